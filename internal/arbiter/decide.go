package arbiter

import (
	"fmt"
	"strings"
	"time"

	"github.com/mcbridge/mcbridge/internal/status"
)

// Policy selects how a decision is made. Benchmarks compare all three.
type Policy int

const (
	CostModel       Policy = iota // minimise the estimated time to first token
	AlwaysRestore                 // restore every usable matched block
	AlwaysRecompute               // restore nothing
)

var policyNames = [...]string{
	CostModel:       "cost-model",
	AlwaysRestore:   "always-restore",
	AlwaysRecompute: "always-recompute",
}

func (p Policy) String() string {
	if p >= 0 && int(p) < len(policyNames) {
		return policyNames[p]
	}
	return fmt.Sprintf("policy(%d)", int(p))
}

// ParsePolicy reads a policy by its String form.
func ParsePolicy(s string) (Policy, error) {
	for p, name := range policyNames {
		if s == name {
			return Policy(p), nil
		}
	}
	return 0, status.Errorf(status.Config, "arbiter: unknown policy %q (want %s)", s, strings.Join(policyNames[:], ", "))
}

// ReasonCode says why a decision came out as it did.
type ReasonCode int

const (
	NoMatch          ReasonCode = iota // no leading block of the prompt is cached
	TooShort                           // no whole block fits before the one token that must be computed
	Restore                            // restoring is estimated faster
	RecomputeCheaper                   // recomputing is estimated faster
	_                                  // 4: a split plan (compute the head while restoring the tail), which no host could place
	PolicyForced                       // the policy chose, not the cost model
	InvalidInput                       // the input cannot describe a prompt; nothing is restored
	Local                              // the host's own cache holds as much, or computing the rest of it is cheaper
)

var reasonNames = [...]string{
	NoMatch:          "no-match",
	TooShort:         "too-short",
	Restore:          "restore",
	RecomputeCheaper: "recompute-cheaper",
	PolicyForced:     "policy-forced",
	InvalidInput:     "invalid-input",
	Local:            "local",
}

func (r ReasonCode) String() string {
	if r >= 0 && int(r) < len(reasonNames) && reasonNames[r] != "" {
		return reasonNames[r]
	}
	return fmt.Sprintf("reason(%d)", int(r))
}

// Input describes one prompt against the cache.
type Input struct {
	PromptTokens    int    // P: tokens in the prompt
	BlockTokens     int    // B: tokens per block
	MatchedBlocks   int    // m: leading blocks found in the cache
	KVBytesPerToken int64  // KV bytes one token occupies, all layers: 0 for a memory that is all FixedBytes
	Link            string // the source the blocks come from, e.g. "local" or a peer segment
	// CachedTokens is how many leading tokens the host already holds,
	// computed under the same scope: a restore replaces them, so it must
	// beat computing only the rest.
	CachedTokens int
	// FixedBytes is what a restore moves besides the blocks, whatever
	// their number: the snapshot of a model's partial state.
	FixedBytes int64
}

// Decision is the plan for one prompt: restore blocks [0, RestoreBlocks),
// then compute positions [RestoreBlocks·B, P). A plan that computes the
// first blocks while later ones are restored is not made: llama.cpp's own
// state restore, which every host runs, always starts at position 0.
type Decision struct {
	RestoreBlocks int
	MatchedBlocks int
	Policy        Policy
	Reason        ReasonCode
	EstRestore    time.Duration // time to first token restoring every usable block
	EstRecompute  time.Duration // time to first token computing the whole prompt
	EstTotal      time.Duration // time to first token of this plan
	// Deadline is how long the restore may take before the host gives it
	// up and computes instead (Config.DeadlineFactor): zero when nothing is
	// restored or the policy, not the cost model, chose the restore; the
	// host's own transfer deadline applies then.
	Deadline time.Duration
}

// String reads as a log line, e.g.
// "restore 12/12 blocks: est 4.1ms vs recompute 310ms".
func (d Decision) String() string {
	est := func(x time.Duration) string { return round3(x).String() }
	switch d.Reason {
	case InvalidInput:
		return "recompute: invalid input"
	case NoMatch:
		return "recompute: no cached blocks: est " + est(d.EstTotal)
	case Local:
		return fmt.Sprintf("local: the host's own cache wins over restoring %d blocks: est %s vs restore %s", d.MatchedBlocks, est(d.EstTotal), est(d.EstRestore))
	case TooShort:
		return fmt.Sprintf("recompute 0/%d blocks: no whole block before the last token: est %s", d.MatchedBlocks, est(d.EstTotal))
	}
	forced := ""
	if d.Reason == PolicyForced {
		forced = " (" + d.Policy.String() + ")"
	}
	if d.RestoreBlocks == 0 {
		return fmt.Sprintf("recompute 0/%d blocks%s: est %s vs restore %s", d.MatchedBlocks, forced, est(d.EstTotal), est(d.EstRestore))
	}
	return fmt.Sprintf("restore %d/%d blocks%s: est %s vs recompute %s", d.RestoreBlocks, d.MatchedBlocks, forced, est(d.EstTotal), est(d.EstRecompute))
}

// round3 keeps three significant digits, enough for a log line.
func round3(d time.Duration) time.Duration {
	unit := time.Duration(1)
	for d/unit >= 1000 && unit < time.Hour {
		unit *= 10
	}
	return d.Round(unit)
}

