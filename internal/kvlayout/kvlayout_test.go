package kvlayout

import (
	"bytes"
	"math"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mcbridge/mcbridge/internal/chunksum"
	"github.com/mcbridge/mcbridge/internal/mem"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/status"
)

func shape(block int, krow, vrow, elem []int) *Shape {
	return &Shape{Geometry: &pool.Geometry{BlockTokens: block, KRow: krow, VRow: vrow}, VElem: elem}
}

func TestValidate(t *testing.T) {
	s := shape(4, []int{16, 16}, []int{8, 8}, []int{2, 2})
	const a = 0x10000
	good := func() *Layout {
		return &Layout{Cells: 32, Location: "cpu:0", Layers: []Layer{
			{K: a, V: a, KStride: 16, VStride: 8},
			{K: a, V: a, KStride: 32, VStride: 8},
		}}
	}
	trans := func() *Layout {
		lo := good()
		lo.VTrans = true
		lo.Layers[0].VStride, lo.Layers[1].VStride = 64, 64 // 32 cells of 2 bytes
		return lo
	}
	for _, lo := range []*Layout{good(), trans()} {
		require.NoError(t, lo.Validate(s), "a good layout")
	}
	// A K-only model (MLA) has no V tensors, whatever the V layout says.
	kOnly := shape(4, []int{16, 16}, []int{0, 0}, []int{1, 1})
	for _, lo := range []*Layout{good(), trans()} {
		for l := range lo.Layers {
			lo.Layers[l].V, lo.Layers[l].VStride = 0, 0
		}
		require.NoError(t, lo.Validate(kOnly), "a K-only layout (V transposed %v)", lo.VTrans)
	}
	noLoc := good()
	noLoc.Location = ""
	require.NoError(t, noLoc.Validate(s), "no location")

	top := uintptr(math.MaxUint64 - 100)
	for _, tc := range []struct {
		name string
		lo   func() *Layout
		s    *Shape
		code status.Code
		msg  string
	}{
		{"layer count", func() *Layout { lo := good(); lo.Layers = lo.Layers[:1]; return lo }, nil, status.Layout, "1 layers, model 2"},
		{"V element sizes", good, shape(4, []int{16, 16}, []int{8, 8}, []int{2}), status.Layout, "V element sizes"},
		{"no cells", func() *Layout { lo := good(); lo.Cells = 0; return lo }, nil, status.Layout, "no cells"},
		{"device memory", func() *Layout { lo := good(); lo.Location = "cuda:0"; return lo }, nil, status.Unsupported, "cuda:0"},
		{"bare cpu", func() *Layout { lo := good(); lo.Location = "cpu:"; return lo }, nil, status.Unsupported, "cpu:"},
		{"NULL K", func() *Layout { lo := good(); lo.Layers[1].K = 0; return lo }, nil, status.Layout, "layer 1: K at 0x0"},
		{"NULL V", func() *Layout { lo := good(); lo.Layers[0].V = 0; return lo }, nil, status.Layout, "layer 0: K at 0x10000, V at 0x0"},
		{"V of a K-only model", good, shape(4, []int{16, 16}, []int{0, 0}, []int{2, 2}), status.Layout, "V at 0x10000 for V rows of 0 bytes"},
		{"K stride below row", func() *Layout { lo := good(); lo.Layers[0].KStride = 15; return lo }, nil, status.Layout, "K stride 15"},
		{"V stride below row", func() *Layout { lo := good(); lo.Layers[1].VStride = 7; return lo }, nil, status.Layout, "V stride 7"},
		{"K wraps", func() *Layout { lo := good(); lo.Layers[0].K = top; return lo }, nil, status.Layout, "K tensor reaches past user space"},
		{"K stride overflows", func() *Layout { lo := good(); lo.Layers[0].KStride = math.MaxUint64 / 16; return lo }, nil, status.Layout, "K tensor reaches past user space"},
		{"V wraps", func() *Layout { lo := good(); lo.Layers[1].V = top; return lo }, nil, status.Layout, "V tensor reaches past user space"},
		{"transposed V wraps", func() *Layout { lo := trans(); lo.Layers[1].V = top; return lo }, nil, status.Layout, "V tensor reaches past user space"},
		{"transposed V stride overflows", func() *Layout { lo := trans(); lo.Layers[0].VStride = math.MaxUint64 / 2; return lo }, nil, status.Layout, "V tensor reaches past user space"},
		{"transposed stride too small", func() *Layout { lo := trans(); lo.Layers[1].VStride = 63; return lo }, nil, status.Layout, "fewer than 32 cells"},
		{"V row not whole elements", trans, shape(4, []int{16, 16}, []int{8, 9}, []int{2, 2}), status.Layout, "not whole elements"},
		{"V element of 0", trans, shape(4, []int{16, 16}, []int{8, 8}, []int{2, 0}), status.Layout, "not whole elements"},
		{"V element larger than the row", trans, shape(4, []int{16, 16}, []int{8, 8}, []int{16, 2}), status.Layout, "not whole elements"},
	} {
		ss := s
		if tc.s != nil {
			ss = tc.s
		}
		err := tc.lo().Validate(ss)
		assert.Equal(t, tc.code, status.Of(err), "%s: %v", tc.name, err)
		assert.ErrorContains(t, err, tc.msg, tc.name)
	}
	// A tensor may end exactly at the top of user space (2^57); one byte
	// further cannot be memory the host owns, though it does not wrap.
	edge := good()
	edge.Layers = edge.Layers[:1]
	edge.Cells = 1
	edge.Layers[0].K = uintptr(1<<57 - 16)
	one := shape(4, []int{16}, []int{8}, []int{2})
	assert.NoError(t, edge.Validate(one), "K ending at the top of user space")
	edge.Layers[0].K++
	err := edge.Validate(one)
	assert.Equal(t, status.Layout, status.Of(err), "K ending past user space: %v", err)
}

