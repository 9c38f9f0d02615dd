package route

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/gguf"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// policies are compared in this order, each on fresh servers;
// MCB_ROUTE_POLICIES (comma-separated) runs others, a policy twice for one.
func policies() []string {
	if v := os.Getenv("MCB_ROUTE_POLICIES"); v != "" {
		return strings.Split(v, ",")
	}
	return []string{"cache-aware", "round-robin", "least-loaded"}
}

// upstreams is how many stock servers sit behind the proxy.
const upstreams = 3

// modelConfig is the bench model's shape with 4 layers instead of 12:
// the same KV per layer and prefill per layer, a third of the time, so that
// three servers and three policies fit a loaded two-core machine.
func modelConfig() gguf.Config {
	c := gguf.Presets["bench"]
	c.Name, c.BlockCount, c.ContextLength = "mcbridge-route", 4, 8192
	return c
}

// BenchmarkRoute replays the workload through three stock servers behind
// the proxy under each policy and writes bench/out/route.json ($MCB_BENCH_OUT
// names another directory). MCB_BENCH_QUICK=1 replays a smaller swarm.
func BenchmarkRoute(b *testing.B) {
	w := DefaultWorkload
	if os.Getenv("MCB_BENCH_QUICK") != "" {
		w.Agents, w.Turns, w.SharedTokens = 3, 2, 512
	}
	cfg := modelConfig()
	model := filepath.Join(b.TempDir(), "route.gguf")
	require.NoError(b, gguf.WriteFile(model, cfg))
	swarm := Generate(w)
	rep := Report{Note: "the policies measured in one run on the same machine: read them against each other; the load averages at the start and the end say how quiet it was",
		Date: time.Now().UTC().Format(time.RFC3339), LoadStart: testenv.LoadAverage(), Workload: w, Upstreams: upstreams, Slots: 2,
		Model: fmt.Sprintf("%s: %d layers, n_embd %d, %d KV heads, f16", cfg.Name, cfg.BlockCount, cfg.EmbeddingLength, cfg.HeadCountKV)}
	t0 := time.Now()
	for b.Loop() {
		rep.Results = rep.Results[:0]
		for _, pol := range policies() {
			rep.Results = append(rep.Results, replay(b, model, swarm, w, pol))
		}
	}
	rep.Seconds, rep.LoadEnd = time.Since(t0).Seconds(), testenv.LoadAverage()
	rep.Differing = differing(rep.Results)
	rep.OutputsIdentical = len(rep.Differing) == 0
	if !rep.OutputsIdentical {
		b.Logf("answers that differ from %s's for the same prompt: %v", rep.Results[0].Policy, rep.Differing)
	}
	for _, r := range rep.Results {
		b.ReportMetric(r.TTFT.Mean, r.Policy+"-ttft-mean-ms")
		b.ReportMetric(r.PrefixHitRatio, r.Policy+"-hit-ratio")
	}
	b.Logf("wrote %s (%.0f s)", testenv.WriteBenchOut(b, "route.json", rep), rep.Seconds)
}

