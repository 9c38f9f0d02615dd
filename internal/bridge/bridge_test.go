package bridge_test

import (
	"bytes"
	"context"
	"fmt"
	"math/rand"
	"sync"
	"sync/atomic"
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
	"github.com/mcbridge/mcbridge/internal/transport"
)

func TestRestoreRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		name      string
		vtrans    bool
		scattered bool
		twoProcs  bool
	}{
		{"local", false, false, false},
		{"local-vtrans", true, false, false},
		{"local-scattered-vtrans", true, true, false},
		{"remote", false, false, true},
		{"remote-vtrans-scattered", true, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := rand.New(rand.NewSource(1))
			cfg := bridgetest.Config(t)
			a := bridgetest.Open(t, cfg, "a")
			b := a
			if tc.twoProcs {
				b = bridgetest.Open(t, cfg, "b")
			}
			src := kvtest.New(t, 3, 64, 32, 48, tc.vtrans)
			dst := kvtest.New(t, 3, 64, 32, 48, tc.vtrans)
			ma, mb := bridgetest.Register(t, a, src, 4), bridgetest.Register(t, b, dst, 4)
			tokens := kvtest.Tokens(r, 22) // five full blocks and two tokens
			cells := kvtest.SeqCells(len(tokens))
			if tc.scattered {
				cells = kvtest.ScatteredCells(r, len(tokens), 64)
			}
			src.Fill(tokens, cells)
			res := bridgetest.SaveAll(t, ma, src, key.Scope{}, tokens, cells)
			require.Equal(t, 5, res.Published, "save: %+v", res)
			require.Equal(t, 5, res.Written, "save: %+v", res)
			require.Zero(t, res.Known, "save: %+v", res)

			lk, err := mb.Lookup(key.Scope{}, tokens, 0)
			require.NoError(t, err)
			require.Equal(t, 5, lk.MatchedBlocks, "lookup matched blocks")
			dst.Scribble()
			dcells := kvtest.SeqCells(20)
			if tc.scattered {
				dcells = kvtest.ScatteredCells(rand.New(rand.NewSource(2)), 20, 64)
			}
			got, err := bridgetest.LoadAll(t, mb, dst, key.Scope{}, tokens[:20], dcells)
			require.NoError(t, err, "load")
			require.Equal(t, 20, got.OKTokens, "load: %+v", got)
			require.NoError(t, dst.Check(tokens[:20], dcells, 20))
			st := b.Stats()
			require.Equal(t, int64(20), st.RestoredTokens, "stats: %+v", st)
			require.Equal(t, int64(1), st.Hits, "stats: %+v", st)
		})
	}
}

func TestSaveDedupe(t *testing.T) {
	cfg := bridgetest.Config(t)
	a, b := bridgetest.Open(t, cfg, "a"), bridgetest.Open(t, cfg, "b")
	h := kvtest.New(t, 2, 32, 16, 16, false)
	ma, mb := bridgetest.Register(t, a, h, 4), bridgetest.Register(t, b, h, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(3)), 16)
	h.Fill(tokens, kvtest.SeqCells(16))
	res := bridgetest.SaveAll(t, ma, h, key.Scope{}, tokens[:8], kvtest.SeqCells(8))
	require.Equal(t, 2, res.Published, "a: %+v", res)
	// b knows a's two blocks and writes only the two after them.
	res = bridgetest.SaveAll(t, mb, h, key.Scope{}, tokens, kvtest.SeqCells(16))
	require.Equal(t, 2, res.Known, "b: %+v", res)
	require.Equal(t, 2, res.Written, "b: %+v", res)
	require.Equal(t, 2, res.Published, "b: %+v", res)
	// Two saves racing past the lookup: the directory keeps one copy.
	tok2 := kvtest.Tokens(rand.New(rand.NewSource(4)), 8)
	h.Fill(tok2, kvtest.SeqCells(8))
	sa, err := ma.SaveBegin(key.Scope{}, h.Layout(), tok2, kvtest.SeqCells(8))
	require.NoError(t, err)
	sb, err := mb.SaveBegin(key.Scope{}, h.Layout(), tok2, kvtest.SeqCells(8))
	require.NoError(t, err)
	for l := 0; l < 2; l++ {
		require.NoError(t, sa.SaveLayer(l))
		require.NoError(t, sb.SaveLayer(l))
	}
	beforeA, beforeB := a.Stats(), b.Stats()
	ra, err := sa.End()
	require.NoError(t, err)
	rb, err := sb.End()
	require.NoError(t, err)
	require.Equal(t, 2, ra.Queued, "race: a %+v", ra)
	require.Equal(t, 2, rb.Queued, "race: b %+v", rb)
	// Whichever publisher reaches the directory first keeps its copy.
	pa, pb := bridgetest.Published(t, a, beforeA), bridgetest.Published(t, b, beforeB)
	da, db := a.Stats().DedupedBlocks-beforeA.DedupedBlocks, b.Stats().DedupedBlocks-beforeB.DedupedBlocks
	require.Equal(t, int64(2), pa+pb, "race: published %d + %d", pa, pb)
	require.ElementsMatch(t, []int64{0, 2}, []int64{pa, pb}, "race: one publisher wins both blocks")
	require.Equal(t, pa, db, "race: b dedupes what a published")
	require.Equal(t, pb, da, "race: a dedupes what b published")
	na, _, _ := a.Resident()
	nb, _, _ := b.Resident()
	require.Equal(t, 6, na+nb, "the loser frees its copies: 2 unique blocks each, the 2 raced ones once")
}

