package proxy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/transport"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const blockTokens = 8

var dirSeq atomic.Int64

// directoryName gives each test its own memory directory, shared by the
// bridges the test opens (two proxies share KV through it).
func directoryName(t testing.TB) string {
	return fmt.Sprintf("%s-%d", t.Name(), dirSeq.Add(1))
}

func openBridge(t testing.TB, dir, owner string) *bridge.Bridge {
	t.Helper()
	return openBridgeOf(t, bridgeConfig(dir, owner))
}

// bridgeConfig is the tests' bridge configuration.
func bridgeConfig(dir, owner string) config.Config {
	c := config.Default()
	c.PoolBytes = 8 << 20
	c.BlockTokens = blockTokens
	c.Directory.Name = dir
	c.Owner = owner
	c.Arbiter.Policy = "always-restore"
	return c
}

func openBridgeOf(t testing.TB, c config.Config) *bridge.Bridge {
	t.Helper()
	b, err := bridge.Open(c, bridge.Deps{})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, b.Close(), "bridge close") })
	return b
}

// node is a fake server with a proxy (and its bridge) in front.
type node struct {
	fs  *fakeServer
	p   *Proxy
	url string
}

func startNode(t testing.TB, fs *fakeServer, dir, owner string, opts Options) *node {
	t.Helper()
	return startNodeOn(t, openBridge(t, dir, owner), fs, opts)
}

// startNodeOn is startNode over a bridge of the caller's.
func startNodeOn(t testing.TB, b *bridge.Bridge, fs *fakeServer, opts Options) *node {
	t.Helper()
	opts.Upstream, opts.SlotDir = fs.url(), fs.dir
	p, err := New(b, opts)
	require.NoError(t, err)
	srv := httptest.NewServer(p)
	t.Cleanup(func() {
		srv.Close()
		assert.NoError(t, p.Close(), "proxy close")
		assertEmptyDir(t, nil, fs.dir)
	})
	return &node{fs: fs, p: p, url: srv.URL}
}

func (n *node) flush(t testing.TB) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, n.p.Flush(ctx))
}

func post(t testing.TB, url, path string, body any) (int, []byte) {
	code, b, _ := postH(t, url, path, body)
	return code, b
}

// postH is post, and returns the answer's headers.
func postH(t testing.TB, url, path string, body any) (int, []byte, http.Header) {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(url+path, "application/json", bytes.NewReader(b))
	require.NoError(t, err)
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, out, resp.Header
}

func seqTokens(n, mul, off int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = int32((i*mul + off) % 256)
	}
	return out
}

func concat(a, b []int32) []int32 { return append(append([]int32(nil), a...), b...) }

// restoredOf reads the tokens the proxy restored for an answer from its
// headers, the only place the proxy reports them.
func restoredOf(t testing.TB, h http.Header) int {
	t.Helper()
	n, err := strconv.Atoi(h.Get("Mcb-Restored-N"))
	require.NoError(t, err, "Mcb-Restored-N: %q", h.Get("Mcb-Restored-N"))
	_, err = strconv.ParseFloat(h.Get("Mcb-Restore-Ms"), 64)
	require.NoError(t, err, "Mcb-Restore-Ms: %q", h.Get("Mcb-Restore-Ms"))
	return n
}

// cacheFree strips what depends on the cache from an answer: what is left is
// the same whether or not the prefix was restored.
func cacheFree(t testing.TB, b []byte) map[string]any {
	t.Helper()
	var m map[string]any
	require.NoError(t, json.Unmarshal(b, &m), "answer %q", b)
	delete(m, "timings")
	delete(m, "usage")
	delete(m, "id_slot")
	return m
}

