package proxy

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The agent APIs llama-server v0.5.0 serves, /v1/responses (Codex) and
// /v1/messages (Claude Code), are restored like chats: the prompt the
// server's own conversion and template give, the answer the server's own.
func TestAgentAPIsRestore(t *testing.T) {
	system := strings.Repeat("You are a careful coding agent. ", 4)
	bodies := map[string]func(user string, stream bool) map[string]any{
		"/v1/responses": func(user string, stream bool) map[string]any {
			return map[string]any{"instructions": system, "input": []any{
				map[string]any{"role": "user", "content": user},
			}, "max_output_tokens": 4, "stream": stream}
		},
		"/v1/messages": func(user string, stream bool) map[string]any {
			return map[string]any{"system": []any{map[string]any{"type": "text", "text": system}},
				"messages":   []any{map[string]any{"role": "user", "content": []any{map[string]any{"type": "text", "text": user}}}},
				"max_tokens": 4, "stream": stream}
		},
	}
	for path, body := range bodies {
		for _, stream := range []bool{false, true} {
			name := strings.TrimPrefix(path, "/v1/")
			if stream {
				name += "-stream"
			}
			t.Run(name, func(t *testing.T) {
				dir := directoryName(t)
				one := startFront(t, fakes(t, 1, 2), dir, "one", Options{})
				two := startFront(t, fakes(t, 1, 2), dir, "two", Options{})
				ref := newFake(t, "slot-fa-on.bin", 1, 1, 1)
				ep := map[string]endpoint{"/v1/responses": responses, "/v1/messages": messages}[path]
				promptOf := func(b map[string]any) []int32 {
					raw, err := json.Marshal(b)
					require.NoError(t, err)
					return fakePrompt(t, ep, raw, b)
				}
				a, b := body("what is in main.go?", stream), body("and in util.go?", stream)
				shared := lcp(promptOf(a), promptOf(b)) / blockTokens * blockTokens
				require.Positive(t, shared)

				r := postReply(t, one.url, path, a)
				require.Equal(t, 200, r.code, "%s", r.body)
				assert.Zero(t, r.restored)
				one.flush(t)
				r = postReply(t, two.url, path, b)
				require.Equal(t, 200, r.code, "%s", r.body)
				assert.Equal(t, shared, r.restored, "the shared prefix is restored")
				_, want := post(t, ref.url(), path, b)
				assert.Equal(t, withoutCounts(t, want), withoutCounts(t, r.body), "the answer is the server's own")
				two.flush(t)
				st := two.p.Stats()
				assert.Zero(t, st.AnswerMismatches, "the proxy's tokens are the server's")
				assert.Equal(t, int64(1), st.Saves, "the restored slot's new blocks are published: %+v", st)
			})
		}
	}
}

// /v1/messages runs pinned to one slot like a chat: two requests at once
// take a slot each, none holds the whole server, and a restore is made
// whatever share of the prompt it is.
func TestMessagesPinned(t *testing.T) {
	dir := directoryName(t)
	one := startFront(t, fakes(t, 1, 1), dir, "one", Options{})
	fs := fakes(t, 1, 2)
	two := startFront(t, fs, dir, "two", Options{})
	// A short shared system prompt before a long user message: the
	// restore is under a tenth of the prompt.
	system := strings.Repeat("x", 2*blockTokens)
	req := func(user string, stream bool) map[string]any {
		return map[string]any{"system": system, "messages": []any{map[string]any{"role": "user", "content": user}}, "max_tokens": 2, "stream": stream}
	}
	r := postReply(t, one.url, "/v1/messages", req(strings.Repeat("a", 40*blockTokens), false))
	require.Equal(t, 200, r.code, "%s", r.body)
	one.flush(t)

	gate := make(chan struct{})
	fs[0].mu.Lock()
	fs[0].gate = gate
	fs[0].mu.Unlock()
	type result struct {
		code     int
		restored string
		err      error
	}
	results := make(chan result, 2)
	var bodies []map[string]any
	for _, user := range []string{"b", "c"} {
		body := req(strings.Repeat(user, 40*blockTokens), true)
		bodies = append(bodies, body)
		raw, err := json.Marshal(body)
		require.NoError(t, err)
		go func() {
			resp, err := http.Post(two.url+"/v1/messages", "application/json", bytes.NewReader(raw))
			if err != nil {
				results <- result{err: err}
				return
			}
			defer resp.Body.Close()
			_, err = io.ReadAll(resp.Body)
			results <- result{code: resp.StatusCode, restored: resp.Header.Get("Mcb-Restored-N"), err: err}
		}()
	}
	// Both streams are under way at once, one in each slot.
	require.Eventually(t, func() bool {
		fs[0].mu.Lock()
		defer fs[0].mu.Unlock()
		return fs[0].slots[0].computing && fs[0].slots[1].computing
	}, 10*time.Second, time.Millisecond, "two messages requests run at once")
	close(gate)
	promptOf := func(b map[string]any) []int32 {
		raw, err := json.Marshal(b)
		require.NoError(t, err)
		return fakePrompt(t, messages, raw, b)
	}
	shared := lcp(promptOf(bodies[0]), promptOf(bodies[1])) / blockTokens * blockTokens
	require.Positive(t, shared)
	require.Less(t, shared*10, len(promptOf(bodies[0])), "the restore is under a tenth of the prompt")
	for range 2 {
		r := <-results
		require.NoError(t, r.err)
		require.Equal(t, 200, r.code)
		assert.Equal(t, strconv.Itoa(shared), r.restored, "the shared system prompt is restored")
	}
	st := two.p.Stats()
	assert.Zero(t, st.Exclusive, "no request held the whole server")
	assert.Equal(t, int64(2), st.Pinned)
	fs[0].mu.Lock()
	defer fs[0].mu.Unlock()
	chats := 0
	for _, body := range fs[0].requests {
		if _, probe := body["prompt"]; probe {
			continue // the proxy's own probe
		}
		chats++
		assert.Contains(t, body, "id_slot", "the converted chat carries its slot")
		assert.Contains(t, body, "messages")
		assert.NotContains(t, body, "system", "the server got the chat, not the Anthropic body")
	}
	assert.Equal(t, 2, chats)
}

// withoutCounts is an answer (JSON, or server-sent events of JSON) without
// its token counts, which say how much was cached.
func withoutCounts(t testing.TB, b []byte) []string {
	t.Helper()
	var strip func(v any) any
	strip = func(v any) any {
		switch v := v.(type) {
		case map[string]any:
			delete(v, "usage")
			delete(v, "timings")
			for k, e := range v {
				v[k] = strip(e)
			}
		case []any:
			for i, e := range v {
				v[i] = strip(e)
			}
		}
		return v
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "event: ") {
			out = append(out, line)
			continue
		}
		data := strings.TrimPrefix(line, "data: ")
		if strings.TrimSpace(data) == "" || data == "[DONE]" {
			continue
		}
		var v any
		require.NoError(t, json.Unmarshal([]byte(data), &v), "%q", data)
		c, err := json.Marshal(strip(v))
		require.NoError(t, err)
		out = append(out, string(c))
	}
	return out
}
