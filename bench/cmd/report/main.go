// Command report runs the bridge's benchmarks, the trace replay and the
// arbiter's evaluation, and writes docs/bench/README.md with tables and
// SVG plots, saying which of docs/design.md's targets are met. Everything
// comes from one run: the end-to-end benchmarks (bench/e2e, llama-server
// processes) run with the others and leave bench/out/e2e.json.
//
// Run it from the repository root (bench/report.sh does). MCB_BENCH_QUICK=1
// selects the quick mode for CI: small sizes, one iteration per benchmark,
// part of the trace; its numbers show that everything runs, not how fast.
// Raw outputs go to bench/out/ (bench.txt, report.json, e2e.json,
// route.json, agentapi.json).
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/mcbridge/mcbridge/bench/agentapi"
	"github.com/mcbridge/mcbridge/bench/arbitereval"
	"github.com/mcbridge/mcbridge/bench/route"
	"github.com/mcbridge/mcbridge/internal/arbiter"
	"github.com/mcbridge/mcbridge/internal/preset"
	"github.com/mcbridge/mcbridge/internal/replay"
)

// report is everything the README is written from; bench/out/report.json
// holds it as measured.
type report struct {
	Quick     bool      `json:"quick"`
	Date      time.Time `json:"date"`
	Machine   machine   `json:"machine"`
	LoadStart string    `json:"loadavg_start"`
	LoadEnd   string    `json:"loadavg_end"`

	Bench []benchResult `json:"bench"` // ./bench and ./internal/residency

	Trace       string                `json:"trace"`
	Replay      *replay.Result        `json:"replay,omitempty"`
	Capacity    []capacityPoint       `json:"capacity"`
	Links       []linkPoint           `json:"links"`
	Arbiter     []arbiterPoint        `json:"arbiter"`
	ArbiterSums []arbitereval.Summary `json:"arbiter_summary"`

	E2E    json.RawMessage `json:"e2e,omitempty"` // bench/out/e2e.json as found
	E2EErr string          `json:"e2e_error,omitempty"`

	Route    *route.Report `json:"route,omitempty"` // bench/out/route.json, which BenchmarkRoute writes
	RouteErr string        `json:"route_error,omitempty"`

	AgentAPI    *agentapi.Report `json:"agentapi,omitempty"` // bench/out/agentapi.json, which BenchmarkAgentAPI writes
	AgentAPIErr string           `json:"agentapi_error,omitempty"`

	Stages []stage `json:"stages"`
}

// capacityPoint is one replay with a bounded pool.
type capacityPoint struct {
	Eviction string  `json:"eviction"`
	Fraction float64 `json:"fraction"` // of the trace's distinct blocks
	PoolGiB  float64 `json:"pool_gib"` // at bench-cpu's KV bytes
	HitRatio float64 `json:"hit_ratio"`
	Ideal    float64 `json:"ideal"`
	Evicted  int64   `json:"evictions"`
}

// linkPoint is one replay at one link speed.
type linkPoint struct {
	Preset   string                        `json:"preset"`
	LinkGBps float64                       `json:"link_gbps"`
	TTFT     map[string]replay.Percentiles `json:"ttft_ms"`
	Restored map[string]int64              `json:"restored_tokens"`
}

// arbiterPoint is an arbitereval.Point with its ratios, for report.json.
type arbiterPoint struct {
	arbitereval.Point
	Ratio     float64 `json:"ratio"`
	ColdRatio float64 `json:"cold_ratio"`
}

type stage struct {
	Name    string  `json:"name"`
	Seconds float64 `json:"seconds"`
}

func main() {
	out := flag.String("out", "docs/bench", "directory for README.md and the plots")
	raw := flag.String("raw", "bench/out", "directory for raw outputs; e2e.json is read from it")
	trace := flag.String("trace", "", "Mooncake trace to replay ($MCB_TRACE, else internal/replay/testdata/synthetic_trace.jsonl)")
	renderOnly := flag.Bool("render-only", false, "measure nothing: rewrite the README and plots from the last report.json and the current e2e.json, route.json and agentapi.json")
	flag.Parse()
	run := measure
	if *renderOnly {
		run = rerender
	}
	if err := run(*out, *raw, *trace); err != nil {
		fmt.Fprintln(os.Stderr, "report:", err)
		os.Exit(1)
	}
}