func TestSharedPrefixAcrossServers(t *testing.T) {
	for _, tc := range []struct {
		name    string
		file    string
		streams int
		chat    bool
	}{
		{"fa-on", "slot-fa-on.bin", 1, false},
		{"fa-off-vtrans", "slot-plain-fa-off.bin", 1, false},
		{"two-streams", "slot-plain-fa-off.bin", 2, false},
		{"chat", "slot-fa-on.bin", 1, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := directoryName(t)
			n1 := startNode(t, newFake(t, tc.file, tc.streams, tc.streams, 1), dir, "one", Options{})
			n2 := startNode(t, newFake(t, tc.file, tc.streams, tc.streams, 1), dir, "two", Options{})
			ref := newFake(t, tc.file, 1, 1, 1) // the same model, no proxy
			prefix := seqTokens(3*blockTokens, 7, 3)
			path := "/completion"
			req := func(suffix []int32) map[string]any {
				return map[string]any{"prompt": concat(prefix, suffix), "n_predict": 4, "temperature": 0}
			}
			tokensOf := func(r map[string]any) []int32 { return r["prompt"].([]int32) }
			if tc.chat {
				path = "/v1/chat/completions"
				system := strings.Repeat("You are a careful agent. ", 3)
				req = func(suffix []int32) map[string]any {
					return map[string]any{"messages": []any{
						map[string]any{"role": "system", "content": system},
						map[string]any{"role": "user", "content": fmt.Sprint(suffix)},
					}, "max_tokens": 4}
				}
				tokensOf = func(r map[string]any) []int32 { return tokenize(chatPrompt(r)) }
			}
			shared := lcp(tokensOf(req(seqTokens(5, 5, 11))), tokensOf(req(seqTokens(5, 3, 17)))) / blockTokens * blockTokens

			code, b1, h1 := postH(t, n1.url, path, req(seqTokens(5, 5, 11)))
			require.Equal(t, 200, code, "request 1: %s", b1)
			n := restoredOf(t, h1)
			require.Zero(t, n, "request 1 restored tokens from an empty directory")
			n1.flush(t)
			st := n1.p.Stats()
			require.NotZero(t, st.PublishedBlocks, "request 1 published nothing: %+v", st)

			code, b2, h2 := postH(t, n2.url, path, req(seqTokens(5, 3, 17)))
			require.Equal(t, 200, code, "request 2: %s", b2)
			restored := restoredOf(t, h2)
			var rest map[string]any
			require.NoError(t, json.Unmarshal(b2, &rest), "answer %q", b2)
			require.Equal(t, shared, restored, "request 2 restored tokens, want the shared ones; stats %+v", n2.p.Stats())
			cacheN := rest["timings"].(map[string]any)["cache_n"].(float64)
			require.Equal(t, shared, int(cacheN), "the server reused tokens")
			_, direct := post(t, ref.url(), path, req(seqTokens(5, 3, 17)))
			require.Equal(t, cacheFree(t, direct), cacheFree(t, b2), "answer through the proxy, without")
			require.Len(t, n2.fs.restores, 1, "restores")
			n2.flush(t)
			assertEmptyDir(t, n1.p, n1.fs.dir)
			assertEmptyDir(t, n2.p, n2.fs.dir)
		})
	}
}

// assertEmptyDir checks that dir holds nothing but the files p's restores
// load into (one a slot, for p's life; none once p is nil, after Close).
func assertEmptyDir(t testing.TB, p *Proxy, dir string) {
	t.Helper()
	kept := map[string]bool{}
	if p != nil {
		for _, be := range p.ups {
			be.mu.Lock()
			for _, sf := range be.files {
				kept[sf.name] = true
			}
			be.mu.Unlock()
		}
	}
	es, err := os.ReadDir(dir)
	require.NoError(t, err)
	var left []string
	for _, e := range es {
		if !kept[e.Name()] {
			left = append(left, e.Name())
		}
	}
	assert.Empty(t, left, "left in the slot directory")
}

// warm publishes the blocks of prompt through n and returns the request.
func warm(t testing.TB, n *node, prompt []int32) {
	t.Helper()
	code, b := post(t, n.url, "/completion", map[string]any{"prompt": prompt, "n_predict": 2})
	require.Equal(t, 200, code, "warm-up: %s", b)
	n.flush(t)
}

