package llamastate

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/status"
)

// The files in testdata were written by llama.cpp v0.5.0 (stock build) on the
// tiny preset of internal/gguf (2 layers, 2 KV heads of 16) by
// `libllama_test testdata MODEL DIR` (csrc/embed/tests): 24 prompt
// tokens, and each state's first 16 tokens computed alone (-prefix16).
func readTestdata(t testing.TB, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	require.NoError(t, err)
	return b
}

// The prompt the testdata were computed over: (i*7 + 3) % 256.
func promptTokens(n int) []int32 {
	t := make([]int32, n)
	for i := range t {
		t[i] = int32((i*7 + 3) % 256)
	}
	return t
}

const (
	ggmlF32 = 0
	ggmlF16 = 1
)

func TestParseRealStates(t *testing.T) {
	tests := []struct {
		file      string
		kind      Kind
		nStream   int
		stream    int
		cells     int
		vTrans    bool
		kType     int32
		kRow      uint64
		scattered bool // cells out of position order
	}{
		{"seq-fa-on.bin", Memory, 1, 0, 24, false, ggmlF16, 64, false},
		{"seq-fa-on-prefix16.bin", Memory, 1, 0, 16, false, ggmlF16, 64, false},
		{"seq-fa-off.bin", Memory, 1, 0, 24, true, ggmlF16, 64, false},
		{"seq-f32k.bin", Memory, 1, 0, 24, false, ggmlF32, 128, false},
		{"seq-two-streams-fa-off.bin", Memory, 2, 1, 24, true, ggmlF16, 64, false},
		{"seq-scattered-fa-off.bin", Memory, 1, 0, 24, true, ggmlF16, 64, true},
		{"slot-fa-on.bin", SlotFile, 1, 0, 24, false, ggmlF16, 64, false},
		{"slot-plain-fa-off.bin", SlotFile, 1, 0, 24, true, ggmlF16, 64, false},
	}
	for _, tc := range tests {
		t.Run(tc.file, func(t *testing.T) {
			b := readTestdata(t, tc.file)
			st, err := Parse(b)
			require.NoError(t, err)
			si, err := st.Sequence()
			require.NoError(t, err)
			s := st.Streams[si]
			require.Equal(t, tc.kind, st.Kind, "kind")
			require.Len(t, st.Streams, tc.nStream, "streams")
			require.Equal(t, tc.stream, si, "stream of the sequence")
			require.Len(t, s.Cells, tc.cells, "cells in stream %d", si)
			require.Equal(t, tc.vTrans, s.VTrans, "v_trans")
			if st.Kind == Memory {
				assert.Equal(t, int32(tc.stream), st.SeqID, "seq id")
			}
			require.Len(t, s.Layers, 2, "layers")
			for l, ly := range s.Layers {
				assert.Equal(t, tc.kType, ly.KType, "layer %d: K type", l)
				assert.Equal(t, tc.kRow, ly.KRowSize, "layer %d: K row size", l)
				assert.Equal(t, int32(ggmlF16), ly.VType, "layer %d: V type", l)
				assert.Equal(t, uint64(64), ly.VRowSize, "layer %d: V row size", l)
				if tc.vTrans {
					assert.Equal(t, uint32(2), ly.VElSize, "layer %d: transposed V element size", l)
					assert.Equal(t, uint32(32), ly.NEmbdV, "layer %d: transposed V elements", l)
				}
				assert.True(t, bytes.Equal(b[ly.KOff:ly.KOff+len(ly.K)], ly.K), "layer %d: the offset does not locate the K rows", l)
				assert.True(t, bytes.Equal(b[ly.VOff:ly.VOff+len(ly.V)], ly.V), "layer %d: the offset does not locate the V rows", l)
			}
			assert.Equal(t, tc.scattered, s.Cells[0].Pos != 0, "first cell at position %d", s.Cells[0].Pos)
			_, err = st.PositionCells(tc.cells)
			assert.NoError(t, err)
			if st.Kind == SlotFile {
				toks, err := st.PromptTokens()
				assert.NoError(t, err, "tokens")
				assert.Equal(t, promptTokens(24), toks, "tokens")
			}
			out, err := st.Build()
			assert.NoError(t, err, "Build")
			assert.True(t, bytes.Equal(out, b), "Build: %d bytes of %d, not the parsed ones", len(out), len(b))
			assert.Equal(t, len(b), st.Size(), "Size")
		})
	}
}