func TestCheckCells(t *testing.T) {
	lo := &Layout{Cells: 70}
	for _, tc := range []struct {
		cells []uint32
		msg   string
	}{
		{[]uint32{0, 1, 69}, ""},
		{nil, ""},
		{[]uint32{3, 70}, "cell 70 of 70"},
		{[]uint32{1 << 31}, "of 70"},
		{[]uint32{5, 64, 5}, "cell 5 given twice"},
		{[]uint32{69, 0, 69}, "cell 69 given twice"},
	} {
		err := lo.CheckCells(tc.cells)
		if tc.msg == "" {
			assert.NoError(t, err, "%v", tc.cells)
			continue
		}
		assert.Equal(t, status.Layout, status.Of(err), "%v: %v", tc.cells, err)
		assert.ErrorContains(t, err, tc.msg, "%v", tc.cells)
	}
}

func TestRuns(t *testing.T) {
	for _, tc := range []struct {
		cells []uint32
		want  []Run
	}{
		{nil, nil},
		{[]uint32{7}, []Run{{0, 1, 7}}},
		{[]uint32{0, 1, 2, 3}, []Run{{0, 4, 0}}},
		{[]uint32{5, 6, 1, 2, 3, 9}, []Run{{0, 2, 5}, {2, 3, 1}, {5, 1, 9}}},
		{[]uint32{3, 2, 1}, []Run{{0, 1, 3}, {1, 1, 2}, {2, 1, 1}}},
		{[]uint32{math.MaxUint32, 0}, []Run{{0, 1, math.MaxUint32}, {1, 1, 0}}},
	} {
		assert.Equal(t, tc.want, Runs(tc.cells), "Runs(%v)", tc.cells)
	}
}

// guarded is a tensor of n bytes that ends against an inaccessible page and
// starts after canary bytes, so a write past its end faults and a write
// before its start shows in the canary.
type guarded struct {
	mapping []byte
	slack   []byte // canary bytes before the tensor
	buf     []byte
}

