package e2e

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/testenv"
)

// BenchmarkUbatchAlignment measures what docs/design.md §10.1 decides:
// whether restores should end on a multiple of n_ubatch. llama-server on
// the CPU is not guaranteed batch-invariant; a restore that ends on a
// ubatch boundary makes the rest of the prompt fall in the ubatches a
// fresh computation uses, one that ends elsewhere does not.
//
// Two patched servers (-ub 512, two slots, always-restore) differ only in
// block_tokens: 64 (restores end on a block) and 512 (= n_ubatch: every
// restore ends on a ubatch boundary, which is what aligning restores down
// to n_ubatch gives). For each shared-prefix length, on each server, slot
// 0 computes prefix+A and slot 1 answers prefix+B from the blocks slot 0
// published; a stock server answers prefix+B fresh. Each prefix is new
// to both servers, so every answer restores. It reports, per length and
// over all: the tokens each restores (what aligning loses), TTFT (the
// request's wall time less its decode after the first token), how many
// answers equal the fresh one, and how many equal the stock server's from
// as many cached tokens (testenv.StockFrom: what the e2e tests compare
// with).
//
// One sub-benchmark a model preset: -bench 'UbatchAlignment/tiny' for the
// quick one.
func BenchmarkUbatchAlignment(b *testing.B) {
	for _, p := range []struct {
		preset  string
		trials  int   // prefixes of each length
		lengths []int // shared-prefix lengths
	}{{"tiny", 4, alignLengths}, {"bench", 1, []int{640, 896, 1152, 1536}}} {
		b.Run(p.preset, func(b *testing.B) { ubatchAlignment(b, p.preset, p.trials, p.lengths) })
	}
}

const (
	alignUbatch  = 512
	alignTail    = 40 // tokens of each request's own
	alignPredict = 16
)

// alignLengths are the shared prefixes: every residue of 512 in steps of
// 128 (and two multiples of 512), so that block-aligned restores end
// anywhere in a ubatch. The bench model measures a few of them: its
// prefill is 20 times the tiny one's.
var alignLengths = []int{640, 768, 896, 1024, 1152, 1280, 1408, 1536, 1664, 1920, 2048}

// alignServer is one patched server of the comparison and what it gave.
type alignServer struct {
	name  string
	block int
	srv   *testenv.Llama
	// per length: restored tokens, TTFT in ms, answers as fresh, answers
	// as stock's from as many cached tokens, answers
	restored, ttft   map[int][]float64
	same, asStock, n map[int]int
}

func ubatchAlignment(b *testing.B, preset string, trials int, lengths []int) {
	model := testenv.Model(b, preset, 0)
	args := func(slots int) []string {
		return append(testenv.BenchServerArgs(model, 8192, slots, "on"), "-ub", fmt.Sprint(alignUbatch))
	}
	stock := testenv.StartLlama(b, "stock", testenv.StockServer(b), args(1))
	servers := []*alignServer{{name: "block-aligned", block: 64}, {name: "ubatch-aligned", block: alignUbatch}}
	for _, s := range servers {
		cfg := fmt.Sprintf(`{"block_tokens": %d, "arbiter": {"policy": "always-restore"}}`, s.block)
		s.srv = testenv.StartLlama(b, s.name, testenv.PatchedServer(b), append(args(2), "--mcb-config", cfg))
		require.Equal(b, "on", s.srv.BridgeState())
	}
	fresh := map[string]any{"cache_prompt": false}
	for i := 0; i < b.N; i++ {
		freshTTFT := map[int][]float64{}
		for _, s := range servers {
			s.restored, s.ttft, s.same, s.asStock, s.n = map[int][]float64{}, map[int][]float64{}, map[int]int{}, map[int]int{}, map[int]int{}
		}
		for trial := 0; trial < trials; trial++ {
			for li, n := range lengths {
				// A first token of its own: no prefix shares a block with
				// another.
				prefix := testenv.Tokens(n, 7, 1+trial*len(lengths)+li)
				promptA := testenv.Cat(prefix, testenv.Tokens(alignTail, 11, 5))
				promptB := testenv.Cat(prefix, testenv.Tokens(alignTail, 13, 9))
				reqB := testenv.Request{Prompt: promptB, Slot: 1, NPredict: alignPredict}
				ms, want := timedAnswer(b, stock.URL, testenv.Request{Prompt: promptB, Slot: 0, NPredict: alignPredict, Extra: fresh})
				require.Zero(b, want.Timings.CacheN, "computed fresh")
				freshTTFT[n] = append(freshTTFT[n], ms)
				for _, s := range servers {
					s.srv.Complete(b, testenv.Request{Prompt: promptA, Slot: 0, NPredict: 1})
					ms, got := timedAnswer(b, s.srv.URL, reqB)
					require.Equal(b, []any{"restore", n / s.block * s.block}, []any{got.MCB.Decision, got.MCB.RestoredN},
						"%s restores the prefix's whole blocks: %+v", s.name, got.MCB)
					s.restored[n] = append(s.restored[n], float64(got.MCB.RestoredN))
					s.ttft[n] = append(s.ttft[n], ms)
					s.n[n]++
					if slices.Equal(got.Tokens, want.Tokens) {
						s.same[n]++
					}
					if slices.Equal(got.Tokens, testenv.StockFrom(b, stock.URL, reqB, got.Timings.CacheN).Tokens) {
						s.asStock[n]++
					}
				}
			}
		}
		alignReport(b, servers, lengths, freshTTFT)
	}
}

