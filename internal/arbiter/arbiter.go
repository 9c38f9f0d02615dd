// Package arbiter decides, for one prompt, how many of its cached leading
// blocks to restore and how many to recompute, from a cost model of prefill
// and of each transfer link that it calibrates online from observed times.
//
// It is deterministic (the clock is injected, no goroutines), cheap enough
// to call on every prompt, and explains every decision in its log line.
package arbiter

import (
	"math"
	"sync"
	"time"

	"github.com/mcbridge/mcbridge/internal/status"
)

// Limits on what the arbiter accepts. Inputs beyond them are garbage, not
// workloads: no llama.cpp context holds 2^24 tokens.
const (
	MaxPromptTokens = 1 << 24
	// MaxSearchBlocks caps the restore search; a match longer than this
	// restores at most its first MaxSearchBlocks blocks.
	MaxSearchBlocks = 1 << 16
	// MaxTransferBytes bounds an observed transfer (1 PiB).
	MaxTransferBytes = 1 << 50
	// maxLinks bounds the per-link calibration state; peers come and go, so
	// the least recently measured link is forgotten first.
	maxLinks = 1024
)

// Config selects the policy and seeds the cost model. The zero value is
// usable: every zero field takes its documented default.
type Config struct {
	Policy Policy
	// Prefill is the prefill cost before any observation (DefaultPrefill).
	Prefill PrefillCost
	// DefaultLink is assumed for any link not named in Links (DefaultLink).
	DefaultLink Link
	// Links holds per-link costs known before any observation.
	Links map[string]Link
	// Window is about how many recent observations a calibration weighs
	// (64); older ones fade geometrically.
	Window int
	// LinkExpiry is how long a link's calibration lasts without a new
	// measurement (10 minutes); then the link is assumed at its configured
	// cost again and relearned from its next transfer. A link believed slow
	// is not used, so not measured: without expiry a congestion once seen
	// would keep the arbiter off that link for good.
	LinkExpiry time.Duration
	// DeadlineFactor and DeadlineMargin give a restore its deadline
	// (Decision.Deadline): DeadlineFactor times its estimated time, but no
	// more than the compute it saves, plus DeadlineMargin. A holder that
	// hangs so costs the request that waits on it little more than
	// recomputing would have: the margin and a few estimated restores.
	// DeadlineFactor (4) is at least 1; the margin (zero here; the bridge
	// configures 50 ms) covers what no link calibration sees: scheduling on
	// a loaded host, a first contact's handshake.
	DeadlineFactor float64
	DeadlineMargin time.Duration
	// Now is the clock (time.Now).
	Now func() time.Time
}

const (
	defaultWindow         = 64
	defaultLinkExpiry     = 10 * time.Minute
	defaultDeadlineFactor = 4
)

