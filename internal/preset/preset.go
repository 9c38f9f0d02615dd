// Package preset names the workloads the benchmarks and the trace replay
// charge time against: how many KV bytes a token occupies, what prefill
// really costs, and how fast a restore from this process's own pool is.
//
// A preset is ground truth for a simulation, never the arbiter's belief:
// the arbiter starts from its own defaults and learns a preset only through
// its Observe calls, as it would on a real server.
package preset

import (
	"math"
	"sort"
	"strings"
	"time"

	"github.com/mcbridge/mcbridge/internal/arbiter"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Prefill is the true time to prefill positions [start, end) of one
// sequence whose positions [0, start) are already in the KV cache.
type Prefill interface {
	Time(start, end int) time.Duration
}

// Preset is one simulated model on one machine.
type Preset struct {
	Name string
	// KVBytesPerToken is the KV of one token, all layers, K and V.
	KVBytesPerToken int64
	Prefill         Prefill
	// LocalBandwidth is bytes per second of a restore from this process's
	// own pool into its KV tensors (no network in between).
	LocalBandwidth float64
	// Source says where the numbers come from, for the report.
	Source string
}

// Throughput is one measured prefill: Tokens from an empty cache at
// TokensPerSecond.
type Throughput struct {
	Tokens          int
	TokensPerSecond float64
}

// Interpolated is a prefill cost read off measured whole-prompt runs rather
// than fitted to a formula: tokens per second is interpolated linearly in
// log-log space between the measured lengths and extrapolated with the end
// segments' slopes. Prefilling [a, b) after a cached prefix costs T(b)-T(a),
// T(n) = n / rate(n), so continuing a long prompt pays the marginal cost at
// its depth. Its shape differs from the arbiter's quadratic model on
// purpose: a replay against it tests calibration, not a tautology.
type Interpolated []Throughput

// Time implements Prefill.
func (m Interpolated) Time(start, end int) time.Duration {
	start = max(start, 0)
	if end <= start {
		return 0
	}
	return time.Duration((m.total(end) - m.total(start)) * float64(time.Second))
}

// total is T(n) in seconds.
func (m Interpolated) total(n int) float64 {
	if n <= 0 {
		return 0
	}
	return float64(n) / m.rate(float64(n))
}

func (m Interpolated) rate(n float64) float64 {
	i := sort.Search(len(m), func(i int) bool { return float64(m[i].Tokens) >= n })
	// The segment that holds n, or the nearest end segment.
	i = min(max(i, 1), len(m)-1)
	a, b := m[i-1], m[i]
	slope := math.Log(b.TokensPerSecond/a.TokensPerSecond) / math.Log(float64(b.Tokens)/float64(a.Tokens))
	return a.TokensPerSecond * math.Pow(n/float64(a.Tokens), slope)
}

// BenchCPU is docs/design.md §15's bench model: llama.cpp v0.5.0 on this CPU
// with 2 threads, a random 12-layer n_embd 768 model with 4 f16 KV heads
// of 64 (12 KiB of KV per token), prefilling 611 tok/s at 512 tokens, 369
// at 2048, 253 at 4160 and 166 at 8256; a restore from local memory runs
// at the 16 GB/s memcpy measured on the same machine.
var BenchCPU = Preset{
	Name:            "bench-cpu",
	KVBytesPerToken: 12 << 10,
	Prefill: Interpolated{
		{512, 611}, {2048, 369}, {4160, 253}, {8256, 166},
	},
	LocalBandwidth: 16e9,
	Source:         "docs/design.md §15: llama.cpp v0.5.0, CPU, 2 threads, 12-layer n_embd 768 f16 model; prefill 611/369/253/166 tok/s at 512/2048/4160/8256 tokens, interpolated; memcpy 16 GB/s",
}

// Llama3GPU is Llama-3-8B (32 layers, 8 KV heads of 128, f16: 128 KiB of
// KV per token) on one H100-class GPU. Nothing here measured it; the
// coefficients are arithmetic: 16 GFLOP of weights per token at about
// 640 TFLOP/s effective (25 µs), attention at 4·32·4096 FLOP per (token,
// earlier position) pair at about 350 TFLOP/s (1.5 ns), and 5 ms per call
// for graph launch and sampling. That puts a 128k-token prefill at about
// 16 s and a 4k-token one at about 120 ms. Local restores cross PCIe from
// a host pool at 25 GB/s.
var Llama3GPU = Preset{
	Name:            "llama3-8b-gpu",
	KVBytesPerToken: 128 << 10,
	Prefill:         arbiter.PrefillCost{Fixed: 5e-3, PerToken: 25e-6, PerContext: 1.5e-9},
	LocalBandwidth:  25e9,
	Source:          "assumed, not measured: Llama-3-8B f16 KV on an H100-class GPU; 5 ms + 25 µs/token + 1.5 ns per attended pair; host pool over PCIe at 25 GB/s",
}

// All lists the presets by name.
var All = []Preset{BenchCPU, Llama3GPU}

// Lookup returns the preset called name.
func Lookup(name string) (Preset, error) {
	names := make([]string, 0, len(All))
	for _, p := range All {
		if p.Name == name {
			return p, nil
		}
		names = append(names, p.Name)
	}
	return Preset{}, status.Errorf(status.InvalidArg, "unknown preset %q (want %s)", name, strings.Join(names, ", "))
}