// timedAnswer is a completion and its TTFT in ms: the client's wall time
// less the server's decode time after the first token.
func timedAnswer(b *testing.B, url string, r testenv.Request) (float64, testenv.Completion) {
	t0 := time.Now()
	c := testenv.Complete(b, url, r)
	return ms(time.Since(t0)) - c.Timings.PredictedMS, c
}

func medianMS(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

func mean(v []float64) float64 {
	var sum float64
	for _, x := range v {
		sum += x
	}
	return sum / float64(len(v))
}

func alignReport(b *testing.B, servers []*alignServer, lengths []int, freshTTFT map[int][]float64) {
	block, ubatch := servers[0], servers[1]
	b.Logf("prefix | %s: restored, TTFT, as fresh, as stock from as many | %s: the same | fresh TTFT", block.name, ubatch.name)
	var lost, lostMS, restoredAll []float64
	for _, n := range lengths {
		row := fmt.Sprintf("%6d", n)
		for _, s := range servers {
			row += fmt.Sprintf(" | %5.0f %8.1f ms %d/%d %d/%d", mean(s.restored[n]), medianMS(s.ttft[n]), s.same[n], s.n[n], s.asStock[n], s.n[n])
		}
		b.Logf("%s | %.1f ms", row, medianMS(freshTTFT[n]))
		lost = append(lost, mean(block.restored[n])-mean(ubatch.restored[n]))
		lostMS = append(lostMS, medianMS(ubatch.ttft[n])-medianMS(block.ttft[n]))
		restoredAll = append(restoredAll, mean(block.restored[n]))
	}
	for _, s := range servers {
		var same, asStock, n int
		for _, l := range lengths {
			same, asStock, n = same+s.same[l], asStock+s.asStock[l], n+s.n[l]
		}
		b.ReportMetric(float64(same)/float64(n), s.name+"-as-fresh")
		b.ReportMetric(float64(asStock)/float64(n), s.name+"-as-stock")
		b.Logf("%s: %d/%d answers as fresh, %d/%d as stock's from as many cached tokens", s.name, same, n, asStock, n)
	}
	b.ReportMetric(mean(lost), "align-lost-tokens")
	b.ReportMetric(mean(lost)/mean(restoredAll), "align-lost-share")
	b.ReportMetric(mean(lostMS), "align-ttft-ms")
	b.Logf("aligning to n_ubatch %d restores %.0f fewer tokens on average (%.0f%% of the block-aligned restore), TTFT %+.1f ms on average (medians per length)",
		alignUbatch, mean(lost), 100*mean(lost)/mean(restoredAll), mean(lostMS))
}
