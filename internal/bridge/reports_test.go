package bridge

import (
	"github.com/mcbridge/mcbridge/internal/holdings"
	"math/rand"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/transport"
)

func TestReportCodec(t *testing.T) {
	var items []reportItem
	for i := range 150 {
		items = append(items, reportItem{key: key.Hash{byte(i), 1, 2}, gen: uint64(i) * 1e15})
	}
	for _, kind := range []reportKind{reportUsed, reportBad, reportWant} {
		msgs := encodeReports(kind, items)
		require.Len(t, msgs, 3, "150 items in messages of %d", maxReportItems)
		var got []reportItem
		for _, m := range msgs {
			k, its, err := parseReport(m)
			require.NoError(t, err, m)
			require.Equal(t, kind, k)
			got = append(got, its...)
		}
		want := items
		if kind != reportBad {
			want = make([]reportItem, len(items))
			for i := range items {
				want[i] = reportItem{key: items[i].key}
			}
		}
		require.Equal(t, want, got)
	}
	for _, bad := range []string{"", "u", "x 00", "uu " + key.Hash{}.String(), "u 00", "u " + strings.Repeat("g", 32),
		"b " + key.Hash{}.String(), "b " + key.Hash{}.String() + ":x", "u " + strings.Repeat(key.Hash{}.String()+" ", maxReportItems+1)} {
		_, _, err := parseReport(bad)
		assert.Equal(t, status.InvalidArg, status.Of(err), "%q: %v", bad, err)
	}
}

// FuzzParseReport: a message either fails or encodes back to what it says.
func FuzzParseReport(f *testing.F) {
	f.Add("u " + key.Hash{1}.String())
	f.Add("b " + key.Hash{2}.String() + ":42 " + key.Hash{3}.String() + ":0")
	f.Add("w")
	f.Fuzz(func(t *testing.T, msg string) {
		kind, items, err := parseReport(msg)
		if err != nil {
			require.Equal(t, status.InvalidArg, status.Of(err))
			return
		}
		again := encodeReports(kind, items)
		require.Len(t, again, 1)
		k2, items2, err := parseReport(again[0])
		require.NoError(t, err)
		require.Equal(t, kind, k2)
		require.Equal(t, items, items2)
	})
}

// bigBlocks is a host whose 4-token blocks are 64 KiB, so that a few MiB
// of pool hold few enough blocks to evict.
func bigBlocks(t *testing.T) *kvtest.Host { return newHost(t, 4, 64, 2048, 2048, false) }

// storeNodeConfig is a store node's configuration: its pool holds about n of
// bigBlocks' blocks.
func storeNodeConfig(c config.Config, n int, eviction string) config.Config {
	c.PoolBytes = int64(n) * (64<<10 + 4<<10)
	c.PoolBytes = max(c.PoolBytes, 1<<20)
	c.Eviction = eviction
	return c
}

// restoreFrom restores tokens on a fresh reader host and reports how many
// it restored from which segment.
func restoreFrom(t *testing.T, m *Model, tokens []int32) (int, string) {
	t.Helper()
	h := bigBlocks(t)
	h.Scribble()
	lk, err := m.Lookup(key.Scope{}, tokens, 0)
	require.NoError(t, err)
	if lk.RestoreTokens == 0 {
		return 0, ""
	}
	seg := ""
	if e := m.match(key.Root(m.fp, key.Scope{}), lk.chain); len(e) > 0 {
		seg = e[0].Loc.Segment
	}
	n := lk.RestoreTokens
	res, err := loadAll(t, m, h, key.Scope{}, tokens[:n], kvtest.SeqCells(n))
	require.NoError(t, err, "restoring from %s", seg)
	require.NoError(t, h.Check(tokens, kvtest.SeqCells(len(tokens)), res.OKTokens), "restored bytes")
	return res.OKTokens, seg
}

