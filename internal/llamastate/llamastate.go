// Package llamastate reads and writes llama.cpp v0.5.0 sequence states: the
// blob of llama_state_seq_get_data (magic 0xaf143cd8 and the source sequence
// id in front) and the slot file of llama_state_seq_save_file and
// llama-server's /slots save ("ggsq", version 3 and a token list in front).
// Both carry, per KV stream, the sequence's cells (position, sequence ids) in
// cell order and then, per layer, K rows and V rows or V columns
// (llama-patches/README.md, "Sequence-state blob").
//
// A reverse proxy splits slot files into blocks of positions and reassembles
// a prefix with Slice. The format is version-specific: this package keys on
// v0.5.0 and refuses other magics and slot versions. Two variants are not
// flagged in the state, and Parse tries them when a state does not read
// without: the cells of M-RoPE and per-layer-embedding caches carry an
// extension (llama_kv_cell_ext; CellExt), and an MLA cache has no V tensors,
// so its layers have no V sections (KOnly). The state of a memory of two
// KV caches (llama_kv_cache_iswa of sliding-window models: the base cache's
// state, then the window cache's; llama_kv_cache_dsa: the MLA cache's, then
// its indexer's) reads with ParseTwoCaches; Parse refuses it. Hybrid and
// recurrent memories write states that are not KV caches' and read with
// neither.
package llamastate

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/mcbridge/mcbridge/internal/status"
)

// Magic numbers and the slot file version of llama.cpp v0.5.0.
const (
	SeqMagic    = 0xaf143cd8 // io_magic, llama-context.cpp
	SlotMagic   = 0x67677371 // LLAMA_STATE_SEQ_MAGIC, "ggsq"
	SlotVersion = 3          // LLAMA_STATE_SEQ_VERSION
)

// maxStreams is LLAMA_MAX_SEQ (llama-cparams.h): a context has at most one
// KV stream a sequence.
const maxStreams = 256

// Kind says which of the two framings a state has.
type Kind int

const (
	Memory   Kind = iota // llama_state_seq_get_data: magic, seq id, streams
	SlotFile             // llama_state_seq_save_file: magic, version, tokens, streams
)

// State is a parsed sequence state. Its byte slices alias the buffer given
// to Parse, which must not change while the State is in use.
type State struct {
	Kind  Kind
	SeqID int32 // the source sequence (Memory only)
	// Words are the slot file's token words as written (SlotFile only):
	// llama-server's server_tokens::serialize, or a plain token list.
	Words   []int32
	Streams []Stream
	// Second is the second KV cache's streams in the state of a memory of
	// two (ParseTwoCaches), written after the first cache's Streams; nil for
	// one cache. Both caches have as many streams, and one cell format and
	// variant.
	Second []Stream
	// CellExt says that every cell carries an extension (Cell.Ext).
	CellExt bool
	// KOnly says that the layers carry K only: the cache has no V (MLA,
	// where attention reads V out of K's latent), and the state no V
	// sections. Every layer's V fields are then zero and V is empty.
	KOnly bool
}

// Stream is one KV stream's section. A stream without cells of the
// sequence has neither cells nor layers.
type Stream struct {
	Cells  []Cell
	VTrans bool // V stored transposed (flash attention off)
	Layers []Layer
}

// Cell is one KV cell of the sequence, in the blob's (cell-index) order.
type Cell struct {
	Pos    int32
	SeqIDs []int32
	Ext    CellExt // in states with CellExt only
}

// Layer is one layer's K and V. K holds one row of KRowSize bytes per cell,
// in cell order. V holds, row-major, one row of VRowSize bytes per cell, or,
// transposed, NEmbdV columns of one VElSize-byte element per cell.
type Layer struct {
	KType    int32
	KRowSize uint64
	K        []byte
	KOff     int // offset of K in the parsed buffer
	VType    int32
	VRowSize uint64 // transposed: NEmbdV * VElSize
	VElSize  uint32 // transposed only
	NEmbdV   uint32 // transposed only
	V        []byte
	VOff     int // offset of V in the parsed buffer
}

