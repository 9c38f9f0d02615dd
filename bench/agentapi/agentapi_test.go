package agentapi

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	aoption "github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/openai/openai-go/v3"
	ooption "github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/gguf"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// The swarm: servers × slots slots, agents agents of turns turns.
const (
	servers = 2
	slots   = 2
	agents  = 4
	turns   = 2
	predict = 8
)

// systemWords is the shared system prompt's length in words;
// quickSystemWords, MCB_BENCH_QUICK's.
const systemWords, quickSystemWords = 400, 150

// modelConfig is the routing benchmark's model: the bench model's layers
// cut to 4.
func modelConfig() gguf.Config {
	c := gguf.Presets["bench"]
	c.Name, c.BlockCount, c.ContextLength = "mcbridge-agentapi", 4, 8192
	return c
}

// words draws n words of a fixed lexicon: text the generated vocabularies
// tokenize like prose.
func words(rng *rand.Rand, n int) string {
	lex := strings.Fields("the agent reads writes tests files module package function returns error value slot cache prefix server request answer tool schema repository change commit review build run check type field method call")
	out := make([]string, n)
	for i := range out {
		out[i] = lex[rng.IntN(len(lex))]
	}
	return strings.Join(out, " ")
}

// swarm is the workload: the shared system prompt, and each agent's task
// and one user message per turn.
type swarm struct {
	system string
	tasks  []string
	users  [][]string
}

func newSwarm(seed uint64, system int) swarm {
	rng := rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15))
	s := swarm{system: "You are a coding agent of a swarm. " + words(rng, system)}
	for range agents {
		s.tasks = append(s.tasks, "Task: "+words(rng, 40))
		var us []string
		for range turns {
			us = append(us, words(rng, 20))
		}
		s.users = append(s.users, us)
	}
	return s
}

var toolNames = []string{"read_file", "write_file", "run_tests"}

func toolSchema() map[string]any {
	return map[string]any{"type": "object", "properties": map[string]any{"path": map[string]any{"type": "string"},
		"content": map[string]any{"type": "string"}}, "required": []string{"path"}}
}

// turn is one agent's conversation up to turn k: the task, then each
// earlier user message and the answer to it, then turn k's message.
func (s swarm) messages(a, k int, answers []string) anthropic.MessageNewParams {
	var msgs []anthropic.MessageParam
	for i := 0; i <= k; i++ {
		user := s.users[a][i]
		if i == 0 {
			user = s.tasks[a] + "\n" + user
		}
		msgs = append(msgs, anthropic.NewUserMessage(anthropic.NewTextBlock(user)))
		if i < k {
			msgs = append(msgs, anthropic.NewAssistantMessage(anthropic.NewTextBlock(answers[i])))
		}
	}
	p := anthropic.MessageNewParams{Model: "agentapi", MaxTokens: predict, System: []anthropic.TextBlockParam{{Text: s.system}}, Messages: msgs}
	for _, n := range toolNames {
		p.Tools = append(p.Tools, anthropic.ToolUnionParam{OfTool: &anthropic.ToolParam{Name: n, Description: anthropic.String("The " + n + " tool."),
			InputSchema: anthropic.ToolInputSchemaParam{Properties: toolSchema()["properties"], Required: []string{"path"}}}})
	}
	return p
}

func (s swarm) responses(a, k int, answers []string) responses.ResponseNewParams {
	var items responses.ResponseInputParam
	for i := 0; i <= k; i++ {
		user := s.users[a][i]
		if i == 0 {
			user = s.tasks[a] + "\n" + user
		}
		items = append(items, responses.ResponseInputItemParamOfMessage(user, responses.EasyInputMessageRoleUser))
		if i < k {
			// llama-server reads an assistant item only with its type.
			answer := responses.ResponseInputItemParamOfMessage(answers[i], responses.EasyInputMessageRoleAssistant)
			answer.OfMessage.Type = responses.EasyInputMessageTypeMessage
			items = append(items, answer)
		}
	}
	p := responses.ResponseNewParams{Model: "agentapi", Instructions: openai.String(s.system), MaxOutputTokens: openai.Int(predict),
		Temperature: openai.Float(0), Input: responses.ResponseNewParamsInputUnion{OfInputItemList: items}}
	for _, n := range toolNames {
		p.Tools = append(p.Tools, responses.ToolUnionParam{OfFunction: &responses.FunctionToolParam{Name: n,
			Description: openai.String("The " + n + " tool."), Strict: openai.Bool(false), Parameters: toolSchema()}})
	}
	return p
}

