package arbitereval

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/arbiter"
	"github.com/mcbridge/mcbridge/internal/preset"
)

// TestArbiterTarget is docs/design.md §15's arbiter target on the default sweep:
// after warm-up, never more than 5% slower than the better of always
// restoring and always recomputing. The sweep must also be one where
// calibration matters (a fresh arbiter misses the bound somewhere) and
// where neither fixed policy is enough on its own.
func TestArbiterTarget(t *testing.T) {
	points, err := Evaluate(Options{})
	require.NoError(t, err)
	require.Len(t, points, 2*6*8, "points")
	sums := Summarize(points)
	all := sums[len(sums)-1]
	require.Equal(t, "all", all.Preset, "last summary %+v", all)
	require.Equal(t, len(points), all.Points, "last summary %+v", all)
	for _, s := range sums {
		w := s.Worst
		t.Logf("%s: worst %.3f at %g GB/s, %d tokens; fresh arbiter %.2f, restore %.2f, recompute %.2f",
			s.Preset, w.Ratio(), w.LinkGBps, w.PrefixTokens, s.ColdWorst, s.RestoreWorst, s.RecomputeWorst)
	}
	w := all.Worst
	assert.Zero(t, all.Over5, "points over 1.05; worst %.3f: %s at %g GB/s, %d cached tokens", w.Ratio(), w.Preset, w.LinkGBps, w.PrefixTokens)
	assert.Greater(t, all.ColdWorst, 1.05, "a sweep where calibration does not matter: fresh %.2f", all.ColdWorst)
	assert.Greater(t, all.RestoreWorst, 1.05, "a sweep where always-restore is enough: restore %.2f", all.RestoreWorst)
	assert.Greater(t, all.RecomputeWorst, 1.05, "a sweep where always-recompute is enough: recompute %.2f", all.RecomputeWorst)
}

func TestTruth(t *testing.T) {
	p := preset.Preset{Name: "x", KVBytesPerToken: 1000, Prefill: arbiter.PrefillCost{PerToken: 1e-3}, LocalBandwidth: 1}
	tr := truth{p: p, bandwidth: 1e6, latency: time.Millisecond, block: 10}
	for _, tc := range []struct {
		k, prompt int
		want      time.Duration
	}{
		{0, 25, 25 * time.Millisecond},
		// 1 ms latency, 10 tokens · 1000 B at 1 MB/s, then 15 tokens.
		{1, 25, (1 + 10 + 15) * time.Millisecond},
		{2, 25, (1 + 20 + 5) * time.Millisecond},
	} {
		assert.Equal(t, tc.want, tr.ttft(tc.k, tc.prompt), "ttft(%d, %d)", tc.k, tc.prompt)
	}
}

func TestEvaluateOptions(t *testing.T) {
	one := []preset.Preset{preset.BenchCPU}
	for _, tc := range []struct {
		name string
		opt  Options
		n    int
		ok   bool
	}{
		{"one point", Options{Presets: one, LinkGBps: []float64{10}, Prefixes: []int{4096}}, 1, true},
		{"negative link", Options{Presets: one, LinkGBps: []float64{-1}}, 0, false},
		{"negative warm-up", Options{Presets: one, Warmup: -1}, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pts, err := Evaluate(tc.opt)
			if tc.ok {
				require.NoError(t, err)
			} else {
				require.Error(t, err)
			}
			require.Len(t, pts, tc.n, "points")
			for _, p := range pts {
				require.Equal(t, p.PrefixTokens+64, p.PromptTokens, "point %+v", p)
				require.Positive(t, p.Arbiter, "point %+v", p)
				require.LessOrEqual(t, p.Best(), p.Recompute, "point %+v", p)
			}
		})
	}
}
