package llamastate

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/mcbridge/mcbridge/internal/status"
)

// ErrLeadHeld is CacheWithLead's error for a lead at a position the cache
// state holds already.
var ErrLeadHeld = errors.New("the cache state holds the lead cell's position")

// ParseCache reads b as exactly one KV cache's state: a stream count and the
// streams, as llama_kv_cache::state_write writes them after a state's
// header. A sliding-window memory writes its window cache's state so, after
// the base cache's (ParseLeading's rest). cellExt and kOnly are the
// variant of the state it came from, which its caches share.
func ParseCache(b []byte, cellExt, kOnly bool) ([]Stream, error) {
	ss, n, err := ParseCacheLeading(b, cellExt, kOnly)
	if err != nil {
		return nil, err
	}
	if n != 0 {
		return nil, status.Errorf(status.InvalidArg, "cache state: %d bytes after the last stream", n)
	}
	return ss, nil
}

// ParseCacheLeading reads the first of the KV cache states b holds back to
// back (ParseCache's input followed by more: a sliding-window memory with
// an indexer cache writes its full-attention cache's, its indexer's, then
// its window cache's) and says how many bytes follow it.
func ParseCacheLeading(b []byte, cellExt, kOnly bool) ([]Stream, int, error) {
	r := &reader{b: b, ext: cellExt, kOnly: kOnly}
	ss, err := r.streams()
	if err != nil {
		return nil, 0, err
	}
	return ss, r.left(), nil
}

// CacheWithLead frames the KV cache state b (ParseCache's input, written
// by a context of any stream count) for a context of nStream streams: the
// sequence's cells go in the first stream, after one more cell, lead,
// whose K and V rows are zero bytes. lead's position must be one the
// state does not hold.
func CacheWithLead(b []byte, cellExt, kOnly bool, nStream int, lead Cell) ([]byte, error) {
	ss, err := ParseCache(b, cellExt, kOnly)
	if err != nil {
		return nil, err
	}
	in := &State{Streams: ss}
	si, err := in.Sequence()
	if err != nil {
		return nil, err
	}
	if nStream < 1 {
		return nil, status.Errorf(status.InvalidArg, "a cache of %d streams", nStream)
	}
	src := &ss[si]
	for _, c := range src.Cells {
		if c.Pos == lead.Pos {
			return nil, status.Wrap(status.InvalidArg, fmt.Errorf("%w (%d)", ErrLeadHeld, lead.Pos), "")
		}
	}
	out := make([]Stream, nStream)
	out[0] = withLead(src, lead)
	st := &State{Kind: Memory, Streams: out, CellExt: cellExt, KOnly: kOnly}
	if err := st.check(); err != nil {
		return nil, err
	}
	return appendCache(nil, out, cellExt, kOnly, true), nil
}

// withLead is src with lead in front of its cells and zero rows for it in
// every layer.
func withLead(src *Stream, lead Cell) Stream {
	n := len(src.Cells) + 1
	dst := Stream{VTrans: src.VTrans, Cells: make([]Cell, 0, n)}
	dst.Cells = append(append(dst.Cells, lead), src.Cells...)
	dst.Layers = make([]Layer, len(src.Layers))
	for l, ly := range src.Layers {
		d := ly
		d.K = append(make([]byte, ly.KRowSize, uint64(n)*ly.KRowSize), ly.K...)
		switch {
		case !src.VTrans:
			d.V = append(make([]byte, ly.VRowSize, uint64(n)*ly.VRowSize), ly.V...)
		default:
			// Each of the NEmbdV columns holds one element per cell: the
			// lead's goes in front of every column.
			el, old := int(ly.VElSize), len(src.Cells)
			d.V = make([]byte, int(ly.VRowSize)*n)
			for j := 0; j < int(ly.NEmbdV); j++ {
				copy(d.V[(j*n+1)*el:(j+1)*n*el], ly.V[j*old*el:(j+1)*old*el])
			}
		}
		dst.Layers[l] = d
	}
	return dst
}

