package arbiter

import (
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mcbridge/mcbridge/internal/status"
)

// benchKV is the bench model's KV per token (DESIGN.md §5): 12 KiB.
const benchKV = 12 << 10

func mustNew(t testing.TB, cfg Config) *Arbiter {
	t.Helper()
	a, err := New(cfg)
	if err != nil {
		t.Fatalf("New(%+v): %v", cfg, err)
	}
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
			if status.Of(err) != status.Config {
				t.Fatalf("New: got %v, want a %v error", err, status.Config)
			}
		})
	}
	if _, err := New(Config{}); err != nil {
		t.Fatalf("zero Config: %v", err)
	}
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
		{"no match", CostModel, Input{4096, 256, 0, benchKV, "fast"}, 0, NoMatch, true},
		{"prompt shorter than a block", CostModel, Input{100, 256, 0, benchKV, "fast"}, 0, TooShort, true},
		{"one block prompt leaves one token", CostModel, Input{256, 256, 1, benchKV, "fast"}, 0, TooShort, true},
		{"fast link restores all", CostModel, Input{4160, 256, 16, benchKV, "fast"}, 16, Restore, true},
		{"full match keeps one token", CostModel, Input{4096, 256, 16, benchKV, "fast"}, 15, Restore, true},
		{"match longer than prompt", CostModel, Input{1000, 256, 40, benchKV, "fast"}, 3, Restore, true},
		{"one block plus one token", CostModel, Input{257, 256, 1, benchKV, "fast"}, 1, Restore, true},
		{"slow link short prefix recomputes", CostModel, Input{600, 256, 2, benchKV, "slow"}, 0, RecomputeCheaper, true},
		{"slow link long prefix restores", CostModel, Input{65536 + 64, 256, 256, benchKV, "slow"}, 256, Restore, true},
		{"unknown link uses the default", CostModel, Input{4160, 256, 16, benchKV, "peer-7"}, 16, Restore, true},
		{"always restore on a slow link", AlwaysRestore, Input{600, 256, 2, benchKV, "slow"}, 2, PolicyForced, true},
		{"always restore keeps one token", AlwaysRestore, Input{512, 256, 2, benchKV, "slow"}, 1, PolicyForced, true},
		{"always recompute on a fast link", AlwaysRecompute, Input{4160, 256, 16, benchKV, "fast"}, 0, PolicyForced, true},
		{"policy does not hide no match", AlwaysRestore, Input{4160, 256, 0, benchKV, "fast"}, 0, NoMatch, true},
		{"zero prompt", CostModel, Input{0, 256, 0, benchKV, "fast"}, 0, InvalidInput, false},
		{"zero block size", CostModel, Input{4096, 0, 3, benchKV, "fast"}, 0, InvalidInput, false},
		{"negative match", CostModel, Input{4096, 256, -1, benchKV, "fast"}, 0, InvalidInput, false},
		{"zero KV bytes", CostModel, Input{4096, 256, 4, 0, "fast"}, 0, InvalidInput, false},
		{"prompt beyond any context", CostModel, Input{MaxPromptTokens + 1, 256, 4, benchKV, "fast"}, 0, InvalidInput, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := mustNew(t, Config{Policy: tc.policy, Links: links})
			d := a.Decide(tc.in)
			if d.RestoreBlocks != tc.restore || d.Reason != tc.reason || d.HeadComputeBlocks != 0 {
				t.Fatalf("Decide(%+v) = %v (restore %d, head %d, %v), want restore %d, %v",
					tc.in, d, d.RestoreBlocks, d.HeadComputeBlocks, d.Reason, tc.restore, tc.reason)
			}
			if (d.EstTotal > 0) != tc.wantEstimate {
				t.Fatalf("EstTotal = %v, want an estimate: %v", d.EstTotal, tc.wantEstimate)
			}
			if tc.wantEstimate && d.EstTotal > max(d.EstRestore, d.EstRecompute) {
				t.Fatalf("EstTotal %v above both endpoints (%v, %v)", d.EstTotal, d.EstRestore, d.EstRecompute)
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
	near := func(x, y time.Duration) bool { return (x - y).Abs() <= 2 }
	if !near(d.EstRecompute, wantRecompute) || !near(d.EstRestore, wantRestore) || d.EstTotal != d.EstRestore {
		t.Fatalf("decision %+v, want recompute %v, restore %v", d, wantRecompute, wantRestore)
	}
}

func TestSplitOnlyWhenEnabled(t *testing.T) {
	// A link whose transfer of the whole prefix costs about as much as
	// computing half of it: overlapping the two beats either alone.
	link := Link{Bandwidth: 1e9, Latency: 10 * time.Microsecond}
	in := Input{PromptTokens: 8192 + 64, BlockTokens: 256, MatchedBlocks: 32, KVBytesPerToken: 1 << 20, Link: "l"}
	links := map[string]Link{"l": link}

	d := mustNew(t, Config{Links: links}).Decide(in)
	if d.HeadComputeBlocks != 0 || d.Reason == Split {
		t.Fatalf("split disabled but got %v", d)
	}
	sd := mustNew(t, Config{Links: links, Split: true}).Decide(in)
	if sd.Reason != Split || sd.HeadComputeBlocks == 0 || sd.RestoreBlocks == 0 {
		t.Fatalf("split enabled: got %v (%+v)", sd, sd)
	}
	if sd.EstTotal >= d.EstTotal || sd.PrefixBlocks() > 32 {
		t.Fatalf("split plan %v not better than sequential %v", sd, d)
	}
	forced := mustNew(t, Config{Links: links, Split: true, Policy: AlwaysRestore}).Decide(in)
	if forced.HeadComputeBlocks != 0 || forced.RestoreBlocks != 32 {
		t.Fatalf("always-restore must not split: %v", forced)
	}
}

// bestSplit's one-pointer sweep must find the optimum that trying every
// (s, k) finds.
func TestBestSplitMatchesExhaustiveSearch(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	logUniform := func(lo, hi float64) float64 { return lo * math.Pow(hi/lo, rng.Float64()) }
	for i := 0; i < 2000; i++ {
		block := 1 + rng.IntN(64)
		prompt := 1 + rng.IntN(80*block)
		c := newPlan(prompt, block,
			vec{logUniform(1e-6, 1e-1) * float64(rng.IntN(2)), logUniform(1e-7, 1e-2), logUniform(1e-12, 1e-5) * float64(rng.IntN(2))},
			logUniform(1e-7, 1e-1)*float64(rng.IntN(2)), logUniform(1e-7, 1e-1))
		usable := min(rng.IntN(80), (prompt-1)/block)

		gotS, gotK, got := c.bestSplit(usable)
		want := c.sequential(0)
		for k := 0; k <= usable; k++ {
			for s := 0; s <= k; s++ {
				want = min(want, c.split(s, k))
			}
		}
		if got != want || c.split(gotS, gotK) != got || gotS > gotK || gotK > usable {
			t.Fatalf("plan %+v usable %d: bestSplit = (%d, %d, %g), exhaustive min %g", c, usable, gotS, gotK, got, want)
		}
	}
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
		for _, tc := range []struct {
			got        float64
			start, end int
		}{
			{c.head(k), 0, k * block},
			{c.tail(k), k * block, prompt},
		} {
			want := cost.vec().dot(prefillFeatures(tc.start, tc.end))
			if math.Abs(tc.got-want) > 1e-9*max(want, 1e-3) {
				t.Fatalf("%+v, block %d, prompt %d: plan times [%d, %d) at %g, the model at %g", cost, block, prompt, tc.start, tc.end, tc.got, want)
			}
		}
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
		{Decision{HeadComputeBlocks: 3, RestoreBlocks: 9, MatchedBlocks: 12, Reason: Split, EstTotal: ms(3), EstRestore: ms(4.1), EstRecompute: ms(310)},
			"split 12/12 blocks, computing 3 while restoring 9: est 3ms vs restore 4.1ms vs recompute 310ms"},
		{Decision{Reason: NoMatch, EstTotal: 1234567 * time.Microsecond}, "recompute: no cached blocks: est 1.23s"},
		{Decision{MatchedBlocks: 1, Reason: TooShort, EstTotal: 1500 * time.Nanosecond}, "recompute 0/1 blocks: no whole block before the last token: est 1.5µs"},
		{Decision{Reason: InvalidInput}, "recompute: invalid input"},
	} {
		if got := tc.d.String(); got != tc.want {
			t.Errorf("String() = %q, want %q", got, tc.want)
		}
	}
}