func TestRestoreFaults(t *testing.T) {
	blockBytes := func(m *bridge.Model) int64 { return int64(m.BlockBytes()) }
	for _, tc := range []struct {
		name  string
		fault func(m *bridge.Model) transport.Fault
		code  status.Code
	}{
		{"fail", func(*bridge.Model) transport.Fault { return transport.Fault{Kind: transport.FailAll} }, status.Transfer},
		{"corrupt", func(*bridge.Model) transport.Fault { return transport.Fault{Kind: transport.Corrupt} }, status.Corrupt},
		{"drop-peer", func(*bridge.Model) transport.Fault { return transport.Fault{Kind: transport.DropPeer} }, status.Transfer},
		{"timeout", func(*bridge.Model) transport.Fault {
			return transport.Fault{Kind: transport.Delay, Arg: int64(time.Hour)}
		}, status.Timeout},
		{"partial", func(m *bridge.Model) transport.Fault {
			return transport.Fault{Kind: transport.FailAfter, Arg: blockBytes(m)/3 + 17}
		}, status.Transfer},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := bridgetest.Config(t)
			cfg.TransferTimeoutMS = 200
			cfg.PeerDownMS = 0 // planning around a hung peer: TestHungPeerPlannedAround
			a, b := bridgetest.Open(t, cfg, "a"), bridgetest.Open(t, cfg, "b")
			src := kvtest.New(t, 3, 32, 32, 32, false)
			dst := kvtest.New(t, 3, 32, 32, 32, false)
			ma, mb := bridgetest.Register(t, a, src, 4), bridgetest.Register(t, b, dst, 4)
			tokens := kvtest.Tokens(rand.New(rand.NewSource(5)), 16)
			cells := kvtest.SeqCells(16)
			src.Fill(tokens, cells)
			bridgetest.SaveAll(t, ma, src, key.Scope{}, tokens, cells)

			a.Transport().(*transport.Loopback).SetFault(tc.fault(ma))
			dst.Scribble()
			res, err := bridgetest.LoadAll(t, mb, dst, key.Scope{}, tokens, cells)
			require.Equal(t, tc.code, status.Of(err), "load error %v", err)
			require.NotEqual(t, len(tokens), res.OKTokens, "load reported every token good under a fault")
			require.NoError(t, dst.CheckRestored(tokens, cells, res.OKTokens))
			require.Equal(t, int64(1), b.Stats().FailuresByStatus[tc.code], "failures counted under %v", tc.code)
			// Once the fault clears, the same restore succeeds in full.
			a.Transport().(*transport.Loopback).SetFault(transport.Fault{})
			res, err = bridgetest.LoadAll(t, mb, dst, key.Scope{}, tokens, cells)
			require.NoError(t, err, "after the fault")
			require.Equal(t, 16, res.OKTokens, "after the fault: %+v", res)
			require.NoError(t, dst.Check(tokens, cells, 16))
		})
	}
}

// A peer whose transfers time out costs one request its deadline: the
// peer is then planned around (lookups match none of its blocks) until
// peer_down_ms has passed, and counted once.
func TestHungPeerPlannedAround(t *testing.T) {
	cfg := bridgetest.Config(t)
	cfg.TransferTimeoutMS = 200
	cfg.PeerDownMS = 10000
	a := bridgetest.Open(t, cfg, "a")
	var clock atomic.Int64
	clock.Store(time.Now().UnixNano())
	cfg.Owner = "b"
	b, err := bridge.Open(cfg, bridge.Deps{Now: func() time.Time { return time.Unix(0, clock.Load()) }})
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Close() })
	src := kvtest.New(t, 3, 32, 32, 32, false)
	dst := kvtest.New(t, 3, 32, 32, 32, false)
	ma, mb := bridgetest.Register(t, a, src, 4), bridgetest.Register(t, b, dst, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(6)), 16)
	cells := kvtest.SeqCells(16)
	src.Fill(tokens, cells)
	bridgetest.SaveAll(t, ma, src, key.Scope{}, tokens, cells)
	a.Transport().(*transport.Loopback).SetFault(transport.Fault{Kind: transport.Delay, Arg: int64(time.Hour)})

	_, err = bridgetest.LoadAll(t, mb, dst, key.Scope{}, tokens, cells)
	require.Equal(t, status.Timeout, status.Of(err), "load from the hung peer: %v", err)
	require.Equal(t, int64(1), b.Stats().PeersDown)
	p, err := mb.Lookup(key.Scope{}, tokens, 0)
	require.NoError(t, err)
	require.Zero(t, p.MatchedBlocks, "lookup while the peer is down: %+v", p.Decision)
	_, err = mb.LoadBegin(key.Scope{}, dst.Layout(), tokens, cells)
	require.Equal(t, status.NotFound, status.Of(err), "load while the peer is down: %v", err)

	a.Transport().(*transport.Loopback).SetFault(transport.Fault{})
	clock.Add(int64(10 * time.Second))
	p, err = mb.Lookup(key.Scope{}, tokens, 0)
	require.NoError(t, err)
	require.Equal(t, 3, p.MatchedBlocks, "lookup once the down period is over (the last token is computed): %+v", p.Decision)
	res, err := bridgetest.LoadAll(t, mb, dst, key.Scope{}, tokens, cells)
	require.NoError(t, err)
	require.Equal(t, 16, res.OKTokens)
	require.NoError(t, dst.Check(tokens, cells, 16))
	require.Equal(t, int64(1), b.Stats().PeersDown, "one hung period is counted once")
}

