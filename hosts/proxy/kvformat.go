package proxy

import (
	"encoding/binary"
	"math"

	"github.com/zeebo/xxh3"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout"
	"github.com/mcbridge/mcbridge/internal/llamastate"
	"github.com/mcbridge/mcbridge/internal/mem"
	"github.com/mcbridge/mcbridge/internal/status"
)

// llamaVersion is the llama.cpp release whose slot files llamastate reads;
// it goes into every fingerprint, as the format is keyed on it.
const llamaVersion = "v0.5.0"

// probeTokens is the fixed prompt whose KV identifies the upstream's model
// and numerics (DESIGN amendment 5): ids every vocabulary has.
var probeTokens = []int32{1, 2, 3, 5, 8, 13, 21, 34}

// ggmlType is what a row of a KV cache type weighs: blck elements in size
// bytes. Only the types llama.cpp accepts for -ctk/-ctv are listed.
type ggmlType struct{ blck, size int }

var ggmlTypes = map[int32]ggmlType{
	0: {1, 4}, 1: {1, 2}, 30: {1, 2}, // f32, f16, bf16
	2: {32, 18}, 3: {32, 20}, 6: {32, 22}, 7: {32, 24}, 8: {32, 34}, 20: {32, 18}, // q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl
}

// rowElements is how many elements a row of bytes holds, 0 when the bytes
// are not whole rows of that type.
func rowElements(typ int32, bytes uint64) uint32 {
	t, ok := ggmlTypes[typ]
	if !ok || bytes == 0 || bytes%uint64(t.size) != 0 {
		return 0
	}
	n := bytes / uint64(t.size) * uint64(t.blck)
	if n > math.MaxUint32 {
		return 0
	}
	return uint32(n)
}

// layerFormat is one layer's K and V as the upstream writes them.
type layerFormat struct {
	KType   int32
	KRow    uint64
	VType   int32
	VRow    uint64
	VElSize uint32 // transposed V only
	NEmbdV  uint32 // transposed V only
}

// kvFormat is what every slot file of the upstream must say: a file that
// differs was written by another model or configuration.
type kvFormat struct {
	NStream int
	VTrans  bool
	Layers  []layerFormat
}

// formatOf reads the format of a parsed slot file's sequence.
func formatOf(st *llamastate.State) (kvFormat, int, error) {
	si, err := st.Sequence()
	if err != nil {
		return kvFormat{}, 0, err
	}
	s := &st.Streams[si]
	f := kvFormat{NStream: len(st.Streams), VTrans: s.VTrans, Layers: make([]layerFormat, len(s.Layers))}
	for l, ly := range s.Layers {
		f.Layers[l] = layerFormat{KType: ly.KType, KRow: ly.KRowSize, VType: ly.VType, VRow: ly.VRowSize, VElSize: ly.VElSize, NEmbdV: ly.NEmbdV}
	}
	return f, si, nil
}

func (f *kvFormat) equal(o *kvFormat) bool {
	if f.NStream != o.NStream || f.VTrans != o.VTrans || len(f.Layers) != len(o.Layers) {
		return false
	}
	for i := range f.Layers {
		if f.Layers[i] != o.Layers[i] {
			return false
		}
	}
	return true
}

// spec turns the format into the bridge's model registration. The model
// digest and the probe digest carry what the format cannot: weights, rope
// settings, rotation of quantized K/V, adapters applied server-wide.
func (f *kvFormat) spec(content, probe key.Hash, extra string) (bridge.ModelSpec, error) {
	n := len(f.Layers)
	if n == 0 {
		return bridge.ModelSpec{}, status.Errorf(status.Unsupported, "KV format without layers")
	}
	p := key.Model{
		LlamaVersion: llamaVersion,
		ContentHash:  content,
		NLayer:       uint32(n),
		TypeK:        f.Layers[0].KType,
		TypeV:        f.Layers[0].VType,
		VTrans:       f.VTrans,
		KVProbe:      probe,
		Extra:        extra,
	}
	spec := bridge.ModelSpec{KRow: make([]int, n), VRow: make([]int, n), VElem: make([]int, n)}
	for l, ly := range f.Layers {
		if ly.KType != p.TypeK || ly.VType != p.TypeV {
			return spec, status.Errorf(status.Unsupported, "layer %d: K/V types %d/%d differ from layer 0's", l, ly.KType, ly.VType)
		}
		if ly.KRow > math.MaxInt32 || ly.VRow > math.MaxInt32 {
			return spec, status.Errorf(status.Unsupported, "layer %d: rows over 2 GiB", l)
		}
		ek := rowElements(ly.KType, ly.KRow)
		if ek == 0 {
			return spec, status.Errorf(status.Unsupported, "layer %d: K row of %d bytes is not whole rows of type %d", l, ly.KRow, ly.KType)
		}
		spec.KRow[l], spec.VRow[l] = int(ly.KRow), int(ly.VRow)
		var ev uint32
		if f.VTrans {
			// Transposed V is one unquantized element per cell and column.
			if t, ok := ggmlTypes[ly.VType]; !ok || t.blck != 1 || uint32(t.size) != ly.VElSize {
				return spec, status.Errorf(status.Unsupported, "layer %d: transposed V of type %d in %d-byte elements", l, ly.VType, ly.VElSize)
			}
			ev, spec.VElem[l] = ly.NEmbdV, int(ly.VElSize)
		} else {
			ev = rowElements(ly.VType, ly.VRow)
			spec.VElem[l] = 1
			if t := ggmlTypes[ly.VType]; t.blck == 1 {
				spec.VElem[l] = t.size
			}
		}
		if ev == 0 {
			return spec, status.Errorf(status.Unsupported, "layer %d: V row of %d bytes is not whole rows of type %d", l, ly.VRow, ly.VType)
		}
		p.NEmbdKGQA = append(p.NEmbdKGQA, ek)
		p.NEmbdVGQA = append(p.NEmbdVGQA, ev)
	}
	spec.Params = p
	return spec, nil
}

