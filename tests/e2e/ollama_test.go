package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/testenv"
)

// A real Ollama (scripts/ollama/build.sh: the pinned release, built from
// its module source) runs llama-server as its runner: it finds the binary
// in lib/ollama beside its own, starts one per loaded model with its own
// argument list and its whole environment, and stops it with SIGKILL when
// the model's keep-alive runs out. Installed as docs/ollama.md says, the
// patched server is that runner, configured by the environment alone; a
// store node keeps the KV across the kills.

// ollama is `ollama serve` installed as a user installs it: bin/ollama and
// lib/ollama/llama-server, here a link that the test points at the stock
// or the patched server between runners (Ollama looks the runner up each
// time it starts one).
type ollama struct {
	*testenv.Server
	bin    string
	runner string
	env    []string
}

func startOllama(t *testing.T, env ...string) *ollama {
	t.Helper()
	root := t.TempDir()
	o := &ollama{bin: filepath.Join(root, "bin", "ollama"), runner: filepath.Join(root, "lib", "ollama", "llama-server")}
	require.NoError(t, os.MkdirAll(filepath.Dir(o.bin), 0o755))
	require.NoError(t, os.MkdirAll(filepath.Dir(o.runner), 0o755))
	// A copy, not a link: Ollama resolves its own path through links to
	// find lib/ollama.
	b, err := os.ReadFile(testenv.Ollama(t))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(o.bin, b, 0o755))
	o.useRunner(t, testenv.StockServer(t))
	port := testenv.FreePort(t)
	o.env = append([]string{"HOME=" + root, "OLLAMA_HOST=127.0.0.1:" + strconv.Itoa(port),
		"OLLAMA_MODELS=" + filepath.Join(root, "models"), "OLLAMA_NO_CLOUD=1"}, env...)
	p := testenv.Spawn(t, "ollama", o.bin, []string{"serve"}, o.env)
	url := "http://127.0.0.1:" + strconv.Itoa(port)
	require.NoError(t, testenv.WaitHTTP(p, url+"/api/version", time.Minute))
	o.Server = &testenv.Server{Proc: p, URL: url, Port: port}
	return o
}

// useRunner makes bin the llama-server Ollama starts next.
func (o *ollama) useRunner(t *testing.T, bin string) {
	t.Helper()
	_ = os.Remove(o.runner)
	require.NoError(t, os.Symlink(bin, o.runner))
}

// create imports a model with `ollama create` from a Modelfile.
func (o *ollama) create(t *testing.T, name, modelfile string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "Modelfile")
	require.NoError(t, os.WriteFile(path, []byte(modelfile), 0o644))
	cmd := exec.Command(o.bin, "create", name, "-f", path)
	cmd.Env = append(os.Environ(), o.env...)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "ollama create %s: %s", name, out)
}

// idle waits until Ollama runs no model: a keep-alive ran out, or was 0.
func (o *ollama) idle(t *testing.T) {
	t.Helper()
	testenv.Eventually(t, defaultWait, func() bool {
		var ps struct {
			Models []json.RawMessage `json:"models"`
		}
		require.NoError(t, jsonGet(t, o.URL+"/api/ps", &ps))
		return len(ps.Models) == 0
	}, "Ollama never unloaded its model")
}

// count is how many times s is in Ollama's log (its runners' output
// included).
func (o *ollama) count(s string) int {
	b, err := os.ReadFile(o.Log)
	if err != nil {
		return 0
	}
	return strings.Count(string(b), s)
}

// runnerArgs are the argument lists of the runners Ollama started, from
// its log ("starting llama-server" cmd=...), in order.
func (o *ollama) runnerArgs(t *testing.T) [][]string {
	b, err := os.ReadFile(o.Log)
	require.NoError(t, err)
	var out [][]string
	for _, m := range regexp.MustCompile(`msg="starting llama-server" cmd="([^"]*)"`).FindAllSubmatch(b, -1) {
		out = append(out, strings.Fields(string(m[1]))[1:])
	}
	return out
}

// ollamaSystem is a long system prompt (the shared prefix of a tool-using
// agent) in text that the generated model's byte-level vocabulary
// tokenizes: longer than one of the runner's ubatches (1024 here), so
// that restores end inside a ubatch, where only stock from as many cached
// tokens answers as they must (docs/design.md §10.1).
var ollamaSystem = strings.Repeat("You are a careful assistant. Answer briefly, cite the tools you used, never invent a file name. ", 12)