// apiOf is the API agent a speaks in a swarm.
func apiOf(kind string, a int) string {
	switch {
	case kind == "mixed" && a%2 == 1, kind == "responses":
		return "responses"
	}
	return "messages"
}

// call streams one request and times its first event and its end.
func call(ctx context.Context, base, api string, s swarm, a, k int, answers []string) (Request, error) {
	r := Request{Agent: a, Turn: k, API: api}
	t0 := time.Now()
	first := func() {
		if r.TTFTMS == 0 {
			r.TTFTMS = float64(time.Since(t0).Microseconds()) / 1000
		}
	}
	var header http.Header
	keep := func(req *http.Request, next func(*http.Request) (*http.Response, error)) (*http.Response, error) {
		resp, err := next(req)
		if err == nil {
			header = resp.Header
		}
		return resp, err
	}
	switch api {
	case "messages":
		cl := anthropic.NewClient(aoption.WithBaseURL(base), aoption.WithAPIKey("none"), aoption.WithMaxRetries(0),
			aoption.WithHTTPClient(testenv.Client), aoption.WithMiddleware(keep), aoption.WithJSONSet("temperature", 0))
		st := cl.Messages.NewStreaming(ctx, s.messages(a, k, answers))
		var msg anthropic.Message
		for st.Next() {
			first()
			if err := msg.Accumulate(st.Current()); err != nil {
				return r, err
			}
		}
		if err := st.Err(); err != nil {
			return r, err
		}
		for _, b := range msg.Content {
			r.Answer += b.Text
		}
	default:
		cl := openai.NewClient(ooption.WithBaseURL(base+"/v1/"), ooption.WithAPIKey("none"), ooption.WithMaxRetries(0),
			ooption.WithHTTPClient(testenv.Client), ooption.WithMiddleware(keep))
		st := cl.Responses.NewStreaming(ctx, s.responses(a, k, answers))
		for st.Next() {
			first()
			if ev := st.Current(); ev.Type == "response.completed" {
				r.Answer = ev.Response.OutputText()
			}
		}
		if err := st.Err(); err != nil {
			return r, err
		}
	}
	r.TotalMS = float64(time.Since(t0).Microseconds()) / 1000
	if header != nil {
		r.Restored, _ = strconv.Atoi(header.Get("Mcb-Restored-N"))
	}
	if r.Answer == "" {
		r.Answer = "(no text)"
	}
	return r, nil
}