// A reader sent to a block that its owner evicted and reused meanwhile
// must fail verification, not restore the new occupant.
func TestEvictedDuringRead(t *testing.T) {
	cfg := bridgetest.Config(t)
	cfg.PoolBytes = 1 << 20
	a, b := bridgetest.Open(t, cfg, "a"), bridgetest.Open(t, cfg, "b")
	h := kvtest.New(t, 2, 4096, 1024, 1024, false)
	ma, mb := bridgetest.Register(t, a, h, 16), bridgetest.Register(t, b, h, 16)
	r := rand.New(rand.NewSource(6))
	tokens := kvtest.Tokens(r, 16)
	h.Fill(tokens, kvtest.SeqCells(16))
	bridgetest.SaveAll(t, ma, h, key.Scope{}, tokens, kvtest.SeqCells(16))
	stale := mb.Match(key.Root(mb.Fingerprint(), key.Scope{}), key.Chain(key.Root(mb.Fingerprint(), key.Scope{}), tokens, 16))
	require.Len(t, stale, 1, "blocks b sees")
	// Fill a's pool until the first block is evicted and its memory reused.
	for i := 0; ; i++ {
		other := kvtest.Tokens(r, 16)
		h.Fill(other, kvtest.SeqCells(16))
		bridgetest.SaveAll(t, ma, h, key.Scope{}, other, kvtest.SeqCells(16))
		if _, ok := a.Holdings().Get(stale[0].Key); !ok {
			break
		}
		require.LessOrEqual(t, i, 100, "block never evicted")
	}
	require.NotZero(t, mb.Mirrored(), "b's mirror is empty")
	require.Empty(t, mb.Match(key.Root(mb.Fingerprint(), key.Scope{}), []key.BlockKey{stale[0].Key}), "b's mirror still lists the evicted block")
	// Replay the stale entry as a lagging directory would.
	mb.Apply(directory.Event{Kind: directory.Put, Entry: stale[0]})
	dst := kvtest.New(t, 2, 4096, 1024, 1024, false)
	dst.Scribble()
	res, err := bridgetest.LoadAll(t, mb, dst, key.Scope{}, tokens, kvtest.SeqCells(16))
	require.Equal(t, status.Corrupt, status.Of(err), "stale read: %v", err)
	require.Zero(t, res.OKTokens, "stale read: %+v", res)
	require.NoError(t, dst.CheckRestored(tokens, kvtest.SeqCells(16), 0))
	require.NotZero(t, a.Stats().Evictions, "no eviction counted")
}

func TestIsolation(t *testing.T) {
	cfg := bridgetest.Config(t)
	a := bridgetest.Open(t, cfg, "a")
	h := kvtest.New(t, 2, 32, 16, 16, false)
	m := bridgetest.Register(t, a, h, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(7)), 9)
	h.Fill(tokens, kvtest.SeqCells(9))
	bridgetest.SaveAll(t, m, h, key.Scope{TenantSalt: []byte("alice")}, tokens, kvtest.SeqCells(9))
	other := bridgetest.Spec(h, 4)
	other.Params.NLayer = 1
	other.KRow, other.VRow, other.VElem = other.KRow[:1], other.VRow[:1], other.VElem[:1]
	other.Params.NEmbdKGQA, other.Params.NEmbdVGQA = other.Params.NEmbdKGQA[:1], other.Params.NEmbdVGQA[:1]
	m2, err := a.RegisterModel(other)
	require.NoError(t, err)
	for _, tc := range []struct {
		name  string
		m     *bridge.Model
		scope key.Scope
		want  int
	}{
		{"same tenant", m, key.Scope{TenantSalt: []byte("alice")}, 2},
		{"other tenant", m, key.Scope{TenantSalt: []byte("bob")}, 0},
		{"no tenant", m, key.Scope{}, 0},
		{"adapter", m, key.Scope{TenantSalt: []byte("alice"), Adapters: "lora@1"}, 0},
		{"other model", m2, key.Scope{TenantSalt: []byte("alice")}, 0},
	} {
		lk, err := tc.m.Lookup(tc.scope, tokens, 0)
		assert.NoError(t, err, tc.name)
		assert.Equal(t, tc.want, lk.MatchedBlocks, "%s: matched blocks", tc.name)
	}
}