const canary = 0xa5

func newGuarded(t testing.TB, n int) *guarded {
	t.Helper()
	ps := unix.Getpagesize()
	pages := (n + ps - 1) / ps
	if pages == 0 {
		pages = 1
	}
	m, err := mem.Map((pages + 2) * ps)
	require.NoError(t, err)
	require.NoError(t, unix.Mprotect(m[:ps], unix.PROT_NONE))
	require.NoError(t, unix.Mprotect(m[len(m)-ps:], unix.PROT_NONE))
	data := m[ps : len(m)-ps]
	g := &guarded{mapping: m, slack: data[:len(data)-n], buf: data[len(data)-n:]}
	for i := range g.slack {
		g.slack[i] = canary
	}
	return g
}

func (g *guarded) addr() uintptr { return mem.Addr(g.buf) }

func (g *guarded) slackIntact() bool {
	for _, c := range g.slack {
		if c != canary {
			return false
		}
	}
	return true
}

func (g *guarded) free() { _ = mem.Unmap(g.mapping) }

// tensors are one layer's K and V, sized exactly to what the layout says
// its cells occupy.
type tensors struct {
	k, v *guarded
}

func kExtent(lo *Layout, krow int, ly Layer) int {
	return int(uint64(lo.Cells-1)*ly.KStride) + krow
}

func vExtent(lo *Layout, vrow, elem int, ly Layer) int {
	if vrow == 0 {
		return 0 // a K-only layer
	}
	if lo.VTrans {
		return int(uint64(vrow/elem-1)*ly.VStride) + int(lo.Cells)*elem
	}
	return int(uint64(lo.Cells-1)*ly.VStride) + vrow
}

// expectPlaced writes layer l's rows into kt and vt by index arithmetic, the
// reference that Place's address arithmetic must agree with.
func expectPlaced(lo *Layout, s *Shape, l int, payload []byte, cells []uint32, kt, vt []byte) {
	g := s.Geometry
	ly := lo.Layers[l]
	krow, vrow, elem := g.KRow[l], g.VRow[l], s.VElem[l]
	vbase := g.BlockTokens * krow
	for p, c := range cells {
		copy(kt[uint64(c)*ly.KStride:][:krow], payload[p*krow:(p+1)*krow])
		if vrow == 0 {
			continue
		}
		vsrc := payload[vbase+p*vrow : vbase+(p+1)*vrow]
		if !lo.VTrans {
			copy(vt[uint64(c)*ly.VStride:][:vrow], vsrc)
			continue
		}
		for d := 0; d < vrow/elem; d++ {
			copy(vt[uint64(d)*ly.VStride+uint64(c)*uint64(elem):][:elem], vsrc[d*elem:(d+1)*elem])
		}
	}
}

func fillRandom(r *rand.Rand, b []byte) { _, _ = r.Read(b) }

