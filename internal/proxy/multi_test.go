package proxy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/proxy/route"
)

// front is a proxy in front of several fake servers.
type front struct {
	p     *Proxy
	url   string
	fakes []*fakeServer
}

func startFront(t testing.TB, fakes []*fakeServer, dir, owner string, opts Options) *front {
	t.Helper()
	b := openBridge(t, dir, owner)
	for _, fs := range fakes {
		opts.Upstreams = append(opts.Upstreams, Upstream{URL: fs.url(), SlotDir: fs.dir})
	}
	if opts.HealthInterval == 0 {
		opts.HealthInterval = -1 // the tests check health when they mean to
	}
	p, err := New(b, opts)
	require.NoError(t, err)
	srv := httptest.NewServer(p)
	t.Cleanup(func() {
		srv.Close()
		assert.NoError(t, p.Close(), "proxy close")
		for _, fs := range fakes {
			assertEmptyDir(t, nil, fs.dir)
		}
	})
	return &front{p: p, url: srv.URL, fakes: fakes}
}

func (f *front) flush(t testing.TB) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, f.p.Flush(ctx))
}

// reply is an answer through the proxy: its status, body and the proxy's
// headers.
type reply struct {
	code     int
	body     []byte
	upstream int
	restored int
}

func postReply(t testing.TB, url, path string, body any) reply {
	t.Helper()
	b, err := json.Marshal(body)
	require.NoError(t, err)
	resp, err := http.Post(url+path, "application/json", bytes.NewReader(b))
	require.NoError(t, err)
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	r := reply{code: resp.StatusCode, body: out, upstream: -1}
	if v := resp.Header.Get("Mcb-Upstream"); v != "" {
		r.upstream, _ = strconv.Atoi(v)
	}
	r.restored, _ = strconv.Atoi(resp.Header.Get("Mcb-Restored-N"))
	return r
}

func fakes(t testing.TB, n, slots int) []*fakeServer {
	var out []*fakeServer
	for range n {
		out = append(out, newFake(t, "slot-fa-on.bin", slots, 1, 1))
	}
	return out
}

func completionReq(prompt []int32, extra ...any) map[string]any {
	r := map[string]any{"prompt": prompt, "n_predict": 4, "temperature": 0}
	for i := 0; i+1 < len(extra); i += 2 {
		r[extra[i].(string)] = extra[i+1]
	}
	return r
}

// Three servers behind one proxy: a prefix lands on the server that holds
// it while that one is idle; with its slot busy the next request sharing
// the prefix goes elsewhere and restores it there; every answer is the one
// a server without the proxy gives.
func TestRoutesToTheHolderAndSpreadsWhenBusy(t *testing.T) {
	f := startFront(t, fakes(t, 3, 1), directoryName(t), "one", Options{})
	ref := newFake(t, "slot-fa-on.bin", 1, 1, 1)
	prefix := seqTokens(3*blockTokens, 7, 3)
	check := func(r reply, req map[string]any) {
		t.Helper()
		require.Equal(t, 200, r.code, "%s", r.body)
		_, want := post(t, ref.url(), "/completion", req)
		assert.Equal(t, cacheFree(t, want), cacheFree(t, r.body), "the answer is the server's own")
	}

	first := completionReq(concat(prefix, []int32{1, 2, 3}))
	r := postReply(t, f.url, "/completion", first)
	check(r, first)
	holder := r.upstream
	f.flush(t)

	second := completionReq(concat(prefix, []int32{4, 5}))
	r = postReply(t, f.url, "/completion", second)
	check(r, second)
	assert.Equal(t, []int{holder, 0}, []int{r.upstream, r.restored}, "the idle holder takes it, nothing restored")
	f.flush(t)

	// A streamed answer keeps the holder's one slot busy.
	gate := make(chan struct{})
	hf := f.fakes[holder]
	hf.mu.Lock()
	hf.gate = gate
	hf.mu.Unlock()
	b, _ := json.Marshal(completionReq(concat(prefix, []int32{6}), "stream", true, "n_predict", 50))
	resp, err := http.Post(f.url+"/completion", "application/json", bytes.NewReader(b))
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, strconv.Itoa(holder), resp.Header.Get("Mcb-Upstream"), "the stream goes to the holder")
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(line, "data: "), line)

	third := completionReq(concat(prefix, []int32{7, 7}))
	r = postReply(t, f.url, "/completion", third)
	check(r, third)
	assert.NotEqual(t, holder, r.upstream, "the busy holder is passed over")
	assert.Equal(t, 3*blockTokens, r.restored, "the other server restores the prefix")
	close(gate)
	_, _ = io.Copy(io.Discard, resp.Body)
	f.flush(t)

	st := f.p.Stats()
	assert.Equal(t, int64(2), st.Routes["prefix"], "routes %v", st.Routes)
	assert.Equal(t, int64(1), st.Routes["spread"], "routes %v", st.Routes)
	metrics := metricLines(t, f.url)
	assert.Contains(t, metrics, `mcproxy_route_decisions_total{reason="spread"} 1`)
	assert.Contains(t, metrics, `mcproxy_upstream_routed_total{upstream="`+f.fakes[holder].url()+`"} 3`)
}

// metricLines are the sample lines of a proxy's /metrics.
func metricLines(t testing.TB, url string) []string {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if l != "" && l[0] != '#' {
			out = append(out, l)
		}
	}
	return out
}