func (c Config) withDefaults() Config {
	if c.Prefill == (PrefillCost{}) {
		c.Prefill = DefaultPrefill
	}
	if c.DefaultLink == (Link{}) {
		c.DefaultLink = DefaultLink
	}
	if c.Window == 0 {
		c.Window = defaultWindow
	}
	if c.LinkExpiry == 0 {
		c.LinkExpiry = defaultLinkExpiry
	}
	if c.DeadlineFactor == 0 {
		c.DeadlineFactor = defaultDeadlineFactor
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return c
}

func (c Config) validate() error {
	if c.Policy < CostModel || c.Policy > AlwaysRecompute {
		return status.Errorf(status.Config, "arbiter: unknown policy %d", int(c.Policy))
	}
	p := c.Prefill
	for _, v := range []float64{p.Fixed, p.PerToken, p.PerContext} {
		if !(v >= 0) || math.IsInf(v, 0) {
			return status.Errorf(status.Config, "arbiter: prefill cost %+v: coefficients must be finite and >= 0", p)
		}
	}
	if !(p.PerToken > 0) {
		return status.Errorf(status.Config, "arbiter: prefill cost %+v: PerToken must be > 0", p)
	}
	if err := validLink("default", c.DefaultLink); err != nil {
		return err
	}
	for name, l := range c.Links {
		if err := validLink(name, l); err != nil {
			return err
		}
	}
	if c.Window < 1 {
		return status.Errorf(status.Config, "arbiter: window %d must be >= 1", c.Window)
	}
	if c.LinkExpiry < 0 {
		return status.Errorf(status.Config, "arbiter: link expiry %v must be >= 0", c.LinkExpiry)
	}
	if !(c.DeadlineFactor >= 1) || math.IsInf(c.DeadlineFactor, 0) {
		return status.Errorf(status.Config, "arbiter: deadline factor %v must be finite and >= 1", c.DeadlineFactor)
	}
	if c.DeadlineMargin < 0 {
		return status.Errorf(status.Config, "arbiter: deadline margin %v must be >= 0", c.DeadlineMargin)
	}
	return nil
}

func validLink(name string, l Link) error {
	if !(l.Bandwidth > 0) || math.IsInf(l.Bandwidth, 0) || l.Latency < 0 {
		return status.Errorf(status.Config, "arbiter: link %q %+v: bandwidth must be finite and > 0, latency >= 0", name, l)
	}
	return nil
}

// Arbiter is safe for concurrent use: llama-server slots call it from
// several threads. One mutex guards the calibration; a decision holds it
// only to read the coefficients.
type Arbiter struct {
	cfg Config

	mu      sync.Mutex
	prefill fit
	links   map[string]*linkFit
}

type linkFit struct {
	fit
	measured time.Time // last observation, for expiry and eviction
}

// New returns an arbiter. It fails with status.Config on a policy it does
// not know or a cost that is negative, zero where it must not be, or not
// finite.
func New(cfg Config) (*Arbiter, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	links := make(map[string]Link, len(cfg.Links))
	for name, l := range cfg.Links {
		links[name] = l
	}
	cfg.Links = links
	return &Arbiter{
		cfg:     cfg,
		prefill: newFit(3, cfg.Prefill.vec(), prefillFloor, cfg.Window),
		links:   make(map[string]*linkFit),
	}, nil
}

// Policy is the policy the arbiter was configured with.
func (a *Arbiter) Policy() Policy { return a.cfg.Policy }

// ObservePrefill calibrates the prefill model from one prefill call that
// computed positions [start, end) in d. Observations that cannot be real
// (an empty or negative range, d <= 0, end beyond MaxPromptTokens) are
// ignored.
func (a *Arbiter) ObservePrefill(start, end int, d time.Duration) {
	if start < 0 || end <= start || end > MaxPromptTokens || d <= 0 {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.prefill.observe(prefillFeatures(start, end), d.Seconds())
}

// ObserveTransfer calibrates link from one transfer batch of bytes that took
// d. Observations with bytes <= 0, bytes > MaxTransferBytes or d <= 0 are
// ignored.
func (a *Arbiter) ObserveTransfer(link string, bytes int64, d time.Duration) {
	if bytes <= 0 || bytes > MaxTransferBytes || d <= 0 {
		return
	}
	now := a.cfg.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	lf := a.liveLink(link, now)
	if lf == nil {
		lf = a.newLinkFit(link, now)
	}
	lf.measured = now
	lf.observe(linkFeatures(bytes), d.Seconds())
}

// newLinkFit starts calibrating link, forgetting the least recently
// measured link when the table is full (ties broken by name, so eviction is
// deterministic).
func (a *Arbiter) newLinkFit(link string, now time.Time) *linkFit {
	if len(a.links) >= maxLinks {
		var oldest *linkFit
		var oldestName string
		for name, lf := range a.links {
			if oldest == nil || lf.measured.Before(oldest.measured) || (lf.measured.Equal(oldest.measured) && name < oldestName) {
				oldest, oldestName = lf, name
			}
		}
		delete(a.links, oldestName)
	}
	lf := &linkFit{fit: newFit(2, a.linkPrior(link).vec(), linkFloor, a.cfg.Window), measured: now}
	a.links[link] = lf
	return lf
}

func (a *Arbiter) linkPrior(link string) Link {
	if l, ok := a.cfg.Links[link]; ok {
		return l
	}
	return a.cfg.DefaultLink
}

// liveLink is link's calibration, or nil when it has none or it expired.
// The caller holds a.mu.
func (a *Arbiter) liveLink(link string, now time.Time) *linkFit {
	lf := a.links[link]
	if lf == nil || now.Sub(lf.measured) <= a.cfg.LinkExpiry {
		return lf
	}
	delete(a.links, link)
	return nil
}

// Calibrated says whether link has a measurement of its own that has not
// expired: until it has, its estimates are the configured prior's.
func (a *Arbiter) Calibrated(link string) bool {
	now := a.cfg.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.liveLink(link, now) != nil
}

// linkVec is link's current coefficients [latency s, s per byte]. The
// caller holds a.mu.
func (a *Arbiter) linkVec(link string, now time.Time) vec {
	if lf := a.liveLink(link, now); lf != nil {
		return lf.theta
	}
	return a.linkPrior(link).vec()
}

// PrefillTime is the calibrated estimate of prefilling [start, end).
func (a *Arbiter) PrefillTime(start, end int) time.Duration {
	a.mu.Lock()
	defer a.mu.Unlock()
	return seconds(a.prefill.predict(prefillFeatures(start, end)))
}

// TransferTime is the calibrated estimate of moving bytes over link in one
// batch; zero when bytes <= 0.
func (a *Arbiter) TransferTime(link string, bytes int64) time.Duration {
	now := a.cfg.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	return seconds(a.linkVec(link, now).dot(linkFeatures(bytes)))
}

// Prefill is the calibrated prefill cost.
func (a *Arbiter) Prefill() PrefillCost {
	a.mu.Lock()
	defer a.mu.Unlock()
	return prefillFromVec(a.prefill.theta)
}

// Link is the calibrated cost of link as of now.
func (a *Arbiter) Link(link string) Link {
	now := a.cfg.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	return linkFromVec(a.linkVec(link, now))
}
