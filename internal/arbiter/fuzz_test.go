package arbiter

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// FuzzDecide feeds arbitrary prompts, after arbitrary observations, to every
// policy: Decide must never panic, never plan outside [0, MatchedBlocks],
// always leave a token to compute, and never report a negative estimate.
func FuzzDecide(f *testing.F) {
	f.Add(4160, 256, 16, int64(benchKV), "local", uint8(0), 0, 4096, int64(16e9), int64(49<<20))
	f.Add(4096, 256, 16, int64(benchKV), "local", uint8(1), 4096, 4097, int64(30e6), int64(1))
	f.Add(257, 256, 1, int64(1<<20), "peer", uint8(0), 0, 1, int64(1), int64(1<<50))
	f.Add(1, 1, 1, int64(1), "", uint8(2), -1, 0, int64(-1), int64(0))
	f.Add(MaxPromptTokens, 1, 1<<30, int64(1<<62), "x", uint8(0), 0, MaxPromptTokens, int64(1<<62), int64(1<<62))
	f.Add(0, 0, -5, int64(-1), "y", uint8(255), 7, 3, int64(0), int64(-7))
	f.Fuzz(func(t *testing.T, prompt, block, matched int, kv int64, link string, policy uint8,
		obsStart, obsEnd int, obsNanos, obsBytes int64) {
		a := mustNew(t, Config{Policy: Policy(policy % 3), Now: newFakeClock().Now})
		for i := 0; i < 3; i++ {
			a.ObservePrefill(obsStart, obsEnd, time.Duration(obsNanos))
			a.ObserveTransfer(link, obsBytes, time.Duration(obsNanos))
		}
		in := Input{PromptTokens: prompt, BlockTokens: block, MatchedBlocks: matched, KVBytesPerToken: kv, Link: link}
		d := a.Decide(in)
		require.GreaterOrEqual(t, d.RestoreBlocks, 0, "Decide(%+v) = %+v: plan outside [0, %d]", in, d, matched)
		require.LessOrEqual(t, d.RestoreBlocks, max(matched, 0), "Decide(%+v) = %+v: plan outside [0, %d]", in, d, matched)
		if d.RestoreBlocks > 0 {
			require.GreaterOrEqual(t, prompt, 1, "Decide(%+v) = %+v: leaves no token to compute", in, d)
			require.GreaterOrEqual(t, block, 1, "Decide(%+v) = %+v: leaves no token to compute", in, d)
			require.LessOrEqual(t, d.RestoreBlocks, (prompt-1)/block, "Decide(%+v) = %+v: leaves no token to compute", in, d)
		}
		require.GreaterOrEqual(t, d.EstRestore, time.Duration(0), "Decide(%+v) = %+v: negative estimate", in, d)
		require.GreaterOrEqual(t, d.EstRecompute, time.Duration(0), "Decide(%+v) = %+v: negative estimate", in, d)
		require.GreaterOrEqual(t, d.EstTotal, time.Duration(0), "Decide(%+v) = %+v: negative estimate", in, d)
		require.NotEmpty(t, d.String(), "empty log line")
	})
}

// ParsePolicy reads configuration text: any input either fails or names a
// policy that prints back as the input.
func FuzzParsePolicy(f *testing.F) {
	for _, s := range []string{"cost-model", "always-restore", "always-recompute", "", "Always-Restore", "cost-model\x00"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		p, err := ParsePolicy(s)
		if err == nil {
			require.Equal(t, s, p.String(), "ParsePolicy(%q) = %v", s, p)
		}
	})
}
