package main

import (
	"fmt"
	"strings"

	"github.com/mcbridge/mcbridge/bench/agentapi"
)

// The agent-API benchmark (bench/agentapi, run with the others or on its
// own) leaves bench/out/agentapi.json; the report renders its rows, every
// request's time to first token on both sides, and issue 29's targets.

// readAgentAPI reads bench/out/agentapi.json; nil without error when
// absent.
func readAgentAPI(path string) (*agentapi.Report, error) {
	r, err := readResults[agentapi.Report](path)
	if r == nil || err != nil {
		return nil, err
	}
	if len(r.Rows) == 0 {
		return nil, fmt.Errorf("%s: no rows", path)
	}
	for _, row := range r.Rows {
		if _, _, ok := r.Pair(row.Swarm); !ok {
			return nil, fmt.Errorf("%s: swarm %q lacks a stock or a proxy run of the same requests", path, row.Swarm)
		}
	}
	return r, nil
}

func secs(ms float64) string { return num(ms/1000, 1) + " s" }

// agentTargets are issue 29's targets, judged over every swarm of the run:
// what, target, measured, verdict.
func agentTargets(a *agentapi.Report) [][4]string {
	var slower, cut, exclusive []string
	slowerN, longer, excl := 0, 0, 0.0
	for _, row := range a.Rows {
		slowerN += row.SlowerThanStock
		slower = append(slower, fmt.Sprintf("%s %d of %d", row.Swarm, row.SlowerThanStock, row.Requests))
		if row.ProxyMakespanMS >= row.StockMakespanMS {
			longer++
		}
		cut = append(cut, fmt.Sprintf("%s %s → %s", row.Swarm, secs(row.StockMakespanMS), secs(row.ProxyMakespanMS)))
		excl += row.Exclusive
		exclusive = append(exclusive, fmt.Sprintf("%s %s", row.Swarm, num(row.Exclusive, 0)))
	}
	return [][4]string{
		{"agent APIs through the proxy: every request's TTFT", "no request slower than its stock twin (nothing cached, same concurrency)",
			"slower: " + strings.Join(slower, ", "), judge(slowerN == 0)},
		{"agent APIs through the proxy: swarm makespan", "cut by the shared prefix", strings.Join(cut, ", "), judge(longer == 0)},
		{"agent APIs through the proxy: requests holding every slot", "`mcproxy_exclusive_total` 0 for Messages and Responses",
			strings.Join(exclusive, ", "), judge(excl == 0)},
	}
}

func (r *report) writeAgentAPI(m *md) {
	m.p("## Agent APIs (bench/agentapi)\n")
	switch {
	case r.AgentAPIErr != "":
		m.p("`bench/out/agentapi.json` could not be read: %s\n", r.AgentAPIErr)
		return
	case r.AgentAPI == nil:
		m.p("Not run: `go test -run '^$' -bench AgentAPI -benchtime 1x ./bench/agentapi` runs the agent swarms and leaves `bench/out/agentapi.json`, which was absent.\n")
		return
	}
	a := r.AgentAPI
	m.p("Swarms of %d agents of %d turns each, streamed through the vendors' SDKs (anthropic-sdk-go for Messages, openai-go for Responses): Messages only, Responses only, and mixed (even agents Messages, odd ones Responses). The agents share a system prompt of %d words and three tools; each has a task of its own, and a turn sends the conversation so far (answers of %d greedy tokens). Stock: the requests straight to %d stock llama-servers of %d slots each (agent a to server a mod %d), nothing cached at the start. Proxy: the same requests through one `mcbridge proxy` in front of %d fresh servers, after one unmeasured request of each API the swarm speaks published the shared prefix. Model %s. One run of %.0f s, measured on %s.\n",
		a.Agents, a.Turns, a.Words, a.Predict, a.Servers, a.Slots, a.Servers, a.Servers, a.Model, a.Seconds, a.Date)
	m.p("> %s. Load average %s at the start, %s at the end.\n", upperFirst(a.Note), a.LoadStart, a.LoadEnd)
	var rows [][]string
	for _, row := range a.Rows {
		rows = append(rows, []string{row.Swarm, fmt.Sprint(row.Requests), secs(row.StockMakespanMS), secs(row.ProxyMakespanMS),
			secs(row.StockTTFT.P50), secs(row.ProxyTTFT.P50), secs(row.StockTTFT.Max), secs(row.ProxyTTFT.Max),
			fmt.Sprintf("%d of %d", row.SlowerThanStock, row.Requests), fmt.Sprintf("%d of %d", row.SameAnswers, row.Requests),
			num(row.Exclusive, 0)})
	}
	m.table([]string{"swarm", "requests", "makespan stock", "makespan proxy", "TTFT p50 stock", "TTFT p50 proxy", "TTFT max stock",
		"TTFT max proxy", "proxy slower than its stock twin", "answers as stock", "`mcproxy_exclusive_total`"}, rows)

	// Every request's TTFT: a row per agent and turn, a stock and a proxy
	// column per swarm.
	head := []string{"agent", "turn"}
	var pairs [][2]agentapi.Run
	for _, row := range a.Rows {
		stock, proxy, _ := a.Pair(row.Swarm)
		pairs = append(pairs, [2]agentapi.Run{stock, proxy})
		head = append(head, row.Swarm+" stock", row.Swarm+" proxy (restored tokens)")
	}
	rows = nil
	for i, q := range pairs[0][0].Requests {
		cells := []string{fmt.Sprint(q.Agent), fmt.Sprint(q.Turn)}
		for _, p := range pairs {
			if i >= len(p[0].Requests) {
				cells = append(cells, "", "")
				continue
			}
			s, x := p[0].Requests[i], p[1].Requests[i]
			proxy := fmt.Sprintf("%s (%d)", secs(x.TTFTMS), x.Restored)
			if x.TTFTMS > s.TTFTMS {
				proxy = "**" + proxy + "**"
			}
			cells = append(cells, fmt.Sprintf("%s %s", secs(s.TTFTMS), s.API[:1]), proxy)
		}
		rows = append(rows, cells)
	}
	m.p("Every request's time to first token (its first streamed event); m: Messages, r: Responses. In bold, a proxy request slower than its stock twin.\n")
	m.table(head, rows)
	var trows [][]string
	for _, t := range agentTargets(a) {
		trows = append(trows, t[:])
	}
	m.table([]string{"target (issue 29)", "", "measured", "verdict"}, trows)
}
