package replay

import (
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/arbiter"
	"github.com/mcbridge/mcbridge/internal/preset"
)

// linear is a preset whose costs are easy to compute by hand: 1 ms per
// prefilled token, 1000 KV bytes per token, local restores at 1 GB/s.
var linear = preset.Preset{
	Name:            "linear",
	KVBytesPerToken: 1000,
	Prefill:         arbiter.PrefillCost{PerToken: 1e-3},
	LocalBandwidth:  1e9,
}

func req(ts int64, length int, ids ...int64) Request {
	return Request{Timestamp: ts, InputLength: length, HashIDs: ids}
}

// TestKnownAnswers replays small traces whose hits and times follow from
// the rules by hand. Blocks are 4 tokens.
func TestKnownAnswers(t *testing.T) {
	restoreOnly := []arbiter.Policy{arbiter.AlwaysRestore}
	for _, tc := range []struct {
		name  string
		trace []Request
		opt   Options
		// Expected results of the first policy.
		ideal, hit, restored, remote int64
		ttft                         []float64 // ms, sorted: p50 is the middle one
	}{
		{
			name:  "repeat: the last token and the partial block are computed",
			trace: []Request{req(0, 10, 1, 2, 3), req(1, 10, 1, 2, 3)},
			opt:   Options{Servers: 1, Policies: restoreOnly},
			// The second request had all three ids before (10 tokens);
			// the bridge restores its two full blocks before the last token.
			ideal: 10, hit: 8, restored: 8,
			// 10 ms to prefill the first; 8 tokens · 1000 B at 1 GB/s
			// (8 µs) and 2 tokens for the second.
			ttft: []float64{2.008, 10},
		},
		{
			name:  "branching prefixes",
			trace: []Request{req(0, 12, 1, 2, 3), req(1, 12, 1, 2, 4), req(2, 8, 1, 5)},
			opt:   Options{Servers: 1, Policies: restoreOnly},
			ideal: 8 + 4, hit: 8 + 4, restored: 8 + 4,
			ttft: []float64{4.004, 4.008, 12},
		},
		{
			name:  "a peer's blocks come over the link",
			trace: []Request{req(0, 10, 1, 2, 3), req(1, 10, 1, 2, 3)},
			opt:   Options{Servers: 2, Policies: restoreOnly, Bandwidth: 1e8, Latency: time.Millisecond},
			ideal: 10, hit: 8, restored: 8, remote: 8,
			// 1 ms latency + 8000 B at 100 MB/s (80 µs) + 2 ms.
			ttft: []float64{3.08, 10},
		},
		{
			name:  "always-recompute restores nothing",
			trace: []Request{req(0, 10, 1, 2, 3), req(1, 10, 1, 2, 3)},
			opt:   Options{Servers: 1, Policies: []arbiter.Policy{arbiter.AlwaysRecompute}},
			ideal: 10, hit: 8, restored: 0,
			ttft: []float64{10, 10},
		},
		{
			name: "a pool of two blocks keeps the first two",
			// The first request saves two of its three blocks: the third
			// finds the pool full of blocks it is itself writing.
			trace: []Request{req(0, 13, 1, 2, 3, 4), req(1, 13, 1, 2, 3, 4)},
			opt:   Options{Servers: 1, Policies: restoreOnly, PoolBytes: 2 * 4 * 1000},
			ideal: 13, hit: 8, restored: 8,
			ttft: []float64{5.008, 13},
		},
		{
			name:  "the cost model restores when restoring is cheaper",
			trace: []Request{req(0, 10, 1, 2, 3), req(1, 10, 1, 2, 3)},
			opt:   Options{Servers: 1, Policies: []arbiter.Policy{arbiter.CostModel}},
			ideal: 10, hit: 8, restored: 8,
			ttft: []float64{2.008, 10},
		},
		{
			name: "the cost model learns a link slower than prefill",
			// 1000 B per token at 100 kB/s is 10 ms per token, prefill 1 ms.
			// Server 1 first restores from server 0, believing the link
			// fast, and learns from it; server 0 restores in place; server
			// 1 then recomputes.
			trace: []Request{req(0, 10, 1, 2, 3), req(1, 10, 1, 2, 3), req(2, 10, 1, 2, 3), req(3, 10, 1, 2, 3)},
			opt:   Options{Servers: 2, Policies: []arbiter.Policy{arbiter.CostModel}, Bandwidth: 1e5},
			ideal: 30, hit: 24, restored: 16, remote: 8,
			// 80 ms over the link + 2 ms; 8 µs in place + 2 ms; recomputes.
			ttft: []float64{2.008, 10, 10, 82},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.opt.BlockTokens = 4
			tc.opt.Preset = linear
			res, err := Run(tc.trace, tc.opt)
			require.NoError(t, err)
			var total int64
			for _, r := range tc.trace {
				total += int64(r.InputLength)
			}
			assert.InDelta(t, float64(tc.ideal)/float64(total), res.IdealPrefixHitRatio, 1e-12, "ideal prefix hit ratio")
			assert.Equal(t, tc.hit, res.HitTokens, "hit tokens")
			assert.Equal(t, tc.restored, res.RestoredTokens, "restored tokens")
			assert.Equal(t, tc.remote, res.Runs[0].RemoteRestoredTokens, "tokens restored from peers")
			assert.Equal(t, total-tc.restored, res.RecomputedTokens, "recomputed tokens")
			got := res.TTFT[TTFTKey(tc.opt.Policies[0])]
			mid, last := tc.ttft[(len(tc.ttft)-1)/2], tc.ttft[len(tc.ttft)-1]
			assert.InDelta(t, mid, got.P50, 1e-6, "ttft p50")
			assert.InDelta(t, last, got.P99, 1e-6, "ttft p99")
			run := res.Runs[0]
			assert.Zero(t, run.LoadFailures, "failed loads of %d", run.Loads)
			assert.Equal(t, tc.restored > 0, run.Loads > 0, "%d loads", run.Loads)
		})
	}
}

