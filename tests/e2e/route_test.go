package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/testenv"
)

// routeConfig is the proxies' bridge in these tests: one process, its own
// memory directory, every match restored (the tiny model computes faster
// than any restore, which would leave the cost model nothing to restore).
const routeConfig = `{"block_tokens": 64, "arbiter": {"policy": "always-restore"}}`

// stockUpstream runs a stock llama-server with a slot directory of its
// own and slots slots, on port when it is not 0 (a restart on the same
// port).
func stockUpstream(t *testing.T, name, model string, slots int, dir string, port int) *testenv.Llama {
	t.Helper()
	args := append(testenv.ServerArgs(model, 4096, slots, "on"), "--slot-save-path", dir)
	if port == 0 {
		return testenv.StartLlama(t, name, testenv.StockServer(t), args)
	}
	p := testenv.Spawn(t, name, testenv.StockServer(t), append(args, "--host", "127.0.0.1", "--port", strconv.Itoa(port)), nil)
	url := "http://127.0.0.1:" + strconv.Itoa(port)
	require.NoError(t, testenv.WaitHTTP(p, url+"/health", 3*time.Minute))
	return &testenv.Llama{Server: &testenv.Server{Proc: p, URL: url, Port: port}}
}

// upstreams are stock servers behind one proxy.
type upstreams struct {
	servers []*testenv.Llama
	dirs    []string
	proxy   *testenv.Proxy
}

// startRouted runs n stock servers of slots slots each and one proxy in
// front of them all.
func startRouted(t *testing.T, model string, n, slots int, extra ...string) *upstreams {
	t.Helper()
	u := &upstreams{}
	args := []string{"proxy", "--config", routeConfig}
	for i := range n {
		name := fmt.Sprintf("u%d", i)
		dir := testenv.SlotDir(t, name)
		s := stockUpstream(t, name, model, slots, dir, 0)
		u.servers, u.dirs = append(u.servers, s), append(u.dirs, dir)
		args = append(args, "--upstream", s.URL+",slots="+dir)
	}
	s := testenv.StartServer(t, "proxy", testenv.Mcbridge(t), append(args, extra...), nil, func(port int) []string {
		return []string{"--listen", "127.0.0.1:" + strconv.Itoa(port)}
	}, "/healthz")
	u.proxy = &testenv.Proxy{Server: s}
	return u
}

// settled waits until the proxy has saved and published every answer.
func settled(t *testing.T, p *testenv.Proxy) {
	t.Helper()
	testenv.Eventually(t, defaultWait, func() bool { return p.State(t)["pending"] == float64(0) }, "the proxy never settled")
}

// answer is a completion through the proxy with the proxy's headers.
type answer struct {
	testenv.Completion
	code     int
	body     []byte
	upstream int
	restored int
}

func postThrough(t *testing.T, url, path string, body any) answer {
	t.Helper()
	b, err := json.Marshal(body)
	require.NoError(t, err)
	resp, err := testenv.Client.Post(url+path, "application/json", bytes.NewReader(b))
	require.NoError(t, err, "POST %s", path)
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	a := answer{code: resp.StatusCode, body: out, upstream: -1}
	if v := resp.Header.Get("Mcb-Upstream"); v != "" {
		a.upstream, _ = strconv.Atoi(v)
	}
	a.restored, _ = strconv.Atoi(resp.Header.Get("Mcb-Restored-N"))
	if resp.StatusCode == 200 && path == "/completion" && !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		require.NoError(t, json.Unmarshal(out, &a.Completion), "%s", out)
	}
	// The proxy passes the upstream's body as it is; what it restored is in its headers.
	if resp.Header.Get("Mcb-Restored-N") != "" {
		a.MCB = testenv.ProxyOutcome(t, resp.Header)
	}
	return a
}

func completionBody(r testenv.Request) map[string]any {
	b := map[string]any{"prompt": r.Prompt, "n_predict": r.NPredict, "temperature": 0, "seed": 42,
		"return_tokens": true, "cache_prompt": true, "id_slot": r.Slot}
	for k, v := range r.Extra {
		b[k] = v
	}
	return b
}

