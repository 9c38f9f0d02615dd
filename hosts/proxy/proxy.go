// Package proxy puts the bridge in front of a stock llama-server (v0.5.0)
// without rebuilding it, through the server's slot files.
//
// For a completion it finds the prompt's tokens, looks its leading blocks
// up, and on a hit fetches them into a slot file holding exactly the
// restored prefix, has the server restore that file into a free slot and
// pins the request to that slot, so the server computes only the rest.
// After the answer it saves the slot into a file and publishes the new
// full blocks from it, off the request's path. The client sees the
// server's answer, with timings.mcb_restored_n and timings.mcb_restore_ms
// added to non-streaming JSON answers; anything that fails falls back to
// forwarding the request as it came.
//
// The proxy schedules the server's slots: every request that computes is
// pinned to a slot the proxy holds for its whole run (restore, compute,
// save), so it never restores into a slot another request uses. It must
// therefore be the server's only client.
//
// Only clean KV is published (docs/design.md §5.4): cells computed from
// position 0 over exactly the slot's tokens, by the registered model. A
// slot turns dirty when a request shifts or adapts its cells (per-request
// LoRA, n_cache_reuse), when a client restores a slot file of its own, or
// when the server reused more of it than the proxy knows the origin of;
// a dirty slot publishes nothing until a request recomputes it from
// position 0. Server-wide context shift and cache reuse are not visible in
// /props: Options says whether the upstream has them, and then nothing is
// published at all.
package proxy

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/host"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Options configure a Proxy.
type Options struct {
	// Upstream is the llama-server's base URL.
	Upstream string
	// SlotDir is the server's --slot-save-path, on this host.
	SlotDir string
	// APIKey is the server's --api-key, sent with the proxy's own calls
	// (slot files, tokenizer, probe); clients send their own.
	APIKey string
	// ModelPath is the GGUF to digest for the fingerprint when the path in
	// the server's /props is not absolute or not readable here.
	ModelPath string
	// NoPublish turns publishing off: restores only.
	NoPublish bool
	// UpstreamContextShift and UpstreamCacheReuse mirror the server's
	// --context-shift and --cache-reuse, which /props does not report:
	// with either, cells may hold KV computed over other tokens, and
	// nothing is published.
	UpstreamContextShift bool
	UpstreamCacheReuse   int
	// Scope salts every key (tenant isolation); empty shares with everyone
	// using the same model.
	Scope key.Scope
	// Transport carries requests to the upstream; nil uses a clone of
	// http.DefaultTransport.
	Transport http.RoundTripper
	// Log receives the proxy's events; nil discards them.
	Log *slog.Logger
	// Now times restores; nil uses time.Now.
	Now func() time.Time
	// PublishQueue bounds the saved slot files waiting to be published;
	// beyond it a file is dropped (0: 4).
	PublishQueue int
	// RetryLearn is how long the proxy forwards plainly after it failed to
	// learn the upstream's model before trying again (0: 10s).
	RetryLearn time.Duration
}

// maxRequestBody bounds the body the proxy reads to find the prompt;
// larger requests are forwarded without the bridge.
const maxRequestBody = 256 << 20

// controlTimeout bounds the proxy's own calls: learning, saving after an
// answer (the client is gone by then).
const controlTimeout = 5 * time.Minute

// Proxy is an http.Handler in front of one llama-server.
type Proxy struct {
	b    *bridge.Bridge
	opts Options
	up   *upstream
	rp   *httputil.ReverseProxy
	mux  *http.ServeMux
	log  *slog.Logger
	inst string // names this proxy's files in the slot directory
	seq  atomic.Uint64

	learnMu sync.Mutex // one learner at a time
	mu      sync.Mutex
	model   *learned // nil until learned, or after the upstream changed
	slots   *slotTable
	learnAt time.Time
	offWhy  string // why the bridge is off (model == nil)
	// publishOff says why nothing is published any more ("" while on).
	publishOff string
	closed     bool

	queue   chan publishJob
	workers sync.WaitGroup // the publisher and the savers still running
	pending atomic.Int64   // answers whose save or publish is not done
	stats   counters
}

// learned is what the proxy found out about the upstream: its identity,
// KV format and the bridge model registered for it.
type learned struct {
	m       *host.Model
	nStream int
	props   props
	path    string
	digest  key.Hash

	mu    sync.Mutex
	tasks map[int]int // per slot, the last id_task /slots showed
}

