package bridge

import (
	"context"
	"math/rand"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/status"
	mcstore "github.com/mcbridge/mcbridge/internal/store/mooncake"
	"github.com/mcbridge/mcbridge/internal/store/mooncake/mastertest"
)

// Every case runs against a real mooncake_master and the real client
// library (make test builds both).

// storeConfig is testConfig with the bridges' blocks in the master's store.
func storeConfig(t testing.TB, m *mastertest.Master, replicas int, segment int64) config.Config {
	c := testConfig(t)
	c.Store.Kind, c.Store.Master, c.Store.Lib = "mooncake", m.Addr(), mastertest.Lib(t)
	c.Store.Replicas, c.Store.SegmentBytes = replicas, segment
	c.Store.AuditIntervalMS = 100
	return c
}

// storeBridge opens a bridge and waits until its store client is set up
// (it connects in the background).
func storeBridge(t testing.TB, c config.Config, owner string) *Bridge {
	b := openBridge(t, c, owner)
	waitStore(t, b)
	return b
}

func waitStore(t testing.TB, b *Bridge) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for b.storeHealth() != nil {
		require.True(t, time.Now().Before(deadline), "the store never came up: %v", b.storeHealth())
		time.Sleep(10 * time.Millisecond)
	}
}

func withSegment(c config.Config, segment int64) config.Config {
	c.Store.SegmentBytes = segment
	return c
}

// entries are the mirror's entries of the chain of tokens.
func entries(m *Model, tokens []int32) []directory.Entry {
	root := key.Root(m.fp, key.Scope{})
	return m.match(root, key.Chain(root, tokens, m.geo.BlockTokens))
}

func TestStoreRoundTrip(t *testing.T) {
	m := mastertest.Start(t, mastertest.Options{})
	cfg := storeConfig(t, m, 1, 32<<20)
	a, b := storeBridge(t, cfg, "a"), storeBridge(t, withSegment(cfg, 0), "b")
	src := newHost(t, 3, 64, 32, 48, true)
	dst := newHost(t, 3, 64, 32, 48, true)
	ma, mb := register(t, a, src, 4), register(t, b, dst, 4)
	r := rand.New(rand.NewSource(21))
	tokens := kvtest.Tokens(r, 22)
	cells := kvtest.ScatteredCells(r, len(tokens), 64)
	src.Fill(tokens, cells)
	res := saveAll(t, ma, src, key.Scope{}, tokens, cells)
	require.Equal(t, 5, res.Published, "%+v", res)
	assert.Equal(t, int64(5), a.Stats().StorePuts)

	es := entries(mb, tokens)
	require.Len(t, es, 5, "b's mirror holds a's blocks")
	for _, e := range es {
		master, writer, ok := parseStoreSegment(e.Loc.Segment)
		require.True(t, ok, "the entry names the store: %+v", e.Loc)
		assert.Equal(t, m.Addr(), master)
		assert.Equal(t, a.StoreSegment(), writer)
		segs, err := m.Segments(storeKey(e.Key))
		require.NoError(t, err)
		assert.Equal(t, []string{a.StoreSegment()}, segs, "one replica, in the writer's own segment")
	}
	assert.Equal(t, linkStoreHost, b.linkFor(es[0]), "another process of this host")
	assert.Equal(t, "local", a.linkFor(es[0]), "the writer's own pool")

	dst.Scribble()
	dcells := kvtest.ScatteredCells(rand.New(rand.NewSource(2)), 20, 64)
	got, err := loadAll(t, mb, dst, key.Scope{}, tokens[:20], dcells)
	require.NoError(t, err)
	require.Equal(t, 20, got.OKTokens, "%+v", got)
	require.NoError(t, dst.Check(tokens[:20], dcells, 20))
	assert.Equal(t, int64(5), b.Stats().StoreGets, "b read every block from the store")

	// The writer restores from its own pool, not through the store.
	back := newHost(t, 3, 64, 32, 48, true)
	got, err = loadAll(t, ma, back, key.Scope{}, tokens[:20], kvtest.SeqCells(20))
	require.NoError(t, err)
	require.Equal(t, 20, got.OKTokens)
	require.NoError(t, back.Check(tokens[:20], kvtest.SeqCells(20), 20))
	assert.Zero(t, a.Stats().StoreGets)

	// A block evicted from the writer's pool stays published: the store
	// holds it.
	require.NoError(t, a.hold.Evict(a.hold.Size()))
	n, _, _ := a.Resident()
	require.Zero(t, n)
	require.NoError(t, a.Flush(context.Background()))
	require.Len(t, entries(ma, tokens), 5, "eviction unpublishes nothing")
	got, err = loadAll(t, ma, back, key.Scope{}, tokens[:20], kvtest.SeqCells(20))
	require.NoError(t, err)
	require.Equal(t, 20, got.OKTokens)
	assert.Equal(t, int64(5), a.Stats().StoreGets, "evicted here, read from the store")
}

