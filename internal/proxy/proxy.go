// Package proxy puts the bridge in front of stock llama-servers (v0.5.0)
// without rebuilding them, through the servers' slot files.
//
// One proxy serves one model from several upstream servers. For a
// completion it finds the prompt's tokens, looks its leading blocks up, and
// routes it (package route) to the upstream with the lowest expected time
// to first token: one whose slot already holds the prefix, else one that
// restores it fastest, else the least loaded. There, on a hit, it fetches
// the blocks into a slot file holding exactly the restored prefix, has the
// server restore that file into a free slot and pins the request to that
// slot, so the server computes only the rest. After the answer it saves the
// slot into a file and publishes the new full blocks from it, off the
// request's path. The client sees the server's answer as it sent it, with
// the Mcb-* headers added to every answer; anything
// that fails falls back to forwarding the request as it came, and an
// upstream that does not answer leaves the rotation while the request goes
// to another.
//
// The proxy schedules the servers' slots: every request that computes is
// pinned to a slot the proxy holds for its whole run (restore, compute,
// save), so it never restores into a slot another request uses. It
// verifies before it relies: what it remembers of a slot counts only when
// the server's GET /slots confirms it (the slot's last task and token
// count are the ones the proxy saw after its own request), a server whose
// slots forget their tasks has restarted and is learned again, and what a
// slot holds after a request is taken from the answer's own counts, never
// from the plan. Anything unconfirmed is unknown: the prefix is restored.
//
// Only clean KV is published (docs/design.md §5.4): cells computed from
// position 0 over exactly the slot's tokens, by the registered model. A
// slot turns dirty when a request shifts or adapts its cells (per-request
// LoRA, n_cache_reuse), when a client restores a slot file of its own, or
// when the server reused more of it than the proxy knows the origin of;
// a dirty slot publishes nothing until a request recomputes it from
// position 0. Server-wide context shift and cache reuse are not visible in
// /props: Options says whether the upstreams have them, and then nothing is
// published at all.
package proxy

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/proxy/route"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Upstream is one llama-server behind the proxy.
type Upstream struct {
	// URL is the server's base URL.
	URL string
	// SlotDir is the server's --slot-save-path, on this host: the proxy
	// restores into its slots and publishes from them. Without one the
	// server is routed to and its slots are scheduled, but the proxy
	// neither restores nor saves there.
	SlotDir string
	// Patched: a patched llama-server of the same swarm, which restores
	// from the directory by itself; the router counts on that.
	Patched bool
}

// upstreamTransport carries requests to llama-server without reusing
// connections. llama-server v0.5.0 closes a connection after every streamed
// answer while that answer's headers offer keep-alive (its chunked content
// provider returns false after the last chunk, which cpp-httplib takes for
// a failed write), and closes an idle one after 5 s: a POST sent on such a
// connection just as the server closes it fails with EOF and is not
// retried (CI saw it as a test's request failing right after a streamed
// one). A connection on the same host or network costs far less than that
// failure, and frees the server's HTTP thread at once.
func upstreamTransport() *http.Transport {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.DisableKeepAlives = true
	return t
}

// Options configure a Proxy.
type Options struct {
	// Upstreams are the servers behind the proxy, all of one model.
	Upstreams []Upstream
	// Upstream and SlotDir name the one upstream when Upstreams is empty.
	Upstream string
	SlotDir  string
	// APIKey is the servers' --api-key, sent with the proxy's own calls
	// (slot files, tokenizer, probe); clients send their own.
	APIKey string
	// ModelPath is the GGUF to digest for the fingerprint when the path in
	// a server's /props is not absolute or not readable here.
	ModelPath string
	// NoPublish turns publishing off: restores only.
	NoPublish bool
	// UpstreamContextShift and UpstreamCacheReuse mirror the servers'
	// --context-shift and --cache-reuse, which /props does not report:
	// with either, cells may hold KV computed over other tokens, and
	// nothing is published.
	UpstreamContextShift bool
	UpstreamCacheReuse   int
	// Scope salts every key (tenant isolation); empty shares with everyone
	// using the same model.
	Scope key.Scope
	// Route configures the router; its clock is Now.
	Route route.Config
	// HealthInterval is how often every upstream's health is checked (0:
	// 1s; negative: never, the tests call CheckHealth).
	HealthInterval time.Duration
	// Transport carries requests to the upstreams; nil uses
	// upstreamTransport.
	Transport http.RoundTripper
	// Log receives the proxy's events; nil discards them.
	Log *slog.Logger
	// Now times restores and routing; nil uses time.Now.
	Now func() time.Time
	// PublishQueue bounds the saved slot files waiting to be published;
	// beyond it a file is dropped (0: 4).
	PublishQueue int
	// RetryLearn is how long the proxy forwards plainly after it failed to
	// learn an upstream's model before trying again (0: 10s).
	RetryLearn time.Duration
}

