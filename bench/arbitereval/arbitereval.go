// Package arbitereval measures the arbiter's decisions against ground
// truth: for each preset, link speed and cached prefix length, the true
// time to first token of the arbiter's plan against always restoring and
// always recomputing.
//
// The truth is the preset's (bench-cpu: interpolated measurements, a shape
// the arbiter's quadratic model does not have; llama3-8b-gpu: two orders
// of magnitude faster than the arbiter's defaults) and the swept link,
// which the arbiter's default of 3.9 GB/s matches for none of them. So the
// arbiter is first warmed up as a server would warm it: Warmup requests of
// random prefix lengths, half of them hits, each decided, executed and
// observed (ObservePrefill, ObserveTransfer) with measurement noise. The
// evaluation then asks it once per prefix length. Cold is the same
// question asked of a fresh arbiter, to show what calibration buys.
package arbitereval

import (
	"math"
	"math/rand/v2"
	"time"

	"github.com/mcbridge/mcbridge/internal/arbiter"
	"github.com/mcbridge/mcbridge/internal/preset"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Options sets the sweep; zero fields take the defaults noted.
type Options struct {
	Presets  []preset.Preset // bench-cpu and llama3-8b-gpu
	LinkGBps []float64       // 1, 2, 5, 10, 25, 50
	Latency  time.Duration   // per restore (10 µs)
	Prefixes []int           // cached prefix tokens: 1k, 2k, ..., 128k
	// Suffix is the tokens after the prefix that every prompt computes (64).
	Suffix      int
	BlockTokens int     // 256
	Warmup      int     // requests observed before the evaluation (64)
	Noise       float64 // log-normal sigma of observed times (0.05)
	Seed        uint64
}

func (o Options) withDefaults() Options {
	if len(o.Presets) == 0 {
		o.Presets = preset.All
	}
	if len(o.LinkGBps) == 0 {
		o.LinkGBps = []float64{1, 2, 5, 10, 25, 50}
	}
	if o.Latency == 0 {
		o.Latency = 10 * time.Microsecond
	}
	if len(o.Prefixes) == 0 {
		for n := 1 << 10; n <= 128<<10; n *= 2 {
			o.Prefixes = append(o.Prefixes, n)
		}
	}
	if o.Suffix == 0 {
		o.Suffix = 64
	}
	if o.BlockTokens == 0 {
		o.BlockTokens = 256
	}
	if o.Warmup == 0 {
		o.Warmup = 64
	}
	if o.Noise == 0 {
		o.Noise = 0.05
	}
	return o
}

// Point is one (preset, link, prefix) evaluation. Times are true TTFTs.
type Point struct {
	Preset       string        `json:"preset"`
	LinkGBps     float64       `json:"link_gbps"`
	PrefixTokens int           `json:"prefix_tokens"`
	PromptTokens int           `json:"prompt_tokens"`
	Arbiter      time.Duration `json:"arbiter_ns"`
	Restore      time.Duration `json:"restore_ns"`
	Recompute    time.Duration `json:"recompute_ns"`
	Cold         time.Duration `json:"cold_ns"` // a fresh arbiter's plan
	// RestoredBlocks is what the warmed-up arbiter chose to restore, of
	// PrefixTokens/BlockTokens.
	RestoredBlocks int `json:"restored_blocks"`
}

// Best is the faster of always-restore and always-recompute.
func (p Point) Best() time.Duration { return min(p.Restore, p.Recompute) }

// Ratio is the arbiter's TTFT over Best: 1.05 is the target's bound.
func (p Point) Ratio() float64 { return float64(p.Arbiter) / float64(p.Best()) }

// ColdRatio is a fresh arbiter's TTFT over Best.
func (p Point) ColdRatio() float64 { return float64(p.Cold) / float64(p.Best()) }

// truth is the real cost of plans for one preset and link.
type truth struct {
	p         preset.Preset
	bandwidth float64
	latency   time.Duration
	block     int
}

func (t truth) transfer(tokens int) time.Duration {
	if tokens == 0 {
		return 0
	}
	return t.latency + time.Duration(float64(int64(tokens)*t.p.KVBytesPerToken)/t.bandwidth*float64(time.Second))
}

// ttft is restoring k blocks, then computing the rest of a prompt.
func (t truth) ttft(k, prompt int) time.Duration {
	return t.transfer(k*t.block) + t.p.Prefill.Time(k*t.block, prompt)
}

// Evaluate runs the sweep.
func Evaluate(opt Options) ([]Point, error) {
	opt = opt.withDefaults()
	if opt.BlockTokens < 1 || opt.Suffix < 1 || opt.Warmup < 0 || opt.Noise < 0 {
		return nil, status.Errorf(status.InvalidArg, "arbitereval: options %+v", opt)
	}
	var out []Point
	for _, p := range opt.Presets {
		for _, gbps := range opt.LinkGBps {
			if !(gbps > 0) {
				return nil, status.Errorf(status.InvalidArg, "arbitereval: link of %g GB/s", gbps)
			}
			t := truth{p: p, bandwidth: gbps * 1e9, latency: opt.Latency, block: opt.BlockTokens}
			warm, err := warmArbiter(opt, t)
			if err != nil {
				return nil, err
			}
			cold, err := newArbiter()
			if err != nil {
				return nil, err
			}
			for _, prefix := range opt.Prefixes {
				out = append(out, evaluate(opt, t, warm, cold, prefix))
			}
		}
	}
	return out, nil
}

// link is the name every decision and observation uses: one peer.
const link = "peer"

// clock is an injected clock that each request moves by a second.
type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

func newArbiter() (*arbiter.Arbiter, error) {
	c := &clock{t: time.Unix(1_700_000_000, 0)}
	return arbiter.New(arbiter.Config{Policy: arbiter.CostModel, Now: c.now})
}

func input(opt Options, t truth, prefix int) arbiter.Input {
	return arbiter.Input{
		PromptTokens: prefix + opt.Suffix, BlockTokens: opt.BlockTokens, MatchedBlocks: prefix / opt.BlockTokens,
		KVBytesPerToken: t.p.KVBytesPerToken, Link: link,
	}
}

func evaluate(opt Options, t truth, warm, cold *arbiter.Arbiter, prefix int) Point {
	in := input(opt, t, prefix)
	d, c := warm.Decide(in), cold.Decide(in)
	usable := min(in.MatchedBlocks, (in.PromptTokens-1)/opt.BlockTokens)
	return Point{
		Preset: t.p.Name, LinkGBps: t.bandwidth / 1e9, PrefixTokens: prefix, PromptTokens: in.PromptTokens,
		Arbiter:        t.ttft(d.RestoreBlocks, in.PromptTokens),
		Restore:        t.ttft(usable, in.PromptTokens),
		Recompute:      t.ttft(0, in.PromptTokens),
		Cold:           t.ttft(c.RestoreBlocks, in.PromptTokens),
		RestoredBlocks: d.RestoreBlocks,
	}
}

// warmArbiter returns an arbiter that has served opt.Warmup requests:
// prefixes log-uniform over the evaluated range, half of them cached.
func warmArbiter(opt Options, t truth) (*arbiter.Arbiter, error) {
	c := &clock{t: time.Unix(1_700_000_000, 0)}
	a, err := arbiter.New(arbiter.Config{Policy: arbiter.CostModel, Now: c.now})
	if err != nil {
		return nil, err
	}
	rng := rand.New(rand.NewPCG(opt.Seed, uint64(t.bandwidth)^uint64(t.p.KVBytesPerToken)))
	lo, hi := math.Log(float64(opt.Prefixes[0])), math.Log(float64(opt.Prefixes[len(opt.Prefixes)-1]))
	noisy := func(d time.Duration) time.Duration {
		return time.Duration(float64(d) * math.Exp(opt.Noise*rng.NormFloat64()))
	}
	for range opt.Warmup {
		c.t = c.t.Add(time.Second)
		prefix := int(math.Exp(lo + (hi-lo)*rng.Float64()))
		in := input(opt, t, prefix)
		if rng.IntN(2) == 0 {
			in.MatchedBlocks = 0
		}
		d := a.Decide(in)
		restored := d.RestoreBlocks * opt.BlockTokens
		if restored > 0 {
			a.ObserveTransfer(link, int64(restored)*t.p.KVBytesPerToken, noisy(t.transfer(restored)))
		}
		a.ObservePrefill(restored, in.PromptTokens, noisy(t.p.Prefill.Time(restored, in.PromptTokens)))
	}
	return a, nil
}

// Summary is the sweep's worst cases, per preset and over all.
type Summary struct {
	Preset string `json:"preset"`
	Points int    `json:"points"`
	// Worst is the point where the arbiter is furthest above Best.
	Worst Point `json:"worst"`
	// Over5 counts points more than 5% above Best.
	Over5 int `json:"over_5pct"`
	// Worst ratios to Best of a fresh arbiter, always-restore and
	// always-recompute.
	ColdWorst      float64 `json:"cold_worst_ratio"`
	RestoreWorst   float64 `json:"restore_worst_ratio"`
	RecomputeWorst float64 `json:"recompute_worst_ratio"`
}

// Summarize groups points by preset; the last summary, named "all",
// covers every point.
func Summarize(points []Point) []Summary {
	var order []string
	by := map[string]*Summary{}
	add := func(name string, p Point) {
		s := by[name]
		if s == nil {
			s = &Summary{Preset: name, Worst: p}
			by[name] = s
			order = append(order, name)
		}
		s.Points++
		if p.Ratio() > s.Worst.Ratio() {
			s.Worst = p
		}
		if p.Ratio() > 1.05 {
			s.Over5++
		}
		s.ColdWorst = max(s.ColdWorst, p.ColdRatio())
		s.RestoreWorst = max(s.RestoreWorst, float64(p.Restore)/float64(p.Best()))
		s.RecomputeWorst = max(s.RecomputeWorst, float64(p.Recompute)/float64(p.Best()))
	}
	for _, p := range points {
		add(p.Preset, p)
	}
	for _, p := range points {
		add("all", p)
	}
	out := make([]Summary, 0, len(order))
	for _, name := range order {
		out = append(out, *by[name])
	}
	return out
}
