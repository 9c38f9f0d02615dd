// Package kvlayout describes where a host keeps its KV tensors and moves a
// block's rows between a pool block and those tensors.
//
// The host names, per layer, the base address and strides of K and V; a
// block's tokens occupy cells given per position. Cells need not be
// contiguous (llama.cpp's find_slot wraps into holes), so rows move in one
// copy per run of consecutive cells. When V is transposed (llama.cpp without
// flash attention) a V tensor holds one row per embedding dimension with one
// element per cell, and a block's V is gathered or scattered element-wise
// through a local staging of its rows, never with per-element transfers.
package kvlayout

import (
	"math"

	"github.com/mcbridge/mcbridge/internal/chunksum"
	"github.com/mcbridge/mcbridge/internal/mem"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Layer locates one layer's K and V tensors.
type Layer struct {
	K, V    uintptr
	KStride uint64 // bytes between the K rows of consecutive cells
	// VStride is the bytes between the V rows of consecutive cells, or,
	// when V is transposed, between the rows of consecutive dimensions.
	VStride uint64
}

// Layout is a host's KV memory, borrowed for one load or save.
type Layout struct {
	Cells    uint32 // cells in every tensor
	VTrans   bool
	Location string // "cpu:N" or "cuda:N"
	Layers   []Layer
}

// Shape is what the model says about rows: bytes per token row of K and V,
// and V's element size, needed to transpose.
type Shape struct {
	Geometry *pool.Geometry
	VElem    []int // bytes per V element, per layer
}

// Validate checks that every row of every cell lies inside its tensor as
// described and that the description fits the model, so that no later copy
// can run outside it.
func (lo *Layout) Validate(s *Shape) error {
	g := s.Geometry
	switch {
	case len(lo.Layers) != g.Layers():
		return status.Errorf(status.Layout, "layout has %d layers, model %d", len(lo.Layers), g.Layers())
	case len(s.VElem) != g.Layers():
		return status.Errorf(status.Layout, "shape has V element sizes for %d layers, model %d", len(s.VElem), g.Layers())
	case lo.Cells == 0:
		return status.Errorf(status.Layout, "layout has no cells")
	case lo.Location != "" && !(len(lo.Location) > 4 && lo.Location[:4] == "cpu:"):
		// Rows are moved by the CPU here; device memory needs a transport
		// that reads into it, which the staging path does not have.
		return status.Errorf(status.Unsupported, "layout location %q: host memory (cpu:N) only in this build", lo.Location)
	}
	for l, ly := range lo.Layers {
		krow, vrow, elem := uint64(g.KRow[l]), uint64(g.VRow[l]), uint64(s.VElem[l])
		// A K-only model's layers (MLA) have no V tensor, and every other
		// model's have one.
		if ly.K == 0 || (ly.V == 0) != (vrow == 0) {
			return status.Errorf(status.Layout, "layer %d: K at %#x, V at %#x for V rows of %d bytes", l, ly.K, ly.V, vrow)
		}
		if ly.KStride < krow {
			return status.Errorf(status.Layout, "layer %d: K stride %d below the row size %d", l, ly.KStride, krow)
		}
		if !fits(ly.K, ly.KStride, uint64(lo.Cells-1), krow) {
			return status.Errorf(status.Layout, "layer %d: K tensor reaches past user space", l)
		}
		if vrow == 0 {
			continue
		}
		if lo.VTrans {
			if elem == 0 || vrow%elem != 0 {
				return status.Errorf(status.Layout, "layer %d: V row of %d bytes is not whole elements of %d", l, vrow, elem)
			}
			if ly.VStride/elem < uint64(lo.Cells) {
				return status.Errorf(status.Layout, "layer %d: transposed V stride %d holds fewer than %d cells", l, ly.VStride, lo.Cells)
			}
			if !fits(ly.V, ly.VStride, vrow/elem-1, uint64(lo.Cells)*elem) {
				return status.Errorf(status.Layout, "layer %d: V tensor reaches past user space", l)
			}
			continue
		}
		if ly.VStride < vrow {
			return status.Errorf(status.Layout, "layer %d: V stride %d below the row size %d", l, ly.VStride, vrow)
		}
		if !fits(ly.V, ly.VStride, uint64(lo.Cells-1), vrow) {
			return status.Errorf(status.Layout, "layer %d: V tensor reaches past user space", l)
		}
	}
	return nil
}

// maxAddr bounds user-space addresses on every 64-bit platform Linux
// runs (57-bit virtual addresses with 5-level paging): a tensor said to
// reach past it cannot be memory the host owns.
const maxAddr = 1 << 57

// fits reports whether base + n*stride + last stays within user space.
func fits(base uintptr, stride, n, last uint64) bool {
	if n != 0 && stride > (math.MaxUint64-last)/n {
		return false
	}
	span := n*stride + last
	return uint64(base) < maxAddr && span <= maxAddr-uint64(base)
}

// CheckCells checks that cells name distinct cells of the layout.
func (lo *Layout) CheckCells(cells []uint32) error {
	seen := make([]uint64, (lo.Cells+63)/64)
	for i, c := range cells {
		if c >= lo.Cells {
			return status.Errorf(status.Layout, "position %d in cell %d of %d", i, c, lo.Cells)
		}
		if seen[c/64]&(1<<(c%64)) != 0 {
			return status.Errorf(status.Layout, "cell %d given twice", c)
		}
		seen[c/64] |= 1 << (c % 64)
	}
	return nil
}

// Run is n consecutive positions, starting at pos in a block, that sit in
// consecutive cells from cell.
type Run struct {
	Pos, N int
	Cell   uint32
}

// Runs splits a block's cells into runs of consecutive cells.
func Runs(cells []uint32) []Run {
	var runs []Run
	for i := 0; i < len(cells); {
		j := i + 1
		for j < len(cells) && uint64(cells[j]) == uint64(cells[j-1])+1 { // no wrap from 2^32-1 to 0
			j++
		}
		runs = append(runs, Run{Pos: i, N: j - i, Cell: cells[i]})
		i = j
	}
	return runs
}

// Place copies layer l of a block, as stored in payload (B K rows then B V
// rows), into the layout's tensors at the block's cells.
func (lo *Layout) Place(s *Shape, l int, payload []byte, runs []Run) {
	lo.move(s, l, payload, runs, true)
}

// PlaceSum is Place fused with the layer's checksum (pool.Sum of payload),
// so that the payload is read from memory once. Chunk by chunk of the sum,
// it moves the chunk's rows into the tensors with streaming stores and
// sums the chunk: where the rows allow (fusedSum), in the same pass
// (chunksum), else right after the copy, which has just brought the chunk
// into cache. Transposed V is summed with the rest and scattered after.
// The caller compares the sum with the block's: on a mismatch the block's
// cells hold unverified bytes.
func (lo *Layout) PlaceSum(s *Shape, l int, payload []byte, runs []Run) uint64 {
	sum := lo.moveSum(s, l, payload, runs, true, lo.fusedSum(s, l))
	if vrow := s.Geometry.VRow[l]; lo.VTrans && vrow > 0 {
		vpart := payload[s.Geometry.BlockTokens*s.Geometry.KRow[l]:]
		for _, r := range runs {
			transposed(lo.Layers[l].V, lo.Layers[l].VStride, vrow, s.VElem[l], r, vpart, true)
		}
	}
	return sum
}

// GatherSum is Gather fused with the layer's checksum, which it returns:
// where the rows allow (fusedSum) and payload is aligned for streaming
// stores, it gathers and sums each chunk in one pass (chunksum), writing
// the pool with streaming stores, as nothing reads a saved block soon;
// else it gathers, then sums the payload.
func (lo *Layout) GatherSum(s *Shape, l int, payload []byte, runs []Run) uint64 {
	if !lo.fusedSum(s, l) || !chunksum.Aligned(mem.Addr(payload)) {
		lo.Gather(s, l, payload, runs)
		return pool.Sum(payload)
	}
	return lo.moveSum(s, l, payload, runs, false, true)
}

// moveSum moves layer l's row-major rows between payload and the tensors
// (into the tensors when place) with streaming stores, chunk by chunk of
// pool.Sum, and returns the payload's sum: computed in the same pass for
// chunks chunksum fits when fused, else from payload after each chunk's
// copy. Transposed V is left to the caller.
func (lo *Layout) moveSum(s *Shape, l int, payload []byte, runs []Run, place, fused bool) uint64 {
	g := s.Geometry
	ly := lo.Layers[l]
	krow, vrow := g.KRow[l], g.VRow[l]
	kn := g.BlockTokens * krow
	payload = payload[:kn+g.BlockTokens*vrow]
	kpart, vpart := payload[:kn], payload[kn:]
	sum := pool.NewSummer()
	for off := 0; off < len(payload); off += pool.SumChunk {
		end := min(off+pool.SumChunk, len(payload))
		var ck *chunksum.Chunk
		if fused && chunksum.Fits(end-off) {
			c := chunksum.New(end - off)
			ck = &c
		}
		moveSpan(ly.K, ly.KStride, krow, runs, kpart, off, end, ck, place)
		if !lo.VTrans && vrow > 0 {
			moveSpan(ly.V, ly.VStride, vrow, runs, vpart, off-kn, end-kn, ck, place)
		}
		if ck != nil {
			sum.AddSum(ck.Sum64())
		} else {
			sum.Add(payload[off:end])
		}
	}
	return sum.Sum64()
}

// fusedSum reports whether layer l's rows can be summed as they move:
// every piece moveSpan copies is whole 64-byte stripes (rows of whole
// stripes, chunks of whole rows' multiples), the tensors' rows are 32-byte
// aligned, and V is not transposed (transposed V moves apart from the sum).
func (lo *Layout) fusedSum(s *Shape, l int) bool {
	ly := lo.Layers[l]
	krow, vrow := s.Geometry.KRow[l], s.Geometry.VRow[l]
	if pool.SumChunk%64 != 0 || krow%64 != 0 || !chunksum.Aligned(ly.K) || ly.KStride%32 != 0 {
		return false
	}
	return vrow == 0 || (!lo.VTrans && vrow%64 == 0 && chunksum.Aligned(ly.V) && ly.VStride%32 == 0)
}

// moveSpan moves bytes [from, to) of a block's K or V part (offsets into
// part, clipped to it) between part and the cells of its runs (into the
// cells when place), row by row where the tensor's rows are not adjacent,
// with streaming stores: through ck, which sums them, when not nil.
func moveSpan(base uintptr, stride uint64, row int, runs []Run, part []byte, from, to int, ck *chunksum.Chunk, place bool) {
	from, to = max(from, 0), min(to, len(part))
	move := func(tensor, blk []byte) {
		dst, src := tensor, blk
		if !place {
			dst, src = blk, tensor
		}
		if ck != nil {
			ck.Copy(dst, src)
		} else {
			mem.Stream(dst, src)
		}
	}
	for _, r := range runs {
		lo, hi := r.Pos*row, (r.Pos+r.N)*row
		a, b := max(lo, from), min(hi, to)
		if a >= b {
			continue
		}
		at := base + uintptr(uint64(r.Cell)*stride)
		if stride == uint64(row) {
			move(mem.Bytes(at+uintptr(a-lo), b-a), part[a:b])
			continue
		}
		for x := a; x < b; {
			k := (x - lo) / row
			rowEnd := min(lo+(k+1)*row, b)
			move(mem.Bytes(at+uintptr(uint64(k)*stride)+uintptr(x-lo-k*row), rowEnd-x), part[x:rowEnd])
			x = rowEnd
		}
	}
}

// Piece is a stretch of a layer's payload, bytes [Off, Off+Len), that sits
// at Addr in the tensors once placed.
type Piece struct {
	Off  int
	Len  int
	Addr uintptr
}

// Pieces lists where layer l's payload lands at the block's cells, in
// payload order: one piece per run for K and one for V (none for a K-only
// layer), so that a transfer can write each piece in place. It returns nil
// where rows do not sit back to back (a padded stride, transposed V):
// there every row or element would be a piece of its own, and the payload
// is staged and placed instead.
func (lo *Layout) Pieces(s *Shape, l int, runs []Run) []Piece {
	g := s.Geometry
	ly := lo.Layers[l]
	krow, vrow := g.KRow[l], g.VRow[l]
	if ly.KStride != uint64(krow) || (vrow > 0 && (lo.VTrans || ly.VStride != uint64(vrow))) {
		return nil
	}
	out := make([]Piece, 0, 2*len(runs))
	for part, p := range []struct {
		base uintptr
		row  int
	}{{ly.K, krow}, {ly.V, vrow}} {
		if p.row == 0 {
			continue // a K-only layer: no V to write
		}
		for _, r := range runs {
			out = append(out, Piece{
				Off:  part*g.BlockTokens*krow + r.Pos*p.row,
				Len:  r.N * p.row,
				Addr: p.base + uintptr(uint64(r.Cell)*uint64(p.row)),
			})
		}
	}
	return out
}

// SumPieces is pool.Sum of the size bytes of payload that pieces (as
// Pieces gives them) hold in the tensors: each chunk is summed where it
// sits, or, when it spans pieces, gathered into scratch (SumChunk bytes)
// first.
func SumPieces(pieces []Piece, size int, scratch []byte) uint64 {
	sum := pool.NewSummer()
	i := 0
	for off := 0; off < size; off += pool.SumChunk {
		end := min(off+pool.SumChunk, size)
		for pieces[i].Off+pieces[i].Len <= off {
			i++
		}
		if p := pieces[i]; end <= p.Off+p.Len {
			sum.Add(mem.Bytes(p.Addr+uintptr(off-p.Off), end-off))
			continue
		}
		buf := scratch[:end-off]
		for j, at := i, off; at < end; j++ {
			p := pieces[j]
			n := copy(buf[at-off:], mem.Bytes(p.Addr+uintptr(at-p.Off), p.Off+p.Len-at))
			at += n
		}
		sum.Add(buf)
	}
	return sum.Sum64()
}

// Gather copies layer l's rows at the block's cells into payload.
func (lo *Layout) Gather(s *Shape, l int, payload []byte, runs []Run) {
	lo.move(s, l, payload, runs, false)
}

func (lo *Layout) move(s *Shape, l int, payload []byte, runs []Run, place bool) {
	g := s.Geometry
	ly := lo.Layers[l]
	krow, vrow := g.KRow[l], g.VRow[l]
	kpart := payload[:g.BlockTokens*krow]
	vpart := payload[g.BlockTokens*krow : g.BlockTokens*(krow+vrow)]
	for _, r := range runs {
		rows(ly.K, ly.KStride, krow, r, kpart, place)
		if vrow == 0 {
			continue // a K-only layer
		}
		if !lo.VTrans {
			rows(ly.V, ly.VStride, vrow, r, vpart, place)
			continue
		}
		transposed(ly.V, ly.VStride, vrow, s.VElem[l], r, vpart, place)
	}
}

// rows moves a run of rows between the block and a row-major tensor.
func rows(base uintptr, stride uint64, row int, r Run, part []byte, place bool) {
	blk := part[r.Pos*row : (r.Pos+r.N)*row]
	at := base + uintptr(uint64(r.Cell)*stride)
	if stride == uint64(row) {
		t := mem.Bytes(at, r.N*row)
		if place {
			copy(t, blk)
		} else {
			copy(blk, t)
		}
		return
	}
	for i := 0; i < r.N; i++ {
		t := mem.Bytes(at+uintptr(uint64(i)*stride), row)
		if place {
			copy(t, blk[i*row:(i+1)*row])
		} else {
			copy(blk[i*row:(i+1)*row], t)
		}
	}
}

// transposed moves a run between token-major rows in the block and a
// dimension-major V tensor: dimension d of token p sits at
// base + d*stride + cell*elem.
func transposed(base uintptr, stride uint64, row, elem int, r Run, part []byte, place bool) {
	dims := row / elem
	for d := 0; d < dims; d++ {
		col := mem.Bytes(base+uintptr(uint64(d)*stride+uint64(r.Cell)*uint64(elem)), r.N*elem)
		src := part[r.Pos*row+d*elem:]
		switch elem {
		case 2:
			strided2(col, src, r.N, row, place)
		case 4:
			strided4(col, src, r.N, row, place)
		default:
			for i := 0; i < r.N; i++ {
				if place {
					copy(col[i*elem:(i+1)*elem], src[i*row:i*row+elem])
				} else {
					copy(src[i*row:i*row+elem], col[i*elem:(i+1)*elem])
				}
			}
		}
	}
}

func strided2(col, rows []byte, n, row int, place bool) {
	for i := 0; i < n; i++ {
		c, r := col[2*i:2*i+2:2*i+2], rows[i*row:i*row+2:i*row+2]
		if place {
			c[0], c[1] = r[0], r[1]
		} else {
			r[0], r[1] = c[0], c[1]
		}
	}
}

func strided4(col, rows []byte, n, row int, place bool) {
	for i := 0; i < n; i++ {
		c, r := col[4*i:4*i+4:4*i+4], rows[i*row:i*row+4:i*row+4]
		if place {
			copy(c, r)
		} else {
			copy(r, c)
		}
	}
}