func measure(outDir, rawDir, tracePath string) error {
	// The benchmarks run in their packages' directories: they are told
	// where rawDir is as an absolute path.
	rawDir, err := filepath.Abs(rawDir)
	if err != nil {
		return err
	}
	r := &report{Quick: os.Getenv("MCB_BENCH_QUICK") != "", Date: time.Now().UTC(), Machine: readMachine(), LoadStart: loadAverage()}
	for _, d := range []string{outDir, rawDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	r.Trace = tracePath
	if r.Trace == "" {
		r.Trace = os.Getenv("MCB_TRACE")
	}
	if r.Trace == "" {
		r.Trace = filepath.Join("internal", "replay", "testdata", "synthetic_trace.jsonl")
	}

	timed := func(name string, fn func() error) error {
		start := time.Now()
		fmt.Fprintf(os.Stderr, "== %s\n", name)
		err := fn()
		r.Stages = append(r.Stages, stage{name, time.Since(start).Seconds()})
		return err
	}
	if err := timed("benchmarks", func() error { return r.runBenchmarks(filepath.Join(rawDir, "bench.txt")) }); err != nil {
		return err
	}
	if err := timed("trace replay", r.runReplays); err != nil {
		return err
	}
	if err := timed("arbiter evaluation", r.runArbiter); err != nil {
		return err
	}
	r.LoadEnd = loadAverage()
	return r.write(outDir, rawDir)
}

// rerender rewrites the outputs from the last measurement, with the
// end-to-end results as they are now.
func rerender(outDir, rawDir, _ string) error {
	b, err := os.ReadFile(filepath.Join(rawDir, "report.json"))
	if err != nil {
		return err
	}
	var r report
	if err := json.Unmarshal(b, &r); err != nil {
		return fmt.Errorf("%s: %w", filepath.Join(rawDir, "report.json"), err)
	}
	return r.write(outDir, rawDir)
}

// write reads the end-to-end results, then writes report.json, the plots
// and the README.
func (r *report) write(outDir, rawDir string) error {
	var err error
	r.E2EErr = ""
	if r.E2E, err = readE2E(filepath.Join(rawDir, "e2e.json")); err != nil {
		r.E2EErr = err.Error()
	}
	r.RouteErr = ""
	if r.Route, err = readRoute(filepath.Join(rawDir, "route.json")); err != nil {
		r.RouteErr = err.Error()
	}
	r.AgentAPIErr = ""
	if r.AgentAPI, err = readAgentAPI(filepath.Join(rawDir, "agentapi.json")); err != nil {
		r.AgentAPIErr = err.Error()
	}
	if err := writeJSON(filepath.Join(rawDir, "report.json"), r); err != nil {
		return err
	}
	if err := writePlots(outDir, r); err != nil {
		return err
	}
	f, err := os.Create(filepath.Join(outDir, "README.md"))
	if err != nil {
		return err
	}
	writeMarkdown(f, r)
	if m := f.Close(); err == nil {
		err = m
	}
	return err
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

// runBenchmarks runs the benchmark packages through
// `go test`, as anyone would to reproduce one, keeping the raw output.
func (r *report) runBenchmarks(rawPath string) error {
	benchtime := "1s"
	if r.Quick {
		benchtime = "1x"
	}
	f, err := os.Create(rawPath)
	if err != nil {
		return err
	}
	defer f.Close()
	// The end-to-end benchmarks run once each: every one of them measures
	// its baselines inside, and BenchmarkTTFT leaves e2e.json in rawDir.
	for _, run := range []struct{ pkg, bench, benchtime string }{
		{"./bench/", ".", benchtime},
		{"./internal/residency/", ".", benchtime},
		{"./internal/transport/mooncake/", "PeerRead", benchtime},
		{"./internal/store/mooncake/", "Store", benchtime},
		{"./bench/e2e/", ".", "1x"},
		{"./bench/route/", "Route", "1x"},
		{"./bench/agentapi/", "AgentAPI", "1x"},
	} {
		cmd := exec.Command("go", "test", "-run", "^$", "-bench", run.bench, "-benchtime", run.benchtime, "-count", "1", "-timeout", "2h", run.pkg)
		cmd.Env = append(os.Environ(), "MCB_E2E_OUT="+filepath.Join(filepath.Dir(rawPath), "e2e.json"), "MCB_BENCH_OUT="+filepath.Dir(rawPath))
		pr, pw := io.Pipe()
		cmd.Stdout, cmd.Stderr = pw, pw
		if err := cmd.Start(); err != nil {
			return err
		}
		parsed := make(chan []benchResult, 1)
		go func() {
			res, _ := parseBench(io.TeeReader(pr, io.MultiWriter(f, os.Stderr)))
			// Drain whatever follows a line too long to parse.
			_, _ = io.Copy(io.Discard, pr)
			parsed <- res
		}()
		err := cmd.Wait()
		pw.Close()
		r.Bench = append(r.Bench, <-parsed...)
		if err != nil {
			return fmt.Errorf("go test -bench %s %s: %w", run.bench, run.pkg, err)
		}
	}
	return nil
}

// Sweeps of the replay.
var (
	capacityFractions      = []float64{0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1}
	quickCapacityFractions = []float64{0.1, 0.5}
	linkSpeeds             = []float64{1, 2, 5, 10, 25, 50}
	quickLinkSpeeds        = []float64{1, 10, 50}
)

// quickRequests is how much of the trace the quick mode replays.
const quickRequests = 500

func (r *report) runReplays() error {
	trace, err := replay.LoadTrace(r.Trace)
	if err != nil {
		return fmt.Errorf("trace replay: %w", err)
	}
	base := replay.Options{}
	fractions, links := capacityFractions, linkSpeeds
	if r.Quick {
		base.Requests = quickRequests
		fractions, links = quickCapacityFractions, quickLinkSpeeds
	}
	res, err := replay.Run(trace, base)
	if err != nil {
		return err
	}
	r.Replay = &res
	fmt.Fprintf(os.Stderr, "replay: hit %.4f of ideal %.4f\n", res.PrefixHitRatio, res.IdealPrefixHitRatio)

	blockBytes := int64(res.BlockTokens) * preset.BenchCPU.KVBytesPerToken
	for _, ev := range []string{"lru", "cost"} {
		for _, f := range fractions {
			opt := base
			opt.Eviction = ev
			opt.Policies = []arbiter.Policy{arbiter.AlwaysRestore}
			opt.PoolBytes = int64(f * float64(res.DistinctBlocks) * float64(blockBytes))
			c, err := replay.Run(trace, opt)
			if err != nil {
				return fmt.Errorf("replay with %s eviction at %g of the blocks: %w", ev, f, err)
			}
			r.Capacity = append(r.Capacity, capacityPoint{Eviction: ev, Fraction: f, PoolGiB: float64(opt.PoolBytes) / (1 << 30),
				HitRatio: c.PrefixHitRatio, Ideal: c.IdealPrefixHitRatio, Evicted: c.Runs[0].Evictions})
			fmt.Fprintf(os.Stderr, "replay: %s, pool %.0f%%: hit %.4f\n", ev, 100*f, c.PrefixHitRatio)
		}
	}
	for _, p := range preset.All {
		for _, gbps := range links {
			opt := base
			opt.Preset = p
			opt.Bandwidth = gbps * 1e9
			opt.Latency = 10 * time.Microsecond
			l, err := replay.Run(trace, opt)
			if err != nil {
				return fmt.Errorf("replay of %s at %g GB/s: %w", p.Name, gbps, err)
			}
			lp := linkPoint{Preset: p.Name, LinkGBps: gbps, TTFT: l.TTFT, Restored: map[string]int64{}}
			for _, run := range l.Runs {
				lp.Restored[run.Policy] = run.RestoredTokens
			}
			r.Links = append(r.Links, lp)
			fmt.Fprintf(os.Stderr, "replay: %s at %g GB/s: mean TTFT %.0f/%.0f/%.0f ms\n", p.Name, gbps,
				l.TTFT["arbiter"].Mean, l.TTFT["restore"].Mean, l.TTFT["recompute"].Mean)
		}
	}
	return nil
}

func (r *report) runArbiter() error {
	points, err := arbitereval.Evaluate(arbitereval.Options{})
	if err != nil {
		return err
	}
	for _, p := range points {
		r.Arbiter = append(r.Arbiter, arbiterPoint{Point: p, Ratio: p.Ratio(), ColdRatio: p.ColdRatio()})
	}
	r.ArbiterSums = arbitereval.Summarize(points)
	return nil
}