// A store node keeps the prefix its readers restore through a stream of
// blocks nobody reads again, because readers report their restores to it;
// the same stream pushes out a prefix nobody restores.
func TestStoreKeepsWhatReadersRestore(t *testing.T) {
	for _, tc := range []struct {
		name     string
		restored bool
	}{{"restored by readers", true}, {"restored by nobody", false}} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(t)
			cfg.Arbiter.Policy = "always-restore"
			cfg.PoolBytes = 32 << 20
			store := openBridge(t, storeNodeConfig(cfg, 12, "frequency"), "store")
			require.NoError(t, store.Replicate())
			p, err := Open(withOwner(cfg, "producer"), Deps{})
			require.NoError(t, err)
			src := bigBlocks(t)
			mp := register(t, p, src, 4)
			hot := kvtest.Tokens(rand.New(rand.NewSource(1)), 17)
			src.Fill(hot, kvtest.SeqCells(17))
			saveAll(t, mp, src, key.Scope{}, hot, kvtest.SeqCells(17))
			waitFor(t, "the store to copy the prefix", func() bool { return store.Stats().Replicated == 4 })
			require.NoError(t, p.Close())
			waitFor(t, "the store to publish its copies", func() bool { return store.Stats().TakenOver == 4 })

			r := openBridge(t, cfg, "reader")
			mr := register(t, r, bigBlocks(t), 4)
			c := openBridge(t, cfg, "churn")
			hc := bigBlocks(t)
			mc := register(t, c, hc, 4)
			for i := range 20 {
				if tc.restored {
					uses := store.Stats().PeerUses
					n, seg := restoreFrom(t, mr, hot)
					require.Equal(t, 16, n, "round %d", i)
					require.Equal(t, store.Segment(), seg)
					waitFor(t, "the store to hear of the restore", func() bool { return store.Stats().PeerUses >= uses+4 })
				}
				cold := kvtest.Tokens(rand.New(rand.NewSource(int64(100+i))), 16)
				hc.Fill(cold, kvtest.SeqCells(16))
				before := store.Stats().Replicated
				saveAll(t, mc, hc, key.Scope{}, cold, kvtest.SeqCells(16))
				waitFor(t, "the store to copy the cold blocks", func() bool { return store.Stats().Replicated >= before+4 })
			}
			require.Positive(t, store.Stats().Evictions, "the stream must make the store evict")
			var held int
			store.mu.Lock()
			for _, k := range key.Chain(key.Root(mr.fp, key.Scope{}), hot[:16], 4) {
				if _, ok := store.hold.Get(k); ok {
					held++
				}
			}
			store.mu.Unlock()
			if tc.restored {
				assert.Equal(t, 4, held, "the prefix readers restore, after 80 blocks nobody reads")
			} else {
				assert.Less(t, held, 4, "a prefix nobody restores outlived 80 newer blocks")
			}
		})
	}
}

// corruptResident flips a payload byte of a block in b's pool.
func corruptResident(t *testing.T, b *Bridge, k key.BlockKey) {
	t.Helper()
	s, ok := b.hold.Get(k)
	require.True(t, ok)
	blk := b.hold.Bytes(s.Off, s.Size)
	blk[len(blk)-100] ^= 0x40
}