// Three stock servers of one slot each behind one proxy: a request sharing
// a prefix goes to the server that holds it while that one is idle, and to
// another server, which restores the prefix, while the holder's slot is
// busy; every answer is a single stock server's.
func TestRouteSharedPrefix(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	u := startRouted(t, model, 3, 1)
	ref := testenv.StartLlama(t, "ref", testenv.StockServer(t), testenv.ServerArgs(model, 4096, 1, "on"))
	ask := func(prompt []int32) answer {
		t.Helper()
		r := testenv.Request{Prompt: prompt, Slot: -1, NPredict: nPredict}
		a := postThrough(t, u.proxy.URL, "/completion", completionBody(r))
		require.Equal(t, 200, a.code, "%s", a.body)
		assert.Equal(t, testenv.StockFrom(t, ref.URL, r, a.Timings.CacheN).Tokens, a.Tokens, "the answer is a stock server's")
		return a
	}

	first := ask(testenv.Cat(prefix, testenv.Tokens(50, 11, 5)))
	holder := first.upstream
	require.GreaterOrEqual(t, holder, 0)
	waitMirrored(t, u.proxy.URL, shared/block)

	second := ask(testenv.Cat(prefix, testenv.Tokens(70, 13, 9)))
	assert.Equal(t, holder, second.upstream, "the idle holder takes the shared prefix")
	assert.Zero(t, second.restored, "nothing moves")
	assert.GreaterOrEqual(t, second.Timings.CacheN, len(prefix), "the holder's slot has the prefix: %+v", second.Timings)

	// A long streamed answer keeps the holder's one slot busy.
	long := testenv.Request{Prompt: testenv.Cat(prefix, testenv.Tokens(30, 17, 1)), Slot: -1, NPredict: 3000}
	body := completionBody(long)
	body["stream"] = true
	b, err := json.Marshal(body)
	require.NoError(t, err)
	resp, err := testenv.Client.Post(u.proxy.URL+"/completion", "application/json", bytes.NewReader(b))
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, strconv.Itoa(holder), resp.Header.Get("Mcb-Upstream"), "the long answer goes to the holder")
	rd := bufio.NewReader(resp.Body)
	_, err = rd.ReadString('\n')
	require.NoError(t, err, "the long answer started")

	third := ask(testenv.Cat(prefix, testenv.Tokens(40, 19, 7)))
	assert.NotEqual(t, holder, third.upstream, "the busy holder is passed over")
	assert.Equal(t, shared, third.restored, "the other server restores the prefix")
	assert.Equal(t, shared, third.Timings.CacheN, "and computes only the rest")
	_, err = io.Copy(io.Discard, rd)
	require.NoError(t, err)

	m := testenv.Metrics(t, u.proxy.URL+"/metrics")
	assert.Equal(t, float64(1), m[`mcproxy_route_decisions_total{reason="load"}`], "the first request went by load")
	assert.Equal(t, float64(2), m[`mcproxy_route_decisions_total{reason="prefix"}`], "two went to the holder for its prefix")
	assert.Equal(t, float64(1), m[`mcproxy_route_decisions_total{reason="spread"}`], "one spread off the busy holder")
	assert.Equal(t, float64(shared), m["mcbridge_restored_tokens_total"])
}

