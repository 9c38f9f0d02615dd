package bridge_test

import (
	"context"
	"math/rand"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/bridge/bridgetest"
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
	c := bridgetest.Config(t)
	c.Store.Kind, c.Store.Master, c.Store.Lib = "mooncake", m.Addr(), mastertest.Lib(t)
	c.Store.Replicas, c.Store.SegmentBytes = replicas, segment
	c.Store.AuditIntervalMS = 100
	return c
}

// storeBridge opens a bridge and waits until its store client is set up
// (it connects in the background).
func storeBridge(t testing.TB, c config.Config, owner string) *bridge.Bridge {
	b := bridgetest.Open(t, c, owner)
	waitStore(t, b)
	return b
}

func waitStore(t testing.TB, b *bridge.Bridge) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for b.StoreHealth() != nil {
		require.True(t, time.Now().Before(deadline), "the store never came up: %v", b.StoreHealth())
		time.Sleep(10 * time.Millisecond)
	}
}

func withSegment(c config.Config, segment int64) config.Config {
	c.Store.SegmentBytes = segment
	return c
}

// entries are the mirror's entries of the chain of tokens.
func entries(m *bridge.Model, tokens []int32) []directory.Entry {
	root := key.Root(m.Fingerprint(), key.Scope{})
	return m.Match(root, key.Chain(root, tokens, m.BlockTokens()))
}

