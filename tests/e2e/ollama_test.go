package e2e

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/testenv"
)

// Ollama runs llama-server as its runner (llm/llama_server.go, read at
// ollama/ollama fb3076099): it finds the binary in lib/ollama beside its
// own, starts it with a fixed argument list and its whole environment,
// sends /tokenize, /apply-template, /completion (streamed, cache_prompt
// true, no id_slot) and /v1/chat/completions, and when the keep-alive runs
// out it stops the runner with Process.Kill: SIGKILL, no shutdown. Its
// port is private to Ollama. So the patched server is configured by the
// environment alone (MCB_CONFIG), serves its bridge metrics on a port of
// the library's own (metrics_listen), and what outlives a kill is a store
// node's copy, here on its disk.

// ollamaArgs is Ollama's argument list for a model blob with -c n and
// -np 1 (its defaults; no -ngl, -t or batch flags unless a user sets
// them); the port comes from StartServer.
func ollamaArgs(blob string, n int) []string {
	return []string{"--model", blob, "--host", "127.0.0.1", "--no-webui", "--offline",
		"-c", strconv.Itoa(n), "-np", "1",
		"--log-verbosity", "4", "--no-log-prefix", "--no-log-timestamps",
		"--flash-attn", "auto"}
}

// ollamaBlob copies a model to where Ollama keeps it: blobs/sha256-<digest>,
// no extension.
func ollamaBlob(t *testing.T, model string) string {
	b, err := os.ReadFile(model)
	require.NoError(t, err)
	sum := sha256.Sum256(b)
	dir := filepath.Join(t.TempDir(), "models", "blobs")
	require.NoError(t, os.MkdirAll(dir, 0o755))
	p := filepath.Join(dir, "sha256-"+hex.EncodeToString(sum[:]))
	require.NoError(t, os.WriteFile(p, b, 0o644))
	return p
}

func startOllamaRunner(t *testing.T, name, bin, blob string, env ...string) *testenv.Server {
	return testenv.StartServer(t, name, bin, ollamaArgs(blob, 4096), env, func(port int) []string {
		return []string{"--port", strconv.Itoa(port)}
	}, "/health")
}

// ollamaOptions are the sampling fields Ollama sends with every request,
// greedy (temperature 0) so that answers compare.
func ollamaOptions(n int) map[string]any {
	return map[string]any{"n_predict": n, "temperature": 0, "top_k": 40, "top_p": 0.9, "min_p": 0,
		"repeat_penalty": 1.1, "repeat_last_n": 64, "frequency_penalty": 0, "presence_penalty": 0, "seed": 42}
}

// ollamaExchange is what one conversation turn gets back, request by
// request, as Ollama sends them.
type ollamaExchange struct {
	Tokens     []int
	Prompt     string
	Completion string
	Timings    testenv.Timings
	Chat       string
}

var ollamaMessages = []map[string]string{
	{"role": "system", "content": ollamaSystem},
	{"role": "user", "content": "Summarise the rules above in one line."},
}

// ollamaSystem is a long system prompt (the shared prefix of a tool-using
// agent), text the tiny model's byte-level vocabulary tokenizes.
var ollamaSystem = strings.Repeat("You are a careful assistant. Answer briefly, cite the tools you used, never invent a file name. ", 12)

func ollamaTurn(t *testing.T, url string) ollamaExchange {
	t.Helper()
	var ex ollamaExchange
	var tok struct {
		Tokens []int `json:"tokens"`
	}
	testenv.Post(t, url+"/tokenize", map[string]any{"content": ollamaSystem}, &tok)
	ex.Tokens = tok.Tokens
	var tpl struct {
		Prompt string `json:"prompt"`
	}
	testenv.Post(t, url+"/apply-template", map[string]any{"messages": ollamaMessages}, &tpl)
	require.NotEmpty(t, tpl.Prompt)
	ex.Prompt = tpl.Prompt
	ex.Completion, ex.Timings, _ = ollamaComplete(t, url, tpl.Prompt)

	body := ollamaOptions(nPredict)
	body["messages"], body["stream"], body["cache_prompt"] = ollamaMessages, false, true
	var chat struct {
		Choices []struct {
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
	}
	testenv.Post(t, url+"/v1/chat/completions", body, &chat)
	require.Len(t, chat.Choices, 1)
	ex.Chat = chat.Choices[0].Message.Content
	return ex
}

// ollamaComplete is Ollama's /completion: a rendered prompt string,
// streamed as server-sent events, cache_prompt true, no id_slot.
func ollamaComplete(t *testing.T, url, prompt string) (string, testenv.Timings, testenv.Outcome) {
	t.Helper()
	body := ollamaOptions(nPredict)
	body["prompt"], body["stream"], body["cache_prompt"] = prompt, true, true
	b, err := json.Marshal(body)
	require.NoError(t, err)
	req, err := http.NewRequest(http.MethodPost, url+"/completion", bytes.NewReader(b))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	// One run in four, the next POST on the connection this stream used
	// read EOF before llama-server saw it (a POST is not retried): the
	// stream gets a connection of its own.
	req.Close = true
	resp, err := testenv.Client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var text strings.Builder
	var timings testenv.Timings
	var outcome testenv.Outcome
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		var ev struct {
			Content string           `json:"content"`
			Stop    bool             `json:"stop"`
			Timings *testenv.Timings `json:"timings"`
			MCB     *testenv.Outcome `json:"mcbridge"`
		}
		require.NoError(t, json.Unmarshal([]byte(data), &ev), "event %q", data)
		text.WriteString(ev.Content)
		if ev.Stop && ev.Timings != nil {
			timings = *ev.Timings
		}
		if ev.Stop && ev.MCB != nil {
			outcome = *ev.MCB
		}
	}
	require.NoError(t, sc.Err())
	return text.String(), timings, outcome
}

