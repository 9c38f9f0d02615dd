package kvevents

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/key"
)

const testSeed = 1337

func tokens(n int, base int32) []int32 {
	t := make([]int32, n)
	for i := range t {
		t[i] = base + int32(i)
	}
	return t
}

func bkey(b byte) key.BlockKey { return key.BlockKey{b} }

// blocks names blocks lo..hi-1 of c with keys base+i.
func blocks(c *Chain, base byte, lo, hi int) []Block {
	var out []Block
	for i := lo; i < hi; i++ {
		out = append(out, Block{Key: bkey(base + byte(i)), Chain: c, Index: i})
	}
	return out
}

func tags(qs []queued) []string {
	var out []string
	for _, q := range qs {
		out = append(out, q.ev.Tag)
	}
	return out
}

func TestHoldingsAnnounceChainsFromPositionZero(t *testing.T) {
	h := newHoldings("CPU")
	c := NewChain(tokens(12, 100), 4, testSeed)
	require.Equal(t, key.MooncakeHashes(tokens(12, 100), 4, testSeed), c.Hashes)
	tp := h.topic("kv@a@m", 4)
	// Only the last block is this process's: the two above it come along.
	h.stored(tp, blocks(c, 0, 2, 3))
	qs := h.take()
	require.Equal(t, []string{TagCleared, TagStored}, tags(qs), "a new topic starts with a clear")
	ev := qs[1].ev
	require.Equal(t, c.Hashes, ev.Hashes, "one event for the chain, as vLLM sends a request's blocks")
	require.Nil(t, ev.Parent)
	require.Equal(t, tokens(12, 100), ev.Tokens)
	require.Equal(t, 4, ev.BlockSize)
	require.Equal(t, "CPU", ev.Medium)

	// A second chain sharing two blocks announces only its own tail,
	// under the shared parent.
	d := NewChain(append(tokens(8, 100), tokens(4, 500)...), 4, testSeed)
	h.stored(tp, blocks(d, 10, 2, 3))
	qs = h.take()
	require.Len(t, qs, 1)
	require.Equal(t, []uint64{d.Hashes[2]}, qs[0].ev.Hashes)
	require.Equal(t, c.Hashes[1], *qs[0].ev.Parent)

	// Storing a key again changes nothing.
	h.stored(tp, blocks(c, 0, 2, 3))
	require.Empty(t, h.take())

	// Removing c's block frees its leaf only: the shared blocks stay
	// pinned by d's.
	h.removed([]key.BlockKey{bkey(2)})
	qs = h.take()
	require.Len(t, qs, 1)
	require.Equal(t, TagRemoved, qs[0].ev.Tag)
	require.Equal(t, []uint64{c.Hashes[2]}, qs[0].ev.Hashes)
	// Removing d's block frees its chain, leaf first, in one event.
	h.removed([]key.BlockKey{bkey(12), bkey(99)})
	qs = h.take()
	require.Len(t, qs, 1)
	require.Equal(t, []uint64{d.Hashes[2], d.Hashes[1], d.Hashes[0]}, qs[0].ev.Hashes)
	require.Empty(t, tp.held)
}

func TestHoldingsOwnBlocksAboveOthers(t *testing.T) {
	h := newHoldings("CPU")
	c := NewChain(tokens(12, 0), 4, testSeed)
	tp := h.topic("kv@a@m", 4)
	h.take()
	// Blocks 1 and 2 are this process's, block 1 pinned by itself and by 2.
	h.stored(tp, blocks(c, 0, 1, 3))
	h.take()
	h.removed([]key.BlockKey{bkey(1)})
	require.Empty(t, h.take(), "block 1 still holds block 2 up")
	h.removed([]key.BlockKey{bkey(2)})
	qs := h.take()
	require.Equal(t, []uint64{c.Hashes[2], c.Hashes[1], c.Hashes[0]}, qs[0].ev.Hashes)
}

func TestHoldingsClearAndSnapshot(t *testing.T) {
	h := newHoldings("DISK")
	c := NewChain(tokens(8, 0), 4, testSeed)
	d := NewChain(tokens(8, 50), 4, testSeed)
	ta, tb := h.topic("kv@a@m2", 4), h.topic("kv@a@m1", 4)
	h.stored(ta, blocks(c, 0, 1, 2))
	h.stored(tb, blocks(d, 10, 0, 2))
	h.snapshot()
	qs := h.take()
	// Topics in name order, each cleared then its chains, parents first.
	require.Equal(t, []string{TagCleared, TagStored, TagCleared, TagStored}, tags(qs))
	require.Equal(t, "kv@a@m1", qs[0].t.name)
	require.Equal(t, d.Hashes, qs[1].ev.Hashes)
	require.Equal(t, c.Hashes, qs[3].ev.Hashes)
	require.Equal(t, "DISK", qs[3].ev.Medium)

	h.clear()
	qs = h.take()
	require.Equal(t, []string{TagCleared, TagCleared}, tags(qs))
	require.Empty(t, h.keys)
	h.removed([]key.BlockKey{bkey(1)})
	require.Empty(t, h.take(), "cleared keys are forgotten")
}
