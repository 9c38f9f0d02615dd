// Package kvhost stands in for llama.cpp's KV cache in benchmarks and
// replays: per layer one K and one V tensor of row-major f16 rows, in
// memory outside the Go heap, where position p lives in cell p.
//
// "Computing" a token writes rows that are a deterministic function of the
// token, its position, the layer and K or V, so that a restore can be
// checked byte for byte against what prefill would have produced.
package kvhost

import (
	"bytes"
	"encoding/binary"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout"
	"github.com/mcbridge/mcbridge/internal/mem"
	"github.com/mcbridge/mcbridge/internal/status"
)

// elem is the size of an f16 element, the KV type llama.cpp defaults to.
const elem = 2

// Host is a model's KV tensors, Layers() of them each for K and V.
type Host struct {
	cells      int
	krow, vrow int
	k, v       [][]byte
	scratch    []byte
}

// New maps tensors of cells rows for a model of layers layers whose K and V
// rows are krow and vrow bytes (whole f16 elements).
func New(layers, cells, krow, vrow int) (*Host, error) {
	if layers <= 0 || cells <= 0 || krow <= 0 || vrow <= 0 || krow%elem != 0 || vrow%elem != 0 {
		return nil, status.Errorf(status.InvalidArg, "kvhost: %d layers, %d cells, rows of %d/%d bytes", layers, cells, krow, vrow)
	}
	h := &Host{cells: cells, krow: krow, vrow: vrow}
	for range layers {
		k, err := mem.Map(cells * krow)
		if err != nil {
			h.Close()
			return nil, err
		}
		h.k = append(h.k, k)
		v, err := mem.Map(cells * vrow)
		if err != nil {
			h.Close()
			return nil, err
		}
		h.v = append(h.v, v)
	}
	return h, nil
}

// Close unmaps the tensors.
func (h *Host) Close() error {
	var first error
	for _, t := range append(h.k, h.v...) {
		if err := mem.Unmap(t); err != nil && first == nil {
			first = err
		}
	}
	h.k, h.v = nil, nil
	return first
}

// Layers is the number of layers.
func (h *Host) Layers() int { return len(h.k) }

// Spec is the model registration matching the tensors; name keeps unlike
// benchmarks out of each other's key space.
func (h *Host) Spec(name string, blockTokens int) bridge.ModelSpec {
	n := len(h.k)
	s := bridge.ModelSpec{
		Params: key.Model{LlamaVersion: "kvhost", Arch: "llama", NLayer: uint32(n), TypeK: 1, TypeV: 1,
			BlockTokens: uint32(blockTokens), Extra: name},
	}
	for range n {
		s.Params.NEmbdKGQA = append(s.Params.NEmbdKGQA, uint32(h.krow/elem))
		s.Params.NEmbdVGQA = append(s.Params.NEmbdVGQA, uint32(h.vrow/elem))
		s.KRow = append(s.KRow, h.krow)
		s.VRow = append(s.VRow, h.vrow)
		s.VElem = append(s.VElem, elem)
	}
	return s
}

// Layout describes the tensors for a load or a save.
func (h *Host) Layout() kvlayout.Layout {
	lo := kvlayout.Layout{Cells: uint32(h.cells), Location: "cpu:0"}
	for l := range h.k {
		lo.Layers = append(lo.Layers, kvlayout.Layer{
			K: mem.Addr(h.k[l]), V: mem.Addr(h.v[l]), KStride: uint64(h.krow), VStride: uint64(h.vrow),
		})
	}
	return lo
}

// Positions returns the cells of positions [0, n): cell p holds position p.
func Positions(n int) []uint32 {
	c := make([]uint32, n)
	for i := range c {
		c[i] = uint32(i)
	}
	return c
}

// Compute writes the rows that prefill gives positions [from, to) of tokens.
func (h *Host) Compute(tokens []int32, from, to int) {
	if to <= from {
		return
	}
	for l := range h.k {
		for kv, t := range [2][]byte{h.k[l], h.v[l]} {
			size := h.rowSize(kv)
			copy(t[from*size:to*size], h.rows(tokens, from, to, l, kv))
		}
	}
}

// Check reports whether positions [0, n) hold the rows prefill gives
// tokens, in every layer.
func (h *Host) Check(tokens []int32, n int) error {
	if w := h.WrongPositions(tokens, n); w > 0 {
		return status.Errorf(status.Corrupt, "kvhost: %d of positions [0, %d) do not hold the computed rows", w, n)
	}
	return nil
}