func TestEnumStrings(t *testing.T) {
	for p := CostModel; p <= AlwaysRecompute; p++ {
		got, err := ParsePolicy(p.String())
		if err != nil || got != p {
			t.Errorf("ParsePolicy(%q) = %v, %v", p.String(), got, err)
		}
	}
	if _, err := ParsePolicy("arbiter"); status.Of(err) != status.Config {
		t.Errorf("ParsePolicy(unknown): %v", err)
	}
	if s := Policy(9).String(); s != "policy(9)" {
		t.Errorf("Policy(9) = %q", s)
	}
	for r := NoMatch; r <= InvalidInput; r++ {
		if s := r.String(); strings.HasPrefix(s, "reason(") {
			t.Errorf("reason %d has no name", int(r))
		}
	}
}

// Slots call the arbiter from several threads; -race checks the locking.
func TestConcurrentUse(t *testing.T) {
	a := mustNew(t, Config{Split: true})
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 200; i++ {
				a.ObservePrefill(0, 256+i, time.Duration(256+i)*time.Millisecond)
				a.ObserveTransfer("local", int64(1+i)<<20, time.Duration(1+i)*100*time.Microsecond)
				d := a.Decide(Input{PromptTokens: 4096 + g, BlockTokens: 256, MatchedBlocks: 16, KVBytesPerToken: benchKV, Link: "local"})
				if d.PrefixBlocks()*256 > 4096+g-1 {
					t.Errorf("prefix %d leaves no token", d.PrefixBlocks())
					return
				}
				_ = a.Prefill()
				_ = a.Link("local")
			}
		}(g)
	}
	wg.Wait()
}
