package bridge

import (
	"context"
	"fmt"
	"math/rand"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

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
			cfg := testConfig(t)
			a := openBridge(t, cfg, "a")
			b := a
			if tc.twoProcs {
				b = openBridge(t, cfg, "b")
			}
			src := newHost(t, 3, 64, 32, 48, tc.vtrans)
			dst := newHost(t, 3, 64, 32, 48, tc.vtrans)
			ma, mb := register(t, a, src, 4), register(t, b, dst, 4)
			tokens := kvtest.Tokens(r, 22) // five full blocks and two tokens
			cells := kvtest.SeqCells(len(tokens))
			if tc.scattered {
				cells = kvtest.ScatteredCells(r, len(tokens), 64)
			}
			src.Fill(tokens, cells)
			res := saveAll(t, ma, src, key.Scope{}, tokens, cells)
			require.Equal(t, 5, res.Published, "save: %+v", res)
			require.Equal(t, 5, res.Written, "save: %+v", res)
			require.Zero(t, res.Known, "save: %+v", res)

			lk, err := mb.Lookup(key.Scope{}, tokens)
			require.NoError(t, err)
			require.Equal(t, 5, lk.MatchedBlocks, "lookup matched blocks")
			dst.Scribble()
			dcells := kvtest.SeqCells(20)
			if tc.scattered {
				dcells = kvtest.ScatteredCells(rand.New(rand.NewSource(2)), 20, 64)
			}
			got, err := loadAll(t, mb, dst, key.Scope{}, tokens[:20], dcells)
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
	cfg := testConfig(t)
	a, b := openBridge(t, cfg, "a"), openBridge(t, cfg, "b")
	h := newHost(t, 2, 32, 16, 16, false)
	ma, mb := register(t, a, h, 4), register(t, b, h, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(3)), 16)
	h.Fill(tokens, kvtest.SeqCells(16))
	res := saveAll(t, ma, h, key.Scope{}, tokens[:8], kvtest.SeqCells(8))
	require.Equal(t, 2, res.Published, "a: %+v", res)
	// b knows a's two blocks and writes only the two after them.
	res = saveAll(t, mb, h, key.Scope{}, tokens, kvtest.SeqCells(16))
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
	ra, err := sa.End()
	require.NoError(t, err)
	rb, err := sb.End()
	require.NoError(t, err)
	require.Equal(t, 2, ra.Published, "race: a %+v, b %+v", ra, rb)
	require.Zero(t, rb.Published, "race: a %+v, b %+v", ra, rb)
	require.Equal(t, 2, rb.Deduped, "race: a %+v, b %+v", ra, rb)
	n, _, _ := b.Resident()
	require.Equal(t, 2, n, "b must hold only its 2 unique blocks")
}

func TestRestoreFaults(t *testing.T) {
	blockBytes := func(m *Model) int64 { return int64(m.geo.Size()) }
	for _, tc := range []struct {
		name   string
		fault  func(m *Model) transport.Fault
		code   status.Code
		strict bool // failed rows must be untouched, not only free of wrong bytes
	}{
		{"fail", func(*Model) transport.Fault { return transport.Fault{Kind: transport.FailAll} }, status.Transfer, true},
		{"corrupt", func(*Model) transport.Fault { return transport.Fault{Kind: transport.Corrupt} }, status.Corrupt, true},
		{"drop-peer", func(*Model) transport.Fault { return transport.Fault{Kind: transport.DropPeer} }, status.Transfer, true},
		{"timeout", func(*Model) transport.Fault { return transport.Fault{Kind: transport.Delay, Arg: int64(time.Hour)} }, status.Timeout, true},
		{"partial", func(m *Model) transport.Fault {
			return transport.Fault{Kind: transport.FailAfter, Arg: blockBytes(m)/3 + 17}
		}, status.Transfer, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(t)
			cfg.TransferTimeoutMS = 200
			a, b := openBridge(t, cfg, "a"), openBridge(t, cfg, "b")
			src := newHost(t, 3, 32, 32, 32, false)
			dst := newHost(t, 3, 32, 32, 32, false)
			ma, mb := register(t, a, src, 4), register(t, b, dst, 4)
			tokens := kvtest.Tokens(rand.New(rand.NewSource(5)), 16)
			cells := kvtest.SeqCells(16)
			src.Fill(tokens, cells)
			saveAll(t, ma, src, key.Scope{}, tokens, cells)

			a.tr.(*transport.Loopback).SetFault(tc.fault(ma))
			dst.Scribble()
			res, err := loadAll(t, mb, dst, key.Scope{}, tokens, cells)
			require.Equal(t, tc.code, status.Of(err), "load error %v", err)
			require.NotEqual(t, len(tokens), res.OKTokens, "load reported every token good under a fault")
			if tc.strict {
				require.NoError(t, dst.Check(tokens, cells, res.OKTokens))
			} else {
				require.NoError(t, dst.CheckNoWrong(tokens, cells))
			}
			require.Equal(t, int64(1), b.Stats().FailuresByStatus[tc.code], "failures counted under %v", tc.code)
			// Once the fault clears, the same restore succeeds in full.
			a.tr.(*transport.Loopback).SetFault(transport.Fault{})
			res, err = loadAll(t, mb, dst, key.Scope{}, tokens, cells)
			require.NoError(t, err, "after the fault")
			require.Equal(t, 16, res.OKTokens, "after the fault: %+v", res)
			require.NoError(t, dst.Check(tokens, cells, 16))
		})
	}
}