func TestMisuse(t *testing.T) {
	cfg := bridgetest.Config(t)
	a := bridgetest.Open(t, cfg, "a")
	h := kvtest.New(t, 2, 32, 16, 16, false)
	m := bridgetest.Register(t, a, h, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(8)), 8)
	h.Fill(tokens, kvtest.SeqCells(8))
	bridgetest.SaveAll(t, m, h, key.Scope{}, tokens, kvtest.SeqCells(8))
	lo := h.Layout()
	bad := lo
	bad.Layers = append(bad.Layers[:0:0], lo.Layers...)
	bad.Layers[1].KStride = 3
	short := lo
	short.Layers = lo.Layers[:1]
	for _, tc := range []struct {
		name   string
		tokens []int32
		cells  []uint32
		code   status.Code
	}{
		{"partial block", tokens[:6], kvtest.SeqCells(6), status.InvalidArg},
		{"cells count", tokens, kvtest.SeqCells(7), status.InvalidArg},
		{"cell out of range", tokens, append(kvtest.SeqCells(7), 99), status.Layout},
		{"cell twice", tokens, append(kvtest.SeqCells(7), 3), status.Layout},
		{"empty", nil, nil, status.InvalidArg},
	} {
		_, err := m.LoadBegin(key.Scope{}, lo, tc.tokens, tc.cells)
		assert.Equal(t, tc.code, status.Of(err), "%s: %v", tc.name, err)
	}
	_, err := m.LoadBegin(key.Scope{}, bad, tokens, kvtest.SeqCells(8))
	assert.Equal(t, status.Layout, status.Of(err), "bad stride: %v", err)
	_, err = m.LoadBegin(key.Scope{}, short, tokens, kvtest.SeqCells(8))
	assert.Equal(t, status.Layout, status.Of(err), "missing layer: %v", err)
	_, err = m.LoadBegin(key.Scope{}, lo, kvtest.Tokens(rand.New(rand.NewSource(9)), 8), kvtest.SeqCells(8))
	assert.Equal(t, status.NotFound, status.Of(err), "unknown tokens: %v", err)
	ld, err := m.LoadBegin(key.Scope{}, lo, tokens, kvtest.SeqCells(8))
	require.NoError(t, err)
	err = a.Close()
	assert.Equal(t, status.State, status.Of(err), "close with an open load: %v", err)
	_, err = ld.WaitLayer(5)
	assert.Equal(t, status.InvalidArg, status.Of(err), "wait on layer 5: %v", err)
	_, err = ld.End()
	require.NoError(t, err)
	_, err = ld.End()
	assert.Equal(t, status.State, status.Of(err), "end twice: %v", err)
	_, err = ld.WaitLayer(0)
	assert.Equal(t, status.State, status.Of(err), "wait after end: %v", err)
	sv, err := m.SaveBegin(key.Scope{}, lo, kvtest.Tokens(rand.New(rand.NewSource(10)), 4), kvtest.SeqCells(4))
	require.NoError(t, err)
	require.NoError(t, sv.SaveLayer(0))
	err = sv.SaveLayer(0)
	assert.Equal(t, status.State, status.Of(err), "layer saved twice: %v", err)
	_, err = sv.End()
	assert.Equal(t, status.State, status.Of(err), "end with a layer missing: %v", err)
	n, _, _ := a.Resident()
	assert.Equal(t, 2, n, "blocks an incomplete save left resident")
	assert.Equal(t, 2*int64(m.BlockBytes()), a.Holdings().Used(), "pool bytes, want two blocks'")
}

// A restore counts as a use: under LRU, the prompt restored last outlives
// one saved later but never used.
func TestRestoreRefreshesRecency(t *testing.T) {
	cfg := bridgetest.Config(t)
	b := bridgetest.Open(t, cfg, "a")
	h := kvtest.New(t, 2, 64, 1024, 1024, false)
	m := bridgetest.Register(t, b, h, 16)
	r := rand.New(rand.NewSource(13))
	first, second := kvtest.Tokens(r, 16), kvtest.Tokens(r, 16)
	for _, toks := range [][]int32{first, second} {
		h.Fill(toks, kvtest.SeqCells(16))
		bridgetest.SaveAll(t, m, h, key.Scope{}, toks, kvtest.SeqCells(16))
	}
	_, err := bridgetest.LoadAll(t, m, h, key.Scope{}, first, kvtest.SeqCells(16))
	require.NoError(t, err)
	require.NoError(t, b.Holdings().Evict(1))
	lk, _ := m.Lookup(key.Scope{}, append(first, 1), 0)
	require.Equal(t, 1, lk.MatchedBlocks, "the block restored last was evicted first")
	lk, _ = m.Lookup(key.Scope{}, append(second, 1), 0)
	require.Zero(t, lk.MatchedBlocks, "the block never used survived")
}

// flakyDirectory fails Publish while down is set, committing the entries
// first when commit is set, as a slow etcd does that commits after the
// client's deadline.
type flakyDirectory struct {
	directory.Directory
	down   atomic.Bool
	commit bool
}

// openOverDownDirectory opens a bridge as owner over a flakyDirectory
// that is down, and a model of two layers and 4-token blocks on it.
func openOverDownDirectory(t *testing.T, cfg config.Config, owner string, commit bool) (*bridge.Bridge, *flakyDirectory, *kvtest.Host, *bridge.Model) {
	t.Helper()
	dir := &flakyDirectory{Directory: directory.OpenMemory(cfg.Directory.Name), commit: commit}
	dir.down.Store(true)
	t.Cleanup(func() { _ = dir.Close() })
	b, err := bridge.Open(bridgetest.WithOwner(cfg, owner), bridge.Deps{Directory: dir})
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Close() })
	h := kvtest.New(t, 2, 32, 16, 16, false)
	return b, dir, h, bridgetest.Register(t, b, h, 4)
}