func TestStoreRoundTrip(t *testing.T) {
	m := mastertest.Start(t, mastertest.Options{})
	cfg := storeConfig(t, m, 1, 32<<20)
	a, b := storeBridge(t, cfg, "a"), storeBridge(t, withSegment(cfg, 0), "b")
	src := kvtest.New(t, 3, 64, 32, 48, true)
	dst := kvtest.New(t, 3, 64, 32, 48, true)
	ma, mb := bridgetest.Register(t, a, src, 4), bridgetest.Register(t, b, dst, 4)
	r := rand.New(rand.NewSource(21))
	tokens := kvtest.Tokens(r, 22)
	cells := kvtest.ScatteredCells(r, len(tokens), 64)
	src.Fill(tokens, cells)
	res := bridgetest.SaveAll(t, ma, src, key.Scope{}, tokens, cells)
	require.Equal(t, 5, res.Published, "%+v", res)
	assert.Equal(t, int64(5), a.Stats().StorePuts)

	es := entries(mb, tokens)
	require.Len(t, es, 5, "b's mirror holds a's blocks")
	for _, e := range es {
		master, writer, ok := bridge.ParseStoreSegment(e.Loc.Segment)
		require.True(t, ok, "the entry names the store: %+v", e.Loc)
		assert.Equal(t, m.Addr(), master)
		assert.Equal(t, a.StoreSegment(), writer)
		segs, err := m.Segments(bridge.StoreKey(e.Key))
		require.NoError(t, err)
		assert.Equal(t, []string{a.StoreSegment()}, segs, "one replica, in the writer's own segment")
	}
	assert.Equal(t, bridge.LinkStoreHost, b.LinkFor(es[0]), "another process of this host")
	assert.Equal(t, "local", a.LinkFor(es[0]), "the writer's own pool")

	dst.Scribble()
	dcells := kvtest.ScatteredCells(rand.New(rand.NewSource(2)), 20, 64)
	got, err := bridgetest.LoadAll(t, mb, dst, key.Scope{}, tokens[:20], dcells)
	require.NoError(t, err)
	require.Equal(t, 20, got.OKTokens, "%+v", got)
	require.NoError(t, dst.Check(tokens[:20], dcells, 20))
	assert.Equal(t, int64(5), b.Stats().StoreGets, "b read every block from the store")

	// The writer restores from its own pool, not through the store.
	back := kvtest.New(t, 3, 64, 32, 48, true)
	got, err = bridgetest.LoadAll(t, ma, back, key.Scope{}, tokens[:20], kvtest.SeqCells(20))
	require.NoError(t, err)
	require.Equal(t, 20, got.OKTokens)
	require.NoError(t, back.Check(tokens[:20], kvtest.SeqCells(20), 20))
	assert.Zero(t, a.Stats().StoreGets)

	// A block evicted from the writer's pool stays published: the store
	// holds it.
	require.NoError(t, a.Holdings().Evict(a.Holdings().Size()))
	n, _, _ := a.Resident()
	require.Zero(t, n)
	require.NoError(t, a.Flush(context.Background()))
	require.Len(t, entries(ma, tokens), 5, "eviction unpublishes nothing")
	got, err = bridgetest.LoadAll(t, ma, back, key.Scope{}, tokens[:20], kvtest.SeqCells(20))
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
			a, err := bridge.Open(bridgetest.WithOwner(withSegment(cfg, tc.writerSegment), "a"), bridge.Deps{})
			require.NoError(t, err)
			waitStore(t, a)
			keeperNode := storeBridge(t, cfg, "keeper")
			require.NoError(t, keeperNode.WatchStore())
			other, err := bridge.Open(bridgetest.WithOwner(cfg, "other"), bridge.Deps{})
			require.NoError(t, err)
			waitStore(t, other)
			src := kvtest.New(t, 2, 64, 32, 32, false)
			ma := bridgetest.Register(t, a, src, 4)
			tokens := kvtest.Tokens(rand.New(rand.NewSource(5)), 16)
			src.Fill(tokens, kvtest.SeqCells(16))
			bridgetest.SaveAll(t, ma, src, key.Scope{}, tokens, kvtest.SeqCells(16))
			es := entries(ma, tokens)
			require.Len(t, es, 4)
			for _, e := range es {
				segs, err := m.Segments(bridge.StoreKey(e.Key))
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
			dst := kvtest.New(t, 2, 64, 32, 32, false)
			mc := bridgetest.Register(t, c, dst, 4)
			require.NoError(t, a.Close())
			gone := map[string]bool{"a": true}
			if tc.writerSegment == 0 {
				require.NoError(t, other.Close())
				gone["other"] = true
			} else {
				t.Cleanup(func() { _ = other.Close() })
			}
			bridgetest.WaitFor(t, "the survivors to publish the blocks again", func() bool {
				es := entries(mc, tokens)

				for _, e := range es {
					if gone[e.Loc.Owner] {
						return false
					}
				}
				return len(es) == 4
			})
			dst.Scribble()
			res, err := bridgetest.LoadAll(t, mc, dst, key.Scope{}, tokens, kvtest.SeqCells(16))
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
	h := kvtest.New(t, 2, 32, 16, 16, false)
	ma, mb := bridgetest.Register(t, a, h, 4), bridgetest.Register(t, b, h, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(6)), 8)
	h.Fill(tokens, kvtest.SeqCells(8))
	bridgetest.SaveAll(t, ma, h, key.Scope{}, tokens, kvtest.SeqCells(8))
	require.Len(t, entries(mb, tokens), 2)
	remove := func() {
		for _, e := range entries(ma, tokens) {
			require.NoError(t, a.StoreClient().Remove(context.Background(), bridge.StoreKey(e.Key), true))
		}
	}

	remove()
	bridgetest.WaitFor(t, "the owner to put its copies back", func() bool {
		return a.Stats().StoreDropped >= 2 && a.Stats().StorePuts == 4 && len(entries(mb, tokens)) == 2
	})
	got, err := bridgetest.LoadAll(t, mb, kvtest.New(t, 2, 32, 16, 16, false), key.Scope{}, tokens, kvtest.SeqCells(8))
	require.NoError(t, err)
	assert.Equal(t, 8, got.OKTokens, "b restores the blocks put back")

	// A put-back pins its blocks until the library has read them, and the
	// tracker that unpins them runs a moment after StorePuts counts them.
	bridgetest.WaitFor(t, "a's pool to let go of its blocks", func() bool {
		return a.Holdings().Evict(a.Holdings().Size()) == nil
	})
	remove()
	bridgetest.WaitFor(t, "the audits to drop the lost blocks", func() bool { return mb.Mirrored() == 0 && ma.Mirrored() == 0 })
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
	h := kvtest.New(t, 2, 32, 16, 16, false)
	ma, mb := bridgetest.Register(t, a, h, 4), bridgetest.Register(t, b, h, 4)
	r := rand.New(rand.NewSource(8))
	before := kvtest.Tokens(r, 8)
	h.Fill(before, kvtest.SeqCells(8))
	bridgetest.SaveAll(t, ma, h, key.Scope{}, before, kvtest.SeqCells(8))
	require.Len(t, entries(mb, before), 2)

	m.Kill()
	bridgetest.WaitFor(t, "the bridges to notice", func() bool { return a.Health() != nil && b.Health() != nil })
	assert.Contains(t, a.Health().Error(), "Mooncake Store")

	during := kvtest.Tokens(r, 8)
	h.Fill(during, kvtest.SeqCells(8))
	res := bridgetest.SaveAll(t, ma, h, key.Scope{}, during, kvtest.SeqCells(8))
	assert.Zero(t, res.Published, "nothing reaches the directory: %+v", res)
	assert.Equal(t, int64(2), a.Stats().StorePutFailures)
	got, err := bridgetest.LoadAll(t, ma, kvtest.New(t, 2, 32, 16, 16, false), key.Scope{}, during, kvtest.SeqCells(8))
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
	h := kvtest.New(t, 2, 32, 16, 16, false)
	ma, mb := bridgetest.Register(t, a, h, 4), bridgetest.Register(t, b, h, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(9)), 12)
	h.Fill(tokens, kvtest.SeqCells(12))
	bridgetest.SaveAll(t, ma, h, key.Scope{}, tokens, kvtest.SeqCells(12))
	es := entries(ma, tokens)
	require.Len(t, es, 3)

	// Overwrite block 1 in the store with a copy whose last layer has a
	// flipped byte (put_from of an existing key replaces nothing, so the
	// key goes first).
	sl, ok := a.Holdings().Get(es[1].Key)
	require.True(t, ok)
	bad := append([]byte(nil), a.Holdings().Bytes(sl.Off, sl.Size)...)
	bad[ma.Geometry().LayerOffset(ma.Geometry().Layers()-1)+1] ^= 0xff
	ctx := context.Background()
	require.NoError(t, a.StoreClient().Remove(ctx, bridge.StoreKey(es[1].Key), true))
	require.NoError(t, a.StoreClient().Put(ctx, bridge.StoreKey(es[1].Key), bad, mcstore.PutOptions{}))

	got, err := bridgetest.LoadAll(t, mb, kvtest.New(t, 2, 32, 16, 16, false), key.Scope{}, tokens, kvtest.SeqCells(12))
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
	b := bridgetest.Open(t, plain, "b")
	h := kvtest.New(t, 2, 32, 16, 16, false)
	ma, mb := bridgetest.Register(t, a, h, 4), bridgetest.Register(t, b, h, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(10)), 9)
	h.Fill(tokens, kvtest.SeqCells(9))
	bridgetest.SaveAll(t, ma, h, key.Scope{}, tokens[:8], kvtest.SeqCells(8))
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
	_, err := bridge.Open(cfg, bridge.Deps{})
	assert.Equal(t, status.Config, status.Of(err), "%v", err)

	m.Kill()
	cfg = storeConfig(t, m, 1, 32<<20)
	cfg.Store.SetupTimeoutMS = 3000
	a := bridgetest.Open(t, cfg, "a")
	require.Error(t, a.Health())
	assert.Contains(t, a.Health().Error(), "Mooncake Store", "%v", a.Health())
	h := kvtest.New(t, 2, 32, 16, 16, false)
	ma := bridgetest.Register(t, a, h, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(14)), 8)
	h.Fill(tokens, kvtest.SeqCells(8))
	res := bridgetest.SaveAll(t, ma, h, key.Scope{}, tokens, kvtest.SeqCells(8))
	assert.Zero(t, res.Published, "nothing published without the store: %+v", res)
	got, err := bridgetest.LoadAll(t, ma, kvtest.New(t, 2, 32, 16, 16, false), key.Scope{}, tokens, kvtest.SeqCells(8))
	require.NoError(t, err)
	assert.Equal(t, 8, got.OKTokens, "restorable here")

	m.Restart()
	waitStore(t, a)
	bridgetest.WaitFor(t, "the pending blocks to reach the store", func() bool { return a.Stats().StorePuts == 2 && a.Stats().SavedBlocks == 2 })
	b := storeBridge(t, withSegment(cfg, 0), "b")
	mb := bridgetest.Register(t, b, h, 4)
	got, err = bridgetest.LoadAll(t, mb, kvtest.New(t, 2, 32, 16, 16, false), key.Scope{}, tokens, kvtest.SeqCells(8))
	require.NoError(t, err)
	assert.Equal(t, 8, got.OKTokens)
	assert.Equal(t, int64(2), b.Stats().StoreGets)
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
	b, err := bridge.Open(bridgetest.WithOwner(cfg, "a"), bridge.Deps{Directory: dir})
	require.NoError(t, err)
	waitStore(t, b)
	h := kvtest.New(t, 2, 32, 16, 16, false)
	mb := bridgetest.Register(t, b, h, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(12)), 9)
	h.Fill(tokens, kvtest.SeqCells(9))
	sv, err := mb.SaveBegin(key.Scope{}, h.Layout(), tokens, kvtest.SeqCells(9))
	require.NoError(t, err)
	for l := range h.K {
		require.NoError(t, sv.SaveLayer(l))
	}
	_, err = sv.End()
	require.NoError(t, err)
	bridgetest.WaitFor(t, "the store to take the blocks", func() bool { return b.Stats().StorePuts == 2 })
	bridgetest.WaitFor(t, "the publisher to wait on the directory", func() bool { return dir.calls.Load() > 0 })
	es := entries(mb, tokens)
	require.Len(t, es, 2)
	assert.True(t, b.StoreNames(es[0].Loc), "the resident entry names the store")
	p, err := mb.Lookup(key.Scope{}, tokens, 0)
	require.NoError(t, err)
	assert.Equal(t, 2, p.MatchedBlocks)
	got, err := bridgetest.LoadAll(t, mb, kvtest.New(t, 2, 32, 16, 16, false), key.Scope{}, tokens[:8], kvtest.SeqCells(8))
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
	h := kvtest.New(t, 2, 32, 16, 16, false)
	ma, mb := bridgetest.Register(t, a, h, 4), bridgetest.Register(t, b, h, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(13)), 8)
	h.Fill(tokens, kvtest.SeqCells(8))
	bridgetest.SaveAll(t, ma, h, key.Scope{}, tokens, kvtest.SeqCells(8))
	dst := kvtest.New(t, 2, 32, 16, 16, false)
	got, err := bridgetest.LoadAll(t, mb, dst, key.Scope{}, tokens, kvtest.SeqCells(8))
	require.NoError(t, err)
	require.Equal(t, 8, got.OKTokens)
	require.NoError(t, dst.Check(tokens, kvtest.SeqCells(8), 8))
	assert.Equal(t, int64(2), b.Stats().StoreGets)
}