// Slicing a real state to its first 16 positions gives exactly the bytes
// llama.cpp writes for those 16 tokens computed alone, scattered cells and
// a second stream included.
func TestSliceMatchesLlama(t *testing.T) {
	for _, name := range []string{"fa-on", "fa-off", "f32k", "two-streams-fa-off", "scattered-fa-off"} {
		t.Run(name, func(t *testing.T) {
			st, err := Parse(readTestdata(t, "seq-"+name+".bin"))
			require.NoError(t, err)
			s16, err := st.Slice(16)
			require.NoError(t, err)
			got, err := s16.Build()
			require.NoError(t, err)
			want := readTestdata(t, "seq-"+name+"-prefix16.bin")
			require.True(t, bytes.Equal(got, want), "Slice(16) differs from llama.cpp's 16-token state (%d vs %d bytes)", len(got), len(want))
		})
	}
}

// kvAt is a position's K row and V bytes (V gathered from its column when
// transposed), found by a plain search: the reference for Slice.
func kvAt(s *Stream, l int, pos int32) (k, v []byte) {
	ly := s.Layers[l]
	for c, cell := range s.Cells {
		if cell.Pos != pos {
			continue
		}
		k = ly.K[uint64(c)*ly.KRowSize:][:ly.KRowSize]
		if !s.VTrans {
			return k, ly.V[uint64(c)*ly.VRowSize:][:ly.VRowSize]
		}
		el := int(ly.VElSize)
		for j := 0; j < int(ly.NEmbdV); j++ {
			v = append(v, ly.V[(j*len(s.Cells)+c)*el:][:el]...)
		}
		return k, v
	}
	return nil, nil
}

func TestSliceKeepsEveryRow(t *testing.T) {
	files := []string{"seq-fa-on.bin", "seq-fa-off.bin", "seq-scattered-fa-off.bin", "seq-two-streams-fa-off.bin", "slot-fa-on.bin", "slot-plain-fa-off.bin"}
	for _, file := range files {
		st, err := Parse(readTestdata(t, file))
		require.NoError(t, err)
		si, _ := st.Sequence()
		for _, n := range []int{1, 7, 16, 24} {
			sl, err := st.Slice(n)
			require.NoError(t, err, "%s: Slice(%d)", file, n)
			src, dst := &st.Streams[si], &sl.Streams[si]
			require.Len(t, dst.Cells, n, "%s: Slice(%d): cells", file, n)
			require.Equal(t, st.Kind, sl.Kind, "%s: Slice(%d): kind", file, n)
			require.Equal(t, st.SeqID, sl.SeqID, "%s: Slice(%d): seq", file, n)
			require.Len(t, sl.Streams, len(st.Streams), "%s: Slice(%d): streams", file, n)
			for p := 0; p < n; p++ {
				require.Equal(t, int32(p), dst.Cells[p].Pos, "%s: cell %d: %+v", file, p, dst.Cells[p])
				require.True(t, slices.Equal(dst.Cells[p].SeqIDs, src.Cells[0].SeqIDs), "%s: cell %d: %+v", file, p, dst.Cells[p])
				for l := range src.Layers {
					wk, wv := kvAt(src, l, int32(p))
					gk, gv := kvAt(dst, l, int32(p))
					require.True(t, bytes.Equal(wk, gk), "%s: Slice(%d): layer %d position %d: K differs", file, n, l, p)
					require.True(t, bytes.Equal(wv, gv), "%s: Slice(%d): layer %d position %d: V differs", file, n, l, p)
				}
			}
			if st.Kind == SlotFile {
				toks, err := sl.PromptTokens()
				require.NoError(t, err, "%s: Slice(%d) tokens", file, n)
				require.Equal(t, promptTokens(n), toks, "%s: Slice(%d) tokens", file, n)
				require.Equal(t, st.Words[0] == -1, sl.Words[0] == -1, "%s: Slice changed the token format", file)
			}
		}
	}
}

