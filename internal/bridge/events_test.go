package bridge_test

import (
	"math/rand"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/bridge/bridgetest"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvevents"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/storenode"
)

// sinkCall is one call the bridge made on its event sink.
type sinkCall struct {
	op     string // stored, removed, clear
	model  string
	block  int
	key    key.BlockKey
	hashes []uint64 // the stored block's chain, up to it
	keys   []key.BlockKey
}

type recordingSink struct {
	mu    sync.Mutex
	calls []sinkCall
}

func (r *recordingSink) Stored(model string, blockTokens int, blocks []kvevents.Block) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, b := range blocks {
		r.calls = append(r.calls, sinkCall{op: "stored", model: model, block: blockTokens, key: b.Key, hashes: b.Chain.Hashes[:b.Index+1]})
	}
}

func (r *recordingSink) Model(model string, blockTokens int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, sinkCall{op: "model", model: model, block: blockTokens})
}

func (r *recordingSink) Removed(keys []key.BlockKey) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, sinkCall{op: "removed", keys: append([]key.BlockKey(nil), keys...)})
}

func (r *recordingSink) Clear() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, sinkCall{op: "clear"})
}

// take returns the calls so far and forgets them.
func (r *recordingSink) take() []sinkCall {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.calls
	r.calls = nil
	return c
}

func openWithSink(t *testing.T, cfg config.Config, owner string) (*bridge.Bridge, *recordingSink) {
	sink := &recordingSink{}
	cfg.Owner = owner
	b, err := bridge.Open(cfg, bridge.Deps{Events: sink})
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Close() })
	return b, sink
}

func storedKeys(calls []sinkCall) []key.BlockKey {
	var out []key.BlockKey
	for _, c := range calls {
		if c.op == "stored" {
			out = append(out, c.key)
		}
	}
	return out
}

func TestEventsFollowWhatThisProcessAnswersFor(t *testing.T) {
	cfg := bridgetest.Config(t)
	a, sa := openWithSink(t, cfg, "a")
	b, sb := openWithSink(t, cfg, "b")
	h := kvtest.New(t, 2, 64, 16, 16, false)
	sp := bridgetest.Spec(h, 4)
	sp.Name = "tiny"
	ma, err := a.RegisterModel(sp)
	require.NoError(t, err)
	mb, err := b.RegisterModel(sp)
	require.NoError(t, err)
	require.Equal(t, []sinkCall{{op: "model", model: "tiny", block: 4}}, sa.take(), "registering starts the model's events")
	sb.take()
	tokens := kvtest.Tokens(rand.New(rand.NewSource(5)), 16)
	h.Fill(tokens, kvtest.SeqCells(16))
	seed := cfg.KVEvents.HashSeed
	want := key.MooncakeHashes(tokens, 4, seed)
	chain := key.Chain(key.Root(ma.Fingerprint(), key.Scope{}), tokens, 4)

	bridgetest.SaveAll(t, ma, h, key.Scope{}, tokens[:8], kvtest.SeqCells(8))
	calls := sa.take()
	require.Len(t, calls, 2, "%+v", calls)
	for i, c := range calls {
		require.Equal(t, sinkCall{op: "stored", model: "tiny", block: 4, key: chain[i], hashes: want[:i+1]}, c)
	}

	// b writes blocks 2 and 3 under a's two: each carries the chain from
	// position 0, a's blocks included.
	bridgetest.SaveAll(t, mb, h, key.Scope{}, tokens, kvtest.SeqCells(16))
	calls = sb.take()
	require.Equal(t, []key.BlockKey{chain[2], chain[3]}, storedKeys(calls))
	require.Equal(t, want, calls[1].hashes)
	require.Empty(t, sa.take())

	// Under a tenant salt or an adapter nothing is announced.
	for _, sc := range []key.Scope{{TenantSalt: []byte("t")}, {Adapters: "lora@1"}} {
		res := bridgetest.SaveAll(t, ma, h, sc, tokens, kvtest.SeqCells(16))
		require.Equal(t, 4, res.Published, "%+v", sc)
		require.Empty(t, sa.take(), "%+v", sc)
	}

	// Two saves racing past the lookup: only the winner's blocks are
	// announced, by the winner.
	tok2 := kvtest.Tokens(rand.New(rand.NewSource(6)), 8)
	h.Fill(tok2, kvtest.SeqCells(8))
	var saves []*bridge.Save
	for _, m := range []*bridge.Model{ma, mb} {
		sv, err := m.SaveBegin(key.Scope{}, h.Layout(), tok2, kvtest.SeqCells(8))
		require.NoError(t, err)
		saves = append(saves, sv)
	}
	for _, sv := range saves {
		for l := range h.K {
			require.NoError(t, sv.SaveLayer(l))
		}
		_, err := sv.End()
		require.NoError(t, err)
	}
	bridgetest.Published(t, a, a.Stats())
	bridgetest.Published(t, b, b.Stats())
	ka, kb := storedKeys(sa.take()), storedKeys(sb.take())
	require.ElementsMatch(t, []int{0, 2}, []int{len(ka), len(kb)}, "a announced %d, b %d", len(ka), len(kb))
	require.NoError(t, b.Close())
	require.Equal(t, "clear", sb.take()[0].op, "close clears")
}

