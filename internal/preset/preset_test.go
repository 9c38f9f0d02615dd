package preset

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestInterpolatedHitsMeasuredRates(t *testing.T) {
	m := BenchCPU.Prefill.(Interpolated)
	for _, p := range m {
		got := BenchCPU.Prefill.Time(0, p.Tokens).Seconds()
		want := float64(p.Tokens) / p.TokensPerSecond
		assert.LessOrEqual(t, math.Abs(got-want)/want, 1e-9, "prefill of %d tokens: %.6fs, measured %.6fs", p.Tokens, got, want)
	}
}

func TestPrefillIsAdditiveAndMonotone(t *testing.T) {
	for _, p := range All {
		t.Run(p.Name, func(t *testing.T) {
			prev := time.Duration(0)
			for n := 1; n <= 1<<17; n *= 2 {
				whole := p.Prefill.Time(0, n)
				require.Greater(t, whole, prev, "prefill of %d tokens, against fewer", n)
				prev = whole
				// A cached head leaves the rest of the prompt's cost, which
				// is less than the whole and at least the head's share of it
				// (later positions attend to more).
				head, tail := p.Prefill.Time(0, n/2), p.Prefill.Time(n/2, n)
				if n >= 2 {
					require.Positive(t, tail, "prefill [%d,%d) %v against [0,%d) %v and [0,%d) %v", n/2, n, tail, n, whole, n/2, head)
					require.Less(t, tail, whole, "prefill [%d,%d) %v against [0,%d) %v and [0,%d) %v", n/2, n, tail, n, whole, n/2, head)
					require.GreaterOrEqual(t, tail, whole-head-time.Microsecond, "prefill [%d,%d) %v against [0,%d) %v and [0,%d) %v", n/2, n, tail, n, whole, n/2, head)
				}
			}
			require.Zero(t, p.Prefill.Time(5, 5), "an empty range costs time")
			require.Zero(t, p.Prefill.Time(9, 3), "an empty range costs time")
		})
	}
}

// The continuation figures of docs/design.md §15 (64 new tokens after a restored
// 4096 or 8192) were not inputs of the interpolation; they check its shape.
func TestBenchCPUContinuation(t *testing.T) {
	for _, tc := range []struct {
		start    int
		measured time.Duration
	}{{4096, 379 * time.Millisecond}, {8192, 814 * time.Millisecond}} {
		got := BenchCPU.Prefill.Time(tc.start, tc.start+64)
		r := got.Seconds() / tc.measured.Seconds()
		assert.GreaterOrEqual(t, r, 0.7, "64 tokens after %d: %v, measured %v", tc.start, got, tc.measured)
		assert.LessOrEqual(t, r, 1.3, "64 tokens after %d: %v, measured %v", tc.start, got, tc.measured)
	}
}

func TestLookup(t *testing.T) {
	for _, tc := range []struct {
		name string
		ok   bool
	}{{"bench-cpu", true}, {"llama3-8b-gpu", true}, {"", false}, {"bench", false}} {
		p, err := Lookup(tc.name)
		if tc.ok {
			assert.NoError(t, err, "Lookup(%q)", tc.name)
			assert.Equal(t, tc.name, p.Name, "Lookup(%q)", tc.name)
		} else {
			assert.Error(t, err, "Lookup(%q) = %q", tc.name, p.Name)
		}
	}
}
