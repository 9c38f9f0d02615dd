package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// stockWithSlots runs a stock llama-server with a slot directory of its
// own, for a proxy in front of it.
func stockWithSlots(t *testing.T, name, model, fa string) (*testenv.Llama, string) {
	dir := testenv.SlotDir(t, name)
	s := testenv.StartLlama(t, name, testenv.StockServer(t), append(testenv.ServerArgs(model, 4096, 2, fa), "--slot-save-path", dir))
	return s, dir
}

func proxyConfig(etcd, te, prefix string) string {
	return fmt.Sprintf(`{"block_tokens": 64, "arbiter": {"policy": "always-restore"}, "directory": {"kind": "etcd", "endpoints": [%q], "prefix": %q}, "transport": {"kind": "mooncake", "lib": %q}}`,
		etcd, prefix, te)
}

// streamEvents posts a streamed completion and returns its events without
// their timings.
func streamEvents(t *testing.T, url string, r testenv.Request) []string {
	t.Helper()
	body := map[string]any{"prompt": r.Prompt, "n_predict": r.NPredict, "temperature": 0, "seed": 42,
		"return_tokens": true, "cache_prompt": true, "id_slot": r.Slot, "stream": true}
	for k, v := range r.Extra {
		body[k] = v
	}
	code, b := testenv.PostRaw(t, url+"/completion", body)
	require.Equal(t, 200, code, "%s", b)
	var out []string
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var ev map[string]any
		require.NoError(t, json.Unmarshal([]byte(data), &ev))
		out = append(out, testenv.JSON(map[string]any{"content": ev["content"], "tokens": ev["tokens"], "stop": ev["stop"]}))
	}
	return out
}

func chatRequest(user string, extra map[string]any) map[string]any {
	system := strings.Repeat("You are an agent of a swarm. Follow the repository conventions. ", 12)
	r := map[string]any{"messages": []map[string]any{{"role": "system", "content": system}, {"role": "user", "content": user}},
		"max_tokens": 8, "temperature": 0, "seed": 42}
	for k, v := range extra {
		r[k] = v
	}
	return r
}

// templateTokens is what the stock server computes for a chat.
func templateTokens(t *testing.T, url string, user string) []int32 {
	var tmpl struct {
		Prompt string `json:"prompt"`
	}
	testenv.Post(t, url+"/apply-template", chatRequest(user, nil), &tmpl)
	var tok struct {
		Tokens []int32 `json:"tokens"`
	}
	testenv.Post(t, url+"/tokenize", map[string]any{"content": tmpl.Prompt, "add_special": true}, &tok)
	return tok.Tokens
}