// A reader sent to a block that its owner evicted and reused meanwhile
// must fail verification, not restore the new occupant.
func TestEvictedDuringRead(t *testing.T) {
	cfg := testConfig(t)
	cfg.PoolBytes = 1 << 20
	a, b := openBridge(t, cfg, "a"), openBridge(t, cfg, "b")
	h := newHost(t, 2, 4096, 1024, 1024, false)
	ma, mb := register(t, a, h, 16), register(t, b, h, 16)
	r := rand.New(rand.NewSource(6))
	tokens := kvtest.Tokens(r, 16)
	h.Fill(tokens, kvtest.SeqCells(16))
	saveAll(t, ma, h, key.Scope{}, tokens, kvtest.SeqCells(16))
	stale := mb.match(key.Root(mb.fp, key.Scope{}), key.Chain(key.Root(mb.fp, key.Scope{}), tokens, 16))
	require.Len(t, stale, 1, "blocks b sees")
	// Fill a's pool until the first block is evicted and its memory reused.
	for i := 0; ; i++ {
		other := kvtest.Tokens(r, 16)
		h.Fill(other, kvtest.SeqCells(16))
		saveAll(t, ma, h, key.Scope{}, other, kvtest.SeqCells(16))
		if _, ok := a.resident.Get(stale[0].Key); !ok {
			break
		}
		require.LessOrEqual(t, i, 100, "block never evicted")
	}
	require.NotZero(t, mb.Mirrored(), "b's mirror is empty")
	require.Empty(t, mb.match(key.Root(mb.fp, key.Scope{}), []key.BlockKey{stale[0].Key}), "b's mirror still lists the evicted block")
	// Replay the stale entry as a lagging directory would.
	mb.apply(directory.Event{Kind: directory.Put, Entry: stale[0]})
	dst := newHost(t, 2, 4096, 1024, 1024, false)
	dst.Scribble()
	res, err := loadAll(t, mb, dst, key.Scope{}, tokens, kvtest.SeqCells(16))
	require.Equal(t, status.Corrupt, status.Of(err), "stale read: %v", err)
	require.Zero(t, res.OKTokens, "stale read: %+v", res)
	require.NoError(t, dst.Check(tokens, kvtest.SeqCells(16), 0))
	require.NotZero(t, a.Stats().Evictions, "no eviction counted")
}

func TestIsolation(t *testing.T) {
	cfg := testConfig(t)
	a := openBridge(t, cfg, "a")
	h := newHost(t, 2, 32, 16, 16, false)
	m := register(t, a, h, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(7)), 9)
	h.Fill(tokens, kvtest.SeqCells(9))
	saveAll(t, m, h, key.Scope{TenantSalt: []byte("alice")}, tokens, kvtest.SeqCells(9))
	other := spec(h, 4)
	other.Params.NLayer = 1
	other.KRow, other.VRow, other.VElem = other.KRow[:1], other.VRow[:1], other.VElem[:1]
	other.Params.NEmbdKGQA, other.Params.NEmbdVGQA = other.Params.NEmbdKGQA[:1], other.Params.NEmbdVGQA[:1]
	m2, err := a.RegisterModel(other)
	require.NoError(t, err)
	for _, tc := range []struct {
		name  string
		m     *Model
		scope key.Scope
		want  int
	}{
		{"same tenant", m, key.Scope{TenantSalt: []byte("alice")}, 2},
		{"other tenant", m, key.Scope{TenantSalt: []byte("bob")}, 0},
		{"no tenant", m, key.Scope{}, 0},
		{"adapter", m, key.Scope{TenantSalt: []byte("alice"), Adapters: "lora@1"}, 0},
		{"other model", m2, key.Scope{TenantSalt: []byte("alice")}, 0},
	} {
		lk, err := tc.m.Lookup(tc.scope, tokens)
		assert.NoError(t, err, tc.name)
		assert.Equal(t, tc.want, lk.MatchedBlocks, "%s: matched blocks", tc.name)
	}
}

