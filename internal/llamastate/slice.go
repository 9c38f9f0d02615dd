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
// count). A slot file keeps the words of its first n tokens.
func (st *State) Slice(n int) (*State, error) {
	at, err := st.PositionCells(n)
	if err != nil {
		return nil, err
	}
	si, _ := st.Sequence()
	src := &st.Streams[si]
	out := &State{Kind: st.Kind, SeqID: st.SeqID, Streams: make([]Stream, len(st.Streams)), CellExt: st.CellExt, KOnly: st.KOnly}
	if st.Kind == SlotFile {
		if out.Words, err = st.sliceWords(n); err != nil {
			return nil, err
		}
	}
	dst := &out.Streams[si]
	dst.VTrans = src.VTrans
	dst.Cells = make([]Cell, n)
	ids := make([]int32, n)
	for p, c := range at {
		// llama.cpp restores cells of exactly one sequence.
		if len(src.Cells[c].SeqIDs) != 1 {
			return nil, status.Errorf(status.Unsupported, "cell %d belongs to %d sequences", c, len(src.Cells[c].SeqIDs))
		}
		ids[p] = src.Cells[c].SeqIDs[0]
		dst.Cells[p] = Cell{Pos: int32(p), SeqIDs: ids[p : p+1 : p+1], Ext: src.Cells[c].Ext}
	}
	total := len(src.Cells)
	dst.Layers = make([]Layer, len(src.Layers))
	for l, ly := range src.Layers {
		d := ly
		kRow, vRow := int(ly.KRowSize), int(ly.VRowSize)
		d.K = make([]byte, n*kRow)
		for p, c := range at {
			copy(d.K[p*kRow:(p+1)*kRow], ly.K[c*kRow:])
		}
		d.V = make([]byte, n*vRow) // empty in a K-only state, whose V rows are 0 bytes
		if !src.VTrans {
			for p, c := range at {
				copy(d.V[p*vRow:(p+1)*vRow], ly.V[c*vRow:])
			}
		} else {
			// Column j holds one element per cell: its length is the
			// stream's cell count, so every element moves on its own.
			el := int(ly.VElSize)
			for j := 0; j < int(ly.NEmbdV); j++ {
				for p, c := range at {
					copy(d.V[(j*n+p)*el:(j*n+p+1)*el], ly.V[(j*total+c)*el:])
				}
			}
		}
		dst.Layers[l] = d
	}
	// Reparse the built bytes so that offsets describe them and the
	// result is exactly what a consumer of the bytes would see.
	b, err := out.Build()
	if err != nil {
		return nil, err
	}
	return Parse(b)
}