// Decide plans the prompt described by in. It never restores more than
// MatchedBlocks blocks and always leaves at least one token to compute, for
// llama.cpp state carries no logits.
func (a *Arbiter) Decide(in Input) Decision {
	d := Decision{MatchedBlocks: in.MatchedBlocks, Policy: a.cfg.Policy}
	if in.PromptTokens < 1 || in.PromptTokens > MaxPromptTokens || in.BlockTokens < 1 ||
		in.MatchedBlocks < 0 || in.KVBytesPerToken < 0 || in.FixedBytes < 0 || in.KVBytesPerToken+in.FixedBytes == 0 || in.CachedTokens < 0 || in.CachedTokens > in.PromptTokens {
		d.Reason = InvalidInput
		return d
	}
	now := a.cfg.Now()
	a.mu.Lock()
	prefill := a.prefill.theta
	link := a.linkVec(in.Link, now)
	a.mu.Unlock()

	c := newPlan(in.PromptTokens, in.BlockTokens, prefill, link[0]+link[1]*float64(in.FixedBytes), link[1]*float64(in.BlockTokens)*float64(in.KVBytesPerToken))
	usable := min(in.MatchedBlocks, (in.PromptTokens-1)/in.BlockTokens, MaxSearchBlocks)
	recompute := c.sequential(0)
	restore := c.sequential(usable)
	d.EstRecompute, d.EstRestore = seconds(recompute), seconds(restore)
	// Blocks the host holds already are restored only by a plan that goes
	// past them; anything shorter is the host's own cache, for free.
	held := in.CachedTokens / in.BlockTokens
	local := c.tailTokens(in.CachedTokens)

	switch {
	case (in.PromptTokens-1)/in.BlockTokens == 0:
		d.Reason, d.EstTotal = TooShort, seconds(local)
	case in.MatchedBlocks == 0:
		d.Reason, d.EstTotal = NoMatch, seconds(local)
	case usable <= held:
		d.Reason, d.EstTotal = Local, seconds(local)
	case a.cfg.Policy == AlwaysRestore:
		d.Reason, d.RestoreBlocks, d.EstTotal = PolicyForced, usable, d.EstRestore
	case a.cfg.Policy == AlwaysRecompute:
		d.Reason, d.EstTotal = PolicyForced, seconds(local)
	default:
		k, t := c.bestSequential(held+1, usable, local)
		d.RestoreBlocks, d.EstTotal = k, seconds(t)
		switch {
		case k > 0:
			d.Reason = Restore
		case in.CachedTokens > 0:
			d.Reason = Local
		default:
			d.Reason = RecomputeCheaper
		}
		d.Deadline = a.deadline(&c, k, local)
	}
	return d
}

// deadline is the time a plan restoring k blocks may spend on that
// restore: DeadlineFactor times its estimate, but never more than the
// compute it saves (past that, the plan is worse than computing from what
// the host holds, which costs local), plus DeadlineMargin. Zero when the
// plan restores nothing.
func (a *Arbiter) deadline(c *plan, k int, local float64) time.Duration {
	if k == 0 {
		return 0
	}
	saves := local - c.tail(k)
	return seconds(min(a.cfg.DeadlineFactor*c.restore(k), saves)) + a.cfg.DeadlineMargin
}

// plan evaluates candidate plans for one prompt, in seconds. It holds the
// prefill model of PrefillCost expanded in blocks, so that a candidate costs
// a few flops: with c = [c0, c1, c2] and k >= 1 blocks,
//
//	compute(0, kB) = c0 + c1·B·k + c2·B²/2·k²
//	compute(kB, P) = compute(0, P) - c1·B·k - c2·B²/2·k²
type plan struct {
	theta    vec     // the prefill model, per token
	whole    float64 // compute(0, P)
	linear   float64 // c1·B
	square   float64 // c2·B²/2
	latency  float64 // per transfer batch
	perBlock float64 // transfer time per block, latency excluded
}

func newPlan(prompt, block int, prefill vec, latency, perBlock float64) plan {
	b := float64(block)
	return plan{
		theta:    prefill,
		whole:    prefill.dot(prefillFeatures(0, prompt)),
		linear:   prefill[1] * b,
		square:   prefill[2] * b * b / 2,
		latency:  latency,
		perBlock: perBlock,
	}
}

// tail is compute(kB, P), for kB < P.
func (c *plan) tail(k int) float64 {
	x := float64(k)
	return c.whole - x*(c.linear+x*c.square)
}

func (c *plan) restore(blocks int) float64 {
	if blocks == 0 {
		return 0
	}
	return c.latency + float64(blocks)*c.perBlock
}

// tailTokens is compute(n, P) for n tokens already in place: every token
// when n is 0.
func (c *plan) tailTokens(n int) float64 {
	if n == 0 {
		return c.whole
	}
	x := float64(n)
	return c.whole - x*(c.theta[1]+x*c.theta[2]/2)
}

// sequential is restore k blocks, then compute the rest.
func (c *plan) sequential(k int) float64 { return c.restore(k) + c.tail(k) }

// bestSequential searches every k in [from, usable] against restoring
// nothing, which costs base. Under this model the optimum is at an end
// (restore cost is linear in k, the compute saved is concave), but the scan
// costs a few nanoseconds per block and stays exact whatever the
// calibration does. Ties go to fewer blocks.
func (c *plan) bestSequential(from, usable int, base float64) (int, float64) {
	bestK, best := 0, base
	for k := max(from, 1); k <= usable; k++ {
		if t := c.sequential(k); t < best {
			bestK, best = k, t
		}
	}
	return bestK, best
}
