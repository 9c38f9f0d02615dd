package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/testenv"
)

// agentSystem is a system prompt of more than ten blocks: over the server's
// slot similarity threshold for /v1/messages, whose slot the server picks.
var agentSystem = strings.Repeat("You are an agent of a swarm. Follow the repository conventions. ", 12)

// The agent APIs of llama-server v0.5.0 through the proxy: a first request
// computes on one server, a second with the same system prompt goes to the
// other (round robin) and is restored there from the proxy's bridge; its
// greedy answer, plain and streamed, is a stock server's, and the proxy
// restored exactly the full blocks the two prompts share as the server's
// own template and tokenizer render them.
func TestProxyAgentAPIs(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	u := startRouted(t, model, 2, 1, "--route", "round-robin")
	ref := testenv.StartLlama(t, "ref", testenv.StockServer(t), testenv.ServerArgs(model, 4096, 1, "on"))
	apis := []struct {
		path string
		body func(system, user string, stream bool) map[string]any
	}{
		{"/v1/messages", func(system, user string, stream bool) map[string]any {
			return map[string]any{"system": system, "messages": []any{map[string]any{"role": "user", "content": user}},
				"max_tokens": 8, "temperature": 0, "stream": stream}
		}},
		{"/v1/responses", func(system, user string, stream bool) map[string]any {
			return map[string]any{"instructions": system, "input": user, "max_output_tokens": 8, "temperature": 0, "seed": 42, "stream": stream}
		}},
	}
	// Both APIs become this chat on the server.
	chatTokens := func(system, user string) []int32 {
		var tmpl struct {
			Prompt string `json:"prompt"`
		}
		testenv.Post(t, ref.URL+"/apply-template", map[string]any{"messages": []any{
			map[string]any{"role": "system", "content": system}, map[string]any{"role": "user", "content": user}}}, &tmpl)
		var tok struct {
			Tokens []int32 `json:"tokens"`
		}
		testenv.Post(t, ref.URL+"/tokenize", map[string]any{"content": tmpl.Prompt, "add_special": true, "parse_special": true}, &tok)
		return tok.Tokens
	}
	restored := 0.0
	for _, api := range apis {
		for _, stream := range []bool{false, true} {
			// Each case has its own system prompt: the slots hold nothing
			// of it before.
			system := fmt.Sprintf("%s, streamed %v. %s", api.path, stream, agentSystem)
			userA, userB := "list the files, please", "and now the tests, please"
			a, b := chatTokens(system, userA), chatTokens(system, userB)
			n := 0
			for n < min(len(a), len(b)) && a[n] == b[n] {
				n++
			}
			want := n / block * block
			require.Greater(t, want, len(a)/10, "the shared part must be over the similarity threshold")

			// Counted before the first request: its blocks are published
			// asynchronously and may already be mirrored once it settles.
			mirrored := testenv.Metrics(t, u.proxy.URL+"/metrics")["mcbridge_mirrored_blocks"]
			first := postThrough(t, u.proxy.URL, api.path, api.body(system, userA, stream))
			require.Equal(t, 200, first.code, "%s", first.body)
			settled(t, u.proxy)
			waitMirrored(t, u.proxy.URL, int(mirrored)+(len(a)-1)/block)
			second := postThrough(t, u.proxy.URL, api.path, api.body(system, userB, stream))
			require.Equal(t, 200, second.code, "%s", second.body)
			assert.NotEqual(t, first.upstream, second.upstream, "%s: round robin", api.path)
			assert.Equal(t, want, second.restored, "%s (stream %v): the shared full blocks are restored", api.path, stream)
			restored += float64(second.restored)
			_, refBody := testenv.PostRaw(t, ref.URL+api.path, api.body(system, userB, stream))
			assert.Equal(t, answerText(t, refBody), answerText(t, second.body), "%s (stream %v): the answer is a stock server's", api.path, stream)
			assert.NotEmpty(t, answerText(t, second.body))
		}
	}
	m := testenv.Metrics(t, u.proxy.URL+"/metrics")
	assert.Equal(t, restored, m["mcbridge_restored_tokens_total"])
	assert.Zero(t, m["mcproxy_answer_mismatches_total"], "the proxy's tokens were the server's every time")
}

// answerText is what an Anthropic or Responses answer says, streamed or
// not: its text and tool calls, without ids, timestamps or counts.
func answerText(t *testing.T, b []byte) []string {
	t.Helper()
	var out []string
	add := func(data []byte) {
		var v map[string]any
		require.NoError(t, json.Unmarshal(data, &v), "%s", data)
		for _, key := range []string{"content", "output", "delta", "item", "text"} {
			if x, ok := v[key]; ok {
				out = append(out, testenv.JSON(stripIDs(x)))
			}
		}
	}
	if !bytes.HasPrefix(bytes.TrimSpace(b), []byte("{")) {
		sc := bufio.NewScanner(bytes.NewReader(b))
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			if data, ok := strings.CutPrefix(sc.Text(), "data: "); ok && data != "[DONE]" {
				add([]byte(data))
			}
		}
		return out
	}
	add(b)
	return out
}

// stripIDs drops what differs between two runs of the same answer.
func stripIDs(v any) any {
	switch v := v.(type) {
	case map[string]any:
		for _, k := range []string{"id", "item_id", "call_id", "created_at", "completed_at", "usage", "timings"} {
			delete(v, k)
		}
		for k, e := range v {
			v[k] = stripIDs(e)
		}
	case []any:
		for i, e := range v {
			v[i] = stripIDs(e)
		}
	}
	return v
}
