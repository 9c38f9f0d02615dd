package bridge

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
)

func newHost(t testing.TB, layers, cells, krow, vrow int, vtrans bool) *kvtest.Host {
	return kvtest.New(t, layers, cells, krow, vrow, vtrans)
}

func spec(h *kvtest.Host, blockTokens int) ModelSpec {
	p, krow, vrow, velem := h.Model(blockTokens)
	return ModelSpec{Params: p, KRow: krow, VRow: vrow, VElem: velem}
}

var dirSeq atomic.Int64

// testConfig gives each test its own memory directory, shared by the
// bridges the test opens.
func testConfig(t testing.TB) config.Config {
	c := config.Default()
	c.PoolBytes = 8 << 20
	c.BlockTokens = 4
	c.Directory.Name = fmt.Sprintf("%s-%d", t.Name(), dirSeq.Add(1))
	return c
}

func openBridge(t testing.TB, c config.Config, owner string) *Bridge {
	c.Owner = owner
	b, err := Open(c, Deps{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Close() })
	return b
}

func register(t testing.TB, b *Bridge, h *kvtest.Host, blockTokens int) *Model {
	m, err := b.RegisterModel(spec(h, blockTokens))
	require.NoError(t, err)
	return m
}

// savedResult is a save and what the publisher did with its blocks.
type savedResult struct {
	SaveResult
	Published, Deduped int
}

// saveAll saves tokens and waits for the publisher, so that the directory
// has the blocks when it returns.
func saveAll(t testing.TB, m *Model, h *kvtest.Host, scope key.Scope, tokens []int32, cells []uint32) savedResult {
	t.Helper()
	before := m.b.Stats()
	sv, err := m.SaveBegin(scope, h.Layout(), tokens, cells)
	require.NoError(t, err, "save begin")
	for l := range h.K {
		require.NoError(t, sv.SaveLayer(l), "save layer %d", l)
	}
	res, err := sv.End()
	require.NoError(t, err, "save end")
	return savedResult{SaveResult: res, Published: int(published(t, m.b, before)), Deduped: int(m.b.Stats().DedupedBlocks - before.DedupedBlocks)}
}

// published flushes b's publisher and returns the blocks it published
// since before.
func published(t testing.TB, b *Bridge, before Stats) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, b.Flush(ctx), "flushing the publisher")
	return b.Stats().SavedBlocks - before.SavedBlocks
}

// loadAll restores tokens layer by layer and returns the result and error.
func loadAll(t testing.TB, m *Model, h *kvtest.Host, scope key.Scope, tokens []int32, cells []uint32) (LoadResult, error) {
	t.Helper()
	ld, err := m.LoadBegin(scope, h.Layout(), tokens, cells)
	if err != nil {
		return LoadResult{}, err
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