// `mcbridge proxy` in front of stock llama-servers: what one proxy's
// server computed, a proxy in front of another server (another process)
// restores, through etcd and the Transfer Engine; every answer, plain,
// streamed or chat, is the stock server's; another model or flash
// attention setting restores nothing.
func TestProxy(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	other := testenv.Model(t, "tiny", 2)
	etcd := etcdtest.Start(t)
	pa := testenv.Cat(prefix[:512], testenv.Tokens(40, 5, 11))
	pb := testenv.Cat(prefix[:512], testenv.Tokens(40, 3, 17))
	const sharedTokens = 512
	fresh := map[string]any{"cache_prompt": false}
	reqA := testenv.Request{Prompt: pa, Slot: -1, NPredict: nPredict}
	reqB := testenv.Request{Prompt: pb, Slot: -1, NPredict: nPredict}
	for _, fa := range []string{"on", "off"} {
		t.Run("fa-"+fa, func(t *testing.T) {
			otherFA := map[string]string{"on": "off", "off": "on"}[fa]
			cfg := proxyConfig(etcd.Endpoint(), mockTE, "/proxytest-"+fa)
			s1, d1 := stockWithSlots(t, "s1", model, fa)
			s2, d2 := stockWithSlots(t, "s2", model, fa)
			ref := testenv.StartLlama(t, "ref", testenv.StockServer(t), testenv.ServerArgs(model, 4096, 2, fa))
			p1 := testenv.StartProxy(t, "p1", s1.URL, d1, cfg)
			p2 := testenv.StartProxy(t, "p2", s2.URL, d2, cfg)

			out := testenv.Complete(t, p1.URL, reqA)
			assert.Zero(t, out.MCB.RestoredN, "request 1 restores nothing from an empty directory")
			assert.Equal(t, testenv.StockFrom(t, ref.URL, reqA, out.Timings.CacheN).Tokens, out.Tokens, "request 1 answers as stock")
			n := (len(pa) + nPredict - 1) / block
			waitMirrored(t, p2.URL, n)

			out = testenv.Complete(t, p2.URL, reqB)
			assert.Equal(t, sharedTokens, out.MCB.RestoredN, "request 2 restores the shared tokens: %+v", out.MCB)
			assert.Equal(t, sharedTokens, out.Timings.CacheN, "server 2 computes only the rest")
			assert.Equal(t, testenv.StockFrom(t, ref.URL, reqB, sharedTokens).Tokens, out.Tokens, "request 2 is token-identical to stock")
			assert.Equal(t, float64(sharedTokens), testenv.Metrics(t, p2.URL+"/metrics")["mcbridge_restored_tokens_total"])

			got := streamEvents(t, p2.URL, testenv.Request{Prompt: pb, Slot: 1 - out.IDSlot, NPredict: nPredict})
			testenv.Prime(t, ref.URL, pb, sharedTokens, fresh)
			assert.Equal(t, streamEvents(t, ref.URL, testenv.Request{Prompt: pb, Slot: 0, NPredict: nPredict}), got,
				"the streamed answer is stock's from as many tokens, event by event")
			assert.Equal(t, float64(2*sharedTokens), testenv.Metrics(t, p2.URL+"/metrics")["mcbridge_restored_tokens_total"],
				"the streamed request restored too")

			// Chat: the same system prompt, another user message.
			ta, tb := templateTokens(t, ref.URL, "first question"), templateTokens(t, ref.URL, "another one")
			lcp := 0
			for lcp < min(len(ta), len(tb)) && ta[lcp] == tb[lcp] {
				lcp++
			}
			chatShared := lcp / block * block
			before := testenv.Metrics(t, p2.URL+"/metrics")["mcbridge_mirrored_blocks"]
			testenv.Post(t, p1.URL+"/v1/chat/completions", chatRequest("first question", nil), nil)
			waitMirrored(t, p2.URL, int(before)+chatShared/block)
			var chatOut, chatRef struct {
				Choices []map[string]any `json:"choices"`
				Timings testenv.Timings  `json:"timings"`
			}
			h := testenv.PostHeaders(t, p2.URL+"/v1/chat/completions", chatRequest("another one", nil), &chatOut)
			testenv.Prime(t, ref.URL, tb, chatOut.Timings.CacheN, fresh)
			testenv.Post(t, ref.URL+"/v1/chat/completions", chatRequest("another one", map[string]any{"id_slot": 0}), &chatRef)
			assert.Equal(t, chatShared, testenv.ProxyOutcome(t, h).RestoredN, "a chat restores the tokens its template shares with another")
			assert.Equal(t, chatOut.Timings.CacheN, chatRef.Timings.CacheN, "the stock server held as many of the chat's tokens")
			assert.Equal(t, testenv.JSON(chatRef.Choices), testenv.JSON(chatOut.Choices), "the chat answer is stock's")

			for _, v := range []struct{ name, model, fa string }{{"other weights", other, fa}, {"flash attention " + otherFA, model, otherFA}} {
				s, d := stockWithSlots(t, "s-"+v.name, v.model, v.fa)
				p := testenv.StartProxy(t, "p-"+v.name, s.URL, d, cfg)
				got := testenv.Complete(t, p.URL, testenv.Request{Prompt: pb, Slot: -1, NPredict: nPredict})
				want := s.Complete(t, testenv.Request{Prompt: pb, Slot: -1, NPredict: nPredict, Extra: fresh})
				assert.Zero(t, got.MCB.RestoredN, "%s: nothing restored", v.name)
				assert.Equal(t, want.Tokens, got.Tokens, "%s: the answer is the server's own", v.name)
				assert.NotEqual(t, p1.State(t)["fingerprint"], p.State(t)["fingerprint"], "%s: another fingerprint", v.name)
				p.Stop()
				s.Stop()
			}
			p1.Stop()
			p2.Stop()
			for _, d := range []string{d1, d2} {
				left, err := os.ReadDir(d)
				require.NoError(t, err)
				assert.Empty(t, left, "the proxies left no file in %s", d)
			}
		})
	}
}