func TestModelMismatchRestoresNothing(t *testing.T) {
	dir := directoryName(t)
	n1 := startNode(t, newFake(t, "slot-fa-on.bin", 1, 1, 1), dir, "one", Options{})
	other := startNode(t, newFake(t, "slot-fa-on.bin", 1, 1, 2), dir, "other", Options{})
	fa := startNode(t, newFake(t, "slot-plain-fa-off.bin", 1, 1, 1), dir, "fa-off", Options{})
	prefix := seqTokens(4*blockTokens, 7, 3)
	warm(t, n1, concat(prefix, []int32{1, 2, 3}))
	for _, n := range []*node{other, fa} {
		code, b, h := postH(t, n.url, "/completion", map[string]any{"prompt": concat(prefix, []int32{9, 9}), "n_predict": 2})
		require.Equal(t, 200, code, "%s", b)
		restored := restoredOf(t, h)
		require.Zero(t, restored, "another model restored tokens")
		require.Empty(t, n.fs.restores, "another model restored")
		require.NotEqual(t, n1.p.State().Fingerprint, n.p.State().Fingerprint, "another model has the same fingerprint")
	}
}

func TestFallbacks(t *testing.T) {
	prefix := seqTokens(3*blockTokens, 7, 3)
	prompt := concat(prefix, []int32{4, 5, 6})
	for _, tc := range []struct {
		name     string
		setup    func(fs *fakeServer, peer *bridge.Bridge)
		reason   string // the counted fallback; "" when none is
		code     int
		restores int // restore calls the server saw
	}{
		{"restore refused", func(fs *fakeServer, _ *bridge.Bridge) { fs.refuseRestore = true }, "restore_refused", 200, 1},
		{"slot busy", func(fs *fakeServer, _ *bridge.Bridge) { fs.busy[0] = true }, "slot_busy", 200, 0},
		{"upstream changed", func(fs *fakeServer, _ *bridge.Bridge) { fs.build = "b2-other" }, "upstream_changed", 200, 0},
		// Blocks that fail verification never reach the server.
		{"corrupt transfer", func(_ *fakeServer, peer *bridge.Bridge) {
			peer.Transport().(*transport.Loopback).SetFault(transport.Fault{Kind: transport.Corrupt})
		}, "load_failed", 200, 0},
		{"peer gone", func(_ *fakeServer, peer *bridge.Bridge) {
			peer.Transport().(*transport.Loopback).SetFault(transport.Fault{Kind: transport.DropPeer})
		}, "load_failed", 200, 0},
		// The restore happens before the server fails the completion.
		{"upstream error", func(fs *fakeServer, _ *bridge.Bridge) { fs.completionCode = 500 }, "", 500, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := directoryName(t)
			one := startNode(t, newFake(t, "slot-fa-on.bin", 1, 1, 1), dir, "one", Options{})
			warm(t, one, prompt)
			fs := newFake(t, "slot-fa-on.bin", 1, 1, 1)
			n := startNode(t, fs, dir, "two", Options{})
			require.NoError(t, n.p.Learn(context.Background()))
			fs.mu.Lock()
			tc.setup(fs, one.p.b)
			fs.mu.Unlock()
			req := map[string]any{"prompt": concat(prefix, []int32{7, 8}), "n_predict": 2}
			code, b, h := postH(t, n.url, "/completion", req)
			require.Equal(t, tc.code, code, "status: %s", b)
			if tc.code != 200 {
				// An error passes through exactly as the server sent it.
				require.Equal(t, `{"error":{"code":500,"message":"the fake failed on purpose","type":"invalid_request_error"}}`, string(b), "error body")
			} else {
				require.Zero(t, restoredOf(t, h), "restored")
				ref := newFake(t, "slot-fa-on.bin", 1, 1, 1)
				_, direct := post(t, ref.url(), "/completion", req)
				require.Equal(t, cacheFree(t, direct), cacheFree(t, b), "answer %s, without the proxy %s", b, direct)
			}
			n.flush(t)
			st := n.p.Stats()
			if tc.reason != "" {
				require.Equal(t, int64(1), st.Fallbacks[tc.reason], "fallbacks %v, want one %s", st.Fallbacks, tc.reason)
			}
			require.Len(t, fs.restores, tc.restores, "restore calls")
			if tc.code != 200 {
				require.Zero(t, st.Saves, "saved after an error: %+v", st)
			}
			assertEmptyDir(t, n.p, fs.dir)
		})
	}
}

