package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// BenchmarkMemoryKinds is restore against recompute for the memory kinds
// beyond plain attention (docs/design.md §5.9), at shared prefixes of 4k
// and 8k tokens plus 64 of the request's own, each kind beside a plain
// model of the same size in the same run: test-llama-archs' random models
// of Llama, Gemma 3 and Qwen3.5 at the bench model's size (12 layers of
// n_embd 768 in 2 heads; scripts/llama/archs.sh bench): Gemma 3 windows
// every other layer by 1024 tokens (the test's layer pattern), Qwen3.5
// alternates gated delta-net and attention layers. Their training context
// is raised to 16k.
//
//   - stock: a stock llama-server computes the whole prompt
//     (cache_prompt false, so every round computes it);
//   - restore: a patched server restores what another patched process
//     computed (etcd, the mock Transfer Engine): the blocks of the attention
//     layers, and for a sliding-window or hybrid memory the snapshot of its
//     partial state at the prefix's end;
//   - proxy: mcbridge proxy before a stock server restores what another
//     proxy's stock server computed, snapshots taken by the prompt's stops
//     at each boundary (docs/proxy.md).
//
// TTFT medians of interleaved rounds, the askers' slots erased between
// them. The holders' cost is measured too: each round both holders (a
// patched server, a proxy) compute a prefix of their own from nothing, the
// patched server saving its blocks and snapshots as it goes, the proxy
// sending its snapshot prompts and saving the slot at each boundary, and
// their TTFT is set against stock's computing the same prompt in the same
// round into the same slot, the three in another order each round (the
// 0%-hit overhead of docs/design.md §15, for these memories: the median of
// the rounds' ratios, of TTFT and of the processor time the holder's
// processes used, which the rest of the machine disturbs less than the
// clock); the last round's prefix is the one the askers restore. Results
// go to $MCB_BENCH_OUT/kinds.json
// (bench/out).
func BenchmarkMemoryKinds(b *testing.B) {
	prefixes, rounds := []int{4096, 8192}, 3
	if os.Getenv("MCB_BENCH_QUICK") != "" {
		prefixes, rounds = []int{2048}, 2
	}
	kinds := []struct{ kind, model, arch string }{
		{"plain", "llama-dense", "llama"},
		{"sliding-window", "gemma3-dense", "gemma3"},
		{"hybrid", "qwen35-dense", "qwen35"},
	}
	for i := 0; i < b.N; i++ {
		res := kindsResult{Date: time.Now().UTC().Format(time.RFC3339), Suffix: ttftSuffix}
		etcd := etcdtest.Start(b)
		for _, k := range kinds {
			for _, p := range prefixes {
				row := memoryKindRow(b, etcd.Endpoint(), k.model, k.arch, p, rounds)
				row.Kind = k.kind
				res.Rows = append(res.Rows, row)
				b.ReportMetric(row.Cut, fmt.Sprintf("cut-%s-%d", k.kind, p))
				b.ReportMetric(row.ProxyCut, fmt.Sprintf("proxycut-%s-%d", k.kind, p))
				b.ReportMetric(row.HolderCost, fmt.Sprintf("holdercost-%s-%d", k.kind, p))
				b.ReportMetric(row.ProxyHolderCost, fmt.Sprintf("proxyholdercost-%s-%d", k.kind, p))
				b.ReportMetric(row.HolderCPUCost, fmt.Sprintf("holdercpu-%s-%d", k.kind, p))
				b.ReportMetric(row.ProxyHolderCPUCost, fmt.Sprintf("proxyholdercpu-%s-%d", k.kind, p))
				b.Logf("%s (%s), %d shared: stock %.1f ms, restore %.1f ms (%d tokens, %s): cut %.2fx, proxy %.1f ms (%d tokens): cut %.2fx, first token as stock: %v",
					k.kind, k.model, p, row.StockMS, row.RestoreTTFTms, row.RestoredN, row.Decision, row.Cut,
					row.ProxyTTFTms, row.ProxyRestoredN, row.ProxyCut, row.SameAsStock)
				b.Logf("%s (%s), %d shared, holders computing and saving: patched %.1f ms (%.3fx stock, processor %.3fx, %d snapshots), proxy %.1f ms (%.3fx stock, processor %.3fx, %.0f snapshot prompts)",
					k.kind, k.model, p, row.HolderTTFTms, row.HolderCost, row.HolderCPUCost, row.Snapshots, row.ProxyHolderTTFTms, row.ProxyHolderCost, row.ProxyHolderCPUCost, row.ProxySnapshots)
			}
		}
		b.Logf("wrote %s", testenv.WriteBenchOut(b, "kinds.json", res))
	}
}

type kindsResult struct {
	Date   string    `json:"date"`
	Suffix int       `json:"own_tokens"`
	Rows   []kindRow `json:"rows"`
}

