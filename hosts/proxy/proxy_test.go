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
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/transport"
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
	c := config.Default()
	c.PoolBytes = 8 << 20
	c.BlockTokens = blockTokens
	c.Directory.Name = dir
	c.Owner = owner
	c.Arbiter.Policy = "always-restore"
	b, err := bridge.Open(c, bridge.Deps{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Errorf("bridge close: %v", err)
		}
	})
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
	b := openBridge(t, dir, owner)
	opts.Upstream, opts.SlotDir = fs.url(), fs.dir
	p, err := New(b, opts)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(p)
	t.Cleanup(func() {
		srv.Close()
		if err := p.Close(); err != nil {
			t.Errorf("proxy close: %v", err)
		}
	})
	return &node{fs: fs, p: p, url: srv.URL}
}

func (n *node) flush(t testing.TB) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := n.p.Flush(ctx); err != nil {
		t.Fatal(err)
	}
}

func post(t testing.TB, url, path string, body any) (int, []byte) {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(url+path, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, out
}

func seqTokens(n, mul, off int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = int32((i*mul + off) % 256)
	}
	return out
}

func concat(a, b []int32) []int32 { return append(append([]int32(nil), a...), b...) }

// decoded splits an answer into the proxy's timing fields and the rest.
func decoded(t testing.TB, b []byte) (rest map[string]any, restored int) {
	t.Helper()
	if err := json.Unmarshal(b, &rest); err != nil {
		t.Fatalf("answer %q: %v", b, err)
	}
	tm, _ := rest["timings"].(map[string]any)
	n, ok := tm["mcb_restored_n"].(float64)
	if !ok {
		t.Fatalf("answer without timings.mcb_restored_n: %s", b)
	}
	if _, ok := tm["mcb_restore_ms"].(float64); !ok {
		t.Fatalf("answer without timings.mcb_restore_ms: %s", b)
	}
	delete(tm, "mcb_restored_n")
	delete(tm, "mcb_restore_ms")
	return rest, int(n)
}

// cacheFree strips what depends on the cache from an answer: what is left is
// the same whether or not the prefix was restored.
func cacheFree(t testing.TB, b []byte) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("answer %q: %v", b, err)
	}
	delete(m, "timings")
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

			code, b1 := post(t, n1.url, path, req(seqTokens(5, 5, 11)))
			if code != 200 {
				t.Fatalf("request 1: %d %s", code, b1)
			}
			if _, n := decoded(t, b1); n != 0 {
				t.Fatalf("request 1 restored %d tokens from an empty directory", n)
			}
			n1.flush(t)
			if st := n1.p.Stats(); st.PublishedBlocks == 0 {
				t.Fatalf("request 1 published nothing: %+v", st)
			}

			code, b2 := post(t, n2.url, path, req(seqTokens(5, 3, 17)))
			if code != 200 {
				t.Fatalf("request 2: %d %s", code, b2)
			}
			rest, restored := decoded(t, b2)
			if restored != shared {
				t.Fatalf("request 2 restored %d tokens, want the %d shared ones; stats %+v", restored, shared, n2.p.Stats())
			}
			if cacheN := rest["timings"].(map[string]any)["cache_n"].(float64); int(cacheN) != shared {
				t.Fatalf("the server reused %v tokens, want %d", cacheN, shared)
			}
			_, direct := post(t, ref.url(), path, req(seqTokens(5, 3, 17)))
			if got, want := cacheFree(t, b2), cacheFree(t, direct); !reflect.DeepEqual(got, want) {
				t.Fatalf("answer through the proxy %v, without %v", got, want)
			}
			if len(n2.fs.restores) != 1 {
				t.Fatalf("restores %v", n2.fs.restores)
			}
			n2.flush(t)
			assertEmptyDir(t, n1.fs.dir)
			assertEmptyDir(t, n2.fs.dir)
		})
	}
}

func assertEmptyDir(t testing.TB, dir string) {
	t.Helper()
	es, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range es {
		t.Errorf("left in the slot directory: %s", e.Name())
	}
}

