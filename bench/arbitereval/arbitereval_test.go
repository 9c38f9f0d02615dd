package arbitereval

import (
	"testing"
	"time"

	"github.com/mcbridge/mcbridge/bench/preset"
	"github.com/mcbridge/mcbridge/internal/arbiter"
)

// TestArbiterTarget is DESIGN.md §7's arbiter target on the default sweep:
// after warm-up, never more than 5% slower than the better of always
// restoring and always recomputing. The sweep must also be one where
// calibration matters (a fresh arbiter misses the bound somewhere) and
// where neither fixed policy is enough on its own.
func TestArbiterTarget(t *testing.T) {
	points, err := Evaluate(Options{})
	if err != nil {
		t.Fatal(err)
	}
	if want := 2 * 6 * 8; len(points) != want {
		t.Fatalf("%d points, want %d", len(points), want)
	}
	sums := Summarize(points)
	all := sums[len(sums)-1]
	if all.Preset != "all" || all.Points != len(points) {
		t.Fatalf("last summary %+v", all)
	}
	for _, s := range sums {
		w := s.Worst
		t.Logf("%s: worst %.3f at %g GB/s, %d tokens; fresh arbiter %.2f, restore %.2f, recompute %.2f",
			s.Preset, w.Ratio(), w.LinkGBps, w.PrefixTokens, s.ColdWorst, s.RestoreWorst, s.RecomputeWorst)
	}
	if all.Over5 > 0 {
		w := all.Worst
		t.Errorf("%d points over 1.05; worst %.3f: %s at %g GB/s, %d cached tokens", all.Over5, w.Ratio(), w.Preset, w.LinkGBps, w.PrefixTokens)
	}
	if all.ColdWorst <= 1.05 || all.RestoreWorst <= 1.05 || all.RecomputeWorst <= 1.05 {
		t.Errorf("a sweep where calibration or choice does not matter: fresh %.2f, restore %.2f, recompute %.2f",
			all.ColdWorst, all.RestoreWorst, all.RecomputeWorst)
	}
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
		if got := tr.ttft(tc.k, tc.prompt); got != tc.want {
			t.Errorf("ttft(%d, %d) = %v, want %v", tc.k, tc.prompt, got, tc.want)
		}
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
			if (err == nil) != tc.ok || len(pts) != tc.n {
				t.Fatalf("%d points, %v", len(pts), err)
			}
			for _, p := range pts {
				if p.PromptTokens != p.PrefixTokens+64 || p.Arbiter <= 0 || p.Best() > p.Recompute {
					t.Fatalf("point %+v", p)
				}
			}
		})
	}
}