// replay runs the swarm through fresh servers and a fresh proxy routing by
// policy.
func replay(b *testing.B, model string, swarm Swarm, w Workload, policy string) Result {
	b.Helper()
	t0 := time.Now()
	args := []string{"proxy", "--route", policy, "--config", `{"pool_bytes": 1073741824}`}
	var servers []*testenv.Llama
	for i := range upstreams {
		dir := testenv.ShmSlotDir(b, "route-"+strconv.Itoa(i))
		s := testenv.StartLlama(b, fmt.Sprintf("%s-u%d", policy, i), testenv.StockServer(b),
			append(testenv.BenchServerArgs(model, 8192, 2, "on"), "--slot-save-path", dir))
		servers = append(servers, s)
		args = append(args, "--upstream", s.URL+",slots="+dir)
	}
	px := testenv.StartServer(b, policy+"-proxy", testenv.Mcbridge(b), args, nil, func(port int) []string {
		return []string{"--listen", "127.0.0.1:" + strconv.Itoa(port)}
	}, "/healthz")
	// The swarm has been running: one request computed the shared prefix
	// and it is published (not measured).
	warm := append(append([]int32(nil), swarm.Shared...), 300, 301, 302, 303)
	_, err := stream(px.URL, warm, 1)
	require.NoError(b, err)
	testenv.Eventually(b, 5*time.Minute, func() bool {
		var st struct {
			Pending int `json:"pending"`
		}
		return json.Unmarshal(testenv.Get(b, px.URL+"/healthz"), &st) == nil && st.Pending == 0
	}, "%s: the warm-up was never published", policy)
	before := testenv.Metrics(b, px.URL+"/metrics")

	res := Result{Policy: policy, PerUpstream: make([]int, upstreams), Decisions: map[string]int64{}}
	var mu sync.Mutex
	var wg sync.WaitGroup
	errs := make(chan error, len(swarm.Agents))
	for a := range swarm.Agents {
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(time.Duration(a) * w.Stagger)
			var answers [][]int32
			for k := range w.Turns {
				r, err := stream(px.URL, swarm.Prompt(a, k, answers), w.Predict)
				if err != nil {
					errs <- fmt.Errorf("agent %d turn %d: %w", a, k, err)
					return
				}
				r.Agent, r.Turn = a, k
				answers = append(answers, r.Answer)
				mu.Lock()
				res.Trace = append(res.Trace, r)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(b, err)
	}
	after := testenv.Metrics(b, px.URL+"/metrics")
	delta := func(name string) int64 { return int64(after[name] - before[name]) }
	res.RestoredBytes = delta("mcbridge_restored_bytes_total")
	res.SavedBytes = delta("mcproxy_saved_bytes_total")
	res.BytesMoved = res.RestoredBytes + res.SavedBytes
	for k := range after {
		if r, ok := strings.CutPrefix(k, `mcproxy_route_decisions_total{reason="`); ok {
			if n := delta(k); n > 0 {
				res.Decisions[strings.TrimSuffix(r, `"}`)] = n
			}
		}
	}
	sort.Slice(res.Trace, func(i, j int) bool {
		return res.Trace[i].Agent < res.Trace[j].Agent || (res.Trace[i].Agent == res.Trace[j].Agent && res.Trace[i].Turn < res.Trace[j].Turn)
	})
	var ttft []float64
	for _, r := range res.Trace {
		res.Requests++
		res.PromptTokens += r.Prompt
		res.CachedTokens += r.CacheN
		res.RestoredTokens += r.Restored
		if r.Upstream >= 0 && r.Upstream < upstreams {
			res.PerUpstream[r.Upstream]++
		}
		ttft = append(ttft, r.TTFTMS)
	}
	res.PrefixHitRatio = float64(res.CachedTokens) / float64(res.PromptTokens)
	res.LocalHitRatio = float64(res.CachedTokens-res.RestoredTokens) / float64(res.PromptTokens)
	res.TTFT = percentiles(ttft)
	px.Stop()
	for _, s := range servers {
		s.Stop()
	}
	res.Seconds = time.Since(t0).Seconds()
	b.Logf("%s: hit %.3f (local %.3f), TTFT mean %.0f ms p90 %.0f ms, moved %d MiB, per upstream %v, %v",
		policy, res.PrefixHitRatio, res.LocalHitRatio, res.TTFT.Mean, res.TTFT.P90, res.BytesMoved>>20, res.PerUpstream, res.Decisions)
	return res
}

func percentiles(xs []float64) Percentiles {
	if len(xs) == 0 {
		return Percentiles{}
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	sum := 0.0
	for _, x := range s {
		sum += x
	}
	at := func(q float64) float64 { return s[min(len(s)-1, int(q*float64(len(s))))] }
	return Percentiles{Mean: sum / float64(len(s)), P50: at(0.5), P90: at(0.9)}
}

// stream sends one completion of token ids through openai-go's
// Completions API, as a client of the OpenAI-compatible endpoint would,
// and reads the answer's token ids and cache count from the fields
// llama-server adds to it ("verbose": each event's __verbose holds its
// tokens; the last event's timings its cache_n).
func stream(url string, prompt []int32, predict int) (Request, error) {
	ids := make([]int64, len(prompt))
	for i, t := range prompt {
		ids[i] = int64(t)
	}
	var header http.Header
	cl := openai.NewClient(option.WithBaseURL(url+"/v1/"), option.WithAPIKey("none"), option.WithMaxRetries(0),
		option.WithHTTPClient(testenv.Client),
		option.WithMiddleware(func(req *http.Request, next option.MiddlewareNext) (*http.Response, error) {
			resp, err := next(req)
			if err == nil {
				header = resp.Header
			}
			return resp, err
		}),
		option.WithJSONSet("cache_prompt", true), option.WithJSONSet("verbose", true))
	t0 := time.Now()
	st := cl.Completions.NewStreaming(context.Background(), openai.CompletionNewParams{Model: "route",
		Prompt:    openai.CompletionNewParamsPromptUnion{OfArrayOfTokens: ids},
		MaxTokens: openai.Int(int64(predict)), Temperature: openai.Float(0), Seed: openai.Int(42)})
	r := Request{Prompt: len(prompt), Upstream: -1}
	for st.Next() {
		c := st.Current()
		if header != nil && r.Upstream < 0 {
			r.Upstream, _ = strconv.Atoi(header.Get("Mcb-Upstream"))
			r.Restored, _ = strconv.Atoi(header.Get("Mcb-Restored-N"))
		}
		var v struct {
			Tokens []int32 `json:"tokens"`
		}
		if f, ok := c.JSON.ExtraFields["__verbose"]; ok {
			if err := json.Unmarshal([]byte(f.Raw()), &v); err != nil {
				return Request{}, err
			}
		}
		if len(v.Tokens) > 0 && r.TTFTMS == 0 {
			r.TTFTMS = float64(time.Since(t0).Microseconds()) / 1000
		}
		r.Answer = append(r.Answer, v.Tokens...)
		var tm struct {
			CacheN int `json:"cache_n"`
		}
		if f, ok := c.JSON.ExtraFields["timings"]; ok && json.Unmarshal([]byte(f.Raw()), &tm) == nil {
			r.CacheN = tm.CacheN
		}
	}
	return r, st.Err()
}

// differing lists, per policy after the first, the requests whose prompt
// was the first policy's and whose answer was not, and whether a restore
// is in either's history (the agent's turns up to it). Once an answer
// differs the agent's later prompts differ too, and are not listed.
func differing(rs []Result) map[string][]string {
	out := map[string][]string{}
	for i, r := range rs[1:] {
		name := fmt.Sprintf("%d:%s", i+1, r.Policy)
		for j, q := range r.Trace {
			if j >= len(rs[0].Trace) {
				break
			}
			p := rs[0].Trace[j]
			if p.Prompt == q.Prompt && p.Agent == q.Agent && p.Turn == q.Turn && samePrompt(rs[0].Trace, r.Trace, j) && !equal(p.Answer, q.Answer) {
				how := "no restore in either history"
				if restoredBefore(rs[0].Trace, j) || restoredBefore(r.Trace, j) {
					how = "a restore in its history"
				}
				out[name] = append(out[name], fmt.Sprintf("agent %d turn %d (%s)", q.Agent, q.Turn, how))
			}
		}
	}
	return out
}

// restoredBefore: a turn of request j's agent up to j restored.
func restoredBefore(t []Request, j int) bool {
	for k := 0; k <= j; k++ {
		if t[k].Agent == t[j].Agent && t[k].Restored > 0 {
			return true
		}
	}
	return false
}

// samePrompt: every earlier turn of the agent got the same answer in both
// runs, so that turn j's prompt is the same.
func samePrompt(a, b []Request, j int) bool {
	for k := 0; k < j; k++ {
		if a[k].Agent == a[j].Agent && !equal(a[k].Answer, b[k].Answer) {
			return false
		}
	}
	return true
}

func equal(a, b []int32) bool {
	if len(a) != len(b) || len(a) == 0 {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
