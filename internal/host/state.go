package host

import (
	"bytes"
	"errors"
	"fmt"
	"runtime"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout"
	"github.com/mcbridge/mcbridge/internal/llamastate"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Hosts that see KV only as llama.cpp states (the proxy through slot files,
// embedders through llama_state_seq_get_data / set_data) save and restore
// through the same bridge calls as a host with tensors: a parsed state is
// a KV layout whose cells are the state's, so the rows move in place.

// Frame says how a restored state is framed for the host that loads it.
type Frame struct {
	Kind    llamastate.Kind
	NStream int // the target context's stream count (the cells go in the first section)
	// SeqID is the sequence written into the blob (Memory) and into each
	// cell; llama.cpp restores into the destination it is called with.
	SeqID int32
}

// ErrSecondCacheLacks is SaveState's error for the state of two caches whose
// second cache lacks positions of the blocks: a sliding-window memory's
// state holds only the window cache's last window.
var ErrSecondCacheLacks = errors.New("the second KV cache lacks positions of the blocks")

// ParseState reads a state in the model's framing: of one KV cache, or of
// two (Format.SecondLayers), or, for a model with a partial state, of its
// attention layers' cache, the partial state that follows left out.
func (m *Model) ParseState(state []byte) (*llamastate.State, error) {
	switch {
	case m.SnapshotOnly():
		// A recurrent memory's, or a whole memory state: its framing,
		// without streams.
		st, _, err := llamastate.ParseFramed(state)
		return st, err
	case m.tail != noTail:
		st, _, err := m.parseWithTail(state)
		return st, err
	case m.Format.SecondLayers > 0:
		return llamastate.ParseTwoCaches(state)
	}
	return llamastate.Parse(state)
}

// parseWithTail reads the state of a model with a partial state: its
// attention layers' cache (and the indexer's, State.Second, where the
// model's blocks carry one), and the partial state after it.
func (m *Model) parseWithTail(state []byte) (*llamastate.State, []byte, error) {
	st, n, err := llamastate.ParseLeading(state)
	if err != nil {
		return nil, nil, err
	}
	if n > 0 && m.Format.SecondLayers > 0 {
		if st.Second, n, err = llamastate.ParseCacheLeading(state[len(state)-n:], st.CellExt, st.KOnly); err != nil {
			return nil, nil, status.Wrap(status.InvalidArg, err, "the indexer cache's state")
		}
	}
	if n == 0 {
		return nil, nil, status.Errorf(status.InvalidArg, "the state carries no partial state after its KV cache")
	}
	tail := state[len(state)-n:]
	switch m.tail {
	case windowTail:
		if _, err := llamastate.ParseCache(tail, st.CellExt, st.KOnly); err != nil {
			return nil, nil, status.Wrap(status.InvalidArg, err, "the window cache's state")
		}
	case indexedRecurrentTail:
		if len(tail) <= m.recurrentBytes {
			return nil, nil, status.Errorf(status.InvalidArg, "%d bytes after the attention cache: no recurrent state of %d and indexer cache after it", len(tail), m.recurrentBytes)
		}
		if _, err := llamastate.ParseCache(tail[m.recurrentBytes:], st.CellExt, true); err != nil {
			return nil, nil, status.Wrap(status.InvalidArg, err, "the indexer cache's state")
		}
	}
	return st, tail, nil
}

// SaveStateSnapshot stores the partial state a state ends with (a window
// cache's state, a recurrent state) as the snapshot after tokens
// (bridge.Model.SaveSnapshot): the state must hold exactly positions
// [0, len(tokens)), computed over tokens from position 0 under scope, and
// a slot file must list exactly tokens. A stock llama-server's slot file
// holds the partial state at its end only, so a host snapshots a prompt by
// saving one after each boundary (the proxy: docs/design.md §5.9).
func (m *Model) SaveStateSnapshot(scope key.Scope, state []byte, tokens []int32) error {
	if m.tail == noTail {
		return status.Errorf(status.Unsupported, "the model's states carry no partial state")
	}
	if m.SnapshotOnly() {
		return m.saveStateOnlySnapshot(scope, state, tokens)
	}
	st, tail, err := m.parseWithTail(state)
	if err != nil {
		return err
	}
	si, err := st.Sequence()
	if err != nil {
		return err
	}
	if n := len(st.Streams[si].Cells); n != len(tokens) {
		return status.Errorf(status.InvalidArg, "a state of %d positions for a snapshot after %d tokens", n, len(tokens))
	}
	if _, err := st.PositionCells(len(tokens)); err != nil {
		return err
	}
	if err := slotListsTokens(st, tokens); err != nil {
		return err
	}
	if m.tail == indexedRecurrentTail {
		// The indexer's rows of every position, in position order, for
		// the attention cache a restore frames so (RestoreState).
		rec := tail[:m.recurrentBytes]
		idx, err := llamastate.CacheOfPositions(tail[m.recurrentBytes:], st.CellExt, true, len(tokens))
		if err != nil {
			return status.Wrap(status.InvalidArg, err, "the indexer cache's state")
		}
		tail = append(bytes.Clone(rec), idx...)
	}
	return m.SaveSnapshot(scope, tokens, tail)
}

// saveStateOnlySnapshot is SaveStateSnapshot of a model without KV
// layers: the whole state after its framing, a recurrent state at the
// snapshot's last position, or a memory state only llama.cpp reads.
func (m *Model) saveStateOnlySnapshot(scope key.Scope, state []byte, tokens []int32) error {
	st, mem, err := llamastate.ParseFramed(state)
	if err != nil {
		return err
	}
	if m.tail == recurrentTail {
		if pos, err := llamastate.RecurrentPos(mem); err != nil || int(pos) != len(tokens)-1 {
			return status.Errorf(status.InvalidArg, "a recurrent state at position %d for a snapshot after %d tokens (%v)", pos, len(tokens), err)
		}
	}
	if err := slotListsTokens(st, tokens); err != nil {
		return err
	}
	return m.SaveSnapshot(scope, tokens, mem)
}

// slotListsTokens checks that a slot file lists exactly tokens; other
// states list none.
func slotListsTokens(st *llamastate.State, tokens []int32) error {
	if st.Kind != llamastate.SlotFile {
		return nil
	}
	toks, err := st.PromptTokens()
	if err != nil {
		return err
	}
	if !equalTokens(toks, tokens) {
		return status.Errorf(status.InvalidArg, "the slot file lists other tokens than the snapshot's")
	}
	return nil
}

// SaveState saves the full blocks of a state: its positions [0, len(tokens))
// must hold tokens, computed from position 0 under scope. A state of two
// caches must hold the blocks' positions in both: Merge copies them into
// one layout of every layer first.
func (m *Model) SaveState(scope key.Scope, state []byte, tokens []int32) (bridge.SaveResult, error) {
	if m.SnapshotOnly() {
		return bridge.SaveResult{}, status.Errorf(status.Unsupported, "a recurrent memory's states have no blocks: SaveStateSnapshot saves them")
	}
	st, err := m.ParseState(state)
	if err != nil {
		return bridge.SaveResult{}, err
	}
	f, si, err := FormatOf(st)
	if err != nil {
		return bridge.SaveResult{}, err
	}
	if !f.Equal(&m.Format) {
		return bridge.SaveResult{}, status.Errorf(status.ModelMismatch, "the state's KV format differs from the model's")
	}
	s := &st.Streams[si]
	B := m.BlockTokens()
	n := min(len(tokens), len(s.Cells)) / B * B
	if n == 0 {
		return bridge.SaveResult{}, status.Errorf(status.InvalidArg, "a state of %d cells for %d tokens holds no full block of %d", len(s.Cells), len(tokens), B)
	}
	at, err := st.PositionCells(n)
	if err != nil {
		return bridge.SaveResult{}, err
	}
	if m.Format.CellExt {
		// Only cells whose extensions are the prompt's text tokens' hold KV
		// a restore recreates (no media embeddings).
		for p, c := range at {
			if s.Cells[c].Ext != m.textExt(int32(p), tokens[p]) {
				n = p / B * B
				break
			}
		}
		if n == 0 {
			return bridge.SaveResult{}, status.Errorf(status.Unsupported, "the state's first block holds cells of no text prompt")
		}
		at = at[:n]
	}
	rows := st
	if st.Second != nil {
		if rows, err = st.Merge(n); err != nil {
			return bridge.SaveResult{}, status.Wrap(status.Unsupported, fmt.Errorf("%w: %w", ErrSecondCacheLacks, err),
				"a sliding-window cache's state holds only its last window")
		}
		s = &rows.Streams[si]
		for p := range at {
			at[p] = p
		}
	}
	cells := make([]uint32, n)
	for i, c := range at {
		cells[i] = uint32(c)
	}
	sv, err := m.SaveBegin(scope, StateLayout(s), tokens[:n], cells)
	if err != nil {
		return bridge.SaveResult{}, err
	}
	var layerErr error
	for l := range s.Layers {
		if layerErr = sv.SaveLayer(l); layerErr != nil {
			break
		}
	}
	res, err := sv.End()
	// SaveLayer read the rows through the layout's addresses.
	runtime.KeepAlive(state)
	runtime.KeepAlive(rows)
	if layerErr != nil {
		return res, layerErr
	}
	return res, err
}

// RestoreState loads a plan into a new state of positions [0, OKTokens),
// laid out in memory from alloc (which must return a slice of the length
// asked for), so the transfers land in the state itself. The state is
// returned whenever a block verified: alloc's first buffer or, after a
// partial load, a second one holding the verified blocks, with the error
// that cut the load short. The state of two caches is framed again from
// the loaded rows (Split copies them), with every position in each.
func (m *Model) RestoreState(p *bridge.Plan, fr Frame, alloc func(n int) []byte) ([]byte, bridge.LoadResult, error) {
	if p.Model() != m.Model {
		return nil, bridge.LoadResult{}, status.Errorf(status.InvalidArg, "a plan of another model")
	}
	tokens := p.Tokens()
	n := len(tokens)
	if n == 0 {
		return nil, bridge.LoadResult{}, status.Errorf(status.NotFound, "the plan restores nothing")
	}
	if fr.NStream < 1 {
		return nil, bridge.LoadResult{}, status.Errorf(status.InvalidArg, "a state of %d streams", fr.NStream)
	}
	if m.SnapshotOnly() {
		if m.tail != recurrentTail && m.tail != wholeTail {
			return nil, bridge.LoadResult{}, status.Errorf(status.Unsupported, "a model registered with its partial state alone loads snapshots (Plan.Load), not states")
		}
		return m.restoreStateOnly(p, fr, alloc)
	}
	empty := m.emptyState(fr, tokens)
	// The rows are left for the load to fill: written here, they would
	// be written twice. A state of two caches is framed again, and a
	// partial state goes after the KV: those load into a buffer first.
	two := m.Format.SecondLayers > 0
	var buf []byte
	if two || m.tail != noTail {
		buf = make([]byte, empty.Size())
	} else {
		buf = alloc(empty.Size())
	}
	if err := empty.FrameInto(buf); err != nil {
		return nil, bridge.LoadResult{}, err
	}
	st, err := llamastate.Parse(buf)
	if err != nil {
		return nil, bridge.LoadResult{}, err
	}
	cells := make([]uint32, n)
	for i := range cells {
		cells[i] = uint32(i)
	}
	layout := StateLayout(&st.Streams[0])
	// At return the load is fenced or was refused: nothing writes into buf
	// any more, and the caller may free it.
	defer m.Model.UnregisterTensors(&layout)
	ld, err := p.Load(layout, cells)
	if err != nil {
		return nil, bridge.LoadResult{}, err
	}
	for l := range m.Format.Layers {
		if _, err := ld.WaitLayer(l); err != nil {
			break
		}
	}
	var tail []byte
	var tailErr error
	if m.tail != noTail {
		tail, tailErr = m.restoredTail(ld, fr, tokens)
	}
	res, loadErr := ld.End()
	runtime.KeepAlive(buf)
	if res.OKTokens == 0 {
		if loadErr == nil {
			loadErr = status.Errorf(status.Internal, "the load verified no block")
		}
		return nil, res, loadErr
	}
	if tailErr != nil {
		return nil, bridge.LoadResult{}, tailErr
	}
	if res.OKTokens == n && !two && tail == nil {
		return buf, res, nil
	}
	// Keep the verified leading blocks.
	sl := st
	if res.OKTokens < n {
		if sl, err = st.Slice(res.OKTokens); err != nil {
			return nil, res, err
		}
	}
	if two {
		if sl, err = sl.Split(len(m.Format.Layers)-m.Format.SecondLayers, 0); err != nil {
			return nil, res, err
		}
	}
	out, err := sl.AppendTo(alloc(sl.Size() + len(tail))[:0])
	if err != nil {
		return nil, res, err
	}
	return append(out, tail...), res, loadErr
}

// restoreStateOnly is RestoreState of a model without KV layers: the plan's
// snapshot, framed (a recurrent state must be at its last position).
func (m *Model) restoreStateOnly(p *bridge.Plan, fr Frame, alloc func(n int) []byte) ([]byte, bridge.LoadResult, error) {
	tokens := p.Tokens()
	ld, err := p.Load(kvlayout.Layout{}, nil)
	if err != nil {
		return nil, bridge.LoadResult{}, err
	}
	var out []byte
	mem, err := ld.Snapshot()
	if err == nil && m.tail == recurrentTail {
		var pos int32
		if pos, err = llamastate.RecurrentPos(mem); err == nil && int(pos) != len(tokens)-1 {
			err = status.Errorf(status.Corrupt, "the snapshot after %d tokens is a recurrent state at position %d", len(tokens), pos)
		}
	}
	if err == nil {
		frame := &llamastate.State{Kind: fr.Kind, SeqID: fr.SeqID}
		if fr.Kind == llamastate.SlotFile {
			frame.Words = ServerWords(tokens)
		}
		out, err = frame.AppendFramed(alloc(frame.RecurrentSize(mem))[:0], mem)
	}
	res, endErr := ld.End()
	if err == nil {
		err = endErr
	}
	if err != nil || res.OKTokens == 0 {
		if err == nil {
			err = status.Errorf(status.Internal, "the load verified no snapshot")
		}
		return nil, res, err
	}
	return out, res, nil
}

// SnapshotsRestoreAfter is how many tokens a snapshot of the model's
// partial state must come after to restore: a sliding-window memory's
// window, whose states hold position 0 up to it (restoredTail refuses
// them); 0 for the rest.
func (m *Model) SnapshotsRestoreAfter() int { return m.window }

// restoredTail is the partial state a load of a model with one ends at,
// framed for the context the state is restored into: the snapshot's
// recurrent state as it is, or its window cache's state in fr.NStream
// streams with one more cell, at position 0, whose rows are zero.
//
// That cell is for llama-server v0.5.0, which reads a slot's memory before
// it goes on from a prompt's first n_past tokens: a window that does not
// reach back past n_past - n_swa (pos_min_thold, server-context.cpp) makes
// it load a context checkpoint or, having none, as after any slot restore,
// compute the whole prompt again. A window state at P holds exactly the
// positions from P - n_swa, one short. Position 0 is masked for every
// position the server computes from P on (P > n_swa: llama_hparams::
// is_masked_swa, standard windows and chunks alike), so no attention
// reads the cell's rows, and the next decode reuses its cell. A window that
// holds position 0 already (P <= n_swa) passes no such check: the restore
// is refused.
func (m *Model) restoredTail(ld *bridge.Load, fr Frame, tokens []int32) ([]byte, error) {
	snap, err := ld.Snapshot()
	if err != nil {
		return nil, err
	}
	switch m.tail {
	case recurrentTail:
		return bytes.Clone(snap), nil
	case indexedRecurrentTail:
		// The indexer cache's state, of one stream at the snapshot's
		// positions in order, framed for the context's streams.
		if len(snap) <= m.recurrentBytes {
			return nil, status.Errorf(status.Corrupt, "a snapshot of %d bytes: no recurrent state of %d and indexer cache", len(snap), m.recurrentBytes)
		}
		idx, err := llamastate.ReframeCache(snap[m.recurrentBytes:], fr.NStream)
		if err != nil {
			return nil, status.Wrap(status.Corrupt, err, "the snapshot's indexer cache")
		}
		return append(bytes.Clone(snap[:m.recurrentBytes]), idx...), nil
	}
	lead := llamastate.Cell{Pos: 0, SeqIDs: []int32{fr.SeqID}}
	if m.Format.CellExt {
		lead.Ext = m.textExt(0, tokens[0])
	}
	out, err := llamastate.CacheWithLead(snap, m.Format.CellExt, m.Format.KOnly(), fr.NStream, lead)
	if errors.Is(err, llamastate.ErrLeadHeld) {
		return nil, status.Wrap(status.Unsupported, err, fmt.Sprintf("the window state after %d tokens reaches back to position 0: llama-server computes such a prompt again after a slot restore", len(tokens)))
	}
	return out, err
}

// emptyState is a state of n cells at positions 0..n-1 whose rows the load
// then writes in place. Every layer's rows alias one zero buffer, which
// only gives them their lengths: FrameInto writes around them.
func (m *Model) emptyState(fr Frame, tokens []int32) *llamastate.State {
	n := len(tokens)
	st := &llamastate.State{Kind: fr.Kind, SeqID: fr.SeqID, Streams: make([]llamastate.Stream, fr.NStream),
		CellExt: m.Format.CellExt, KOnly: m.Format.KOnly()}
	if fr.Kind == llamastate.SlotFile {
		st.Words = ServerWords(tokens)
	}
	s := &st.Streams[0]
	s.VTrans = m.Format.VTrans
	s.Cells = make([]llamastate.Cell, n)
	ids := make([]int32, n)
	for p := range s.Cells {
		ids[p] = fr.SeqID
		s.Cells[p] = llamastate.Cell{Pos: int32(p), SeqIDs: ids[p : p+1 : p+1]}
		if st.CellExt {
			s.Cells[p].Ext = m.textExt(int32(p), tokens[p])
		}
	}
	var widest uint64
	for _, ly := range m.Format.Layers {
		widest = max(widest, ly.KRow, ly.VRow)
	}
	zero := make([]byte, uint64(n)*widest)
	s.Layers = make([]llamastate.Layer, len(m.Format.Layers))
	for l, ly := range m.Format.Layers {
		s.Layers[l] = llamastate.Layer{KType: ly.KType, KRowSize: ly.KRow, K: zero[:uint64(n)*ly.KRow],
			VType: ly.VType, VRowSize: ly.VRow, VElSize: ly.VElSize, NEmbdV: ly.NEmbdV, V: zero[:uint64(n)*ly.VRow]}
	}
	return st
}

// ServerWords frames tokens as llama-server's slot files do
// (server_tokens::serialize): -1, version 1, the count, the tokens, no media.
func ServerWords(tokens []int32) []int32 {
	w := make([]int32, 0, len(tokens)+4)
	w = append(w, -1, 1, int32(len(tokens)))
	w = append(w, tokens...)
	return append(w, 0)
}
