package arbiter

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/status"
)

// A restore's deadline is a small multiple of its estimate plus the margin
// while recomputing costs far more, and never more than the compute the
// restore saves plus the margin.
func TestDeadlineFollowsTheEstimates(t *testing.T) {
	fast := Link{Bandwidth: 10e9, Latency: 20 * time.Microsecond}
	// A link on which restoring 16 blocks costs nearly what computing
	// them does: the cost model still restores, and the deadline is
	// capped by the compute saved, not by four restores.
	marginal := Link{Bandwidth: 5e6, Latency: 0}
	links := map[string]Link{"fast": fast, "marginal": marginal}
	a := mustNew(t, Config{Links: links, DeadlineFactor: 4, DeadlineMargin: 30 * time.Millisecond})
	in := Input{PromptTokens: 4160, BlockTokens: 256, MatchedBlocks: 16, KVBytesPerToken: benchKV, Link: "fast"}

	d := a.Decide(in)
	require.Equal(t, Restore, d.Reason, "%v", d)
	restore := fast.Time(16 * 256 * benchKV)
	require.InDelta(t, 4*restore+30*time.Millisecond, d.Deadline, 2, "deadline of %v: four estimated restores plus the margin", d)

	in.Link = "marginal"
	d = a.Decide(in)
	require.Equal(t, Restore, d.Reason, "%v", d)
	saves := a.PrefillTime(0, 16*256+64) - a.PrefillTime(16*256, 16*256+64)
	require.Less(t, saves, 4*marginal.Time(16*256*benchKV), "the case needs a restore whose four estimates exceed what it saves")
	require.InDelta(t, saves+30*time.Millisecond, d.Deadline, float64(time.Microsecond), "deadline of %v: the compute saved plus the margin", d)

	// What the host holds is not saved by the restore.
	in.Link, in.CachedTokens = "marginal", 1024
	d = a.Decide(in)
	require.Equal(t, 16, d.RestoreBlocks, "%v", d)
	saves = a.PrefillTime(1024, 4160) - a.PrefillTime(16*256, 4160)
	require.InDelta(t, saves+30*time.Millisecond, d.Deadline, float64(time.Microsecond), "deadline of %v past the host's own prefix", d)
}

func TestDeadlineIsZeroWithoutAModelledRestore(t *testing.T) {
	for _, tc := range []struct {
		name   string
		policy Policy
		in     Input
	}{
		{"no match", CostModel, Input{4160, 256, 0, benchKV, "local", 0, 0}},
		{"local", CostModel, Input{4160, 256, 16, benchKV, "local", 4100, 0}},
		{"always recompute", AlwaysRecompute, Input{4160, 256, 16, benchKV, "local", 0, 0}},
		{"always restore", AlwaysRestore, Input{4160, 256, 16, benchKV, "local", 0, 0}},
		{"invalid", CostModel, Input{0, 256, 16, benchKV, "local", 0, 0}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := mustNew(t, Config{Policy: tc.policy}).Decide(tc.in)
			require.Zero(t, d.Deadline, "Decide(%+v) = %v", tc.in, d)
		})
	}
}

// The deadline is learnt per link: transfers observed slow on one peer
// lengthen that peer's deadline and no other's.
func TestDeadlineLearnsPerLink(t *testing.T) {
	now := time.Unix(1000, 0)
	a := mustNew(t, Config{Now: func() time.Time { return now }})
	in := func(link string) Input {
		return Input{PromptTokens: 8192 + 64, BlockTokens: 256, MatchedBlocks: 32, KVBytesPerToken: benchKV, Link: link}
	}
	before := a.Decide(in("peer-a")).Deadline
	require.Equal(t, before, a.Decide(in("peer-b")).Deadline, "two links without observations")
	for i := 0; i < 32; i++ {
		a.ObserveTransfer("peer-a", 32*256*benchKV, 200*time.Millisecond)
	}
	slow, other := a.Decide(in("peer-a")), a.Decide(in("peer-b"))
	require.Equal(t, Restore, slow.Reason, "%v", slow)
	require.Greater(t, slow.Deadline, 4*before, "peer-a measured about 8x slower than the default: %v then %v", before, slow.Deadline)
	require.Equal(t, before, other.Deadline, "peer-b's deadline moved with peer-a's transfers")
}

func TestDeadlineConfig(t *testing.T) {
	for _, cfg := range []Config{
		{DeadlineFactor: 0.5},
		{DeadlineFactor: math.NaN()},
		{DeadlineFactor: math.Inf(1)},
		{DeadlineMargin: -time.Millisecond},
	} {
		_, err := New(cfg)
		require.Equal(t, status.Config, status.Of(err), "New(%+v): %v", cfg, err)
	}
	d := mustNew(t, Config{}).Decide(Input{PromptTokens: 4160, BlockTokens: 256, MatchedBlocks: 16, KVBytesPerToken: benchKV, Link: "local"})
	require.InDelta(t, defaultDeadlineFactor*DefaultLink.Time(16*256*benchKV), d.Deadline, 2, "defaults: four estimates, no margin: %v", d)
}
