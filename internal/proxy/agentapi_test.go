package proxy

import (
	"encoding/json"
	"strings"
	"testing"

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

// /v1/messages reaches the slot the server picks: the proxy restores only
// when the server's rule then picks the restored slot.
func TestMessagesRestoreOnlyWhereTheServerPicksIt(t *testing.T) {
	dir := directoryName(t)
	one := startFront(t, fakes(t, 1, 1), dir, "one", Options{})
	two := startFront(t, fakes(t, 1, 2), dir, "two", Options{})
	// A short shared system prompt before a long user message: the
	// restore would be under a tenth of the prompt.
	system := strings.Repeat("x", 2*blockTokens)
	req := func(user string) map[string]any {
		return map[string]any{"system": system, "messages": []any{map[string]any{"role": "user", "content": user}}, "max_tokens": 2}
	}
	r := postReply(t, one.url, "/v1/messages", req(strings.Repeat("a", 40*blockTokens)))
	require.Equal(t, 200, r.code, "%s", r.body)
	one.flush(t)
	r = postReply(t, two.url, "/v1/messages", req(strings.Repeat("b", 40*blockTokens)))
	require.Equal(t, 200, r.code, "%s", r.body)
	assert.Zero(t, r.restored)
	assert.Equal(t, int64(1), two.p.Stats().Fallbacks["server_picks"])
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
		data := strings.TrimPrefix(line, "data: ")
		if strings.TrimSpace(data) == "" {
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
