package arbiter

import (
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/status"
)

// benchKV is the bench model's KV per token (docs/design.md §15): 12 KiB.
const benchKV = 12 << 10

func mustNew(t testing.TB, cfg Config) *Arbiter {
	t.Helper()
	a, err := New(cfg)
	require.NoError(t, err, "New(%+v)", cfg)
	return a
}

func TestNewRejectsBadConfig(t *testing.T) {
	nan := math.NaN()
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"unknown policy", Config{Policy: 7}},
		{"negative policy", Config{Policy: -1}},
		{"zero per token", Config{Prefill: PrefillCost{Fixed: 1e-3}}},
		{"negative fixed", Config{Prefill: PrefillCost{Fixed: -1, PerToken: 1e-3}}},
		{"NaN context", Config{Prefill: PrefillCost{PerToken: 1e-3, PerContext: nan}}},
		{"infinite per token", Config{Prefill: PrefillCost{PerToken: math.Inf(1)}}},
		{"zero bandwidth link", Config{DefaultLink: Link{Latency: time.Millisecond}}},
		{"infinite bandwidth link", Config{Links: map[string]Link{"x": {Bandwidth: math.Inf(1)}}}},
		{"negative latency", Config{Links: map[string]Link{"x": {Bandwidth: 1e9, Latency: -1}}}},
		{"negative window", Config{Window: -3}},
		{"negative expiry", Config{LinkExpiry: -time.Second}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(tc.cfg)
			require.Equal(t, status.Config, status.Of(err), "New: got %v", err)
		})
	}
	_, err := New(Config{})
	require.NoError(t, err, "zero Config")
}

