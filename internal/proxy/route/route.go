// Package route chooses which upstream llama-server of a proxy serves a
// request: the one with the lowest expected time to first token (TTFT).
//
// For each upstream the estimate is
//
//	TTFT = wait + busy + own
//
// own is the request's own prefill there: computing from the prefix a slot
// of that upstream already holds, or restoring the swarm's prefix into it
// and computing the rest, whichever the cost model says is faster (the
// restore estimate comes from the bridge's arbiter and is corrected per
// upstream by what its restores really took). busy is the prefill the
// requests already sent there still have to do: they share the device. wait
// is, when every slot is taken, the time until enough of them free up. Both
// grow with what an upstream already has, so a hot server stops winning
// once its queue costs more than moving the prefix elsewhere (the shape of
// Dynamo's KV router and llm-d's scorers: prefix overlap against load).
//
// The router is deterministic: the clock is injected, it starts no
// goroutines, and equal inputs give equal choices (ties go to the upstream
// with fewer requests in flight, then to the lower index). Every choice
// carries its reason and the costs it compared, for the proxy's debug log
// and its metrics. Health checks and failed requests take upstreams out of
// the rotation; consecutive good checks bring them back.
package route

import (
	"fmt"
	"math"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/mcbridge/mcbridge/internal/arbiter"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Policy is how the router chooses.
type Policy int

const (
	// CacheAware chooses by expected TTFT (the package comment).
	CacheAware Policy = iota
	// RoundRobin takes the healthy upstreams in turn, ignoring prefixes.
	RoundRobin
	// LeastLoaded takes the healthy upstream with the fewest requests in
	// flight, ignoring prefixes.
	LeastLoaded
)

var policyNames = [...]string{CacheAware: "cache-aware", RoundRobin: "round-robin", LeastLoaded: "least-loaded"}

func (p Policy) String() string {
	if p >= 0 && int(p) < len(policyNames) {
		return policyNames[p]
	}
	return fmt.Sprintf("policy(%d)", int(p))
}

// ParsePolicy reads a policy's name.
func ParsePolicy(s string) (Policy, error) {
	for i, n := range policyNames {
		if n == s {
			return Policy(i), nil
		}
	}
	return 0, status.Errorf(status.Config, "route: unknown policy %q (want %s)", s, strings.Join(policyNames[:], ", "))
}

// Reason says why an upstream was chosen.
type Reason int

const (
	// None: no upstream could take the request.
	None Reason = iota
	// Only: one upstream could take it.
	Only
	// Prefix: a slot of it holds the prompt's longest prefix; nothing moves.
	Prefix
	// Restore: it restores the prefix from the swarm fastest.
	Restore
	// Spread: the upstream fastest when idle was busier; this one wins with
	// its queue counted.
	Spread
	// Load: no upstream holds any of the prompt (or its tokens are
	// unknown): the least loaded wins.
	Load
	// RoundRobinTurn and LeastLoadedPick are the choices of those policies.
	RoundRobinTurn
	LeastLoadedPick
	// LastResort: every upstream that could take it was out of the
	// rotation; this one is tried anyway (a server back from a restart is
	// not refused for the health checks it takes to be readmitted).
	LastResort
)

// Reasons are every reason, in the order metrics list them.
var Reasons = []Reason{None, Only, Prefix, Restore, Spread, Load, RoundRobinTurn, LeastLoadedPick, LastResort}

var reasonNames = [...]string{None: "none", Only: "only", Prefix: "prefix", Restore: "restore", Spread: "spread",
	Load: "load", RoundRobinTurn: "round_robin", LeastLoadedPick: "least_loaded", LastResort: "last_resort"}

func (r Reason) String() string {
	if r >= 0 && int(r) < len(reasonNames) {
		return reasonNames[r]
	}
	return fmt.Sprintf("reason(%d)", int(r))
}

// Config configures a Router. The zero value is usable.
type Config struct {
	Policy Policy
	// DecodePrior is the time per generated token assumed for an upstream
	// before any of its answers is observed (10 ms).
	DecodePrior time.Duration
	// Window is about how many recent observations a calibration weighs
	// (16); older ones fade geometrically.
	Window int
	// FailAfter is how many failed health checks in a row take an upstream
	// out of the rotation (1); a failed request does at once.
	FailAfter int
	// RecoverAfter is how many good health checks in a row bring it back
	// (2).
	RecoverAfter int
	// Now is the clock (time.Now).
	Now func() time.Time
}

// Candidate is what the proxy knows of one upstream for one request.
type Candidate struct {
	// Skip: this upstream cannot take the request (another model, not
	// learned yet, or it failed this request already).
	Skip bool
	// Slots is the upstream's slot count (0 until learned: taken as 1).
	Slots int
	// Cached is how many leading prompt tokens the slot the request would
	// get there already holds, by the proxy's account of it.
	Cached int
	// CanRestore: the proxy (or the server itself) restores into it.
	CanRestore bool
}

// Request is one request's routing problem.
type Request struct {
	// Prompt is the prompt's token count; 0 when it is not known (the
	// choice then goes by load only).
	Prompt int
	// Predict is how many tokens the answer is expected to generate.
	Predict int
	// Restorable is how many leading prompt tokens the swarm can restore
	// (whole blocks, at least one token left to compute).
	Restorable int
	// RestoreTTFT is the arbiter's estimate of the TTFT restoring them: the
	// transfer plus computing the rest.
	RestoreTTFT time.Duration
	// Prefill is the calibrated prefill cost.
	Prefill arbiter.PrefillCost
	// Candidates has one entry per upstream.
	Candidates []Candidate
}

// Cost is one upstream's estimate, for the log line.
type Cost struct {
	Skip     bool // not a candidate (skipped or down)
	Start    int  // tokens in place before computing
	Restore  bool // restoring beats computing from what it holds
	InFlight int
	Wait     time.Duration
	Busy     time.Duration
	Own      time.Duration
	Total    time.Duration
}

// Choice is the router's answer. Done must be called with its Ticket once
// the request has its answer (or failed).
type Choice struct {
	Upstream int
	Reason   Reason
	Restore  bool // the estimate counted on a restore into it
	Start    int  // tokens in place there before computing
	Est      time.Duration
	Costs    []Cost
	Ticket   Ticket
}

// String reads as a log line: the choice, its reason and every cost.
func (c Choice) String() string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "upstream %d (%s): est %s, start %d", c.Upstream, c.Reason, c.Est.Round(time.Microsecond), c.Start)
	if c.Restore {
		sb.WriteString(" restored")
	}
	for i, k := range c.Costs {
		if k.Skip {
			fmt.Fprintf(&sb, "; %d: out", i)
			continue
		}
		fmt.Fprintf(&sb, "; %d: %s = wait %s + busy %s + own %s (start %d", i, k.Total.Round(time.Microsecond),
			k.Wait.Round(time.Microsecond), k.Busy.Round(time.Microsecond), k.Own.Round(time.Microsecond), k.Start)
		if k.Restore {
			sb.WriteString(", restore")
		}
		fmt.Fprintf(&sb, ", %d in flight)", k.InFlight)
	}
	return sb.String()
}