// reader reads little-endian fields; every count read is checked against
// the bytes left before anything is sized by it.
// CellExt is llama_kv_cell_ext: M-RoPE's 2-D position of the cell's token
// and the token (per-layer embeddings hash n-grams of them).
type CellExt struct {
	X, Y, Tok int32
}

// cellExtSize is sizeof(llama_kv_cell_ext).
const cellExtSize = 12

type reader struct {
	b     []byte
	off   int
	ext   bool // cells carry an extension
	kOnly bool // layers have no V sections
}

func (r *reader) left() int { return len(r.b) - r.off }

func (r *reader) u32(what string) (uint32, error) {
	if r.left() < 4 {
		return 0, status.Errorf(status.InvalidArg, "sequence state: truncated at %s (offset %d)", what, r.off)
	}
	v := binary.LittleEndian.Uint32(r.b[r.off:])
	r.off += 4
	return v, nil
}

func (r *reader) i32(what string) (int32, error) {
	v, err := r.u32(what)
	return int32(v), err
}

func (r *reader) u64(what string) (uint64, error) {
	if r.left() < 8 {
		return 0, status.Errorf(status.InvalidArg, "sequence state: truncated at %s (offset %d)", what, r.off)
	}
	v := binary.LittleEndian.Uint64(r.b[r.off:])
	r.off += 8
	return v, nil
}

// bytes takes n*size bytes; n and size come from the input.
func (r *reader) bytes(n, size uint64, what string) ([]byte, int, error) {
	if size != 0 && n > math.MaxInt64/size || n*size > uint64(r.left()) {
		return nil, 0, status.Errorf(status.InvalidArg, "sequence state: %s of %d x %d bytes at offset %d, %d left", what, n, size, r.off, r.left())
	}
	off := r.off
	r.off += int(n * size)
	return r.b[off:r.off:r.off], off, nil
}

// variants are the readings a state is tried in, in Parse's order: plain
// cells and layers with V, extended cells, no V sections, both.
var variants = []struct{ ext, kOnly bool }{{false, false}, {true, false}, {false, true}, {true, true}}

// Parse reads a sequence state blob or slot file. It accepts exactly one
// state: bytes after the last stream are an error. A state that does not
// read with plain cells and layers with V is read again with extended cells
// (CellExt), then with layers without V (KOnly), then with both. A whole
// state of one variant does not read as another: each shifts every field
// that follows, and a reading must end at the state's last byte. (A state
// with V cut where its K sections end reads as K-only; a host's model has
// one format and refuses states of another.) When none reads, the error is
// that of the first reading that read a whole state and found bytes after
// it, which is what the state of several caches (sliding-window, hybrid,
// MLA with an indexer) gives, else the plain reading's. When those bytes
// are the states of more KV caches, the error is a *CachesError.
func Parse(b []byte) (*State, error) {
	var first, whole error
	wholeExt := false
	for _, v := range variants {
		st, err := parse(b, v.ext, v.kOnly)
		if err == nil {
			return st, nil
		}
		if first == nil {
			first = err
		}
		if st != nil && whole == nil {
			whole, wholeExt = err, v.ext
		}
	}
	if whole == nil {
		return nil, first
	}
	var ce *CachesError
	if errors.As(whole, &ce) && !kvCaches(b[len(b)-ce.Bytes:], wholeExt) {
		return nil, status.Errorf(status.InvalidArg, "%s", ce.Error())
	}
	return nil, whole
}

// CachesError is Parse's error for a whole state followed by the states of
// more KV caches: what a memory of several caches writes, each cache's
// state after the other's (llama_kv_cache_iswa, llama_kv_cache_dsa and the
// like). A host that wrote the state itself learns from it that its memory
// is not one KV cache (errors.As). Bytes after a state that are no cache's
// state are a plain InvalidArg error with the same message.
type CachesError struct {
	Bytes int // after the last stream
}

func (e *CachesError) Error() string {
	return fmt.Sprintf("sequence state: %d bytes after the last stream", e.Bytes)
}