func (d *flakyDirectory) Publish(ctx context.Context, entries []directory.Entry) ([]bool, error) {
	if d.down.Load() && !d.commit {
		return nil, status.Errorf(status.Timeout, "directory did not answer in time")
	}
	won, err := d.Directory.Publish(ctx, entries)
	if d.down.Load() {
		return nil, status.Errorf(status.Timeout, "directory did not answer in time")
	}
	return won, err
}

// A save never waits on the directory. A publish that times out is
// retried by the publisher; meanwhile the blocks stay sealed and resident,
// so this process restores them at once, an entry the directory committed
// anyway names valid bytes, and once the directory answers the blocks are
// published without being written twice.
func TestPublishTimeoutKeepsBlocks(t *testing.T) {
	for _, commit := range []bool{true, false} {
		t.Run(fmt.Sprintf("committed=%v", commit), func(t *testing.T) {
			cfg := bridgetest.Config(t)
			b, dir, h, m := openOverDownDirectory(t, cfg, "a", commit)
			tokens := kvtest.Tokens(rand.New(rand.NewSource(14)), 8)
			h.Fill(tokens, kvtest.SeqCells(8))
			sv, err := m.SaveBegin(key.Scope{}, h.Layout(), tokens, kvtest.SeqCells(8))
			require.NoError(t, err)
			for l := range h.K {
				require.NoError(t, sv.SaveLayer(l))
			}
			res, err := sv.End()
			require.NoError(t, err, "a save does not wait on the directory")
			require.Equal(t, 2, res.Queued, "save: %+v", res)
			require.Eventually(t, func() bool { return b.Stats().DirectoryErrors > 0 }, 10*time.Second, time.Millisecond,
				"the publisher tried the stopped directory")
			n, _, _ := b.Resident()
			require.Equal(t, 2, n, "blocks resident after the timeout")
			lk, err := m.Lookup(key.Scope{}, append(tokens, 1), 0)
			require.NoError(t, err)
			require.Equal(t, 2, lk.MatchedBlocks, "this process finds its own blocks before the directory does")

			reader := bridgetest.Open(t, cfg, "reader")
			dst := kvtest.New(t, 2, 32, 16, 16, false)
			mr := bridgetest.Register(t, reader, dst, 4)
			if commit {
				// The entries did commit: another process restores valid bytes.
				dst.Scribble()
				got, err := bridgetest.LoadAll(t, mr, dst, key.Scope{}, tokens, kvtest.SeqCells(8))
				require.NoError(t, err, "restore of the committed entries")
				require.Equal(t, 8, got.OKTokens, "restore of the committed entries: %+v", got)
				require.NoError(t, dst.Check(tokens, kvtest.SeqCells(8), 8))
			}
			used := b.Holdings().Used()
			before := b.Stats()
			dir.down.Store(false)
			require.Equal(t, int64(2), bridgetest.Published(t, b, before), "the retried publish counts the blocks as this process's")
			require.Zero(t, b.Stats().DedupedBlocks, "a late commit of our own entries is not another process's win")
			again := bridgetest.SaveAll(t, m, h, key.Scope{}, tokens, kvtest.SeqCells(8))
			require.Zero(t, again.Written, "second save: %+v", again)
			require.Equal(t, used, b.Holdings().Used(), "pool bytes after the second save")
			require.Eventually(t, func() bool {
				lk, _ := mr.Lookup(key.Scope{}, append(tokens, 1), 0)
				return lk.MatchedBlocks == 2
			}, 10*time.Second, time.Millisecond, "the reader sees both blocks")
		})
	}
}

// stuckDirectory never answers a publish or unpublish until released: what
// a stopped (SIGSTOP) etcd looks like to a client.
type stuckDirectory struct {
	directory.Directory
	release chan struct{}
	calls   atomic.Int64
}

func (d *stuckDirectory) wait(ctx context.Context) error {
	d.calls.Add(1)
	select {
	case <-d.release:
		return nil
	case <-ctx.Done():
		return status.Wrap(status.Timeout, ctx.Err(), "directory stuck")
	}
}

func (d *stuckDirectory) Publish(ctx context.Context, entries []directory.Entry) ([]bool, error) {
	if err := d.wait(ctx); err != nil {
		return nil, err
	}
	return d.Directory.Publish(ctx, entries)
}

func (d *stuckDirectory) Unpublish(ctx context.Context, owner string, model key.Fingerprint, keys []key.BlockKey) error {
	if err := d.wait(ctx); err != nil {
		return err
	}
	return d.Directory.Unpublish(ctx, owner, model, keys)
}

