// Package kvtest imitates a llama.cpp host for tests and benchmarks: per
// layer K and V tensors outside the Go heap, filled with bytes that depend
// on (token, position, layer), so a restore can be checked byte by byte
// in any process that knows the tokens.
package kvtest

import (
	"fmt"
	"math/rand"

	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout"
	"github.com/mcbridge/mcbridge/internal/mem"
)

// Scribble is the byte Scribble fills tensors with: rows that still hold it
// were not touched.
const Scribble = 0xee

// Host is a fake KV cache of Cells cells per tensor.
type Host struct {
	Cells  int
	VTrans bool
	KRow   []int // bytes per token row, per layer
	VRow   []int
	VElem  int
	K, V   [][]byte
}

// TB is the part of testing.TB a Host needs, so that a child process of a
// test can make one too.
type TB interface {
	Fatal(args ...any)
	Cleanup(func())
}

// New maps a host's tensors; layer l's K rows are krow+16*l bytes so that
// layers differ. vrow 0 is a K-only cache (MLA): no V tensors. They are
// unmapped when tb ends.
func New(tb TB, layers, cells, krow, vrow int, vtrans bool) *Host {
	h := &Host{Cells: cells, VTrans: vtrans, VElem: 2}
	for l := 0; l < layers; l++ {
		h.KRow = append(h.KRow, krow+16*l)
		h.VRow = append(h.VRow, vrow)
		kb, err := mem.Map(cells * h.KRow[l])
		if err != nil {
			tb.Fatal(err)
		}
		var vb []byte
		if vrow > 0 {
			if vb, err = mem.Map(cells * vrow); err != nil {
				tb.Fatal(err)
			}
		}
		h.K, h.V = append(h.K, kb), append(h.V, vb)
	}
	tb.Cleanup(func() {
		for l := range h.K {
			_ = mem.Unmap(h.K[l])
			_ = mem.Unmap(h.V[l])
		}
	})
	return h
}

// Model returns the fingerprint inputs and row sizes a host of this shape
// registers: K and V as f16.
func (h *Host) Model(blockTokens int) (p key.Model, krow, vrow, velem []int) {
	n := len(h.KRow)
	p = key.Model{LlamaVersion: "test", Arch: "llama", NLayer: uint32(n), VTrans: h.VTrans, BlockTokens: uint32(blockTokens)}
	for l := 0; l < n; l++ {
		p.NEmbdKGQA = append(p.NEmbdKGQA, uint32(h.KRow[l]/2))
		p.NEmbdVGQA = append(p.NEmbdVGQA, uint32(h.VRow[l]/2))
		velem = append(velem, h.VElem)
	}
	return p, h.KRow, h.VRow, velem
}

// Layout describes the tensors to the bridge.
func (h *Host) Layout() kvlayout.Layout {
	lo := kvlayout.Layout{Cells: uint32(h.Cells), VTrans: h.VTrans, Location: "cpu:0"}
	for l := range h.K {
		vstride := uint64(h.VRow[l])
		if h.VTrans {
			vstride = uint64(h.Cells * h.VElem)
		}
		ly := kvlayout.Layer{K: mem.Addr(h.K[l]), KStride: uint64(h.KRow[l])}
		if h.VRow[l] > 0 {
			ly.V, ly.VStride = mem.Addr(h.V[l]), vstride
		}
		lo.Layers = append(lo.Layers, ly)
	}
	return lo
}

// Value is the byte a token at position pos has at byte i of layer l's K
// (kv=0) or V (kv=1) row.
func Value(tok int32, pos, l, kv, i int) byte {
	return byte(int(tok)*31 + pos*7 + l*13 + kv*101 + i*3)
}

// vAt returns V byte i of the token in cell c of layer l.
func (h *Host) vAt(l, c, i int) *byte {
	if !h.VTrans {
		return &h.V[l][c*h.VRow[l]+i]
	}
	d, b := i/h.VElem, i%h.VElem
	return &h.V[l][d*h.Cells*h.VElem+c*h.VElem+b]
}

// Fill writes the KV that computing tokens at positions [0, n) into cells gives.
func (h *Host) Fill(tokens []int32, cells []uint32) {
	for p, c := range cells {
		for l := range h.K {
			for i := 0; i < h.KRow[l]; i++ {
				h.K[l][int(c)*h.KRow[l]+i] = Value(tokens[p], p, l, 0, i)
			}
			for i := 0; i < h.VRow[l]; i++ {
				*h.vAt(l, int(c), i) = Value(tokens[p], p, l, 1, i)
			}
		}
	}
}

// Scribble sets every byte of every tensor to Scribble.
func (h *Host) Scribble() {
	for l := range h.K {
		for i := range h.K[l] {
			h.K[l][i] = Scribble
		}
		for i := range h.V[l] {
			h.V[l][i] = Scribble
		}
	}
}

// Check verifies that positions [0, n) hold their computed KV in cells and
// positions [n, len) still hold Scribble, and reports the first difference.
func (h *Host) Check(tokens []int32, cells []uint32, n int) error {
	for p, c := range cells {
		for l := range h.K {
			for kv, row := range []int{h.KRow[l], h.VRow[l]} {
				for i := 0; i < row; i++ {
					want := byte(Scribble)
					if p < n {
						want = Value(tokens[p], p, l, kv, i)
					}
					if got := *h.at(l, kv, int(c), i); got != want {
						return fmt.Errorf("pos %d cell %d layer %d kv %d byte %d: %#x, want %#x", p, c, l, kv, i, got, want)
					}
				}
			}
		}
	}
	return nil
}

// CheckRestored verifies what a load that verified n leading positions
// into cells may leave: positions [0, n) hold their computed KV, and every
// cell the load was not given still holds Scribble. The cells of positions
// [n, len) belong to no sequence after a failed load and may hold anything
// (include/mcbridge.h, "Failures").
func (h *Host) CheckRestored(tokens []int32, cells []uint32, n int) error {
	if err := h.Check(tokens[:n], cells[:n], n); err != nil {
		return err
	}
	given := make(map[uint32]bool, len(cells))
	for _, c := range cells {
		given[c] = true
	}
	for c := 0; c < h.Cells; c++ {
		if given[uint32(c)] {
			continue
		}
		for l := range h.K {
			for kv, row := range []int{h.KRow[l], h.VRow[l]} {
				for i := 0; i < row; i++ {
					if got := *h.at(l, kv, c, i); got != Scribble {
						return fmt.Errorf("cell %d layer %d kv %d byte %d, outside the load, changed to %#x", c, l, kv, i, got)
					}
				}
			}
		}
	}
	return nil
}

func (h *Host) at(l, kv, c, i int) *byte {
	if kv == 0 {
		return &h.K[l][c*h.KRow[l]+i]
	}
	return h.vAt(l, c, i)
}

// Tokens returns n pseudo-random token ids.
func Tokens(r *rand.Rand, n int) []int32 {
	t := make([]int32, n)
	for i := range t {
		t[i] = int32(r.Intn(32000))
	}
	return t
}

// SeqCells puts position i in cell i.
func SeqCells(n int) []uint32 {
	c := make([]uint32, n)
	for i := range c {
		c[i] = uint32(i)
	}
	return c
}

// ScatteredCells places n positions in distinct cells, in runs of four, as
// llama.cpp's find_slot does when it wraps into holes.
func ScatteredCells(r *rand.Rand, n, cells int) []uint32 {
	out := make([]uint32, 0, n)
	for _, chunk := range r.Perm(cells / 4) {
		for j := 0; j < 4 && len(out) < n; j++ {
			out = append(out, uint32(chunk*4+j))
		}
	}
	return out
}