// Ticket names a request in flight.
type Ticket uint64

// Outcome is what a request's answer said, for the calibrations.
type Outcome struct {
	// Failed: the upstream did not answer (refused, reset): it leaves the
	// rotation until its health checks pass again.
	Failed bool
	// Predicted tokens were generated in Decode.
	Predicted int
	Decode    time.Duration
	// Restored tokens were restored in RestoreTook (0: no restore).
	Restored    int
	RestoreTook time.Duration
}

// Router chooses upstreams. It is safe for concurrent use.
type Router struct {
	cfg Config

	mu     sync.Mutex
	ups    []upstream
	rr     int // the next upstream round-robin considers
	ticket Ticket
	work   map[Ticket]*work
}

type upstream struct {
	down       bool
	good, bad  int     // consecutive health results
	decode     float64 // seconds per generated token, calibrated
	restoreFix float64 // measured over estimated restore time, calibrated
	inFlight   int
}

// work is a request in flight, with the estimates it was sent with.
type work struct {
	upstream    int
	prefillEnds time.Time // when its first token is expected
	predict     int
	restoreEst  time.Duration // the transfer part of its estimate, for restoreFix
}

const (
	defaultDecodePrior = 10 * time.Millisecond
	defaultWindow      = 16
	// restoreFix stays within these bounds: one odd restore (a page fault
	// storm, a descheduled server) must not rule an upstream out for good.
	minRestoreFix, maxRestoreFix = 0.25, 64
)

