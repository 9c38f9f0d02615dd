package bridge

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
)

// TestMirrorMatchesAMap drives a mirror and a plain map with the same
// random puts and deletes (children before parents, republished keys,
// reused slots, so that child links go stale and point at freed slots)
// and checks that every walk
// of every chain finds exactly what the map holds.
func TestMirrorMatchesAMap(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	const chains, depth = 8, 12
	// Chain 0's second block has the zero key, which a freed slot holds.
	keyOf := func(c, d int) key.BlockKey { return key.BlockKey{byte(c), byte(d - 1)} }
	parentOf := func(c, d int) key.Hash {
		if d == 0 {
			return key.Hash{0xff, byte(c)}
		}
		return keyOf(c, d-1)
	}
	mr := newMirror()
	want := map[key.BlockKey]directory.Entry{}
	for step := range 20000 {
		c, d := rng.IntN(chains), rng.IntN(depth)
		k := keyOf(c, d)
		if rng.IntN(3) == 0 {
			mr.delete(k)
			delete(want, k)
		} else {
			e := directory.Entry{Key: k, Parent: parentOf(c, d), Loc: directory.Location{Segment: "s", Addr: uint64(step)}}
			mr.put(e)
			want[k] = e
		}
		require.Equal(t, len(want), mr.len(), "step %d", step)
		walked := rng.IntN(chains)
		prev := int32(-1)
		for d := range depth {
			k := keyOf(walked, d)
			e, slot, ok := mr.next(prev, k)
			w, wok := want[k]
			require.Equal(t, wok, ok, "step %d: chain %d block %d present", step, walked, d)
			if !ok {
				break
			}
			require.Equal(t, w, *e, "step %d: chain %d block %d", step, walked, d)
			g, gok := mr.get(k)
			require.True(t, gok)
			require.Equal(t, w, *g)
			prev = slot
		}
	}
	for k := range want {
		mr.delete(k)
	}
	require.Zero(t, mr.len())
	require.Len(t, mr.free, len(mr.entries), "every slot is free again")
	for _, e := range mr.entries {
		require.Zero(t, e, "a freed slot keeps an entry")
	}
}
