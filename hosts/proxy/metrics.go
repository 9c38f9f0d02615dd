package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/mcbridge/mcbridge/internal/metrics"
	"github.com/mcbridge/mcbridge/internal/status"
)

// fallbackReasons are the reasons a restore falls back, as counted.
var fallbackReasons = [...]string{"check_failed", "upstream_changed", "slot_busy", "evicted", "load_failed", "file_error", "restore_refused", "other"}

type counters struct {
	requests, pinned, plain, exclusive, noTokens     atomic.Int64
	restores, restoredTokens                         atomic.Int64
	saves, savesSkipped, saveFailures, saveMismatch  atomic.Int64
	publishedBlocks, publishFailures, publishDropped atomic.Int64
	fallbacks                                        [len(fallbackReasons)]atomic.Int64
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

// Stats are the proxy's counters since New.
type Stats struct {
	Requests        int64 // completion, chat and infill requests
	Pinned          int64 // forwarded pinned to a slot the proxy held
	Plain           int64 // forwarded as they came: no slot table yet
	Exclusive       int64 // forwarded holding every slot
	NoTokens        int64 // prompts the proxy could not tokenize
	Restores        int64
	RestoredTokens  int64
	Fallbacks       map[string]int64 // restores that fell back, by reason
	Saves           int64
	SavesSkipped    int64 // answers with no block the directory lacked
	SaveFailures    int64
	SaveMismatch    int64 // saved files that were not the request's work
	PublishedBlocks int64
	PublishFailures int64
	PublishDropped  int64 // files dropped with the publish queue full
}

// Stats returns a snapshot of the counters.
func (p *Proxy) Stats() Stats {
	c := &p.stats
	s := Stats{
		Requests: c.requests.Load(), Pinned: c.pinned.Load(), Plain: c.plain.Load(), Exclusive: c.exclusive.Load(),
		NoTokens: c.noTokens.Load(), Restores: c.restores.Load(), RestoredTokens: c.restoredTokens.Load(),
		Saves: c.saves.Load(), SavesSkipped: c.savesSkipped.Load(), SaveFailures: c.saveFailures.Load(),
		SaveMismatch: c.saveMismatch.Load(), PublishedBlocks: c.publishedBlocks.Load(),
		PublishFailures: c.publishFailures.Load(), PublishDropped: c.publishDropped.Load(),
		Fallbacks: map[string]int64{},
	}
	for i, r := range fallbackReasons {
		if n := c.fallbacks[i].Load(); n > 0 {
			s.Fallbacks[r] = n
		}
	}
	return s
}

// State says whether the bridge and publishing are on, and why not.
type State struct {
	Bridge      bool   `json:"bridge"`
	BridgeOff   string `json:"bridge_off,omitempty"`
	Publishing  bool   `json:"publishing"`
	PublishOff  string `json:"publish_off,omitempty"`
	Fingerprint string `json:"fingerprint,omitempty"`
	Slots       int    `json:"slots"`
	// Mirrored is how many blocks of the model the directory holds, as
	// this proxy's mirror of it knows.
	Mirrored int `json:"mirrored_blocks"`
	// Pending counts answers whose save or publish is not done.
	Pending int64 `json:"pending"`
}

// State reports the proxy's state.
func (p *Proxy) State() State {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := State{Bridge: p.model != nil, BridgeOff: p.offWhy, Publishing: p.publishOff == "" && !p.closed, PublishOff: p.publishOff,
		Pending: p.pending.Load()}
	if p.model != nil {
		s.Fingerprint = p.model.m.Fingerprint().String()
		s.Mirrored = p.model.m.Mirrored()
	}
	if p.slots != nil {
		s.Slots = p.slots.len()
	}
	return s
}

// healthz answers 200 with the proxy's state while the upstream is
// healthy, 503 otherwise.
func (p *Proxy) healthz(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 5*time.Second)
	defer cancel()
	err := p.up.call(ctx, http.MethodGet, "/health", nil, nil, nil)
	body := struct {
		Status   string `json:"status"`
		Upstream string `json:"upstream"`
		State
	}{Status: "ok", Upstream: "ok", State: p.State()}
	code := http.StatusOK
	if err != nil {
		body.Status, body.Upstream, code = "unavailable", err.Error(), http.StatusServiceUnavailable
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(body)
}

// metrics writes the bridge's series, the same vocabulary every host
// writes, then the proxy's own, named mcproxy_ so that the mcbridge_ set is
// the same here as in a patched llama-server or a store node.
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
	gauge := func(b bool) int64 {
		if b {
			return 1
		}
		return 0
	}
	for _, m := range []struct {
		name, kind, help string
		v                int64
	}{
		{"requests_total", "counter", "Completion, chat and infill requests.", s.Requests},
		{"pinned_total", "counter", "Requests forwarded pinned to a slot the proxy held.", s.Pinned},
		{"plain_total", "counter", "Requests forwarded as they came.", s.Plain},
		{"exclusive_total", "counter", "Requests forwarded holding every slot.", s.Exclusive},
		{"untokenized_total", "counter", "Prompts the proxy could not tokenize.", s.NoTokens},
		{"restores_total", "counter", "Slot restores of bridge blocks.", s.Restores},
		{"restored_tokens_total", "counter", "Tokens restored into slots.", s.RestoredTokens},
		{"saves_total", "counter", "Slots saved to publish their blocks.", s.Saves},
		{"saves_skipped_total", "counter", "Answers whose blocks the directory already had.", s.SavesSkipped},
		{"save_failures_total", "counter", "Slot saves that failed.", s.SaveFailures},
		{"save_mismatches_total", "counter", "Saved slots that did not hold the request's tokens.", s.SaveMismatch},
		{"queued_blocks_total", "counter", "Blocks of saved slots handed to the bridge's publisher.", s.PublishedBlocks},
		{"publish_failures_total", "counter", "Saved slots that failed to publish.", s.PublishFailures},
		{"publish_dropped_total", "counter", "Saved slots dropped with the publish queue full.", s.PublishDropped},
		{"publishing", "gauge", "1 while saved slots are published.", gauge(st.Publishing)},
	} {
		if _, err := fmt.Fprintf(w, "# HELP mcproxy_%s %s\n# TYPE mcproxy_%s %s\nmcproxy_%s %d\n",
			m.name, m.help, m.name, m.kind, m.name, m.v); err != nil {
			return
		}
	}
	fmt.Fprintf(w, "# HELP mcproxy_restore_fallbacks_total Restores that fell back to computing, by reason.\n# TYPE mcproxy_restore_fallbacks_total counter\n")
	for _, r := range fallbackReasons {
		fmt.Fprintf(w, "mcproxy_restore_fallbacks_total{reason=%q} %d\n", r, s.Fallbacks[r])
	}
}