// New builds a proxy in front of opts.Upstream that uses b. It contacts
// nothing: the upstream's model is learned on first use (or by Learn).
func New(b *bridge.Bridge, opts Options) (*Proxy, error) {
	base, err := url.Parse(opts.Upstream)
	if err != nil || (base.Scheme != "http" && base.Scheme != "https") || base.Host == "" {
		return nil, status.Errorf(status.Config, "upstream %q: an http:// or https:// URL", opts.Upstream)
	}
	if st, err := os.Stat(opts.SlotDir); err != nil || !st.IsDir() {
		return nil, status.Errorf(status.Config, "slot directory %q: not a directory (%v)", opts.SlotDir, err)
	}
	if opts.Transport == nil {
		opts.Transport = http.DefaultTransport.(*http.Transport).Clone()
	}
	if opts.Log == nil {
		opts.Log = slog.New(slog.DiscardHandler)
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.PublishQueue <= 0 {
		opts.PublishQueue = 4
	}
	if opts.RetryLearn <= 0 {
		opts.RetryLearn = 10 * time.Second
	}
	var id [6]byte
	_, _ = rand.Read(id[:])
	p := &Proxy{
		b: b, opts: opts, log: opts.Log, inst: hex.EncodeToString(id[:]),
		up:    &upstream{base: base, client: &http.Client{Transport: opts.Transport}, apiKey: opts.APIKey},
		queue: make(chan publishJob, opts.PublishQueue),
	}
	switch {
	case opts.NoPublish:
		p.publishOff = "publishing disabled by option"
	case opts.UpstreamContextShift:
		p.publishOff = "the upstream shifts context (cells may hold KV of other tokens)"
	case opts.UpstreamCacheReuse > 0:
		p.publishOff = "the upstream reuses cache chunks by KV shifting"
	}
	p.rp = &httputil.ReverseProxy{
		Rewrite:        func(pr *httputil.ProxyRequest) { pr.SetURL(base) },
		Transport:      opts.Transport,
		FlushInterval:  -1, // server-sent events go out as they come
		ModifyResponse: p.modifyResponse,
		ErrorLog:       slog.NewLogLogger(opts.Log.Handler(), slog.LevelWarn),
	}
	p.routes()
	p.workers.Add(1)
	go p.publisher()
	return p, nil
}

func (p *Proxy) routes() {
	m := http.NewServeMux()
	m.HandleFunc("GET /healthz", p.healthz)
	m.HandleFunc("GET /metrics", p.metrics)
	for _, path := range []string{"/completion", "/completions", "/v1/completions"} {
		m.HandleFunc("POST "+path, p.completion(completion))
	}
	for _, path := range []string{"/chat/completions", "/v1/chat/completions"} {
		m.HandleFunc("POST "+path, p.completion(chat))
	}
	m.HandleFunc("POST /infill", p.completion(infill))
	m.HandleFunc("POST /slots/{id}", p.slotFile)
	m.HandleFunc("POST /lora-adapters", p.loraAdapters)
	// Routes that never compute in a slot. Anything else that is not a GET
	// may (embeddings, responses, messages): it runs holding every slot.
	for _, path := range []string{"/tokenize", "/detokenize", "/apply-template", "/props",
		"/chat/completions/input_tokens", "/v1/chat/completions/input_tokens",
		"/responses/input_tokens", "/v1/responses/input_tokens", "/v1/messages/count_tokens",
		"/v1/chat/completions/control"} {
		m.HandleFunc("POST "+path, p.passthroughAll)
	}
	m.HandleFunc("GET /", p.passthroughAll)
	m.HandleFunc("OPTIONS /", p.passthroughAll)
	m.HandleFunc("/", p.exclusiveAll)
	p.mux = m
}

// ServeHTTP serves the proxy's own endpoints and forwards the rest.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) { p.mux.ServeHTTP(w, r) }

// Learn contacts the upstream now and learns its model; requests do it on
// their own when it has not been done.
func (p *Proxy) Learn(ctx context.Context) error {
	p.learnMu.Lock()
	defer p.learnMu.Unlock()
	return p.relearn(ctx)
}

// relearn runs with learnMu held.
func (p *Proxy) relearn(ctx context.Context) error {
	lm, err := p.learn(ctx)
	p.mu.Lock()
	defer p.mu.Unlock()
	p.learnAt = p.opts.Now()
	p.model = lm
	if err != nil {
		p.offWhy = err.Error()
		p.log.Warn("mcbridge proxy: bridge off", "reason", err)
		return err
	}
	p.offWhy = ""
	p.log.Info("mcbridge proxy: bridge on", "model", lm.m.Fingerprint().String(), "layers", len(lm.m.Format.Layers),
		"v_trans", lm.m.Format.VTrans, "streams", lm.nStream, "block_tokens", lm.m.BlockTokens())
	return nil
}

// current returns the learned model, learning it first when that is due;
// nil means the bridge is off for this request. Requests that find a
// learner at work wait for it: it takes one short completion.
func (p *Proxy) current() *learned {
	due := func() (*learned, bool) {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.model, p.model == nil && (p.learnAt.IsZero() || p.opts.Now().Sub(p.learnAt) >= p.opts.RetryLearn)
	}
	if lm, ok := due(); !ok {
		return lm
	}
	p.learnMu.Lock()
	defer p.learnMu.Unlock()
	lm, ok := due()
	if !ok {
		return lm
	}
	ctx, cancel := context.WithTimeout(context.Background(), controlTimeout)
	defer cancel()
	_ = p.relearn(ctx)
	lm, _ = due()
	return lm
}

// forget drops a model the upstream no longer matches; the next request
// learns again.
func (p *Proxy) forget(lm *learned, why string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.model == lm {
		p.model, p.offWhy, p.learnAt = nil, why, time.Time{}
		p.log.Warn("mcbridge proxy: upstream changed, learning it again", "reason", why)
	}
}

func (p *Proxy) table() *slotTable {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.slots
}

// stopPublishing turns publishing off for good: the upstream did something
// that may leave KV of other tokens in its cells.
func (p *Proxy) stopPublishing(why string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.publishOff == "" {
		p.publishOff = why
		p.log.Warn("mcbridge proxy: publishing off", "reason", why)
	}
}

// publishingFor says whether KV computed under lm may be published: not
// once the upstream was found to have changed since.
func (p *Proxy) publishingFor(lm *learned) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.publishOff == "" && !p.closed && lm != nil && p.model == lm
}

