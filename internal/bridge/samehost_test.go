package bridge

import (
	"math/rand"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/transport"
)

func sharedConfig(t *testing.T) config.Config {
	cfg := testConfig(t)
	cfg.SharedPool = config.SharedPool{Enabled: true, Dir: t.TempDir()}
	return cfg
}

// A block of another bridge's shared pool is restored from the mapping,
// with no transfer: the holder's engine failing every request changes
// nothing. Entries say which host and pool they are in.
func TestSameHostRestoreNeedsNoTransport(t *testing.T) {
	p := savedPeers(t, sharedConfig(t), 32, 4, 16, 21)
	a, b, dst, mb, tokens := p.a, p.b, p.dst, p.mb, p.tokens
	host, err := pool.HostID()
	require.NoError(t, err)
	e := p.ma.match(key.Root(p.ma.fp, key.Scope{}), key.Chain(key.Root(p.ma.fp, key.Scope{}), tokens, 4))
	require.Len(t, e, 4)
	require.Equal(t, host, e[0].Loc.Host)
	require.Equal(t, a.SharedPool(), e[0].Loc.Pool)

	a.tr.(*transport.Loopback).SetFault(transport.Fault{Kind: transport.FailAll})
	dst.Scribble()
	res, err := loadAll(t, mb, dst, key.Scope{}, tokens, kvtest.SeqCells(16))
	require.NoError(t, err)
	require.Equal(t, 16, res.OKTokens)
	require.NoError(t, dst.Check(tokens, kvtest.SeqCells(16), 16))
	require.Equal(t, int64(4), b.Stats().SharedPoolBlocks)
	require.Equal(t, 1, b.shared.peers.Mapped(), "the pool is mapped once")
}

// A block the holder rewrites while a reader copies it fails the
// generation read after the copy: the restore stops before it, and the
// cells past the good prefix are the host's to drop.
func TestSameHostRewriteFailsTheRecheck(t *testing.T) {
	p := savedPeers(t, sharedConfig(t), 32, 4, 16, 22)
	a, b, dst, mb, tokens := p.a, p.b, p.dst, p.mb, p.tokens
	dst.Scribble()
	ld, err := mb.LoadBegin(key.Scope{}, dst.Layout(), tokens, kvtest.SeqCells(16))
	require.NoError(t, err)
	for l := range dst.K {
		_, err := ld.WaitLayer(l)
		require.NoError(t, err)
	}
	// Every layer is placed; the holder now reuses the third block's
	// memory, as an eviction does.
	s, ok := a.hold.Get(ld.blocks[2].entry.Key)
	require.True(t, ok)
	pool.BeginWrite(a.hold.Bytes(s.Off, s.Size), a.hold.NextGeneration())
	res, err := ld.End()
	require.Equal(t, status.Corrupt, status.Of(err), "%v", err)
	require.Equal(t, 8, res.OKTokens, "the blocks before the rewritten one stand")
	require.NoError(t, dst.CheckRestored(tokens, kvtest.SeqCells(16), 8))
	require.Equal(t, int64(1), b.Stats().TornReads)
}

// Without shared pools, or for the own pool, nothing is mapped: blocks
// come over the transport or from the pool itself.
func TestSameHostOnlyForSharedPeers(t *testing.T) {
	p := savedPeers(t, testConfig(t), 32, 4, 8, 23)
	res, err := loadAll(t, p.mb, p.dst, key.Scope{}, p.tokens, kvtest.SeqCells(8))
	require.NoError(t, err)
	require.Equal(t, 8, res.OKTokens)
	require.Zero(t, p.b.Stats().SharedPoolBlocks)
	require.Empty(t, p.a.SharedPool())
}

func TestSameHostOwnPoolIsNotMapped(t *testing.T) {
	own := savedPeers(t, sharedConfig(t), 32, 4, 8, 24)
	own.src.Scribble()
	res, err := loadAll(t, own.ma, own.src, key.Scope{}, own.tokens, kvtest.SeqCells(8))
	require.NoError(t, err)
	require.Equal(t, 8, res.OKTokens)
	require.Zero(t, own.a.Stats().SharedPoolBlocks, "the own pool is read as such")
}

// The pool's socket is a unix socket only the user can reach, in a
// directory only the user can enter (tests/reliability's
// TestSharedPoolHolder checks that such a process listens on no TCP port).
func TestSameHostSocketIsPrivate(t *testing.T) {
	b := openBridge(t, sharedConfig(t), "a")
	addr, err := pool.ParseAddress(b.SharedPool())
	require.NoError(t, err)
	st, err := os.Stat(addr.Path)
	require.NoError(t, err)
	require.Equal(t, os.ModeSocket|0o600, st.Mode()&(os.ModeSocket|os.ModePerm))
	dir, err := os.Stat(filepath.Dir(addr.Path))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), dir.Mode().Perm())
	require.NoError(t, b.Close())
	_, err = os.Stat(addr.Path)
	require.True(t, os.IsNotExist(err), "the socket outlived the bridge: %v", err)
}

// A store node with a shared pool copies a same-host owner's blocks from
// the owner's mapped pool, with no transfer (the owner's engine fails
// every request), and serves them the same way once the owner is gone.
func TestSameHostStoreNode(t *testing.T) {
	cfg := sharedConfig(t)
	store := openBridge(t, cfg, "store")
	require.NoError(t, store.Replicate())
	a := openBridge(t, cfg, "a")
	a.tr.(*transport.Loopback).SetFault(transport.Fault{Kind: transport.FailAll})
	src := newHost(t, 2, 32, 16, 16, false)
	ma := register(t, a, src, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(26)), 16)
	src.Fill(tokens, kvtest.SeqCells(16))
	saveAll(t, ma, src, key.Scope{}, tokens, kvtest.SeqCells(16))
	waitFor(t, "the store to copy 4 blocks", func() bool { return store.Stats().Replicated == 4 })
	require.Zero(t, store.Stats().ReplicationFails)

	require.NoError(t, a.Close())
	waitFor(t, "the store to publish its copies", func() bool { return store.Stats().TakenOver == 4 })
	store.tr.(*transport.Loopback).SetFault(transport.Fault{Kind: transport.FailAll})
	c := openBridge(t, cfg, "c")
	dst := newHost(t, 2, 32, 16, 16, false)
	mc := register(t, c, dst, 4)
	waitFor(t, "c's mirror to hold the store's blocks", func() bool {
		p, err := mc.Lookup(key.Scope{}, append(tokens, 1), 0)
		return err == nil && p.MatchedBlocks == 4
	})
	res, err := loadAll(t, mc, dst, key.Scope{}, tokens, kvtest.SeqCells(16))
	require.NoError(t, err)
	require.Equal(t, 16, res.OKTokens)
	require.NoError(t, dst.Check(tokens, kvtest.SeqCells(16), 16))
	require.Equal(t, int64(4), c.Stats().SharedPoolBlocks)
}
