package bridge

import (
	"math/rand"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/transport"
)

// waitFor polls cond: replication runs in its own goroutine.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			require.FailNowf(t, "timed out", "timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestStoreOutlivesOwner(t *testing.T) {
	cfg := testConfig(t)
	store := openBridge(t, cfg, "store")
	require.NoError(t, store.Replicate())
	a, _, tokens := ownerCopiedBy(t, cfg, store)

	// The owner exits: it unpublishes, and the store's copies take over.
	require.NoError(t, a.Close())
	waitFor(t, "the store to publish its copies", func() bool { return store.Stats().TakenOver == 5 })

	c := openBridge(t, cfg, "c")
	dst := newHost(t, 3, 64, 32, 48, true)
	mc := register(t, c, dst, 4)
	dst.Scribble()
	res, err := loadAll(t, mc, dst, key.Scope{}, tokens[:20], kvtest.SeqCells(20))
	require.NoError(t, err, "restore from the store")
	require.Equal(t, 20, res.OKTokens, "restore from the store: %+v", res)
	require.NoError(t, dst.Check(tokens, kvtest.SeqCells(20), 20))
}

func TestStoreRefusesCorruptCopies(t *testing.T) {
	cfg := testConfig(t)
	a := openBridge(t, cfg, "a")
	a.tr.(*transport.Loopback).SetFault(transport.Fault{Kind: transport.Corrupt})
	store := openBridge(t, cfg, "store")
	src := newHost(t, 2, 32, 16, 16, false)
	ma := register(t, a, src, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(12)), 8)
	src.Fill(tokens, kvtest.SeqCells(8))
	saveAll(t, ma, src, key.Scope{}, tokens, kvtest.SeqCells(8))
	require.NoError(t, store.Replicate())
	waitFor(t, "two failed copies", func() bool { return store.Stats().ReplicationFails == 2 })
	n, _, _ := store.Resident()
	require.Zero(t, n, "corrupt copies the store kept")
	require.Zero(t, store.hold.Used(), "pool bytes failed copies leaked")
}

// ownerCopiedBy opens owner "a", saves 20 tokens (5 blocks) there and
// waits until store has copied them.
func ownerCopiedBy(t *testing.T, cfg config.Config, store *Bridge) (*Bridge, *Model, []int32) {
	t.Helper()
	a, err := Open(withOwner(cfg, "a"), Deps{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = a.Close() })
	src := newHost(t, 3, 64, 32, 48, true)
	ma := register(t, a, src, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(11)), 20)
	src.Fill(tokens, kvtest.SeqCells(20))
	saveAll(t, ma, src, key.Scope{}, tokens, kvtest.SeqCells(20))
	waitFor(t, "the store to copy 5 blocks", func() bool { return store.Stats().Replicated == 5 })
	return a, ma, tokens
}

func withOwner(c config.Config, owner string) config.Config {
	c.Owner = owner
	return c
}
