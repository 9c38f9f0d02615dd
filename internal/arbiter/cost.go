package arbiter

import (
	"math"
	"time"
)

// PrefillCost models the time to prefill positions [a, b) of one sequence
// whose positions [0, a) are already in the KV cache:
//
//	t = Fixed + PerToken·(b-a) + PerContext·(b²-a²)/2
//
// The last term is attention: the token at position p attends to p earlier
// positions, and Σ_{p=a}^{b-1} p ≈ (b²-a²)/2. It makes a block's prefill
// cost grow with its position, which a restore's cost does not.
type PrefillCost struct {
	Fixed      float64 // seconds per prefill call (graph build, logits)
	PerToken   float64 // seconds per token, whatever its position
	PerContext float64 // seconds per (token, earlier position) pair
}

// DefaultPrefill is the bench model of docs/design.md §15 (llama.cpp v0.5.0, a
// 12-layer n_embd 768 f16 model, CPU, 2 threads), which prefills 611 tok/s
// at 512 tokens, 369 at 2048 and 253 at 4160. PerToken and PerContext are
// the least-relative-error fit of those three runs (606, 378, 249 tok/s,
// all within 2.5%; it predicts 150 tok/s at 8256 where 166 was measured).
// Fixed cannot be resolved from runs of 512 tokens and more (it would be
// under 0.3% of the shortest); 2 ms stands for graph build and logits and
// is left to calibration. Other models and machines differ by orders of
// magnitude: the arbiter rescales these from the first observed prefill.
var DefaultPrefill = PrefillCost{Fixed: 2e-3, PerToken: 1.315e-3, PerContext: 1.2965e-6}

// Time is the modelled time to prefill [a, b); zero when b <= a.
func (c PrefillCost) Time(a, b int) time.Duration {
	return seconds(c.vec().dot(prefillFeatures(a, b)))
}

func (c PrefillCost) vec() vec { return vec{c.Fixed, c.PerToken, c.PerContext} }

func prefillFromVec(v vec) PrefillCost {
	return PrefillCost{Fixed: v[0], PerToken: v[1], PerContext: v[2]}
}

// prefillFeatures is x with t = θ·x; zero for an empty range, so that
// computing nothing costs nothing, not even Fixed. Positions start at 0.
func prefillFeatures(a, b int) vec {
	a = max(a, 0)
	if b <= a {
		return vec{}
	}
	n := float64(b) - float64(a)
	return vec{1, n, n * (float64(a) + float64(b)) / 2}
}

// prefillFloor is the unit of a prefill coefficient configured as zero:
// roughly where each term starts to matter for prompts of a few thousand
// tokens.
var prefillFloor = vec{1e-3, 1e-6, 1e-9}

// Link models moving n bytes over one source: Latency + n/Bandwidth, where
// Latency is paid once per transfer batch.
type Link struct {
	Bandwidth float64       // bytes per second; +Inf when no size dependence was measured
	Latency   time.Duration // per transfer batch
}

// DefaultLink is assumed for a link that is neither configured nor measured:
// the 3.9 GB/s of llama-server's slot restore measured in docs/design.md §15, the
// floor any path of ours must beat. Erring fast matters: a link believed too
// slow is never used, so never measured, so never corrected.
var DefaultLink = Link{Bandwidth: 3.9e9, Latency: 50 * time.Microsecond}

// Time is the modelled time to move bytes; zero when bytes <= 0.
func (l Link) Time(bytes int64) time.Duration {
	return seconds(l.vec().dot(linkFeatures(bytes)))
}

func (l Link) vec() vec { return vec{l.Latency.Seconds(), 1 / l.Bandwidth} }

func linkFromVec(v vec) Link {
	return Link{Bandwidth: 1 / v[1], Latency: seconds(v[0])}
}

func linkFeatures(bytes int64) vec {
	if bytes <= 0 {
		return vec{}
	}
	return vec{1, float64(bytes)}
}

// linkFloor is the unit of a link latency configured as zero.
var linkFloor = vec{10e-6, 0}

// seconds converts to a Duration, saturating instead of overflowing; NaN and
// negative values become zero.
func seconds(s float64) time.Duration {
	if !(s > 0) {
		return 0
	}
	if s >= math.MaxInt64/1e9 {
		return math.MaxInt64
	}
	return time.Duration(math.Round(s * 1e9))
}