// New is a router over n upstreams, all in the rotation.
func New(cfg Config, n int) (*Router, error) {
	if n < 1 {
		return nil, status.Errorf(status.Config, "route: %d upstreams", n)
	}
	if cfg.Policy < CacheAware || cfg.Policy > LeastLoaded {
		return nil, status.Errorf(status.Config, "route: unknown policy %d", int(cfg.Policy))
	}
	if cfg.DecodePrior < 0 || cfg.Window < 0 || cfg.FailAfter < 0 || cfg.RecoverAfter < 0 {
		return nil, status.Errorf(status.Config, "route: negative setting in %+v", cfg)
	}
	if cfg.DecodePrior == 0 {
		cfg.DecodePrior = defaultDecodePrior
	}
	if cfg.Window == 0 {
		cfg.Window = defaultWindow
	}
	if cfg.FailAfter == 0 {
		cfg.FailAfter = 1
	}
	if cfg.RecoverAfter == 0 {
		cfg.RecoverAfter = 2
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	r := &Router{cfg: cfg, ups: make([]upstream, n), work: map[Ticket]*work{}}
	for i := range r.ups {
		r.ups[i] = upstream{decode: cfg.DecodePrior.Seconds(), restoreFix: 1}
	}
	return r, nil
}

// Policy is the router's policy.
func (r *Router) Policy() Policy { return r.cfg.Policy }

// Len is the number of upstreams.
func (r *Router) Len() int { return len(r.ups) }

// Choose picks the upstream for req and counts the request in flight there
// until Done. With no upstream able to take it, the reason is None and the
// error says why.
func (r *Router) Choose(req Request) (Choice, error) {
	if len(req.Candidates) != len(r.ups) {
		return Choice{Reason: None}, status.Errorf(status.InvalidArg, "route: %d candidates for %d upstreams", len(req.Candidates), len(r.ups))
	}
	if req.Prompt < 0 || req.Predict < 0 || req.Restorable < 0 || req.RestoreTTFT < 0 {
		return Choice{Reason: None}, status.Errorf(status.InvalidArg, "route: negative request %+v", req)
	}
	now := r.cfg.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	costs := make([]Cost, len(r.ups))
	eligible, lastResort := 0, false
	for pass := 0; pass < 2 && eligible == 0; pass++ {
		// The second pass, when every candidate is out of the rotation,
		// takes them as they are.
		lastResort = pass == 1
		for i := range r.ups {
			c := &req.Candidates[i]
			if c.Skip || (r.ups[i].down && !lastResort) {
				costs[i] = Cost{Skip: true}
				continue
			}
			eligible++
			costs[i] = r.cost(i, c, &req, now)
		}
	}
	if eligible == 0 {
		return Choice{Upstream: -1, Reason: None, Costs: costs}, status.Errorf(status.Transfer, "no upstream left to try")
	}
	var pick int
	var reason Reason
	switch r.cfg.Policy {
	case RoundRobin:
		pick, reason = r.roundRobin(costs), RoundRobinTurn
	case LeastLoaded:
		pick, reason = argmin(costs, func(k *Cost) float64 { return float64(k.InFlight) }), LeastLoadedPick
	default:
		pick = argmin(costs, func(k *Cost) float64 { return k.Total.Seconds() })
		reason = r.reason(costs, pick, &req, eligible)
	}
	if lastResort {
		reason = LastResort
	}
	k := costs[pick]
	ch := Choice{Upstream: pick, Reason: reason, Restore: k.Restore, Start: k.Start, Est: k.Total, Costs: costs}
	r.ticket++
	ch.Ticket = r.ticket
	w := &work{upstream: pick, prefillEnds: now.Add(k.Wait + k.Busy + k.Own), predict: req.Predict}
	if k.Restore {
		w.restoreEst = r.restoreTransfer(&req)
	}
	r.work[ch.Ticket] = w
	r.ups[pick].inFlight++
	return ch, nil
}

// cost estimates upstream i's TTFT for req.
func (r *Router) cost(i int, c *Candidate, req *Request, now time.Time) Cost {
	u := &r.ups[i]
	k := Cost{InFlight: u.inFlight}
	var ends []time.Duration
	for _, w := range r.work {
		if w.upstream != i {
			continue
		}
		left := max(w.prefillEnds.Sub(now), 0)
		k.Busy += left
		ends = append(ends, left+seconds(float64(w.predict)*u.decode))
	}
	// Every slot taken: the request waits until one frees, the k-th
	// soonest when k-1 others queue before it.
	slots := max(c.Slots, 1)
	if queued := u.inFlight - slots; queued >= 0 && len(ends) > 0 {
		sort.Slice(ends, func(a, b int) bool { return ends[a] < ends[b] })
		k.Wait = ends[min(queued, len(ends)-1)]
	}
	if req.Prompt > 0 {
		cached := min(c.Cached, req.Prompt)
		k.Start, k.Own = cached, req.Prefill.Time(cached, req.Prompt)
		if c.CanRestore && req.Restorable > cached && req.Restorable < req.Prompt {
			alt := seconds(r.restoreTransfer(req).Seconds()*u.restoreFix) + req.Prefill.Time(req.Restorable, req.Prompt)
			if alt < k.Own {
				k.Start, k.Own, k.Restore = req.Restorable, alt, true
			}
		}
	}
	k.Total = k.Wait + k.Busy + k.Own
	return k
}

// restoreTransfer is the transfer part of the arbiter's restore estimate.
func (r *Router) restoreTransfer(req *Request) time.Duration {
	return max(req.RestoreTTFT-req.Prefill.Time(req.Restorable, req.Prompt), 0)
}

// reason explains a cache-aware pick: Spread when the load moved it away
// from the upstream that would be fastest if nothing were in flight.
func (r *Router) reason(costs []Cost, pick int, req *Request, eligible int) Reason {
	if eligible == 1 {
		return Only
	}
	if req.Prompt == 0 {
		return Load
	}
	idle := argmin(costs, func(k *Cost) float64 { return k.Own.Seconds() })
	k := costs[pick]
	switch {
	case idle != pick && costs[idle].Own < k.Own:
		return Spread
	case k.Restore:
		return Restore
	case k.Start > 0:
		return Prefix
	}
	return Load
}

// roundRobin takes the next eligible upstream from the cursor on.
func (r *Router) roundRobin(costs []Cost) int {
	n := len(costs)
	for j := 0; j < n; j++ {
		i := (r.rr + j) % n
		if !costs[i].Skip {
			r.rr = (i + 1) % n
			return i
		}
	}
	return -1 // unreachable: the caller checked that one is eligible
}

// argmin is the eligible upstream minimizing f; ties go to fewer requests
// in flight, then to the lower index.
func argmin(costs []Cost, f func(*Cost) float64) int {
	best := -1
	for i := range costs {
		k := &costs[i]
		if k.Skip {
			continue
		}
		if best < 0 {
			best = i
			continue
		}
		b := &costs[best]
		if v, w := f(k), f(b); v < w || (v == w && k.InFlight < b.InFlight) {
			best = i
		}
	}
	return best
}

// Done ends a request in flight and feeds the calibrations with what its
// answer said. Unknown tickets are ignored (Done twice).
func (r *Router) Done(t Ticket, o Outcome) {
	r.mu.Lock()
	defer r.mu.Unlock()
	w, ok := r.work[t]
	if !ok {
		return
	}
	delete(r.work, t)
	u := &r.ups[w.upstream]
	u.inFlight--
	if o.Failed {
		u.down, u.bad, u.good = true, r.cfg.FailAfter, 0
		return
	}
	a := 1 / float64(r.cfg.Window)
	if o.Predicted > 0 && o.Decode > 0 {
		u.decode += a * (o.Decode.Seconds()/float64(o.Predicted) - u.decode)
	}
	if o.Restored > 0 && o.RestoreTook > 0 && w.restoreEst > 0 {
		fix := math.Min(math.Max(o.RestoreTook.Seconds()/w.restoreEst.Seconds(), minRestoreFix), maxRestoreFix)
		u.restoreFix += a * (fix - u.restoreFix)
	}
}

// Health records one health check of upstream i and says whether it is in
// the rotation now and whether that changed.
func (r *Router) Health(i int, ok bool) (up, changed bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	u := &r.ups[i]
	was := !u.down
	if ok {
		u.good, u.bad = u.good+1, 0
		if u.down && u.good >= r.cfg.RecoverAfter {
			u.down = false
		}
	} else {
		u.bad, u.good = u.bad+1, 0
		if !u.down && u.bad >= r.cfg.FailAfter {
			u.down = true
		}
	}
	return !u.down, was != !u.down
}

// State is one upstream as the router sees it.
type State struct {
	Up       bool
	InFlight int
	// DecodePerToken and RestoreFix are the calibrations.
	DecodePerToken time.Duration
	RestoreFix     float64
}

// States reports every upstream.
func (r *Router) States() []State {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]State, len(r.ups))
	for i, u := range r.ups {
		out[i] = State{Up: !u.down, InFlight: u.inFlight, DecodePerToken: seconds(u.decode), RestoreFix: u.restoreFix}
	}
	return out
}

func seconds(s float64) time.Duration {
	if s <= 0 || math.IsNaN(s) {
		return 0
	}
	if s > float64(math.MaxInt64)/1e9 {
		return math.MaxInt64
	}
	return time.Duration(s * 1e9)
}