func TestDecide(t *testing.T) {
	fast := Link{Bandwidth: 50e9, Latency: 5 * time.Microsecond}
	slow := Link{Bandwidth: 1e6, Latency: 50 * time.Millisecond}
	links := map[string]Link{"fast": fast, "slow": slow}
	for _, tc := range []struct {
		name         string
		policy       Policy
		in           Input
		restore      int
		reason       ReasonCode
		wantEstimate bool
	}{
		{"no match", CostModel, Input{4096, 256, 0, benchKV, "fast", 0, 0}, 0, NoMatch, true},
		{"prompt shorter than a block", CostModel, Input{100, 256, 0, benchKV, "fast", 0, 0}, 0, TooShort, true},
		{"one block prompt leaves one token", CostModel, Input{256, 256, 1, benchKV, "fast", 0, 0}, 0, TooShort, true},
		{"fast link restores all", CostModel, Input{4160, 256, 16, benchKV, "fast", 0, 0}, 16, Restore, true},
		{"full match keeps one token", CostModel, Input{4096, 256, 16, benchKV, "fast", 0, 0}, 15, Restore, true},
		{"match longer than prompt", CostModel, Input{1000, 256, 40, benchKV, "fast", 0, 0}, 3, Restore, true},
		{"one block plus one token", CostModel, Input{257, 256, 1, benchKV, "fast", 0, 0}, 1, Restore, true},
		{"slow link short prefix recomputes", CostModel, Input{600, 256, 2, benchKV, "slow", 0, 0}, 0, RecomputeCheaper, true},
		{"slow link long prefix restores", CostModel, Input{65536 + 64, 256, 256, benchKV, "slow", 0, 0}, 256, Restore, true},
		{"unknown link uses the default", CostModel, Input{4160, 256, 16, benchKV, "peer-7", 0, 0}, 16, Restore, true},
		{"always restore on a slow link", AlwaysRestore, Input{600, 256, 2, benchKV, "slow", 0, 0}, 2, PolicyForced, true},
		{"always restore keeps one token", AlwaysRestore, Input{512, 256, 2, benchKV, "slow", 0, 0}, 1, PolicyForced, true},
		{"always recompute on a fast link", AlwaysRecompute, Input{4160, 256, 16, benchKV, "fast", 0, 0}, 0, PolicyForced, true},
		{"policy does not hide no match", AlwaysRestore, Input{4160, 256, 0, benchKV, "fast", 0, 0}, 0, NoMatch, true},
		{"zero prompt", CostModel, Input{0, 256, 0, benchKV, "fast", 0, 0}, 0, InvalidInput, false},
		{"zero block size", CostModel, Input{4096, 0, 3, benchKV, "fast", 0, 0}, 0, InvalidInput, false},
		{"negative match", CostModel, Input{4096, 256, -1, benchKV, "fast", 0, 0}, 0, InvalidInput, false},
		{"zero KV bytes", CostModel, Input{4096, 256, 4, 0, "fast", 0, 0}, 0, InvalidInput, false},
		{"negative KV bytes", CostModel, Input{4096, 256, 4, -1, "fast", 0, 1 << 20}, 0, InvalidInput, false},
		{"a snapshot alone (no KV rows) restores every block it covers", CostModel, Input{4160, 256, 16, 0, "fast", 0, 1 << 20}, 16, Restore, true},
		{"a snapshot alone too large to move recomputes", CostModel, Input{4160, 256, 16, 0, "fast", 0, 1 << 40}, 0, RecomputeCheaper, true},
		{"prompt beyond any context", CostModel, Input{MaxPromptTokens + 1, 256, 4, benchKV, "fast", 0, 0}, 0, InvalidInput, false},
		{"host holds every usable block", CostModel, Input{4160, 256, 16, benchKV, "fast", 4096, 0}, 0, Local, true},
		{"host holds more than matched", CostModel, Input{4160, 256, 8, benchKV, "fast", 3000, 0}, 0, Local, true},
		{"a few blocks beyond the host's are cheaper to compute", CostModel, Input{65536 + 64, 256, 256, benchKV, "slow", 65536 - 256, 0}, 0, Local, true},
		{"a long restore beyond the host's short prefix", CostModel, Input{65536 + 64, 256, 256, benchKV, "fast", 256, 0}, 256, Restore, true},
		{"always restore still defers to a longer host prefix", AlwaysRestore, Input{4160, 256, 16, benchKV, "fast", 4100, 0}, 0, Local, true},
		{"always recompute keeps the host's prefix", AlwaysRecompute, Input{4160, 256, 16, benchKV, "fast", 512, 0}, 0, PolicyForced, true},
		{"cached beyond the prompt", CostModel, Input{4096, 256, 4, benchKV, "fast", 4097, 0}, 0, InvalidInput, false},
		{"negative cached", CostModel, Input{4096, 256, 4, benchKV, "fast", -1, 0}, 0, InvalidInput, false},
		{"a snapshot of the partial state too large to move recomputes", CostModel, Input{4160, 256, 16, benchKV, "fast", 0, 1 << 40}, 0, RecomputeCheaper, true},
		{"negative fixed bytes", CostModel, Input{4160, 256, 16, benchKV, "fast", 0, -1}, 0, InvalidInput, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := mustNew(t, Config{Policy: tc.policy, Links: links})
			d := a.Decide(tc.in)
			require.Equal(t, tc.restore, d.RestoreBlocks, "Decide(%+v) = %v: restored blocks", tc.in, d)
			require.Equal(t, tc.reason, d.Reason, "Decide(%+v) = %v: reason", tc.in, d)
			require.Equal(t, tc.wantEstimate, d.EstTotal > 0, "EstTotal = %v: whether there is an estimate", d.EstTotal)
			if tc.wantEstimate {
				require.LessOrEqual(t, d.EstTotal, max(d.EstRestore, d.EstRecompute), "EstTotal above both endpoints (%v, %v)", d.EstRestore, d.EstRecompute)
			}
		})
	}
}

// The estimates in a decision are the model's own, so a decision and the
// estimate functions used by the replay simulator never disagree.
func TestDecisionEstimatesMatchEstimateFunctions(t *testing.T) {
	a := mustNew(t, Config{})
	in := Input{PromptTokens: 4160, BlockTokens: 256, MatchedBlocks: 16, KVBytesPerToken: benchKV, Link: "local"}
	d := a.Decide(in)
	wantRecompute := a.PrefillTime(0, 4160)
	wantRestore := a.TransferTime("local", 16*256*benchKV) + a.PrefillTime(16*256, 4160)
	require.InDelta(t, wantRecompute, d.EstRecompute, 2, "decision %+v: recompute estimate", d)
	require.InDelta(t, wantRestore, d.EstRestore, 2, "decision %+v: restore estimate", d)
	require.Equal(t, d.EstRestore, d.EstTotal, "decision %+v: total estimate", d)
}