// With two replicas a prefix outlives the process that computed it and one
// more: the keeper of a surviving process publishes the entries again,
// and a new process restores them. A writer that contributes a segment
// holds the first replica itself; one that does not leaves both to
// others.
func TestStoreReplicasOutliveTheWriter(t *testing.T) {
	for _, tc := range []struct {
		name          string
		writerSegment int64
	}{{"writer holds the first", 32 << 20}, {"writer holds none", 0}} {
		t.Run(tc.name, func(t *testing.T) {
			m := mastertest.Start(t, mastertest.Options{ClientTTL: 2 * time.Second})
			cfg := storeConfig(t, m, 2, 32<<20)
			a, err := Open(withOwner(withSegment(cfg, tc.writerSegment), "a"), Deps{})
			require.NoError(t, err)
			waitStore(t, a)
			keeperNode := storeBridge(t, cfg, "keeper")
			require.NoError(t, keeperNode.WatchStore())
			other, err := Open(withOwner(cfg, "other"), Deps{})
			require.NoError(t, err)
			waitStore(t, other)
			src := newHost(t, 2, 64, 32, 32, false)
			ma := register(t, a, src, 4)
			tokens := kvtest.Tokens(rand.New(rand.NewSource(5)), 16)
			src.Fill(tokens, kvtest.SeqCells(16))
			saveAll(t, ma, src, key.Scope{}, tokens, kvtest.SeqCells(16))
			es := entries(ma, tokens)
			require.Len(t, es, 4)
			for _, e := range es {
				segs, err := m.Segments(storeKey(e.Key))
				require.NoError(t, err)
				require.Len(t, segs, 2, "two replicas")
				if tc.writerSegment > 0 {
					assert.Contains(t, segs, a.StoreSegment(), "the first in the writer's segment")
				} else {
					assert.ElementsMatch(t, []string{keeperNode.StoreSegment(), other.StoreSegment()}, segs)
				}
			}

			// The writer exits; where it held no replica, one of the two
			// holders goes too.
			c := storeBridge(t, withSegment(cfg, 0), "c")
			dst := newHost(t, 2, 64, 32, 32, false)
			mc := register(t, c, dst, 4)
			require.NoError(t, a.Close())
			gone := map[string]bool{"a": true}
			if tc.writerSegment == 0 {
				require.NoError(t, other.Close())
				gone["other"] = true
			} else {
				t.Cleanup(func() { _ = other.Close() })
			}
			waitFor(t, "the survivors to publish the blocks again", func() bool {
				es := entries(mc, tokens)

				for _, e := range es {
					if gone[e.Loc.Owner] {
						return false
					}
				}
				return len(es) == 4
			})
			dst.Scribble()
			res, err := loadAll(t, mc, dst, key.Scope{}, tokens, kvtest.SeqCells(16))
			require.NoError(t, err)
			require.Equal(t, 16, res.OKTokens, "%+v", res)
			require.NoError(t, dst.Check(tokens, kvtest.SeqCells(16), 16))
		})
	}
}