// Saves, evictions, lookups and loads run while the directory answers
// nothing: only the publisher waits on it. The directory's deadline is an
// hour, so a host thread that waited on it would hang the test.
func TestNoDirectoryCallOnTheHostPath(t *testing.T) {
	cfg := bridgetest.Config(t)
	cfg.PoolBytes = 1 << 20
	cfg.Directory.OpTimeoutMS = int(time.Hour / time.Millisecond)
	dir := &stuckDirectory{Directory: directory.OpenMemory(cfg.Directory.Name), release: make(chan struct{})}
	defer dir.Close()
	b, err := bridge.Open(bridgetest.WithOwner(cfg, "a"), bridge.Deps{Directory: dir})
	require.NoError(t, err)
	h := kvtest.New(t, 2, 256, 256, 256, false)
	m := bridgetest.Register(t, b, h, 16)
	r := rand.New(rand.NewSource(15))
	var last []int32
	for i := 0; i < 64; i++ {
		last = kvtest.Tokens(r, 64)
		h.Fill(last, kvtest.SeqCells(64))
		sv, err := m.SaveBegin(key.Scope{}, h.Layout(), last, kvtest.SeqCells(64))
		require.NoError(t, err)
		for l := range h.K {
			require.NoError(t, sv.SaveLayer(l))
		}
		_, err = sv.End()
		require.NoError(t, err)
	}
	require.Positive(t, b.Stats().Evictions, "the pool filled and evicted")
	require.Positive(t, dir.calls.Load(), "the publisher is waiting on the directory")
	lk, err := m.Lookup(key.Scope{}, append(last, 1), 0)
	require.NoError(t, err)
	require.Equal(t, 4, lk.MatchedBlocks, "the last save is restorable here at once")
	dst := kvtest.New(t, 2, 256, 256, 256, false)
	dst.Scribble()
	got, err := bridgetest.LoadAll(t, m, dst, key.Scope{}, last, kvtest.SeqCells(64))
	require.NoError(t, err)
	require.Equal(t, 64, got.OKTokens)
	require.NoError(t, dst.Check(last, kvtest.SeqCells(64), 64))
	close(dir.release)
	require.NoError(t, b.Close())
}

// A load from a peer lands each layer in the host's cells where its rows
// sit back to back. One whose peer answers only after the deadline ends
// with the batch aborted: the host gets its cells back, and the late
// transfers never write into them, however long the batch lives on.
func TestLandedLoadFencedAtTheDeadline(t *testing.T) {
	cfg := bridgetest.Config(t)
	cfg.TransferTimeoutMS = 200
	cfg.PeerDownMS = 0
	a, b := bridgetest.Open(t, cfg, "a"), bridgetest.Open(t, cfg, "b")
	for _, vtrans := range []bool{false, true} {
		src := kvtest.New(t, 3, 32, 32, 32, vtrans)
		dst := kvtest.New(t, 3, 32, 32, 32, vtrans)
		ma, mb := bridgetest.Register(t, a, src, 4), bridgetest.Register(t, b, dst, 4)
		tokens := kvtest.Tokens(rand.New(rand.NewSource(9)), 16)
		cells := kvtest.ScatteredCells(rand.New(rand.NewSource(10)), 16, 32)
		src.Fill(tokens, kvtest.SeqCells(16))
		bridgetest.SaveAll(t, ma, src, key.Scope{}, tokens, kvtest.SeqCells(16))

		dst.Scribble()
		ld, err := mb.LoadBegin(key.Scope{}, dst.Layout(), tokens, cells)
		require.NoError(t, err)
		res, err := ld.End()
		require.NoError(t, err, "vtrans %v", vtrans)
		require.Equal(t, !vtrans, ld.Landed(), "vtrans %v: transfers land in place only where rows sit back to back", vtrans)
		require.Equal(t, 16, res.OKTokens)
		require.NoError(t, dst.Check(tokens, cells, 16), "vtrans %v", vtrans)

		a.Transport().(*transport.Loopback).SetFault(transport.Fault{Kind: transport.Delay, Arg: int64(2 * cfg.TransferTimeoutMS * int(time.Millisecond))})
		dst.Scribble()
		ld, err = mb.LoadBegin(key.Scope{}, dst.Layout(), tokens, cells)
		require.NoError(t, err)
		res, err = ld.End()
		require.Equal(t, status.Timeout, status.Of(err), "vtrans %v: %v", vtrans, err)
		require.Zero(t, res.OKTokens)
		require.NoError(t, dst.CheckRestored(tokens, cells, 0))
		var k, v [][]byte
		for l := range dst.K {
			k, v = append(k, bytes.Clone(dst.K[l])), append(v, bytes.Clone(dst.V[l]))
		}
		require.NotZero(t, b.Stats().ParkedBatches, "the timed-out batch is parked")
		time.Sleep(3 * time.Duration(cfg.TransferTimeoutMS) * time.Millisecond)
		b.Reap() // polls the parked batch past the transfers' delayed due time
		for l := range dst.K {
			require.Equal(t, k[l], dst.K[l], "vtrans %v: layer %d's K changed after the load ended", vtrans, l)
			require.Equal(t, v[l], dst.V[l], "vtrans %v: layer %d's V changed after the load ended", vtrans, l)
		}
		a.Transport().(*transport.Loopback).SetFault(transport.Fault{})
		require.NoError(t, b.UnregisterModel(mb))
		require.NoError(t, a.UnregisterModel(ma))
	}
}

// peers is a reader b with a model on dst and a holder a that saved
// tokens, computed on src in cells 0..n-1, for b to read.
type peers struct {
	a, b     *bridge.Bridge
	src, dst *kvtest.Host
	ma, mb   *bridge.Model
	tokens   []int32
}

func savedPeers(t *testing.T, cfg config.Config, cells, blockTokens, n int, seed int64) peers {
	t.Helper()
	return savedPeersDeps(t, cfg, bridge.Deps{}, cells, blockTokens, n, seed)
}

