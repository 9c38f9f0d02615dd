//go:build demo

// Package demo is the swarm demo, `make demo`. Agents share a long prefix
// ("system prompt + tools", 4096 tokens by default) and each adds its own
// task; their requests go round-robin to three patched llama-servers that
// share KV through mcbridge: a store node (`mcbridge serve --embed-etcd`,
// the directory and a DRAM pool) and the mock Mooncake Transfer Engine
// between the processes. Only the first agent computes the prefix; the
// others restore it, whichever server they land on.
//
// For every request the table shows the tokens restored, the time to first
// token with mcbridge and without it (the same request on a stock
// llama-server that has nothing cached), and whether the greedy completion
// is the stock server's from as many cached tokens (testenv.StockFrom:
// llama-server on the CPU is not batch-invariant, so only an answer from
// the same cache state must be the same tokens). The test fails when any
// output differs, or when a server's first request after agent 1's
// restored nothing.
//
// It is a test behind the build tag "demo", so that it can use testenv and
// `go test ./...` leaves it out:
//
//	. build/e2e.env && go test -tags demo -count=1 -v -run '^TestSwarmDemo$' ./demo/
//
// The knobs, from the environment:
//
//	DEMO_AGENTS   requests (default 6)
//	DEMO_PREFIX   shared prefix tokens (default 4096)
//	DEMO_SUFFIX   tokens of the first agent's own task (default 64; each next agent +8)
//	DEMO_THREADS  llama-server -t (default 2)
//	DEMO_PREDICT  tokens generated per request (default 16)
package demo

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/testenv"
	"github.com/mcbridge/mcbridge/internal/transport/mooncake/mocklib"
)

const servers = 3

// knob reads a whole-number environment variable of at least least, or def
// when it is unset.
func knob(t *testing.T, name string, def, least int) int {
	t.Helper()
	s, ok := os.LookupEnv(name)
	if !ok || s == "" {
		return def
	}
	n, err := strconv.Atoi(s)
	require.NoError(t, err, "%s=%q: want a whole number", name, s)
	require.GreaterOrEqual(t, n, least, "%s=%d: want at least %d", name, n, least)
	return n
}

// row is one agent's request, with mcbridge and without.
type row struct {
	agent    int
	server   string
	prompt   int
	with     testenv.Completion
	without  testenv.Completion
	asStock  testenv.Completion // stock's from as many cached tokens as with
	sameToks bool
}