// A slot file and the in-memory blob of the same computation differ only
// in their framing.
func TestSlotFileIsFramedBlob(t *testing.T) {
	slot, err := Parse(readTestdata(t, "slot-fa-on.bin"))
	require.NoError(t, err)
	mem, err := Parse(readTestdata(t, "seq-fa-on.bin"))
	require.NoError(t, err)
	slot.Kind, slot.Words, slot.SeqID = Memory, nil, mem.SeqID
	got, _ := slot.Build()
	require.True(t, bytes.Equal(got, readTestdata(t, "seq-fa-on.bin")), "the slot file's streams differ from the blob's")
}

// put32 overwrites a little-endian u32 in a copy of b.
func put32(b []byte, off int, v uint32) []byte {
	c := bytes.Clone(b)
	binary.LittleEndian.PutUint32(c[off:], v)
	return c
}

func TestParseRefuses(t *testing.T) {
	good := readTestdata(t, "seq-fa-on.bin")
	slot := readTestdata(t, "slot-fa-on.bin")
	const cell0 = 16 // magic, seq, n_stream, cell count
	dataAt := cell0 + 24*12
	tests := []struct {
		name string
		b    []byte
		code status.Code
	}{
		{"empty", nil, status.InvalidArg},
		{"other magic", put32(good, 0, 0x12345678), status.Unsupported},
		{"slot version 2", put32(slot, 4, 2), status.Unsupported},
		{"slot token count past the end", put32(slot, 8, 1<<30), status.InvalidArg},
		{"no streams", put32(good, 8, 0), status.InvalidArg},
		{"a billion streams", put32(good, 8, 1<<30), status.InvalidArg},
		{"4 billion cells", put32(good, 12, 0xffffffff), status.InvalidArg},
		{"a billion sequence ids", put32(good, cell0+4, 1<<30), status.InvalidArg},
		{"v_trans 2", put32(good, dataAt, 2), status.InvalidArg},
		{"no layers", put32(good, dataAt+4, 0), status.InvalidArg},
		{"4 billion layers", put32(good, dataAt+4, 0xffffffff), status.InvalidArg},
		{"K rows of 4 GiB", put32(good, dataAt+12, 0xffffffff), status.InvalidArg},
		{"empty K rows", put32(good, dataAt+12, 0), status.InvalidArg},
		{"trailing byte", append(bytes.Clone(good), 0), status.InvalidArg},
	}
	for _, tc := range tests {
		_, err := Parse(tc.b)
		assert.Equal(t, tc.code, status.Of(err), "%s: %v", tc.name, err)
	}
	// A blob cut anywhere reads as nothing, except where its K sections
	// end: that is a state of the same cells in a cache without V (MLA),
	// which nothing in the state tells apart. A host's model has one
	// format, and states of the other are refused as another model's.
	plain, err := Parse(good)
	require.NoError(t, err)
	kEnd := kOnly(plain).Size()
	for cut := 0; cut < len(good); cut++ {
		st, err := Parse(good[:cut])
		if cut == kEnd {
			require.NoError(t, err, "the blob's K sections")
			require.True(t, st.KOnly, "the blob's K sections read as a K-only state")
			continue
		}
		require.Error(t, err, "a blob cut at %d of %d bytes parsed", cut, len(good))
	}
}

