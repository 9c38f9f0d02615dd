package llamastate

import (
	"bytes"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"
)

// FuzzParse: Parse never panics, allocates in proportion to its input,
// and whatever it accepts builds back to the same bytes. Whatever Slice
// accepts is a state of exactly positions 0..n-1 that slices to itself.
func FuzzParse(f *testing.F) {
	files, err := filepath.Glob(filepath.Join("testdata", "*.bin"))
	require.NoError(f, err, "no seeds in testdata")
	require.NotEmpty(f, files, "no seeds in testdata")
	// The real states cut to two positions: every framing and layout, in
	// a few hundred bytes, so that minimizing an interesting input is quick.
	for _, name := range files {
		b, err := os.ReadFile(name)
		require.NoError(f, err)
		st, err := Parse(b)
		require.NoError(f, err)
		small, err := st.Slice(2)
		require.NoError(f, err)
		seed, err := small.Build()
		require.NoError(f, err)
		f.Add(seed)
		// A sliding-window memory's state: the window cache after the base.
		if len(small.Streams[0].Layers) > 1 || len(small.Streams) > 1 {
			si, _ := small.Sequence()
			if len(small.Streams[si].Layers) > 1 {
				seed, err = twoCachesOf(f, small, 1).Build()
				require.NoError(f, err)
				f.Add(seed)
			}
		}
		small.CellExt = true
		for i := range small.Streams {
			for c := range small.Streams[i].Cells {
				small.Streams[i].Cells[c].Ext = CellExt{X: int32(c), Y: int32(c), Tok: int32(7 * c)}
			}
		}
		seed, err = small.Build()
		require.NoError(f, err)
		f.Add(seed)
		// The same without V sections, as an MLA cache writes its
		// states, with and without extended cells.
		for _, ext := range []bool{true, false} {
			small.CellExt = ext
			seed, err = kOnly(small).Build()
			require.NoError(f, err)
			f.Add(seed)
		}
	}
	f.Add([]byte{})
	f.Add(recurrentState(f, SlotFile, 3, 40))
	f.Add(recurrentState(f, Memory, 8, 7))
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzRecurrent(t, b)
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		st, err := Parse(b)
		runtime.ReadMemStats(&after)
		// The worst case is a stream list: 4 input bytes per 56-byte Stream,
		// read four times (plain, extended cells, no V, both).
		require.LessOrEqual(t, after.TotalAlloc-before.TotalAlloc, 64*uint64(len(b))+64<<10, "bytes Parse of %d bytes allocated", len(b))
		fuzzTwoCaches(t, b)
		fuzzWindowCache(t, b)
		_, _ = ReframeCache(b, 2) // never panics on any input
		if err != nil {
			return
		}
		if st.Kind == Memory && oneStreamWithCells(st.Streams) && len(st.Second) == 0 {
			out, err := ReframeSeqState(b, 3)
			require.NoError(t, err, "ReframeSeqState refused one sequence's state")
			got, err := Parse(out)
			require.NoError(t, err, "ReframeSeqState's output does not read")
			require.Len(t, got.Streams, 3)
		}
		out, err := st.Build()
		require.NoError(t, err, "accepted %d bytes but does not build", len(b))
		require.True(t, bytes.Equal(out, b), "accepted %d bytes but built %d", len(b), len(out))
		require.Equal(t, len(b), st.Size(), "size of an accepted state")
		si, err := st.Sequence()
		if err != nil {
			return
		}
		cells := len(st.Streams[si].Cells)
		for _, n := range []int{1, cells / 2, cells} {
			sl, err := st.Slice(n)
			if err != nil {
				continue
			}
			s := sl.Streams[si]
			require.Len(t, s.Cells, n, "Slice(%d): cells", n)
			require.Len(t, sl.Streams, len(st.Streams), "Slice(%d): streams", n)
			require.Equal(t, st.CellExt, sl.CellExt, "Slice(%d): cell extensions", n)
			require.Equal(t, st.KOnly, sl.KOnly, "Slice(%d): V sections", n)
			for p, c := range s.Cells {
				require.Equal(t, int32(p), c.Pos, "Slice(%d): cell %d: %+v", n, p, c)
				require.Len(t, c.SeqIDs, 1, "Slice(%d): cell %d: %+v", n, p, c)
			}
			again, err := sl.Slice(n)
			require.NoError(t, err, "Slice(%d) of a slice", n)
			b1, _ := sl.Build()
			b2, _ := again.Build()
			require.True(t, bytes.Equal(b1, b2), "Slice(%d) is not idempotent", n)
		}
	})
}