// kvCaches says whether b is the states of one or more KV caches back to
// back, each a stream count and streams as llama_kv_cache::state_write
// writes them, with V sections or without (an indexer's cache may have
// none). The caches of one memory share the cells' format (ext).
func kvCaches(b []byte, ext bool) bool {
	for len(b) > 0 {
		n := 0
		for _, kOnly := range []bool{false, true} {
			r := &reader{b: b, ext: ext, kOnly: kOnly}
			if _, err := r.streams(); err == nil {
				n = r.off
				break
			}
		}
		if n == 0 {
			return false
		}
		b = b[n:]
	}
	return true
}

// ParseTwoCaches reads the state of a memory of two KV caches
// (llama_kv_cache_iswa::state_write and the like): the first cache's state,
// then the second's, in one variant (Parse's), with as many streams each.
func ParseTwoCaches(b []byte) (*State, error) {
	var first error
	for _, v := range variants {
		st, err := parse(b, v.ext, v.kOnly)
		var ce *CachesError
		if err == nil {
			err = status.Errorf(status.InvalidArg, "sequence state: one KV cache where two were expected")
		} else if st != nil && errors.As(err, &ce) {
			r := &reader{b: b, off: len(b) - ce.Bytes, ext: v.ext, kOnly: v.kOnly}
			if st.Second, err = r.streams(); err == nil && r.left() != 0 {
				err = status.Errorf(status.InvalidArg, "sequence state: %d bytes after the second cache", r.left())
			}
			if err == nil && len(st.Second) != len(st.Streams) {
				err = status.Errorf(status.InvalidArg, "sequence state: %d streams in the second cache, %d in the first", len(st.Second), len(st.Streams))
			}
			if err == nil {
				return st, nil
			}
		}
		if first == nil {
			first = err
		}
	}
	return nil, first
}

// ParseLeading reads the state of a memory's first KV cache and says how
// many bytes the memory wrote after it: another cache's state (the window
// cache of a sliding-window memory), a recurrent state (a hybrid memory),
// or none. Of the variants that read a whole first cache, the one that
// reads the most is taken.
func ParseLeading(b []byte) (*State, int, error) {
	var best *State
	rest, first := 0, error(nil)
	for _, v := range variants {
		st, err := parse(b, v.ext, v.kOnly)
		if err == nil {
			return st, 0, nil
		}
		var ce *CachesError
		if st != nil && errors.As(err, &ce) && (best == nil || ce.Bytes < rest) {
			best, rest = st, ce.Bytes
		}
		if first == nil {
			first = err
		}
	}
	if best == nil {
		return nil, 0, first
	}
	return best, rest, nil
}

// parse reads b as one variant. A whole state followed by more bytes is an
// error that comes with the state read: a *CachesError, which Parse keeps
// only when those bytes read as caches' states.
func parse(b []byte, cellExt, kOnly bool) (*State, error) {
	r := &reader{b: b, ext: cellExt, kOnly: kOnly}
	st := &State{CellExt: cellExt, KOnly: kOnly}
	if err := r.frame(st); err != nil {
		return nil, err
	}
	var err error
	if st.Streams, err = r.streams(); err != nil {
		return nil, err
	}
	if r.left() != 0 {
		return st, status.Wrap(status.InvalidArg, &CachesError{Bytes: r.left()}, "")
	}
	return st, nil
}

// frame reads a state's framing, what comes before its memory's state:
// the kind, and the sequence id or the slot file's token words.
func (r *reader) frame(st *State) error {
	magic, err := r.u32("magic")
	if err != nil {
		return err
	}
	switch magic {
	case SeqMagic:
		st.Kind = Memory
		if st.SeqID, err = r.i32("sequence id"); err != nil {
			return err
		}
	case SlotMagic:
		st.Kind = SlotFile
		version, err := r.u32("slot version")
		if err != nil {
			return err
		}
		if version != SlotVersion {
			return status.Errorf(status.Unsupported, "slot file version %d (llama.cpp v0.5.0 writes %d)", version, SlotVersion)
		}
		n, err := r.u32("token count")
		if err != nil {
			return err
		}
		words, _, err := r.bytes(uint64(n), 4, "token words")
		if err != nil {
			return err
		}
		st.Words = make([]int32, n)
		for i := range st.Words {
			st.Words[i] = int32(binary.LittleEndian.Uint32(words[4*i:]))
		}
	default:
		return status.Errorf(status.Unsupported, "magic %#x: not a llama.cpp v0.5.0 sequence state or slot file", magic)
	}
	return nil
}