func TestEventsOnEviction(t *testing.T) {
	cfg := bridgetest.Config(t)
	cfg.PoolBytes = 1 << 20
	a, sa := openWithSink(t, cfg, "a")
	h := kvtest.New(t, 2, 4096, 1024, 1024, false)
	m := bridgetest.Register(t, a, h, 16) // 64 KiB blocks: a pool of fifteen
	sa.take()
	rng := rand.New(rand.NewSource(9))
	var first []key.BlockKey
	for i := range 16 {
		tokens := kvtest.Tokens(rng, 32)
		h.Fill(tokens, kvtest.SeqCells(32))
		bridgetest.SaveAll(t, m, h, key.Scope{}, tokens, kvtest.SeqCells(32))
		if i == 0 {
			first = key.Chain(key.Root(m.Fingerprint(), key.Scope{}), tokens, 16)
		}
	}
	var removed []key.BlockKey
	for _, c := range sa.take() {
		if c.op == "removed" {
			removed = append(removed, c.keys...)
		}
	}
	require.NotEmpty(t, removed, "the pool evicted")
	require.Subset(t, removed, first, "the oldest chain went first")
	require.Positive(t, a.Stats().Evictions)
}

// openStoreNode opens a bridge with an event sink as a replicating store
// node.
func openStoreNode(t *testing.T, cfg config.Config) (*bridge.Bridge, *recordingSink) {
	store, ss := openWithSink(t, cfg, "store")
	node, err := storenode.New(store, storenode.Config{})
	require.NoError(t, err)
	require.NoError(t, node.Replicate())
	return store, ss
}

func TestEventsOfAStoreNode(t *testing.T) {
	cfg := bridgetest.Config(t)
	store, ss := openStoreNode(t, cfg)
	a, ma, tokens := bridgetest.OwnerCopiedBy(t, cfg, store)
	require.Empty(t, ss.take(), "copies the owner still holds are not the store's to announce")

	require.NoError(t, a.Close())
	bridgetest.WaitFor(t, "the store to publish its copies", func() bool { return store.Stats().TakenOver == 5 })
	calls := ss.take()
	want := key.MooncakeHashes(tokens, 4, cfg.KVEvents.HashSeed)
	require.Len(t, calls, 5)
	got := map[uint64]bool{}
	for _, c := range calls {
		require.Equal(t, ma.Fingerprint().String(), c.model, "a store names models by fingerprint")
		require.Equal(t, want[:len(c.hashes)], c.hashes, "each copy's chain is read back from the copies above it")
		got[c.hashes[len(c.hashes)-1]] = true
	}
	require.Len(t, got, 5)
}

// A snapshot of a partial state is no block of tokens: neither its owner
// nor a store node that takes it over announces it to routers.
func TestEventsSkipSnapshots(t *testing.T) {
	cfg := bridgetest.Config(t)
	store, ss := openStoreNode(t, cfg)
	a, as := openWithSink(t, cfg, "a")
	src := kvtest.New(t, 3, 64, 32, 48, false)
	ma := registerPartial(t, a, src)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(11)), 20)
	src.Fill(tokens, kvtest.SeqCells(20))
	before := a.Stats()
	bridgetest.SaveAll(t, ma, src, key.Scope{}, tokens, kvtest.SeqCells(20))
	require.NoError(t, ma.SaveSnapshot(key.Scope{}, tokens[:16], partialState(tokens[:16], 500)))
	require.Equal(t, int64(6), bridgetest.Published(t, a, before), "5 blocks and the snapshot published")
	chain := key.Chain(key.Root(ma.Fingerprint(), key.Scope{}), tokens, 4)
	require.ElementsMatch(t, chain, storedKeys(as.take()), "the owner announces its blocks only")

	bridgetest.WaitFor(t, "the store to copy 6 blocks", func() bool { return store.Stats().Replicated == 6 })
	require.NoError(t, a.Close())
	bridgetest.WaitFor(t, "the store to take them over", func() bool { return store.Stats().TakenOver == 6 })
	require.ElementsMatch(t, chain, storedKeys(ss.take()), "the store announces the blocks it took over only")
}