func TestSwarmDemo(t *testing.T) {
	agents := knob(t, "DEMO_AGENTS", 6, 1)
	prefixN := knob(t, "DEMO_PREFIX", 4096, 1)
	suffixN := knob(t, "DEMO_SUFFIX", 64, 0)
	threads := knob(t, "DEMO_THREADS", 2, 1)
	nPredict := knob(t, "DEMO_PREDICT", 16, 1)
	start := time.Now()

	mockTE, cleanup, err := mocklib.Find()
	require.NoError(t, err, "the mock Transfer Engine")
	t.Cleanup(cleanup)
	t.Cleanup(testenv.Cleanup)
	patched, stock := testenv.PatchedServer(t), testenv.StockServer(t)
	model := testenv.Model(t, "bench", 0)

	transport := map[string]any{"kind": "mooncake", "lib": mockTE}
	etcdURL := "http://127.0.0.1:" + strconv.Itoa(testenv.FreePort(t))
	store := testenv.StartStore(t, "store", testenv.JSON(map[string]any{"transport": transport}),
		"--embed-etcd", "--etcd-dir", filepath.Join(t.TempDir(), "etcd"), "--etcd-client-url", etcdURL)
	t.Logf("store node pid %d on %s, etcd %s", store.Pid(), store.URL, etcdURL)

	ctx := prefixN + suffixN + 8*agents + nPredict + 256
	// -fa auto is on for the CPU backend. DEMO_THREADS takes the place of
	// ServerArgs' -t 2: llama-server warns about a repeated -t.
	args := testenv.BenchServerArgs(model, ctx, 1, "auto")
	args[slices.Index(args, "-t")+1] = strconv.Itoa(threads)
	bridgeCfg := testenv.JSON(map[string]any{
		"directory": map[string]any{"kind": "etcd", "endpoints": []string{etcdURL}},
		"transport": transport,
	})
	swarm := make([]*testenv.Llama, servers)
	for i := range swarm {
		name := fmt.Sprintf("s%d", i+1)
		swarm[i] = testenv.StartLlama(t, name, patched, append(slices.Clone(args), "--mcb-config", bridgeCfg))
		require.Equal(t, "on", swarm[i].BridgeState(), "server %s: the bridge is off", name)
	}
	ref := testenv.StartLlama(t, "stock", stock, args)

	prefix := testenv.Tokens(prefixN, 7, 3)
	rows := make([]row, 0, agents)
	for a := 1; a <= agents; a++ {
		srv := swarm[(a-1)%servers]
		prompt := testenv.Cat(prefix, testenv.Tokens(suffixN+8*(a-1), 11+2*a, a))
		t.Logf("agent %d -> %s: %d prompt tokens", a, srv.Name, len(prompt))
		r := row{agent: a, server: srv.Name, prompt: len(prompt)}
		req := testenv.Request{Prompt: prompt, Slot: 0, NPredict: nPredict}
		r.with = srv.Complete(t, req)
		// Without mcbridge: the same request where nothing of it is cached.
		r.without = testenv.StockFrom(t, ref.URL, req, 0)
		r.asStock = r.without
		if k := r.with.Timings.CacheN; k > 0 {
			r.asStock = testenv.StockFrom(t, ref.URL, req, k)
		}
		r.sameToks = slices.Equal(r.with.Tokens, r.asStock.Tokens)
		rows = append(rows, r)
	}

	var total float64
	for _, s := range swarm {
		total += testenv.Metrics(t, s.URL+"/metrics")["mcbridge_restored_tokens_total"]
	}
	var state struct {
		Blocks    int   `json:"blocks"`
		Bytes     int64 `json:"bytes"`
		PoolBytes int64 `json:"pool_bytes"`
	}
	require.NoError(t, json.Unmarshal(testenv.Get(t, store.URL+"/state"), &state), "the store node's /state")

	fmt.Printf("\nmcbridge swarm demo: %d agents, %d shared tokens, bench model, %d llama-servers + a store node (etcd directory, mock Mooncake TE)\n",
		agents, prefixN, servers)
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "agent\tserver\tprompt\trestored\tcached\tdecision\tTTFT with (ms)\tTTFT without (ms)\tspeedup\tsame output")
	for _, r := range rows {
		w, o, mcb := r.with.Timings, r.without.Timings, r.with.MCB
		decision := mcb.Decision
		if decision == "local" {
			decision += " (own slot)"
		}
		same := "yes"
		if !r.sameToks {
			same = "NO"
		}
		fmt.Fprintf(tw, "%d\t%s\t%d\t%d\t%d\t%s\t%.0f\t%.0f\t%.1fx\t%s\n", r.agent, r.server, r.prompt, mcb.RestoredN, w.CacheN,
			decision, math.Floor(w.PromptMS), math.Floor(o.PromptMS), o.PromptMS/w.PromptMS, same)
	}
	require.NoError(t, tw.Flush())
	fmt.Printf("\nrestored across the swarm: %.0f tokens; TTFT is the server's prompt time (prompt start to first token).\n", total)
	fmt.Printf("store node: %d blocks, %d bytes of a %d-byte pool\n", state.Blocks, state.Bytes, state.PoolBytes)
	t.Logf("demo done in %s", time.Since(start).Round(time.Second))

	for _, r := range rows {
		assert.True(t, r.sameToks, "agent %d on %s gave other tokens with mcbridge than stock from %d cached tokens: %v, stock %v",
			r.agent, r.server, r.with.Timings.CacheN, r.with.Tokens, r.asStock.Tokens)
		// A server's first request finds nothing in its own slot: after
		// agent 1, the shared prefix can only come from the swarm.
		if r.agent > 1 && r.agent <= servers {
			assert.Positive(t, r.with.MCB.RestoredN, "agent %d, %s's first request, restored nothing of the shared prefix: %+v",
				r.agent, r.server, r.with.MCB)
		}
	}
}