// Blocks the store loses (here removed behind the bridges' backs) leave
// every mirror and the owner's directory entries at the next audit; a copy
// the owner's pool still holds goes back into the store by itself.
func TestStoreAuditDropsLostBlocks(t *testing.T) {
	m := mastertest.Start(t, mastertest.Options{})
	cfg := storeConfig(t, m, 1, 32<<20)
	a, b := storeBridge(t, cfg, "a"), storeBridge(t, withSegment(cfg, 0), "b")
	h := newHost(t, 2, 32, 16, 16, false)
	ma, mb := register(t, a, h, 4), register(t, b, h, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(6)), 8)
	h.Fill(tokens, kvtest.SeqCells(8))
	saveAll(t, ma, h, key.Scope{}, tokens, kvtest.SeqCells(8))
	require.Len(t, entries(mb, tokens), 2)
	remove := func() {
		for _, e := range entries(ma, tokens) {
			require.NoError(t, a.store.conn.Load().c.Remove(context.Background(), storeKey(e.Key), true))
		}
	}

	remove()
	waitFor(t, "the owner to put its copies back", func() bool {
		return a.Stats().StoreDropped >= 2 && a.Stats().StorePuts == 4 && len(entries(mb, tokens)) == 2
	})
	got, err := loadAll(t, mb, newHost(t, 2, 32, 16, 16, false), key.Scope{}, tokens, kvtest.SeqCells(8))
	require.NoError(t, err)
	assert.Equal(t, 8, got.OKTokens, "b restores the blocks put back")

	require.NoError(t, a.hold.Evict(a.hold.Size()))
	remove()
	waitFor(t, "the audits to drop the lost blocks", func() bool { return mb.Mirrored() == 0 && ma.Mirrored() == 0 })
	p, err := mb.Lookup(key.Scope{}, tokens, 0)
	require.NoError(t, err)
	assert.Zero(t, p.MatchedBlocks)
}

// With the master gone, saves keep their blocks in the pool (pending,
// restorable here), lookups match no store block (a load would only fail),
// and mcbridge_up says why.
func TestStoreMasterDown(t *testing.T) {
	m := mastertest.Start(t, mastertest.Options{})
	cfg := storeConfig(t, m, 1, 32<<20)
	cfg.TransferTimeoutMS = 2000
	a, b := storeBridge(t, cfg, "a"), storeBridge(t, withSegment(cfg, 0), "b")
	h := newHost(t, 2, 32, 16, 16, false)
	ma, mb := register(t, a, h, 4), register(t, b, h, 4)
	r := rand.New(rand.NewSource(8))
	before := kvtest.Tokens(r, 8)
	h.Fill(before, kvtest.SeqCells(8))
	saveAll(t, ma, h, key.Scope{}, before, kvtest.SeqCells(8))
	require.Len(t, entries(mb, before), 2)

	m.Kill()
	waitFor(t, "the bridges to notice", func() bool { return a.Health() != nil && b.Health() != nil })
	assert.Contains(t, a.Health().Error(), "Mooncake Store")

	during := kvtest.Tokens(r, 8)
	h.Fill(during, kvtest.SeqCells(8))
	res := saveAll(t, ma, h, key.Scope{}, during, kvtest.SeqCells(8))
	assert.Zero(t, res.Published, "nothing reaches the directory: %+v", res)
	assert.Equal(t, int64(2), a.Stats().StorePutFailures)
	got, err := loadAll(t, ma, newHost(t, 2, 32, 16, 16, false), key.Scope{}, during, kvtest.SeqCells(8))
	require.NoError(t, err, "the writer restores its own pending blocks")
	assert.Equal(t, 8, got.OKTokens)

	// What b cannot read now, it does not match: its requests compute.
	p, err := mb.Lookup(key.Scope{}, append(before, 1), 0)
	require.NoError(t, err)
	assert.Zero(t, p.MatchedBlocks)
	_, err = mb.LoadBegin(key.Scope{}, h.Layout(), before, kvtest.SeqCells(8))
	assert.Equal(t, status.NotFound, status.Of(err), "%v", err)
	assert.Equal(t, 2, mb.Mirrored(), "the mirror keeps the entries for when the master returns")
}