// The patched llama-server as Ollama runs it: configured by MCB_CONFIG
// and LLAMA_ARG_CACHE_RAM=0 alone, Ollama's arguments, requests and
// keep-alive kill. A second runner started after the kill restores the
// conversation's prefix from the store node, and every answer is the
// stock server's.
func TestOllamaDropIn(t *testing.T) {
	blob := ollamaBlob(t, testenv.Model(t, "tiny", 0))
	stock := startOllamaRunner(t, "stock", testenv.StockServer(t), blob)
	want := ollamaTurn(t, stock.URL)
	stock.Stop()
	require.True(t, stock.LogContains("prompt cache is enabled"), "Ollama's arguments leave llama-server's prompt cache on")
	require.Greater(t, len(want.Tokens), 2*block, "the system prompt spans blocks")
	require.NotEmpty(t, want.Completion, "stock's /completion")
	require.NotEmpty(t, want.Chat, "stock's /v1/chat/completions")

	metricsAddr := "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t))
	sw := newDiskSwarm(t, fmt.Sprintf(`, "metrics_listen": %q`, metricsAddr))
	store := sw.startStore(t, "store")
	env := []string{"MCB_CONFIG=" + sw.serverCfg, "LLAMA_ARG_CACHE_RAM=0"}

	first := startOllamaRunner(t, "runner-1", testenv.PatchedServer(t), blob, env...)
	require.Equal(t, "on", (&testenv.Llama{Server: first}).BridgeState(), "MCB_CONFIG alone turns the bridge on")
	assert.True(t, first.LogContains("prompt cache is disabled"), "LLAMA_ARG_CACHE_RAM=0 reaches the runner")
	assert.False(t, first.LogContains("keeps every prefix a second time"), "LLAMA_ARG_CACHE_RAM=0 leaves the prompt cache to the bridge: no warning")
	got := ollamaTurn(t, first.URL)
	assert.Equal(t, want.Tokens, got.Tokens, "/tokenize")
	assert.Equal(t, want.Prompt, got.Prompt, "/apply-template")
	assert.Equal(t, want.Completion, got.Completion, "/completion answers as stock")
	assert.Equal(t, want.Chat, got.Chat, "/v1/chat/completions answers as stock")
	m := testenv.Metrics(t, "http://"+metricsAddr+"/metrics")
	assert.Equal(t, float64(1), m["mcbridge_up"], "the library's own metrics listener")
	assert.Positive(t, m["mcbridge_saved_blocks_total"])
	prefix := got.Timings.PromptN / block * block
	require.Positive(t, prefix)
	waitStore(t, store, "the conversation's blocks copied and on disk", func(s storeState) bool {
		return s.Stats.Replicated >= prefix/block && s.Disk.Files >= s.Stats.Replicated
	})

	// The keep-alive runs out: Ollama kills the runner.
	first.Kill()
	_, err := http.Get("http://" + metricsAddr + "/metrics")
	require.Error(t, err, "the metrics listener died with its process")
	waitStore(t, store, "the killed runner's blocks taken over", func(s storeState) bool { return s.Stats.TakenOver >= prefix/block })

	second := startOllamaRunner(t, "runner-2", testenv.PatchedServer(t), blob, env...)
	waitMirrored(t, "http://"+metricsAddr, prefix/block)
	text, timings, outcome := ollamaComplete(t, second.URL, want.Prompt)
	assert.Equal(t, []any{"restore", prefix}, []any{outcome.Decision, outcome.RestoredN},
		"the new runner restores the conversation's full blocks from the store: %+v", outcome)
	assert.Equal(t, want.Completion, text, "and answers as stock")
	t.Logf("system prompt %d tokens; rendered prompt %d tokens, %d restored after the kill; answer %q, chat %q",
		len(want.Tokens), timings.PromptN+timings.CacheN, outcome.RestoredN, text, want.Chat)
	m = testenv.Metrics(t, "http://"+metricsAddr+"/metrics")
	assert.Equal(t, float64(prefix), m["mcbridge_restored_tokens_total"], "the new runner's metrics listener")
	testenv.Eventually(t, defaultWait, func() bool {
		return testenv.Metrics(t, store.URL+"/metrics")["mcbridge_peer_uses_total"] >= float64(prefix/block)
	}, "the runner reports its restores to the store")
}