type kindRow struct {
	Kind          string    `json:"kind"`
	Model         string    `json:"model"`
	SharedTokens  int       `json:"shared_tokens"`
	StockMS       float64   `json:"stock_ttft_ms"`
	StockRounds   []float64 `json:"stock_ttft_ms_rounds"`
	RestoreTTFTms float64   `json:"restore_ttft_ms"`
	RestoreRounds []float64 `json:"restore_ttft_ms_rounds"`
	RestoreMS     float64   `json:"restore_ms"` // the restore's own time, median round
	RestoredN     int       `json:"restored_tokens"`
	RestoredBytes int64     `json:"restored_bytes"`
	Snapshots     int       `json:"holder_snapshots"` // the patched holder's, of one prefix
	Decision      string    `json:"decision"`
	Cut           float64   `json:"cut"` // stock TTFT over the restore's
	// The proxy's: TTFT, the tokens it restored, and the holder proxy's
	// prompts stopped at a snapshot boundary, for one prefix.
	ProxyTTFTms    float64   `json:"proxy_ttft_ms"`
	ProxyRounds    []float64 `json:"proxy_ttft_ms_rounds"`
	ProxyRestoredN int       `json:"proxy_restored_tokens"`
	ProxyCut       float64   `json:"proxy_cut"`
	ProxySnapshots float64   `json:"proxy_snapshot_prompts"`
	SameAsStock    bool      `json:"first_token_as_stock"` // every round, both hosts
	// The holders' TTFT computing and saving a prefix nobody holds, stock's
	// computing the same prompt in the same round, and the median of the
	// rounds' ratios of the two (1: no cost).
	HolderStockRounds []float64 `json:"holder_stock_ttft_ms_rounds"`
	HolderTTFTms      float64   `json:"holder_ttft_ms"`
	HolderRounds      []float64 `json:"holder_ttft_ms_rounds"`
	HolderCost        float64   `json:"holder_cost"`
	ProxyHolderTTFTms float64   `json:"proxy_holder_ttft_ms"`
	ProxyHolderRounds []float64 `json:"proxy_holder_ttft_ms_rounds"`
	ProxyHolderCost   float64   `json:"proxy_holder_cost"`
	// The same as processor time: the holder's (the proxy's and its stock
	// server's) over stock's, the median of the rounds' ratios.
	HolderCPUCost      float64 `json:"holder_cpu_cost"`
	ProxyHolderCPUCost float64 `json:"proxy_holder_cpu_cost"`
}

// kindTokens is n ids of the random models' 128-token vocabulary.
func kindTokens(n, mul, off int) []int32 {
	t := make([]int32, n)
	for i := range t {
		t[i] = int32((i*mul + off) % 128)
	}
	return t
}

