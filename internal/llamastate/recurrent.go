package llamastate

import (
	"encoding/binary"

	"github.com/mcbridge/mcbridge/internal/status"
)

// A memory that is one recurrent state (llama_memory_recurrent: Mamba,
// RWKV) writes no KV cache: after a state's framing comes
// llama_memory_recurrent::state_write of the sequence, its cell count (a
// sequence has one cell), the cell's position and sequence-id count (0: the
// destination sequence is the reader's), then the state's tensors.

// recurrentMeta is the cell count and the one cell's position and id count.
const recurrentMeta = 12

// ParseRecurrent reads the state of a memory that is one recurrent state:
// its framing (Kind, SeqID, Words; no Streams) and the recurrent state
// that follows, which must hold one cell of one sequence. The returned
// bytes alias b.
func ParseRecurrent(b []byte) (*State, []byte, error) {
	st, rec, err := ParseFramed(b)
	if err != nil {
		return nil, nil, err
	}
	if _, err := RecurrentPos(rec); err != nil {
		return nil, nil, err
	}
	return st, rec, nil
}

// ParseFramed reads a state's framing (Kind, SeqID, Words; no Streams)
// and returns the memory's state after it unread: a memory whose state is
// not KV caches' states (a recurrent state; DeepSeek V4's caches, which
// only llama.cpp reads). The returned bytes alias b.
func ParseFramed(b []byte) (*State, []byte, error) {
	r := &reader{b: b}
	st := &State{}
	if err := r.frame(st); err != nil {
		return nil, nil, err
	}
	if r.left() == 0 {
		return nil, nil, status.Errorf(status.InvalidArg, "sequence state: no memory state after its framing")
	}
	return st, b[r.off:], nil
}

// RecurrentPos reads the position the recurrent state of one sequence is
// at: the last position computed into it.
func RecurrentPos(rec []byte) (int32, error) {
	if len(rec) <= recurrentMeta {
		return 0, status.Errorf(status.InvalidArg, "recurrent state of %d bytes", len(rec))
	}
	le := binary.LittleEndian
	cells, pos, ids := le.Uint32(rec), int32(le.Uint32(rec[4:])), le.Uint32(rec[8:])
	switch {
	case cells != 1:
		return 0, status.Errorf(status.InvalidArg, "recurrent state of %d cells: one sequence has one", cells)
	case ids != 0:
		return 0, status.Errorf(status.InvalidArg, "recurrent state whose cell names %d sequences: not one sequence's", ids)
	case pos < 0:
		return 0, status.Errorf(status.InvalidArg, "recurrent state at position %d", pos)
	}
	return pos, nil
}

// AppendRecurrent appends st's framing, then rec, a recurrent state: the
// state of a memory that is one recurrent state.
func (st *State) AppendRecurrent(w, rec []byte) ([]byte, error) {
	if _, err := RecurrentPos(rec); err != nil {
		return nil, err
	}
	return st.AppendFramed(w, rec)
}

// AppendFramed appends st's framing, then mem, a memory's state
// (ParseFramed's).
func (st *State) AppendFramed(w, mem []byte) ([]byte, error) {
	if st.Streams != nil || st.Second != nil {
		return nil, status.Errorf(status.InvalidArg, "a framed memory state with KV streams")
	}
	if len(mem) == 0 {
		return nil, status.Errorf(status.InvalidArg, "an empty memory state")
	}
	return append(st.appendFrame(w), mem...), nil
}

// RecurrentSize is the length of AppendRecurrent's and AppendFramed's
// output for rec.
func (st *State) RecurrentSize(rec []byte) int {
	n := 8
	if st.Kind == SlotFile {
		n = 12 + 4*len(st.Words)
	}
	return n + len(rec)
}
