package llamastate

import (
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
	r := &reader{b: b, ext: cellExt, kOnly: kOnly}
	ss, err := r.streams()
	if err != nil {
		return nil, err
	}
	if r.left() != 0 {
		return nil, status.Errorf(status.InvalidArg, "cache state: %d bytes after the last stream", r.left())
	}
	return ss, nil
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