// probeDigest hashes the KV of positions 0..n-1 of a parsed slot file in
// position order, V row by row whatever its layout, so that where the
// server put the cells does not change it.
func probeDigest(st *llamastate.State, n int) (key.Hash, error) {
	at, err := st.PositionCells(n)
	if err != nil {
		return key.Hash{}, err
	}
	si, _ := st.Sequence()
	s := &st.Streams[si]
	h := xxh3.New()
	_, _ = h.WriteString("mcbridge proxy kv probe v1 " + llamaVersion)
	var b [4]byte
	put := func(v uint32) {
		binary.LittleEndian.PutUint32(b[:], v)
		_, _ = h.Write(b[:])
	}
	for _, t := range probeTokens[:n] {
		put(uint32(t))
	}
	total := len(s.Cells)
	for _, ly := range s.Layers {
		put(uint32(ly.KType))
		put(uint32(ly.VType))
		kr := int(ly.KRowSize)
		for _, c := range at {
			_, _ = h.Write(ly.K[c*kr : (c+1)*kr])
		}
		if !s.VTrans {
			vr := int(ly.VRowSize)
			for _, c := range at {
				_, _ = h.Write(ly.V[c*vr : (c+1)*vr])
			}
			continue
		}
		el := int(ly.VElSize)
		for _, c := range at {
			for j := 0; j < int(ly.NEmbdV); j++ {
				_, _ = h.Write(ly.V[(j*total+c)*el : (j*total+c+1)*el])
			}
		}
	}
	u := h.Sum128()
	var out key.Hash
	binary.BigEndian.PutUint64(out[:8], u.Hi)
	binary.BigEndian.PutUint64(out[8:], u.Lo)
	return out, nil
}

// serverWords frames tokens as llama-server's slot files do
// (server_tokens::serialize): -1, version 1, the count, the tokens, no media.
func serverWords(tokens []int32) []int32 {
	w := make([]int32, 0, len(tokens)+4)
	w = append(w, -1, 1, int32(len(tokens)))
	w = append(w, tokens...)
	return append(w, 0)
}

// restoreFile is a slot file of positions 0..n-1 for one slot, with the
// layout that points into its K and V.
type restoreFile struct {
	bytes  []byte
	state  *llamastate.State
	layout kvlayout.Layout
	cells  []uint32
}

// newRestoreFile lays out an empty slot file for tokens in slot's stream:
// the load then writes every K and V byte in place.
func (f *kvFormat) newRestoreFile(slot int, tokens []int32) (*restoreFile, error) {
	n := len(tokens)
	stream := 0
	if f.NStream > 1 {
		stream = slot
	}
	if n == 0 || stream >= f.NStream {
		return nil, status.Errorf(status.InvalidArg, "restore file of %d tokens for slot %d of %d streams", n, slot, f.NStream)
	}
	st := &llamastate.State{Kind: llamastate.SlotFile, Words: serverWords(tokens), Streams: make([]llamastate.Stream, f.NStream)}
	s := &st.Streams[stream]
	s.VTrans = f.VTrans
	s.Cells = make([]llamastate.Cell, n)
	ids := make([]int32, n)
	for p := range s.Cells {
		ids[p] = int32(slot)
		s.Cells[p] = llamastate.Cell{Pos: int32(p), SeqIDs: ids[p : p+1 : p+1]}
	}
	// Every layer's rows alias one zero buffer: Build only reads them.
	var widest uint64
	for _, ly := range f.Layers {
		widest = max(widest, ly.KRow, ly.VRow)
	}
	zero := make([]byte, uint64(n)*widest)
	s.Layers = make([]llamastate.Layer, len(f.Layers))
	for l, ly := range f.Layers {
		s.Layers[l] = llamastate.Layer{KType: ly.KType, KRowSize: ly.KRow, K: zero[:uint64(n)*ly.KRow],
			VType: ly.VType, VRowSize: ly.VRow, VElSize: ly.VElSize, NEmbdV: ly.NEmbdV, V: zero[:uint64(n)*ly.VRow]}
	}
	b, err := st.Build()
	if err != nil {
		return nil, err
	}
	parsed, err := llamastate.Parse(b)
	if err != nil {
		return nil, err
	}
	cells := make([]uint32, n)
	for i := range cells {
		cells[i] = uint32(i)
	}
	return &restoreFile{bytes: b, state: parsed, layout: f.layout(b, &parsed.Streams[stream]), cells: cells}, nil
}

// layout points the bridge at a parsed file's rows: cell c of layer l is
// K row c and V row c, or element c of each V column.
func (f *kvFormat) layout(b []byte, s *llamastate.Stream) kvlayout.Layout {
	lo := kvlayout.Layout{Cells: uint32(len(s.Cells)), VTrans: s.VTrans, Location: "cpu:0", Layers: make([]kvlayout.Layer, len(s.Layers))}
	for l, ly := range s.Layers {
		vStride := ly.VRowSize
		if s.VTrans {
			vStride = uint64(len(s.Cells)) * uint64(ly.VElSize)
		}
		lo.Layers[l] = kvlayout.Layer{K: mem.Addr(b[ly.KOff:]), V: mem.Addr(b[ly.VOff:]), KStride: ly.KRowSize, VStride: vStride}
	}
	return lo
}