// checkPlaceGather places layer l of a random payload at cells, checks the
// tensors against the reference byte for byte (untouched cells, stride
// padding and canaries included), then gathers the rows back.
func checkPlaceGather(t testing.TB, r *rand.Rand, lo *Layout, s *Shape, l int, cells []uint32, ts []tensors) {
	t.Helper()
	g := s.Geometry
	n := g.LayerSize(l)
	pl := newGuarded(t, n)
	defer pl.free()
	fillRandom(r, pl.buf)
	payload := append([]byte{}, pl.buf...)

	wantK := make([][]byte, len(ts))
	wantV := make([][]byte, len(ts))
	before := make([]struct{ k, v []byte }, len(ts))
	for i, tt := range ts {
		fillRandom(r, tt.k.buf)
		fillRandom(r, tt.v.buf)
		wantK[i] = append([]byte{}, tt.k.buf...)
		wantV[i] = append([]byte{}, tt.v.buf...)
		before[i].k, before[i].v = append([]byte{}, tt.k.buf...), append([]byte{}, tt.v.buf...)
	}
	expectPlaced(lo, s, l, payload, cells, wantK[l], wantV[l])

	runs := Runs(cells)
	lo.Place(s, l, pl.buf, runs)
	for i, tt := range ts {
		require.True(t, bytes.Equal(tt.k.buf, wantK[i]), "Place of layer %d: layer %d's K tensor differs from the reference (cells %v, layout %+v)", l, i, cells, lo)
		require.True(t, bytes.Equal(tt.v.buf, wantV[i]), "Place of layer %d: layer %d's V tensor differs from the reference (cells %v, layout %+v)", l, i, cells, lo)
		require.True(t, tt.k.slackIntact(), "Place of layer %d wrote before layer %d's K tensor", l, i)
		require.True(t, tt.v.slackIntact(), "Place of layer %d wrote before layer %d's V tensor", l, i)
	}
	require.True(t, bytes.Equal(pl.buf, payload), "Place changed the payload")
	require.True(t, pl.slackIntact(), "Place wrote before the payload")

	// PlaceSum over the tensors as they were: the same bytes placed, and
	// the layer's checksum.
	for i, tt := range ts {
		copy(tt.k.buf, before[i].k)
		copy(tt.v.buf, before[i].v)
	}
	require.Equal(t, pool.Sum(payload), lo.PlaceSum(s, l, pl.buf, runs), "PlaceSum of layer %d: not the payload's checksum", l)
	for i, tt := range ts {
		require.True(t, bytes.Equal(tt.k.buf, wantK[i]), "PlaceSum of layer %d: layer %d's K tensor differs from the reference", l, i)
		require.True(t, bytes.Equal(tt.v.buf, wantV[i]), "PlaceSum of layer %d: layer %d's V tensor differs from the reference", l, i)
		require.True(t, tt.k.slackIntact() && tt.v.slackIntact(), "PlaceSum of layer %d wrote outside layer %d's tensors", l, i)
	}

	clear(pl.buf)
	lo.Gather(s, l, pl.buf, runs)
	require.True(t, bytes.Equal(pl.buf, payload), "Gather of layer %d did not return the placed rows (cells %v)", l, cells)
	require.True(t, pl.slackIntact(), "Gather wrote before the payload")
	clear(pl.buf)
	require.Equal(t, pool.Sum(payload), lo.GatherSum(s, l, pl.buf, runs), "GatherSum of layer %d: not the payload's checksum", l)
	require.True(t, bytes.Equal(pl.buf, payload), "GatherSum of layer %d did not return the placed rows (cells %v)", l, cells)
	require.True(t, pl.slackIntact(), "GatherSum wrote before the payload")
	for i, tt := range ts {
		require.True(t, bytes.Equal(tt.k.buf, wantK[i]), "Gather changed layer %d's K tensor", i)
		require.True(t, bytes.Equal(tt.v.buf, wantV[i]), "Gather changed layer %d's V tensor", i)
	}

	// Pieces: each piece landed where it says gives the tensors Place
	// gives, and SumPieces of what landed is the payload's checksum.
	ly := lo.Layers[l]
	pieces := lo.Pieces(s, l, runs)
	packed := ly.KStride == uint64(g.KRow[l]) && (g.VRow[l] == 0 || !lo.VTrans && ly.VStride == uint64(g.VRow[l]))
	require.Equal(t, packed, pieces != nil, "Pieces of layer %d (layout %+v): pieces only where rows sit back to back", l, lo)
	if pieces == nil {
		return
	}
	for i, tt := range ts {
		copy(tt.k.buf, before[i].k)
		copy(tt.v.buf, before[i].v)
	}
	at := 0
	for _, p := range pieces {
		require.Equal(t, at, p.Off, "pieces of layer %d cover the payload in order", l)
		copy(mem.Bytes(p.Addr, p.Len), payload[p.Off:p.Off+p.Len])
		at += p.Len
	}
	require.Equal(t, n, at, "pieces of layer %d cover the payload", l)
	for i, tt := range ts {
		require.True(t, bytes.Equal(tt.k.buf, wantK[i]), "pieces of layer %d: layer %d's K tensor differs from the reference", l, i)
		require.True(t, bytes.Equal(tt.v.buf, wantV[i]), "pieces of layer %d: layer %d's V tensor differs from the reference", l, i)
		require.True(t, tt.k.slackIntact() && tt.v.slackIntact(), "pieces of layer %d lie outside layer %d's tensors", l, i)
	}
	scratch := make([]byte, pool.SumChunk)
	require.Equal(t, pool.Sum(payload), SumPieces(pieces, n, scratch), "SumPieces of layer %d: not the payload's checksum", l)
	for _, p := range []Piece{pieces[0], pieces[len(pieces)/2], pieces[len(pieces)-1]} {
		b := mem.Bytes(p.Addr+uintptr(p.Len-1), 1)
		b[0] ^= 1
		require.NotEqual(t, pool.Sum(payload), SumPieces(pieces, n, scratch), "SumPieces of layer %d missed a flipped byte at payload offset %d", l, p.Off+p.Len-1)
		b[0] ^= 1
	}
}

