// Package metrics writes a bridge's counters in the Prometheus text
// exposition format, for the store node's and the proxy's /metrics.
package metrics

import (
	"fmt"
	"io"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/status"
)

type metric struct {
	name, kind, help string
	value            int64
}

// Write writes b's counters and pool occupancy.
func Write(w io.Writer, b *bridge.Bridge) error {
	s := b.Stats()
	blocks, bytes, poolBytes := b.Resident()
	ms := []metric{
		{"lookups_total", "counter", "Prompts looked up.", s.Lookups},
		{"lookup_hits_total", "counter", "Lookups that matched at least one block.", s.Hits},
		{"lookup_misses_total", "counter", "Lookups that matched nothing.", s.Misses},
		{"decided_restore_total", "counter", "Lookups the arbiter answered with a restore.", s.DecidedRestore},
		{"decided_recompute_total", "counter", "Matched lookups the arbiter sent to recompute.", s.DecidedRecompute},
		{"loads_total", "counter", "Restores started.", s.Loads},
		{"load_failures_total", "counter", "Restores that delivered less than asked.", s.LoadFailures},
		{"restored_tokens_total", "counter", "Tokens restored and verified.", s.RestoredTokens},
		{"restored_bytes_total", "counter", "KV bytes restored and verified.", s.RestoredBytes},
		{"saves_total", "counter", "Saves ended.", s.Saves},
		{"save_failures_total", "counter", "Saves that published nothing.", s.SaveFailures},
		{"saved_blocks_total", "counter", "Blocks this process published.", s.SavedBlocks},
		{"deduped_blocks_total", "counter", "Blocks written but published first by another process.", s.DedupedBlocks},
		{"evictions_total", "counter", "Blocks evicted from the pool.", s.Evictions},
		{"directory_errors_total", "counter", "Directory calls that failed.", s.DirectoryErrors},
		{"torn_reads_total", "counter", "Blocks that changed while read.", s.TornReads},
		{"replicated_blocks_total", "counter", "Blocks a store node copied from their owners.", s.Replicated},
		{"taken_over_blocks_total", "counter", "Copies a store node published after their owner let go.", s.TakenOver},
		{"replication_failures_total", "counter", "Copies that failed to transfer or verify.", s.ReplicationFails},
		{"resident_blocks", "gauge", "Blocks held in the pool.", int64(blocks)},
		{"resident_bytes", "gauge", "Bytes of blocks held in the pool.", bytes},
		{"pool_bytes", "gauge", "Size of the pool.", poolBytes},
	}
	for _, m := range ms {
		if _, err := fmt.Fprintf(w, "# HELP mcbridge_%s %s\n# TYPE mcbridge_%s %s\nmcbridge_%s %d\n",
			m.name, m.help, m.name, m.kind, m.name, m.value); err != nil {
			return err
		}
	}
	if _, err := fmt.Fprintf(w, "# HELP mcbridge_load_failures_by_status_total Failed restores by the status that ended them.\n# TYPE mcbridge_load_failures_by_status_total counter\n"); err != nil {
		return err
	}
	for code, n := range s.FailuresByStatus {
		if n == 0 {
			continue
		}
		if _, err := fmt.Fprintf(w, "mcbridge_load_failures_by_status_total{status=%q} %d\n", status.Code(code).String(), n); err != nil {
			return err
		}
	}
	return nil
}
