// Package host is what every host of the bridge shares: the patched
// llama-server (through the C ABI), the proxy in front of a stock
// llama-server and the libllama embedder (both of which see KV only as
// llama.cpp state blobs). It owns, once, the rules that decide whether two
// hosts share blocks: the model's identity (format, weights digest, llama.cpp
// version, the KV probe), the canonical scope of a request (tenant salt,
// adapter set) and the metric vocabulary. A host that computed the same KV
// bytes from the same GGUF gets the same keys, whichever kind it is.
package host

import (
	"math"

	"github.com/mcbridge/mcbridge/internal/llamapin"
	"github.com/mcbridge/mcbridge/internal/llamastate"
	"github.com/mcbridge/mcbridge/internal/status"
)

// LlamaVersion is the llama.cpp tag (internal/llamapin/PIN) whose state format
// this build reads and writes. Every fingerprint carries it.
var LlamaVersion = llamapin.Tag

// LayerFormat is one layer's K and V as llama.cpp lays them out. VElSize and
// NEmbdV are set only for transposed V, where the state format names them.
// A layer of a K-only cache (MLA: attention reads V out of K's latent, and
// llama.cpp allocates no V tensor) has VRow 0 and VType its K type: no V
// type is written anywhere, and what the host's V type is changes no byte,
// so every host names it so and their fingerprints agree.
type LayerFormat struct {
	KType   int32
	KRow    uint64 // bytes of one token's K row
	VType   int32
	VRow    uint64 // bytes of one token's V row (transposed: NEmbdV * VElSize)
	VElSize uint32
	NEmbdV  uint32
}

// Format is a KV cache's shape: what every state of one model agrees on.
type Format struct {
	VTrans bool
	Layers []LayerFormat
	// CellExt says that the cells of the model's states carry an extension
	// (M-RoPE and per-layer-embedding caches). Hosts that hand over tensors
	// keep their cells themselves and leave it unset; it is not part of the
	// fingerprint, as it changes no KV byte.
	CellExt bool
	// SecondLayers is how many of the trailing Layers are a second KV
	// cache's: a memory of two (a sliding-window model's window cache, after
	// its base cache) writes each cache's state after the other's. 0 for
	// one cache. A block carries every layer's rows.
	SecondLayers int
}

// KOnly reports whether the format's layers have no V (an MLA cache).
func (f *Format) KOnly() bool { return len(f.Layers) > 0 && f.Layers[0].VRow == 0 }

// Equal reports whether two formats describe the same rows.
func (f *Format) Equal(o *Format) bool {
	if f.VTrans != o.VTrans || f.CellExt != o.CellExt || f.SecondLayers != o.SecondLayers || len(f.Layers) != len(o.Layers) {
		return false
	}
	for i := range f.Layers {
		if f.Layers[i] != o.Layers[i] {
			return false
		}
	}
	return true
}

// FormatOf reads the format of a parsed state's one sequence and returns the
// index of the stream that holds it. In the state of two caches, the
// sequence is in that stream of each, and the layers are the first cache's
// then the second's.
func FormatOf(st *llamastate.State) (Format, int, error) {
	si, err := st.Sequence()
	if err != nil {
		return Format{}, 0, err
	}
	s := &st.Streams[si]
	layers := s.Layers
	f := Format{VTrans: s.VTrans, CellExt: st.CellExt}
	if st.Second != nil {
		s2 := &st.Second[si]
		if len(s2.Cells) == 0 || s2.VTrans != s.VTrans {
			return Format{}, 0, status.Errorf(status.Unsupported, "the second KV cache holds %d cells of the sequence, V transposed %v (the first %v)",
				len(s2.Cells), s2.VTrans, s.VTrans)
		}
		layers = append(layers[:len(layers):len(layers)], s2.Layers...)
		f.SecondLayers = len(s2.Layers)
	}
	f.Layers = make([]LayerFormat, len(layers))
	for l, ly := range layers {
		f.Layers[l] = LayerFormat{KType: ly.KType, KRow: ly.KRowSize, VType: ly.VType, VRow: ly.VRowSize}
		if st.KOnly {
			f.Layers[l].VType = ly.KType
			continue
		}
		if s.VTrans {
			f.Layers[l].VElSize, f.Layers[l].NEmbdV = ly.VElSize, ly.NEmbdV
		}
	}
	return f, si, nil
}

// ggmlType is what a row of a KV cache type weighs: blck elements in size
// bytes. Only the types llama.cpp accepts for -ctk/-ctv are listed.
type ggmlType struct{ blck, size int }