// fileName names a file of this proxy in the slot directory; llama-server
// accepts letters, digits, '-', '_' and '.'.
func (p *Proxy) fileName(kind string, slot int) string {
	return fmt.Sprintf("mcb-%s-%s%d-%d.bin", p.inst, kind, slot, p.seq.Add(1))
}

// Flush waits until every answer's save and publish is done.
func (p *Proxy) Flush(ctx context.Context) error {
	t := time.NewTicker(time.Millisecond)
	defer t.Stop()
	for p.pending.Load() > 0 {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	return nil
}

// Close waits for pending saves and publishes and stops the publisher. The
// HTTP server in front must be shut down first; the bridge stays open.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return status.Errorf(status.State, "proxy closed twice")
	}
	p.closed = true
	p.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), controlTimeout)
	err := p.Flush(ctx)
	cancel()
	// No send starts once closed is set (enqueue checks it under mu).
	p.mu.Lock()
	close(p.queue)
	p.mu.Unlock()
	p.workers.Wait()
	return err
}

// enqueue hands a saved file to the publisher; false when the queue is
// full or the proxy closed.
func (p *Proxy) enqueue(job publishJob) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	select {
	case p.queue <- job:
		return true
	default:
		return false
	}
}

// exchange is one pinned request's record, shared with modifyResponse
// through the request's context.
type exchange struct {
	restored  int
	restoreMS float64
	status    int
	ans       answer
	haveAns   bool
	complete  bool // the whole answer went through
}

type exchangeKey struct{}

// completion serves the routes whose prompt the proxy can read.
func (p *Proxy) completion(ep endpoint) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		p.stats.requests.Add(1)
		body, err := io.ReadAll(io.LimitReader(r.Body, maxRequestBody+1))
		if err != nil {
			http.Error(w, "mcbridge proxy: reading the request: "+err.Error(), http.StatusBadRequest)
			return
		}
		if len(body) > maxRequestBody {
			p.exclusive(w, r, io.MultiReader(bytes.NewReader(body), r.Body))
			return
		}
		req, err := parseRequest(ep, body)
		switch {
		case err != nil:
			// The server answers with its own error and computes nothing.
			p.passthrough(w, r, bytes.NewReader(body))
		case req.multi:
			p.exclusive(w, r, bytes.NewReader(body))
		default:
			p.pinned(w, r, req, body)
		}
	}
}