// streams reads a KV cache's state: the stream count and the streams.
func (r *reader) streams() ([]Stream, error) {
	nStream, err := r.u32("stream count")
	if err != nil {
		return nil, err
	}
	if nStream == 0 || uint64(nStream) > uint64(r.left()/4) {
		return nil, status.Errorf(status.InvalidArg, "sequence state: %d streams in %d bytes", nStream, r.left())
	}
	ss := make([]Stream, nStream)
	for s := range ss {
		if err := r.stream(&ss[s]); err != nil {
			return nil, err
		}
	}
	return ss, nil
}

func (r *reader) stream(s *Stream) error {
	n, err := r.u32("cell count")
	if err != nil || n == 0 {
		return err
	}
	// A cell takes at least 8 bytes: position and sequence id count.
	if uint64(n) > uint64(r.left()/8) {
		return status.Errorf(status.InvalidArg, "sequence state: %d cells in %d bytes", n, r.left())
	}
	s.Cells = make([]Cell, n)
	for c := range s.Cells {
		cell := &s.Cells[c]
		if cell.Pos, err = r.i32("cell position"); err != nil {
			return err
		}
		k, err := r.u32("cell sequence count")
		if err != nil {
			return err
		}
		if r.ext {
			ext, _, err := r.bytes(1, cellExtSize, "cell extension")
			if err != nil {
				return err
			}
			cell.Ext = CellExt{X: int32(binary.LittleEndian.Uint32(ext)), Y: int32(binary.LittleEndian.Uint32(ext[4:])),
				Tok: int32(binary.LittleEndian.Uint32(ext[8:]))}
		}
		ids, _, err := r.bytes(uint64(k), 4, "cell sequence ids")
		if err != nil {
			return err
		}
		cell.SeqIDs = make([]int32, k)
		for i := range cell.SeqIDs {
			cell.SeqIDs[i] = int32(binary.LittleEndian.Uint32(ids[4*i:]))
		}
	}
	vTrans, err := r.u32("v_trans")
	if err != nil {
		return err
	}
	if vTrans > 1 {
		return status.Errorf(status.InvalidArg, "sequence state: v_trans %d", vTrans)
	}
	s.VTrans = vTrans == 1
	nLayer, err := r.u32("layer count")
	if err != nil {
		return err
	}
	// A layer takes at least a 12-byte K header and, with V, a 12-byte V
	// header.
	minLayer := 24
	if r.kOnly {
		minLayer = 12
	}
	if nLayer == 0 || uint64(nLayer) > uint64(r.left()/minLayer) {
		return status.Errorf(status.InvalidArg, "sequence state: %d layers in %d bytes", nLayer, r.left())
	}
	s.Layers = make([]Layer, nLayer)
	cells := uint64(n)
	for l := range s.Layers {
		ly := &s.Layers[l]
		if ly.KType, err = r.i32("K type"); err != nil {
			return err
		}
		if ly.KRowSize, err = r.u64("K row size"); err != nil {
			return err
		}
		if ly.KRowSize == 0 {
			return status.Errorf(status.InvalidArg, "sequence state: layer %d: empty K rows", l)
		}
		if ly.K, ly.KOff, err = r.bytes(cells, ly.KRowSize, "K rows"); err != nil {
			return err
		}
	}
	if r.kOnly {
		return nil
	}
	for l := range s.Layers {
		ly := &s.Layers[l]
		if ly.VType, err = r.i32("V type"); err != nil {
			return err
		}
		if s.VTrans {
			if ly.VElSize, err = r.u32("V element size"); err != nil {
				return err
			}
			if ly.NEmbdV, err = r.u32("V columns"); err != nil {
				return err
			}
			ly.VRowSize = uint64(ly.VElSize) * uint64(ly.NEmbdV)
		} else if ly.VRowSize, err = r.u64("V row size"); err != nil {
			return err
		}
		if ly.VRowSize == 0 {
			return status.Errorf(status.InvalidArg, "sequence state: layer %d: empty V rows", l)
		}
		if ly.V, ly.VOff, err = r.bytes(cells, ly.VRowSize, "V data"); err != nil {
			return err
		}
	}
	return nil
}