// ollamaTemplate is a model's own Ollama (Go) template: Ollama renders the
// chat itself and sends the runner the text.
const ollamaTemplate = `{{ range .Messages }}<|{{ .Role }}|>{{ .Content }}
{{ end }}<|assistant|>`

func chatMessages(turns ...string) []map[string]string {
	msgs := []map[string]string{{"role": "system", "content": ollamaSystem}}
	for i, c := range turns {
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		msgs = append(msgs, map[string]string{"role": role, "content": c})
	}
	return msgs
}

var (
	turn1 = chatMessages("Summarise the rules above in one line.")
	turn2 = chatMessages("Summarise the rules above in one line.", "Be brief, cite tools, invent nothing.", "Which tool would you use first?")
)

// ollamaAnswer is what one request got back.
type ollamaAnswer struct {
	Text       string
	PromptEval int // prompt_eval_count, or the usage's prompt_tokens: the whole prompt
	Cached     int // prompt_eval_cached_count, or the usage's cached_tokens
}

// greedy are the options of every request: greedy, so that answers compare.
func greedy(extra map[string]any) map[string]any {
	o := map[string]any{"temperature": 0, "seed": 42, "num_predict": 16}
	for k, v := range extra {
		o[k] = v
	}
	return o
}

func (o *ollama) chat(t *testing.T, model string, msgs []map[string]string, keepAlive any) ollamaAnswer {
	t.Helper()
	var r struct {
		Message struct {
			Content string `json:"content"`
		} `json:"message"`
		PromptEvalCount       int `json:"prompt_eval_count"`
		PromptEvalCachedCount int `json:"prompt_eval_cached_count"`
	}
	testenv.Post(t, o.URL+"/api/chat", map[string]any{"model": model, "messages": msgs, "stream": false,
		"keep_alive": keepAlive, "options": greedy(nil)}, &r)
	return ollamaAnswer{r.Message.Content, r.PromptEvalCount, r.PromptEvalCachedCount}
}

func (o *ollama) generate(t *testing.T, model, prompt string, options map[string]any, keepAlive any) ollamaAnswer {
	t.Helper()
	var r struct {
		Response              string `json:"response"`
		PromptEvalCount       int    `json:"prompt_eval_count"`
		PromptEvalCachedCount int    `json:"prompt_eval_cached_count"`
	}
	testenv.Post(t, o.URL+"/api/generate", map[string]any{"model": model, "prompt": prompt, "raw": true, "stream": false,
		"keep_alive": keepAlive, "options": greedy(options)}, &r)
	return ollamaAnswer{r.Response, r.PromptEvalCount, r.PromptEvalCachedCount}
}