func buildLayout(t testing.TB, lo *Layout, s *Shape) []tensors {
	t.Helper()
	g := s.Geometry
	ts := make([]tensors, len(lo.Layers))
	for l := range lo.Layers {
		ly := &lo.Layers[l]
		ts[l].k = newGuarded(t, kExtent(lo, g.KRow[l], *ly))
		ts[l].v = newGuarded(t, vExtent(lo, g.VRow[l], s.VElem[l], *ly))
		ly.K, ly.V = ts[l].k.addr(), ts[l].v.addr()
		if g.VRow[l] == 0 {
			ly.V = 0 // a K-only layer: its V tensor stays empty
		}
	}
	return ts
}

func freeLayout(ts []tensors) {
	for _, tt := range ts {
		tt.k.free()
		tt.v.free()
	}
}

func TestPlaceGatherRoundTrip(t *testing.T) {
	const block, cellCount = 16, 64
	r := rand.New(rand.NewSource(1))
	scattered := []uint32{40, 41, 42, 3, 4, 63, 0, 10, 11, 12, 13, 14, 50, 20, 21, 7}
	for _, elem := range []int{1, 2, 4, 8} {
		for _, vtrans := range []bool{false, true} {
			// Layer 0 packs rows; layer 1 pads them, taking the per-row path.
			krow, vrow := []int{8 * elem, 12 * elem}, []int{6 * elem, 10 * elem}
			s := shape(block, krow, vrow, []int{elem, elem})
			lo := &Layout{Cells: cellCount, VTrans: vtrans, Location: "cpu:0", Layers: []Layer{
				{KStride: uint64(krow[0]), VStride: uint64(vrow[0])},
				{KStride: uint64(krow[1] + 24), VStride: uint64(vrow[1] + 3)},
			}}
			if vtrans {
				lo.Layers[0].VStride = cellCount * uint64(elem)
				lo.Layers[1].VStride = cellCount*uint64(elem) + 5
			}
			ts := buildLayout(t, lo, s)
			require.NoError(t, lo.Validate(s))
			for _, cells := range [][]uint32{scattered, seqCells(48, block), seqCells(0, block)} {
				require.NoError(t, lo.CheckCells(cells))
				for l := range lo.Layers {
					checkPlaceGather(t, r, lo, s, l, cells, ts)
				}
			}
			freeLayout(ts)
		}
	}
}

