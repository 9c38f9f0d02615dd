package e2e

import (
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// BenchmarkStoreTTFT is the time to first token of a prompt whose shared
// prefix another llama-server process computed, restored through Mooncake
// Store, against the same prompt computed by a stock server (without), the
// same prefix restored over the direct Transfer Engine path (the real
// library, through etcd, no store), and the stock server's own slot
// computing only the unshared remainder (local): at 4096 and 8192 shared
// tokens of the bench model, in one run.
//
// Each server restores from a process that holds the blocks: through the
// store, the first (only) replica sits in the computing server's segment
// and the reader, a pure client, reads it over the store's TCP transport.
func BenchmarkStoreTTFT(b *testing.B) {
	const suffix, maxShared = 64, 8192
	model := testenv.Model(b, "bench", 0)
	etcd := etcdtest.Start(b)
	node := testenv.StartStoreNode(b, "node", etcd.Endpoint(), testenv.StoreNodeOptions{})
	args := testenv.BenchServerArgs(model, 2*(maxShared+suffix+256), 2, "on")
	start := func(name, bin, cfg string) *testenv.Llama {
		a := args
		if cfg != "" {
			a = append(append([]string{}, args...), "--mcb-config", cfg)
		}
		s := testenv.StartLlama(b, name, bin, a)
		if cfg != "" {
			require.Equal(b, "on", s.BridgeState(), "%s's bridge", name)
		}
		return s
	}
	storeOpts := testenv.BridgeOptions{BlockTokens: 256, DeadlineMS: 30000}
	storeY := start("store-y", testenv.PatchedServer(b), node.Config(b, storeOpts))
	storeOpts.SegmentBytes = 512 << 20 // the writer holds the replicas of its 8192 tokens (96 MiB)
	storeX := start("store-x", testenv.PatchedServer(b), node.Config(b, storeOpts))
	teCfg := fmt.Sprintf(`{"block_tokens": 256, "transfer_timeout_ms": 30000, "directory": {"kind": "etcd", "endpoints": [%q], "prefix": "/te"}, "transport": {"kind": "mooncake", "lib": %q}}`,
		etcd.Endpoint(), testenv.RealTE(b))
	teX := start("te-x", testenv.PatchedServer(b), teCfg)
	teY := start("te-y", testenv.PatchedServer(b), teCfg)
	stock := start("stock", testenv.StockServer(b), "")

	// One restore on each path before the measured ones: a reader's first read
	// of a segment sets up the engine's connection to it, and a restore that
	// outlasts the arbiter's deadline computes instead, as a server must (a
	// fresh Store build's first read did, 2026-12-06); neither is what this
	// measures.
	for _, pair := range [][2]*testenv.Llama{{storeX, storeY}, {teX, teY}} {
		warm := testenv.Tokens(1024, 5, 1)
		mirrored := func() float64 { return testenv.Metrics(b, pair[1].URL+"/metrics")["mcbridge_mirrored_blocks"] }
		before := mirrored()
		ttft(b, pair[0].URL, warm, 0, nil)
		testenv.Eventually(b, 2*time.Minute, func() bool { return mirrored() >= before+4 }, "%s never saw the warm-up prefix", pair[1].Name)
		ttft(b, pair[1].URL, testenv.Cat(warm, testenv.Tokens(suffix, 3, 1)), 1, nil)
	}
	for i := 0; i < b.N; i++ {
		for _, shared := range []int{4096, 8192} {
			prefix := testenv.Tokens(shared, 7, shared/1024+3+i)
			own := func(mul, off int) []int32 { return testenv.Cat(prefix, testenv.Tokens(suffix, mul, off)) }
			a, pb, pc := own(11, 5), own(13, 9), own(17, 2)
			n := strconv.Itoa(shared)
			restored := func(name string, writer, reader *testenv.Llama) time.Duration {
				mirrored := func() float64 { return testenv.Metrics(b, reader.URL+"/metrics")["mcbridge_mirrored_blocks"] }
				before := mirrored()
				ttft(b, writer.URL, a, 0, nil)
				testenv.Eventually(b, 2*time.Minute, func() bool { return mirrored() >= before+float64(shared/256) },
					"%s never saw the prefix", reader.Name)
				d, c := ttft(b, reader.URL, pb, 1, nil)
				require.Equal(b, []any{"restore", shared}, []any{c.MCB.Decision, c.MCB.RestoredN}, "%s: %+v", name, c.MCB)
				return d
			}
			viaStore := restored("store", storeX, storeY)
			viaTE := restored("te", teX, teY)
			without, _ := ttft(b, stock.URL, pb, 1, nil)
			local, c := ttft(b, stock.URL, pc, 1, nil)
			require.Equal(b, shared, c.Timings.CacheN, "the stock slot kept the prefix")
			b.ReportMetric(ms(without), "ttft-ms-without-"+n)
			b.ReportMetric(ms(viaStore), "ttft-ms-store-"+n)
			b.ReportMetric(ms(viaTE), "ttft-ms-te-"+n)
			b.ReportMetric(ms(local), "ttft-ms-local-"+n)
			b.ReportMetric(float64(without)/float64(viaStore), "x-faster-store-"+n)
			b.ReportMetric(float64(viaStore)/float64(viaTE), "store/te-"+n)
		}
	}
}
