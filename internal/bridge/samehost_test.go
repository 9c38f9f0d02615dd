package bridge_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge/bridgetest"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/transport"
)

func sharedConfig(t *testing.T) config.Config {
	cfg := bridgetest.Config(t)
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
	e := p.ma.Match(key.Root(p.ma.Fingerprint(), key.Scope{}), key.Chain(key.Root(p.ma.Fingerprint(), key.Scope{}), tokens, 4))
	require.Len(t, e, 4)
	require.Equal(t, host, e[0].Loc.Host)
	require.Equal(t, a.SharedPool(), e[0].Loc.Pool)

	a.Transport().(*transport.Loopback).SetFault(transport.Fault{Kind: transport.FailAll})
	dst.Scribble()
	res, err := bridgetest.LoadAll(t, mb, dst, key.Scope{}, tokens, kvtest.SeqCells(16))
	require.NoError(t, err)
	require.Equal(t, 16, res.OKTokens)
	require.NoError(t, dst.Check(tokens, kvtest.SeqCells(16), 16))
	require.Equal(t, int64(4), b.Stats().SharedPoolBlocks)
	require.Equal(t, 1, b.MappedPools(), "the pool is mapped once")
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
	s, ok := a.Holdings().Get(ld.BlockKey(2))
	require.True(t, ok)
	pool.BeginWrite(a.Holdings().Bytes(s.Off, s.Size), a.Holdings().NextGeneration())
	res, err := ld.End()
	require.Equal(t, status.Corrupt, status.Of(err), "%v", err)
	require.Equal(t, 8, res.OKTokens, "the blocks before the rewritten one stand")
	require.NoError(t, dst.CheckRestored(tokens, kvtest.SeqCells(16), 8))
	require.Equal(t, int64(1), b.Stats().TornReads)
}

// Without shared pools, or for the own pool, nothing is mapped: blocks
// come over the transport or from the pool itself.
func TestSameHostOnlyForSharedPeers(t *testing.T) {
	p := savedPeers(t, bridgetest.Config(t), 32, 4, 8, 23)
	res, err := bridgetest.LoadAll(t, p.mb, p.dst, key.Scope{}, p.tokens, kvtest.SeqCells(8))
	require.NoError(t, err)
	require.Equal(t, 8, res.OKTokens)
	require.Zero(t, p.b.Stats().SharedPoolBlocks)
	require.Empty(t, p.a.SharedPool())
}

func TestSameHostOwnPoolIsNotMapped(t *testing.T) {
	own := savedPeers(t, sharedConfig(t), 32, 4, 8, 24)
	own.src.Scribble()
	res, err := bridgetest.LoadAll(t, own.ma, own.src, key.Scope{}, own.tokens, kvtest.SeqCells(8))
	require.NoError(t, err)
	require.Equal(t, 8, res.OKTokens)
	require.Zero(t, own.a.Stats().SharedPoolBlocks, "the own pool is read as such")
}

// The pool's socket is a unix socket only the user can reach, in a
// directory only the user can enter (tests/reliability's
// TestSharedPoolHolder checks that such a process listens on no TCP port).
func TestSameHostSocketIsPrivate(t *testing.T) {
	b := bridgetest.Open(t, sharedConfig(t), "a")
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
