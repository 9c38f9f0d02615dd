package storenode_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/bridge/bridgetest"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/disk"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/storenode"
)

// storeNode is a store node: its bridge, the host endpoint, and its roles
// on it.
type storeNode struct {
	*bridge.Bridge
	*storenode.Node
}

// Stats are the bridge's, which carry the node's too.
func (s *storeNode) Stats() bridge.Stats { return s.Bridge.Stats() }

// replicating opens a store node as owner, with the disk tier given (nil
// for none), and starts its replication. The bridge's Close stops it.
func replicating(t *testing.T, cfg config.Config, owner string, tier *disk.Tier) *storeNode {
	t.Helper()
	b := bridgetest.Open(t, cfg, owner)
	n, err := storenode.New(b, storenode.Config{Disk: tier})
	require.NoError(t, err)
	require.NoError(t, n.Replicate())
	return &storeNode{b, n}
}

// bigBlocks is a host whose 4-token blocks are 64 KiB, so that a few MiB
// of pool hold few enough blocks to evict.
func bigBlocks(t *testing.T) *kvtest.Host { return kvtest.New(t, 4, 64, 2048, 2048, false) }

// storeNodeConfig is a store node's configuration: its pool holds about n of
// bigBlocks' blocks.
func storeNodeConfig(c config.Config, n int, eviction string) config.Config {
	c.PoolBytes = int64(n) * (64<<10 + 4<<10)
	c.PoolBytes = max(c.PoolBytes, 1<<20)
	c.Eviction = eviction
	return c
}

// restoreFrom restores tokens on a fresh reader host and reports how many
// it restored, and the segment the directory of cfg names for the first
// block when the reader looked it up.
func restoreFrom(t *testing.T, cfg config.Config, m *bridge.Model, tokens []int32) (int, string) {
	t.Helper()
	h := bigBlocks(t)
	h.Scribble()
	lk, err := m.Lookup(key.Scope{}, tokens, 0)
	require.NoError(t, err)
	if lk.RestoreTokens == 0 {
		return 0, ""
	}
	seg := holderOf(t, cfg, m, tokens)
	n := lk.RestoreTokens
	res, err := bridgetest.LoadAll(t, m, h, key.Scope{}, tokens[:n], kvtest.SeqCells(n))
	require.NoError(t, err, "restoring from %s", seg)
	require.NoError(t, h.Check(tokens, kvtest.SeqCells(len(tokens)), res.OKTokens), "restored bytes")
	return res.OKTokens, seg
}

// holderOf is the segment cfg's memory directory names for the first block
// of tokens under m, or "".
func holderOf(t *testing.T, cfg config.Config, m *bridge.Model, tokens []int32) string {
	t.Helper()
	d := directory.OpenMemory(cfg.Directory.Name)
	defer func() { require.NoError(t, d.Close()) }()
	first := key.Chain(key.Root(m.Fingerprint(), key.Scope{}), tokens[:m.BlockTokens()], m.BlockTokens())[0]
	seg := ""
	// The subscription delivers what the directory holds before it returns.
	cancel, err := d.Subscribe(m.Fingerprint(), func(ev directory.Event) {
		if ev.Kind == directory.Put && ev.Entry.Key == first {
			seg = ev.Entry.Loc.Segment
		}
	})
	require.NoError(t, err)
	cancel()
	return seg
}