// warm publishes the blocks of prompt through n and returns the request.
func warm(t testing.TB, n *node, prompt []int32) {
	t.Helper()
	if code, b := post(t, n.url, "/completion", map[string]any{"prompt": prompt, "n_predict": 2}); code != 200 {
		t.Fatalf("warm-up: %d %s", code, b)
	}
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
		code, b := post(t, n.url, "/completion", map[string]any{"prompt": concat(prefix, []int32{9, 9}), "n_predict": 2})
		if code != 200 {
			t.Fatalf("%d %s", code, b)
		}
		if _, restored := decoded(t, b); restored != 0 || len(n.fs.restores) != 0 {
			t.Fatalf("another model restored %d tokens", restored)
		}
		if n.p.State().Fingerprint == n1.p.State().Fingerprint {
			t.Fatal("another model has the same fingerprint")
		}
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
			if err := n.p.Learn(context.Background()); err != nil {
				t.Fatal(err)
			}
			fs.mu.Lock()
			tc.setup(fs, one.p.b)
			fs.mu.Unlock()
			req := map[string]any{"prompt": concat(prefix, []int32{7, 8}), "n_predict": 2}
			code, b := post(t, n.url, "/completion", req)
			if code != tc.code {
				t.Fatalf("status %d, want %d: %s", code, tc.code, b)
			}
			if tc.code != 200 {
				// An error passes through exactly as the server sent it.
				if want := `{"error":{"code":500,"message":"the fake failed on purpose","type":"invalid_request_error"}}`; string(b) != want {
					t.Fatalf("error body %q", b)
				}
			} else {
				if _, restored := decoded(t, b); restored != 0 {
					t.Fatalf("restored %d", restored)
				}
				ref := newFake(t, "slot-fa-on.bin", 1, 1, 1)
				_, direct := post(t, ref.url(), "/completion", req)
				if !reflect.DeepEqual(cacheFree(t, b), cacheFree(t, direct)) {
					t.Fatalf("answer %s, without the proxy %s", b, direct)
				}
			}
			n.flush(t)
			st := n.p.Stats()
			if tc.reason != "" && st.Fallbacks[tc.reason] != 1 {
				t.Fatalf("fallbacks %v, want one %s", st.Fallbacks, tc.reason)
			}
			if len(fs.restores) != tc.restores {
				t.Fatalf("restore calls %v, want %d", fs.restores, tc.restores)
			}
			if tc.code != 200 && st.Saves != 0 {
				t.Fatalf("saved after an error: %+v", st)
			}
			assertEmptyDir(t, fs.dir)
		})
	}
}

func TestUnknownSlotFileVersionTurnsBridgeOff(t *testing.T) {
	fs := newFake(t, "slot-fa-on.bin", 2, 1, 1)
	fs.saveVersion = 4
	n := startNode(t, fs, directoryName(t), "one", Options{})
	if err := n.p.Learn(context.Background()); err == nil {
		t.Fatal("learned a model from a version 4 slot file")
	}
	req := map[string]any{"prompt": seqTokens(30, 7, 3), "n_predict": 3}
	for range 2 {
		code, b := post(t, n.url, "/completion", req)
		if code != 200 {
			t.Fatalf("%d %s", code, b)
		}
		_, direct := post(t, newFake(t, "slot-fa-on.bin", 1, 1, 1).url(), "/completion", req)
		if !reflect.DeepEqual(cacheFree(t, b), cacheFree(t, direct)) {
			t.Fatalf("answer %s, without the proxy %s", b, direct)
		}
	}
	n.flush(t)
	if st := n.p.State(); st.Bridge || st.BridgeOff == "" {
		t.Fatalf("state %+v", st)
	}
	if st := n.p.Stats(); st.Restores != 0 || st.PublishedBlocks != 0 || st.Pinned != 2 {
		t.Fatalf("stats %+v", st)
	}
	assertEmptyDir(t, fs.dir)
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
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("content type %q", ct)
	}
	var got bytes.Buffer
	rd := bufio.NewReader(io.TeeReader(resp.Body, &got))
	// The first event arrives while the server still holds the second.
	line, err := rd.ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "data: ") {
		t.Fatalf("first event %q, %v", line, err)
	}
	for range 4 {
		gate <- struct{}{}
	}
	if _, err := io.Copy(io.Discard, rd); err != nil {
		t.Fatal(err)
	}
	if got.String() != string(want) {
		t.Fatalf("stream through the proxy\n%s\nwithout\n%s", got.String(), want)
	}
	n.flush(t)
	if st := n.p.Stats(); st.Saves != 1 || st.PublishedBlocks != 3 {
		t.Fatalf("a streamed answer's blocks were not published: %+v", st)
	}
}

