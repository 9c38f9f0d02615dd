package llamastate

import (
	"github.com/mcbridge/mcbridge/internal/status"
)

// serverTokensVersion is SERVER_TOKENS_STATE_VERSION: llama-server's slot
// files start their words with -1 (LLAMA_TOKEN_NULL) and this version.
const serverTokensVersion = 1

// Sequence returns the index of the stream holding the sequence's cells.
// A sequence lives in one stream; a state with none or several is refused.
func (st *State) Sequence() (int, error) {
	found := -1
	for i, s := range st.Streams {
		if len(s.Cells) == 0 {
			continue
		}
		if found >= 0 {
			return 0, status.Errorf(status.Unsupported, "streams %d and %d both hold cells", found, i)
		}
		found = i
	}
	if found < 0 {
		return 0, status.Errorf(status.NotFound, "the state holds no cells")
	}
	return found, nil
}

// PositionCells returns, for positions 0..n-1, the cell that holds each in
// the sequence's stream. Every one of those positions must be held by exactly
// one cell; cells at other positions are ignored.
func (st *State) PositionCells(n int) ([]int, error) {
	si, err := st.Sequence()
	if err != nil {
		return nil, err
	}
	cells := st.Streams[si].Cells
	if n <= 0 || n > len(cells) {
		return nil, status.Errorf(status.InvalidArg, "positions [0, %d) of a sequence of %d cells", n, len(cells))
	}
	at := make([]int, n)
	for i := range at {
		at[i] = -1
	}
	for c, cell := range cells {
		if cell.Pos < 0 || int64(cell.Pos) >= int64(n) {
			continue
		}
		if at[cell.Pos] >= 0 {
			return nil, status.Errorf(status.Unsupported, "position %d is in cells %d and %d", cell.Pos, at[cell.Pos], c)
		}
		at[cell.Pos] = c
	}
	for p, c := range at {
		if c < 0 {
			return nil, status.Errorf(status.Unsupported, "position %d is in no cell", p)
		}
	}
	return at, nil
}

// PromptTokens decodes a slot file's words: llama-server's format (-1,
// version 1, the token count and tokens, then media, refused here) or, as
// older servers wrote, the plain tokens.
func (st *State) PromptTokens() ([]int32, error) {
	if st.Kind != SlotFile {
		return nil, status.Errorf(status.InvalidArg, "only slot files carry tokens")
	}
	w := st.Words
	if len(w) == 0 || w[0] != -1 {
		return w, nil
	}
	if len(w) < 3 || w[1] != serverTokensVersion {
		return nil, status.Errorf(status.Unsupported, "slot file tokens: not server_tokens version %d", serverTokensVersion)
	}
	n := uint64(uint32(w[2]))
	if n > uint64(len(w)-3) {
		return nil, status.Errorf(status.InvalidArg, "slot file tokens: %d tokens in %d words", n, len(w)-3)
	}
	rest := w[3+n:]
	if len(rest) != 1 || rest[0] != 0 {
		return nil, status.Errorf(status.Unsupported, "slot file tokens: media chunks or trailing words")
	}
	return w[3 : 3+n], nil
}

// sliceWords keeps the words of the first n tokens, in the same format.
func (st *State) sliceWords(n int) ([]int32, error) {
	toks, err := st.PromptTokens()
	if err != nil {
		return nil, err
	}
	if n > len(toks) {
		return nil, status.Errorf(status.InvalidArg, "slot file lists %d tokens, %d positions asked", len(toks), n)
	}
	if len(st.Words) > 0 && st.Words[0] == -1 {
		w := make([]int32, 0, n+4)
		w = append(w, -1, serverTokensVersion, int32(n))
		w = append(w, toks[:n]...)
		return append(w, 0), nil
	}
	return append([]int32(nil), toks[:n]...), nil
}

// Slice returns a state of the same kind holding positions 0..n-1 of the
// sequence in cells 0..n-1, in position order: what a restore of a prefix
// needs. Other streams stay empty (a restore needs the target's stream
// count). A slot file keeps the words of its first n tokens. A state of two
// caches slices with Merge or Split.
func (st *State) Slice(n int) (*State, error) {
	if st.Second != nil {
		return nil, status.Errorf(status.InvalidArg, "Slice of a state of two caches")
	}
	at, err := st.PositionCells(n)
	if err != nil {
		return nil, err
	}
	si, _ := st.Sequence()
	out, err := st.sliced(n)
	if err != nil {
		return nil, err
	}
	src := &st.Streams[si]
	if out.Streams[si], err = gather(src, src.Layers, at, 0); err != nil {
		return nil, err
	}
	return out.reparse()
}