func TestSliceRefuses(t *testing.T) {
	good := readTestdata(t, "seq-fa-off.bin")
	const cell0 = 16
	twoStreams := func() []byte {
		// The same section twice: cells of the sequence in two streams.
		b := put32(good, 8, 2)
		return append(b, good[12:]...)
	}
	emptyStream := func() []byte {
		b := binary.LittleEndian.AppendUint32(nil, SeqMagic)
		b = binary.LittleEndian.AppendUint32(b, 0)
		b = binary.LittleEndian.AppendUint32(b, 1)
		return binary.LittleEndian.AppendUint32(b, 0)
	}
	media := func() []byte {
		st, err := Parse(readTestdata(t, "slot-fa-on.bin"))
		require.NoError(t, err)
		st.Words[len(st.Words)-1] = 1 // one media chunk announced
		b, _ := st.Build()
		return b
	}
	tests := []struct {
		name string
		b    []byte
		n    int
		code status.Code
	}{
		{"zero positions", good, 0, status.InvalidArg},
		{"more positions than cells", good, 25, status.InvalidArg},
		{"no cells", emptyStream(), 1, status.NotFound},
		{"cells in two streams", twoStreams(), 1, status.Unsupported},
		{"position 0 twice", put32(good, cell0+12, 0), 2, status.Unsupported},
		{"position 1 missing", put32(good, cell0+12, 99), 2, status.Unsupported},
		{"slot file with media", media(), 4, status.Unsupported},
	}
	for _, tc := range tests {
		st, err := Parse(tc.b)
		require.NoError(t, err, "%s", tc.name)
		_, err = st.Slice(tc.n)
		assert.Equal(t, tc.code, status.Of(err), "%s: %v", tc.name, err)
	}
	// A position missing beyond n does not matter.
	st, _ := Parse(put32(good, cell0+12*20, 99))
	_, err := st.Slice(16)
	assert.NoError(t, err, "position 20 moved away: Slice(16)")
}

func TestBuildRefusesInconsistentStates(t *testing.T) {
	st, err := Parse(readTestdata(t, "seq-fa-off.bin"))
	require.NoError(t, err)
	st.Streams[0].Layers[1].V = st.Streams[0].Layers[1].V[1:]
	_, err = st.Build()
	assert.Equal(t, status.InvalidArg, status.Of(err), "short V: %v", err)
	_, err = (&State{Kind: Memory}).Build()
	assert.Equal(t, status.InvalidArg, status.Of(err), "no streams: %v", err)
}

// FrameInto writes what Build writes except the rows, whose bytes it
// leaves as they were: put back, they make the same file.
func TestFrameIntoLeavesTheRows(t *testing.T) {
	for _, file := range []string{"seq-fa-on.bin", "seq-fa-off.bin", "seq-two-streams-fa-off.bin", "slot-fa-on.bin"} {
		st, err := Parse(readTestdata(t, file))
		require.NoError(t, err, file)
		full, err := st.Build()
		require.NoError(t, err, file)
		b := bytes.Repeat([]byte{0xa5}, st.Size())
		require.NoError(t, st.FrameInto(b), file)
		framed, err := Parse(b)
		require.NoError(t, err, file)
		for s := range framed.Streams {
			for l, ly := range framed.Streams[s].Layers {
				want := st.Streams[s].Layers[l]
				require.Equal(t, bytes.Repeat([]byte{0xa5}, len(want.K)), ly.K, "%s: stream %d layer %d K untouched", file, s, l)
				require.Equal(t, bytes.Repeat([]byte{0xa5}, len(want.V)), ly.V, "%s: stream %d layer %d V untouched", file, s, l)
				copy(ly.K, want.K)
				copy(ly.V, want.V)
			}
		}
		require.Equal(t, full, b, file)
		require.Error(t, st.FrameInto(b[:len(b)-1]), "%s: a buffer of the wrong size", file)
	}
}

// withExt is st with every cell extended as an M-RoPE text prompt's are: the
// position twice and the token.
func withExt(st *State) *State {
	out := *st
	out.CellExt = true
	out.Streams = slices.Clone(st.Streams)
	for i := range out.Streams {
		out.Streams[i].Cells = slices.Clone(st.Streams[i].Cells)
		for c := range out.Streams[i].Cells {
			p := out.Streams[i].Cells[c].Pos
			out.Streams[i].Cells[c].Ext = CellExt{X: p, Y: p, Tok: 3 + p}
		}
	}
	return &out
}

