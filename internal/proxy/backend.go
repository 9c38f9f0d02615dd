package proxy

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/host"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/proxy/route"
	"github.com/mcbridge/mcbridge/internal/status"
)

// backend is one upstream server: its slots, the model learned from it and
// the requests the proxy runs there.
type backend struct {
	p    *Proxy
	i    int
	name string // its URL, in logs and metric labels
	spec Upstream
	up   *upstream
	rp   *httputil.ReverseProxy

	learnMu sync.Mutex // one learner at a time
	mu      sync.Mutex
	model   *learned // nil until learned, or after the upstream changed
	slots   *slotTable
	learnAt time.Time
	offWhy  string // why the bridge is off (model == nil)
	// publishOff says why nothing is published from this upstream ("" while
	// on).
	publishOff  string
	files       map[int]*slotFile // restores load into these, by slot
	filesClosed bool              // the proxy closed them

	routed, restarts atomic.Int64
}

// learned is what the proxy found out about an upstream: its identity, KV
// format and the bridge model registered for it.
type learned struct {
	m       *host.Model
	nStream int
	props   props
	path    string
	digest  key.Hash
}

func newBackend(p *Proxy, i int, spec Upstream) (*backend, error) {
	base, err := url.Parse(spec.URL)
	if err != nil || (base.Scheme != "http" && base.Scheme != "https") || base.Host == "" {
		return nil, status.Errorf(status.Config, "upstream %q: an http:// or https:// URL", spec.URL)
	}
	be := &backend{p: p, i: i, name: spec.URL, spec: spec,
		up: &upstream{base: base, client: &http.Client{Transport: p.opts.Transport}, apiKey: p.opts.APIKey}}
	switch {
	case spec.SlotDir == "":
		be.publishOff = "no slot directory"
	case p.opts.NoPublish:
		be.publishOff = "publishing disabled by option"
	case p.opts.UpstreamContextShift:
		be.publishOff = "the upstream shifts context (cells may hold KV of other tokens)"
	case p.opts.UpstreamCacheReuse > 0:
		be.publishOff = "the upstream reuses cache chunks by KV shifting"
	}
	be.rp = &httputil.ReverseProxy{
		Rewrite:        func(pr *httputil.ProxyRequest) { pr.SetURL(base) },
		Transport:      p.opts.Transport,
		FlushInterval:  -1, // server-sent events go out as they come
		ModifyResponse: be.modifyResponse,
		ErrorHandler:   be.errorHandler,
		ErrorLog:       slog.NewLogLogger(p.log.Handler(), slog.LevelWarn),
	}
	return be, nil
}

// relearn runs with learnMu held.
func (be *backend) relearn(ctx context.Context) error {
	lm, err := be.learn(ctx)
	be.mu.Lock()
	defer be.mu.Unlock()
	be.learnAt = be.p.opts.Now()
	be.model = lm
	if err != nil {
		be.offWhy = err.Error()
		be.p.log.Warn("mcbridge proxy: bridge off", "upstream", be.name, "reason", err)
		return err
	}
	be.offWhy = ""
	if lm == nil {
		be.offWhy = "no slot directory: routed and scheduled, never restored"
		return nil
	}
	be.p.log.Info("mcbridge proxy: bridge on", "upstream", be.name, "model", lm.m.Fingerprint().String(),
		"layers", len(lm.m.Format.Layers), "v_trans", lm.m.Format.VTrans, "streams", lm.nStream, "block_tokens", lm.m.BlockTokens())
	return nil
}

// current returns the learned model, learning it first when that is due;
// nil means the bridge is off for this upstream. Requests that find a
// learner at work wait for it: it takes one short completion.
func (be *backend) current() *learned {
	due := func() (*learned, bool) {
		be.mu.Lock()
		defer be.mu.Unlock()
		return be.model, be.model == nil && (be.learnAt.IsZero() || be.p.opts.Now().Sub(be.learnAt) >= be.p.opts.RetryLearn)
	}
	if lm, ok := due(); !ok {
		return lm
	}
	be.learnMu.Lock()
	defer be.learnMu.Unlock()
	lm, ok := due()
	if !ok {
		return lm
	}
	ctx, cancel := context.WithTimeout(context.Background(), controlTimeout)
	defer cancel()
	_ = be.relearn(ctx)
	lm, _ = due()
	return lm
}