// WrongPositions counts the positions of [0, n) whose rows, in any layer,
// differ from what prefill gives tokens: a restore's wrong KV.
func (h *Host) WrongPositions(tokens []int32, n int) int {
	if n <= 0 {
		return 0
	}
	wrong := make([]bool, n)
	for l := range h.k {
		for kv, t := range [2][]byte{h.k[l], h.v[l]} {
			size := h.rowSize(kv)
			want := h.rows(tokens, 0, n, l, kv)
			for p := range n {
				if !bytes.Equal(t[p*size:(p+1)*size], want[p*size:(p+1)*size]) {
					wrong[p] = true
				}
			}
		}
	}
	c := 0
	for _, w := range wrong {
		if w {
			c++
		}
	}
	return c
}

func (h *Host) rowSize(kv int) int {
	if kv == 0 {
		return h.krow
	}
	return h.vrow
}

// rows returns the computed rows of positions [from, to) of layer l's K
// (kv 0) or V (kv 1), in a scratch buffer valid until the next call.
func (h *Host) rows(tokens []int32, from, to, l, kv int) []byte {
	size := h.rowSize(kv)
	n := (to - from) * size
	// Rows of up to a word are written a word at a time, each store
	// running into the next row, which the next store overwrites: the
	// slack holds the last one's overrun.
	if cap(h.scratch) < n+8 {
		h.scratch = make([]byte, n+8)
	}
	buf := h.scratch[:n+8]
	for p := from; p < to; p++ {
		dst := buf[(p-from)*size:]
		if size <= 8 {
			binary.LittleEndian.PutUint64(dst, word(tokens[p], p, l, kv))
			continue
		}
		fill(dst[:size], word(tokens[p], p, l, kv))
	}
	return buf[:n]
}

// CopyFrom copies positions [0, n) of every tensor of src, a host of the
// same geometry: a memcpy of the bytes a restore of n tokens places, on
// the threads a restore places them with (as many goroutines as the
// process has CPUs, a block's rows of a layer each) and with the copy it
// uses (mem.Stream), so that a restore's "x memcpy" is measured against
// the best this machine does with the same cores, not against one core.
func (h *Host) CopyFrom(src *Host, n int) {
	type piece struct{ dst, src []byte }
	var pieces []piece
	for l := range h.k {
		for from := 0; from < n; from += copyTokens {
			to := min(from+copyTokens, n)
			pieces = append(pieces, piece{h.k[l][from*h.krow : to*h.krow], src.k[l][from*h.krow : to*h.krow]},
				piece{h.v[l][from*h.vrow : to*h.vrow], src.v[l][from*h.vrow : to*h.vrow]})
		}
	}
	var next atomic.Int64
	work := func() {
		for i := int(next.Add(1) - 1); i < len(pieces); i = int(next.Add(1) - 1) {
			mem.Stream(pieces[i].dst, pieces[i].src)
		}
	}
	var wg sync.WaitGroup
	for range runtime.GOMAXPROCS(0) - 1 {
		wg.Go(work)
	}
	work()
	wg.Wait()
}

// copyTokens is the positions one goroutine of CopyFrom copies at a time:
// the bridge's default block size, a restore's unit of work.
const copyTokens = 256

// CopyTo copies positions [0, n) of every tensor, layer by layer, K then V,
// into dst, and returns the bytes copied: a plain memcpy of the bytes a
// save of n tokens gathers.
func (h *Host) CopyTo(dst []byte, n int) int {
	off := 0
	for l := range h.k {
		off += copy(dst[off:], h.k[l][:n*h.krow])
		off += copy(dst[off:], h.v[l][:n*h.vrow])
	}
	return off
}

// Clear zeroes positions [0, n), so that a later Check proves a restore
// wrote them.
func (h *Host) Clear(n int) {
	for l := range h.k {
		clear(h.k[l][:n*h.krow])
		clear(h.v[l][:n*h.vrow])
	}
}

// word mixes a row's coordinates into the word its bytes repeat.
func word(tok int32, pos, layer, kv int) uint64 {
	x := uint64(uint32(tok)) | uint64(pos)<<32
	x ^= uint64(layer)<<56 | uint64(kv)<<63
	x ^= x >> 31
	x *= 0x9e3779b97f4a7c15
	x ^= x >> 29
	return x
}

// fill repeats w over dst.
func fill(dst []byte, w uint64) {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], w)
	n := copy(dst, b[:])
	for n < len(dst) {
		n += copy(dst[n:], dst[:n])
	}
}