// Cells with extensions (M-RoPE, per-layer embeddings) read as such, build
// back to the same bytes and keep their extensions through Slice; the same
// state without them still reads as plain.
func TestCellExtensions(t *testing.T) {
	for _, file := range []string{"slot-fa-on.bin", "seq-fa-off.bin", "seq-scattered-fa-off.bin"} {
		t.Run(file, func(t *testing.T) {
			plain, err := Parse(readTestdata(t, file))
			require.NoError(t, err)
			require.False(t, plain.CellExt)
			b, err := withExt(plain).Build()
			require.NoError(t, err)
			require.Len(t, plain.Streams, 1)
			assert.Len(t, b, len(readTestdata(t, file))+cellExtSize*len(plain.Streams[0].Cells), "12 more bytes a cell")
			st, err := Parse(b)
			require.NoError(t, err)
			require.True(t, st.CellExt, "read with extensions")
			si, err := st.Sequence()
			require.NoError(t, err)
			for _, c := range st.Streams[si].Cells {
				assert.Equal(t, CellExt{X: c.Pos, Y: c.Pos, Tok: 3 + c.Pos}, c.Ext, "cell at %d", c.Pos)
			}
			again, err := st.Build()
			require.NoError(t, err)
			assert.Equal(t, b, again, "builds back to its bytes")
			assert.Equal(t, len(b), st.Size())

			sl, err := st.Slice(8)
			require.NoError(t, err)
			require.True(t, sl.CellExt)
			for p, c := range sl.Streams[si].Cells {
				assert.Equal(t, CellExt{X: int32(p), Y: int32(p), Tok: 3 + int32(p)}, c.Ext, "sliced cell %d", p)
			}
			plainSl, err := plain.Slice(8)
			require.NoError(t, err)
			for l, ly := range sl.Streams[si].Layers {
				assert.Equal(t, plainSl.Streams[si].Layers[l].K, ly.K, "layer %d: the same K rows as the plain state's", l)
				assert.Equal(t, plainSl.Streams[si].Layers[l].V, ly.V, "layer %d: the same V as the plain state's", l)
			}
		})
	}
}

// kOnly is st as an MLA cache writes it: the same cells and K rows, and
// no V section in any layer.
func kOnly(st *State) *State {
	out := *st
	out.KOnly = true
	out.Streams = slices.Clone(st.Streams)
	for i := range out.Streams {
		out.Streams[i].Layers = slices.Clone(st.Streams[i].Layers)
		for l := range out.Streams[i].Layers {
			ly := &out.Streams[i].Layers[l]
			ly.VType, ly.VRowSize, ly.VElSize, ly.NEmbdV, ly.V, ly.VOff = 0, 0, 0, 0, nil, 0
		}
	}
	return &out
}

// States of a cache without V (MLA: llama_kv_cache writes no V section for
// a layer whose V tensor is null) read as K-only, alone and with cell
// extensions, build back to the same bytes and keep their K rows through
// Slice; V transposed or not, the flag is written and nothing follows K.
func TestKOnly(t *testing.T) {
	for _, file := range []string{"slot-fa-on.bin", "seq-fa-off.bin", "seq-scattered-fa-off.bin", "seq-two-streams-fa-off.bin"} {
		for _, ext := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s ext %v", file, ext), func(t *testing.T) {
				plain, err := Parse(readTestdata(t, file))
				require.NoError(t, err)
				src := kOnly(plain)
				if ext {
					src = withExt(src)
				}
				b, err := src.Build()
				require.NoError(t, err)
				want := len(readTestdata(t, file))
				for _, s := range plain.Streams {
					for _, ly := range s.Layers {
						want -= 12 + len(ly.V) // V type, V row size or element size and columns, V
					}
					if ext {
						want += cellExtSize * len(s.Cells)
					}
				}
				assert.Len(t, b, want, "the state without its V sections")

				st, err := Parse(b)
				require.NoError(t, err)
				require.True(t, st.KOnly, "read without V")
				require.Equal(t, ext, st.CellExt, "cell extensions")
				si, err := st.Sequence()
				require.NoError(t, err)
				for l, ly := range st.Streams[si].Layers {
					assert.Equal(t, plain.Streams[si].Layers[l].K, ly.K, "layer %d: K rows", l)
					assert.True(t, bytes.Equal(b[ly.KOff:ly.KOff+len(ly.K)], ly.K), "layer %d: the offset does not locate the K rows", l)
					assert.Empty(t, ly.V, "layer %d: V", l)
					assert.Zero(t, ly.VRowSize, "layer %d: V row size", l)
				}
				again, err := st.Build()
				require.NoError(t, err)
				assert.Equal(t, b, again, "builds back to its bytes")
				assert.Equal(t, len(b), st.Size())

				for _, n := range []int{1, 8, len(st.Streams[si].Cells)} {
					sl, err := st.Slice(n)
					require.NoError(t, err, "Slice(%d)", n)
					require.True(t, sl.KOnly, "Slice(%d) is K-only", n)
					plainSl, err := plain.Slice(n)
					require.NoError(t, err)
					for l, ly := range sl.Streams[si].Layers {
						assert.Equal(t, plainSl.Streams[si].Layers[l].K, ly.K, "Slice(%d): layer %d: the plain state's K rows", n, l)
						assert.Empty(t, ly.V, "Slice(%d): layer %d: V", n, l)
					}
					sb, err := sl.Build()
					require.NoError(t, err)
					pb, err := kOnly(plainSl).Build()
					require.NoError(t, err)
					if !ext {
						assert.Equal(t, pb, sb, "Slice(%d): the plain slice without V", n)
					}
				}
			})
		}
	}
}