// A block whose bytes in the store are not what its entry promises is
// refused: the load keeps the verified prefix before it.
func TestStoreRefusesCorruptBlocks(t *testing.T) {
	m := mastertest.Start(t, mastertest.Options{})
	cfg := storeConfig(t, m, 1, 32<<20)
	cfg.Store.AuditIntervalMS = 3600e3 // the swap below is not the store losing the block
	a, b := storeBridge(t, cfg, "a"), storeBridge(t, withSegment(cfg, 0), "b")
	h := newHost(t, 2, 32, 16, 16, false)
	ma, mb := register(t, a, h, 4), register(t, b, h, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(9)), 12)
	h.Fill(tokens, kvtest.SeqCells(12))
	saveAll(t, ma, h, key.Scope{}, tokens, kvtest.SeqCells(12))
	es := entries(ma, tokens)
	require.Len(t, es, 3)

	// Overwrite block 1 in the store with a copy whose last layer has a
	// flipped byte (put_from of an existing key replaces nothing, so the
	// key goes first).
	sl, ok := a.hold.Get(es[1].Key)
	require.True(t, ok)
	bad := append([]byte(nil), a.hold.Bytes(sl.Off, sl.Size)...)
	bad[ma.geo.LayerOffset(ma.geo.Layers()-1)+1] ^= 0xff
	ctx := context.Background()
	require.NoError(t, a.store.conn.Load().c.Remove(ctx, storeKey(es[1].Key), true))
	require.NoError(t, a.store.conn.Load().c.Put(ctx, storeKey(es[1].Key), bad, mcstore.PutOptions{}))

	got, err := loadAll(t, mb, newHost(t, 2, 32, 16, 16, false), key.Scope{}, tokens, kvtest.SeqCells(12))
	require.Error(t, err)
	assert.Equal(t, status.Corrupt, status.Of(err), "%v", err)
	assert.Equal(t, 4, got.OKTokens, "the block before the corrupt one restores")
}

// A bridge without a store matches no store entry: it could not read one.
func TestStoreEntriesNeedTheStore(t *testing.T) {
	m := mastertest.Start(t, mastertest.Options{})
	cfg := storeConfig(t, m, 1, 32<<20)
	a := storeBridge(t, cfg, "a")
	plain := cfg
	plain.Store = config.Default().Store
	b := openBridge(t, plain, "b")
	h := newHost(t, 2, 32, 16, 16, false)
	ma, mb := register(t, a, h, 4), register(t, b, h, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(10)), 9)
	h.Fill(tokens, kvtest.SeqCells(9))
	saveAll(t, ma, h, key.Scope{}, tokens[:8], kvtest.SeqCells(8))
	p, err := mb.Lookup(key.Scope{}, tokens, 0)
	require.NoError(t, err)
	assert.Zero(t, p.MatchedBlocks)
	_, err = mb.LoadBegin(key.Scope{}, h.Layout(), tokens[:8], kvtest.SeqCells(8))
	assert.Equal(t, status.NotFound, status.Of(err))
	assert.Equal(t, int(2), mb.Mirrored(), "the mirror still knows them")
}

// A wrong library fails the bridge's open; a master nobody runs does not:
// the bridge serves its own pool, says why the store is out, and joins the
// master once it comes, offering the blocks it saved meanwhile.
func TestStoreConnectsInTheBackground(t *testing.T) {
	m := mastertest.Start(t, mastertest.Options{})
	cfg := storeConfig(t, m, 1, 0)
	cfg.Store.Lib = "/nonexistent/libmooncake_store.so"
	_, err := Open(cfg, Deps{})
	assert.Equal(t, status.Config, status.Of(err), "%v", err)

	m.Kill()
	cfg = storeConfig(t, m, 1, 32<<20)
	cfg.Store.SetupTimeoutMS = 3000
	a := openBridge(t, cfg, "a")
	require.Error(t, a.Health())
	assert.Contains(t, a.Health().Error(), "Mooncake Store", "%v", a.Health())
	h := newHost(t, 2, 32, 16, 16, false)
	ma := register(t, a, h, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(14)), 8)
	h.Fill(tokens, kvtest.SeqCells(8))
	res := saveAll(t, ma, h, key.Scope{}, tokens, kvtest.SeqCells(8))
	assert.Zero(t, res.Published, "nothing published without the store: %+v", res)
	got, err := loadAll(t, ma, newHost(t, 2, 32, 16, 16, false), key.Scope{}, tokens, kvtest.SeqCells(8))
	require.NoError(t, err)
	assert.Equal(t, 8, got.OKTokens, "restorable here")

	m.Restart()
	waitStore(t, a)
	waitFor(t, "the pending blocks to reach the store", func() bool { return a.Stats().StorePuts == 2 && a.Stats().SavedBlocks == 2 })
	b := storeBridge(t, withSegment(cfg, 0), "b")
	mb := register(t, b, h, 4)
	got, err = loadAll(t, mb, newHost(t, 2, 32, 16, 16, false), key.Scope{}, tokens, kvtest.SeqCells(8))
	require.NoError(t, err)
	assert.Equal(t, 8, got.OKTokens)
	assert.Equal(t, int64(2), b.Stats().StoreGets)
}