func TestRunRejects(t *testing.T) {
	ok := []Request{req(0, 10, 1, 2, 3)}
	for _, tc := range []struct {
		name  string
		trace []Request
		opt   Options
	}{
		{"too few ids", []Request{req(0, 13, 1, 2, 3)}, Options{BlockTokens: 4}},
		{"too many ids", []Request{req(0, 8, 1, 2, 3)}, Options{BlockTokens: 4}},
		{"id reached from two prefixes", []Request{req(0, 8, 1, 2), req(0, 8, 3, 2)}, Options{BlockTokens: 4}},
		{"id first and later", []Request{req(0, 8, 1, 2), req(0, 4, 2)}, Options{BlockTokens: 4}},
		{"pool under two blocks a server", ok, Options{BlockTokens: 4, PoolBytes: 3 * 4 * 12 << 10, Servers: 2}},
		{"unknown eviction", ok, Options{BlockTokens: 4, Eviction: "fifo"}},
		{"negative latency", ok, Options{BlockTokens: 4, Bandwidth: 1e9, Latency: -1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Run(tc.trace, tc.opt)
			require.Error(t, err, "accepted")
		})
	}
}

// samplePath finds the sample trace: $MCB_TRACE, or the copy in testdata.
func samplePath() string {
	if p := os.Getenv("MCB_TRACE"); p != "" {
		return p
	}
	return filepath.Join("testdata", "synthetic_trace.jsonl")
}

// TestSampleTrace replays Mooncake's sample trace with an unbounded pool:
// the bridge must reuse at least 99% of what the trace's ids say an ideal
// cache could, and always-restore must restore every hit. Under the race
// detector it replays the first requestsUnderRace requests, against their
// own ideal, to keep `go test -race ./...` short; the whole trace runs
// without it (and in the bench report).
func TestSampleTrace(t *testing.T) {
	const requestsUnderRace = 1000
	trace, err := LoadTrace(samplePath())
	require.NoError(t, err)
	opt := Options{Policies: []arbiter.Policy{arbiter.AlwaysRestore}}
	if raceEnabled {
		opt.Requests = requestsUnderRace
	}
	res, err := Run(trace, opt)
	require.NoError(t, err)
	t.Logf("%d requests: ideal %.4f, hit %.4f, %d of %d restored from peers, %.1fs",
		res.Requests, res.IdealPrefixHitRatio, res.PrefixHitRatio, res.Runs[0].RemoteRestoredTokens, res.RestoredTokens, res.Runs[0].WallSeconds)
	// The trace's README states the whole trace's ideal; a different
	// figure means the ids were read differently.
	if res.Requests == len(trace) {
		assert.InDelta(t, 0.651, res.IdealPrefixHitRatio, 0.0005, "ideal prefix hit ratio, the trace's README says 0.651")
	}
	assert.GreaterOrEqual(t, res.PrefixHitRatio, 0.99*res.IdealPrefixHitRatio, "prefix hit ratio against 99%% of the ideal")
	assert.Equal(t, res.HitTokens, res.RestoredTokens, "restored tokens of the hit tokens")
	assert.Zero(t, res.Runs[0].LoadFailures, "failed loads")
	assert.Zero(t, res.Runs[0].Evictions, "evictions")
}

