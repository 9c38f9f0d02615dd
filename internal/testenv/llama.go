package testenv

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// Llama is a llama-server process.
type Llama struct{ *Server }

// StartLlama runs a llama-server (bin) on a free loopback port with args
// and waits until /health answers. env is added to the test's own.
func StartLlama(tb testing.TB, name, bin string, args []string, env ...string) *Llama {
	tb.Helper()
	s := StartServer(tb, name, bin, args, env, func(port int) []string {
		return []string{"--host", "127.0.0.1", "--port", strconv.Itoa(port)}
	}, "/health")
	return &Llama{s}
}

// ServerArgs are the arguments the tests give every llama-server of one
// comparison, so that slots, streams and batches are equal and only the
// bridge differs: the model, a context of ctx cells over slots, 1 thread,
// flash attention fa ("on" or "off"), no prompt cache. One thread, as
// the tests run several servers at once beside other packages' tests on
// few processors: llama.cpp's threads spin between a graph's operations,
// and a server's thread whose sibling lost its processor spins out its
// time slice (TestModels' representatives side by side took 3.6 times the
// processor time with 2 threads a server).
func ServerArgs(model string, ctx, slots int, fa string) []string {
	return serverArgs(model, ctx, slots, fa, 1)
}

// BenchServerArgs is ServerArgs with the 2 threads the benchmarks' model
// was measured with (docs/design.md §15), for benchmarks and the demo,
// which run their servers one comparison at a time.
func BenchServerArgs(model string, ctx, slots int, fa string) []string {
	return serverArgs(model, ctx, slots, fa, 2)
}

func serverArgs(model string, ctx, slots int, fa string, threads int) []string {
	return []string{"-m", model, "-c", strconv.Itoa(ctx), "-np", strconv.Itoa(slots), "-t", strconv.Itoa(threads),
		"-fa", fa, "--no-webui", "--cache-ram", "0", "--metrics"}
}

// Timings is the part of a completion's "timings" the tests read: the
// server's own, numbers only.
type Timings struct {
	CacheN    int     `json:"cache_n"`
	PromptN   int     `json:"prompt_n"`
	PromptMS  float64 `json:"prompt_ms"`
	Predicted int     `json:"predicted_n"`
	// PredictedMS is the decode's time after the first token.
	PredictedMS float64 `json:"predicted_ms"`
	// PredictedPerSecond is the server's decode rate.
	PredictedPerSecond float64 `json:"predicted_per_second"`
	// DraftN and DraftAccepted are the speculative decoding's drafted and
	// accepted tokens (a server with a draft model; 0 when none was drafted).
	DraftN        int `json:"draft_n"`
	DraftAccepted int `json:"draft_n_accepted"`
}

// Outcome is what the bridge did for a prompt: the patched server's
// "mcbridge" object, or, for an answer through the proxy, its
// Mcb-Restored-N, Mcb-Restore-Ms and Mcb-Fallback headers (docs/proxy.md).
type Outcome struct {
	Decision      string  `json:"decision"`
	Reason        string  `json:"reason"`
	MatchedN      int     `json:"matched_n"`
	RestoredN     int     `json:"restored_n"`
	RestoredBytes int64   `json:"restored_bytes"`
	RestoreMS     float64 `json:"restore_ms"`
	LookupMS      float64 `json:"lookup_ms"`
	SavedBlocks   int     `json:"saved_blocks"`
	Snapshots     int     `json:"snapshots"` // partial states snapshotted (sliding-window, hybrid)
	SaveMS        float64 `json:"save_ms"`
	// DraftPrefilledN is what a draft model's context computed of the
	// restored prefix while the target's restore ran, and DraftRestoredN
	// what it restored of its own blocks beside the target's.
	DraftPrefilledN int     `json:"draft_prefilled_n"`
	DraftPrefillMS  float64 `json:"draft_prefill_ms"`
	DraftRestoredN  int     `json:"draft_restored_n"`
	// RestoredSnapshotBytes is, of the restored bytes, the snapshot's.
	RestoredSnapshotBytes int64  `json:"restored_snapshot_bytes"`
	Error                 string `json:"error"`
}

// Completion is a /completion answer.
type Completion struct {
	Content string  `json:"content"`
	Tokens  []int32 `json:"tokens"`
	IDSlot  int     `json:"id_slot"`
	Timings Timings `json:"timings"`
	MCB     Outcome `json:"mcbridge"`
}

// Request is a greedy, seeded completion of a token-id prompt; Extra is
// merged into the JSON.
type Request struct {
	Prompt   []int32
	Slot     int // -1: the server picks
	NPredict int
	Extra    map[string]any
}

// Body is the JSON object a completion request posts.
func (r Request) Body() map[string]any {
	b := map[string]any{"prompt": r.Prompt, "n_predict": r.NPredict, "temperature": 0, "seed": 42,
		"return_tokens": true, "cache_prompt": true, "id_slot": r.Slot}
	for k, v := range r.Extra {
		b[k] = v
	}
	return b
}

// Complete posts a completion to url/completion (a llama-server or a proxy).
func Complete(tb testing.TB, url string, r Request) Completion {
	tb.Helper()
	var c Completion
	c.MCB.fromProxy(tb, PostHeaders(tb, url+"/completion", r.Body(), &c))
	return c
}

// fromProxy reads the proxy's headers, when the answer came through one.
func (o *Outcome) fromProxy(tb testing.TB, h http.Header) {
	tb.Helper()
	n := h.Get("Mcb-Restored-N")
	if n == "" {
		return
	}
	var err error
	o.RestoredN, err = strconv.Atoi(n)
	require.NoError(tb, err, "Mcb-Restored-N: %q", n)
	o.RestoreMS, err = strconv.ParseFloat(h.Get("Mcb-Restore-Ms"), 64)
	require.NoError(tb, err, "Mcb-Restore-Ms: %q", h.Get("Mcb-Restore-Ms"))
	o.Error = h.Get("Mcb-Fallback")
}

