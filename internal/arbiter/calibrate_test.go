package arbiter

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fakeClock is an injected clock that tests move by hand.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{t: time.Unix(1_700_000_000, 0)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// noisy multiplies a true duration by log-normal noise of sigma, and with
// probability outliers by 10 (a preempted prefill, a congested link).
func noisy(rng *rand.Rand, truth time.Duration, sigma, outliers float64) time.Duration {
	f := math.Exp(sigma * rng.NormFloat64())
	if rng.Float64() < outliers {
		f *= 10
	}
	return time.Duration(float64(truth) * f)
}

// prefillSpan draws the ranges a server prefills: whole prompts of 64 to
// maxTokens tokens, and continuations of a cached prefix.
func prefillSpan(rng *rand.Rand, maxTokens int) (int, int) {
	n := int(64 * math.Pow(float64(maxTokens)/64, rng.Float64()))
	if rng.IntN(2) == 0 {
		return 0, n
	}
	a := rng.IntN(maxTokens)
	return a, a + 1 + rng.IntN(512)
}

func relErr(got, want time.Duration) float64 {
	return math.Abs(float64(got)-float64(want)) / float64(want)
}

func TestPrefillCalibrationConverges(t *testing.T) {
	truths := map[string]PrefillCost{
		"defaults":          DefaultPrefill,
		"3x slower":         {Fixed: 6e-3, PerToken: 3 * DefaultPrefill.PerToken, PerContext: 3 * DefaultPrefill.PerContext},
		"GPU, other shape":  {Fixed: 5e-3, PerToken: 25e-6, PerContext: 2e-10},
		"attention-heavy":   {Fixed: 1e-3, PerToken: 2e-4, PerContext: 1e-6},
		"no attention term": {Fixed: 1e-3, PerToken: 1e-3},
	}
	spans := [][2]int{{0, 512}, {0, 2048}, {0, 8192}, {4096, 4160}, {8000, 8064}}
	for _, outliers := range []float64{0, 0.05} {
		for name, truth := range truths {
			t.Run(fmt.Sprintf("%s/outliers=%g", name, outliers), func(t *testing.T) {
				rng := rand.New(rand.NewPCG(7, 11))
				a := mustNew(t, Config{})
				for i := 0; i < 600; i++ {
					s, e := prefillSpan(rng, 8192)
					a.ObservePrefill(s, e, noisy(rng, truth.Time(s, e), 0.05, outliers))
				}
				for _, sp := range spans {
					got, want := a.PrefillTime(sp[0], sp[1]), truth.Time(sp[0], sp[1])
					e := relErr(got, want)
					assert.LessOrEqual(t, e, 0.05, "PrefillTime%v = %v, truth %v (%.1f%% off); fitted %+v", sp, got, want, 100*e, a.Prefill())
				}
			})
		}
	}
}

func TestTransferCalibrationConverges(t *testing.T) {
	truths := map[string]Link{
		"RDMA":       {Bandwidth: 22e9, Latency: 8 * time.Microsecond},
		"local":      {Bandwidth: 12e9, Latency: 20 * time.Microsecond},
		"1GbE":       {Bandwidth: 0.11e9, Latency: 400 * time.Microsecond},
		"no latency": {Bandwidth: 5e9},
	}
	sizes := []int64{64 << 10, 4 << 20, 256 << 20}
	for _, outliers := range []float64{0, 0.05} {
		for name, truth := range truths {
			t.Run(fmt.Sprintf("%s/outliers=%g", name, outliers), func(t *testing.T) {
				rng := rand.New(rand.NewPCG(3, 5))
				a := mustNew(t, Config{Now: newFakeClock().Now})
				for i := 0; i < 600; i++ {
					n := int64(4096 * math.Pow(65536, rng.Float64()))
					a.ObserveTransfer(name, n, noisy(rng, truth.Time(n), 0.05, outliers))
				}
				for _, n := range sizes {
					got, want := a.TransferTime(name, n), truth.Time(n)
					e := relErr(got, want)
					assert.LessOrEqual(t, e, 0.05, "TransferTime(%d) = %v, truth %v (%.1f%% off); fitted %+v", n, got, want, 100*e, a.Link(name))
				}
				assert.Equal(t, DefaultLink.Time(4<<20), a.TransferTime("other", 4<<20), "calibrating %q moved another link", name)
			})
		}
	}
}

// The defaults fix the curve's shape; one observation fixes its scale, so a
// machine far from the defaults is predicted well from its first prefill.
func TestOneObservationRescalesTheModel(t *testing.T) {
	a := mustNew(t, Config{})
	a.ObservePrefill(0, 4096, DefaultPrefill.Time(0, 4096)/100)
	for _, sp := range [][2]int{{0, 256}, {0, 4096}, {0, 32768}, {8192, 8200}} {
		got, want := a.PrefillTime(sp[0], sp[1]), DefaultPrefill.Time(sp[0], sp[1])/100
		assert.LessOrEqual(t, relErr(got, want), 1e-6, "PrefillTime%v = %v, want %v", sp, got, want)
	}
}

func TestCalibrationIgnoresGarbage(t *testing.T) {
	clock := newFakeClock()
	a := mustNew(t, Config{Now: clock.Now})
	a.ObservePrefill(0, 1000, time.Second)
	a.ObserveTransfer("l", 1<<20, time.Millisecond)
	prefill, link := a.Prefill(), a.Link("l")

	a.ObservePrefill(0, 0, time.Second)
	a.ObservePrefill(100, 50, time.Second)
	a.ObservePrefill(-5, 50, time.Second)
	a.ObservePrefill(0, 1000, 0)
	a.ObservePrefill(0, 1000, -time.Second)
	a.ObservePrefill(0, MaxPromptTokens+1, time.Hour)
	a.ObserveTransfer("l", 0, time.Millisecond)
	a.ObserveTransfer("l", -1, time.Millisecond)
	a.ObserveTransfer("l", 1<<20, 0)
	a.ObserveTransfer("l", 1<<20, -time.Millisecond)
	a.ObserveTransfer("l", MaxTransferBytes+1, time.Hour)
	a.ObserveTransfer("garbage-only", 0, time.Millisecond)

	assert.Equal(t, prefill, a.Prefill(), "prefill moved on garbage")
	assert.Equal(t, link, a.Link("l"), "link moved on garbage")
	assert.Equal(t, DefaultLink, a.Link("garbage-only"), "garbage created link state")

	// Absurd but well-formed observations (a stalled clock, a mislabelled
	// call) are kept, with a pull the Huber threshold bounds.
	for i := 0; i < 20; i++ {
		a.ObservePrefill(0, 1000, time.Second)
		a.ObserveTransfer("l", 1<<20, time.Millisecond)
	}
	prefillBefore, linkBefore := a.PrefillTime(0, 1000), a.TransferTime("l", 1<<20)
	a.ObservePrefill(0, 1000, time.Nanosecond)
	a.ObservePrefill(0, 1000, math.MaxInt64)
	a.ObserveTransfer("l", 1<<20, time.Nanosecond)
	a.ObserveTransfer("l", 1<<20, math.MaxInt64)
	e := relErr(a.PrefillTime(0, 1000), prefillBefore)
	assert.LessOrEqual(t, e, 0.01, "two absurd prefills moved the estimate %.1f%%", 100*e)
	e = relErr(a.TransferTime("l", 1<<20), linkBefore)
	assert.LessOrEqual(t, e, 0.01, "two absurd transfers moved the estimate %.1f%%", 100*e)
}

// Whatever is observed, coefficients stay finite and nonnegative and
// estimates stay usable.
func TestCalibrationNeverNaN(t *testing.T) {
	rng := rand.New(rand.NewPCG(13, 17))
	a := mustNew(t, Config{Window: 2})
	extremes := []time.Duration{1, 2, time.Microsecond, time.Hour, math.MaxInt64, math.MaxInt64 / 3}
	for i := 0; i < 5000; i++ {
		s := rng.IntN(MaxPromptTokens)
		e := s + 1 + rng.IntN(MaxPromptTokens-s)
		if rng.IntN(3) == 0 {
			s, e = 0, 1+rng.IntN(4)
		}
		d := extremes[rng.IntN(len(extremes))]
		if rng.IntN(2) == 0 {
			d = time.Duration(rng.Int64())
		}
		a.ObservePrefill(s, e, d)
		a.ObserveTransfer("l", 1+rng.Int64N(MaxTransferBytes), d)
		a.ObserveTransfer("l", 1+rng.Int64N(16), d)

		p, l := a.Prefill(), a.Link("l")
		for _, v := range []float64{p.Fixed, p.PerToken, p.PerContext, l.Latency.Seconds(), 1 / l.Bandwidth} {
			require.GreaterOrEqual(t, v, 0.0, "after %d observations: prefill %+v, link %+v", i, p, l)
			require.False(t, math.IsInf(v, 0), "after %d observations: prefill %+v, link %+v", i, p, l)
		}
		require.GreaterOrEqual(t, a.PrefillTime(0, 4096), time.Duration(0), "negative estimate: prefill %+v", p)
		require.GreaterOrEqual(t, a.TransferTime("l", 1<<20), time.Duration(0), "negative estimate: link %+v", l)
	}
}

// A link measured slow must be tried again eventually: its calibration
// expires, and the next transfer relearns it from scratch.
func TestLinkCalibrationExpires(t *testing.T) {
	clock := newFakeClock()
	nominal := Link{Bandwidth: 10e9, Latency: 10 * time.Microsecond}
	a := mustNew(t, Config{Now: clock.Now, Links: map[string]Link{"peer": nominal}, LinkExpiry: time.Minute})
	congested := Link{Bandwidth: 0.1e9, Latency: 10 * time.Microsecond}
	for i := 0; i < 50; i++ {
		a.ObserveTransfer("peer", 64<<20, congested.Time(64<<20))
	}
	in := Input{PromptTokens: 1024 + 64, BlockTokens: 256, MatchedBlocks: 4, KVBytesPerToken: 1 << 20, Link: "peer"}
	d := a.Decide(in)
	require.Zero(t, d.RestoreBlocks, "congested link: %v", d)
	e := relErr(a.TransferTime("peer", 64<<20), congested.Time(64<<20))
	require.LessOrEqual(t, e, 0.01, "congested estimate %.1f%% off", 100*e)

	clock.Advance(time.Minute)
	est := a.TransferTime("peer", 64<<20)
	require.LessOrEqual(t, relErr(est, congested.Time(64<<20)), 0.01, "expired early: %v", est)
	clock.Advance(time.Second)
	require.Equal(t, nominal, a.Link("peer"), "after expiry: want the configured link")
	d = a.Decide(in)
	require.Equal(t, 4, d.RestoreBlocks, "expired link not tried again: %v", d)

	// The first measurement after expiry rescales the configured curve to it.
	recovered := Link{Bandwidth: 5e9, Latency: 20 * time.Microsecond}
	a.ObserveTransfer("peer", 64<<20, recovered.Time(64<<20))
	est = a.TransferTime("peer", 64<<20)
	require.LessOrEqual(t, relErr(est, recovered.Time(64<<20)), 1e-6, "first measurement after expiry: %v, want %v", est, recovered.Time(64<<20))
}

// A lasting change (a link that became 3x slower, a machine that became
// busy) is followed within a few dozen observations, while a burst of
// outliers shorter than that moves the estimate little.
func TestCalibrationFollowsChangeNotBursts(t *testing.T) {
	before := Link{Bandwidth: 5e9, Latency: 100 * time.Microsecond}
	for _, tc := range []struct {
		name   string
		after  Link
		burst  int // observations at the new cost before returning to the old one
		within int // observations after which the estimate must be within 5%
	}{
		{"3x slower", Link{Bandwidth: 5e9 / 3, Latency: 300 * time.Microsecond}, 0, 30},
		{"3x faster", Link{Bandwidth: 15e9, Latency: 33 * time.Microsecond}, 0, 30},
		{"10x slower", Link{Bandwidth: 0.5e9, Latency: time.Millisecond}, 0, 30},
		{"burst of 7 10x outliers", Link{Bandwidth: 0.5e9, Latency: time.Millisecond}, 7, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(41, 43))
			a := mustNew(t, Config{Now: newFakeClock().Now})
			size := func() int64 { return int64(64 << 10 * math.Pow(16384, rng.Float64())) }
			for i := 0; i < 300; i++ {
				n := size()
				a.ObserveTransfer("l", n, noisy(rng, before.Time(n), 0.05, 0))
			}
			truth := tc.after
			for i := 0; i < 100; i++ {
				if i == tc.burst && tc.burst > 0 {
					truth = before
				}
				n := size()
				a.ObserveTransfer("l", n, noisy(rng, truth.Time(n), 0.05, 0))
				if i >= max(tc.within, tc.burst) {
					est := a.TransferTime("l", 1<<30)
					e := relErr(est, truth.Time(1<<30))
					require.LessOrEqual(t, e, 0.05, "observation %d: estimate %v, truth %v (%.1f%% off)", i, est, truth.Time(1<<30), 100*e)
				}
			}
		})
	}
}

