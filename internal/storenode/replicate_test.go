package storenode_test

import (
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge/bridgetest"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/storenode"
	"github.com/mcbridge/mcbridge/internal/transport"
)

func TestStoreOutlivesOwner(t *testing.T) {
	cfg := bridgetest.Config(t)
	store := replicating(t, cfg, "store", nil)
	a, _, tokens := bridgetest.OwnerCopiedBy(t, cfg, store.Bridge)

	// The owner exits: it unpublishes, and the store's copies take over.
	require.NoError(t, a.Close())
	bridgetest.WaitFor(t, "the store to publish its copies", func() bool { return store.Stats().TakenOver == 5 })

	c := bridgetest.Open(t, cfg, "c")
	dst := kvtest.New(t, 3, 64, 32, 48, true)
	mc := bridgetest.Register(t, c, dst, 4)
	dst.Scribble()
	res, err := bridgetest.LoadAll(t, mc, dst, key.Scope{}, tokens[:20], kvtest.SeqCells(20))
	require.NoError(t, err, "restore from the store")
	require.Equal(t, 20, res.OKTokens, "restore from the store: %+v", res)
	require.NoError(t, dst.Check(tokens, kvtest.SeqCells(20), 20))
}

func TestStoreRefusesCorruptCopies(t *testing.T) {
	cfg := bridgetest.Config(t)
	a := bridgetest.Open(t, cfg, "a")
	a.Transport().(*transport.Loopback).SetFault(transport.Fault{Kind: transport.Corrupt})
	store := bridgetest.Open(t, cfg, "store")
	node, err := storenode.New(store, storenode.Config{})
	require.NoError(t, err)
	src := kvtest.New(t, 2, 32, 16, 16, false)
	ma := bridgetest.Register(t, a, src, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(12)), 8)
	src.Fill(tokens, kvtest.SeqCells(8))
	bridgetest.SaveAll(t, ma, src, key.Scope{}, tokens, kvtest.SeqCells(8))
	require.NoError(t, node.Replicate())
	bridgetest.WaitFor(t, "two failed copies", func() bool { return store.Stats().ReplicationFails == 2 })
	n, _, _ := store.Resident()
	require.Zero(t, n, "corrupt copies the store kept")
	require.Zero(t, store.Holdings().Used(), "pool bytes failed copies leaked")
}

// A store node with a shared pool copies a same-host owner's blocks from
// the owner's mapped pool, with no transfer (the owner's engine fails
// every request), and serves them the same way once the owner is gone.
func TestSameHostStoreNode(t *testing.T) {
	cfg := bridgetest.Config(t)
	cfg.SharedPool = config.SharedPool{Enabled: true, Dir: t.TempDir()}
	store := replicating(t, cfg, "store", nil)
	a := bridgetest.Open(t, cfg, "a")
	a.Transport().(*transport.Loopback).SetFault(transport.Fault{Kind: transport.FailAll})
	src := kvtest.New(t, 2, 32, 16, 16, false)
	ma := bridgetest.Register(t, a, src, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(26)), 16)
	src.Fill(tokens, kvtest.SeqCells(16))
	bridgetest.SaveAll(t, ma, src, key.Scope{}, tokens, kvtest.SeqCells(16))
	bridgetest.WaitFor(t, "the store to copy 4 blocks", func() bool { return store.Stats().Replicated == 4 })
	require.Zero(t, store.Stats().ReplicationFails)

	require.NoError(t, a.Close())
	bridgetest.WaitFor(t, "the store to publish its copies", func() bool { return store.Stats().TakenOver == 4 })
	store.Transport().(*transport.Loopback).SetFault(transport.Fault{Kind: transport.FailAll})
	c := bridgetest.Open(t, cfg, "c")
	dst := kvtest.New(t, 2, 32, 16, 16, false)
	mc := bridgetest.Register(t, c, dst, 4)
	bridgetest.WaitFor(t, "c's mirror to hold the store's blocks", func() bool {
		p, err := mc.Lookup(key.Scope{}, append(tokens, 1), 0)
		return err == nil && p.MatchedBlocks == 4
	})
	res, err := bridgetest.LoadAll(t, mc, dst, key.Scope{}, tokens, kvtest.SeqCells(16))
	require.NoError(t, err)
	require.Equal(t, 16, res.OKTokens)
	require.NoError(t, dst.Check(tokens, kvtest.SeqCells(16), 16))
	require.Equal(t, int64(4), c.Stats().SharedPoolBlocks)
}
