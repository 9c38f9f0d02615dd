package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mcbridge/mcbridge/internal/metrics"
	"github.com/mcbridge/mcbridge/internal/proxy/route"
	"github.com/mcbridge/mcbridge/internal/status"
)

// fallbackReasons are the reasons a restore falls back, as counted.
var fallbackReasons = [...]string{"check_failed", "upstream_changed", "slot_busy", "evicted", "load_failed", "file_error",
	"restore_refused", "other"}

// unconfirmedReasons are why GET /slots did not confirm a slot.
var unconfirmedReasons = [...]string{"unseen", "task", "tokens", "missing", "unreachable"}

type counters struct {
	requests, pinned, plain, exclusive, noTokens     atomic.Int64
	restores, restoredTokens                         atomic.Int64
	saves, savedBytes, savesSkipped, saveFailures    atomic.Int64
	saveMismatch, answerMismatches                   atomic.Int64
	publishedBlocks, publishFailures, publishDropped atomic.Int64
	retries                                          atomic.Int64
	snapshotPrompts, snapshotFailures                atomic.Int64
	fallbacks                                        [len(fallbackReasons)]atomic.Int64
	unconfirmedBy                                    [len(unconfirmedReasons)]atomic.Int64
	routeMu                                          sync.Mutex
	routes                                           map[route.Reason]int64
}

func (c *counters) fallback(err error) {
	reason := "other"
	var f *fallback
	if errors.As(err, &f) {
		reason = f.reason
	}
	for i, r := range fallbackReasons {
		if r == reason {
			c.fallbacks[i].Add(1)
			return
		}
	}
	c.fallbacks[len(fallbackReasons)-1].Add(1)
}

func (c *counters) unconfirmed(why string) {
	for i, r := range unconfirmedReasons {
		if r == why {
			c.unconfirmedBy[i].Add(1)
		}
	}
}

func (c *counters) routed(r route.Reason) {
	c.routeMu.Lock()
	defer c.routeMu.Unlock()
	if c.routes == nil {
		c.routes = map[route.Reason]int64{}
	}
	c.routes[r]++
}

// Stats are the proxy's counters since New.
type Stats struct {
	Requests         int64 // completion, chat, infill, responses and messages requests
	Pinned           int64 // forwarded pinned to a slot the proxy held
	Plain            int64 // forwarded as they came: no slot table yet
	Exclusive        int64 // forwarded holding every slot
	NoTokens         int64 // prompts the proxy could not tokenize
	Restores         int64
	RestoredTokens   int64
	Fallbacks        map[string]int64 // restores that fell back, by reason
	Unconfirmed      map[string]int64 // slots /slots did not confirm, by why
	Saves            int64
	SavedBytes       int64
	SavesSkipped     int64 // answers with no block the directory lacked
	SaveFailures     int64
	SaveMismatch     int64 // saved files that were not the request's work
	AnswerMismatches int64 // answers that counted another prompt than the proxy's tokens
	PublishedBlocks  int64
	PublishFailures  int64
	PublishDropped   int64            // files dropped with the publish queue full
	Routes           map[string]int64 // routing choices by reason
	Retries          int64            // requests sent to another upstream after theirs did not answer
	SnapshotPrompts  int64            // prompts sent up to a snapshot boundary
	SnapshotFailures int64            // snapshots not taken: the prompt, the save or the store failed
}

// Stats returns a snapshot of the counters.
func (p *Proxy) Stats() Stats {
	c := &p.stats
	s := Stats{
		Requests: c.requests.Load(), Pinned: c.pinned.Load(), Plain: c.plain.Load(), Exclusive: c.exclusive.Load(),
		NoTokens: c.noTokens.Load(), Restores: c.restores.Load(), RestoredTokens: c.restoredTokens.Load(),
		Saves: c.saves.Load(), SavedBytes: c.savedBytes.Load(), SavesSkipped: c.savesSkipped.Load(), SaveFailures: c.saveFailures.Load(),
		SaveMismatch: c.saveMismatch.Load(), AnswerMismatches: c.answerMismatches.Load(), PublishedBlocks: c.publishedBlocks.Load(),
		PublishFailures: c.publishFailures.Load(), PublishDropped: c.publishDropped.Load(), Retries: c.retries.Load(),
		SnapshotPrompts: c.snapshotPrompts.Load(), SnapshotFailures: c.snapshotFailures.Load(),
		Fallbacks: map[string]int64{}, Unconfirmed: map[string]int64{}, Routes: map[string]int64{},
	}
	for i, r := range fallbackReasons {
		if n := c.fallbacks[i].Load(); n > 0 {
			s.Fallbacks[r] = n
		}
	}
	for i, r := range unconfirmedReasons {
		if n := c.unconfirmedBy[i].Load(); n > 0 {
			s.Unconfirmed[r] = n
		}
	}
	c.routeMu.Lock()
	for r, n := range c.routes {
		s.Routes[r.String()] = n
	}
	c.routeMu.Unlock()
	return s
}