// savedPeersDeps is savedPeers with the reader b built from bDeps.
func savedPeersDeps(t *testing.T, cfg config.Config, bDeps bridge.Deps, cells, blockTokens, n int, seed int64) peers {
	t.Helper()
	p := peers{a: bridgetest.Open(t, cfg, "a"), b: bridgetest.OpenDeps(t, cfg, "b", bDeps),
		src: kvtest.New(t, 2, cells, 32, 32, false), dst: kvtest.New(t, 2, cells, 32, 32, false)}
	p.ma, p.mb = bridgetest.Register(t, p.a, p.src, blockTokens), bridgetest.Register(t, p.b, p.dst, blockTokens)
	p.tokens = kvtest.Tokens(rand.New(rand.NewSource(seed)), n)
	p.src.Fill(p.tokens, kvtest.SeqCells(n))
	bridgetest.SaveAll(t, p.ma, p.src, key.Scope{}, p.tokens, kvtest.SeqCells(n))
	return p
}

// The tensors a load landed in stay registered with the engine until the
// host says it frees them; then they are the engine's no more, which the
// engine shows by taking a registration of the same memory again.
func TestUnregisterTensors(t *testing.T) {
	p := savedPeers(t, bridgetest.Config(t), 32, 4, 8, 12)
	a, b, dst, ma, mb, tokens := p.a, p.b, p.dst, p.ma, p.mb, p.tokens
	lo := dst.Layout()
	ld, err := mb.LoadBegin(key.Scope{}, lo, tokens, kvtest.SeqCells(8))
	require.NoError(t, err)
	res, err := ld.End()
	require.NoError(t, err)
	require.True(t, ld.Landed())
	require.Equal(t, 8, res.OKTokens)
	k0 := lo.Layers[0].K
	require.Error(t, b.Transport().RegisterMemory(k0, 64, "cpu:0", false), "the landed tensors are registered")
	mb.UnregisterTensors(&lo)
	require.Zero(t, mb.TensorSpans())
	require.NoError(t, b.Transport().RegisterMemory(k0, 64, "cpu:0", false), "the tensors are still registered")
	require.NoError(t, b.Transport().UnregisterMemory(k0))
	require.NoError(t, b.UnregisterModel(mb))
	require.NoError(t, a.UnregisterModel(ma))
}

// Cells scattered into more runs than landing in place pays for are
// staged and placed instead, and restore as well.
func TestScatteredCellsStaged(t *testing.T) {
	p := savedPeers(t, bridgetest.Config(t), 64, 16, 32, 11)
	dst, mb, tokens := p.dst, p.mb, p.tokens
	for _, tc := range []struct {
		name   string
		cells  []uint32
		landed bool
	}{
		{"runs of 4", func() (c []uint32) {
			for i := range uint32(32) {
				c = append(c, i+i/4*2) // 4 cells, a hole of 2
			}
			return c
		}(), true},
		{"every other cell", func() (c []uint32) {
			for i := range uint32(32) {
				c = append(c, 2*i)
			}
			return c
		}(), false},
	} {
		dst.Scribble()
		ld, err := mb.LoadBegin(key.Scope{}, dst.Layout(), tokens, tc.cells)
		require.NoError(t, err, tc.name)
		res, err := ld.End()
		require.NoError(t, err, tc.name)
		require.Equal(t, tc.landed, ld.Landed(), tc.name)
		require.Equal(t, 32, res.OKTokens, tc.name)
		require.NoError(t, dst.Check(tokens, tc.cells, 32), tc.name)
	}
}

// stepClock is an engine's clock that moves only when told: Step has the
// next reading return the time then and move the clock on by d for every
// later one, Advance moves it at once.
type stepClock struct {
	mu   sync.Mutex
	t    time.Time
	step time.Duration
}

func (c *stepClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.t
	c.t, c.step = c.t.Add(c.step), 0
	return now
}

func (c *stepClock) Step(d time.Duration) {
	c.mu.Lock()
	c.step = d
	c.mu.Unlock()
}

