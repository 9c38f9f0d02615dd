package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/mcbridge/mcbridge/internal/arbiter"
	"github.com/mcbridge/mcbridge/internal/preset"
	"github.com/mcbridge/mcbridge/internal/replay"
	"github.com/mcbridge/mcbridge/internal/status"
)

func init() {
	commands["replay"] = command{
		summary: "replay a Mooncake request trace through the bridge and report hit ratio and modelled TTFT",
		run:     func(args []string) error { return runReplay(args, os.Stdout) },
	}
}

func runReplay(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("replay", flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), `usage: mcbridge replay [flags] TRACE.jsonl

Replays a Mooncake-format trace (JSON lines: timestamp, input_length,
output_length, hash_ids) through the bridge's keys, directory, arbiter,
pool and bridge over the Loopback transport, once per policy, and prints
the prefix hit ratio and a modelled time to first token (see the package
documentation of internal/replay for the model).

flags:`)
		fs.PrintDefaults()
	}
	poolBytes := fs.String("pool-bytes", "0", "cache capacity in the preset's KV bytes, all servers together (64G, 1.5T, ...); 0 holds everything")
	blockTokens := fs.Int("block-tokens", 512, "tokens per hash id and per bridge block")
	presetName := fs.String("preset", preset.BenchCPU.Name, "KV bytes per token and prefill cost: bench-cpu or llama3-8b-gpu")
	linkGBps := fs.Float64("link-gbps", 25, "bandwidth between servers, GB/s")
	latencyUS := fs.Float64("latency-us", 10, "latency of a transfer between servers, µs")
	eviction := fs.String("eviction", "lru", "pool eviction: lru or cost")
	policy := fs.String("policy", "all", "all, cost-model, always-restore or always-recompute")
	servers := fs.Int("servers", 4, "simulated llama-server processes; requests go round-robin")
	requests := fs.Int("requests", 0, "replay only the first N requests (0: all)")
	asJSON := fs.Bool("json", false, "print one JSON object")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if !(*linkGBps > 0) || *latencyUS < 0 {
		return status.Errorf(status.InvalidArg, "link of %g GB/s and %g µs: bandwidth must be positive, latency not negative", *linkGBps, *latencyUS)
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return status.Errorf(status.InvalidArg, "want one trace file, got %d arguments", fs.NArg())
	}
	opt := replay.Options{
		BlockTokens: *blockTokens,
		Servers:     *servers,
		Bandwidth:   *linkGBps * 1e9,
		Latency:     time.Duration(*latencyUS * float64(time.Microsecond)),
		Eviction:    *eviction,
		Requests:    *requests,
	}
	var err error
	if opt.PoolBytes, err = replay.ParseBytes(*poolBytes); err != nil {
		return err
	}
	if opt.Preset, err = preset.Lookup(*presetName); err != nil {
		return err
	}
	if *policy != "all" {
		p, err := arbiter.ParsePolicy(*policy)
		if err != nil {
			return err
		}
		opt.Policies = []arbiter.Policy{p}
	}
	trace, err := replay.LoadTrace(fs.Arg(0))
	if err != nil {
		return err
	}
	res, err := replay.Run(trace, opt)
	if err != nil {
		return err
	}
	if *asJSON {
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		return enc.Encode(res)
	}
	printReplay(out, &res)
	return nil
}

func printReplay(w io.Writer, r *replay.Result) {
	pool := "unbounded"
	if r.PoolBytes > 0 {
		pool = fmt.Sprintf("%d bytes (%d blocks)", r.PoolBytes, r.PoolBlocks)
	}
	fmt.Fprintf(w, "%d requests, %d input tokens, %d distinct blocks of %d tokens, %d servers\n",
		r.Requests, r.InputTokens, r.DistinctBlocks, r.BlockTokens, r.Servers)
	fmt.Fprintf(w, "preset %s (%d KV bytes/token), link %g GB/s + %g µs, pool %s, eviction %s\n",
		r.Preset, r.KVBytesPerToken, r.LinkGBps, r.LatencyUS, pool, r.Eviction)
	fmt.Fprintf(w, "prefix hit ratio %.4f (ideal %.4f, %.2f%% of it)\n\n",
		r.PrefixHitRatio, r.IdealPrefixHitRatio, 100*r.PrefixHitRatio/r.IdealPrefixHitRatio)
	fmt.Fprintf(w, "%-17s %12s %12s %10s %10s %10s %10s\n", "policy", "restored", "recomputed", "TTFT p50", "p90", "p99", "mean ms")
	for _, run := range r.Runs {
		fmt.Fprintf(w, "%-17s %12d %12d %10.1f %10.1f %10.1f %10.1f\n", run.Policy, run.RestoredTokens, run.RecomputedTokens,
			run.TTFT.P50, run.TTFT.P90, run.TTFT.P99, run.TTFT.Mean)
	}
}