// A K-only model (MLA): each layer's payload is its K rows, and no copy
// touches a V tensor, whatever the V layout says.
func TestPlaceGatherKOnly(t *testing.T) {
	const block, cellCount = 8, 32
	r := rand.New(rand.NewSource(4))
	for _, vtrans := range []bool{false, true} {
		krow := []int{96, 100}
		s := shape(block, krow, []int{0, 0}, []int{1, 1})
		lo := &Layout{Cells: cellCount, VTrans: vtrans, Location: "cpu:0", Layers: []Layer{
			{KStride: uint64(krow[0])},
			{KStride: uint64(krow[1] + 12)},
		}}
		ts := buildLayout(t, lo, s)
		require.NoError(t, lo.Validate(s))
		for _, cells := range [][]uint32{{9, 10, 11, 2, 3, 31, 0, 20}, seqCells(24, block)} {
			require.NoError(t, lo.CheckCells(cells))
			for l := range lo.Layers {
				checkPlaceGather(t, r, lo, s, l, cells, ts)
			}
		}
		freeLayout(ts)
	}
}

func seqCells(from, n int) []uint32 {
	c := make([]uint32, n)
	for i := range c {
		c[i] = uint32(from + i)
	}
	return c
}

// Place at the last cells of a tensor that ends against a guard page: an
// off-by-one past the described extent faults instead of passing silently.
func TestPlaceAtTensorEnd(t *testing.T) {
	for _, vtrans := range []bool{false, true} {
		s := shape(4, []int{6}, []int{6}, []int{2})
		lo := &Layout{Cells: 9, VTrans: vtrans, Layers: []Layer{{KStride: 6, VStride: 6}}}
		if vtrans {
			lo.Layers[0].VStride = 18
		}
		ts := buildLayout(t, lo, s)
		require.NoError(t, lo.Validate(s))
		checkPlaceGather(t, rand.New(rand.NewSource(2)), lo, s, 0, []uint32{8, 5, 6, 7}, ts)
		freeLayout(ts)
	}
}

// Rows of bench-model size that straddle pool.SumChunk's boundaries and
// mem.Stream's alignment steps, packed and padded, in runs of every
// length from one cell to a whole block.
func TestPlaceSumAcrossChunks(t *testing.T) {
	const block, cellCount = 256, 700
	r := rand.New(rand.NewSource(3))
	var cells []uint32
	for c, run := uint32(3), 1; len(cells) < block; c, run = c+uint32(run)+5, run*3 {
		for i := 0; i < run && len(cells) < block; i++ {
			cells = append(cells, c+uint32(i))
		}
	}
	for _, vtrans := range []bool{false, true} {
		// Layers 2 and 3 have rows of whole 64-byte stripes at 32-byte
		// aligned addresses, which chunksum sums as they move (packed and
		// padded); layers 0 and 1 do not.
		krow, vrow := []int{1000, 1024, 512, 512}, []int{770, 512, 512, 1024}
		s := shape(block, krow, vrow, []int{2, 2, 2, 2})
		lo := &Layout{Cells: cellCount, VTrans: vtrans, Location: "cpu:0", Layers: []Layer{
			{KStride: uint64(krow[0]), VStride: uint64(vrow[0])},
			{KStride: uint64(krow[1] + 40), VStride: uint64(vrow[1] + 6)},
			{KStride: uint64(krow[2]), VStride: uint64(vrow[2])},
			{KStride: uint64(krow[3] + 64), VStride: uint64(vrow[3] + 32)},
		}}
		if vtrans {
			lo.Layers[0].VStride = cellCount * 2
			lo.Layers[1].VStride = cellCount*2 + 6
			lo.Layers[2].VStride = cellCount * 2
			lo.Layers[3].VStride = cellCount*2 + 32
		}
		ts := buildLayout(t, lo, s)
		require.NoError(t, lo.Validate(s))
		for l := range lo.Layers {
			require.Equal(t, l >= 2 && !vtrans && chunksum.Fits(pool.SumChunk), lo.fusedSum(s, l), "layer %d summed as it moves", l)
		}
		for _, cs := range [][]uint32{cells, seqCells(400, block)} {
			require.NoError(t, lo.CheckCells(cs))
			for l := range lo.Layers {
				checkPlaceGather(t, r, lo, s, l, cs, ts)
			}
		}
		freeLayout(ts)
	}
}