func TestUnknownSlotFileVersionTurnsBridgeOff(t *testing.T) {
	fs := newFake(t, "slot-fa-on.bin", 2, 1, 1)
	fs.saveVersion = 4
	n := startNode(t, fs, directoryName(t), "one", Options{})
	require.Error(t, n.p.Learn(context.Background()), "learned a model from a version 4 slot file")
	req := map[string]any{"prompt": seqTokens(30, 7, 3), "n_predict": 3}
	for range 2 {
		code, b := post(t, n.url, "/completion", req)
		require.Equal(t, 200, code, "%s", b)
		_, direct := post(t, newFake(t, "slot-fa-on.bin", 1, 1, 1).url(), "/completion", req)
		require.Equal(t, cacheFree(t, direct), cacheFree(t, b), "answer %s, without the proxy %s", b, direct)
	}
	n.flush(t)
	state := n.p.State()
	require.False(t, state.Bridge, "state %+v", state)
	require.NotEmpty(t, state.BridgeOff, "state %+v", state)
	st := n.p.Stats()
	require.Zero(t, st.Restores, "stats %+v", st)
	require.Zero(t, st.PublishedBlocks, "stats %+v", st)
	require.Equal(t, int64(2), st.Pinned, "stats %+v", st)
	assertEmptyDir(t, n.p, fs.dir)
}

func TestStreamingPassesThroughAsItComes(t *testing.T) {
	fs := newFake(t, "slot-fa-on.bin", 1, 1, 1)
	n := startNode(t, fs, directoryName(t), "one", Options{})
	req := map[string]any{"prompt": seqTokens(20, 7, 3), "n_predict": 5, "stream": true}
	ref := newFake(t, "slot-fa-on.bin", 1, 1, 1)
	_, want := post(t, ref.url(), "/completion", req)

	gate := make(chan struct{})
	fs.mu.Lock()
	fs.gate = gate
	fs.mu.Unlock()
	b, _ := json.Marshal(req)
	resp, err := http.Post(n.url+"/completion", "application/json", bytes.NewReader(b))
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))
	var got bytes.Buffer
	rd := bufio.NewReader(io.TeeReader(resp.Body, &got))
	// The first event arrives while the server still holds the second.
	line, err := rd.ReadString('\n')
	require.NoError(t, err, "first event %q", line)
	require.True(t, strings.HasPrefix(line, "data: "), "first event %q", line)
	for range 4 {
		gate <- struct{}{}
	}
	_, err = io.Copy(io.Discard, rd)
	require.NoError(t, err)
	require.Equal(t, string(want), got.String(), "stream through the proxy, without")
	n.flush(t)
	st := n.p.Stats()
	require.Equal(t, int64(1), st.Saves, "a streamed answer's blocks were not published: %+v", st)
	require.Equal(t, int64(3), st.PublishedBlocks, "a streamed answer's blocks were not published: %+v", st)
}

// The proxy adds its headers and nothing else: the body is the upstream's.
func TestNonStreamingAnswerIsTheUpstreams(t *testing.T) {
	fs := newFake(t, "slot-fa-on.bin", 1, 1, 1)
	n := startNode(t, fs, directoryName(t), "one", Options{})
	req := map[string]any{"prompt": seqTokens(20, 7, 3), "n_predict": 3}
	_, got, h := postH(t, n.url, "/completion", req)
	_, want, hWant := postH(t, newFake(t, "slot-fa-on.bin", 1, 1, 1).url(), "/completion", req)
	require.Equal(t, string(want), string(got), "answer through the proxy, without")
	require.Zero(t, restoredOf(t, h), "the proxy's headers")
	for k := range h {
		if hWant.Get(k) == "" {
			assert.Contains(t, []string{"Mcb-Upstream", "Mcb-Restored-N", "Mcb-Restore-Ms", "Mcb-Fallback"}, k, "a header the upstream did not send")
		}
	}
}