// ProxyOutcome is what the proxy's headers say it restored for an answer.
func ProxyOutcome(tb testing.TB, h http.Header) Outcome {
	tb.Helper()
	var o Outcome
	o.fromProxy(tb, h)
	return o
}

// Complete posts a completion to the server.
func (l *Llama) Complete(tb testing.TB, r Request) Completion {
	tb.Helper()
	return Complete(tb, l.URL, r)
}

// BridgeState is "on", or the reason the server logged for leaving the
// bridge off ("" when it logged neither: a stock server).
func (l *Llama) BridgeState() string {
	line := l.LogLine("mcbridge: o")
	switch {
	case strings.Contains(line, "mcbridge: on: "):
		return "on"
	case strings.Contains(line, "mcbridge: off: "):
		_, why, _ := strings.Cut(line, "mcbridge: off: ")
		return why
	}
	return ""
}

// Tokens is n token ids that spell no special token: (i*mul+off) % 256,
// the byte tokens of the generated vocabulary.
func Tokens(n, mul, off int) []int32 {
	t := make([]int32, n)
	for i := range t {
		t[i] = int32((i*mul + off) % 256)
	}
	return t
}

// Cat concatenates token lists.
func Cat(parts ...[]int32) []int32 {
	var out []int32
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// JSON formats v for a failure message.
func JSON(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprint(v)
	}
	return string(b)
}

// LlamaTemplate is a chat template of the pinned llama.cpp tree the stock
// server was built from (its models/templates; scripts/llama/build.sh keeps
// the tree beside the build, as ../src), for tests that need a tool-call
// format: the generated models have no template of their own.
func LlamaTemplate(tb testing.TB, name string) string {
	tb.Helper()
	build := filepath.Dir(filepath.Dir(StockServer(tb)))
	p := filepath.Join(filepath.Dir(build), "src", "models", "templates", name)
	_, err := os.Stat(p)
	require.NoError(tb, err, "a template of the stock server's source tree")
	return p
}

// StockFrom is a stock llama-server's answer (at url) to r when it holds
// the first k tokens of r's prompt and computes the rest: the answer of a
// server that restored (or kept) k tokens must be this one, not the
// answer computed fresh. llama-server on the CPU is not batch-invariant
// (docs/design.md §10.1): the rest, computed in ubatches starting at k,
// can give other bits than the same tokens computed from 0, without any
// restore being wrong. On slot 0, the first k tokens are computed fresh,
// followed by tokens the prompt does not continue with (Primer), so that
// the prompt then reuses exactly k; k 0 is the prompt computed fresh. Each
// request is alone on the server, as the answers compared with it are.
func StockFrom(tb testing.TB, url string, r Request, k int) Completion {
	tb.Helper()
	return StockHolding(tb, url, r, k, k)
}

// StockHolding is StockFrom for a slot given k tokens that keeps cacheN of
// them. Where a model's sliding window covers the whole prefix, llama-server
// computes the last of k again (its check of the window asks for a context
// checkpoint, and its checkpoint of k resumes at k - 1), as a server that
// restored k does.
func StockHolding(tb testing.TB, url string, r Request, k, cacheN int) Completion {
	tb.Helper()
	c := StockGiven(tb, url, r, k)
	if k > 0 {
		require.Equal(tb, cacheN, c.Timings.CacheN, "the stock slot given the prompt's first %d tokens kept %d", k, cacheN)
	}
	return c
}

// StockGiven is a stock llama-server's answer to r on a slot given the
// first k tokens of r's prompt, keeping what it keeps of them (its
// Timings.CacheN).
func StockGiven(tb testing.TB, url string, r Request, k int) Completion {
	tb.Helper()
	fresh := map[string]any{"cache_prompt": false}
	for key, v := range r.Extra {
		if _, ok := fresh[key]; !ok {
			fresh[key] = v
		}
	}
	r.Slot = 0
	if k == 0 {
		r.Extra = fresh
		return Complete(tb, url, r)
	}
	Prime(tb, url, r.Prompt, k, fresh)
	return Complete(tb, url, r)
}

// Prime has slot 0 of the stock server at url compute the Primer of
// prompt's first k tokens fresh (extra: the request's own fields and
// cache_prompt false), so that the prompt on slot 0 reuses exactly k.
func Prime(tb testing.TB, url string, prompt []int32, k int, extra map[string]any) {
	tb.Helper()
	Complete(tb, url, Request{Prompt: Primer(tb, prompt, k), Slot: 0, NPredict: 1, Extra: extra})
}

// Primer is the first k tokens of prompt and then primerTail times one of
// them that the prompt does not continue with: a slot that computed it
// shares exactly k tokens with the prompt.
func Primer(tb testing.TB, prompt []int32, k int) []int32 {
	tb.Helper()
	require.Less(tb, k, len(prompt))
	other := slices.IndexFunc(prompt[:k], func(x int32) bool { return x != prompt[k] })
	require.GreaterOrEqual(tb, other, 0, "a token of the prefix that the prompt does not continue with")
	out := slices.Clip(prompt[:k])
	for range primerTail {
		out = append(out, prompt[other])
	}
	return out
}

// primerTail is how many tokens a primer adds after the shared ones. A
// memory that cannot roll back (a sliding window, a recurrent state) goes
// back to k only through a context checkpoint, and llama-server takes one 4
// tokens before a prompt's end (checkpoint_offsets in server-context.cpp):
// with 4 tokens after the shared k, stock holds its own state at k.
const primerTail = 4