// UpstreamState is one upstream's part of State.
type UpstreamState struct {
	URL         string `json:"url"`
	Up          bool   `json:"up"`
	InFlight    int    `json:"in_flight"`
	Bridge      bool   `json:"bridge"`
	BridgeOff   string `json:"bridge_off,omitempty"`
	Publishing  bool   `json:"publishing"`
	PublishOff  string `json:"publish_off,omitempty"`
	Fingerprint string `json:"fingerprint,omitempty"`
	// SnapshotTokens is how many tokens apart the proxy snapshots a model
	// with a partial state (sliding-window, hybrid), and SnapshotsAfter how
	// many tokens a snapshot must come after to restore (the window);
	// SnapshotsOnly says that the model has no KV layers (a recurrent
	// memory, DeepSeek V4's): its snapshots are all it publishes.
	SnapshotTokens int   `json:"snapshot_tokens,omitempty"`
	SnapshotsAfter int   `json:"snapshots_after,omitempty"`
	SnapshotsOnly  bool  `json:"snapshots_only,omitempty"`
	Slots          int   `json:"slots"`
	Routed         int64 `json:"routed"`
	Restarts       int64 `json:"restarts"`
}

// State says whether the bridge and publishing are on, and why not: for
// the first upstream with the bridge on (else the first), with every
// upstream's own in Upstreams.
type State struct {
	Bridge         bool   `json:"bridge"`
	BridgeOff      string `json:"bridge_off,omitempty"`
	Publishing     bool   `json:"publishing"`
	PublishOff     string `json:"publish_off,omitempty"`
	Fingerprint    string `json:"fingerprint,omitempty"`
	SnapshotTokens int    `json:"snapshot_tokens,omitempty"`
	SnapshotsAfter int    `json:"snapshots_after,omitempty"`
	SnapshotsOnly  bool   `json:"snapshots_only,omitempty"`
	Slots          int    `json:"slots"` // over every upstream
	// Mirrored is how many blocks of the model the directory holds, as
	// this proxy's mirror of it knows.
	Mirrored int `json:"mirrored_blocks"`
	// Pending counts answers whose save or publish is not done.
	Pending   int64           `json:"pending"`
	Policy    string          `json:"policy"`
	Upstreams []UpstreamState `json:"upstreams"`
}

// State reports the proxy's state.
func (p *Proxy) State() State {
	s := State{Pending: p.pending.Load(), Policy: p.router.Policy().String()}
	rs := p.router.States()
	lead := -1
	for i, be := range p.ups {
		be.mu.Lock()
		u := UpstreamState{URL: be.name, Up: rs[i].Up, InFlight: rs[i].InFlight, Bridge: be.model != nil, BridgeOff: be.offWhy,
			Publishing: be.publishOff == "" && be.model != nil && !p.isClosed(), PublishOff: be.publishOff,
			Routed: be.routed.Load(), Restarts: be.restarts.Load()}
		if be.model != nil {
			u.Fingerprint = be.model.m.Fingerprint().String()
			u.SnapshotTokens, u.SnapshotsAfter = be.model.m.SnapshotTokens(), be.model.m.SnapshotsRestoreAfter()
			u.SnapshotsOnly = be.model.m.SnapshotOnly()
			if lead < 0 {
				lead = i
				s.Mirrored = be.model.m.Mirrored()
			}
		}
		if be.slots != nil {
			u.Slots = be.slots.len()
			s.Slots += u.Slots
		}
		be.mu.Unlock()
		s.Upstreams = append(s.Upstreams, u)
	}
	if lead < 0 {
		lead = 0
	}
	u := s.Upstreams[lead]
	s.Bridge, s.BridgeOff, s.Fingerprint = u.Bridge, u.BridgeOff, u.Fingerprint
	s.SnapshotTokens, s.SnapshotsAfter, s.SnapshotsOnly = u.SnapshotTokens, u.SnapshotsAfter, u.SnapshotsOnly
	s.Publishing, s.PublishOff = u.Publishing, u.PublishOff
	if p.isClosed() && s.PublishOff == "" {
		s.PublishOff = "the proxy is closed"
	}
	return s
}

