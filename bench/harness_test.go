package bench

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The benchmarks' rigs, run once each at small sizes: every restore must
// place exactly the saved rows, every save must publish every block, for
// the timings to mean anything.

func TestRestoreRig(t *testing.T) {
	for _, g := range []geometry{geo64K, {"odd", 3, 6}} {
		for _, l := range []link{linkLocal, linkShared, linkUnshaped, shaped(10)} {
			t.Run(g.name+"/"+l.name, func(t *testing.T) {
				r := newRestoreRig(t, g, 3, l)
				require.Error(t, r.check(), "the reader's tensors hold the rows before any restore")
				for range 2 {
					require.NoError(t, r.restore())
					require.NoError(t, r.check())
					r.dst.Clear(len(r.tokens))
				}
				r.memcpy()
				require.NoError(t, r.check(), "memcpy baseline")
			})
		}
	}
}

func TestPipelinedRestore(t *testing.T) {
	r := newRestoreRig(t, geometry{"stall", 4, 64}, 2, shaped(1))
	s, err := r.pipelined(50 * time.Microsecond)
	require.NoError(t, err)
	require.NoError(t, r.check())
	require.Positive(t, s.first, "stalls %+v", s)
	require.GreaterOrEqual(t, s.total, s.first, "stalls %+v", s)
	require.GreaterOrEqual(t, s.total, s.maxLater, "stalls %+v", s)
	require.GreaterOrEqual(t, s.compute, 4*50*time.Microsecond, "stalls %+v", s)
}

func TestSaveRig(t *testing.T) {
	r := newSaveRig(t, geo64K, 4*blockTokens)
	// The pool holds two saves: the third evicts the first.
	for range 3 {
		require.NoError(t, r.save())
	}
	require.NoError(t, r.missAndSave())
	// The last save is found again under its scope, up to the block that
	// holds the prompt's last token, which a lookup never matches.
	res, err := r.model.Lookup(r.scopeOf(r.salt), r.tokens, 0)
	require.NoError(t, err, "lookup after save")
	require.Equal(t, r.blocks-1, res.MatchedBlocks, "lookup after save: %+v", res)
	r.memcpy()
}

func TestLookupRig(t *testing.T) {
	r := newLookupRig(t, 4*blockTokens, 100)
	for _, n := range []int{blockTokens, 4 * blockTokens} {
		require.NoError(t, r.lookup(n))
	}
}
