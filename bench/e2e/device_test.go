package e2e

import (
	"fmt"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/gguf"
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
		return append(append(testenv.BenchServerArgs(model, 8192, 2, "on"), onDevice(b, name)...), extra...)
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
	hostArgs := append(testenv.BenchServerArgs(model, 8192, 2, "on"), "--mcb-config", cfg)
	host := testenv.StartLlama(b, "host", testenv.PatchedServer(b), hostArgs)
	hostHolder := testenv.StartLlama(b, "host-holder", testenv.PatchedServer(b), hostArgs)
	mirrored := func(url string) int { return int(testenv.Metrics(b, url+"/metrics")["mcbridge_mirrored_blocks"]) }

	var stockMS, restoredMS, slotMS, restoreGBs, slotGBs, hostGBs []float64
	var devSaveMS, hostSaveMS, devPromptMS []float64
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
		dev := holder.Complete(b, testenv.Request{Prompt: first, Slot: 0, NPredict: 1})
		savedDev := dev.MCB.SavedBlocks
		savedHost := hostHolder.Complete(b, testenv.Request{Prompt: first, Slot: 0, NPredict: 1}).MCB.SavedBlocks
		// The same save from host KV needs blocks nobody saved yet (the
		// prefix's are the device holder's): a prompt of the same length.
		fresh := hostHolder.Complete(b, testenv.Request{Prompt: testenv.Tokens(len(first), 29+2*r, 5*r+1), Slot: 1, NPredict: 1})
		require.Equal(b, savedDev, fresh.MCB.SavedBlocks, "the host holder saves as many new blocks as the device holder")
		devSaveMS, hostSaveMS = append(devSaveMS, dev.MCB.SaveMS), append(hostSaveMS, fresh.MCB.SaveMS)
		devPromptMS = append(devPromptMS, dev.Timings.PromptMS)
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
	// What a save costs the loop (it runs before the next batch): from
	// device KV, the downloads too.
	b.ReportMetric(medianF(devSaveMS), "device_save_ms")
	b.ReportMetric(medianF(hostSaveMS), "host_save_ms")
	b.ReportMetric(medianF(devPromptMS), "device_prompt_ms")
}