// pinned runs one request in a slot the proxy holds, restoring its prefix
// first when the bridge has it.
func (p *Proxy) pinned(w http.ResponseWriter, r *http.Request, req *request, body []byte) {
	ctx := r.Context()
	lm := p.current()
	tab := p.table()
	if tab == nil {
		p.stats.plain.Add(1)
		p.passthrough(w, r, bytes.NewReader(body))
		return
	}
	var tokens []int32
	if lm != nil && !req.dirty && req.ep != infill {
		var err error
		if tokens, err = p.promptTokens(ctx, req, body); err != nil {
			p.log.Debug("mcbridge proxy: no tokens for the prompt", "err", err)
			p.stats.noTokens.Add(1)
		}
	}
	want := -1
	if req.idSlot >= 0 {
		want = req.idSlot % tab.len() // llama-server wraps slot ids the same way
	}
	slot, local, err := tab.acquire(ctx, want, tokens)
	if err != nil {
		return // the client went away while waiting
	}
	// The slot's own prefix is what the server would reuse: the decision
	// weighs a restore against computing only past it.
	var lk *bridge.Plan
	if tokens != nil {
		if lk, err = lm.m.Lookup(p.opts.Scope, tokens, local); err != nil {
			tokens, lk = nil, nil
		}
	}
	// Counted from here, so that Flush after an answer waits for its save.
	p.pending.Add(1)
	handedOff := false
	defer func() {
		if !handedOff {
			p.pending.Add(-1)
		}
	}()
	before := tab.view(slot)
	x := &exchange{}
	if lk != nil && req.cachePrompt && lk.RestoreTokens > 0 {
		t0 := p.opts.Now()
		n, restoreErr := p.restore(ctx, lm, slot, lk)
		x.restoreMS = float64(p.opts.Now().Sub(t0).Microseconds()) / 1000
		switch {
		case restoreErr == nil:
			x.restored = n
			before = slotState{tokens: tokens[:n]}
			p.stats.restores.Add(1)
			p.stats.restoredTokens.Add(int64(n))
		case errors.As(restoreErr, new(*slotTouched)):
			// The server may have cleared the slot or restored part of
			// it: what it holds is unknown, but no dirtier than before.
			before.tokens = nil
			p.stats.fallback(restoreErr)
			p.log.Info("mcbridge proxy: restore fell back", "slot", slot, "err", restoreErr)
		default:
			p.stats.fallback(restoreErr)
			p.log.Debug("mcbridge proxy: restore fell back", "slot", slot, "err", restoreErr)
		}
	}
	out, err := req.pinned(slot)
	if err != nil {
		tab.release(slot, nil, true)
		p.passthrough(w, r, bytes.NewReader(body))
		return
	}
	r2 := r.Clone(context.WithValue(ctx, exchangeKey{}, x))
	r2.Body, r2.ContentLength = io.NopCloser(bytes.NewReader(out)), int64(len(out))
	r2.Header.Del("Content-Length")
	// The proxy reads the answer's timings: it asks for it uncompressed
	// (Go's transport negotiates and undoes compression on its own).
	r2.Header.Del("Accept-Encoding")
	p.stats.pinned.Add(1)
	p.rp.ServeHTTP(w, r2)
	if !x.complete || x.status/100 != 2 {
		// What the server did with the slot is not known; it computed over
		// at most what it held.
		tab.release(slot, nil, before.dirty || req.dirty)
		return
	}
	if x.haveAns && x.ans.Timings != nil {
		p.observe(x.ans.Timings)
		if x.ans.Truncated {
			p.stopPublishing("the upstream truncated a prompt")
		}
	}
	dirty := nextDirty(before, tokens, req.dirty, x)
	matched := 0
	if lk != nil {
		matched = lk.MatchedBlocks
	}
	handedOff = true
	p.workers.Add(1)
	go p.after(lm, tab, slot, tokens, dirty, x, matched)
}

// nextDirty says whether a slot may hold unclean KV after a request that
// had before in it: the request's own cells are clean unless it shifts or
// adapts them, and reused cells are as clean as the slot was, as long as
// the server reused no more than the proxy knows the slot held.
func nextDirty(before slotState, prompt []int32, reqDirty bool, x *exchange) bool {
	if reqDirty {
		return true
	}
	if !x.haveAns || x.ans.Timings == nil {
		return true
	}
	c := x.ans.Timings.CacheN
	if c == 0 {
		return false
	}
	if prompt == nil || c > lcp(before.tokens, prompt) {
		return true
	}
	return before.dirty
}

// observe feeds the arbiter's prefill model with the server's timings.
func (p *Proxy) observe(t *timings) {
	if t.PromptN <= 0 || t.PromptMS <= 0 {
		return
	}
	p.b.Arbiter().ObservePrefill(t.CacheN, t.CacheN+t.PromptN, time.Duration(t.PromptMS*float64(time.Millisecond)))
}

