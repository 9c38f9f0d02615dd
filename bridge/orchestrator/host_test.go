package orchestrator

import (
	"fmt"
	"math/rand"
	"sync/atomic"
	"testing"

	"github.com/mcbridge/mcbridge/bridge/config"
	"github.com/mcbridge/mcbridge/bridge/key"
	"github.com/mcbridge/mcbridge/bridge/kvlayout"
	"github.com/mcbridge/mcbridge/bridge/mem"
)

// host imitates llama.cpp's KV cache: per layer a K and a V tensor of
// cells rows, V optionally transposed, in memory outside the Go heap.
type host struct {
	t      testing.TB
	cells  int
	vtrans bool
	krow   []int
	vrow   []int
	velem  int
	k, v   [][]byte
}

func newHost(t testing.TB, layers, cells, krow, vrow int, vtrans bool) *host {
	h := &host{t: t, cells: cells, vtrans: vtrans, velem: 2}
	for l := 0; l < layers; l++ {
		h.krow = append(h.krow, krow+16*l) // layers of different widths
		h.vrow = append(h.vrow, vrow)
		kb, err := mem.Map(cells * h.krow[l])
		if err != nil {
			t.Fatal(err)
		}
		vb, err := mem.Map(cells * vrow)
		if err != nil {
			t.Fatal(err)
		}
		h.k, h.v = append(h.k, kb), append(h.v, vb)
	}
	t.Cleanup(func() {
		for l := range h.k {
			_ = mem.Unmap(h.k[l])
			_ = mem.Unmap(h.v[l])
		}
	})
	return h
}

func (h *host) spec(blockTokens int) ModelSpec {
	n := len(h.krow)
	p := key.Model{LlamaVersion: "test", Arch: "llama", NLayer: uint32(n), VTrans: h.vtrans, BlockTokens: uint32(blockTokens)}
	velem := make([]int, n)
	for l := 0; l < n; l++ {
		p.NEmbdKGQA = append(p.NEmbdKGQA, uint32(h.krow[l]/2))
		p.NEmbdVGQA = append(p.NEmbdVGQA, uint32(h.vrow[l]/2))
		velem[l] = h.velem
	}
	return ModelSpec{Params: p, KRow: h.krow, VRow: h.vrow, VElem: velem}
}

func (h *host) layout() kvlayout.Layout {
	lo := kvlayout.Layout{Cells: uint32(h.cells), VTrans: h.vtrans, Location: "cpu:0"}
	for l := range h.k {
		vstride := uint64(h.vrow[l])
		if h.vtrans {
			vstride = uint64(h.cells * h.velem)
		}
		lo.Layers = append(lo.Layers, kvlayout.Layer{
			K: mem.Addr(h.k[l]), V: mem.Addr(h.v[l]), KStride: uint64(h.krow[l]), VStride: vstride,
		})
	}
	return lo
}

// value is the deterministic byte a token at position pos has at byte i
// of layer l's K (kv=0) or V (kv=1) row.
func value(tok int32, pos, l, kv, i int) byte {
	return byte(int(tok)*31 + pos*7 + l*13 + kv*101 + i*3)
}

// vAt returns the address in h.v[l] of V byte i of the token in cell c.
func (h *host) vAt(l, c, i int) *byte {
	if !h.vtrans {
		return &h.v[l][c*h.vrow[l]+i]
	}
	d, b := i/h.velem, i%h.velem
	return &h.v[l][d*h.cells*h.velem+c*h.velem+b]
}

// fill writes the KV that "computing" tokens at positions [0, n) into cells gives.
func (h *host) fill(tokens []int32, cells []uint32) {
	for p, c := range cells {
		for l := range h.k {
			for i := 0; i < h.krow[l]; i++ {
				h.k[l][int(c)*h.krow[l]+i] = value(tokens[p], p, l, 0, i)
			}
			for i := 0; i < h.vrow[l]; i++ {
				*h.vAt(l, int(c), i) = value(tokens[p], p, l, 1, i)
			}
		}
	}
}

// scribble sets every byte of every tensor to x, so that untouched rows
// are recognisable.
func (h *host) scribble(x byte) {
	for l := range h.k {
		for i := range h.k[l] {
			h.k[l][i] = x
		}
		for i := range h.v[l] {
			h.v[l][i] = x
		}
	}
}

// check verifies that positions [0, n) hold their computed KV in cells and
// that positions [n, len) were left at the scribble byte x, and reports
// the first difference.
func (h *host) check(tokens []int32, cells []uint32, n int, x byte) error {
	for p, c := range cells {
		for l := range h.k {
			for i := 0; i < h.krow[l]; i++ {
				want := x
				if p < n {
					want = value(tokens[p], p, l, 0, i)
				}
				if got := h.k[l][int(c)*h.krow[l]+i]; got != want {
					return fmt.Errorf("pos %d cell %d layer %d K byte %d: %#x, want %#x", p, c, l, i, got, want)
				}
			}
			for i := 0; i < h.vrow[l]; i++ {
				want := x
				if p < n {
					want = value(tokens[p], p, l, 1, i)
				}
				if got := *h.vAt(l, int(c), i); got != want {
					return fmt.Errorf("pos %d cell %d layer %d V byte %d: %#x, want %#x", p, c, l, i, got, want)
				}
			}
		}
	}
	return nil
}

func randomTokens(r *rand.Rand, n int) []int32 {
	t := make([]int32, n)
	for i := range t {
		t[i] = int32(r.Intn(32000))
	}
	return t
}

// scatteredCells places n positions in distinct cells, in runs, as
// llama.cpp's find_slot does when it wraps into holes.
func scatteredCells(r *rand.Rand, n, cells int) []uint32 {
	perm := r.Perm(cells / 4)
	out := make([]uint32, 0, n)
	for _, chunk := range perm {
		for j := 0; j < 4 && len(out) < n; j++ {
			out = append(out, uint32(chunk*4+j))
		}
	}
	return out
}

func seqCells(n int) []uint32 {
	c := make([]uint32, n)
	for i := range c {
		c[i] = uint32(i)
	}
	return c
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
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return b
}

func register(t testing.TB, b *Bridge, h *host, blockTokens int) *Model {
	m, err := b.RegisterModel(h.spec(blockTokens))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func saveAll(t testing.TB, m *Model, h *host, scope key.Scope, tokens []int32, cells []uint32) SaveResult {
	t.Helper()
	sv, err := m.SaveBegin(scope, h.layout(), tokens, cells)
	if err != nil {
		t.Fatalf("save begin: %v", err)
	}
	for l := range h.k {
		if err := sv.SaveLayer(l); err != nil {
			t.Fatalf("save layer %d: %v", l, err)
		}
	}
	res, err := sv.End()
	if err != nil {
		t.Fatalf("save end: %v", err)
	}
	return res
}

// loadAll restores tokens layer by layer and returns the result and error.
func loadAll(t testing.TB, m *Model, h *host, scope key.Scope, tokens []int32, cells []uint32) (LoadResult, error) {
	t.Helper()
	ld, err := m.LoadBegin(scope, h.layout(), tokens, cells)
	if err != nil {
		return LoadResult{}, err
	}
	last := len(tokens)
	for l := range h.k {
		ok, err := ld.WaitLayer(l)
		if err != nil {
			t.Fatalf("wait layer %d: %v", l, err)
		}
		if ok > last {
			t.Fatalf("layer %d: good prefix grew from %d to %d", l, last, ok)
		}
		last = ok
	}
	return ld.End()
}