// BenchmarkDeviceStall measures the layer-wise pipeline of a restore into
// device KV at link speeds. The readers' mock engines carry every transfer
// as one link of 1, 10 or 25 GB/s (MOCK_TE_LINK_MBPS; "unshaped": the
// mock's same-host copy), and at each speed two readers restore the same
// 4096-token prefix from one holder: one into KV on the device, one into
// host KV, where the rows land in the cells in place. Both move the same
// bytes over the same link and verify them; the device restore also
// uploads each layer once it is verified, overlapping the later layers'
// transfer. What it takes beyond the host restore is the upload the
// pipeline did not hide, reported in layers of the link's time for one
// layer. Where the device's upload is slower than the link (the RPC device
// is a TCP socket), the upload bounds the restore; the report judges the
// stall beyond the slower stage (docs/design.md §15). The unshaped row
// shows the device restore with the link out of the way.
// Medians of interleaved rounds.
//
//	go test -run '^$' -bench DeviceStall -benchtime 1x ./bench/e2e
func BenchmarkDeviceStall(b *testing.B) {
	shared, rounds, links := 4096, 3, []int{0, 1, 10, 25}
	if os.Getenv("MCB_BENCH_QUICK") != "" {
		shared, rounds, links = 1024, 1, []int{0, 10}
	}
	const own = 64
	preset := gguf.Presets["bench"]
	model := testenv.Model(b, "bench", 0)
	etcd := etcdtest.Start(b)
	cfg := fmt.Sprintf(`{"block_tokens": 256, "arbiter": {"policy": "always-restore"}, "directory": {"kind": "etcd", "endpoints": [%q]}, "transport": {"kind": "mooncake", "lib": %q}}`,
		etcd.Endpoint(), mockTE)
	hostArgs := append(testenv.BenchServerArgs(model, 8192, 1, "on"), "--mcb-config", cfg)
	holder := testenv.StartLlama(b, "holder", testenv.PatchedServer(b), hostArgs)
	type reader struct {
		link       int
		device     *testenv.Llama
		host       *testenv.Llama
		devMS, hMS []float64
		bytes      int64
	}
	var readers []*reader
	for _, gbps := range links {
		var env []string
		if gbps > 0 {
			env = []string{fmt.Sprintf("MOCK_TE_LINK_MBPS=%d", gbps*1000)}
		}
		name := fmt.Sprintf("link%d", gbps)
		readers = append(readers, &reader{
			link:   gbps,
			device: testenv.StartLlama(b, name+"-device", testenv.PatchedServer(b), append(slices.Clone(hostArgs), onDevice(b, name)...), env...),
			host:   testenv.StartLlama(b, name+"-host", testenv.PatchedServer(b), hostArgs, env...),
		})
	}
	mirrored := func(url string) int { return int(testenv.Metrics(b, url+"/metrics")["mcbridge_mirrored_blocks"]) }
	// Round 0 warms up: a reader's first restore from the holder opens its
	// segment (a connection and a handshake), which no later one pays.
	for r := 0; r <= rounds; r++ {
		restore := func(l *testenv.Llama, prompt []int32, into *[]float64) (int64, []int32) {
			_, c := ttft(b, l.URL, prompt, 0, nil)
			require.Equal(b, shared, c.MCB.RestoredN, "%s restores the prefix: %+v", l.Name, c.Timings)
			if r > 0 {
				*into = append(*into, c.MCB.RestoreMS)
			}
			return c.MCB.RestoredBytes, c.Tokens
		}
		// A prefix of its own each round: no reader's slot holds it.
		prefix := testenv.Tokens(shared, 3+2*r, 17*r+5)
		had := make([][2]int, len(readers))
		for i, rd := range readers {
			had[i] = [2]int{mirrored(rd.device.URL), mirrored(rd.host.URL)}
		}
		saved := holder.Complete(b, testenv.Request{Prompt: testenv.Cat(prefix, testenv.Tokens(own, 5, r)), NPredict: 1}).MCB.SavedBlocks
		prompt := testenv.Cat(prefix, testenv.Tokens(own, 13, r+1))
		var answer []int32
		for i, rd := range readers {
			waitMirroredBlocks(b, rd.device.URL, had[i][0]+saved)
			waitMirroredBlocks(b, rd.host.URL, had[i][1]+saved)
			// Interleaved, the order turned each round: load drifts
			// onto neither side.
			first, second, firstMS, secondMS := rd.device, rd.host, &rd.devMS, &rd.hMS
			if r%2 == 1 {
				first, second, firstMS, secondMS = rd.host, rd.device, &rd.hMS, &rd.devMS
			}
			n1, t1 := restore(first, prompt, firstMS)
			n2, t2 := restore(second, prompt, secondMS)
			require.Equal(b, n1, n2, "the same prefix's KV has the same size on the device and the host")
			require.Equal(b, t1, t2, "the device and the host reader answer alike")
			if answer == nil {
				answer = t1
			}
			require.Equal(b, answer, t1, "every reader answers alike")
			rd.bytes = n1
		}
	}
	for _, rd := range readers {
		dev, host := medianF(rd.devMS), medianF(rd.hMS)
		label := "unshaped"
		if rd.link > 0 {
			label = fmt.Sprintf("%dGBps", rd.link)
			layerMS := float64(rd.bytes) / float64(preset.BlockCount) / (float64(rd.link) * 1e9) * 1e3
			b.ReportMetric(layerMS, "layer_ms-"+label)
			b.ReportMetric((dev-host)/layerMS, "stall_layers-"+label)
		}
		b.ReportMetric(dev, "device_restore_ms-"+label)
		b.ReportMetric(host, "host_restore_ms-"+label)
		b.ReportMetric(float64(rd.bytes)/dev/1e6, "device_GB/s-"+label)
	}
	b.ReportMetric(float64(preset.BlockCount), "layers")
	b.ReportMetric(float64(readers[0].bytes), "prefix_bytes")
}
