package e2e

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/testenv"
)

// BenchmarkUbatchAlignment measures what docs/design.md §"Restores and
// n_ubatch" rests on: llama-server v0.5.0 on the CPU is not
// batch-invariant, so a request whose first k tokens are already in its
// slot (restored, or its own) answers as the same request computed fresh
// only when k is a multiple of n_ubatch. A stock server (-b/-ub 512, one
// slot) answers a 2100-token prompt fresh; then, for k every third
// multiple of 64 (the tests' block) below it and every multiple of 512,
// its slot is erased, it computes the first k tokens, and it answers the
// whole prompt from them. It reports
// how many answers of each kind differ from the fresh one, and what
// aligning a restore down to n_ubatch would cost: the tokens it leaves to
// compute, at the prompt's measured prefill rate.
// One sub-benchmark a model preset: -bench 'UbatchAlignment/tiny' for the
// quick one.
func BenchmarkUbatchAlignment(b *testing.B) {
	for _, preset := range []string{"tiny", "bench"} {
		b.Run(preset, func(b *testing.B) { ubatchAlignment(b, preset) })
	}
}

func ubatchAlignment(b *testing.B, preset string) {
	const n, ub, block, predict = 2100, 512, 64, 16
	model := testenv.Model(b, preset, 0)
	args := append(testenv.ServerArgs(model, 4096, 1, "on"), "-b", fmt.Sprint(ub), "-ub", fmt.Sprint(ub),
		"--slot-save-path", testenv.SlotDir(b, "align")+"/")
	srv := testenv.StartLlama(b, "stock", testenv.StockServer(b), args)
	prompt := testenv.Tokens(n, 7, 3)
	erase := func() { testenv.Post(b, srv.URL+"/slots/0?action=erase", map[string]any{}, nil) }
	for i := 0; i < b.N; i++ {
		erase()
		fresh := srv.Complete(b, testenv.Request{Prompt: prompt, Slot: 0, NPredict: predict})
		require.Equal(b, n, fresh.Timings.PromptN, "computed fresh")
		msPerToken := fresh.Timings.PromptMS / float64(n)
		var alignedN, alignedSame, otherN, otherSame, extra int
		var ks []int
		for k := 3 * block; k < n; k += 3 * block {
			ks = append(ks, k)
		}
		for k := ub; k < n; k += ub {
			if !slices.Contains(ks, k) {
				ks = append(ks, k)
			}
		}
		for _, k := range ks {
			erase()
			srv.Complete(b, testenv.Request{Prompt: prompt[:k], Slot: 0, NPredict: 1})
			got := srv.Complete(b, testenv.Request{Prompt: prompt, Slot: 0, NPredict: predict})
			// The slot holds the first k tokens, and the one it generated
			// after them, which the prompt may happen to continue with.
			cached := got.Timings.CacheN
			require.Contains(b, []int{k, k + 1}, cached, "the slot held the first %d tokens", k)
			same := slices.Equal(got.Tokens, fresh.Tokens)
			if cached%ub == 0 {
				alignedN++
				if same {
					alignedSame++
				}
			} else {
				otherN++
				extra += cached % ub
				if same {
					otherSame++
				}
			}
			b.Logf("cached %4d (%%%d = %3d): answer as fresh %v", cached, ub, cached%ub, same)
		}
		meanExtra := float64(extra) / float64(otherN)
		b.ReportMetric(float64(alignedSame)/float64(alignedN), "aligned-as-fresh")
		b.ReportMetric(float64(otherSame)/float64(otherN), "unaligned-as-fresh")
		b.ReportMetric(meanExtra, "align-extra-tokens")
		b.ReportMetric(meanExtra*msPerToken, "align-extra-ms")
		b.ReportMetric(msPerToken, "prefill-ms/token")
		b.Logf("n=%d n_ubatch=%d: cached a multiple of n_ubatch %d/%d as fresh, otherwise %d/%d; aligning down costs %.0f tokens on average, %.1f ms at %.2f ms/token (%v for the whole prompt)",
			n, ub, alignedSame, alignedN, otherSame, otherN, meanExtra, meanExtra*msPerToken, msPerToken,
			time.Duration(fresh.Timings.PromptMS*float64(time.Millisecond)).Round(time.Millisecond))
	}
}