// Size is the length of Build's output.
func (st *State) Size() int {
	n := 12
	if st.Kind == SlotFile {
		n = 16 + 4*len(st.Words)
	}
	if st.Second != nil {
		n += 4
	}
	for _, s := range st.streams() {
		n += 4
		if len(s.Cells) == 0 {
			continue
		}
		for _, c := range s.Cells {
			n += 8 + 4*len(c.SeqIDs)
			if st.CellExt {
				n += cellExtSize
			}
		}
		n += 8
		for _, l := range s.Layers {
			n += 12 + len(l.K)
			if !st.KOnly {
				n += 12 + len(l.V)
			}
		}
	}
	return n
}

// streams is every stream of the state, the first cache's then the
// second's.
func (st *State) streams() []Stream {
	if st.Second == nil {
		return st.Streams
	}
	return append(st.Streams[:len(st.Streams):len(st.Streams)], st.Second...)
}

// Build writes the state in its Kind's framing. A State that Parse returned
// builds to the exact bytes it was parsed from.
func (st *State) Build() ([]byte, error) {
	return st.AppendTo(make([]byte, 0, st.Size()))
}

// AppendTo is Build into w's spare capacity: with Size bytes of it, the
// state lands in w's own memory (a C buffer, say) without a copy.
func (st *State) AppendTo(w []byte) ([]byte, error) {
	if err := st.check(); err != nil {
		return nil, err
	}
	return st.encode(w, true), nil
}

// FrameInto writes the state into b, which must be Size bytes long, all but
// the bytes of its K and V rows, which it leaves as they are: for a caller
// that fills the rows in place afterwards, so that they are not written
// twice.
func (st *State) FrameInto(b []byte) error {
	if err := st.check(); err != nil {
		return err
	}
	if len(b) != st.Size() {
		return status.Errorf(status.InvalidArg, "a state of %d bytes framed into %d", st.Size(), len(b))
	}
	st.encode(b[:0], false)
	return nil
}

// encode appends the state to w, the rows' bytes too, or, without rows,
// only room for them, which w's capacity must hold.
func (st *State) encode(w []byte, rows bool) []byte {
	w = st.appendFrame(w)
	w = appendCache(w, st.Streams, st.CellExt, st.KOnly, rows)
	if st.Second != nil {
		w = appendCache(w, st.Second, st.CellExt, st.KOnly, rows)
	}
	return w
}

// appendFrame appends the state's framing, as frame reads it.
func (st *State) appendFrame(w []byte) []byte {
	le := binary.LittleEndian
	if st.Kind == SlotFile {
		w = le.AppendUint32(w, SlotMagic)
		w = le.AppendUint32(w, SlotVersion)
		w = le.AppendUint32(w, uint32(len(st.Words)))
		for _, t := range st.Words {
			w = le.AppendUint32(w, uint32(t))
		}
	} else {
		w = le.AppendUint32(w, SeqMagic)
		w = le.AppendUint32(w, uint32(st.SeqID))
	}
	return w
}