func TestLinkTableForgetsLeastRecentlyMeasured(t *testing.T) {
	clock := newFakeClock()
	a := mustNew(t, Config{Now: clock.Now})
	slow := Link{Bandwidth: 1e9, Latency: time.Millisecond}
	for i := 0; i <= maxLinks; i++ {
		if i == maxLinks {
			// Measure link 0 again, so link 1 is the oldest when the table overflows.
			a.ObserveTransfer("peer-0", 1<<20, slow.Time(1<<20))
			clock.Advance(time.Millisecond)
		}
		a.ObserveTransfer(fmt.Sprintf("peer-%d", i), 1<<20, slow.Time(1<<20))
		clock.Advance(time.Millisecond)
	}
	require.Len(t, a.links, maxLinks, "links held")
	require.NotContains(t, a.links, "peer-1", "peer-1, the least recently measured, was kept")
	for _, name := range []string{"peer-0", "peer-2", fmt.Sprintf("peer-%d", maxLinks)} {
		assert.LessOrEqual(t, relErr(a.TransferTime(name, 1<<20), slow.Time(1<<20)), 0.01, "%s lost its calibration", name)
	}
}

// The subset solver must agree with a brute-force grid minimisation of the
// same nonnegative quadratic on small random problems.
func TestNonnegativeSolveIsOptimal(t *testing.T) {
	rng := rand.New(rand.NewPCG(21, 23))
	for i := 0; i < 100; i++ {
		f := newFit(3, vec{1, 1, 0}, vec{1, 1, 1}, 4)
		for n := 0; n < 1+rng.IntN(4); n++ {
			x := vec{1, rng.Float64() * 3, rng.Float64() * 3}
			w := rng.Float64()
			for r := 0; r < 3; r++ {
				for c := 0; c < 3; c++ {
					f.a[r][c] += w * x[r] * x[c]
				}
				f.b[r] += w * x[r] * (rng.Float64()*4 - 1)
			}
		}
		u, ok := f.solve()
		m := f.system()
		objective := func(u vec) float64 {
			o := 0.0
			for r := 0; r < 3; r++ {
				for c := 0; c < 3; c++ {
					o += u[r] * m[r][c] * u[c]
				}
				o -= 2 * f.b[r] * u[r]
			}
			return o
		}
		got := 0.0
		if ok {
			got = objective(u)
		}
		for _, v := range u {
			require.GreaterOrEqual(t, v, 0.0, "negative coefficient %v", u)
		}
		const step = 0.1
		for g0 := 0.0; g0 <= 4; g0 += step {
			for g1 := 0.0; g1 <= 4; g1 += step {
				for g2 := 0.0; g2 <= 4; g2 += step {
					if o := objective(vec{g0, g1, g2}); o < got-1e-9 {
						require.FailNowf(t, "solve is not optimal", "problem %d: solve gave %v (objective %g, ok %v) but %v reaches %g", i, u, got, ok, vec{g0, g1, g2}, o)
					}
				}
			}
		}
	}
}