// learnedModel is the model as learned so far, learning nothing.
func (be *backend) learnedModel() *learned {
	be.mu.Lock()
	defer be.mu.Unlock()
	return be.model
}

// forget drops a model the upstream no longer matches; the next request
// learns again.
func (be *backend) forget(lm *learned, why string) {
	be.mu.Lock()
	defer be.mu.Unlock()
	if be.model == lm {
		be.model, be.offWhy, be.learnAt = nil, why, time.Time{}
		be.p.log.Warn("mcbridge proxy: upstream changed, learning it again", "upstream", be.name, "reason", why)
	}
}

// restarted handles a server that is a new process: nothing it held is
// known any more, and its model is learned again before the next restore.
func (be *backend) restarted(why string) {
	be.restarts.Add(1)
	if tab := be.table(); tab != nil {
		tab.forgetAll()
	}
	be.mu.Lock()
	lm := be.model
	be.mu.Unlock()
	if lm != nil {
		be.forget(lm, why)
	} else {
		be.mu.Lock()
		be.learnAt = time.Time{}
		be.mu.Unlock()
	}
}

func (be *backend) table() *slotTable {
	be.mu.Lock()
	defer be.mu.Unlock()
	return be.slots
}

// stopPublishing turns publishing from this upstream off for good: it did
// something that may leave KV of other tokens in its cells.
func (be *backend) stopPublishing(why string) {
	be.mu.Lock()
	defer be.mu.Unlock()
	if be.publishOff == "" {
		be.publishOff = why
		be.p.log.Warn("mcbridge proxy: publishing off", "upstream", be.name, "reason", why)
	}
}

// publishingFor says whether KV computed under lm may be published: not
// once the upstream was found to have changed since.
func (be *backend) publishingFor(lm *learned) bool {
	be.mu.Lock()
	defer be.mu.Unlock()
	return be.publishOff == "" && !be.p.isClosed() && lm != nil && be.model == lm
}

// checkHealth is one health check: /health for the rotation, then /slots
// for a restart the proxy did not see (slots that forgot their tasks).
func (be *backend) checkHealth(ctx context.Context) {
	err := be.up.call(ctx, http.MethodGet, "/health", nil, nil, nil)
	up, changed := be.p.router.Health(be.i, err == nil)
	switch {
	case changed && !up:
		be.p.log.Warn("mcbridge proxy: upstream out of the rotation", "upstream", be.name, "err", err)
	case changed:
		be.p.log.Info("mcbridge proxy: upstream back in the rotation", "upstream", be.name)
		// Back from an outage: whatever it is now, it is not known.
		be.restarted("the upstream came back after failing its health checks")
	}
	if err != nil || !up {
		return
	}
	tab := be.table()
	if tab == nil {
		return
	}
	if infos, err := be.up.slots(ctx); err == nil {
		if err := tab.checkTasks(infos); err != nil {
			be.restarted(err.Error())
		}
	}
}

// exchange is one forwarded request's record, shared with modifyResponse
// and errorHandler through the request's context.
type exchange struct {
	ep        endpoint
	upstream  int
	restored  int
	restoreMS float64
	fallback  string // why a restore fell back: its reason and error
	// path: where the request goes upstream when not where it came
	// (a converted /v1/messages); toMessages: its answer is a chat
	// answer, written back in Anthropic's shape.
	path       string
	toMessages bool
	status     int
	ans        answer
	haveAns    bool
	complete   bool // the whole answer went through
	// retryable: nothing went to the client yet and the body can be sent
	// again; unreachable: it was, and the upstream gave no answer.
	retryable   bool
	unreachable bool
	failed      bool // the upstream failed the exchange (no answer, or a broken one)
}

type exchangeKey struct{}