func TestMisuse(t *testing.T) {
	cfg := testConfig(t)
	a := openBridge(t, cfg, "a")
	h := newHost(t, 2, 32, 16, 16, false)
	m := register(t, a, h, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(8)), 8)
	h.Fill(tokens, kvtest.SeqCells(8))
	saveAll(t, m, h, key.Scope{}, tokens, kvtest.SeqCells(8))
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
	assert.Equal(t, 2*int64(m.geo.Size()), a.pool.Used(), "pool bytes, want two blocks'")
}

// A restore counts as a use: under LRU, the prompt restored last outlives
// one saved later but never used.
func TestRestoreRefreshesRecency(t *testing.T) {
	cfg := testConfig(t)
	b := openBridge(t, cfg, "a")
	h := newHost(t, 2, 64, 1024, 1024, false)
	m := register(t, b, h, 16)
	r := rand.New(rand.NewSource(13))
	first, second := kvtest.Tokens(r, 16), kvtest.Tokens(r, 16)
	for _, toks := range [][]int32{first, second} {
		h.Fill(toks, kvtest.SeqCells(16))
		saveAll(t, m, h, key.Scope{}, toks, kvtest.SeqCells(16))
	}
	_, err := loadAll(t, m, h, key.Scope{}, first, kvtest.SeqCells(16))
	require.NoError(t, err)
	require.NoError(t, b.evict(1))
	lk, _ := m.Lookup(key.Scope{}, append(first, 1))
	require.Equal(t, 1, lk.MatchedBlocks, "the block restored last was evicted first")
	lk, _ = m.Lookup(key.Scope{}, append(second, 1))
	require.Zero(t, lk.MatchedBlocks, "the block never used survived")
}

// flakyDirectory fails Publish while down is set, committing the entries
// first when commit is set, as a slow etcd does that commits after the
// client's deadline.
type flakyDirectory struct {
	directory.Directory
	down, commit bool
}

func (d *flakyDirectory) Publish(ctx context.Context, entries []directory.Entry) ([]bool, error) {
	if d.down && !d.commit {
		return nil, status.Errorf(status.Timeout, "directory did not answer in time")
	}
	won, err := d.Directory.Publish(ctx, entries)
	if d.down {
		return nil, status.Errorf(status.Timeout, "directory did not answer in time")
	}
	return won, err
}

// A publish that times out keeps its blocks sealed and resident: an entry
// the directory committed anyway names valid bytes, and the next save of
// the same tokens offers blocks the directory never took again instead of
// writing them twice.
func TestPublishTimeoutKeepsBlocks(t *testing.T) {
	for _, commit := range []bool{true, false} {
		t.Run(fmt.Sprintf("committed=%v", commit), func(t *testing.T) {
			cfg := testConfig(t)
			dir := &flakyDirectory{Directory: directory.OpenMemory(cfg.Directory.Name), down: true, commit: commit}
			defer dir.Close()
			b, err := Open(withOwner(cfg, "a"), Deps{Directory: dir})
			require.NoError(t, err)
			defer b.Close()
			h := newHost(t, 2, 32, 16, 16, false)
			m := register(t, b, h, 4)
			tokens := kvtest.Tokens(rand.New(rand.NewSource(14)), 8)
			h.Fill(tokens, kvtest.SeqCells(8))
			sv, err := m.SaveBegin(key.Scope{}, h.Layout(), tokens, kvtest.SeqCells(8))
			require.NoError(t, err)
			for l := range h.K {
				require.NoError(t, sv.SaveLayer(l))
			}
			_, err = sv.End()
			require.Equal(t, status.Timeout, status.Of(err), "save through a directory that timed out: %v", err)
			n, _, _ := b.Resident()
			require.Equal(t, 2, n, "blocks resident after the timeout")
			reader := openBridge(t, cfg, "reader")
			dst := newHost(t, 2, 32, 16, 16, false)
			mr := register(t, reader, dst, 4)
			if commit {
				// The entries did commit: another process restores valid bytes.
				dst.Scribble()
				res, err := loadAll(t, mr, dst, key.Scope{}, tokens, kvtest.SeqCells(8))
				require.NoError(t, err, "restore of the committed entries")
				require.Equal(t, 8, res.OKTokens, "restore of the committed entries: %+v", res)
				require.NoError(t, dst.Check(tokens, kvtest.SeqCells(8), 8))
			}
			dir.down = false
			used := b.pool.Used()
			res := saveAll(t, m, h, key.Scope{}, tokens, kvtest.SeqCells(8))
			require.Zero(t, res.Written, "second save: %+v", res)
			require.Equal(t, used, b.pool.Used(), "pool bytes after the second save")
			require.Equal(t, map[bool]int{true: 0, false: 2}[commit], res.Published, "blocks the second save published")
			lk, _ := mr.Lookup(key.Scope{}, append(tokens, 1))
			require.Equal(t, 2, lk.MatchedBlocks, "blocks the reader sees after the second save")
		})
	}
}