// Clients keep sending while one of three upstreams is killed with a
// request in flight: it leaves the rotation at once, no request fails
// beyond the ones it had in flight, and every answer is a stock server's.
// Started again on its port, it passes its health checks, comes back as a
// new server and takes requests again.
func TestRouteUpstreamKilled(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	u := startRouted(t, model, 3, 1, "--health-interval", "200ms")
	ref := testenv.StartLlama(t, "ref", testenv.StockServer(t), testenv.ServerArgs(model, 4096, 1, "on"))
	prompt := func(client, i int) testenv.Request {
		return testenv.Request{Prompt: testenv.Cat(prefix, testenv.Tokens(40+i, 3+client, i)), Slot: -1, NPredict: 48}
	}
	const clients, each = 3, 3
	victim := 1
	victimURL := u.servers[victim].URL
	inFlight := func() float64 {
		return testenv.Metrics(t, u.proxy.URL+"/metrics")[`mcproxy_upstream_in_flight{upstream="`+victimURL+`"}`]
	}
	type result struct {
		req testenv.Request
		a   answer
		err error
	}
	var mu sync.Mutex
	var results []result
	var wg sync.WaitGroup
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				r := prompt(c, i)
				b, _ := json.Marshal(completionBody(r))
				resp, err := testenv.Client.Post(u.proxy.URL+"/completion", "application/json", bytes.NewReader(b))
				res := result{req: r, err: err}
				if err == nil {
					res.a.code = resp.StatusCode
					res.a.body, _ = io.ReadAll(resp.Body)
					resp.Body.Close()
					_ = json.Unmarshal(res.a.body, &res.a.Completion)
				}
				mu.Lock()
				results = append(results, res)
				mu.Unlock()
			}
		}()
	}
	testenv.Eventually(t, defaultWait, func() bool { return inFlight() >= 1 }, "the victim never had a request in flight")
	had := inFlight()
	u.servers[victim].Kill()
	wg.Wait()

	failed := 0
	for _, r := range results {
		if r.err != nil || r.a.code != 200 {
			failed++
			continue
		}
		// Each upstream has one slot: every answer was computed alone, as
		// the reference's.
		want := testenv.StockFrom(t, ref.URL, r.req, r.a.Timings.CacheN)
		assert.Equal(t, want.Tokens, r.a.Tokens, "every answer is a stock server's")
	}
	assert.Len(t, results, clients*each)
	assert.LessOrEqual(t, float64(failed), had, "no request fails beyond the ones in flight on the killed server")
	m := testenv.Metrics(t, u.proxy.URL+"/metrics")
	assert.Equal(t, float64(0), m[`mcproxy_upstream_up{upstream="`+victimURL+`"}`], "the killed server is out of the rotation")
	routed := m[`mcproxy_upstream_routed_total{upstream="`+victimURL+`"}`]
	for i := range 3 {
		a := postThrough(t, u.proxy.URL, "/completion", completionBody(prompt(9, i)))
		require.Equal(t, 200, a.code, "%s", a.body)
		assert.NotEqual(t, victim, a.upstream)
	}
	assert.Equal(t, routed, testenv.Metrics(t, u.proxy.URL+"/metrics")[`mcproxy_upstream_routed_total{upstream="`+victimURL+`"}`],
		"nothing more is routed to it")

	// The same port, a new process.
	u.servers[victim] = stockUpstream(t, "u1-again", model, 1, u.dirs[victim], u.servers[victim].Port)
	testenv.Eventually(t, defaultWait, func() bool {
		return testenv.Metrics(t, u.proxy.URL+"/metrics")[`mcproxy_upstream_up{upstream="`+victimURL+`"}`] == 1
	}, "the restarted server never came back")
	m = testenv.Metrics(t, u.proxy.URL+"/metrics")
	assert.Equal(t, float64(1), m[`mcproxy_upstream_restarts_total{upstream="`+victimURL+`"}`], "it is known as a new server")
	// Two long answers keep two servers busy: the three requests cover
	// every server, the one back included.
	var used []int
	for range 2 {
		body := completionBody(testenv.Request{Prompt: testenv.Tokens(100, 5, 5), Slot: -1, NPredict: 3000})
		body["stream"] = true
		b, _ := json.Marshal(body)
		resp, err := testenv.Client.Post(u.proxy.URL+"/completion", "application/json", bytes.NewReader(b))
		require.NoError(t, err)
		defer resp.Body.Close()
		_, err = bufio.NewReader(resp.Body).ReadString('\n')
		require.NoError(t, err)
		n, _ := strconv.Atoi(resp.Header.Get("Mcb-Upstream"))
		used = append(used, n)
	}
	a := postThrough(t, u.proxy.URL, "/completion", completionBody(prompt(7, 1)))
	require.Equal(t, 200, a.code, "%s", a.body)
	assert.ElementsMatch(t, []int{0, 1, 2}, append(used, a.upstream), "the server is back in the rotation")
	assert.Equal(t, testenv.StockFrom(t, ref.URL, prompt(7, 1), a.Timings.CacheN).Tokens, a.Tokens)
}