// maxRequestBody bounds the body the proxy reads to find the prompt;
// larger requests are forwarded without the bridge.
const maxRequestBody = 256 << 20

// controlTimeout bounds the proxy's own calls: learning, saving after an
// answer (the client is gone by then).
const controlTimeout = 5 * time.Minute

// Proxy is an http.Handler in front of the upstreams.
type Proxy struct {
	b      *bridge.Bridge
	opts   Options
	log    *slog.Logger
	inst   string // names this proxy's files in the slot directories
	seq    atomic.Uint64
	ups    []*backend
	router *route.Router
	mux    *http.ServeMux

	mu     sync.Mutex
	closed bool

	queue   chan publishJob
	workers sync.WaitGroup // the publisher, the savers and the health checker
	pending atomic.Int64   // answers whose save or publish is not done
	stop    chan struct{}  // closed by Close
	stats   counters
	bufs    readBuffers // what saved slot files are read into
}

// New builds a proxy in front of opts' upstreams that uses b. It contacts
// nothing: the upstreams' model is learned on first use (or by Learn).
func New(b *bridge.Bridge, opts Options) (*Proxy, error) {
	if len(opts.Upstreams) == 0 {
		opts.Upstreams = []Upstream{{URL: opts.Upstream, SlotDir: opts.SlotDir}}
	} else if opts.Upstream != "" || opts.SlotDir != "" {
		return nil, status.Errorf(status.Config, "give the upstreams either as Upstreams or as Upstream and SlotDir")
	}
	seen := map[string]bool{}
	for _, u := range opts.Upstreams {
		if seen[u.URL] {
			return nil, status.Errorf(status.Config, "upstream %q given twice", u.URL)
		}
		seen[u.URL] = true
		if u.SlotDir == "" {
			continue
		}
		if st, err := os.Stat(u.SlotDir); err != nil || !st.IsDir() {
			return nil, status.Errorf(status.Config, "slot directory %q: not a directory (%v)", u.SlotDir, err)
		}
	}
	if opts.Transport == nil {
		opts.Transport = upstreamTransport()
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
	if opts.HealthInterval == 0 {
		opts.HealthInterval = time.Second
	}
	opts.Route.Now = opts.Now
	router, err := route.New(opts.Route, len(opts.Upstreams))
	if err != nil {
		return nil, err
	}
	var id [6]byte
	_, _ = rand.Read(id[:])
	p := &Proxy{
		b: b, opts: opts, log: opts.Log, inst: hex.EncodeToString(id[:]), router: router,
		queue: make(chan publishJob, opts.PublishQueue), stop: make(chan struct{}),
	}
	// Slot files are KV, as the pool is: a quarter of it more may stay
	// resident between saves.
	_, _, poolBytes := b.Resident()
	p.bufs.limit = int(poolBytes / 4)
	for i, u := range opts.Upstreams {
		be, err := newBackend(p, i, u)
		if err != nil {
			return nil, err
		}
		p.ups = append(p.ups, be)
	}
	p.routes()
	p.workers.Add(1)
	go p.publisher()
	if opts.HealthInterval > 0 {
		p.workers.Add(1)
		go p.healthLoop()
	}
	return p, nil
}

func (p *Proxy) routes() {
	m := http.NewServeMux()
	m.HandleFunc("GET /healthz", p.healthz)
	m.HandleFunc("GET /metrics", p.metrics)
	for path, ep := range map[string]endpoint{
		"/completion": completion, "/completions": completion, "/v1/completions": completion,
		"/chat/completions": chat, "/v1/chat/completions": chat, "/infill": infill,
		"/responses": responses, "/v1/responses": responses, "/v1/messages": messages,
	} {
		m.HandleFunc("POST "+path, p.keyed(ep))
	}
	m.HandleFunc("POST /slots/{id}", p.oneUpstream(func(be *backend) http.HandlerFunc { return be.slotFile }))
	m.HandleFunc("POST /lora-adapters", p.oneUpstream(func(be *backend) http.HandlerFunc { return be.loraAdapters }))
	// Routes that never compute in a slot. Anything else that is not a GET
	// may (embeddings, reranking): it runs holding every slot.
	for _, path := range []string{"/tokenize", "/detokenize", "/apply-template", "/props",
		"/chat/completions/input_tokens", "/v1/chat/completions/input_tokens",
		"/responses/input_tokens", "/v1/responses/input_tokens", "/v1/messages/count_tokens",
		"/v1/chat/completions/control"} {
		m.HandleFunc("POST "+path, p.anyUpstream)
	}
	m.HandleFunc("GET /", p.anyUpstream)
	m.HandleFunc("OPTIONS /", p.anyUpstream)
	m.HandleFunc("/", p.computing)
	p.mux = m
}

// ServeHTTP serves the proxy's own endpoints and forwards the rest.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) { p.mux.ServeHTTP(w, r) }

// Learn contacts every upstream now and learns its model; requests do it
// on their own when it has not been done. It fails when none learned.
func (p *Proxy) Learn(ctx context.Context) error {
	var errs []error
	for _, be := range p.ups {
		be.learnMu.Lock()
		err := be.relearn(ctx)
		be.learnMu.Unlock()
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", be.name, err))
		}
	}
	if len(errs) == len(p.ups) {
		return errs[0]
	}
	return nil
}

