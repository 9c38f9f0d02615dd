package bridge_test

import (
	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/bridge/bridgetest"
	"github.com/mcbridge/mcbridge/internal/holdings"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/transport"
)

// corruptResident flips a payload byte of a block in b's pool.
func corruptResident(t *testing.T, b *bridge.Bridge, k key.BlockKey) {
	t.Helper()
	s, ok := b.Holdings().Get(k)
	require.True(t, ok)
	blk := b.Holdings().Bytes(s.Off, s.Size)
	blk[len(blk)-100] ^= 0x40
}

// A block whose bytes went bad in its holder's pool is found by the first
// reader, who tells the holder; the holder checks it, drops it and what
// hangs under it, and unpublishes them: the next reader is not sent to it.
// A block damaged only on the wire is checked too, and kept.
func TestBadBlockIsDropped(t *testing.T) {
	cfg := bridgetest.Config(t)
	a := bridgetest.Open(t, cfg, "holder")
	src := kvtest.New(t, 3, 64, 32, 48, true)
	ma := bridgetest.Register(t, a, src, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(5)), 17)
	src.Fill(tokens, kvtest.SeqCells(17))
	bridgetest.SaveAll(t, ma, src, key.Scope{}, tokens, kvtest.SeqCells(17))
	chain := key.Chain(key.Root(ma.Fingerprint(), key.Scope{}), tokens[:16], 4)

	r := bridgetest.Open(t, cfg, "reader")
	dst := kvtest.New(t, 3, 64, 32, 48, true)
	mr := bridgetest.Register(t, r, dst, 4)

	// On the wire only: the holder's copy is whole and stays.
	a.Transport().(*transport.Loopback).SetFault(transport.Fault{Kind: transport.Corrupt})
	res, err := bridgetest.LoadAll(t, mr, dst, key.Scope{}, tokens[:16], kvtest.SeqCells(16))
	require.Equal(t, status.Corrupt, status.Of(err), "%+v", res)
	a.Transport().(*transport.Loopback).SetFault(transport.Fault{})
	bridgetest.WaitFor(t, "the holder to check the block", func() bool { return a.Stats().BadChecks[holdings.Intact] == 1 })
	lk, err := mr.Lookup(key.Scope{}, tokens, 0)
	require.NoError(t, err)
	require.Equal(t, 4, lk.MatchedBlocks, "a block damaged in transit stays published")
	assert.Equal(t, int64(1), r.Stats().BadReported)

	// In the holder's pool: dropped, with its descendants, and unpublished.
	corruptResident(t, a, chain[1])
	dst.Scribble()
	res, err = bridgetest.LoadAll(t, mr, dst, key.Scope{}, tokens[:16], kvtest.SeqCells(16))
	require.Equal(t, status.Corrupt, status.Of(err))
	require.Equal(t, 4, res.OKTokens, "the block before the bad one restores")
	require.NoError(t, dst.CheckRestored(tokens[:16], kvtest.SeqCells(16), 4))
	bridgetest.WaitFor(t, "the holder to drop the bad block", func() bool { return a.Stats().BadChecks[holdings.Dropped] == 1 })
	bridgetest.WaitFor(t, "the reader's mirror to lose it", func() bool {
		lk, err := mr.Lookup(key.Scope{}, tokens, 0)
		require.NoError(t, err)
		return lk.MatchedBlocks == 1
	})
	n, _, _ := a.Resident()
	assert.Equal(t, 1, n, "the bad block and the two under it are gone from the holder's pool")
	// The next reader restores the good block and is sent nowhere else.
	before := r.Stats().LoadFailures
	dst.Scribble()
	res, err = bridgetest.LoadAll(t, mr, dst, key.Scope{}, tokens[:4], kvtest.SeqCells(4))
	require.NoError(t, err)
	assert.Equal(t, 4, res.OKTokens)
	assert.Equal(t, before, r.Stats().LoadFailures, "no failed restore after the drop")
	// A recomputed block is saved and published again.
	bridgetest.SaveAll(t, ma, src, key.Scope{}, tokens, kvtest.SeqCells(17))
	lk, err = mr.Lookup(key.Scope{}, tokens, 0)
	require.NoError(t, err)
	assert.Equal(t, 4, lk.MatchedBlocks)
}

// A reader's own pool: the block it found bad is checked and dropped
// there too.
func TestOwnBadBlockIsDropped(t *testing.T) {
	cfg := bridgetest.Config(t)
	a := bridgetest.Open(t, cfg, "self")
	h := kvtest.New(t, 2, 32, 16, 16, false)
	m := bridgetest.Register(t, a, h, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(6)), 9)
	h.Fill(tokens, kvtest.SeqCells(9))
	bridgetest.SaveAll(t, m, h, key.Scope{}, tokens, kvtest.SeqCells(9))
	chain := key.Chain(key.Root(m.Fingerprint(), key.Scope{}), tokens[:8], 4)
	corruptResident(t, a, chain[0])
	h.Scribble()
	_, err := bridgetest.LoadAll(t, m, h, key.Scope{}, tokens[:8], kvtest.SeqCells(8))
	require.Equal(t, status.Corrupt, status.Of(err))
	bridgetest.WaitFor(t, "the block to be dropped", func() bool { return a.Stats().BadChecks[holdings.Dropped] == 1 })
	n, _, _ := a.Resident()
	assert.Zero(t, n)
	lk, err := m.Lookup(key.Scope{}, tokens, 0)
	require.NoError(t, err)
	assert.Zero(t, lk.MatchedBlocks)
}