// Merge returns positions 0..n-1 of the state of a memory of two caches
// (ParseTwoCaches) as the state of one cache whose layers are the first
// cache's then the second's, in cells 0..n-1: one layout of every layer's
// rows, which a save hands the bridge. Both caches must hold every one of
// the positions: a sliding-window memory's state holds only the window
// cache's last window (llama_kv_cache::state_write skips the cells the
// window has passed).
func (st *State) Merge(n int) (*State, error) {
	if st.Second == nil {
		return nil, status.Errorf(status.InvalidArg, "Merge of a state of one cache")
	}
	at, err := st.PositionCells(n)
	if err != nil {
		return nil, err
	}
	si, _ := st.Sequence()
	win := &State{Streams: st.Second}
	wat, err := win.PositionCells(n)
	if err != nil {
		return nil, status.Wrap(status.Unsupported, err, "the second cache")
	}
	if wsi, _ := win.Sequence(); wsi != si {
		return nil, status.Errorf(status.InvalidArg, "the sequence is in stream %d of the first cache and %d of the second", si, wsi)
	}
	out, err := st.sliced(n)
	if err != nil {
		return nil, err
	}
	src, wsrc := &st.Streams[si], &st.Second[si]
	if src.VTrans != wsrc.VTrans {
		return nil, status.Errorf(status.InvalidArg, "V transposed %v in the first cache, %v in the second", src.VTrans, wsrc.VTrans)
	}
	base, err := gather(src, src.Layers, at, 0)
	if err != nil {
		return nil, err
	}
	w, err := gather(wsrc, wsrc.Layers, wat, 0)
	if err != nil {
		return nil, err
	}
	base.Layers = append(base.Layers, w.Layers...)
	out.Streams[si] = base
	return out.reparse()
}

// Split is Merge's inverse for a restore: from the state of one cache
// holding positions 0..n-1 in cells 0..n-1 with every layer (the first
// cache's nFirst, then the second's), the state a memory of two caches
// reads: the first cache's layers of every position, and the second's of
// positions from..n-1. A sliding-window memory needs only the window the
// positions after n can see, which a window cache of any size has room
// for; a host that restores the whole cache gives from 0.
func (st *State) Split(nFirst, from int) (*State, error) {
	si, err := st.Sequence()
	if err != nil {
		return nil, err
	}
	src := &st.Streams[si]
	n := len(src.Cells)
	if st.Second != nil || nFirst <= 0 || nFirst >= len(src.Layers) || from < 0 || from >= n {
		return nil, status.Errorf(status.InvalidArg, "splitting %d of %d layers, positions from %d of %d", nFirst, len(src.Layers), from, n)
	}
	at := make([]int, n)
	for p := range at {
		if src.Cells[p].Pos != int32(p) {
			return nil, status.Errorf(status.InvalidArg, "cell %d holds position %d", p, src.Cells[p].Pos)
		}
		at[p] = p
	}
	out, err := st.sliced(n)
	if err != nil {
		return nil, err
	}
	out.Second = make([]Stream, len(st.Streams))
	if out.Streams[si], err = gather(src, src.Layers[:nFirst], at, 0); err != nil {
		return nil, err
	}
	if out.Second[si], err = gather(src, src.Layers[nFirst:], at[from:], from); err != nil {
		return nil, err
	}
	return out.reparse()
}

// sliced is an empty state of st's kind, variant and streams, with the
// words of its first n tokens.
func (st *State) sliced(n int) (*State, error) {
	out := &State{Kind: st.Kind, SeqID: st.SeqID, Streams: make([]Stream, len(st.Streams)), CellExt: st.CellExt, KOnly: st.KOnly}
	if st.Kind == SlotFile {
		var err error
		if out.Words, err = st.sliceWords(n); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// reparse builds the state and parses the bytes again, so that offsets
// describe them and the result is exactly what a consumer of the bytes
// would see.
func (st *State) reparse() (*State, error) {
	b, err := st.Build()
	if err != nil {
		return nil, err
	}
	if st.Second != nil {
		return ParseTwoCaches(b)
	}
	return Parse(b)
}

// gather is a stream of the rows of layers (src's) for src's cells at, in
// cells 0..len(at)-1 at positions pos0, pos0+1, ...
func gather(src *Stream, layers []Layer, at []int, pos0 int) (Stream, error) {
	n := len(at)
	dst := Stream{VTrans: src.VTrans, Cells: make([]Cell, n)}
	ids := make([]int32, n)
	for i, c := range at {
		// llama.cpp restores cells of exactly one sequence.
		if len(src.Cells[c].SeqIDs) != 1 {
			return Stream{}, status.Errorf(status.Unsupported, "cell %d belongs to %d sequences", c, len(src.Cells[c].SeqIDs))
		}
		ids[i] = src.Cells[c].SeqIDs[0]
		dst.Cells[i] = Cell{Pos: int32(pos0 + i), SeqIDs: ids[i : i+1 : i+1], Ext: src.Cells[c].Ext}
	}
	total := len(src.Cells)
	dst.Layers = make([]Layer, len(layers))
	for l, ly := range layers {
		d := ly
		kRow, vRow := int(ly.KRowSize), int(ly.VRowSize)
		d.K = make([]byte, n*kRow)
		for i, c := range at {
			copy(d.K[i*kRow:(i+1)*kRow], ly.K[c*kRow:])
		}
		d.V = make([]byte, n*vRow) // empty in a K-only state, whose V rows are 0 bytes
		if !src.VTrans {
			for i, c := range at {
				copy(d.V[i*vRow:(i+1)*vRow], ly.V[c*vRow:])
			}
		} else {
			// Column j holds one element per cell: its length is the
			// stream's cell count, so every element moves on its own.
			el := int(ly.VElSize)
			for j := 0; j < int(ly.NEmbdV); j++ {
				for i, c := range at {
					copy(d.V[(j*n+i)*el:(j*n+i+1)*el], ly.V[(j*total+c)*el:])
				}
			}
		}
		dst.Layers[l] = d
	}
	return dst, nil
}
