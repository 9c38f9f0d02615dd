package arbiter

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// groundTruth is a machine the arbiter knows nothing about in advance.
type groundTruth struct {
	name    string
	prefill PrefillCost
	kv      int64 // KV bytes per token
}

var truths = []groundTruth{
	// Near the defaults but not equal to them.
	{"cpu-bench", PrefillCost{Fixed: 3e-3, PerToken: 1.2e-3, PerContext: 1.5e-6}, 12 << 10},
	// An 8B GQA model on a GPU: 12k tok/s, attention doubling the cost by 64k.
	{"gpu-8b-gqa", PrefillCost{Fixed: 4e-3, PerToken: 1.0 / 12000, PerContext: 2.5e-9}, 128 << 10},
	// A 7B MHA model on a GPU: four times the KV per token.
	{"gpu-7b-mha", PrefillCost{Fixed: 4e-3, PerToken: 1e-4, PerContext: 3e-9}, 512 << 10},
}

// TestArbiterNearBestEndpoint is the arbiter's target (docs/design.md §15): over
// links of 1-50 GB/s and prefixes of 1k-128k tokens, its chosen plan,
// timed by the ground truth, is never more than 5% slower than the better
// of always-restore and always-recompute. The arbiter starts from its
// defaults and learns each machine and link only from noisy observations
// (5% log-normal noise, 5% of them 10x outliers).
func TestArbiterNearBestEndpoint(t *testing.T) {
	const (
		block   = 256
		latency = 100 * time.Microsecond
	)
	bandwidths := []float64{1e9, 1.5e9, 2e9, 3e9, 5e9, 8e9, 13e9, 20e9, 30e9, 50e9}
	worst, best, decisions, restored := 0.0, math.Inf(1), 0, 0
	worstAt := ""
	for _, truth := range truths {
		rng := rand.New(rand.NewPCG(31, 37))
		a := mustNew(t, Config{Now: newFakeClock().Now})
		for i := 0; i < 400; i++ {
			s, e := prefillSpan(rng, 128<<10)
			a.ObservePrefill(s, e, noisy(rng, truth.prefill.Time(s, e), 0.05, 0.05))
		}
		for _, bw := range bandwidths {
			link := Link{Bandwidth: bw, Latency: latency}
			name := fmt.Sprintf("%gGB/s", bw/1e9)
			for i := 0; i < 100; i++ {
				n := int64(64 << 10 * math.Pow(16384, rng.Float64()))
				a.ObserveTransfer(name, n, noisy(rng, link.Time(n), 0.05, 0.05))
			}
			for prefix := 1024.0; prefix <= 128<<10; prefix *= math.Sqrt2 {
				for _, tail := range []int{1, 64, 1024} {
					m := int(prefix) / block
					in := Input{PromptTokens: m*block + tail, BlockTokens: block, MatchedBlocks: m, KVBytesPerToken: truth.kv, Link: name}
					d := a.Decide(in)
					real := newPlan(in.PromptTokens, block, truth.prefill.vec(), latency.Seconds(), float64(block)*float64(truth.kv)/bw)
					usable := min(m, (in.PromptTokens-1)/block)
					endpoint := min(real.sequential(0), real.sequential(usable))
					ratio := real.sequential(d.RestoreBlocks) / endpoint
					if ratio > worst {
						worst = ratio
						worstAt = fmt.Sprintf("%s over %s, %d+%d tokens: %v", truth.name, name, m*block, tail, d)
					}
					best = min(best, ratio)
					decisions++
					if d.RestoreBlocks > 0 {
						restored++
					}
					assert.LessOrEqual(t, ratio, 1.05, "%s over %s, prompt %d (%d matched): chose %v, %.3fx the best endpoint",
						truth.name, name, in.PromptTokens, m, d, ratio)
				}
			}
		}
	}
	t.Logf("%d decisions (%d restoring), worst %.4fx the best endpoint (%s), best %.4fx",
		decisions, restored, worst, worstAt, best)
}
