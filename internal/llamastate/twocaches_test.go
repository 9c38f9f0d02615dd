package llamastate

import (
	"bytes"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/status"
)

// twoCachesOf makes the state of a sliding-window memory out of a real state of
// one cache: its base cache is the state, its window cache holds layer 1's
// rows (of another layer count, as a window cache has) for positions from..n-1,
// in the stream of the sequence.
func twoCachesOf(t testing.TB, st *State, from int) *State {
	t.Helper()
	si, err := st.Sequence()
	require.NoError(t, err)
	n := len(st.Streams[si].Cells)
	at, err := st.PositionCells(n)
	require.NoError(t, err)
	src := &st.Streams[si]
	w, err := gather(src, src.Layers[1:2], at[from:], from)
	require.NoError(t, err)
	out := *st
	out.Second = make([]Stream, len(st.Streams))
	out.Second[si] = w
	return &out
}

func TestTwoCacheStates(t *testing.T) {
	for _, file := range []string{"seq-fa-on.bin", "seq-fa-off.bin", "seq-two-streams-fa-off.bin", "seq-scattered-fa-off.bin", "slot-fa-on.bin"} {
		st, err := Parse(readTestdata(t, file))
		require.NoError(t, err)
		si, _ := st.Sequence()
		n := len(st.Streams[si].Cells)
		for _, from := range []int{0, 8} {
			b, err := twoCachesOf(t, st, from).Build()
			require.NoError(t, err, "%s", file)

			_, err = Parse(b)
			var ce *CachesError
			require.True(t, errors.As(err, &ce), "%s: Parse of two caches: %v", file, err)
			sw, err := ParseTwoCaches(b)
			require.NoError(t, err, "%s", file)
			again, err := sw.Build()
			require.NoError(t, err)
			require.True(t, bytes.Equal(b, again), "%s: ParseTwoCaches does not build back", file)
			require.Equal(t, len(b), sw.Size())
			require.Len(t, sw.Second, len(sw.Streams))

			// The first cache alone, and the bytes after it.
			lead, rest, err := ParseLeading(b)
			require.NoError(t, err, "%s", file)
			whole, err := st.Build()
			require.NoError(t, err)
			leadB, err := lead.Build()
			require.NoError(t, err)
			require.True(t, bytes.Equal(whole, leadB), "%s: ParseLeading's first cache", file)
			require.Equal(t, len(b)-len(whole), rest, "%s: the bytes after the first cache", file)
			lead, rest, err = ParseLeading(whole)
			require.NoError(t, err, "%s: one cache", file)
			require.Zero(t, rest)
			require.Nil(t, lead.Second)

			_, err = sw.Slice(n)
			require.Error(t, err, "%s: Slice of two caches", file)
			m, err := sw.Merge(n)
			if from > 0 {
				require.Equal(t, status.Unsupported, status.Of(err), "%s: Merge without position 0 in the window: %v", file, err)
				m, err = sw.Merge(from)
				require.Equal(t, status.Unsupported, status.Of(err), "%s: Merge of positions the window lacks: %v", file, err)
				continue
			}
			require.NoError(t, err, "%s: Merge", file)
			require.Nil(t, m.Second)
			ms := &m.Streams[si]
			require.Len(t, ms.Layers, len(st.Streams[si].Layers)+1)
			for p := 0; p < n; p++ {
				require.Equal(t, int32(p), ms.Cells[p].Pos)
				for l := range ms.Layers {
					src := 1 // the window cache's one layer
					if l < len(st.Streams[si].Layers) {
						src = l
					}
					wk, wv := kvAt(&st.Streams[si], src, int32(p))
					gk, gv := kvAt(ms, l, int32(p))
					require.True(t, bytes.Equal(wk, gk) && bytes.Equal(wv, gv), "%s: Merge: layer %d position %d", file, l, p)
				}
			}

			// Split undoes Merge, keeping the window layers' rows
			// of positions from 5 on.
			nb := len(st.Streams[si].Layers)
			sp, err := m.Split(nb, 5)
			require.NoError(t, err, "%s: Split", file)
			require.Len(t, sp.Streams[si].Cells, n)
			require.Len(t, sp.Second[si].Cells, n-5)
			require.Len(t, sp.Second[si].Layers, 1)
			for p := 0; p < n; p++ {
				for l := 0; l < nb; l++ {
					wk, wv := kvAt(&st.Streams[si], l, int32(p))
					gk, gv := kvAt(&sp.Streams[si], l, int32(p))
					require.True(t, bytes.Equal(wk, gk) && bytes.Equal(wv, gv), "%s: split base layer %d position %d", file, l, p)
				}
				wk, wv := kvAt(&st.Streams[si], 1, int32(p))
				gk, gv := kvAt(&sp.Second[si], 0, int32(p))
				if p < 5 {
					require.Nil(t, gk, "%s: split window holds position %d", file, p)
					continue
				}
				require.True(t, bytes.Equal(wk, gk) && bytes.Equal(wv, gv), "%s: split window position %d", file, p)
			}
			for _, bad := range []struct{ nBase, from int }{{0, 0}, {nb + 1, 0}, {nb, -1}, {nb, n}} {
				_, err := m.Split(bad.nBase, bad.from)
				require.Error(t, err, "%s: Split(%d, %d)", file, bad.nBase, bad.from)
			}
		}
	}
}

func TestParseTwoCachesRefuses(t *testing.T) {
	one := readTestdata(t, "seq-fa-on.bin")
	_, err := ParseTwoCaches(one)
	require.Error(t, err, "one cache")
	st, err := Parse(one)
	require.NoError(t, err)
	b, err := twoCachesOf(t, st, 4).Build()
	require.NoError(t, err)
	_, err = ParseTwoCaches(append(b, 0, 0, 0, 0))
	require.Error(t, err, "bytes after the window cache")
	for cut := 1; cut < 64; cut += 7 {
		_, err = ParseTwoCaches(b[:len(b)-cut])
		require.Error(t, err, "cut by %d", cut)
	}
	// A window cache of another stream count is no window cache of this
	// memory.
	two, err := Parse(readTestdata(t, "seq-two-streams-fa-off.bin"))
	require.NoError(t, err)
	mixed := *st
	mixed.Second = two.Streams
	_, err = mixed.Build()
	require.Error(t, err, "window of 2 streams for 1")
}