func FuzzParseStoreSegment(f *testing.F) {
	for _, s := range []string{"", "mooncake-store://", "mooncake-store://h:1/", "mooncake-store://h:1/127.0.0.1:13000",
		"mooncake-store:///x", "127.0.0.1:13000", "mooncake-store://a/b/c"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, seg string) {
		master, writer, ok := parseStoreSegment(seg)
		if !ok {
			return
		}
		require.NotEmpty(t, master)
		require.NotContains(t, master, "/")
		require.Equal(t, seg, storeSegment(master, writer), "parse then format gives the input back")
	})
}

// Between the store taking a block and the directory answering for it, the
// writer finds it through its resident blocks, whose entries already name
// the store, and restores it from its own pool.
func TestStoreBlocksBeforeTheDirectoryAnswers(t *testing.T) {
	m := mastertest.Start(t, mastertest.Options{})
	cfg := storeConfig(t, m, 1, 32<<20)
	cfg.Directory.OpTimeoutMS = int(time.Hour / time.Millisecond)
	dir := &stuckDirectory{Directory: directory.OpenMemory(cfg.Directory.Name), release: make(chan struct{})}
	defer dir.Close()
	b, err := Open(withOwner(cfg, "a"), Deps{Directory: dir})
	require.NoError(t, err)
	waitStore(t, b)
	h := newHost(t, 2, 32, 16, 16, false)
	mb := register(t, b, h, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(12)), 9)
	h.Fill(tokens, kvtest.SeqCells(9))
	sv, err := mb.SaveBegin(key.Scope{}, h.Layout(), tokens, kvtest.SeqCells(9))
	require.NoError(t, err)
	for l := range h.K {
		require.NoError(t, sv.SaveLayer(l))
	}
	_, err = sv.End()
	require.NoError(t, err)
	waitFor(t, "the store to take the blocks", func() bool { return b.Stats().StorePuts == 2 })
	waitFor(t, "the publisher to wait on the directory", func() bool { return dir.calls.Load() > 0 })
	es := entries(mb, tokens)
	require.Len(t, es, 2)
	assert.True(t, b.store.names(es[0].Loc), "the resident entry names the store")
	p, err := mb.Lookup(key.Scope{}, tokens, 0)
	require.NoError(t, err)
	assert.Equal(t, 2, p.MatchedBlocks)
	got, err := loadAll(t, mb, newHost(t, 2, 32, 16, 16, false), key.Scope{}, tokens[:8], kvtest.SeqCells(8))
	require.NoError(t, err)
	assert.Equal(t, 8, got.OKTokens)
	assert.Zero(t, b.Stats().StoreGets, "read from the own pool")
	close(dir.release)
	require.NoError(t, b.Close())
}

// The store's library and the real Transfer Engine's load into one process
// (each RTLD_LOCAL, each with its own engine) and work side by side.
func TestStoreBesideTheTransferEngine(t *testing.T) {
	te := os.Getenv("MCB_TE_REAL_LIB")
	require.NotEmpty(t, te, "MCB_TE_REAL_LIB is unset: it names the real libtransfer_engine.so (make test sets it)")
	m := mastertest.Start(t, mastertest.Options{})
	cfg := storeConfig(t, m, 1, 32<<20)
	cfg.Transport.Kind, cfg.Transport.Lib = "mooncake", te
	a, b := storeBridge(t, cfg, "a"), storeBridge(t, withSegment(cfg, 0), "b")
	h := newHost(t, 2, 32, 16, 16, false)
	ma, mb := register(t, a, h, 4), register(t, b, h, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(13)), 8)
	h.Fill(tokens, kvtest.SeqCells(8))
	saveAll(t, ma, h, key.Scope{}, tokens, kvtest.SeqCells(8))
	dst := newHost(t, 2, 32, 16, 16, false)
	got, err := loadAll(t, mb, dst, key.Scope{}, tokens, kvtest.SeqCells(8))
	require.NoError(t, err)
	require.Equal(t, 8, got.OKTokens)
	require.NoError(t, dst.Check(tokens, kvtest.SeqCells(8), 8))
	assert.Equal(t, int64(2), b.Stats().StoreGets)
}