var ggmlTypes = map[int32]ggmlType{
	0: {1, 4}, 1: {1, 2}, 30: {1, 2}, // f32, f16, bf16
	2: {32, 18}, 3: {32, 20}, 6: {32, 22}, 7: {32, 24}, 8: {32, 34}, 20: {32, 18}, // q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl
}

// RowBytes is the size of a row of elements of a KV cache type, and whether
// the type is one llama.cpp accepts for the cache; a count that is not whole
// blocks of the type has size 0.
func RowBytes(typ int32, elements uint32) (uint64, bool) {
	t, ok := ggmlTypes[typ]
	if !ok {
		return 0, false
	}
	if elements%uint32(t.blck) != 0 {
		return 0, true
	}
	return uint64(elements/uint32(t.blck)) * uint64(t.size), true
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

// layerShape is what the bridge needs of one layer: row sizes, the widths
// that go into the fingerprint, and V's element size (to transpose).
type layerShape struct {
	kRow, vRow     int
	nEmbdK, nEmbdV uint32
	vElem          int
}

// shapes checks f and derives every layer's shape from it. Types must agree
// across layers: llama.cpp has one K and one V type per cache, and the
// caches of one memory share them. A layer without V (an MLA cache's, an
// indexer cache's beside an attention cache with V) has V rows of 0 bytes
// and its K type for V type.
func (f *Format) shapes() ([]layerShape, error) {
	if len(f.Layers) == 0 {
		return nil, status.Errorf(status.Unsupported, "KV format without layers")
	}
	out := make([]layerShape, len(f.Layers))
	k0, v0 := f.Layers[0].KType, -1
	for l, ly := range f.Layers {
		if ly.VRow > 0 && v0 < 0 {
			v0 = int(ly.VType)
		}
		if ly.KType != k0 || ly.VRow > 0 && int(ly.VType) != v0 {
			return nil, status.Errorf(status.Unsupported, "layer %d: K/V types %d/%d differ from earlier layers'", l, ly.KType, ly.VType)
		}
		if ly.VRow == 0 {
			if ly.VElSize != 0 || ly.NEmbdV != 0 || ly.VType != ly.KType {
				return nil, status.Errorf(status.Unsupported, "layer %d: no V rows, but V of type %d in %d columns", l, ly.VType, ly.NEmbdV)
			}
			if ly.KRow > math.MaxInt32 {
				return nil, status.Errorf(status.Unsupported, "layer %d: rows over 2 GiB", l)
			}
			s := layerShape{kRow: int(ly.KRow), nEmbdK: rowElements(ly.KType, ly.KRow), vElem: 1}
			if s.nEmbdK == 0 {
				return nil, status.Errorf(status.Unsupported, "layer %d: K row of %d bytes is not whole rows of type %d", l, ly.KRow, ly.KType)
			}
			out[l] = s
			continue
		}
		if ly.KRow > math.MaxInt32 || ly.VRow > math.MaxInt32 {
			return nil, status.Errorf(status.Unsupported, "layer %d: rows over 2 GiB", l)
		}
		s := layerShape{kRow: int(ly.KRow), vRow: int(ly.VRow), nEmbdK: rowElements(ly.KType, ly.KRow)}
		if s.nEmbdK == 0 {
			return nil, status.Errorf(status.Unsupported, "layer %d: K row of %d bytes is not whole rows of type %d", l, ly.KRow, ly.KType)
		}
		if f.VTrans {
			// Transposed V is one unquantized element per cell and column.
			t, ok := ggmlTypes[ly.VType]
			if !ok || t.blck != 1 || uint32(t.size) != ly.VElSize || uint64(ly.NEmbdV)*uint64(ly.VElSize) != ly.VRow {
				return nil, status.Errorf(status.Unsupported, "layer %d: transposed V of type %d: %d columns of %d-byte elements in %d-byte rows",
					l, ly.VType, ly.NEmbdV, ly.VElSize, ly.VRow)
			}
			s.nEmbdV, s.vElem = ly.NEmbdV, int(ly.VElSize)
		} else {
			s.nEmbdV, s.vElem = rowElements(ly.VType, ly.VRow), 1
			if t := ggmlTypes[ly.VType]; t.blck == 1 {
				s.vElem = t.size
			}
		}
		if s.nEmbdV == 0 {
			return nil, status.Errorf(status.Unsupported, "layer %d: V row of %d bytes is not whole rows of type %d", l, ly.VRow, ly.VType)
		}
		out[l] = s
	}
	return out, nil
}