// send forwards a request with body to the upstream, recording into x.
// A nil body forwards the request's own.
func (be *backend) send(w http.ResponseWriter, r *http.Request, body []byte, rest io.Reader, x *exchange) {
	r2 := r.Clone(context.WithValue(r.Context(), exchangeKey{}, x))
	if x.path != "" {
		r2.URL.Path, r2.URL.RawPath = x.path, ""
	}
	switch {
	case rest != nil:
		r2.Body = io.NopCloser(rest)
	default:
		r2.Body, r2.ContentLength = io.NopCloser(bytes.NewReader(body)), int64(len(body))
		r2.Header.Del("Content-Length")
	}
	// The proxy reads the answer's counts: it asks for it uncompressed
	// (Go's transport negotiates and undoes compression on its own).
	r2.Header.Del("Accept-Encoding")
	be.rp.ServeHTTP(w, r2)
}

// outcome is what the router learns from an exchange.
func (x *exchange) outcome() route.Outcome {
	o := route.Outcome{Failed: x.failed || x.unreachable}
	if x.restored > 0 {
		o.Restored, o.RestoreTook = x.restored, time.Duration(x.restoreMS*float64(time.Millisecond))
	}
	if x.haveAns && x.ans.Timings != nil {
		o.Predicted = x.ans.Timings.PredictedN
		o.Decode = time.Duration(x.ans.Timings.PredictedMS * float64(time.Millisecond))
	}
	return o
}

// forward sends a request as it came.
func (be *backend) forward(w http.ResponseWriter, r *http.Request, body []byte, rest io.Reader, retryable bool) served {
	x := &exchange{upstream: be.i, retryable: retryable && rest == nil}
	be.send(w, r, body, rest, x)
	return served{unreachable: x.unreachable, outcome: x.outcome()}
}

// exclusive forwards a request that may compute in slots the server picks
// (several completions at once, embeddings, other APIs) while holding every
// slot; afterwards what the slots hold is unknown.
func (be *backend) exclusive(w http.ResponseWriter, r *http.Request, body []byte, rest io.Reader) served {
	be.p.stats.exclusive.Add(1)
	tab := be.table()
	if tab == nil {
		return be.forward(w, r, body, rest, true)
	}
	if err := tab.holdAll(r.Context()); err != nil {
		return served{}
	}
	defer tab.releaseAll()
	return be.forward(w, r, body, rest, true)
}

// errorHandler answers for an upstream that gave no usable answer: a 502,
// unless the request can go to another upstream.
func (be *backend) errorHandler(w http.ResponseWriter, r *http.Request, err error) {
	x, _ := r.Context().Value(exchangeKey{}).(*exchange)
	if r.Context().Err() == nil {
		if x != nil {
			x.failed = true
			if x.retryable && x.status == 0 {
				x.unreachable = true
				return
			}
		}
		be.p.log.Warn("mcbridge proxy: upstream failed", "upstream", be.name, "path", r.URL.Path, "err", err)
	}
	w.WriteHeader(http.StatusBadGateway)
}

// modifyResponse reads an answer's counts and adds the proxy's headers
// (docs/proxy.md); the body passes as the upstream sent it, byte for byte.
func (be *backend) modifyResponse(resp *http.Response) error {
	x, _ := resp.Request.Context().Value(exchangeKey{}).(*exchange)
	if x == nil {
		return nil
	}
	x.status = resp.StatusCode
	resp.Header.Set("Mcb-Upstream", strconv.Itoa(be.i))
	resp.Header.Set("Mcb-Restored-N", strconv.Itoa(x.restored))
	resp.Header.Set("Mcb-Restore-Ms", strconv.FormatFloat(x.restoreMS, 'f', 3, 64))
	if x.fallback != "" {
		resp.Header.Set("Mcb-Fallback", x.fallback)
	}
	if resp.StatusCode/100 != 2 {
		return nil
	}
	if isEventStream(resp.Header.Get("Content-Type")) {
		resp.Body = &sseSniffer{rc: resp.Body, ep: x.ep, onClose: func(s *sseSniffer) {
			x.ans, x.haveAns, x.complete = s.last, s.seen, s.atEOF
			x.failed = x.failed || s.readErr
		}}
		if x.toMessages {
			resp.Body = newMessagesStream(resp.Body)
		}
		return nil
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return err
	}
	x.ans, x.haveAns = readAnswer(x.ep, b)
	x.complete = true
	if x.toMessages {
		if b, err = chatToMessages(b); err != nil {
			return err
		}
		resp.ContentLength = int64(len(b))
		resp.Header.Set("Content-Length", strconv.Itoa(len(b)))
	}
	resp.Body = io.NopCloser(bytes.NewReader(b))
	return nil
}