// An upstream that stops answering leaves the rotation at the first
// request that finds it gone; that request goes to another server and no
// request fails. Started again on its port, it comes back after its health
// checks pass, as a new server whose slots hold nothing the proxy knew.
func TestDeadUpstreamLeavesTheRotationAndComesBack(t *testing.T) {
	fs := fakes(t, 2, 1)
	f := startFront(t, fs, directoryName(t), "one", Options{})
	require.NoError(t, f.p.Learn(context.Background()))
	// Upstream 0 takes cold requests first (ties go to the lower index).
	addr := fs[0].srv.Listener.Addr().String()
	fs[0].kill()
	for i := range 6 {
		r := postReply(t, f.url, "/completion", completionReq(seqTokens(20, 3, i)))
		require.Equal(t, 200, r.code, "request %d: %s", i, r.body)
		assert.Equal(t, 1, r.upstream, "request %d", i)
	}
	st := f.p.State()
	assert.False(t, st.Upstreams[0].Up, "the dead server is out")
	assert.Equal(t, int64(1), f.p.Stats().Retries, "one request found it gone and went on")

	startAgain(t, fs[0], addr)
	f.p.CheckHealth(context.Background())
	assert.False(t, f.p.State().Upstreams[0].Up, "one good check is not enough")
	f.p.CheckHealth(context.Background())
	st = f.p.State()
	assert.True(t, st.Upstreams[0].Up, "back in the rotation")
	assert.Equal(t, int64(1), st.Upstreams[0].Restarts, "and known as a new server")
	// A stream held open on one, a request to the other: both take work.
	gate := make(chan struct{})
	for _, s := range fs {
		s.mu.Lock()
		s.gate = gate
		s.mu.Unlock()
	}
	b, _ := json.Marshal(completionReq(seqTokens(20, 5, 1), "stream", true, "n_predict", 20))
	resp, err := http.Post(f.url+"/completion", "application/json", bytes.NewReader(b))
	require.NoError(t, err)
	defer resp.Body.Close()
	_, err = bufio.NewReader(resp.Body).ReadString('\n')
	require.NoError(t, err)
	r := postReply(t, f.url, "/completion", completionReq(seqTokens(20, 9, 2)))
	require.Equal(t, 200, r.code, "%s", r.body)
	streamed, _ := strconv.Atoi(resp.Header.Get("Mcb-Upstream"))
	assert.ElementsMatch(t, []int{0, 1}, []int{streamed, r.upstream}, "the busy one is passed over")
	close(gate)
	_, _ = io.Copy(io.Discard, resp.Body)
	f.flush(t)
}

// startAgain starts a killed fake as a new process on its old address.
func startAgain(t *testing.T, fs *fakeServer, addr string) {
	t.Helper()
	l, err := net.Listen("tcp", addr)
	require.NoError(t, err)
	fs.restart()
	fs.srv = httptest.NewUnstartedServer(fs.handler())
	fs.srv.Listener.Close()
	fs.srv.Listener = l
	fs.srv.Start()
	t.Cleanup(fs.srv.Close)
}

// A proxy whose every upstream is out of the rotation still tries them: a
// server restarted on its port is not refused until two health checks
// have readmitted it.
func TestEveryUpstreamOutIsTriedAnyway(t *testing.T) {
	fs := fakes(t, 1, 1)
	f := startFront(t, fs, directoryName(t), "one", Options{})
	require.NoError(t, f.p.Learn(context.Background()))
	addr := fs[0].srv.Listener.Addr().String()
	fs[0].kill()
	f.p.CheckHealth(context.Background())
	require.False(t, f.p.State().Upstreams[0].Up)

	startAgain(t, fs[0], addr)
	r := postReply(t, f.url, "/completion", completionReq(seqTokens(20, 3, 1)))
	require.Equal(t, 200, r.code, "%s", r.body)
	assert.Equal(t, int64(1), f.p.Stats().Routes["last_resort"])
	r = postReply(t, f.url, "/tokenize", map[string]any{"content": "hello"})
	assert.Equal(t, 200, r.code, "a call that computes nothing too: %s", r.body)
	f.flush(t)
}

// The baseline policies ignore prefixes.
func TestRoundRobinIgnoresPrefixes(t *testing.T) {
	f := startFront(t, fakes(t, 3, 1), directoryName(t), "one", Options{Route: routeConfig("round-robin")})
	prefix := seqTokens(3*blockTokens, 7, 3)
	var got []int
	for i := range 4 {
		r := postReply(t, f.url, "/completion", completionReq(concat(prefix, []int32{int32(i)})))
		require.Equal(t, 200, r.code)
		got = append(got, r.upstream)
		f.flush(t)
	}
	assert.Equal(t, []int{0, 1, 2, 0}, got)
	assert.Equal(t, int64(4), f.p.Stats().Routes["round_robin"])
}

// Slot actions and adapter changes name one server's slots: with several
// upstreams they are refused, not guessed.
func TestSeveralUpstreamsRefuseSlotActions(t *testing.T) {
	f := startFront(t, fakes(t, 2, 1), directoryName(t), "one", Options{})
	for _, path := range []string{"/slots/0?action=erase", "/lora-adapters"} {
		r := postReply(t, f.url, path, map[string]any{})
		assert.Equal(t, http.StatusBadRequest, r.code, path)
		assert.Contains(t, string(r.body), "several upstreams")
	}
}

func routeConfig(policy string) route.Config {
	p, err := route.ParsePolicy(policy)
	if err != nil {
		panic(err)
	}
	return route.Config{Policy: p}
}
