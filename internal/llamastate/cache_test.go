package llamastate

import (
	"bytes"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestCacheWithLead(t *testing.T) {
	for _, file := range []string{"seq-fa-on.bin", "seq-fa-off.bin", "seq-two-streams-fa-off.bin", "seq-scattered-fa-off.bin", "slot-fa-on.bin"} {
		st, err := Parse(readTestdata(t, file))
		require.NoError(t, err)
		si, _ := st.Sequence()
		n := len(st.Streams[si].Cells)
		const from = 8
		b, err := twoCachesOf(t, st, from).Build()
		require.NoError(t, err)
		_, rest, err := ParseLeading(b)
		require.NoError(t, err)
		window := b[len(b)-rest:]

		ss, err := ParseCache(window, st.CellExt, st.KOnly)
		require.NoError(t, err, "%s", file)
		again := appendCache(nil, ss, st.CellExt, st.KOnly, true)
		require.True(t, bytes.Equal(window, again), "%s: ParseCache does not build back", file)
		_, err = ParseCache(append(bytes.Clone(window), 0), st.CellExt, st.KOnly)
		require.Error(t, err, "%s: a byte after the cache", file)
		_, err = ParseCache(window[:len(window)-1], st.CellExt, st.KOnly)
		require.Error(t, err, "%s: a cut cache", file)
		// Two caches back to back: the leading one, and the bytes after it.
		lead, after, err := ParseCacheLeading(append(bytes.Clone(window), window...), st.CellExt, st.KOnly)
		require.NoError(t, err, "%s", file)
		require.Equal(t, len(window), after)
		require.Equal(t, ss, lead)

		for _, nStream := range []int{1, 3} {
			lead := Cell{Pos: 0, SeqIDs: []int32{st.Streams[si].Cells[0].SeqIDs[0]}}
			out, err := CacheWithLead(window, st.CellExt, st.KOnly, nStream, lead)
			require.NoError(t, err, "%s", file)
			got, err := ParseCache(out, st.CellExt, st.KOnly)
			require.NoError(t, err, "%s", file)
			require.Len(t, got, nStream)
			g := &got[0]
			require.Len(t, g.Cells, n-from+1)
			require.Equal(t, lead.Pos, g.Cells[0].Pos)
			for s := 1; s < nStream; s++ {
				require.Empty(t, got[s].Cells, "%s: stream %d", file, s)
			}
			for l := range g.Layers {
				k, v := kvAt(g, l, 0)
				require.Equal(t, make([]byte, len(k)), k, "%s: the lead's K, layer %d", file, l)
				require.Equal(t, make([]byte, len(v)), v, "%s: the lead's V, layer %d", file, l)
				for p := from; p < n; p++ {
					wk, wv := kvAt(&st.Streams[si], 1, int32(p))
					gk, gv := kvAt(g, l, int32(p))
					require.True(t, bytes.Equal(wk, gk) && bytes.Equal(wv, gv), "%s: position %d", file, p)
				}
			}
		}
		_, err = CacheWithLead(window, st.CellExt, st.KOnly, 1, Cell{Pos: from, SeqIDs: []int32{0}})
		require.Error(t, err, "%s: a lead at a position the cache holds", file)
		_, err = CacheWithLead(window, st.CellExt, st.KOnly, 0, Cell{Pos: 0, SeqIDs: []int32{0}})
		require.Error(t, err, "%s: no stream", file)
	}
}

func TestReframeCache(t *testing.T) {
	for _, file := range []string{"seq-fa-on.bin", "seq-fa-off.bin", "seq-two-streams-fa-off.bin", "seq-scattered-fa-off.bin", "slot-fa-on.bin"} {
		st, err := Parse(readTestdata(t, file))
		require.NoError(t, err)
		si, _ := st.Sequence()
		b, err := twoCachesOf(t, st, 8).Build()
		require.NoError(t, err)
		_, rest, err := ParseLeading(b)
		require.NoError(t, err)
		window := b[len(b)-rest:]
		held, err := ParseCache(window, st.CellExt, st.KOnly)
		require.NoError(t, err, "%s", file)

		for _, nStream := range []int{1, 2, 3} {
			out, err := ReframeCache(window, nStream)
			require.NoError(t, err, "%s", file)
			got, err := ParseCache(out, st.CellExt, st.KOnly)
			require.NoError(t, err, "%s: %d streams", file, nStream)
			require.Len(t, got, nStream)
			if nStream == len(held) {
				require.True(t, bytes.Equal(window, out), "%s: a state of the context's count comes back as it is", file)
				continue
			}
			// The sequence's stream first, as it was, the rest empty.
			require.Equal(t, rowsOf(held[si]), rowsOf(got[0]), "%s: %d streams", file, nStream)
			for s := 1; s < nStream; s++ {
				require.Empty(t, got[s].Cells, "%s: stream %d", file, s)
			}
		}
	}
	empty := []byte{2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
	out, err := ReframeCache(empty, 3)
	require.NoError(t, err)
	require.Equal(t, []byte{3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, out, "a state without cells")

	for name, b := range map[string][]byte{
		"nothing":                      nil,
		"no stream":                    {0, 0, 0, 0},
		"more streams than bytes":      {3, 0, 0, 0, 0, 0, 0, 0},
		"bytes after empty streams":    {1, 0, 0, 0, 0, 0, 0, 0, 9},
		"cells in two streams":         {2, 0, 0, 0, 1, 0, 0, 0, 7, 7, 7, 7, 1, 0, 0, 0},
		"a stream too short to follow": {3, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0},
	} {
		_, err := ReframeCache(b, 3)
		require.Error(t, err, name)
	}
	_, err = ReframeCache(empty, 0)
	require.Error(t, err, "no stream to frame for")
	_, err = ReframeCache(empty, maxStreams+1)
	require.Error(t, err, "more streams than a context has")
}

// rowsOf is s without where its rows were in the state it was read from.
func rowsOf(s Stream) Stream {
	s.Layers = slices.Clone(s.Layers)
	for l := range s.Layers {
		s.Layers[l].KOff, s.Layers[l].VOff = 0, 0
	}
	return s
}

func TestReframeSeqState(t *testing.T) {
	for _, file := range []string{"seq-fa-on.bin", "seq-two-streams-fa-off.bin"} {
		b := readTestdata(t, file)
		st, err := Parse(b)
		require.NoError(t, err)
		si, _ := st.Sequence()
		for _, nStream := range []int{1, 2, 4} {
			out, err := ReframeSeqState(b, nStream)
			require.NoError(t, err, "%s", file)
			got, err := Parse(out)
			require.NoError(t, err, "%s: %d streams", file, nStream)
			require.Len(t, got.Streams, nStream)
			require.Equal(t, st.SeqID, got.SeqID)
			gi, err := got.Sequence()
			require.NoError(t, err)
			require.Equal(t, rowsOf(st.Streams[si]), rowsOf(got.Streams[gi]), "%s: %d streams", file, nStream)
		}
		_, err = ReframeSeqState(b[4:], 2)
		require.Error(t, err, "%s: no magic", file)
	}
}

func TestCacheOfPositions(t *testing.T) {
	for _, file := range []string{"seq-fa-on.bin", "seq-fa-off.bin", "seq-two-streams-fa-off.bin", "seq-scattered-fa-off.bin", "slot-fa-on.bin"} {
		st, err := Parse(readTestdata(t, file))
		require.NoError(t, err)
		si, _ := st.Sequence()
		held := &st.Streams[si]
		n := len(held.Cells)
		cache := appendCache(nil, st.Streams, st.CellExt, st.KOnly, true)

		out, err := CacheOfPositions(cache, st.CellExt, st.KOnly, n)
		require.NoError(t, err, "%s", file)
		got, err := ParseCache(out, st.CellExt, st.KOnly)
		require.NoError(t, err, "%s", file)
		require.Len(t, got, 1, "%s: one stream", file)
		g := &got[0]
		require.Len(t, g.Cells, n)
		for c, cell := range g.Cells {
			require.Equal(t, int32(c), cell.Pos, "%s: cell %d", file, c)
		}
		for l := range g.Layers {
			for p := 0; p < n; p++ {
				wk, wv := kvAt(held, l, int32(p))
				gk, gv := kvAt(g, l, int32(p))
				require.True(t, bytes.Equal(wk, gk) && bytes.Equal(wv, gv), "%s: layer %d, position %d", file, l, p)
			}
		}

		_, err = CacheOfPositions(cache, st.CellExt, st.KOnly, n-1)
		require.Error(t, err, "%s: a state holding more positions than asked", file)
		_, err = CacheOfPositions(cache, st.CellExt, st.KOnly, n+1)
		require.Error(t, err, "%s: a state lacking a position", file)
		_, err = CacheOfPositions(cache[:len(cache)-1], st.CellExt, st.KOnly, n)
		require.Error(t, err, "%s: a cut state", file)
	}
}
