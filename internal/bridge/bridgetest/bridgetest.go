// Package bridgetest opens bridges, registers kvtest hosts on them and
// saves and restores through them, for the tests of the bridge and of the
// packages built on it.
package bridgetest

import (
	"context"
	"fmt"
	"math/rand"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
)

// Spec is the model a kvtest host's tensors hold, in blocks of blockTokens.
func Spec(h *kvtest.Host, blockTokens int) bridge.ModelSpec {
	p, krow, vrow, velem := h.Model(blockTokens)
	return bridge.ModelSpec{Params: p, KRow: krow, VRow: vrow, VElem: velem}
}

var dirSeq atomic.Int64

// Config gives each test its own memory directory, shared by the bridges
// the test opens.
func Config(t testing.TB) config.Config {
	c := config.Default()
	c.PoolBytes = 8 << 20
	c.BlockTokens = 4
	c.Directory.Name = fmt.Sprintf("%s-%d", t.Name(), dirSeq.Add(1))
	return c
}

// WithOwner is c naming its bridge owner.
func WithOwner(c config.Config, owner string) config.Config {
	c.Owner = owner
	return c
}

// Open opens a bridge as owner, closed when the test ends.
func Open(t testing.TB, c config.Config, owner string) *bridge.Bridge {
	return OpenDeps(t, c, owner, bridge.Deps{})
}

// OpenDeps opens a bridge as owner with the parts deps supplies, closed
// when the test ends (before the parts, which the test closes itself).
func OpenDeps(t testing.TB, c config.Config, owner string, deps bridge.Deps) *bridge.Bridge {
	b, err := bridge.Open(WithOwner(c, owner), deps)
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Close() })
	return b
}

// Register registers h's model on b.
func Register(t testing.TB, b *bridge.Bridge, h *kvtest.Host, blockTokens int) *bridge.Model {
	m, err := b.RegisterModel(Spec(h, blockTokens))
	require.NoError(t, err)
	return m
}

// Saved is a save and what the publisher did with its blocks.
type Saved struct {
	bridge.SaveResult
	Published, Deduped int
}

// SaveAll saves tokens and waits for the publisher, so that the directory
// has the blocks when it returns.
func SaveAll(t testing.TB, m *bridge.Model, h *kvtest.Host, scope key.Scope, tokens []int32, cells []uint32) Saved {
	t.Helper()
	b := m.Bridge()
	before := b.Stats()
	sv, err := m.SaveBegin(scope, h.Layout(), tokens, cells)
	require.NoError(t, err, "save begin")
	for l := range h.K {
		require.NoError(t, sv.SaveLayer(l), "save layer %d", l)
	}
	res, err := sv.End()
	require.NoError(t, err, "save end")
	return Saved{SaveResult: res, Published: int(Published(t, b, before)), Deduped: int(b.Stats().DedupedBlocks - before.DedupedBlocks)}
}

// Published flushes b's publisher and returns the blocks it published
// since before.
func Published(t testing.TB, b *bridge.Bridge, before bridge.Stats) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, b.Flush(ctx), "flushing the publisher")
	return b.Stats().SavedBlocks - before.SavedBlocks
}

// LoadAll restores tokens layer by layer and returns the result and error.
func LoadAll(t testing.TB, m *bridge.Model, h *kvtest.Host, scope key.Scope, tokens []int32, cells []uint32) (bridge.LoadResult, error) {
	t.Helper()
	ld, err := m.LoadBegin(scope, h.Layout(), tokens, cells)
	if err != nil {
		return bridge.LoadResult{}, err
	}
	last := len(tokens)
	for l := range h.K {
		ok, err := ld.WaitLayer(l)
		require.NoError(t, err, "wait layer %d", l)
		require.LessOrEqual(t, ok, last, "layer %d: good prefix grew", l)
		last = ok
	}
	return ld.End()
}

// WaitFor polls cond: replication, publishing and reports run in their
// own goroutines.
func WaitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			require.FailNowf(t, "timed out", "timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// OwnerCopiedBy opens owner "a", saves 20 tokens (5 blocks) there and
// waits until store, a replicating store node, has copied them.
func OwnerCopiedBy(t testing.TB, cfg config.Config, store *bridge.Bridge) (*bridge.Bridge, *bridge.Model, []int32) {
	t.Helper()
	a := Open(t, cfg, "a")
	src := kvtest.New(t, 3, 64, 32, 48, true)
	ma := Register(t, a, src, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(11)), 20)
	src.Fill(tokens, kvtest.SeqCells(20))
	SaveAll(t, ma, src, key.Scope{}, tokens, kvtest.SeqCells(20))
	WaitFor(t, "the store to copy 5 blocks", func() bool { return store.Stats().Replicated == 5 })
	return a, ma, tokens
}