func memoryKindRow(b *testing.B, etcd, name, arch string, p, rounds int) kindRow {
	model := filepath.Join(testenv.ArchBenchModels(b), name+".gguf")
	ctx := p + ttftSuffix + 256
	args := append(testenv.BenchServerArgs(model, 2*ctx, 2, "on"), "--override-kv", arch+".context_length=int:16384")
	cfg := func(host string) string {
		return fmt.Sprintf(`{"block_tokens": 256, "pool_bytes": %d, "arbiter": {"policy": "always-restore"}, "directory": {"kind": "etcd", "endpoints": [%q], "prefix": "/kinds/%s/%s/%d"}, "transport": {"kind": "mooncake", "lib": %q}}`,
			int64(2)<<30, etcd, host, name, p, mockTE)
	}
	stock := testenv.StartLlama(b, "stock", testenv.StockServer(b), args)
	patched := func(n string) *testenv.Llama {
		return testenv.StartLlama(b, n, testenv.PatchedServer(b), append(slices.Clone(args), "--mcb-config", cfg("patched"), "--slot-save-path", testenv.SlotDir(b, n)+"/"))
	}
	x, y := patched("x"), patched("y")
	var proxies [2]*testenv.Proxy
	var proxied [2]*testenv.Llama // the stock servers behind them
	servers := []*testenv.Llama{stock, x, y}
	for i := range proxies {
		dir := testenv.SlotDir(b, fmt.Sprint("s", i))
		proxied[i] = testenv.StartLlama(b, fmt.Sprint("s", i), testenv.StockServer(b), append(slices.Clone(args), "--slot-save-path", dir+"/"))
		proxies[i] = testenv.StartProxy(b, fmt.Sprint("p", i), proxied[i].URL, dir, cfg("proxy"))
		servers = append(servers, proxied[i])
	}
	defer func() {
		for _, p := range proxies {
			p.Stop()
		}
		for _, s := range servers {
			s.Stop()
		}
	}()
	own := kindTokens(ttftSuffix, 11, 5)
	row := kindRow{Model: name, SharedTokens: p}
	// The holders' rounds, each on a prefix of its own (the pools hold all
	// of them), the shared prefix last. Each round ends when the askers'
	// mirrors know its blocks and snapshots: the holders' saves and
	// publishing, which follow the answer, are over before the next
	// measurement.
	snapshotPrompts := func() float64 {
		return testenv.Metrics(b, proxies[0].URL+"/metrics")["mcproxy_snapshot_prompts_total"]
	}
	// Each server's first decode (the model's pages, the graphs) on a short
	// prompt of its own, before anything is timed.
	for _, u := range []string{stock.URL, x.URL, proxies[0].URL} {
		testenv.Complete(b, u, testenv.Request{Prompt: kindTokens(16, 5, 100), Slot: -1, NPredict: 1})
	}
	patchedHeld, proxyHeld := 0, 0
	var holderCost, proxyHolderCost, holderCPU, proxyHolderCPU []float64
	for r := rounds - 1; r >= 0; r-- {
		computing := testenv.Cat(kindTokens(p, 7, 3+r), own)
		// Each holder against stock computing the same prompt into the
		// same slot, each round in another order, so that what drifts
		// between requests weighs on all three.
		var stockTTFT, patchedTTFT, proxyTTFT time.Duration
		var stockCPU, patchedCPU, proxyCPU float64
		measure := []func(){
			func() {
				stockCPU = cpuOf(b, func() { stockTTFT, _ = ttft(b, stock.URL, computing, 0, map[string]any{"cache_prompt": false}) }, stock.Pid())
			},
			func() {
				var held testenv.Completion
				patchedCPU = cpuOf(b, func() { patchedTTFT, held = ttft(b, x.URL, computing, 0, nil) }, x.Pid())
				row.Snapshots = held.MCB.Snapshots
				patchedHeld += p/256 + held.MCB.Snapshots
				waitMirroredBlocks(b, y.URL, patchedHeld)
			},
			func() {
				before := snapshotPrompts()
				proxyCPU = cpuOf(b, func() { proxyTTFT, _ = ttft(b, proxies[0].URL, computing, -1, nil) }, proxied[0].Pid(), proxies[0].Pid())
				row.ProxySnapshots = snapshotPrompts() - before
				proxyHeld += p/256 + int(row.ProxySnapshots)
				waitMirroredBlocks(b, proxies[1].URL, proxyHeld)
			},
		}
		for i := range measure {
			settle()
			measure[(i+r)%len(measure)]()
		}
		row.HolderStockRounds = append(row.HolderStockRounds, ms(stockTTFT))
		row.HolderRounds = append(row.HolderRounds, ms(patchedTTFT))
		row.ProxyHolderRounds = append(row.ProxyHolderRounds, ms(proxyTTFT))
		holderCost = append(holderCost, ms(patchedTTFT)/ms(stockTTFT))
		proxyHolderCost = append(proxyHolderCost, ms(proxyTTFT)/ms(stockTTFT))
		holderCPU = append(holderCPU, patchedCPU/stockCPU)
		proxyHolderCPU = append(proxyHolderCPU, proxyCPU/stockCPU)
	}

	measured := testenv.Cat(kindTokens(p, 7, 3), kindTokens(ttftSuffix, 13, 9))
	var restoreMS []float64
	row.SameAsStock = true
	for r := range rounds {
		if r > 0 {
			testenv.Post(b, y.URL+"/slots/1?action=erase", map[string]any{}, nil)
			for slot := range 2 {
				testenv.Post(b, fmt.Sprintf("%s/slots/%d?action=erase", proxies[1].URL, slot), map[string]any{}, nil)
			}
		}
		settle()
		d, want := ttft(b, stock.URL, measured, 1, map[string]any{"cache_prompt": false})
		row.StockRounds = append(row.StockRounds, ms(d))
		settle()
		d, c := ttft(b, y.URL, measured, 1, nil)
		row.RestoreRounds = append(row.RestoreRounds, ms(d))
		restoreMS = append(restoreMS, c.MCB.RestoreMS)
		row.RestoredN, row.RestoredBytes, row.Decision = c.MCB.RestoredN, c.MCB.RestoredBytes, c.MCB.Decision
		row.SameAsStock = row.SameAsStock && slices.Equal(c.Tokens, want.Tokens)
		settle()
		d, c = ttft(b, proxies[1].URL, measured, -1, nil)
		row.ProxyRounds = append(row.ProxyRounds, ms(d))
		row.ProxyRestoredN = c.MCB.RestoredN
		row.SameAsStock = row.SameAsStock && slices.Equal(c.Tokens, want.Tokens)
	}
	row.StockMS, row.RestoreTTFTms, row.RestoreMS = medianF(row.StockRounds), medianF(row.RestoreRounds), medianF(restoreMS)
	row.ProxyTTFTms = medianF(row.ProxyRounds)
	row.Cut, row.ProxyCut = row.StockMS/row.RestoreTTFTms, row.StockMS/row.ProxyTTFTms
	row.HolderTTFTms, row.ProxyHolderTTFTms = medianF(row.HolderRounds), medianF(row.ProxyHolderRounds)
	row.HolderCost, row.ProxyHolderCost = medianF(holderCost), medianF(proxyHolderCost)
	row.HolderCPUCost, row.ProxyHolderCPUCost = medianF(holderCPU), medianF(proxyHolderCPU)
	return row
}

// cpuOf runs request and returns the processor time that the processes
// pids used meanwhile.
func cpuOf(b *testing.B, request func(), pids ...int) float64 {
	cpu := func() float64 {
		var s float64
		for _, pid := range pids {
			s += cpuSeconds(b, pid)
		}
		return s
	}
	before := cpu()
	request()
	return cpu() - before
}