func TestNonStreamingAnswerChangesOnlyByTimingFields(t *testing.T) {
	fs := newFake(t, "slot-fa-on.bin", 1, 1, 1)
	n := startNode(t, fs, directoryName(t), "one", Options{})
	req := map[string]any{"prompt": seqTokens(20, 7, 3), "n_predict": 3}
	_, got := post(t, n.url, "/completion", req)
	_, want := post(t, newFake(t, "slot-fa-on.bin", 1, 1, 1).url(), "/completion", req)
	rest, _ := decoded(t, got)
	var w map[string]any
	if err := json.Unmarshal(want, &w); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(rest, w) {
		t.Fatalf("answer through the proxy, timing fields removed\n%v\nwithout\n%v", rest, w)
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
		if codes[i] != 200 {
			t.Fatalf("request %d: %d %s", i, codes[i], got[i])
		}
		_, want := post(t, ref.url(), "/completion", req)
		if !reflect.DeepEqual(cacheFree(t, got[i]), cacheFree(t, want)) {
			t.Fatalf("request %d: answer %s, want %s", i, got[i], want)
		}
	}
	n.flush(t)
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if fs.overlaps != 0 {
		t.Fatalf("%d requests were pinned to a slot that was computing", fs.overlaps)
	}
	if st := n.p.Stats(); st.Pinned != 16 {
		t.Fatalf("stats %+v", st)
	}
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
		if code, b := post(t, n.url, "/completion", s.req); code != 200 {
			t.Fatalf("step %d: %d %s", i, code, b)
		}
		n.flush(t)
		if got := n.p.Stats().PublishedBlocks; got != s.published {
			t.Fatalf("step %d: %d blocks published, want %d", i, got, s.published)
		}
	}
}

func TestUpstreamContextShiftPublishesNothing(t *testing.T) {
	dir := directoryName(t)
	prompt := seqTokens(3*blockTokens+1, 7, 3)
	warm(t, startNode(t, newFake(t, "slot-fa-on.bin", 1, 1, 1), dir, "one", Options{}), prompt)
	n := startNode(t, newFake(t, "slot-fa-on.bin", 1, 1, 1), dir, "two", Options{UpstreamContextShift: true})
	_, b := post(t, n.url, "/completion", map[string]any{"prompt": concat(prompt, []int32{5, 5, 5, 5, 5, 5, 5, 5, 5}), "n_predict": 2})
	if _, restored := decoded(t, b); restored != 3*blockTokens {
		t.Fatalf("restored %d: restores stay on", restored)
	}
	n.flush(t)
	if st := n.p.Stats(); st.Saves != 0 || st.PublishedBlocks != 0 {
		t.Fatalf("published with context shift on: %+v", st)
	}
	if st := n.p.State(); st.Publishing || st.PublishOff == "" {
		t.Fatalf("state %+v", st)
	}
}

func TestHealthzAndMetrics(t *testing.T) {
	n := startNode(t, newFake(t, "slot-fa-on.bin", 2, 1, 1), directoryName(t), "one", Options{})
	post(t, n.url, "/completion", map[string]any{"prompt": seqTokens(20, 7, 3), "n_predict": 2})
	n.flush(t)
	resp, err := http.Get(n.url + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	var h struct {
		Status string `json:"status"`
		State
	}
	err = json.NewDecoder(resp.Body).Decode(&h)
	resp.Body.Close()
	if err != nil || resp.StatusCode != 200 || h.Status != "ok" || !h.Bridge || !h.Publishing || h.Slots != 2 {
		t.Fatalf("healthz %d %+v %v", resp.StatusCode, h, err)
	}
	resp, err = http.Get(n.url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{"mcbridge_saved_blocks_total 2", "mcproxy_requests_total 1",
		"mcproxy_queued_blocks_total 2", `mcproxy_restore_fallbacks_total{reason="slot_busy"} 0`} {
		if !strings.Contains(string(b), want+"\n") {
			t.Errorf("metrics lack %q:\n%s", want, b)
		}
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
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		// The client's own key decides its request; the proxy's key its calls.
		if want := map[string]int{"": 401, "sesame": 200}[key]; resp.StatusCode != want {
			t.Fatalf("key %q: status %d, want %d", key, resp.StatusCode, want)
		}
	}
	n.flush(t)
	if st := n.p.Stats(); st.PublishedBlocks != 2 || !n.p.State().Bridge {
		t.Fatalf("stats %+v, state %+v", st, n.p.State())
	}
}