func TestConcurrentRequestsNeverShareASlot(t *testing.T) {
	fs := newFake(t, "slot-plain-fa-off.bin", 2, 2, 1)
	n := startNode(t, fs, directoryName(t), "one", Options{})
	ref := newFake(t, "slot-plain-fa-off.bin", 1, 1, 1)
	prefix := seqTokens(2*blockTokens, 7, 3)
	reqs := make([]map[string]any, 16)
	for i := range reqs {
		reqs[i] = map[string]any{"prompt": concat(prefix, seqTokens(3+i%5, 3, i)), "n_predict": 2}
	}
	got := make([][]byte, len(reqs))
	codes := make([]int, len(reqs))
	var wg sync.WaitGroup
	for i, req := range reqs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			b, _ := json.Marshal(req)
			resp, err := http.Post(n.url+"/completion", "application/json", bytes.NewReader(b))
			if err != nil {
				return
			}
			defer resp.Body.Close()
			codes[i] = resp.StatusCode
			got[i], _ = io.ReadAll(resp.Body)
		}()
	}
	wg.Wait()
	for i, req := range reqs {
		require.Equal(t, 200, codes[i], "request %d: %s", i, got[i])
		_, want := post(t, ref.url(), "/completion", req)
		require.Equal(t, cacheFree(t, want), cacheFree(t, got[i]), "request %d: answer %s, want %s", i, got[i], want)
	}
	n.flush(t)
	fs.mu.Lock()
	defer fs.mu.Unlock()
	require.Zero(t, fs.overlaps, "requests were pinned to a slot that was computing")
	st := n.p.Stats()
	require.Equal(t, int64(16), st.Pinned, "stats %+v", st)
}

func TestDirtySlotsPublishNothing(t *testing.T) {
	fs := newFake(t, "slot-fa-on.bin", 1, 1, 1)
	n := startNode(t, fs, directoryName(t), "one", Options{})
	a := seqTokens(3*blockTokens+2, 7, 3)
	steps := []struct {
		req       map[string]any
		published int64 // blocks published so far
	}{
		// Chunk reuse shifts cells: the slot turns dirty.
		{map[string]any{"prompt": a, "n_predict": 2, "n_cache_reuse": 4}, 0},
		// Reusing dirty cells keeps it dirty.
		{map[string]any{"prompt": concat(a, []int32{1, 2, 3, 4, 5, 6, 7, 8}), "n_predict": 2}, 0},
		// Per-request adapters change the KV.
		{map[string]any{"prompt": seqTokens(30, 5, 1), "n_predict": 2, "lora": []any{map[string]any{"id": 0, "scale": 0.5}}}, 0},
		// Computed from position 0 again: clean, and published.
		{map[string]any{"prompt": seqTokens(30, 3, 2), "n_predict": 2, "cache_prompt": false}, 3},
	}
	for i, s := range steps {
		code, b := post(t, n.url, "/completion", s.req)
		require.Equal(t, 200, code, "step %d: %s", i, b)
		n.flush(t)
		require.Equal(t, s.published, n.p.Stats().PublishedBlocks, "step %d: blocks published", i)
	}
}

func TestUpstreamContextShiftPublishesNothing(t *testing.T) {
	dir := directoryName(t)
	prompt := seqTokens(3*blockTokens+1, 7, 3)
	warm(t, startNode(t, newFake(t, "slot-fa-on.bin", 1, 1, 1), dir, "one", Options{}), prompt)
	n := startNode(t, newFake(t, "slot-fa-on.bin", 1, 1, 1), dir, "two", Options{UpstreamContextShift: true})
	_, _, h := postH(t, n.url, "/completion", map[string]any{"prompt": concat(prompt, []int32{5, 5, 5, 5, 5, 5, 5, 5, 5}), "n_predict": 2})
	restored := restoredOf(t, h)
	require.Equal(t, 3*blockTokens, restored, "restores stay on")
	n.flush(t)
	st := n.p.Stats()
	require.Zero(t, st.Saves, "published with context shift on: %+v", st)
	require.Zero(t, st.PublishedBlocks, "published with context shift on: %+v", st)
	state := n.p.State()
	require.False(t, state.Publishing, "state %+v", state)
	require.NotEmpty(t, state.PublishOff, "state %+v", state)
}

