package e2e

import (
	"fmt"
	"path/filepath"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// A window cache's state is framed by its context's KV streams:
// llama_kv_cache::state_write writes a section for each, and state_read
// refuses a state of another count. llama-server has one stream with -np 1
// or a unified cache (its default) and one a slot with -np N, so a swarm
// whose servers run different slot counts holds snapshots of different
// framings. Each restore gets the snapshot framed for its own context:
// Gemma 3's window cache, both ways between one stream and two, through
// patched servers and through proxies before stock ones.
func TestWindowSnapshotAcrossStreamCounts(t *testing.T) {
	model := filepath.Join(testenv.ArchModels(t), "gemma3-dense.gguf")
	su := setupArch(t, model, nil)
	withSlots := func(n int) []string {
		args := slices.Clone(su.args)
		i := slices.Index(args, "-np")
		require.GreaterOrEqual(t, i, 0, "the arguments name no slot count: %v", args)
		args[i+1] = fmt.Sprint(n)
		return args
	}
	ref := testenv.StartLlama(t, "stock", testenv.StockServer(t), su.args)
	etcd := etcdtest.Start(t)
	cfg := fmt.Sprintf(`{"block_tokens": %d, "arbiter": {"policy": "always-restore"}, "directory": {"kind": "etcd", "endpoints": [%q]}, "transport": {"kind": "mooncake", "lib": %q}}`,
		block, etcd.Endpoint(), mockTE)
	patched := func(name string, slots int) string {
		s := testenv.StartLlama(t, name, testenv.PatchedServer(t), append(withSlots(slots), "--mcb-config", cfg))
		require.Equal(t, "on", s.BridgeState())
		return s.URL
	}
	proxied := func(name string, slots int) string {
		dir := testenv.SlotDir(t, name)
		s := testenv.StartLlama(t, name, testenv.StockServer(t), append(withSlots(slots), "--slot-save-path", dir))
		return testenv.StartProxy(t, "proxy-"+name, s.URL, dir, proxyConfig(etcd.Endpoint(), mockTE, "/streams/proxy")).URL
	}
	for _, host := range []struct {
		name  string
		start func(name string, slots int) string
		slot  int // the slot a request names: the proxy picks its own
	}{{"patched", patched, 0}, {"proxy", proxied, -1}} {
		t.Run(host.name, func(t *testing.T) {
			one, two := host.start(host.name+"-one", 1), host.start(host.name+"-two", 2)
			// What the askers' mirrors must hold before each restore: the
			// holders' blocks and snapshots so far, each published as an
			// entry of its own, the snapshots first.
			held := 0
			snapshots := func(url string) int {
				return int(testenv.Metrics(t, url+"/metrics")["mcbridge_snapshots_saved_total"])
			}
			for i, c := range []struct{ name, holder, asker string }{{"one stream to two", one, two}, {"two streams to one", two, one}} {
				t.Run(c.name, func(t *testing.T) {
					prefix := archTokens(su.shared, 7, 3+i)
					before := snapshots(c.holder)
					testenv.Complete(t, c.holder, testenv.Request{Prompt: testenv.Cat(prefix, archTokens(40, 11, 5)), Slot: host.slot, NPredict: nPredict})
					held += su.shared/block + snapshots(c.holder) - before
					waitMirrored(t, c.asker, held)
					req := testenv.Request{Prompt: testenv.Cat(prefix, archTokens(48, 13, 9)), Slot: host.slot, NPredict: nPredict}
					got := testenv.Complete(t, c.asker, req)
					assert.Equal(t, []any{su.shared, ""}, []any{got.MCB.RestoredN, got.MCB.Error},
						"the asker restores the blocks and the snapshot: %+v", got.MCB)
					want := testenv.StockHolding(t, ref.URL, req, max(got.Timings.CacheN, got.MCB.RestoredN), got.Timings.CacheN)
					assert.Equal(t, want.Tokens, got.Tokens, "the answer is stock's (cache_n %d)", got.Timings.CacheN)
				})
			}
		})
	}
}