// K-only and V-carrying states do not read as each other, and Build checks
// that a K-only state carries no V.
func TestKOnlyRefuses(t *testing.T) {
	plain, err := Parse(readTestdata(t, "seq-fa-off.bin"))
	require.NoError(t, err)
	b, err := kOnly(plain).Build()
	require.NoError(t, err)
	// A V-carrying state with the flag set, a K-only one without it.
	withV := *plain
	withV.KOnly = true
	_, err = withV.Build()
	assert.Equal(t, status.InvalidArg, status.Of(err), "V in a K-only state: %v", err)
	st, err := Parse(b)
	require.NoError(t, err)
	st.KOnly = false
	_, err = st.Build()
	assert.Equal(t, status.InvalidArg, status.Of(err), "no V in a state with V: %v", err)
	// A K-only state cut anywhere reads as nothing.
	for cut := 0; cut < len(b); cut++ {
		_, err := Parse(b[:cut])
		require.Error(t, err, "a K-only blob cut at %d of %d bytes parsed", cut, len(b))
	}
	// Two caches' sections back to back (an MLA cache's, then its indexer's,
	// as llama_kv_cache_dsa writes them) read as nothing, and the error says
	// that a whole state came first, not what the plain reading made of the
	// second cache's header.
	_, err = Parse(append(bytes.Clone(b), b[8:]...))
	assert.Equal(t, status.InvalidArg, status.Of(err), "%v", err)
	assert.ErrorContains(t, err, fmt.Sprintf("%d bytes after the last stream", len(b)-8))
	var ce *CachesError
	require.ErrorAs(t, err, &ce, "a second cache's state after the first")
	assert.Equal(t, len(b)-8, ce.Bytes)
	// The K-only indexer cache after a cache with V, and three caches.
	v := readTestdata(t, "seq-fa-on.bin")
	_, err = Parse(append(bytes.Clone(v), b[8:]...))
	require.ErrorAs(t, err, &ce, "a K-only cache's state after one with V")
	_, err = Parse(slices.Concat(v, v[8:], b[8:]))
	require.ErrorAs(t, err, &ce, "three caches")
	// Bytes that are no cache's state after a whole one, and a state cut
	// short, are malformed: the same message, no CachesError.
	for name, bad := range map[string][]byte{
		"a byte after":             append(bytes.Clone(b), 0),
		"a cut cache after":        append(bytes.Clone(b), b[8:len(b)-1]...),
		"a cache and a byte after": slices.Concat(b, b[8:], []byte{0}),
		"cut":                      b[:len(b)-1],
	} {
		_, err = Parse(bad)
		assert.Equal(t, status.InvalidArg, status.Of(err), "%s: %v", name, err)
		assert.False(t, errors.As(err, &ce), "%s reads as more caches: %v", name, err)
	}
	_, err = Parse(append(bytes.Clone(b), 0))
	assert.ErrorContains(t, err, "1 bytes after the last stream")
}