func isEventStream(ct string) bool {
	mt, _, _ := strings.Cut(ct, ";")
	return strings.EqualFold(strings.TrimSpace(mt), "text/event-stream")
}

// slotFile forwards a client's own slot save, restore or erase, holding
// that slot. A restored file is KV of unknown origin: the slot is dirty.
func (be *backend) slotFile(w http.ResponseWriter, r *http.Request) {
	tab := be.table()
	id, err := strconv.Atoi(r.PathValue("id"))
	if tab == nil || err != nil || id < 0 {
		be.forward(w, r, nil, r.Body, false)
		return
	}
	id %= tab.len()
	if _, _, err := tab.acquire(r.Context(), id, nil); err != nil {
		return
	}
	before := tab.view(id)
	be.forward(w, r, nil, r.Body, false)
	// The slot's own answer to the next check is what it holds now.
	ctx, cancel := context.WithTimeout(context.Background(), controlTimeout)
	defer cancel()
	sig := be.signature(ctx, id)
	switch r.URL.Query().Get("action") {
	case "save":
		tab.release(id, contents{tokens: before.tokens, dirty: before.dirty, sig: sig})
	case "erase":
		tab.release(id, contents{tokens: []int32{}, sig: sig})
	default:
		tab.release(id, contents{dirty: true})
	}
}

// loraAdapters forwards a change of the server-wide adapter scales. Every
// slot's KV was computed under the old scales and the model's KV changes:
// the slots turn dirty and the model is learned again.
func (be *backend) loraAdapters(w http.ResponseWriter, r *http.Request) {
	tab := be.table()
	if tab != nil {
		if err := tab.holdAll(r.Context()); err != nil {
			return
		}
	}
	be.forward(w, r, nil, r.Body, false)
	if tab != nil {
		for i := 0; i < tab.len(); i++ {
			tab.release(i, contents{dirty: true})
		}
	}
	if lm := be.learnedModel(); lm != nil {
		be.forget(lm, "the server's LoRA adapters changed")
	}
}

// signature is GET /slots' word for a slot now; nil when it gives none.
func (be *backend) signature(ctx context.Context, id int) *slotSig {
	infos, err := be.up.slots(ctx)
	if err != nil {
		return nil
	}
	if err := be.table().checkTasks(infos); err != nil {
		be.restarted(err.Error())
		return nil
	}
	return sigOf(infos, id)
}

// slotPath is a file of the upstream's slot directory.
func (be *backend) slotPath(name string) string { return filepath.Join(be.spec.SlotDir, name) }

// promptTokens finds the tokens the server will compute for a request.
func (be *backend) promptTokens(ctx context.Context, req *request, body []byte) ([]int32, error) {
	switch {
	case req.tokens != nil:
		return req.tokens, nil
	case req.ep == chat || req.ep == responses || req.ep == messages:
		chatBody := body
		var err error
		switch req.ep {
		case responses:
			chatBody, err = responsesToChat(body)
		case messages:
			chatBody, err = messagesToChat(body)
		}
		if err != nil {
			return nil, err
		}
		prompt, err := be.up.applyTemplate(ctx, chatBody)
		if err != nil {
			return nil, err
		}
		return be.up.tokenize(ctx, prompt)
	case req.prompt != nil:
		return be.up.tokenize(ctx, req.prompt)
	}
	return nil, status.Errorf(status.Unsupported, "no single prompt")
}

// observe feeds the arbiter's prefill model with the server's timings.
func (be *backend) observe(t *timings) {
	if t.PromptN <= 0 || t.PromptMS <= 0 {
		return
	}
	be.p.b.Arbiter().ObservePrefill(t.CacheN, t.CacheN+t.PromptN, time.Duration(t.PromptMS*float64(time.Millisecond)))
}

// planFor is the bridge's plan for a slot holding local tokens: the
// request's lookup when its decision holds there, else a lookup of its own.
func (be *backend) planFor(lm *learned, tokens []int32, local int, look *lookup) *bridge.Plan {
	if look.fits(local) {
		return look.plan
	}
	plan, err := lm.m.Lookup(be.p.opts.Scope, tokens, local)
	if err != nil {
		return nil
	}
	return plan
}