// openAIChat is /v1/chat/completions: Ollama's OpenAI-compatible API,
// which has no keep_alive (OLLAMA_KEEP_ALIVE holds).
func (o *ollama) openAIChat(t *testing.T, model string, msgs []map[string]string) ollamaAnswer {
	t.Helper()
	var r struct {
		Choices []struct {
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
		Usage struct {
			PromptTokens int `json:"prompt_tokens"`
			Details      struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	testenv.Post(t, o.URL+"/v1/chat/completions", map[string]any{"model": model, "messages": msgs,
		"temperature": 0, "seed": 42, "max_tokens": 16}, &r)
	require.Len(t, r.Choices, 1)
	return ollamaAnswer{r.Choices[0].Message.Content, r.Usage.PromptTokens, r.Usage.Details.Cached}
}

// rendered is ollamaTemplate applied to msgs, as Ollama sends it.
func rendered(msgs []map[string]string) string {
	var b strings.Builder
	for _, m := range msgs {
		fmt.Fprintf(&b, "<|%s|>%s\n", m["role"], m["content"])
	}
	return b.String() + "<|assistant|>"
}

// ollamaSwarm is what happens around the script's requests when the
// runner is the patched server: the store node that keeps the KV across
// the kills, and the runner's metrics. Its methods do nothing on nil (the
// stock run), so that both runs send the same requests.
type ollamaSwarm struct {
	sw      *diskSwarm
	store   *testenv.Store
	metrics string
	o       *ollama
}

// settle waits, after Ollama killed a runner, until the store node serves
// every block it copied: the runner's entries leave the directory with its
// lease, and the store publishes its copies in their place.
func (s *ollamaSwarm) settle(t *testing.T) {
	if s == nil {
		return
	}
	waitStore(t, s.store, "every copied block served by the store", func(st storeState) bool {
		return st.Stats.TakenOver >= st.Stats.Replicated
	})
}

// ollamaShiftCtx is the context of the context-shift steps (a multiple of
// 256, as Ollama rounds it): rendered(turn1) fits in it, and 200 more
// tokens do not.
const ollamaShiftCtx = 1280

// ollamaRequest is one request to Ollama: api is "chat" (/api/chat),
// "generate" (/api/generate, raw) or "openai" (/v1/chat/completions, which
// has no keep_alive: OLLAMA_KEEP_ALIVE=0 holds).
type ollamaRequest struct {
	api       string
	model     string
	msgs      []map[string]string // chat, openai
	prompt    string              // generate
	options   map[string]any
	keepAlive any
}

const (
	ollamaTpl    = "mcb-tpl"    // a model with a template of its own: Ollama renders the chat
	ollamaNative = "mcb-native" // one without: llama-server renders it
)

func (o *ollama) send(t *testing.T, r ollamaRequest) ollamaAnswer {
	t.Helper()
	switch r.api {
	case "chat":
		return o.chat(t, r.model, r.msgs, r.keepAlive)
	case "generate":
		return o.generate(t, r.model, r.prompt, r.options, r.keepAlive)
	case "openai":
		return o.openAIChat(t, r.model, r.msgs)
	}
	require.FailNow(t, "no such API "+r.api)
	return ollamaAnswer{}
}

// ollamaStep is one request of the script, on a runner Ollama starts for
// it (the previous one was killed).
type ollamaStep struct {
	name    string
	req     ollamaRequest
	shift   bool // num_ctx ollamaShiftCtx: the answer shifts the context
	restore bool // the patched runner restores a prefix from the store
	// storeDown: the store node (and the swarm's directory with it) is
	// stopped during the request. Last: the restarted store node holds
	// copies of the blocks this runner publishes once it is back, so its
	// takeovers no longer tell when the runner's entries are gone.
	storeDown bool
}

// native is whether llama-server renders the step's chat.
func (s ollamaStep) native() bool { return s.req.model == ollamaNative }

// shiftOptions make num_ctx each slot's context: the prompt fits, the
// answer does not.
var shiftOptions = map[string]any{"num_ctx": ollamaShiftCtx, "num_predict": 200}

var ollamaSteps = []ollamaStep{
	{name: "/api/chat, rendered, turn 1", req: ollamaRequest{api: "chat", model: ollamaTpl, msgs: turn1, keepAlive: 0}},
	{name: "/api/chat, rendered, turn 2 after keep_alive 0", restore: true,
		req: ollamaRequest{api: "chat", model: ollamaTpl, msgs: turn2, keepAlive: "1s"}}, // the keep-alive expires
	{name: "/api/generate raw after the keep-alive expired", restore: true,
		req: ollamaRequest{api: "generate", model: ollamaTpl, prompt: rendered(turn1), keepAlive: 0}},
	{name: "/api/chat, native, turn 1", req: ollamaRequest{api: "chat", model: ollamaNative, msgs: turn1, keepAlive: 0}},
	{name: "/v1/chat/completions, native, turn 2", restore: true, req: ollamaRequest{api: "openai", model: ollamaNative, msgs: turn2}},
	{name: "/api/generate past num_ctx: a context shift", shift: true, restore: true,
		req: ollamaRequest{api: "generate", model: ollamaTpl, prompt: rendered(turn1), options: shiftOptions, keepAlive: 0}},
	{name: "/api/generate past num_ctx again", shift: true, restore: true,
		req: ollamaRequest{api: "generate", model: ollamaTpl, prompt: rendered(turn1), options: shiftOptions, keepAlive: 0}},
	{name: "/api/chat, rendered, store node stopped", storeDown: true,
		req: ollamaRequest{api: "chat", model: ollamaTpl, msgs: turn1, keepAlive: "10m"}},
}

// script sends the requests of ollamaSteps through o, one runner each.
// held, on the stock run, are the patched run's answers: before each
// request whose patched runner restored k tokens, the stock runner is
// made to hold the request's first k tokens (prime), so that both
// answers come from the same cache state. llama-server on the CPU is not
// batch-invariant (docs/design.md §10.1): an answer computed from k
// cached tokens and one computed fresh may differ without any restore
// being wrong.
func (s *ollamaSwarm) script(t *testing.T, o *ollama, held []ollamaAnswer) []ollamaAnswer {
	var out []ollamaAnswer
	for i, step := range ollamaSteps {
		if step.storeDown {
			s.stopStore(t)
		}
		primed := held != nil && held[i].Cached > 0
		if primed {
			o.prime(t, step.req, held[i].Cached)
		}
		out = append(out, o.send(t, step.req))
		if step.storeDown {
			s.restartStore(t)
		}
		// An empty prompt with keep_alive 0 unloads: the primed runner was
		// loaded with a keep-alive that /v1 requests (which have none)
		// leave in place.
		if step.storeDown || primed {
			o.generate(t, step.req.model, "", nil, 0)
		}
		o.idle(t)
		if !step.storeDown {
			s.settle(t)
		}
	}
	return out
}

// runnerURL is the address of the runner Ollama started last (its
// --port).
func (o *ollama) runnerURL(t *testing.T) string {
	t.Helper()
	args := o.runnerArgs(t)
	require.NotEmpty(t, args, "Ollama started no runner")
	a := args[len(args)-1]
	i := slices.Index(a, "--port")
	require.True(t, i >= 0 && i+1 < len(a), "no --port in %v", a)
	return "http://127.0.0.1:" + a[i+1]
}

// prime makes Ollama start the runner r will go to and has one of its
// slots compute the primer of the prompt r makes it evaluate, so that r
// reuses exactly k tokens: the state the patched runner is in after
// restoring k tokens. The prompt's tokens are
// the runner's own: it renders native chats (/apply-template) and
// tokenizes (/tokenize) what Ollama sends it.
func (o *ollama) prime(t *testing.T, r ollamaRequest, k int) {
	t.Helper()
	o.generate(t, r.model, "", r.options, "10m") // an empty prompt loads the model, with r's options
	url := o.runnerURL(t)
	text := r.prompt
	switch {
	case r.model == ollamaNative:
		var tpl struct {
			Prompt string `json:"prompt"`
		}
		testenv.Post(t, url+"/apply-template", map[string]any{"messages": r.msgs}, &tpl)
		text = tpl.Prompt
	case r.api != "generate":
		text = rendered(r.msgs)
	}
	var tok struct {
		Tokens []int32 `json:"tokens"`
	}
	testenv.Post(t, url+"/tokenize", map[string]any{"content": text, "add_special": true, "parse_special": true}, &tok)
	primer := testenv.Primer(t, tok.Tokens, k)
	c := testenv.Complete(t, url, testenv.Request{Prompt: primer, Slot: -1, NPredict: 1})
	require.Equal(t, len(primer), c.Timings.PromptN, "a new runner computes the whole primer")
}

// stopStore stops the store node, and with it the swarm's directory (its
// embedded etcd).
func (s *ollamaSwarm) stopStore(t *testing.T) {
	if s == nil {
		return
	}
	s.store.Stop()
}

// restartStore checks that the runner Ollama started meanwhile says it
// cannot reach its swarm, in its log and in mcbridge_up, restarts the
// store node on its directories, and checks that the runner says it is
// back.
func (s *ollamaSwarm) restartStore(t *testing.T) {
	if s == nil {
		return
	}
	testenv.Eventually(t, defaultWait, func() bool { return s.o.LogContains("mcbridge: swarm unreachable") },
		"the runner never logged that its swarm is unreachable")
	down := upReason(t, s.metrics)
	assert.Contains(t, down, "unreachable", "mcbridge_up says why")
	s.store = s.sw.startStore(t, "store-restarted")
	testenv.Eventually(t, defaultWait, func() bool { return s.o.LogContains("mcbridge: swarm reachable again") },
		"the runner never logged that its swarm is back")
	testenv.Eventually(t, defaultWait, func() bool { return upReason(t, s.metrics) == "" }, "mcbridge_up never cleared")
}

// upReason is the reason label of mcbridge_up 0, "" when it is 1.
func upReason(t *testing.T, url string) string {
	for k, v := range testenv.Metrics(t, url) {
		if name, label, ok := strings.Cut(k, "{"); ok && name == "mcbridge_up" && v == 0 {
			return label
		}
		if k == "mcbridge_up" && v == 1 {
			return ""
		}
	}
	require.FailNow(t, "no mcbridge_up at "+url)
	return ""
}

// A real Ollama runs the patched server as its runner, with the arguments
// and environment it gives every runner, and kills it when a keep-alive
// runs out (or is 0) before every request: each new runner restores the
// conversation's prefix from the store node, Ollama reports it as cached
// prompt tokens, and every answer is the one Ollama gives with the stock
// llama-server as its runner holding as many of the prompt's tokens. The
// store node goes away for one runner, which says so and answers from its
// own computation. The swarm is set up as docs/ollama.md sets up one host:
// shared pools, no transfer engine; the store maps each runner's pool as
// it starts, so Ollama's kill right after an answer loses none of it.
func TestOllama(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	metricsAddr := "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t))
	sw := newOneHostSwarm(t, fmt.Sprintf(`, "metrics_listen": %q`, metricsAddr))
	o := startOllama(t, "OLLAMA_NUM_PARALLEL=2", "OLLAMA_KEEP_ALIVE=0", "MCB_CONFIG="+sw.serverCfg, "LLAMA_ARG_CACHE_RAM=0")
	o.create(t, ollamaTpl, fmt.Sprintf("FROM %s\nTEMPLATE \"\"\"%s\"\"\"\n", model, ollamaTemplate))
	o.create(t, ollamaNative, fmt.Sprintf("FROM %s\n", model))

	// The patched run first: what its runners restored is the state the
	// stock runners are then put in.
	s := &ollamaSwarm{sw: sw, store: sw.startStore(t, "store"), metrics: "http://" + metricsAddr + "/metrics", o: o}
	o.useRunner(t, testenv.PatchedServer(t))
	got := s.script(t, o, nil)
	nPatched := len(o.runnerArgs(t))
	shifts := o.count("slot context shift")
	require.GreaterOrEqual(t, shifts, 2, "the patched runners shifted their context")

	var none *ollamaSwarm
	o.useRunner(t, testenv.StockServer(t))
	want := none.script(t, o, got)

	for i, step := range ollamaSteps {
		assert.Equal(t, want[i].Text, got[i].Text, "%s: answers as with the stock runner", step.name)
		assert.Equal(t, want[i].PromptEval, got[i].PromptEval, "%s: the same prompt (prompt_eval_count counts cached tokens too)", step.name)
		assert.Equal(t, got[i].Cached, want[i].Cached, "%s: the stock runner held as many of the prompt's tokens", step.name)
		if step.restore {
			assert.Positive(t, got[i].Cached, "%s: the new runner restored the conversation's prefix", step.name)
		} else {
			assert.Zero(t, got[i].Cached, "%s: nothing to restore", step.name)
		}
		t.Logf("%s: prompt %d tokens, %d of them restored; answer %q", step.name, got[i].PromptEval, got[i].Cached, got[i].Text)
	}

	// What Ollama passed its runners, as docs/ollama.md lists it.
	args := o.runnerArgs(t)
	require.Len(t, args, 2*nPatched, "one runner a request, in both runs")
	for i, a := range args {
		line := " " + strings.Join(a, " ") + " "
		step := ollamaSteps[i%len(ollamaSteps)]
		for _, want := range []string{" --context-shift --keep 4 ", " -np 2 ", " --no-webui ", " --offline ", " --load-mode none "} {
			assert.Contains(t, line, want, "runner %d (%s)", i, step.name)
		}
		// Ollama sizes the batch from the context (num_ctx × parallel): 512
		// up to 4096, 1024 above, as one ubatch.
		b := 1024
		if step.shift {
			b = 512
		}
		assert.Contains(t, line, fmt.Sprintf(" -b %d -ub %d ", b, b), "runner %d (%s)", i, step.name)
		if step.native() {
			assert.NotContains(t, line, " --no-jinja ", "runner %d (%s): llama-server renders the chat", i, step.name)
		} else {
			assert.Contains(t, line, " --no-jinja --chat-template chatml ", "runner %d (%s): Ollama renders the chat", i, step.name)
		}
	}
	assert.Equal(t, 2*shifts, o.count("slot context shift"), "the stock runners shifted their context as often")
	assert.True(t, o.LogContains("mcbridge: on: "), "MCB_CONFIG in Ollama's environment turns the bridge on")
	assert.False(t, o.LogContains("keeps every prefix a second time"), "LLAMA_ARG_CACHE_RAM=0 reaches the runner")
}