// A block whose bytes went bad in its holder's pool is found by the first
// reader, who tells the holder; the holder checks it, drops it and what
// hangs under it, and unpublishes them: the next reader is not sent to it.
// A block damaged only on the wire is checked too, and kept.
func TestBadBlockIsDropped(t *testing.T) {
	cfg := testConfig(t)
	a := openBridge(t, cfg, "holder")
	src := newHost(t, 3, 64, 32, 48, true)
	ma := register(t, a, src, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(5)), 17)
	src.Fill(tokens, kvtest.SeqCells(17))
	saveAll(t, ma, src, key.Scope{}, tokens, kvtest.SeqCells(17))
	chain := key.Chain(key.Root(ma.fp, key.Scope{}), tokens[:16], 4)

	r := openBridge(t, cfg, "reader")
	dst := newHost(t, 3, 64, 32, 48, true)
	mr := register(t, r, dst, 4)

	// On the wire only: the holder's copy is whole and stays.
	a.tr.(*transport.Loopback).SetFault(transport.Fault{Kind: transport.Corrupt})
	res, err := loadAll(t, mr, dst, key.Scope{}, tokens[:16], kvtest.SeqCells(16))
	require.Equal(t, status.Corrupt, status.Of(err), "%+v", res)
	a.tr.(*transport.Loopback).SetFault(transport.Fault{})
	waitFor(t, "the holder to check the block", func() bool { return a.Stats().BadChecks[holdings.Intact] == 1 })
	lk, err := mr.Lookup(key.Scope{}, tokens, 0)
	require.NoError(t, err)
	require.Equal(t, 4, lk.MatchedBlocks, "a block damaged in transit stays published")
	assert.Equal(t, int64(1), r.Stats().BadReported)

	// In the holder's pool: dropped, with its descendants, and unpublished.
	corruptResident(t, a, chain[1])
	dst.Scribble()
	res, err = loadAll(t, mr, dst, key.Scope{}, tokens[:16], kvtest.SeqCells(16))
	require.Equal(t, status.Corrupt, status.Of(err))
	require.Equal(t, 4, res.OKTokens, "the block before the bad one restores")
	require.NoError(t, dst.CheckRestored(tokens[:16], kvtest.SeqCells(16), 4))
	waitFor(t, "the holder to drop the bad block", func() bool { return a.Stats().BadChecks[holdings.Dropped] == 1 })
	waitFor(t, "the reader's mirror to lose it", func() bool {
		lk, err := mr.Lookup(key.Scope{}, tokens, 0)
		require.NoError(t, err)
		return lk.MatchedBlocks == 1
	})
	n, _, _ := a.Resident()
	assert.Equal(t, 1, n, "the bad block and the two under it are gone from the holder's pool")
	// The next reader restores the good block and is sent nowhere else.
	before := r.Stats().LoadFailures
	dst.Scribble()
	res, err = loadAll(t, mr, dst, key.Scope{}, tokens[:4], kvtest.SeqCells(4))
	require.NoError(t, err)
	assert.Equal(t, 4, res.OKTokens)
	assert.Equal(t, before, r.Stats().LoadFailures, "no failed restore after the drop")
	// A recomputed block is saved and published again.
	saveAll(t, ma, src, key.Scope{}, tokens, kvtest.SeqCells(17))
	lk, err = mr.Lookup(key.Scope{}, tokens, 0)
	require.NoError(t, err)
	assert.Equal(t, 4, lk.MatchedBlocks)
}

// A reader's own pool: the block it found bad is checked and dropped
// there too.
func TestOwnBadBlockIsDropped(t *testing.T) {
	cfg := testConfig(t)
	a := openBridge(t, cfg, "self")
	h := newHost(t, 2, 32, 16, 16, false)
	m := register(t, a, h, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(6)), 9)
	h.Fill(tokens, kvtest.SeqCells(9))
	saveAll(t, m, h, key.Scope{}, tokens, kvtest.SeqCells(9))
	chain := key.Chain(key.Root(m.fp, key.Scope{}), tokens[:8], 4)
	corruptResident(t, a, chain[0])
	h.Scribble()
	_, err := loadAll(t, m, h, key.Scope{}, tokens[:8], kvtest.SeqCells(8))
	require.Equal(t, status.Corrupt, status.Of(err))
	waitFor(t, "the block to be dropped", func() bool { return a.Stats().BadChecks[holdings.Dropped] == 1 })
	n, _, _ := a.Resident()
	assert.Zero(t, n)
	lk, err := m.Lookup(key.Scope{}, tokens, 0)
	require.NoError(t, err)
	assert.Zero(t, lk.MatchedBlocks)
}
