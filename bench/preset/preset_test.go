package preset

import (
	"math"
	"testing"
	"time"
)

func TestInterpolatedHitsMeasuredRates(t *testing.T) {
	m := BenchCPU.Prefill.(Interpolated)
	for _, p := range m {
		got := BenchCPU.Prefill.Time(0, p.Tokens).Seconds()
		want := float64(p.Tokens) / p.TokensPerSecond
		if math.Abs(got-want)/want > 1e-9 {
			t.Errorf("prefill of %d tokens: %.6fs, measured %.6fs", p.Tokens, got, want)
		}
	}
}

func TestPrefillIsAdditiveAndMonotone(t *testing.T) {
	for _, p := range All {
		t.Run(p.Name, func(t *testing.T) {
			prev := time.Duration(0)
			for n := 1; n <= 1<<17; n *= 2 {
				whole := p.Prefill.Time(0, n)
				if whole <= prev {
					t.Fatalf("prefill of %d tokens %v, not above %v for fewer", n, whole, prev)
				}
				prev = whole
				// A cached head leaves the rest of the prompt's cost, which
				// is less than the whole and at least the head's share of it
				// (later positions attend to more).
				head, tail := p.Prefill.Time(0, n/2), p.Prefill.Time(n/2, n)
				if n >= 2 && (tail <= 0 || tail >= whole || tail < whole-head-time.Microsecond) {
					t.Fatalf("prefill [%d,%d) %v against [0,%d) %v and [0,%d) %v", n/2, n, tail, n, whole, n/2, head)
				}
			}
			if p.Prefill.Time(5, 5) != 0 || p.Prefill.Time(9, 3) != 0 {
				t.Fatal("an empty range costs time")
			}
		})
	}
}

// The continuation figures of DESIGN.md §5 (64 new tokens after a restored
// 4096 or 8192) were not inputs of the interpolation; they check its shape.
func TestBenchCPUContinuation(t *testing.T) {
	for _, tc := range []struct {
		start    int
		measured time.Duration
	}{{4096, 379 * time.Millisecond}, {8192, 814 * time.Millisecond}} {
		got := BenchCPU.Prefill.Time(tc.start, tc.start+64)
		if r := got.Seconds() / tc.measured.Seconds(); r < 0.7 || r > 1.3 {
			t.Errorf("64 tokens after %d: %v, measured %v", tc.start, got, tc.measured)
		}
	}
}

func TestLookup(t *testing.T) {
	for _, tc := range []struct {
		name string
		ok   bool
	}{{"bench-cpu", true}, {"llama3-8b-gpu", true}, {"", false}, {"bench", false}} {
		p, err := Lookup(tc.name)
		if (err == nil) != tc.ok || (tc.ok && p.Name != tc.name) {
			t.Errorf("Lookup(%q) = %q, %v", tc.name, p.Name, err)
		}
	}
}