// healthz answers 200 with the proxy's state while an upstream is
// healthy, 503 otherwise.
func (p *Proxy) healthz(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 5*time.Second)
	defer cancel()
	var errs []string
	for _, be := range p.ups {
		err := be.up.call(ctx, http.MethodGet, "/health", nil, nil, nil)
		if err == nil {
			errs = nil
			break
		}
		errs = append(errs, be.name+": "+err.Error())
	}
	body := struct {
		Status   string `json:"status"`
		Upstream string `json:"upstream"`
		State
	}{Status: "ok", Upstream: "ok", State: p.State()}
	code := http.StatusOK
	if errs != nil {
		body.Status, body.Upstream, code = "unavailable", errs[0], http.StatusServiceUnavailable
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(body)
}

// metrics writes the bridge's series, the same vocabulary every host
// writes, then the proxy's own (internal/metrics' ProxyVocabulary).
func (p *Proxy) metrics(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "text/plain; version=0.0.4")
	st := p.State()
	var off error
	if !st.Bridge {
		off = status.Errorf(status.Unsupported, "the upstream's model is not learned: %s", st.BridgeOff)
	}
	if err := metrics.Write(w, p.b, off); err != nil {
		return
	}
	s := p.Stats()
	one := func(v int64) []metrics.Sample { return []metrics.Sample{{Value: v}} }
	flag := func(b bool) int64 {
		if b {
			return 1
		}
		return 0
	}
	perUpstream := func(f func(u UpstreamState) int64) []metrics.Sample {
		var out []metrics.Sample
		for _, u := range st.Upstreams {
			out = append(out, metrics.Sample{Label: u.URL, Value: f(u)})
		}
		return out
	}
	byName := func(names []string, m map[string]int64) []metrics.Sample {
		var out []metrics.Sample
		for _, n := range names {
			out = append(out, metrics.Sample{Label: n, Value: m[n]})
		}
		return out
	}
	var reasons []string
	for _, r := range route.Reasons {
		reasons = append(reasons, r.String())
	}
	values := map[string][]metrics.Sample{
		"requests_total": one(s.Requests), "pinned_total": one(s.Pinned), "plain_total": one(s.Plain),
		"exclusive_total": one(s.Exclusive), "untokenized_total": one(s.NoTokens), "restores_total": one(s.Restores),
		"restored_tokens_total": one(s.RestoredTokens), "saves_total": one(s.Saves), "saved_bytes_total": one(s.SavedBytes),
		"saves_skipped_total": one(s.SavesSkipped), "save_failures_total": one(s.SaveFailures),
		"save_mismatches_total": one(s.SaveMismatch), "queued_blocks_total": one(s.PublishedBlocks),
		"publish_failures_total": one(s.PublishFailures), "publish_dropped_total": one(s.PublishDropped),
		"publishing":             one(flag(st.Publishing)),
		"snapshot_prompts_total": one(s.SnapshotPrompts), "snapshot_failures_total": one(s.SnapshotFailures),
		"restore_fallbacks_total": byName(fallbackReasons[:], s.Fallbacks),
		"slots_unconfirmed_total": byName(unconfirmedReasons[:], s.Unconfirmed),
		"answer_mismatches_total": one(s.AnswerMismatches),
		"route_decisions_total":   byName(reasons, s.Routes),
		"route_retries_total":     one(s.Retries),
		"upstream_up":             perUpstream(func(u UpstreamState) int64 { return flag(u.Up) }),
		"upstream_in_flight":      perUpstream(func(u UpstreamState) int64 { return int64(u.InFlight) }),
		"upstream_routed_total":   perUpstream(func(u UpstreamState) int64 { return u.Routed }),
		"upstream_restarts_total": perUpstream(func(u UpstreamState) int64 { return u.Restarts }),
	}
	_ = metrics.WriteProxy(w, func(name string) []metrics.Sample { return values[name] })
}
