package e2e

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// BenchmarkDeviceRestore measures restores into KV on a device (onDevice:
// ggml's RPC backend, or a CUDA GPU in a -tags gpu build; -ngl 99), in one
// run against two baselines on the same device: a stock server computing
// the prompt, and llama-server's own slot restore of the same prefix, which
// writes the same bytes with the backend's tensor_set. The RPC device is a
// TCP socket to another process, so there only the ratios mean anything.
//
//	go test -run '^$' -bench DeviceRestore -benchtime 1x ./bench/e2e
func BenchmarkDeviceRestore(b *testing.B) {
	const shared, own, rounds = 1024, 64, 3
	model := testenv.Model(b, "bench", 0)
	etcd := etcdtest.Start(b)
	cfg := fmt.Sprintf(`{"block_tokens": 256, "arbiter": {"policy": "always-restore"}, "directory": {"kind": "etcd", "endpoints": [%q]}, "transport": {"kind": "mooncake", "lib": %q}}`,
		etcd.Endpoint(), mockTE)
	args := func(name string, extra ...string) []string {
		return append(append(testenv.ServerArgs(model, 8192, 2, "on"), onDevice(b, name)...), extra...)
	}
	dir := testenv.SlotDir(b, "stock")
	stock := testenv.StartLlama(b, "stock", testenv.StockServer(b), args("stock", "--slot-save-path", dir))
	holder := testenv.StartLlama(b, "holder", testenv.PatchedServer(b), args("holder", "--mcb-config", cfg))
	reader := testenv.StartLlama(b, "reader", testenv.PatchedServer(b), args("reader", "--mcb-config", cfg))
	require.Equal(b, "on", reader.BridgeState())
	// The same restore into host KV: the bridge's own part of the restore.
	// Its holder computes the prefix on the host: where the device's KV
	// bytes are the host's (the RPC device; the probe decides), its blocks
	// are the device holder's, already known.
	hostArgs := append(testenv.ServerArgs(model, 8192, 2, "on"), "--mcb-config", cfg)
	host := testenv.StartLlama(b, "host", testenv.PatchedServer(b), hostArgs)
	hostHolder := testenv.StartLlama(b, "host-holder", testenv.PatchedServer(b), hostArgs)
	mirrored := func(url string) int { return int(testenv.Metrics(b, url+"/metrics")["mcbridge_mirrored_blocks"]) }

	var stockMS, restoredMS, slotMS, restoreGBs, slotGBs, hostGBs []float64
	same := true
	for r := 0; r < rounds; r++ {
		prefix := testenv.Tokens(shared, 7+2*r, 11*r+3)
		first := testenv.Cat(prefix, testenv.Tokens(own, 5, r))
		prompt := testenv.Cat(prefix, testenv.Tokens(own, 13, r+1))

		// Stock, nothing cached: the prompt computed on the device.
		d, want := ttft(b, stock.URL, prompt, 0, map[string]any{"cache_prompt": false})
		stockMS = append(stockMS, ms(d))

		// The holder computes the prefix; the reader restores it.
		readerHad, hostHad := mirrored(reader.URL), mirrored(host.URL)
		savedDev := holder.Complete(b, testenv.Request{Prompt: first, Slot: 0, NPredict: 1}).MCB.SavedBlocks
		savedHost := hostHolder.Complete(b, testenv.Request{Prompt: first, Slot: 0, NPredict: 1}).MCB.SavedBlocks
		waitMirroredBlocks(b, reader.URL, readerHad+savedDev)
		waitMirroredBlocks(b, host.URL, hostHad+savedDev+savedHost)
		d, got := ttft(b, reader.URL, prompt, r%2, nil)
		require.Equal(b, shared, got.MCB.RestoredN, "round %d: the reader restores the prefix: %+v", r, got.Timings)
		same = same && slices.Equal(got.Tokens, want.Tokens)
		restoredMS = append(restoredMS, ms(d))
		restoreGBs = append(restoreGBs, float64(got.MCB.RestoredBytes)/got.MCB.RestoreMS/1e6)
		_, h := ttft(b, host.URL, prompt, r%2, nil)
		require.Equal(b, shared, h.MCB.RestoredN, "round %d: the host-KV server restores the prefix: %+v", r, h.Timings)
		hostGBs = append(hostGBs, float64(h.MCB.RestoredBytes)/h.MCB.RestoreMS/1e6)

		// Stock's slot API: compute the prefix in slot 0, save it, restore it
		// into slot 1 and send the prompt there.
		testenv.Complete(b, stock.URL, testenv.Request{Prompt: first, Slot: 0, NPredict: 1})
		var saved struct {
			Written int64 `json:"n_written"`
		}
		testenv.Post(b, stock.URL+"/slots/0?action=save", map[string]string{"filename": "device.bin"}, &saved)
		var restored struct {
			Timings struct {
				RestoreMS float64 `json:"restore_ms"`
			} `json:"timings"`
		}
		t0 := time.Now()
		testenv.Post(b, stock.URL+"/slots/1?action=restore", map[string]string{"filename": "device.bin"}, &restored)
		wall := time.Since(t0)
		d, c := ttft(b, stock.URL, prompt, 1, nil)
		require.GreaterOrEqual(b, c.Timings.CacheN, shared, "the slot restore's prefix is reused: %+v", c.Timings)
		slotMS = append(slotMS, ms(wall+d))
		// The slot file holds the whole first prompt's KV; its per-token
		// bytes equal the bridge's.
		slotGBs = append(slotGBs, float64(saved.Written)*float64(shared)/float64(len(first))/restored.Timings.RestoreMS/1e6)
	}
	require.True(b, same, "the restored prompts answer as stock")
	b.ReportMetric(medianF(stockMS), "stock_ttft_ms")
	b.ReportMetric(medianF(restoredMS), "restored_ttft_ms")
	b.ReportMetric(medianF(slotMS), "slot_ttft_ms")
	b.ReportMetric(medianF(stockMS)/medianF(restoredMS), "ttft_cut_x")
	b.ReportMetric(medianF(slotMS)/medianF(restoredMS), "vs_slot_ttft_x")
	b.ReportMetric(medianF(restoreGBs), "restore_GB/s")
	b.ReportMetric(medianF(slotGBs), "slot_restore_GB/s")
	b.ReportMetric(medianF(restoreGBs)/medianF(slotGBs), "restore_vs_tensor_set_x")
	b.ReportMetric(medianF(hostGBs), "host_kv_restore_GB/s")
}