// swarmRun runs one swarm on fresh servers: straight to them (uncached
// and stock: agent a talks to server a mod servers) or through one proxy
// in front of them all.
func swarmRun(b *testing.B, model string, s swarm, kind, side string) Run {
	b.Helper()
	var urls []string
	args := []string{"proxy", "--config", `{"pool_bytes": 1073741824}`}
	var procs []*testenv.Llama
	for i := range servers {
		dir := testenv.ShmSlotDir(b, "agentapi-"+strconv.Itoa(i))
		sargs := append(testenv.BenchServerArgs(model, 8192, slots, "on"), "--slot-save-path", dir)
		if side == "uncached" {
			sargs = append(sargs, "--no-cache-prompt")
		}
		srv := testenv.StartLlama(b, fmt.Sprintf("%s-%s-u%d", kind, side, i), testenv.StockServer(b), sargs)
		procs = append(procs, srv)
		urls = append(urls, srv.URL)
		args = append(args, "--upstream", srv.URL+",slots="+dir)
	}
	defer func() {
		for _, p := range procs {
			p.Stop()
		}
	}()
	run := Run{Swarm: kind, Side: side}
	ctx := context.Background()
	var proxyURL string
	if side == "proxy" {
		px := testenv.StartServer(b, kind+"-proxy", testenv.Mcbridge(b), args, nil, func(port int) []string {
			return []string{"--listen", "127.0.0.1:" + strconv.Itoa(port)}
		}, "/healthz")
		defer px.Stop()
		proxyURL = px.URL
		// The swarm has been running: one request of each API it speaks
		// computed the shared prefix as that API renders it, and it is
		// published (not measured).
		warm := swarm{system: s.system, tasks: []string{"warm up"}, users: [][]string{{"hello"}}}
		var apis []string
		for a := range agents {
			if api := apiOf(kind, a); !slices.Contains(apis, api) {
				apis = append(apis, api)
				_, err := call(ctx, proxyURL, api, warm, 0, 0, nil)
				require.NoError(b, err)
			}
		}
		testenv.Eventually(b, 5*time.Minute, func() bool {
			var st struct {
				Pending int `json:"pending"`
			}
			return json.Unmarshal(testenv.Get(b, proxyURL+"/healthz"), &st) == nil && st.Pending == 0
		}, "%s: the warm-up was never published", kind)
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	errs := make(chan error, agents)
	t0 := time.Now()
	for a := range agents {
		wg.Add(1)
		go func() {
			defer wg.Done()
			base := proxyURL
			if base == "" {
				base = urls[a%servers]
			}
			var answers []string
			for k := range turns {
				r, err := call(ctx, base, apiOf(kind, a), s, a, k, answers)
				if err != nil {
					errs <- fmt.Errorf("%s %s agent %d turn %d: %w", kind, side, a, k, err)
					return
				}
				answers = append(answers, r.Answer)
				mu.Lock()
				run.Requests = append(run.Requests, r)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	run.MakespanMS = float64(time.Since(t0).Microseconds()) / 1000
	close(errs)
	for err := range errs {
		require.NoError(b, err)
	}
	if proxyURL != "" {
		// Since the proxy started: the warm-up is Messages and Responses
		// traffic too.
		run.Exclusive = testenv.Metrics(b, proxyURL+"/metrics")["mcproxy_exclusive_total"]
	}
	sort.Slice(run.Requests, func(i, j int) bool {
		x, y := run.Requests[i], run.Requests[j]
		return x.Agent < y.Agent || (x.Agent == y.Agent && x.Turn < y.Turn)
	})
	return run
}

// BenchmarkAgentAPI runs the three swarms on both sides and writes
// bench/out/agentapi.json ($MCB_BENCH_OUT names another directory).
// MCB_BENCH_QUICK=1 runs them with a shorter shared system prompt.
func BenchmarkAgentAPI(b *testing.B) {
	cfg := modelConfig()
	model := filepath.Join(b.TempDir(), "agentapi.gguf")
	require.NoError(b, gguf.WriteFile(model, cfg))
	system := systemWords
	if os.Getenv("MCB_BENCH_QUICK") != "" {
		system = quickSystemWords
	}
	s := newSwarm(29, system)
	rep := Report{Note: "the three sides measured in one run on the same machine: read them against each other; the load averages say how quiet it was",
		Date: time.Now().UTC().Format(time.RFC3339), LoadStart: testenv.LoadAverage(), Servers: servers, Slots: slots, Agents: agents, Turns: turns, Predict: predict, Words: system,
		Model: fmt.Sprintf("%s: %d layers, n_embd %d, %d KV heads, f16", cfg.Name, cfg.BlockCount, cfg.EmbeddingLength, cfg.HeadCountKV)}
	t0 := time.Now()
	for b.Loop() {
		rep.Rows, rep.Runs = nil, nil
		for _, kind := range []string{"messages", "responses", "mixed"} {
			var runs []Run
			for _, sd := range Sides {
				runs = append(runs, swarmRun(b, model, s, kind, sd))
			}
			rep.Runs = append(rep.Runs, runs...)
			row := Compare(runs[0], runs[1], runs[2])
			rep.Rows = append(rep.Rows, row)
			b.Logf("%-9s makespan uncached %6.0f stock %6.0f proxy %6.0f ms | TTFT p50 uncached %6.0f stock %6.0f proxy %6.0f | slower than uncached %d/%d, than stock %d/%d | exclusive %.0f",
				kind, row.Uncached.MakespanMS, row.Stock.MakespanMS, row.Proxy.MakespanMS, row.Uncached.TTFT.P50, row.Stock.TTFT.P50, row.Proxy.TTFT.P50,
				row.SlowerThanUncached, row.Requests, row.SlowerThanStock, row.Requests, row.Exclusive)
		}
	}
	rep.Seconds, rep.LoadEnd = time.Since(t0).Seconds(), testenv.LoadAverage()
	b.Logf("wrote %s (%.0f s)", testenv.WriteBenchOut(b, "agentapi.json", rep), rep.Seconds)
}
