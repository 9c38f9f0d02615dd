// Package agentapi measures agent swarms that speak the agent APIs,
// Anthropic Messages (Claude Code) and OpenAI Responses (Codex), through
// `mcbridge proxy` in front of stock llama-servers, against the same
// requests sent straight to stock llama-servers, in one run.
//
//	go test -run '^$' -bench AgentAPI -benchtime 1x -timeout 60m ./bench/agentapi
//	bench/report.sh -render-only   # docs/bench/README.md with it, after a full run
//
// Three swarms run on each side: Messages only, Responses only, and both
// mixed (even agents Messages, odd ones Responses). Agents agents, at least
// as many as the servers have slots together, share one system prompt and
// tool schema and each works on a task of its own, turn after turn; a
// turn's conversation holds the earlier turns and the model's answers. All
// requests are streamed through the vendors' SDKs; a request's time to
// first token is the time until its first event (llama-server sends the
// first event with the first token). Each side runs on fresh servers:
//
//   - uncached: stock servers that cache nothing (--no-cache-prompt), the
//     baseline of issue 29's target: every request computes its whole
//     prompt, at the same concurrency;
//   - stock: stock servers as they run by default, nothing cached at the
//     start; a turn reuses what its own slot kept of the turn before (agent
//     a talks to server a mod servers);
//   - proxy: the same servers behind one proxy, as a running swarm (one
//     request of each API the swarm speaks, through the proxy, has computed
//     and published the shared prefix, not measured).
//
// The report pairs every request with its twins of the other sides. It lands in bench/out/agentapi.json, which
// bench/report.sh (which runs this benchmark with the others) renders into
// docs/bench/README.md ("Agent APIs").
package agentapi

import (
	"slices"
	"sort"
)

// Request is one measured request.
type Request struct {
	Agent    int     `json:"agent"`
	Turn     int     `json:"turn"`
	API      string  `json:"api"` // messages or responses
	TTFTMS   float64 `json:"ttft_ms"`
	TotalMS  float64 `json:"total_ms"`
	Restored int     `json:"restored,omitempty"` // the proxy's Mcb-Restored-N
	Answer   string  `json:"answer"`
}

// Run is one swarm on one side.
type Run struct {
	Swarm      string    `json:"swarm"` // messages, responses or mixed
	Side       string    `json:"side"`  // uncached, stock or proxy
	MakespanMS float64   `json:"makespan_ms"`
	Requests   []Request `json:"requests"` // by agent, then turn
	// Exclusive is the proxy's mcproxy_exclusive_total over the run:
	// requests that held every slot of their upstream.
	Exclusive float64 `json:"exclusive,omitempty"`
}

// Percentiles of TTFT, in ms.
type Percentiles struct {
	Min float64 `json:"min"`
	P50 float64 `json:"p50"`
	P90 float64 `json:"p90"`
	Max float64 `json:"max"`
}

func percentiles(xs []float64) Percentiles {
	if len(xs) == 0 {
		return Percentiles{}
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	at := func(q float64) float64 { return s[int(q*float64(len(s)-1)+0.5)] }
	return Percentiles{Min: s[0], P50: at(0.5), P90: at(0.9), Max: s[len(s)-1]}
}

// Side is one side's figures for a swarm.
type Side struct {
	MakespanMS float64     `json:"makespan_ms"`
	TTFT       Percentiles `json:"ttft_ms"`
}

// Row compares one swarm's three sides.
type Row struct {
	Swarm    string `json:"swarm"`
	Uncached Side   `json:"uncached"`
	Stock    Side   `json:"stock"`
	Proxy    Side   `json:"proxy"`
	Requests int    `json:"requests"`
	// SlowerThanUncached counts the proxy's requests slower to their first
	// token than their uncached twin (the same agent and turn): the
	// target's count. SlowerThanStock counts those slower than their stock
	// twin, which reused its own slot's cache.
	SlowerThanUncached int     `json:"slower_than_uncached"`
	SlowerThanStock    int     `json:"slower_than_stock"`
	Exclusive          float64 `json:"exclusive"`
}

func side(run Run) Side {
	var ttft []float64
	for _, q := range run.Requests {
		ttft = append(ttft, q.TTFTMS)
	}
	return Side{MakespanMS: run.MakespanMS, TTFT: percentiles(ttft)}
}

// Compare pairs the requests of one swarm's three runs, which hold the
// same requests in the same order.
func Compare(uncached, stock, proxy Run) Row {
	row := Row{Swarm: proxy.Swarm, Uncached: side(uncached), Stock: side(stock), Proxy: side(proxy),
		Requests: len(proxy.Requests), Exclusive: proxy.Exclusive}
	for i, p := range proxy.Requests {
		if p.TTFTMS > uncached.Requests[i].TTFTMS {
			row.SlowerThanUncached++
		}
		if p.TTFTMS > stock.Requests[i].TTFTMS {
			row.SlowerThanStock++
		}
	}
	return row
}

// Report is what bench/out/agentapi.json holds: one run of every swarm on
// both sides.
type Report struct {
	Note      string  `json:"note"`
	Date      string  `json:"date"`
	LoadStart string  `json:"loadavg_start"`
	LoadEnd   string  `json:"loadavg_end"`
	Model     string  `json:"model"`
	Servers   int     `json:"servers"`
	Slots     int     `json:"slots_per_server"`
	Agents    int     `json:"agents"`
	Turns     int     `json:"turns"`
	Predict   int     `json:"predict"`
	Words     int     `json:"system_words"` // the shared system prompt's length
	Rows      []Row   `json:"rows"`         // messages, responses, mixed
	Runs      []Run   `json:"runs"`         // each swarm's runs, in the order of Sides
	Seconds   float64 `json:"seconds"`
}

// Sides are the sides of a run, in the order they run.
var Sides = []string{"uncached", "stock", "proxy"}

// Swarm is a swarm's runs in the order of Sides; ok is false when the
// report lacks one or they hold different numbers of requests.
func (r *Report) Swarm(swarm string) (runs []Run, ok bool) {
	for _, sd := range Sides {
		i := slices.IndexFunc(r.Runs, func(run Run) bool { return run.Swarm == swarm && run.Side == sd })
		if i < 0 || (len(runs) > 0 && len(r.Runs[i].Requests) != len(runs[0].Requests)) {
			return nil, false
		}
		runs = append(runs, r.Runs[i])
	}
	return runs, true
}
