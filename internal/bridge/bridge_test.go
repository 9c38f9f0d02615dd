package bridge

import (
	"context"
	"fmt"
	"math/rand"
	"testing"
	"time"

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
			if res.Published != 5 || res.Written != 5 || res.Known != 0 {
				t.Fatalf("save: %+v", res)
			}

			lk, err := mb.Lookup(key.Scope{}, tokens)
			if err != nil {
				t.Fatal(err)
			}
			if lk.MatchedBlocks != 5 {
				t.Fatalf("lookup matched %d blocks, want 5", lk.MatchedBlocks)
			}
			dst.Scribble()
			dcells := kvtest.SeqCells(20)
			if tc.scattered {
				dcells = kvtest.ScatteredCells(rand.New(rand.NewSource(2)), 20, 64)
			}
			got, err := loadAll(t, mb, dst, key.Scope{}, tokens[:20], dcells)
			if err != nil || got.OKTokens != 20 {
				t.Fatalf("load: %+v, %v", got, err)
			}
			if err := dst.Check(tokens[:20], dcells, 20); err != nil {
				t.Fatal(err)
			}
			if st := b.Stats(); st.RestoredTokens != 20 || st.Hits != 1 {
				t.Fatalf("stats: %+v", st)
			}
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
	if res := saveAll(t, ma, h, key.Scope{}, tokens[:8], kvtest.SeqCells(8)); res.Published != 2 {
		t.Fatalf("a: %+v", res)
	}
	// b knows a's two blocks and writes only the two after them.
	res := saveAll(t, mb, h, key.Scope{}, tokens, kvtest.SeqCells(16))
	if res.Known != 2 || res.Written != 2 || res.Published != 2 {
		t.Fatalf("b: %+v", res)
	}
	// Two saves racing past the lookup: the directory keeps one copy.
	tok2 := kvtest.Tokens(rand.New(rand.NewSource(4)), 8)
	h.Fill(tok2, kvtest.SeqCells(8))
	sa, err := ma.SaveBegin(key.Scope{}, h.Layout(), tok2, kvtest.SeqCells(8))
	if err != nil {
		t.Fatal(err)
	}
	sb, err := mb.SaveBegin(key.Scope{}, h.Layout(), tok2, kvtest.SeqCells(8))
	if err != nil {
		t.Fatal(err)
	}
	for l := 0; l < 2; l++ {
		if err := sa.SaveLayer(l); err != nil {
			t.Fatal(err)
		}
		if err := sb.SaveLayer(l); err != nil {
			t.Fatal(err)
		}
	}
	ra, err := sa.End()
	if err != nil {
		t.Fatal(err)
	}
	rb, err := sb.End()
	if err != nil {
		t.Fatal(err)
	}
	if ra.Published != 2 || rb.Published != 0 || rb.Deduped != 2 {
		t.Fatalf("race: a %+v, b %+v", ra, rb)
	}
	if n, _, _ := b.Resident(); n != 2 {
		t.Fatalf("b holds %d blocks, want only its 2 unique ones", n)
	}
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
			if status.Of(err) != tc.code {
				t.Fatalf("load error %v (status %v), want %v", err, status.Of(err), tc.code)
			}
			if res.OKTokens == len(tokens) {
				t.Fatalf("load reported every token good under a fault")
			}
			if tc.strict {
				if err := dst.Check(tokens, cells, res.OKTokens); err != nil {
					t.Fatal(err)
				}
			} else if err := dst.CheckNoWrong(tokens, cells); err != nil {
				t.Fatal(err)
			}
			if got := b.Stats().FailuresByStatus[tc.code]; got != 1 {
				t.Fatalf("failures counted under %v: %d", tc.code, got)
			}
			// Once the fault clears, the same restore succeeds in full.
			a.tr.(*transport.Loopback).SetFault(transport.Fault{})
			if res, err := loadAll(t, mb, dst, key.Scope{}, tokens, cells); err != nil || res.OKTokens != 16 {
				t.Fatalf("after the fault: %+v, %v", res, err)
			}
			if err := dst.Check(tokens, cells, 16); err != nil {
				t.Fatal(err)
			}
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
	if len(stale) != 1 {
		t.Fatalf("b sees %d blocks", len(stale))
	}
	// Fill a's pool until the first block is evicted and its memory reused.
	for i := 0; ; i++ {
		other := kvtest.Tokens(r, 16)
		h.Fill(other, kvtest.SeqCells(16))
		saveAll(t, ma, h, key.Scope{}, other, kvtest.SeqCells(16))
		if _, ok := a.resident.Get(stale[0].Key); !ok {
			break
		}
		if i > 100 {
			t.Fatal("block never evicted")
		}
	}
	if mb.Mirrored() == 0 || len(mb.match(key.Root(mb.fp, key.Scope{}), []key.BlockKey{stale[0].Key})) != 0 {
		t.Fatal("b's mirror still lists the evicted block")
	}
	// Replay the stale entry as a lagging directory would.
	mb.apply(directory.Event{Kind: directory.Put, Entry: stale[0]})
	dst := newHost(t, 2, 4096, 1024, 1024, false)
	dst.Scribble()
	res, err := loadAll(t, mb, dst, key.Scope{}, tokens, kvtest.SeqCells(16))
	if status.Of(err) != status.Corrupt || res.OKTokens != 0 {
		t.Fatalf("stale read: %+v, %v", res, err)
	}
	if err := dst.Check(tokens, kvtest.SeqCells(16), 0); err != nil {
		t.Fatal(err)
	}
	if a.Stats().Evictions == 0 {
		t.Fatal("no eviction counted")
	}
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
	if err != nil {
		t.Fatal(err)
	}
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
		if err != nil || lk.MatchedBlocks != tc.want {
			t.Errorf("%s: matched %d, %v; want %d", tc.name, lk.MatchedBlocks, err, tc.want)
		}
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
		if _, err := m.LoadBegin(key.Scope{}, lo, tc.tokens, tc.cells); status.Of(err) != tc.code {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.code)
		}
	}
	if _, err := m.LoadBegin(key.Scope{}, bad, tokens, kvtest.SeqCells(8)); status.Of(err) != status.Layout {
		t.Errorf("bad stride: %v", err)
	}
	if _, err := m.LoadBegin(key.Scope{}, short, tokens, kvtest.SeqCells(8)); status.Of(err) != status.Layout {
		t.Errorf("missing layer: %v", err)
	}
	if _, err := m.LoadBegin(key.Scope{}, lo, kvtest.Tokens(rand.New(rand.NewSource(9)), 8), kvtest.SeqCells(8)); status.Of(err) != status.NotFound {
		t.Errorf("unknown tokens: %v", err)
	}
	ld, err := m.LoadBegin(key.Scope{}, lo, tokens, kvtest.SeqCells(8))
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); status.Of(err) != status.State {
		t.Errorf("close with an open load: %v", err)
	}
	if _, err := ld.WaitLayer(5); status.Of(err) != status.InvalidArg {
		t.Errorf("wait on layer 5: %v", err)
	}
	if _, err := ld.End(); err != nil {
		t.Fatal(err)
	}
	if _, err := ld.End(); status.Of(err) != status.State {
		t.Errorf("end twice: %v", err)
	}
	if _, err := ld.WaitLayer(0); status.Of(err) != status.State {
		t.Errorf("wait after end: %v", err)
	}
	sv, err := m.SaveBegin(key.Scope{}, lo, kvtest.Tokens(rand.New(rand.NewSource(10)), 4), kvtest.SeqCells(4))
	if err != nil {
		t.Fatal(err)
	}
	if err := sv.SaveLayer(0); err != nil {
		t.Fatal(err)
	}
	if err := sv.SaveLayer(0); status.Of(err) != status.State {
		t.Errorf("layer saved twice: %v", err)
	}
	if _, err := sv.End(); status.Of(err) != status.State {
		t.Errorf("end with a layer missing: %v", err)
	}
	if n, _, _ := a.Resident(); n != 2 {
		t.Errorf("an incomplete save left %d blocks resident, want 2", n)
	}
	if got := a.pool.Used(); got != 2*int64(m.geo.Size()) {
		t.Errorf("pool holds %d bytes, want two blocks' %d", got, 2*m.geo.Size())
	}
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
	if _, err := loadAll(t, m, h, key.Scope{}, first, kvtest.SeqCells(16)); err != nil {
		t.Fatal(err)
	}
	if err := b.evict(1); err != nil {
		t.Fatal(err)
	}
	if lk, _ := m.Lookup(key.Scope{}, append(first, 1)); lk.MatchedBlocks != 1 {
		t.Fatal("the block restored last was evicted first")
	}
	if lk, _ := m.Lookup(key.Scope{}, append(second, 1)); lk.MatchedBlocks != 0 {
		t.Fatal("the block never used survived")
	}
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
			if err != nil {
				t.Fatal(err)
			}
			defer b.Close()
			h := newHost(t, 2, 32, 16, 16, false)
			m := register(t, b, h, 4)
			tokens := kvtest.Tokens(rand.New(rand.NewSource(14)), 8)
			h.Fill(tokens, kvtest.SeqCells(8))
			sv, err := m.SaveBegin(key.Scope{}, h.Layout(), tokens, kvtest.SeqCells(8))
			if err != nil {
				t.Fatal(err)
			}
			for l := range h.K {
				if err := sv.SaveLayer(l); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := sv.End(); status.Of(err) != status.Timeout {
				t.Fatalf("save through a directory that timed out: %v", err)
			}
			if n, _, _ := b.Resident(); n != 2 {
				t.Fatalf("%d blocks resident after the timeout, want 2", n)
			}
			reader := openBridge(t, cfg, "reader")
			dst := newHost(t, 2, 32, 16, 16, false)
			mr := register(t, reader, dst, 4)
			if commit {
				// The entries did commit: another process restores valid bytes.
				dst.Scribble()
				if res, err := loadAll(t, mr, dst, key.Scope{}, tokens, kvtest.SeqCells(8)); err != nil || res.OKTokens != 8 {
					t.Fatalf("restore of the committed entries: %+v, %v", res, err)
				}
				if err := dst.Check(tokens, kvtest.SeqCells(8), 8); err != nil {
					t.Fatal(err)
				}
			}
			dir.down = false
			used := b.pool.Used()
			res := saveAll(t, m, h, key.Scope{}, tokens, kvtest.SeqCells(8))
			if res.Written != 0 || b.pool.Used() != used {
				t.Fatalf("second save: %+v, pool %d -> %d bytes", res, used, b.pool.Used())
			}
			if want := map[bool]int{true: 0, false: 2}[commit]; res.Published != want {
				t.Fatalf("second save published %d blocks, want %d", res.Published, want)
			}
			if lk, _ := mr.Lookup(key.Scope{}, append(tokens, 1)); lk.MatchedBlocks != 2 {
				t.Fatalf("the reader sees %d blocks after the second save", lk.MatchedBlocks)
			}
		})
	}
}