// randomTrace builds conversations: each request either starts a new
// prefix or extends an earlier request's ids (dropping its partial last
// block) with new ones, as multi-turn agents do.
func randomTrace(rng *rand.Rand, n, blockTokens int) []Request {
	var trace []Request
	next := int64(0)
	for i := range n {
		var ids []int64
		if len(trace) > 0 && rng.IntN(4) != 0 {
			prev := trace[rng.IntN(len(trace))]
			full := prev.InputLength / blockTokens
			ids = append(ids, prev.HashIDs[:rng.IntN(full+1)]...)
		}
		for range 1 + rng.IntN(6) {
			ids = append(ids, next)
			next++
		}
		length := (len(ids)-1)*blockTokens + 1 + rng.IntN(blockTokens)
		trace = append(trace, Request{Timestamp: int64(i), InputLength: length, HashIDs: ids})
	}
	return trace
}

// bridgeCeiling is what the bridge can reuse with room for everything:
// leading blocks an earlier request held whole, short of the block that
// holds the prompt's last token.
func bridgeCeiling(trace []Request, blockTokens int) int64 {
	saved := map[int64]bool{}
	var hit int64
	for _, r := range trace {
		n := 0
		for n < len(r.HashIDs) && saved[r.HashIDs[n]] {
			n++
		}
		hit += int64(min(n, (r.InputLength-1)/blockTokens) * blockTokens)
		for _, id := range r.HashIDs[:r.InputLength/blockTokens] {
			saved[id] = true
		}
	}
	return hit
}

func TestRandomTraces(t *testing.T) {
	const B = 4
	var deduped int64
	for seed := range uint64(6) {
		rng := rand.New(rand.NewPCG(seed, 1))
		trace := randomTrace(rng, 200, B)
		require.NoError(t, Check(trace, B))
		want := bridgeCeiling(trace, B)
		ideal, _ := IdealHitTokens(trace, B)
		restore := []arbiter.Policy{arbiter.AlwaysRestore}
		unbounded, err := Run(trace, Options{BlockTokens: B, Servers: 3, Preset: linear, Policies: restore})
		require.NoError(t, err)
		u := unbounded.Runs[0]
		require.Equal(t, want, u.HitTokens, "seed %d: hit tokens against the ceiling", seed)
		require.Equal(t, want, u.RestoredTokens, "seed %d: restored tokens against the ceiling", seed)
		require.Zero(t, u.Evictions, "seed %d: evictions", seed)
		require.Zero(t, u.DedupedBlocks, "seed %d: deduped blocks", seed)
		require.LessOrEqual(t, want, ideal, "seed %d: the ceiling above the ideal", seed)
		// A pool a tenth of the blocks' size evicts, breaks chains and
		// rewrites blocks that peers still hold; it can only lose hits.
		pool := int64(unbounded.DistinctBlocks) * B * linear.KVBytesPerToken / 10
		for _, ev := range []string{"lru", "cost"} {
			bounded, err := Run(trace, Options{BlockTokens: B, Servers: 3, Preset: linear, Policies: restore, PoolBytes: pool, Eviction: ev})
			require.NoError(t, err, "seed %d, %s", seed, ev)
			b := bounded.Runs[0]
			require.LessOrEqual(t, b.HitTokens, want, "seed %d, %s: hit tokens against unbounded", seed, ev)
			require.LessOrEqual(t, b.RestoredTokens, b.HitTokens, "seed %d, %s: restored tokens against hit", seed, ev)
			require.NotZero(t, b.Evictions, "seed %d, %s: evictions", seed, ev)
			deduped += b.DedupedBlocks
		}
	}
	assert.NotZero(t, deduped, "no save was deduplicated: the bounded replays never rewrote a block a peer held")
}