// CheckHealth checks every upstream once, as the health loop does.
func (p *Proxy) CheckHealth(ctx context.Context) {
	for _, be := range p.ups {
		be.checkHealth(ctx)
	}
}

func (p *Proxy) healthLoop() {
	defer p.workers.Done()
	t := time.NewTicker(p.opts.HealthInterval)
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), min(2*p.opts.HealthInterval, 5*time.Second))
		p.CheckHealth(ctx)
		cancel()
	}
}

// fileName names a file of this proxy in a slot directory; llama-server
// accepts letters, digits, '-', '_' and '.'.
func (p *Proxy) fileName(kind string, slot int) string {
	return fmt.Sprintf("mcb-%s-%s%d-%d.bin", p.inst, kind, slot, p.seq.Add(1))
}

// Flush waits until every answer's save and publish is done: its blocks
// handed to the bridge, and the bridge's publisher done offering them to
// the directory.
func (p *Proxy) Flush(ctx context.Context) error {
	if err := p.drain(ctx); err != nil {
		return err
	}
	return p.b.Flush(ctx)
}

// drain waits until every answer's save is done and its blocks are handed
// to the bridge.
func (p *Proxy) drain(ctx context.Context) error {
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

// Close waits for pending saves and their hand-off to the bridge and
// stops the publisher and the health checks. The HTTP server in front must
// be shut down first; the bridge stays open, its publisher with it.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return status.Errorf(status.State, "proxy closed twice")
	}
	p.closed = true
	p.mu.Unlock()
	close(p.stop)
	ctx, cancel := context.WithTimeout(context.Background(), controlTimeout)
	err := p.drain(ctx)
	cancel()
	// No send starts once closed is set (enqueue checks it under mu).
	p.mu.Lock()
	close(p.queue)
	p.mu.Unlock()
	p.workers.Wait()
	for _, be := range p.ups {
		be.closeFiles()
	}
	return err
}

func (p *Proxy) isClosed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closed
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

// readBody reads a request's body up to maxRequestBody; rest is what is
// left of a larger one (nil when it all fit).
func readBody(r *http.Request) (body []byte, rest io.Reader, err error) {
	body, err = io.ReadAll(io.LimitReader(r.Body, maxRequestBody+1))
	if err != nil {
		return nil, nil, err
	}
	if len(body) > maxRequestBody {
		return nil, io.MultiReader(bytes.NewReader(body), r.Body), nil
	}
	return body, nil, nil
}