func TestHealthzAndMetrics(t *testing.T) {
	n := startNode(t, newFake(t, "slot-fa-on.bin", 2, 1, 1), directoryName(t), "one", Options{})
	post(t, n.url, "/completion", map[string]any{"prompt": seqTokens(20, 7, 3), "n_predict": 2})
	n.flush(t)
	resp, err := http.Get(n.url + "/healthz")
	require.NoError(t, err)
	var h struct {
		Status string `json:"status"`
		State
	}
	err = json.NewDecoder(resp.Body).Decode(&h)
	resp.Body.Close()
	require.NoError(t, err)
	require.Equal(t, 200, resp.StatusCode)
	require.Equal(t, "ok", h.Status, "healthz %+v", h)
	require.True(t, h.Bridge, "healthz %+v", h)
	require.True(t, h.Publishing, "healthz %+v", h)
	require.Equal(t, 2, h.Slots, "healthz %+v", h)
	resp, err = http.Get(n.url + "/metrics")
	require.NoError(t, err)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{"mcbridge_saved_blocks_total 2", "mcproxy_requests_total 1",
		"mcproxy_queued_blocks_total 2", `mcproxy_restore_fallbacks_total{reason="slot_busy"} 0`} {
		assert.Contains(t, string(b), want+"\n", "metrics lack %q", want)
	}
}

func TestAPIKey(t *testing.T) {
	fs := newFake(t, "slot-fa-on.bin", 1, 1, 1)
	fs.apiKey = "sesame"
	n := startNode(t, fs, directoryName(t), "one", Options{APIKey: "sesame"})
	b, _ := json.Marshal(map[string]any{"prompt": seqTokens(20, 7, 3), "n_predict": 2})
	for _, key := range []string{"", "sesame"} {
		req, _ := http.NewRequest(http.MethodPost, n.url+"/completion", bytes.NewReader(b))
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		// The client's own key decides its request; the proxy's key its calls.
		require.Equal(t, map[string]int{"": 401, "sesame": 200}[key], resp.StatusCode, "key %q", key)
	}
	n.flush(t)
	st := n.p.Stats()
	require.Equal(t, int64(2), st.PublishedBlocks, "stats %+v, state %+v", st, n.p.State())
	require.True(t, n.p.State().Bridge, "stats %+v, state %+v", st, n.p.State())
}