// appendCache appends one KV cache's state, its stream count and streams,
// as encode does.
func appendCache(w []byte, ss []Stream, cellExt, kOnly, rows bool) []byte {
	le := binary.LittleEndian
	put := func(b []byte) []byte {
		if rows {
			return append(w, b...)
		}
		return w[:len(w)+len(b)]
	}
	w = le.AppendUint32(w, uint32(len(ss)))
	for _, s := range ss {
		w = le.AppendUint32(w, uint32(len(s.Cells)))
		if len(s.Cells) == 0 {
			continue
		}
		for _, c := range s.Cells {
			w = le.AppendUint32(w, uint32(c.Pos))
			w = le.AppendUint32(w, uint32(len(c.SeqIDs)))
			if cellExt {
				w = le.AppendUint32(w, uint32(c.Ext.X))
				w = le.AppendUint32(w, uint32(c.Ext.Y))
				w = le.AppendUint32(w, uint32(c.Ext.Tok))
			}
			for _, id := range c.SeqIDs {
				w = le.AppendUint32(w, uint32(id))
			}
		}
		vTrans := uint32(0)
		if s.VTrans {
			vTrans = 1
		}
		w = le.AppendUint32(w, vTrans)
		w = le.AppendUint32(w, uint32(len(s.Layers)))
		for _, l := range s.Layers {
			w = le.AppendUint32(w, uint32(l.KType))
			w = le.AppendUint64(w, l.KRowSize)
			w = put(l.K)
		}
		if kOnly {
			continue
		}
		for _, l := range s.Layers {
			w = le.AppendUint32(w, uint32(l.VType))
			if s.VTrans {
				w = le.AppendUint32(w, l.VElSize)
				w = le.AppendUint32(w, l.NEmbdV)
			} else {
				w = le.AppendUint64(w, l.VRowSize)
			}
			w = put(l.V)
		}
	}
	return w
}

// check verifies what Build relies on, for states assembled by hand.
func (st *State) check() error {
	switch {
	case st.Kind != Memory && st.Kind != SlotFile:
		return status.Errorf(status.InvalidArg, "state kind %d", st.Kind)
	case len(st.Streams) == 0 || uint64(len(st.Streams)) > math.MaxUint32:
		return status.Errorf(status.InvalidArg, "state of %d streams", len(st.Streams))
	case uint64(len(st.Words)) > math.MaxUint32:
		return status.Errorf(status.InvalidArg, "%d token words", len(st.Words))
	case st.Second != nil && len(st.Second) != len(st.Streams):
		return status.Errorf(status.InvalidArg, "%d streams in the second cache, %d in the first", len(st.Second), len(st.Streams))
	}
	for i, s := range st.streams() {
		if len(s.Cells) == 0 {
			continue
		}
		if len(s.Layers) == 0 || uint64(len(s.Cells)) > math.MaxUint32 || uint64(len(s.Layers)) > math.MaxUint32 {
			return status.Errorf(status.InvalidArg, "stream %d: %d cells, %d layers", i, len(s.Cells), len(s.Layers))
		}
		n := uint64(len(s.Cells))
		for l, ly := range s.Layers {
			if st.KOnly {
				if ly.KRowSize == 0 || uint64(len(ly.K)) != n*ly.KRowSize || ly.VRowSize != 0 || ly.VElSize != 0 || ly.NEmbdV != 0 || len(ly.V) != 0 {
					return status.Errorf(status.InvalidArg, "stream %d layer %d: %d bytes of K for %d cells, V of %d bytes in a K-only state", i, l, len(ly.K), n, len(ly.V))
				}
				continue
			}
			vRow := ly.VRowSize
			if s.VTrans && vRow != uint64(ly.VElSize)*uint64(ly.NEmbdV) {
				return status.Errorf(status.InvalidArg, "stream %d layer %d: V row of %d bytes is not %d x %d", i, l, vRow, ly.NEmbdV, ly.VElSize)
			}
			if ly.KRowSize == 0 || vRow == 0 || uint64(len(ly.K)) != n*ly.KRowSize || uint64(len(ly.V)) != n*vRow {
				return status.Errorf(status.InvalidArg, "stream %d layer %d: %d/%d bytes of K/V for %d cells", i, l, len(ly.K), len(ly.V), n)
			}
		}
	}
	return nil
}
