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
		if _, ok := r.Swarm(row.Swarm); !ok {
			return nil, fmt.Errorf("%s: swarm %q lacks one of the runs %v of the same requests", path, row.Swarm, agentapi.Sides)
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
		slowerN += row.SlowerThanUncached
		slower = append(slower, fmt.Sprintf("%s %d of %d", row.Swarm, row.SlowerThanUncached, row.Requests))
		if row.Proxy.MakespanMS >= row.Stock.MakespanMS {
			longer++
		}
		cut = append(cut, fmt.Sprintf("%s %s → %s", row.Swarm, secs(row.Stock.MakespanMS), secs(row.Proxy.MakespanMS)))
		excl += row.Exclusive
		exclusive = append(exclusive, fmt.Sprintf("%s %s", row.Swarm, num(row.Exclusive, 0)))
	}
	return [][4]string{
		{"every request's TTFT", "no request slower than on stock with nothing cached (`--no-cache-prompt`), same concurrency",
			"slower than its uncached twin: " + strings.Join(slower, ", "), judge(slowerN == 0)},
		{"swarm makespan", "cut by the shared prefix (against stock with its prompt cache)", strings.Join(cut, ", "), judge(longer == 0)},
		{"requests holding every slot", "`mcproxy_exclusive_total` 0 for Messages and Responses",
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
	m.p("Swarms of %d agents of %d turns each, streamed through the vendors' SDKs (anthropic-sdk-go for Messages, openai-go for Responses): Messages only, Responses only, and mixed (even agents Messages, odd ones Responses). The agents share a system prompt of %d words and three tools; each has a task of its own, and a turn sends the conversation so far (answers of %d greedy tokens). Each swarm runs three times on %d fresh llama-servers of %d slots each: **uncached**, stock servers that cache no prompt (`--no-cache-prompt`), every request computing its whole prompt; **stock**, stock servers as they run by default, nothing cached at the start, a turn reusing what its own slot kept of the turn before (agent a to server a mod %d in both); **proxy**, the servers behind one `mcbridge proxy`, after one unmeasured request of each API the swarm speaks published the shared prefix. Model %s. One run of %.0f s, measured on %s.\n",
		a.Agents, a.Turns, a.Words, a.Predict, a.Servers, a.Slots, a.Servers, a.Model, a.Seconds, a.Date)
	m.p("> %s. Load average %s at the start, %s at the end.\n", upperFirst(a.Note), a.LoadStart, a.LoadEnd)
	var rows [][]string
	for _, row := range a.Rows {
		rows = append(rows, []string{row.Swarm, fmt.Sprint(row.Requests),
			secs(row.Uncached.MakespanMS), secs(row.Stock.MakespanMS), secs(row.Proxy.MakespanMS),
			secs(row.Uncached.TTFT.P50), secs(row.Stock.TTFT.P50), secs(row.Proxy.TTFT.P50),
			secs(row.Uncached.TTFT.Max), secs(row.Stock.TTFT.Max), secs(row.Proxy.TTFT.Max),
			fmt.Sprintf("%d of %d", row.SlowerThanUncached, row.Requests), fmt.Sprintf("%d of %d", row.SlowerThanStock, row.Requests), num(row.Exclusive, 0)})
	}
	m.table([]string{"swarm", "requests", "makespan uncached", "stock", "proxy", "TTFT p50 uncached", "stock", "proxy",
		"TTFT max uncached", "stock", "proxy", "proxy slower than uncached", "than stock", "`mcproxy_exclusive_total`"}, rows)

	// Every request's TTFT: a row per agent and turn, a column per side
	// and swarm.
	head := []string{"agent", "turn"}
	var swarms [][]agentapi.Run
	for _, row := range a.Rows {
		runs, _ := a.Swarm(row.Swarm)
		swarms = append(swarms, runs)
		head = append(head, row.Swarm+" uncached", "stock", "proxy (restored tokens)")
	}
	rows = nil
	for i, q := range swarms[0][0].Requests {
		cells := []string{fmt.Sprint(q.Agent), fmt.Sprint(q.Turn)}
		for _, runs := range swarms {
			if i >= len(runs[0].Requests) {
				cells = append(cells, "", "", "")
				continue
			}
			u, s, x := runs[0].Requests[i], runs[1].Requests[i], runs[2].Requests[i]
			proxy := fmt.Sprintf("%s (%d)", secs(x.TTFTMS), x.Restored)
			switch {
			case x.TTFTMS > u.TTFTMS:
				proxy = "**" + proxy + "**"
			case x.TTFTMS > s.TTFTMS:
				proxy = "_" + proxy + "_"
			}
			cells = append(cells, fmt.Sprintf("%s %s", secs(u.TTFTMS), u.API[:1]), secs(s.TTFTMS), proxy)
		}
		rows = append(rows, cells)
	}
	m.p("Every request's time to first token (its first streamed event); m: Messages, r: Responses. In bold, a proxy request slower than its uncached twin; in italics, one slower than its stock twin only.\n")
	m.table(head, rows)
	var trows [][]string
	for _, t := range agentTargets(a) {
		trows = append(trows, t[:])
	}
	m.table([]string{"issue 29's target", "", "measured", "verdict"}, trows)
}
