// Package metrics is the one vocabulary of the bridge's Prometheus series.
// The patched llama-server (through mcb_metrics_text), the proxy and the
// store node all write it, so a dashboard or an alert works on any of
// them. docs/metrics.md lists the same series; a test keeps the two equal.
package metrics

import (
	"fmt"
	"io"
	"strings"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/disk"
	"github.com/mcbridge/mcbridge/internal/kvevents"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Prefix starts every series name.
const Prefix = "mcbridge_"

// Series describes one series of the vocabulary.
type Series struct {
	Name, Kind, Help string
	// Label is the label the series is split by, if any.
	Label string
	value func(*snapshot) []sample
}

type sample struct {
	label string
	value int64
}

type diskStats = disk.Stats

type snapshot struct {
	up     error // nil when up
	b      *bridge.Bridge
	s      bridge.Stats
	d      diskStats
	blocks int
	bytes  int64
	pool   int64
}

func one(f func(*snapshot) int64) func(*snapshot) []sample {
	return func(s *snapshot) []sample { return []sample{{value: f(s)}} }
}

func stat(f func(*bridge.Stats) int64) func(*snapshot) []sample {
	return one(func(s *snapshot) int64 { return f(&s.s) })
}

func tier(f func(*diskStats) int64) func(*snapshot) []sample {
	return one(func(s *snapshot) int64 { return f(&s.d) })
}

func events(f func(kvevents.Stats) int64) func(*snapshot) []sample {
	return one(func(s *snapshot) int64 {
		if s.b == nil {
			return 0
		}
		return f(s.b.EventStats())
	})
}

// Vocabulary is every series, in the order they are written.
var Vocabulary = []Series{
	{Name: "up", Kind: "gauge", Label: "reason",
		Help: "1 when the bridge serves the swarm; 0 with the reason when its configuration was refused or its directory is unreachable.",
		value: func(s *snapshot) []sample {
			if s.up == nil {
				return []sample{{value: 1}}
			}
			return []sample{{label: reasonLabel(s.up), value: 0}}
		}},
	{Name: "lookups_total", Kind: "counter", Help: "Prompts looked up.", value: stat(func(s *bridge.Stats) int64 { return s.Lookups })},
	{Name: "lookup_hits_total", Kind: "counter", Help: "Lookups that matched at least one block.", value: stat(func(s *bridge.Stats) int64 { return s.Hits })},
	{Name: "lookup_misses_total", Kind: "counter", Help: "Lookups that matched nothing.", value: stat(func(s *bridge.Stats) int64 { return s.Misses })},
	{Name: "decided_restore_total", Kind: "counter", Help: "Lookups decided to restore: the host restored what they planned.", value: stat(func(s *bridge.Stats) int64 { return s.DecidedRestore })},
	{Name: "decided_recompute_total", Kind: "counter", Help: "Matched lookups decided to recompute: computing was estimated faster.", value: stat(func(s *bridge.Stats) int64 { return s.DecidedRecompute })},
	{Name: "decided_local_total", Kind: "counter", Help: "Matched lookups where the host's own cache held as much, or computing the rest of it was faster.", value: stat(func(s *bridge.Stats) int64 { return s.DecidedLocal })},
	{Name: "loads_total", Kind: "counter", Help: "Restores started.", value: stat(func(s *bridge.Stats) int64 { return s.Loads })},
	{Name: "load_failures_total", Kind: "counter", Help: "Restores that delivered less than planned; the host recomputed the rest.", value: stat(func(s *bridge.Stats) int64 { return s.LoadFailures })},
	{Name: "load_failures_by_status_total", Kind: "counter", Label: "status", Help: "Failed restores by the status that ended them.",
		value: func(s *snapshot) []sample {
			var out []sample
			for code, n := range s.s.FailuresByStatus {
				if n > 0 {
					out = append(out, sample{label: status.Code(code).String(), value: n})
				}
			}
			return out
		}},
	{Name: "restored_tokens_total", Kind: "counter", Help: "Tokens restored and verified.", value: stat(func(s *bridge.Stats) int64 { return s.RestoredTokens })},
	{Name: "restored_bytes_total", Kind: "counter", Help: "KV bytes restored and verified.", value: stat(func(s *bridge.Stats) int64 { return s.RestoredBytes })},
	{Name: "saves_total", Kind: "counter", Help: "Saves ended with their blocks sealed.", value: stat(func(s *bridge.Stats) int64 { return s.Saves })},
	{Name: "save_failures_total", Kind: "counter", Help: "Saves that sealed nothing.", value: stat(func(s *bridge.Stats) int64 { return s.SaveFailures })},
	{Name: "saved_blocks_total", Kind: "counter", Help: "Blocks this process published.", value: stat(func(s *bridge.Stats) int64 { return s.SavedBlocks })},
	{Name: "deduped_blocks_total", Kind: "counter", Help: "Blocks sealed here but published first by another process.", value: stat(func(s *bridge.Stats) int64 { return s.DedupedBlocks })},
	{Name: "snapshots_saved_total", Kind: "counter", Help: "Snapshots of a sliding-window or hybrid memory's partial state stored here (published as blocks of their own).", value: stat(func(s *bridge.Stats) int64 { return s.SnapshotsSaved })},
	{Name: "publish_dropped_total", Kind: "counter", Help: "Sealed blocks the full publish queue could not take (still restorable here).", value: stat(func(s *bridge.Stats) int64 { return s.PublishDropped })},
	{Name: "unpublish_dropped_total", Kind: "counter", Help: "Evicted blocks whose unpublish the full queue could not take (readers refuse them on the generation).", value: stat(func(s *bridge.Stats) int64 { return s.UnpublishDropped })},
	{Name: "publish_queue_blocks", Kind: "gauge", Help: "Blocks waiting for the directory.",
		value: one(func(s *snapshot) int64 {
			if s.b == nil {
				return 0
			}
			puts, _ := s.b.Queued()
			return int64(puts)
		})},
	{Name: "unpublish_queue_blocks", Kind: "gauge", Help: "Evicted blocks waiting to leave the directory.",
		value: one(func(s *snapshot) int64 {
			if s.b == nil {
				return 0
			}
			_, dels := s.b.Queued()
			return int64(dels)
		})},
	{Name: "evictions_total", Kind: "counter", Help: "Blocks evicted from the pool.", value: stat(func(s *bridge.Stats) int64 { return s.Evictions })},
	{Name: "directory_errors_total", Kind: "counter", Help: "Directory calls that failed (publish, unpublish).", value: stat(func(s *bridge.Stats) int64 { return s.DirectoryErrors })},
	{Name: "directory_background_errors_total", Kind: "counter", Label: "kind", Help: "Directory failures no call returned: lease grants and losses, snapshot reads, broken watches, undecodable entries.",
		value: func(s *snapshot) []sample {
			if s.b == nil {
				return nil
			}
			e := s.b.DirectoryErrors()
			return []sample{{"lease", e.Lease}, {"snapshot", e.Snapshot}, {"watch", e.Watch}, {"decode", e.Decode}}
		}},
	{Name: "torn_reads_total", Kind: "counter", Help: "Blocks that changed while read, refused.", value: stat(func(s *bridge.Stats) int64 { return s.TornReads })},
	{Name: "replicated_blocks_total", Kind: "counter", Help: "Blocks a store node copied from their owners.", value: stat(func(s *bridge.Stats) int64 { return s.Replicated })},
	{Name: "taken_over_blocks_total", Kind: "counter", Help: "Copies a store node published after their owner let go.", value: stat(func(s *bridge.Stats) int64 { return s.TakenOver })},
	{Name: "replication_failures_total", Kind: "counter", Help: "Copies that failed to transfer or verify.", value: stat(func(s *bridge.Stats) int64 { return s.ReplicationFails })},
	{Name: "peers_down_total", Kind: "counter", Help: "Times a peer's transfers timed out and lookups planned around its blocks for peer_down_ms.", value: stat(func(s *bridge.Stats) int64 { return s.PeersDown })},
	{Name: "shared_pool_blocks_total", Kind: "counter", Help: "Blocks restored in place from a same-host process's shared pool, with no transfer.", value: stat(func(s *bridge.Stats) int64 { return s.SharedPoolBlocks })},
	{Name: "shared_pools_mapped", Kind: "gauge", Help: "Shared pools of this host's other processes mapped now (a store node maps each as it appears).", value: stat(func(s *bridge.Stats) int64 { return s.SharedPoolsMapped })},
	{Name: "reports_sent_total", Kind: "counter", Help: "Reports sent to blocks' holders (what readers restored, found bad, wanted next).", value: stat(func(s *bridge.Stats) int64 { return s.ReportsSent })},
	{Name: "reports_failed_total", Kind: "counter", Help: "Reports to blocks' holders not delivered: the holder unreachable, or the queue full.", value: stat(func(s *bridge.Stats) int64 { return s.ReportsFailed + s.ReportsDropped })},
	{Name: "reports_unreadable_total", Kind: "counter", Help: "Reports from readers this holder could not read (another version).", value: stat(func(s *bridge.Stats) int64 { return s.ReportsUnreadable })},
	{Name: "peer_uses_total", Kind: "counter", Help: "Restores of this pool's blocks that readers reported; eviction ranks by them.", value: stat(func(s *bridge.Stats) int64 { return s.PeerUses })},
	{Name: "bad_blocks_reported_total", Kind: "counter", Help: "Blocks that failed verification here, reported to their holder.", value: stat(func(s *bridge.Stats) int64 { return s.BadReported })},
	{Name: "bad_block_checks_total", Kind: "counter", Label: "outcome", Help: "This holder's checks of blocks readers reported bad: dropped (bad here too: dropped and unpublished), intact, gone, busy.",
		value: func(s *snapshot) []sample {
			out := make([]sample, len(s.s.BadChecks))
			for i, n := range s.s.BadChecks {
				out[i] = sample{label: bridge.BadOutcomeNames[i], value: n}
			}
			return out
		}},
	{Name: "disk_blocks", Kind: "gauge", Help: "Blocks in the store node's disk tier.", value: tier(func(d *diskStats) int64 { return d.Files })},
	{Name: "disk_bytes", Kind: "gauge", Help: "Bytes of the disk tier's files.", value: tier(func(d *diskStats) int64 { return d.Bytes })},
	{Name: "disk_budget_bytes", Kind: "gauge", Help: "The disk tier's budget (lowered to what fits when the filesystem fills).", value: tier(func(d *diskStats) int64 { return d.Budget })},
	{Name: "disk_written_total", Kind: "counter", Help: "Blocks written to the disk tier.", value: tier(func(d *diskStats) int64 { return d.Written })},
	{Name: "disk_write_errors_total", Kind: "counter", Help: "Blocks the disk tier could not write (disk full, directory not writable); they stay in memory only.", value: tier(func(d *diskStats) int64 { return d.WriteErrors })},
	{Name: "disk_read_total", Kind: "counter", Help: "Blocks read back from the disk tier into the pool, verified.", value: tier(func(d *diskStats) int64 { return d.Read })},
	{Name: "disk_dropped_total", Kind: "counter", Help: "Disk tier files deleted because they were torn, truncated or changed: never served.", value: tier(func(d *diskStats) int64 { return d.Dropped })},
	{Name: "disk_evicted_total", Kind: "counter", Help: "Disk tier files deleted to stay within the budget.", value: tier(func(d *diskStats) int64 { return d.Evicted })},
	{Name: "kv_events_published_total", Kind: "counter", Help: "Block events handed to the KV events socket (a BlockStored of n blocks counts n).",
		value: events(func(s kvevents.Stats) int64 { return s.Published })},
	{Name: "kv_events_dropped_total", Kind: "counter", Help: "Block events the full KV events queue dropped; the publisher then sent its whole state again.",
		value: events(func(s kvevents.Stats) int64 { return s.Dropped })},
	{Name: "kv_event_replays_total", Kind: "counter", Help: "KV events replay requests answered.",
		value: events(func(s kvevents.Stats) int64 { return s.Replays })},
	{Name: "store_put_blocks_total", Kind: "counter", Help: "Blocks written into Mooncake Store.", value: stat(func(s *bridge.Stats) int64 { return s.StorePuts })},
	{Name: "store_put_failures_total", Kind: "counter", Help: "Blocks Mooncake Store refused (full, master unreachable); they stay in the pool, pending.", value: stat(func(s *bridge.Stats) int64 { return s.StorePutFailures })},
	{Name: "store_get_blocks_total", Kind: "counter", Help: "Blocks read from Mooncake Store for restores.", value: stat(func(s *bridge.Stats) int64 { return s.StoreGets })},
	{Name: "store_adopted_blocks_total", Kind: "counter", Help: "Store entries this process published again after their owner's left the directory.", value: stat(func(s *bridge.Stats) int64 { return s.StoreAdopted })},
	{Name: "store_dropped_blocks_total", Kind: "counter", Help: "Store entries dropped because Mooncake Store no longer held their blocks.", value: stat(func(s *bridge.Stats) int64 { return s.StoreDropped })},
	{Name: "resident_blocks", Kind: "gauge", Help: "Blocks held in this process's pool.", value: one(func(s *snapshot) int64 { return int64(s.blocks) })},
	{Name: "resident_bytes", Kind: "gauge", Help: "Bytes of the blocks held in this process's pool.", value: one(func(s *snapshot) int64 { return s.bytes })},
	{Name: "pool_bytes", Kind: "gauge", Help: "Size of this process's pool.", value: one(func(s *snapshot) int64 { return s.pool })},
	{Name: "mirrored_blocks", Kind: "gauge", Help: "Blocks of the swarm this process's directory mirror knows, for its models.",
		value: one(func(s *snapshot) int64 {
			if s.b == nil {
				return 0
			}
			return int64(s.b.Mirrored())
		})},
}

// Write writes the vocabulary for b. b may be nil (the bridge is off):
// then every counter is 0 and mcbridge_up says why, from off.
func Write(w io.Writer, b *bridge.Bridge, off error) error {
	s := &snapshot{b: b, up: off}
	if b != nil {
		s.s = b.Stats()
		s.d = b.DiskStats()
		s.blocks, s.bytes, s.pool = b.Resident()
		if s.up == nil {
			s.up = b.Health()
		}
	} else if s.up == nil {
		s.up = status.Errorf(status.State, "the bridge is not open")
	}
	var sb strings.Builder
	for _, m := range Vocabulary {
		fmt.Fprintf(&sb, "# HELP %s%s %s\n# TYPE %s%s %s\n", Prefix, m.Name, m.Help, Prefix, m.Name, m.Kind)
		for _, x := range m.value(s) {
			if m.Label != "" && x.label != "" {
				fmt.Fprintf(&sb, "%s%s{%s=%q} %d\n", Prefix, m.Name, m.Label, x.label, x.value)
			} else {
				fmt.Fprintf(&sb, "%s%s %d\n", Prefix, m.Name, x.value)
			}
		}
	}
	_, err := io.WriteString(w, sb.String())
	return err
}

// reasonLabel makes an error message a label value: one line, bounded.
func reasonLabel(err error) string {
	msg := strings.Join(strings.Fields(err.Error()), " ")
	if len(msg) > 240 {
		msg = msg[:240] + "..."
	}
	return msg
}
