package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"

	"github.com/mcbridge/mcbridge/bench/route"
)

// The routing benchmark (bench/route, run on its own by bench/route/run.sh)
// leaves bench/out/route.json; the report renders it as a section and a
// plot of TTFT per policy.

const routePlot = "route_ttft.svg"

// readResults reads a benchmark's JSON results; nil without error when the
// file is absent (the benchmark did not run).
func readResults[T any](path string) (*T, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var v T
	if err := json.Unmarshal(b, &v); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &v, nil
}

// readRoute reads bench/out/route.json; nil without error when absent.
func readRoute(path string) (*route.Report, error) {
	r, err := readResults[route.Report](path)
	if r != nil && len(r.Results) == 0 {
		return nil, fmt.Errorf("%s: no results", path)
	}
	return r, err
}

func mib(b int64) string { return num(float64(b)/(1<<20), 1) }

func (r *report) writeRoute(m *md) {
	m.p("## Routing (bench/route)\n")
	switch {
	case r.RouteErr != "":
		m.p("`bench/out/route.json` could not be read: %s\n", r.RouteErr)
		return
	case r.Route == nil:
		m.p("Not run: `bench/route/run.sh` replays the agent-swarm workload and leaves `bench/out/route.json`, which was absent.\n")
		return
	}
	rt := r.Route
	w := rt.Workload
	m.p("%d agents (seed %d) share a system prompt and tool schema of %d tokens; each runs %d turns of its own conversation (a task of %d tokens, then per turn a user message of %d tokens after its history, answers of %d greedy tokens), the agents %v apart and concurrent. They go through one `mcbridge proxy` in front of %d stock llama-servers (%d slots each, model %s), once per routing policy, each on fresh servers, in one run of %.0f s (%s). Measured by `bench/route/run.sh` on %s.\n",
		w.Agents, w.Seed, w.SharedTokens, w.Turns, w.TaskTokens, w.UserTokens, w.Predict, w.Stagger, rt.Upstreams, rt.Slots, rt.Model,
		rt.Seconds, identical(rt.OutputsIdentical), rt.Date)
	m.p("> %s. Load average %s at the start, %s at the end.\n", upperFirst(rt.Note), rt.LoadStart, rt.LoadEnd)
	var rows [][]string
	for _, p := range rt.Results {
		var decisions []string
		for k, v := range p.Decisions {
			decisions = append(decisions, fmt.Sprintf("%s %d", k, v))
		}
		sort.Strings(decisions)
		rows = append(rows, []string{p.Policy, fmt.Sprint(p.Requests), num(p.PrefixHitRatio, 3), num(p.LocalHitRatio, 3),
			num(p.TTFT.Mean, 0), num(p.TTFT.P50, 0), num(p.TTFT.P90, 0), mib(p.RestoredBytes), mib(p.SavedBytes), mib(p.BytesMoved),
			strings.Trim(fmt.Sprint(p.PerUpstream), "[]"), strings.Join(decisions, ", ")})
	}
	m.table([]string{"policy", "requests", "prefix hit ratio", "held in the slot", "mean TTFT, ms", "p50", "p90",
		"restored, MiB", "saved, MiB", "bytes moved, MiB", "per upstream", "decisions"}, rows)
	m.p("The prefix hit ratio is the share of prompt tokens the servers did not compute (their `cache_n`): held by the slot the request ran in, or restored into it from the bridge; \"held in the slot\" is the first part alone, where no byte moved. Bytes moved are the KV restored into slots plus the slot files saved to publish new blocks. TTFT is the client's time to the first streamed token.\n")
	if len(rt.Differing) > 0 {
		var runs []string
		for run := range rt.Differing {
			runs = append(runs, run)
		}
		sort.Strings(runs)
		var parts []string
		for _, run := range runs {
			parts = append(parts, fmt.Sprintf("%s: %s", run, strings.Join(rt.Differing[run], "; ")))
		}
		m.p("Greedy answers that differ from %s's for the same prompt (a request whose history already differed is not listed): %s.\n",
			rt.Results[0].Policy, strings.Join(parts, " — "))
	}
	m.p("![TTFT per routing policy](%s)\n", routePlot)
}

func identical(ok bool) string {
	if ok {
		return "every policy got the same greedy answers"
	}
	return "**the policies' greedy answers differed**"
}

func upperFirst(s string) string {
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}

// writeRoutePlot draws mean and p90 TTFT per policy as grouped bars.
func writeRoutePlot(dir string, rt *route.Report) error {
	p := plot.New()
	p.Title.Text = "Agent swarm through one proxy, 3 stock servers: TTFT per routing policy"
	p.Y.Label.Text = "TTFT, ms"
	p.Add(plotter.NewGrid())
	var names []string
	mean, p90 := plotter.Values{}, plotter.Values{}
	for _, r := range rt.Results {
		names = append(names, fmt.Sprintf("%s (hit %.2f)", r.Policy, r.PrefixHitRatio))
		mean = append(mean, r.TTFT.Mean)
		p90 = append(p90, r.TTFT.P90)
	}
	w := vg.Points(24)
	for i, v := range []struct {
		name string
		vals plotter.Values
	}{{"mean", mean}, {"p90", p90}} {
		bars, err := plotter.NewBarChart(v.vals, w)
		if err != nil {
			return fmt.Errorf("plot %s: %w", routePlot, err)
		}
		bars.Color = plotutil.Color(i)
		bars.Offset = vg.Length(2*i-1) * w / 2
		p.Add(bars)
		p.Legend.Add(v.name, bars)
	}
	p.Legend.Top = true
	p.NominalX(names...)
	return p.Save(7*vg.Inch, 4.5*vg.Inch, filepath.Join(dir, routePlot))
}