// fuzzTwoCaches: whatever ParseTwoCaches accepts builds back to the same bytes, and
// what Merge makes of it splits into a state of two caches again.
func fuzzTwoCaches(t *testing.T, b []byte) {
	st, err := ParseTwoCaches(b)
	if err != nil {
		return
	}
	out, err := st.Build()
	require.NoError(t, err, "ParseTwoCaches accepted %d bytes that do not build", len(b))
	require.True(t, bytes.Equal(out, b), "ParseTwoCaches accepted %d bytes but built %d", len(b), len(out))
	si, err := st.Sequence()
	if err != nil {
		return
	}
	n := len(st.Streams[si].Cells)
	m, err := st.Merge(n)
	if err != nil {
		return
	}
	nb := len(st.Streams[si].Layers)
	sp, err := m.Split(nb, n-1)
	require.NoError(t, err, "Split of a merged state")
	require.Len(t, sp.Second[si].Cells, 1)
	require.Len(t, sp.Streams[si].Layers, nb)
}

// fuzzWindowCache: the bytes after a state's first cache that ParseCache
// accepts build back to themselves, and CacheWithLead frames them with one
// cell more that reads back.
func fuzzWindowCache(t *testing.T, b []byte) {
	lead, rest, err := ParseLeading(b)
	if err != nil || rest == 0 {
		return
	}
	window := b[len(b)-rest:]
	ss, err := ParseCache(window, lead.CellExt, lead.KOnly)
	if err != nil {
		return
	}
	require.True(t, bytes.Equal(appendCache(nil, ss, lead.CellExt, lead.KOnly, true), window), "ParseCache accepted %d bytes that do not build back", rest)
	in := &State{Streams: ss}
	if si, err := in.Sequence(); err == nil && oneStreamWithCells(ss) {
		for _, n := range []int{1, 3} {
			out, err := ReframeCache(window, n)
			require.NoError(t, err, "ReframeCache refused one sequence's cache of %d streams", len(ss))
			got, err := ParseCache(out, lead.CellExt, lead.KOnly)
			require.NoError(t, err, "ReframeCache's output does not read")
			require.Len(t, got, n)
			at := 0
			if n == len(ss) {
				at = si
			}
			require.Equal(t, rowsOf(ss[si]), rowsOf(got[at]), "ReframeCache for %d streams", n)
		}
	}
	if si, err := in.Sequence(); err == nil {
		// Whatever CacheOfPositions accepts is one stream of positions
		// 0..n-1 in order.
		n := len(ss[si].Cells)
		if out, err := CacheOfPositions(window, lead.CellExt, lead.KOnly, n); err == nil {
			got, err := ParseCache(out, lead.CellExt, lead.KOnly)
			require.NoError(t, err, "CacheOfPositions' output does not read")
			require.Len(t, got, 1)
			require.Len(t, got[0].Cells, n)
			for c, cell := range got[0].Cells {
				require.Equal(t, int32(c), cell.Pos, "CacheOfPositions: cell %d", c)
			}
		}
	}
	out, err := CacheWithLead(window, lead.CellExt, lead.KOnly, 2, Cell{Pos: -1, SeqIDs: []int32{0}})
	if err != nil {
		return
	}
	got, err := ParseCache(out, lead.CellExt, lead.KOnly)
	require.NoError(t, err, "CacheWithLead's output does not read")
	require.Equal(t, int32(-1), got[0].Cells[0].Pos)
}

func oneStreamWithCells(ss []Stream) bool {
	n := 0
	for _, s := range ss {
		if len(s.Cells) > 0 {
			n++
		}
	}
	return n == 1
}

// fuzzRecurrent: what ParseRecurrent and ParseFramed accept builds back to
// the same bytes.
func fuzzRecurrent(t *testing.T, b []byte) {
	if st, mem, err := ParseFramed(b); err == nil {
		out, err := st.AppendFramed(nil, mem)
		require.NoError(t, err, "ParseFramed accepted %d bytes that do not build", len(b))
		require.True(t, bytes.Equal(out, b), "ParseFramed accepted %d bytes but built %d", len(b), len(out))
		require.Equal(t, len(b), st.RecurrentSize(mem))
	}
	st, rec, err := ParseRecurrent(b)
	if err != nil {
		return
	}
	out, err := st.AppendRecurrent(nil, rec)
	require.NoError(t, err, "ParseRecurrent accepted %d bytes that do not build", len(b))
	require.True(t, bytes.Equal(out, b), "ParseRecurrent accepted %d bytes but built %d", len(b), len(out))
}