// keyed serves the routes whose prompt the proxy can read.
func (p *Proxy) keyed(ep endpoint) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		p.stats.requests.Add(1)
		body, rest, err := readBody(r)
		switch {
		case err != nil:
			http.Error(w, "mcbridge proxy: reading the request: "+err.Error(), http.StatusBadRequest)
			return
		case rest != nil:
			p.dispatch(w, r, nil, rest, nil, holdAll)
			return
		}
		req, err := parseRequest(ep, body)
		switch {
		case err != nil:
			// The server answers with its own error and computes nothing.
			p.dispatch(w, r, body, nil, nil, plain)
		case req.multi:
			p.dispatch(w, r, body, nil, nil, holdAll)
		default:
			p.dispatch(w, r, body, nil, req, pin)
		}
	}
}

// computing serves requests the proxy does not read that may compute in
// slots the server picks (embeddings, reranking, unknown routes): each
// runs holding every slot of its upstream.
func (p *Proxy) computing(w http.ResponseWriter, r *http.Request) {
	body, rest, err := readBody(r)
	if err != nil {
		http.Error(w, "mcbridge proxy: reading the request: "+err.Error(), http.StatusBadRequest)
		return
	}
	p.dispatch(w, r, body, rest, nil, holdAll)
}

// anyUpstream forwards a request that computes nothing (tokenizer, props,
// model list) to the first askable upstream.
func (p *Proxy) anyUpstream(w http.ResponseWriter, r *http.Request) {
	body, rest, err := readBody(r)
	if err != nil {
		http.Error(w, "mcbridge proxy: reading the request: "+err.Error(), http.StatusBadRequest)
		return
	}
	ask := p.askable()
	for i, be := range p.ups {
		if !ask[i] {
			continue
		}
		if res := be.forward(w, r, body, rest, rest == nil); !res.unreachable {
			return
		}
		p.router.Health(i, false)
	}
	http.Error(w, "mcbridge proxy: no upstream answered", http.StatusServiceUnavailable)
}

// oneUpstream serves routes that act on one server's slots or adapters:
// with several upstreams the proxy cannot tell which is meant.
func (p *Proxy) oneUpstream(h func(be *backend) http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if len(p.ups) != 1 {
			http.Error(w, "mcbridge proxy: this proxy has several upstreams; act on a server's slots or adapters at the server itself",
				http.StatusBadRequest)
			return
		}
		h(p.ups[0])(w, r)
	}
}

// mode is how a request runs on its upstream.
type mode int

const (
	plain   mode = iota // forwarded as it came
	holdAll             // forwarded while the proxy holds every slot
	pin                 // pinned to a slot the proxy holds, restored first
)

// served is how a request went on one upstream.
type served struct {
	// unreachable: nothing reached the client; another upstream may take
	// the request.
	unreachable bool
	outcome     route.Outcome
}

// dispatch routes a request and serves it, on the next upstream when the
// chosen one does not answer. body is the request's body, or rest when it
// was too large to read (then it goes once, unread).
func (p *Proxy) dispatch(w http.ResponseWriter, r *http.Request, body []byte, rest io.Reader, req *request, m mode) {
	ctx := r.Context()
	var tk *tokenized
	if m == pin && !req.dirty && req.ep != infill {
		tk = p.tokenize(ctx, req, body)
	}
	var look *lookup
	skip := make([]bool, len(p.ups))
	for {
		rq, l := p.routeRequest(req, tk, look, skip)
		look = l
		ch, err := p.router.Choose(rq)
		p.stats.routed(ch.Reason)
		if err != nil {
			http.Error(w, "mcbridge proxy: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		p.log.Debug("mcbridge proxy: routed", "choice", ch.String())
		be := p.ups[ch.Upstream]
		be.routed.Add(1)
		var res served
		switch m {
		case pin:
			res = be.pinned(w, r, req, body, tk, look, ch)
		case holdAll:
			res = be.exclusive(w, r, body, rest)
		default:
			res = be.forward(w, r, body, nil, true)
		}
		p.router.Done(ch.Ticket, res.outcome)
		if !res.unreachable || ctx.Err() != nil {
			return
		}
		p.log.Warn("mcbridge proxy: upstream did not answer; it leaves the rotation and the request goes to another", "upstream", be.name)
		skip[ch.Upstream] = true
		p.stats.retries.Add(1)
	}
}