// promptTokens finds the tokens the server will compute for a request.
func (p *Proxy) promptTokens(ctx context.Context, req *request, body []byte) ([]int32, error) {
	switch {
	case req.tokens != nil:
		return req.tokens, nil
	case req.ep == chat:
		prompt, err := p.up.applyTemplate(ctx, body)
		if err != nil {
			return nil, err
		}
		return p.up.tokenize(ctx, prompt)
	case req.prompt != nil:
		return p.up.tokenize(ctx, req.prompt)
	}
	return nil, status.Errorf(status.Unsupported, "no single prompt")
}

// modifyResponse reads a pinned answer's timings and adds the proxy's to
// non-streaming JSON answers; other answers pass untouched.
func (p *Proxy) modifyResponse(resp *http.Response) error {
	x, _ := resp.Request.Context().Value(exchangeKey{}).(*exchange)
	if x == nil {
		return nil
	}
	x.status = resp.StatusCode
	if resp.StatusCode/100 != 2 {
		return nil
	}
	if isEventStream(resp.Header.Get("Content-Type")) {
		resp.Body = &sseSniffer{rc: resp.Body, onClose: func(s *sseSniffer) {
			x.ans, x.haveAns, x.complete = s.last, s.seen, s.atEOF
		}}
		return nil
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return err
	}
	x.ans, x.haveAns = readAnswer(b)
	x.complete = true
	if out, ok := spliceTimings(b, mcbMembers(x.restored, x.restoreMS)); ok {
		b = out
	}
	resp.Body = io.NopCloser(bytes.NewReader(b))
	resp.ContentLength = int64(len(b))
	resp.Header.Set("Content-Length", strconv.Itoa(len(b)))
	return nil
}

func isEventStream(ct string) bool {
	mt, _, _ := strings.Cut(ct, ";")
	return strings.EqualFold(strings.TrimSpace(mt), "text/event-stream")
}

// passthrough forwards a request as it came.
func (p *Proxy) passthrough(w http.ResponseWriter, r *http.Request, body io.Reader) {
	r2 := r.Clone(r.Context())
	r2.Body = io.NopCloser(body)
	p.rp.ServeHTTP(w, r2)
}

func (p *Proxy) passthroughAll(w http.ResponseWriter, r *http.Request) {
	p.rp.ServeHTTP(w, r)
}

func (p *Proxy) exclusiveAll(w http.ResponseWriter, r *http.Request) {
	p.exclusive(w, r, r.Body)
}

// exclusive forwards a request that may compute in slots the server picks
// (several completions at once, embeddings, other APIs) while holding every
// slot; afterwards what the slots hold is unknown.
func (p *Proxy) exclusive(w http.ResponseWriter, r *http.Request, body io.Reader) {
	p.stats.exclusive.Add(1)
	tab := p.table()
	if tab == nil {
		p.passthrough(w, r, body)
		return
	}
	if err := tab.holdAll(r.Context()); err != nil {
		return
	}
	p.passthrough(w, r, body)
	for i := 0; i < tab.len(); i++ {
		tab.release(i, nil, false)
	}
}

// slotFile forwards a client's own slot save, restore or erase, holding
// that slot. A restored file is KV of unknown origin: the slot is dirty.
func (p *Proxy) slotFile(w http.ResponseWriter, r *http.Request) {
	tab := p.table()
	id, err := strconv.Atoi(r.PathValue("id"))
	if tab == nil || err != nil || id < 0 {
		p.passthroughAll(w, r)
		return
	}
	id %= tab.len()
	if _, _, err := tab.acquire(r.Context(), id, nil); err != nil {
		return
	}
	before := tab.view(id)
	p.passthroughAll(w, r)
	switch r.URL.Query().Get("action") {
	case "save":
		tab.release(id, before.tokens, before.dirty)
	case "erase":
		tab.release(id, []int32{}, false)
	default:
		tab.release(id, nil, true)
	}
}

// loraAdapters forwards a change of the server-wide adapter scales. Every
// slot's KV was computed under the old scales and the model's KV changes:
// the slots turn dirty and the model is learned again.
func (p *Proxy) loraAdapters(w http.ResponseWriter, r *http.Request) {
	tab := p.table()
	if tab != nil {
		if err := tab.holdAll(r.Context()); err != nil {
			return
		}
	}
	p.passthroughAll(w, r)
	if tab != nil {
		for i := 0; i < tab.len(); i++ {
			tab.release(i, nil, true)
		}
	}
	p.mu.Lock()
	lm := p.model
	p.mu.Unlock()
	if lm != nil {
		p.forget(lm, "the server's LoRA adapters changed")
	}
}

// slotPath is a file of the slot directory.
func (p *Proxy) slotPath(name string) string { return filepath.Join(p.opts.SlotDir, name) }