// plan expands the prefill model in blocks; it must time every range as
// PrefillCost.Time does.
func TestPlanMatchesPrefillModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for i := 0; i < 1000; i++ {
		cost := PrefillCost{Fixed: rng.Float64() * 1e-2, PerToken: rng.Float64() * 1e-3, PerContext: rng.Float64() * 1e-6}
		block := 1 + rng.IntN(1024)
		prompt := 1 + rng.IntN(MaxPromptTokens)
		k := rng.IntN(1 + (prompt-1)/block)
		c := newPlan(prompt, block, cost.vec(), 0, 0)
		want := cost.vec().dot(prefillFeatures(k*block, prompt))
		require.InDelta(t, want, c.tail(k), 1e-9*max(want, 1e-3), "%+v, block %d, prompt %d: plan times [%d, %d) unlike the model", cost, block, prompt, k*block, prompt)
	}
}

func TestDecisionString(t *testing.T) {
	ms := func(f float64) time.Duration { return time.Duration(f * float64(time.Millisecond)) }
	for _, tc := range []struct {
		d    Decision
		want string
	}{
		{Decision{RestoreBlocks: 12, MatchedBlocks: 12, Reason: Restore, EstTotal: ms(4.1), EstRestore: ms(4.1), EstRecompute: ms(310.123)},
			"restore 12/12 blocks: est 4.1ms vs recompute 310ms"},
		{Decision{MatchedBlocks: 12, Reason: RecomputeCheaper, EstTotal: ms(310), EstRestore: ms(400.4), EstRecompute: ms(310)},
			"recompute 0/12 blocks: est 310ms vs restore 400ms"},
		{Decision{RestoreBlocks: 11, MatchedBlocks: 12, Policy: AlwaysRestore, Reason: PolicyForced, EstTotal: ms(500), EstRestore: ms(500), EstRecompute: ms(310)},
			"restore 11/12 blocks (always-restore): est 500ms vs recompute 310ms"},
		{Decision{MatchedBlocks: 12, Policy: AlwaysRecompute, Reason: PolicyForced, EstTotal: ms(310), EstRestore: ms(4.1), EstRecompute: ms(310)},
			"recompute 0/12 blocks (always-recompute): est 310ms vs restore 4.1ms"},
		{Decision{Reason: NoMatch, EstTotal: 1234567 * time.Microsecond}, "recompute: no cached blocks: est 1.23s"},
		{Decision{MatchedBlocks: 1, Reason: TooShort, EstTotal: 1500 * time.Nanosecond}, "recompute 0/1 blocks: no whole block before the last token: est 1.5µs"},
		{Decision{Reason: InvalidInput}, "recompute: invalid input"},
	} {
		assert.Equal(t, tc.want, tc.d.String(), "String()")
	}
}

func TestEnumStrings(t *testing.T) {
	for p := CostModel; p <= AlwaysRecompute; p++ {
		got, err := ParsePolicy(p.String())
		assert.NoError(t, err, "ParsePolicy(%q)", p.String())
		assert.Equal(t, p, got, "ParsePolicy(%q)", p.String())
	}
	_, err := ParsePolicy("arbiter")
	assert.Equal(t, status.Config, status.Of(err), "ParsePolicy(unknown): %v", err)
	assert.Equal(t, "policy(9)", Policy(9).String(), "Policy(9)")
	for r := NoMatch; r <= Local; r++ {
		// 4 named split plans, which are no longer made; the C header
		// keeps the value unused.
		assert.Equal(t, r == 4, strings.HasPrefix(r.String(), "reason("), "reason %d: %q", int(r), r.String())
	}
}

// Slots call the arbiter from several threads; -race checks the locking.
func TestConcurrentUse(t *testing.T) {
	a := mustNew(t, Config{})
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 200; i++ {
				a.ObservePrefill(0, 256+i, time.Duration(256+i)*time.Millisecond)
				a.ObserveTransfer("local", int64(1+i)<<20, time.Duration(1+i)*100*time.Microsecond)
				d := a.Decide(Input{PromptTokens: 4096 + g, BlockTokens: 256, MatchedBlocks: 16, KVBytesPerToken: benchKV, Link: "local"})
				if !assert.LessOrEqual(t, d.RestoreBlocks*256, 4096+g-1, "prefix %d leaves no token", d.RestoreBlocks) {
					return
				}
				_ = a.Prefill()
				_ = a.Link("local")
			}
		}(g)
	}
	wg.Wait()
}