// A hybrid memory's slot files hold its recurrent state at their end only:
// the proxy stops the first prompt at its last block boundary as a request
// of its own and stores the state after it; the second server restores
// the blocks and the snapshot the shared prefix ends at, and computes only
// the rest. A prompt that leaves the shared blocks where no snapshot is
// computes, snapshotting the branch, and the prompts after it restore
// there; with proxy_snapshots "every" the first prompt stops at every
// snapshot_blocks blocks too.
func TestHybridSnapshots(t *testing.T) {
	dir := directoryName(t)
	n1 := startNode(t, newHybridFake(t, "slot-fa-on.bin", 1, 1), dir, "one", Options{})
	n2 := startNode(t, newHybridFake(t, "slot-fa-on.bin", 1, 1), dir, "two", Options{})
	ref := newHybridFake(t, "slot-fa-on.bin", 1, 1)
	every := 4 * blockTokens // config.Default's snapshot_blocks
	prefix := seqTokens(2*every+3, 7, 3)
	last := 2 * every // the last block boundary of the prompts below
	req := func(suffix []int32) map[string]any {
		return map[string]any{"prompt": concat(prefix, suffix), "n_predict": 4, "temperature": 0}
	}
	// stops lists the lengths of the prompts a node's server was sent
	// after the probe: the snapshots' prompts, then the request's.
	stops := func(n *node, from int) []int {
		var prompts []int
		for _, r := range n.fs.requests[from:] {
			prompts = append(prompts, len(r["prompt"].([]any)))
		}
		return prompts
	}

	code, b1, h1 := postH(t, n1.url, "/completion", req(seqTokens(5, 5, 11)))
	require.Equal(t, 200, code, "request 1: %s", b1)
	require.Zero(t, restoredOf(t, h1))
	n1.flush(t)
	first := n1.fs.requests[1]
	assert.Equal(t, float64(1), first["n_predict"], "a snapshot's prompt generates one token")
	assert.Equal(t, float64(0), first["id_slot"], "a snapshot's prompt runs in the request's slot")
	assert.Equal(t, []int{last, len(prefix) + 5}, stops(n1, 1), "the prompt stops at its last block boundary, then the request")
	st := n1.p.Stats()
	assert.Equal(t, int64(1), st.SnapshotPrompts)
	assert.Zero(t, st.SnapshotFailures)
	assert.Equal(t, every, n1.p.State().SnapshotTokens)
	n1.p.bufs.mu.Lock()
	assert.NotEmpty(t, n1.p.bufs.idle, "the saved files' buffers are kept for the next save")
	n1.p.bufs.mu.Unlock()

	code, b2, h2 := postH(t, n2.url, "/completion", req(seqTokens(5, 3, 17)))
	require.Equal(t, 200, code, "request 2: %s", b2)
	require.Equal(t, last, restoredOf(t, h2), "restored to the last snapshot of the shared prefix: %+v", n2.p.Stats())
	require.Len(t, n2.fs.restores, 1, "restores")
	var rest map[string]any
	require.NoError(t, json.Unmarshal(b2, &rest), "answer %q", b2)
	assert.Equal(t, last, int(rest["timings"].(map[string]any)["cache_n"].(float64)), "the server reused the restored tokens")
	_, direct := post(t, ref.url(), "/completion", req(seqTokens(5, 3, 17)))
	assert.Equal(t, cacheFree(t, direct), cacheFree(t, b2), "answer through the proxy, without")
	assert.Zero(t, n2.p.Stats().SnapshotPrompts, "the directory has the shared prefix's snapshot")
	n2.flush(t)

	// A branch inside the shared blocks, where no snapshot is: the first
	// prompt to take it computes and snapshots it, the next restores it.
	branch := 5 * blockTokens
	other := func(mul int) map[string]any {
		return map[string]any{"prompt": concat(prefix[:branch], seqTokens(20, mul, 29)), "n_predict": 4, "temperature": 0}
	}
	n4 := startNode(t, newHybridFake(t, "slot-fa-on.bin", 1, 1), dir, "four", Options{})
	code, b4, h4 := postH(t, n4.url, "/completion", other(3))
	require.Equal(t, 200, code, "request 4: %s", b4)
	require.Zero(t, restoredOf(t, h4), "no snapshot where the prompt leaves the shared blocks")
	assert.Equal(t, []int{branch, (branch + 19) / blockTokens * blockTokens, branch + 20}, stops(n4, 1),
		"the prompt stops at the branch and at its last block boundary")
	n4.flush(t)
	n5 := startNode(t, newHybridFake(t, "slot-fa-on.bin", 1, 1), dir, "five", Options{})
	code, b5, h5 := postH(t, n5.url, "/completion", other(5))
	require.Equal(t, 200, code, "request 5: %s", b5)
	require.Equal(t, branch, restoredOf(t, h5), "the branch's snapshot: %+v", n5.p.Stats())
	_, direct = post(t, ref.url(), "/completion", other(5))
	assert.Equal(t, cacheFree(t, direct), cacheFree(t, b5), "answer through the proxy, without")
	n5.flush(t)

	c := bridgeConfig(directoryName(t), "every")
	c.ProxySnapshots = "every"
	n6 := startNodeOn(t, openBridgeOf(t, c), newHybridFake(t, "slot-fa-on.bin", 1, 1), Options{})
	code, b6 := post(t, n6.url, "/completion", req(seqTokens(5, 5, 11)))
	require.Equal(t, 200, code, "request 6: %s", b6)
	assert.Equal(t, []int{every, last, len(prefix) + 5}, stops(n6, 1), "every snapshot_blocks blocks, then the request")
	n6.flush(t)

	// A slot another client filled: the server reuses cells the proxy does
	// not know the origin of, so nothing is snapshotted or published.
	n3 := startNode(t, newHybridFake(t, "slot-fa-on.bin", 1, 1), directoryName(t), "three", Options{})
	require.NoError(t, n3.p.Learn(context.Background()), "the probe first, so that the other client's prompt stays in the slot")
	warmUp := map[string]any{"prompt": prefix[:every+3], "n_predict": 1, "id_slot": 0}
	code, b3 := post(t, n3.fs.url(), "/completion", warmUp)
	require.Equal(t, 200, code, "%s", b3)
	code, b3 = post(t, n3.url, "/completion", req(seqTokens(5, 5, 11)))
	require.Equal(t, 200, code, "%s", b3)
	n3.flush(t)
	st = n3.p.Stats()
	assert.Equal(t, int64(1), st.SnapshotFailures, "the first boundary's prompt reused unknown cells: %+v", st)
	assert.Zero(t, st.PublishedBlocks, "a slot of unknown start publishes nothing: %+v", st)
}
