package llamastate

import (
	"bytes"
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