// ReframeCache frames b, one sequence's KV cache state written by a context
// of any stream count (llama_kv_cache::state_write of one seq_id: a stream
// count, then each stream's cell count and cells, the count 0 for each
// stream but the sequence's), for a context of nStream streams:
// llama_kv_cache::state_read refuses a state of another count, and reads the
// one stream with cells into the sequence's own, wherever it is framed. The
// sequence's stream goes first and the rest are empty; its cells are not
// read, so that a host that does not know the variant of its cells (their
// extension, K only) reframes it too. b framed for nStream already comes
// back as it is.
func ReframeCache(b []byte, nStream int) ([]byte, error) {
	if nStream < 1 || uint64(nStream) > maxStreams {
		return nil, status.Errorf(status.InvalidArg, "a cache of %d streams", nStream)
	}
	if len(b) < 4 {
		return nil, status.Errorf(status.InvalidArg, "cache state of %d bytes", len(b))
	}
	n := uint64(binary.LittleEndian.Uint32(b))
	if n == 0 || n > uint64(len(b)-4)/4 {
		return nil, status.Errorf(status.InvalidArg, "cache state: %d streams in %d bytes", n, len(b))
	}
	if n == uint64(nStream) {
		return b, nil
	}
	// The empty streams before the sequence's are cell counts of 0, those
	// after it the state's last bytes.
	at := uint64(0)
	for at < n && binary.LittleEndian.Uint32(b[4+4*at:]) == 0 {
		at++
	}
	out := binary.LittleEndian.AppendUint32(make([]byte, 0, len(b)+4*nStream), uint32(nStream))
	if at == n {
		if uint64(len(b)) != 4+4*n {
			return nil, status.Errorf(status.InvalidArg, "cache state: %d bytes after %d empty streams", uint64(len(b))-4-4*n, n)
		}
		return append(out, make([]byte, 4*nStream)...), nil
	}
	after := 4 * (n - 1 - at)
	if uint64(len(b)) < 4+4*at+4+after {
		return nil, status.Errorf(status.InvalidArg, "cache state: %d bytes for %d streams", len(b), n)
	}
	end := uint64(len(b)) - after
	for _, c := range b[end:] {
		if c != 0 {
			return nil, status.Errorf(status.InvalidArg, "cache state: stream %d of %d holds cells after the sequence's (stream %d): not one sequence's state", end/4, n, at)
		}
	}
	out = append(out, b[4+4*at:end]...)
	return append(out, make([]byte, 4*(nStream-1))...), nil
}

// ReframeSeqState is ReframeCache for llama_state_seq_get_data's output of
// a memory that writes one KV cache's state: the magic, the sequence id,
// then the cache (a sliding-window memory's PARTIAL_ONLY state is its
// window cache's). llama_state_seq_set_data reads the sequence id and
// restores into the sequence it is given.
func ReframeSeqState(b []byte, nStream int) ([]byte, error) {
	const header = 8
	if len(b) < header+4 || binary.LittleEndian.Uint32(b) != SeqMagic {
		return nil, status.Errorf(status.InvalidArg, "sequence state of %d bytes without its magic", len(b))
	}
	if binary.LittleEndian.Uint32(b[header:]) == uint32(nStream) {
		return b, nil
	}
	cache, err := ReframeCache(b[header:], nStream)
	if err != nil {
		return nil, err
	}
	return append(append(make([]byte, 0, header+len(cache)), b[:header]...), cache...), nil
}

// CacheOfPositions is b, one sequence's KV cache state (ParseCache's input)
// that holds exactly positions [0, n), as the state of one stream whose
// cells hold them in position order. llama_memory_hybrid_idx reads its
// indexer cache's state into the cells its attention cache's state took, in
// the order each lists them: a host that composes the two from different
// sources lists both in position order.
func CacheOfPositions(b []byte, cellExt, kOnly bool, n int) ([]byte, error) {
	ss, err := ParseCache(b, cellExt, kOnly)
	if err != nil {
		return nil, err
	}
	st := &State{Streams: ss, CellExt: cellExt, KOnly: kOnly}
	at, err := st.PositionCells(n)
	if err != nil {
		return nil, err
	}
	si, _ := st.Sequence()
	if held := len(ss[si].Cells); held != n {
		return nil, status.Errorf(status.InvalidArg, "cache state of %d cells for positions [0, %d)", held, n)
	}
	ordered, err := gather(&ss[si], ss[si].Layers, at, 0)
	if err != nil {
		return nil, err
	}
	return appendCache(nil, []Stream{ordered}, cellExt, kOnly, true), nil
}