func (c *stepClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// The seqlock's second read of every remote block goes out as one batch
// as soon as the payloads are in, before the host ends the load. One that
// times out fails its block, and its batch is parked with the memory it
// reads into until the read is done with it.
func TestGenerationCheck(t *testing.T) {
	cfg := bridgetest.Config(t)
	cfg.TransferTimeoutMS = 200
	cfg.PeerDownMS = 0
	// The reader's engine runs on a clock of the test's, so that which
	// reads a delay holds back depends on no scheduling.
	clock := &stepClock{t: time.Unix(1, 0)}
	eng, err := transport.NewLoopback(transport.LoopbackOptions{Name: "b", Now: clock.Now})
	require.NoError(t, err)
	t.Cleanup(func() { _ = eng.Close() })
	p := savedPeersDeps(t, cfg, bridge.Deps{Transport: eng}, 32, 4, 16, 13)
	a, b, dst, mb, tokens := p.a, p.b, p.dst, p.mb, p.tokens

	begin := func() *bridge.Load {
		dst.Scribble()
		ld, err := mb.LoadBegin(key.Scope{}, dst.Layout(), tokens, kvtest.SeqCells(16))
		require.NoError(t, err)
		for l := range dst.K {
			ok, err := ld.WaitLayer(l)
			require.NoError(t, err)
			require.Equal(t, 16, ok)
		}
		require.NotNil(t, ld.GenerationBatch(), "the generation reads are out when the last layer is placed")
		require.Equal(t, 4, ld.GenerationBatch().Tasks(), "one read a remote block, in one batch")
		return ld
	}
	res, err := begin().End()
	require.NoError(t, err)
	require.Equal(t, 16, res.OKTokens)
	require.NoError(t, dst.Check(tokens, kvtest.SeqCells(16), 16))
	idle := b.Holdings().Used()

	// The holder delays every read it serves by an hour from when it was
	// due. The payloads, submitted in one batch at the clock's first
	// reading, are due an hour later when polled: the clock has stepped
	// there. The generation reads, submitted then, are due another hour
	// on, which the clock reaches only when the test moves it.
	const delay = time.Hour
	a.Transport().(*transport.Loopback).SetFault(transport.Fault{Kind: transport.Delay, Arg: int64(delay)})
	clock.Step(delay)
	parked := b.Stats().ParkedBatches
	res, err = begin().End()
	require.Equal(t, status.Timeout, status.Of(err), "%v", err)
	require.Zero(t, res.OKTokens)
	require.Equal(t, parked+1, b.Stats().ParkedBatches, "the generation check is parked")
	require.Equal(t, idle+4*bridge.GenSlot, b.Holdings().Used(), "its reads' memory stays allocated while they may write")
	b.Reap()
	require.Equal(t, idle+4*bridge.GenSlot, b.Holdings().Used(), "a reap leaves it while the reads are due")
	clock.Advance(delay)
	b.Reap()
	require.Equal(t, idle, b.Holdings().Used(), "and frees it once they are done")
	a.Transport().(*transport.Loopback).SetFault(transport.Fault{})
}

// Published holds its caller until the blocks saved before the call are
// in the directory, and no longer than its deadline; a directory failing
// now is not waited on. Only the blocks queued before the call count.
func TestPublishedWaitsForTheSavedBlocks(t *testing.T) {
	cfg := bridgetest.Config(t)
	cfg.Directory.OpTimeoutMS = int(time.Hour / time.Millisecond)
	dir := &stuckDirectory{Directory: directory.OpenMemory(cfg.Directory.Name), release: make(chan struct{})}
	defer dir.Close()
	b, err := bridge.Open(bridgetest.WithOwner(cfg, "saver"), bridge.Deps{Directory: dir})
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Close() })
	h := kvtest.New(t, 2, 32, 16, 16, false)
	m := bridgetest.Register(t, b, h, 4)
	require.NoError(t, b.Published(context.Background()), "nothing saved: nothing to wait for")

	tokens := kvtest.Tokens(rand.New(rand.NewSource(16)), 8)
	require.Equal(t, 2, saveUnflushed(t, m, h, tokens).Queued)
	short, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	require.Equal(t, status.Timeout, status.Of(b.Published(short)), "the directory has not answered")

	done := make(chan error, 1)
	go func() { done <- b.Published(context.Background()) }()
	select {
	case err := <-done:
		require.FailNow(t, "Published returned before the directory took the blocks", "%v", err)
	case <-time.After(50 * time.Millisecond):
	}
	close(dir.release)
	require.NoError(t, <-done)
	reader := bridgetest.Open(t, cfg, "reader")
	mr := bridgetest.Register(t, reader, kvtest.New(t, 2, 32, 16, 16, false), 4)
	lk, err := mr.Lookup(key.Scope{}, append(tokens, 1), 0)
	require.NoError(t, err)
	require.Equal(t, 2, lk.MatchedBlocks, "once Published returns, another process finds the blocks")
}

func TestPublishedDoesNotWaitOnAFailingDirectory(t *testing.T) {
	cfg := bridgetest.Config(t)
	b, dir, h, m := openOverDownDirectory(t, cfg, "failing", false)
	first := kvtest.Tokens(rand.New(rand.NewSource(17)), 8)
	saveUnflushed(t, m, h, first)
	require.Equal(t, status.Directory, status.Of(b.Published(context.Background())),
		"the batch failed: the blocks are queued again, not published")
	second := kvtest.Tokens(rand.New(rand.NewSource(18)), 8)
	saveUnflushed(t, m, h, second)
	require.Equal(t, status.Directory, status.Of(b.Published(context.Background())),
		"a directory failing now is not waited on")
	dir.down.Store(false)
	require.Eventually(t, func() bool { return b.Published(context.Background()) == nil }, 10*time.Second, time.Millisecond,
		"once the directory answers, the retried blocks are published")
}

// saveUnflushed saves tokens, computed in h's first cells, and returns as
// a host does: with the blocks queued for the directory.
func saveUnflushed(t *testing.T, m *bridge.Model, h *kvtest.Host, tokens []int32) bridge.SaveResult {
	t.Helper()
	cells := kvtest.SeqCells(len(tokens))
	h.Fill(tokens, cells)
	sv, err := m.SaveBegin(key.Scope{}, h.Layout(), tokens, cells)
	require.NoError(t, err)
	for l := range h.K {
		require.NoError(t, sv.SaveLayer(l))
	}
	res, err := sv.End()
	require.NoError(t, err)
	return res
}
