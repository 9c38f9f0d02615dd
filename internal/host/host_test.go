package host

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/gguf"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/llamastate"
	"github.com/mcbridge/mcbridge/internal/status"
)

func openBridge(t *testing.T) *bridge.Bridge {
	c := config.Default()
	c.PoolBytes = 16 << 20
	c.BlockTokens = 4
	c.Directory.Name = t.Name()
	b, err := bridge.Open(c, bridge.Deps{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Close() })
	return b
}

func tinyModel(t *testing.T) string {
	p := filepath.Join(t.TempDir(), "tiny.gguf")
	require.NoError(t, gguf.WriteFile(p, gguf.Presets["tiny"]))
	return p
}

// format describes a kvtest host's rows as f16 K and V, or f16 K alone for
// a host without V tensors.
func format(h *kvtest.Host) Format {
	f := Format{VTrans: h.VTrans}
	for l := range h.KRow {
		ly := LayerFormat{KType: 1, KRow: uint64(h.KRow[l]), VType: 1, VRow: uint64(h.VRow[l])}
		if h.VTrans && h.VRow[l] > 0 {
			ly.VElSize, ly.NEmbdV = 2, uint32(h.VRow[l]/2)
		}
		f.Layers = append(f.Layers, ly)
	}
	return f
}

// stateOf is a llama.cpp state blob of positions 0..n-1 at cells holding the
// host's rows, cells listed in cell order as llama.cpp writes them.
func stateOf(t *testing.T, h *kvtest.Host, cells []uint32) []byte {
	n := len(cells)
	f := format(h)
	st := &llamastate.State{Kind: llamastate.Memory, Streams: make([]llamastate.Stream, 1), KOnly: f.KOnly()}
	s := &st.Streams[0]
	s.VTrans = h.VTrans
	// The blob's cells are the host's cells in cell order; their rows are
	// the host's rows, so the blob's cell i is the host's i-th smallest cell.
	order := append([]uint32(nil), cells...)
	sortU32(order)
	posOf := map[uint32]int{}
	for p, c := range cells {
		posOf[c] = p
	}
	for _, c := range order {
		s.Cells = append(s.Cells, llamastate.Cell{Pos: int32(posOf[c]), SeqIDs: []int32{0}})
	}
	for l, ly := range f.Layers {
		k := make([]byte, 0, n*int(ly.KRow))
		for _, c := range order {
			k = append(k, h.K[l][int(c)*int(ly.KRow):int(c+1)*int(ly.KRow)]...)
		}
		var v []byte
		if !h.VTrans {
			for _, c := range order {
				v = append(v, h.V[l][int(c)*int(ly.VRow):int(c+1)*int(ly.VRow)]...)
			}
		} else {
			for d := 0; d < int(ly.NEmbdV); d++ {
				for _, c := range order {
					off := d*h.Cells*2 + int(c)*2
					v = append(v, h.V[l][off:off+2]...)
				}
			}
		}
		if st.KOnly {
			s.Layers = append(s.Layers, llamastate.Layer{KType: 1, KRowSize: ly.KRow, K: k})
			continue
		}
		s.Layers = append(s.Layers, llamastate.Layer{KType: 1, KRowSize: ly.KRow, K: k, VType: 1, VRowSize: ly.VRow,
			VElSize: ly.VElSize, NEmbdV: ly.NEmbdV, V: v})
	}
	b, err := st.Build()
	require.NoError(t, err)
	return b
}

func sortU32(s []uint32) {
	for i := 1; i < len(s); i++ {
		for j := i; j > 0 && s[j] < s[j-1]; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
}

// The probe's digest is the same whether a host hands over its tensors or
// a state blob of them, wherever the cells are and however many the cache
// has: a patched llama-server and a proxied stock one get one model. One
// byte of other KV gives another model.
func TestProbeDigestIsTheSameForTensorsAndStates(t *testing.T) {
	model := tinyModel(t)
	for _, tc := range []struct {
		vtrans bool
		vrow   int // 0: a K-only cache (MLA)
	}{{false, 48}, {true, 48}, {false, 0}, {true, 0}} {
		vtrans := tc.vtrans
		b := openBridge(t)
		a := kvtest.New(t, 3, 64, 32, tc.vrow, vtrans)
		c := kvtest.New(t, 3, 200, 32, tc.vrow, vtrans) // another cache size: another transposed-V stride
		probe := ProbeTokens()
		cellsA := kvtest.SeqCells(len(probe))
		cellsC := kvtest.ScatteredCells(rand.New(rand.NewSource(7)), len(probe), 200)
		a.Fill(probe, cellsA)
		c.Fill(probe, cellsC)
		id := Identity{LlamaVersion: LlamaVersion, GGUFPath: model, Format: format(a)}
		ma, err := Register(b, id, a.Layout(), cellsA)
		require.NoError(t, err)
		mc, err := Register(b, id, c.Layout(), cellsC)
		require.NoError(t, err)
		assert.Equal(t, ma.Fingerprint(), mc.Fingerprint(), "vtrans %v: cells and cache size change the model", vtrans)
		ms, nStream, err := RegisterState(b, Identity{GGUFPath: model}, stateOf(t, c, cellsC))
		require.NoError(t, err)
		assert.Equal(t, 1, nStream)
		assert.Equal(t, ma.Fingerprint(), ms.Fingerprint(), "vtrans %v: a state of the same KV is another model", vtrans)

		c.K[1][int(cellsC[5])*c.KRow[1]+3] ^= 1
		mx, err := Register(b, id, c.Layout(), cellsC)
		require.NoError(t, err)
		assert.NotEqual(t, ma.Fingerprint(), mx.Fingerprint(), "vtrans %v: one byte of other KV, the same model", vtrans)
		assert.Equal(t, tc.vrow == 0, ms.Format.KOnly(), "vtrans %v: the state's format has V rows of %d bytes", vtrans, tc.vrow)
	}
}

// A K-only cache (MLA) is another model than a cache of the same K with V,
// and a format with V in some layers only is refused.
func TestKOnlyFormat(t *testing.T) {
	model := tinyModel(t)
	b := openBridge(t)
	probe := ProbeTokens()
	cells := kvtest.SeqCells(len(probe))
	withV := kvtest.New(t, 2, 16, 32, 32, false)
	kOnly := kvtest.New(t, 2, 16, 32, 0, false)
	for _, h := range []*kvtest.Host{withV, kOnly} {
		h.Fill(probe, cells)
	}
	mv, err := Register(b, Identity{LlamaVersion: LlamaVersion, GGUFPath: model, Format: format(withV)}, withV.Layout(), cells)
	require.NoError(t, err)
	mk, err := Register(b, Identity{LlamaVersion: LlamaVersion, GGUFPath: model, Format: format(kOnly)}, kOnly.Layout(), cells)
	require.NoError(t, err)
	assert.NotEqual(t, mv.Fingerprint(), mk.Fingerprint(), "the same K with and without V")
	assert.True(t, mk.Format.KOnly())
	assert.Equal(t, mk.Format.Layers[0].KType, mk.Format.Layers[0].VType, "a K-only format's V type is its K type")

	// A layer without V after one with V: an indexer cache's beside an
	// attention cache (llama_memory_hybrid_idx). Its layout has no V tensor
	// there, and its V type is its K type.
	mixed := format(withV)
	mixed.Layers[1].VRow, mixed.Layers[1].VElSize, mixed.Layers[1].NEmbdV = 0, 0, 0
	mixed.Layers[1].VType = mixed.Layers[1].KType
	lo := withV.Layout()
	_, err = Register(b, Identity{LlamaVersion: LlamaVersion, GGUFPath: model, Format: mixed}, lo, cells)
	assert.Equal(t, status.Layout, status.Of(err), "a V tensor for a layer without V: %v", err)
	lo.Layers[1].V, lo.Layers[1].VStride = 0, 0
	mm, err := Register(b, Identity{LlamaVersion: LlamaVersion, GGUFPath: model, Format: mixed}, lo, cells)
	require.NoError(t, err)
	assert.NotEqual(t, mv.Fingerprint(), mm.Fingerprint(), "the same layers with V in one only")
	mixed.Layers[1].VType = mixed.Layers[1].KType + 1
	_, err = Register(b, Identity{LlamaVersion: LlamaVersion, GGUFPath: model, Format: mixed}, lo, cells)
	assert.Equal(t, status.Unsupported, status.Of(err), "a layer without V keyed by another V type: %v", err)
	// A state with V is another model's than a K-only one's.
	_, err = mk.SaveState(key0(), stateOf(t, withV, cells), probe)
	assert.Equal(t, status.ModelMismatch, status.Of(err), "a state with V saved as a K-only model's: %v", err)
}

func TestRegisterRefuses(t *testing.T) {
	model := tinyModel(t)
	b := openBridge(t)
	h := kvtest.New(t, 2, 16, 32, 32, false)
	probe := ProbeTokens()
	cells := kvtest.SeqCells(len(probe))
	h.Fill(probe, cells)
	good := Identity{LlamaVersion: LlamaVersion, GGUFPath: model, Format: format(h)}
	for _, tc := range []struct {
		name  string
		id    func(Identity) Identity
		cells []uint32
		code  status.Code
	}{
		{"another llama.cpp", func(id Identity) Identity { id.LlamaVersion = "b1"; return id }, cells, status.ModelMismatch},
		{"no model file", func(id Identity) Identity { id.GGUFPath = ""; return id }, cells, status.InvalidArg},
		{"not a GGUF", func(id Identity) Identity { id.GGUFPath = "/etc/hostname"; return id }, cells, status.InvalidArg},
		{"K row not whole f16", func(id Identity) Identity {
			id.Format.Layers = append([]LayerFormat(nil), id.Format.Layers...)
			id.Format.Layers[0].KRow = 33
			return id
		}, cells, status.Unsupported},
		{"types differ by layer", func(id Identity) Identity {
			id.Format.Layers = append([]LayerFormat(nil), id.Format.Layers...)
			id.Format.Layers[1].KType = 0
			return id
		}, cells, status.Unsupported},
		{"probe of 7 positions", func(id Identity) Identity { return id }, cells[:7], status.InvalidArg},
		{"probe cell outside the cache", func(id Identity) Identity { return id }, append(cells[:7:7], 99), status.Layout},
	} {
		_, err := Register(b, tc.id(good), h.Layout(), tc.cells)
		assert.Equal(t, tc.code, status.Of(err), "%s: %v", tc.name, err)
	}
	_, err := Register(b, good, h.Layout(), cells)
	require.NoError(t, err)
}

func TestRegisterStateRefusesOtherTokens(t *testing.T) {
	model := tinyModel(t)
	b := openBridge(t)
	h := kvtest.New(t, 2, 16, 32, 32, false)
	cells := kvtest.SeqCells(8)
	h.Fill(ProbeTokens(), cells)
	st, err := llamastate.Parse(stateOf(t, h, cells))
	require.NoError(t, err)
	st.Kind, st.Words = llamastate.SlotFile, ServerWords([]int32{9, 9, 9, 9, 9, 9, 9, 9})
	blob, err := st.Build()
	require.NoError(t, err)
	_, _, err = RegisterState(b, Identity{GGUFPath: model}, blob)
	assert.Equal(t, status.InvalidArg, status.Of(err), "%v", err)
	_, _, err = RegisterState(b, Identity{GGUFPath: model}, blob[:len(blob)/2])
	assert.Error(t, err, "a truncated state")
}

func TestScope(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte(content), 0o644))
		return p
	}
	a, aCopy, other := write("a.gguf", "adapter a"), write("copy-of-a.gguf", "adapter a"), write("b.gguf", "adapter b")
	scope := func(tenant string, ad ...Adapter) string {
		s, err := NewScope([]byte(tenant), ad)
		require.NoError(t, err)
		return s.ID().String()
	}
	base := scope("")
	assert.Equal(t, base, scope("", Adapter{a, 0}), "an adapter at scale 0 is no adapter")
	assert.NotEqual(t, base, scope("", Adapter{a, 1}), "an adapter changes the scope")
	assert.Equal(t, scope("", Adapter{a, 1}), scope("", Adapter{aCopy, 1}), "adapters are named by content, not path")
	assert.Equal(t, scope("", Adapter{a, 1}, Adapter{other, 0.5}), scope("", Adapter{other, 0.5}, Adapter{a, 1}), "order does not matter")
	assert.NotEqual(t, scope("", Adapter{a, 1}), scope("", Adapter{a, 0.5}), "the scale matters")
	assert.NotEqual(t, scope("", Adapter{a, 1}), scope("", Adapter{other, 1}), "another adapter")
	assert.NotEqual(t, base, scope("t1"), "a tenant")
	assert.NotEqual(t, scope("t1"), scope("t2"), "another tenant")
	_, err := NewScope(nil, []Adapter{{filepath.Join(dir, "missing.gguf"), 1}})
	assert.Equal(t, status.InvalidArg, status.Of(err), "a missing adapter file cannot be keyed")
	_, err = NewScope(nil, []Adapter{{a, float32(nan())}})
	assert.Equal(t, status.InvalidArg, status.Of(err), "a NaN scale")
}

func nan() float64 {
	zero := 0.0
	return zero / zero
}

// A state host's save and restore: blocks saved from one state come back,
// through another bridge, as a state whose rows are byte-identical by
// position, framed as asked; a partial load keeps the verified blocks.
// restoringBridges opens n bridges that share the in-process directory
// named name, with blocks of 4 tokens, and always restore.
func restoringBridges(t *testing.T, name string, n int) []*bridge.Bridge {
	c := config.Default()
	c.PoolBytes, c.BlockTokens, c.Directory.Name = 16<<20, 4, name
	c.Arbiter.Policy = "always-restore"
	bs := make([]*bridge.Bridge, n)
	for i := range bs {
		b, err := bridge.Open(c, bridge.Deps{})
		require.NoError(t, err)
		bs[i] = b
	}
	return bs
}

func TestStateRoundTrip(t *testing.T) {
	model := tinyModel(t)
	for _, tc := range []struct {
		vtrans bool
		vrow   int // 0: a K-only cache (MLA)
	}{{false, 48}, {true, 48}, {false, 0}, {true, 0}} {
		vtrans := tc.vtrans
		bs := restoringBridges(t, fmt.Sprintf("%s-%v-%d", t.Name(), vtrans, tc.vrow), 2)
		ba, bb := bs[0], bs[1]

		h := kvtest.New(t, 2, 32, 32, tc.vrow, vtrans)
		h.Fill(ProbeTokens(), kvtest.SeqCells(8))
		probe := stateOf(t, h, kvtest.SeqCells(8))
		ma, _, err := RegisterState(ba, Identity{GGUFPath: model}, probe)
		require.NoError(t, err)
		mb, nStream, err := RegisterState(bb, Identity{GGUFPath: model}, probe)
		require.NoError(t, err)

		tokens := kvtest.Tokens(rand.New(rand.NewSource(3)), 13)
		cells := kvtest.ScatteredCells(rand.New(rand.NewSource(4)), 13, 32)
		h.Fill(tokens, cells)
		blob := saveAndRestore(t, ma, mb, stateOf(t, h, cells), tokens, Frame{Kind: llamastate.SlotFile, NStream: nStream, SeqID: 1})
		// The blob is the caller's to free: the engine holds none of it.
		blobAddr := uintptr(unsafe.Pointer(unsafe.SliceData(blob)))
		require.NoError(t, bb.Transport().RegisterMemory(blobAddr, uint64(len(blob)), "cpu:0", false), "vtrans %v: the blob is still registered", vtrans)
		require.NoError(t, bb.Transport().UnregisterMemory(blobAddr))
		st, err := llamastate.Parse(blob)
		require.NoError(t, err)
		assert.Equal(t, tc.vrow == 0, st.KOnly, "vtrans %v: the restored state has V rows of %d bytes", vtrans, tc.vrow)
		words, err := st.PromptTokens()
		require.NoError(t, err)
		assert.Equal(t, tokens[:12], words, "the slot file names the restored tokens")
		got := stateRows(t, st)
		for p := 0; p < 12; p++ {
			assert.Equal(t, hostRows(h, int(cells[p])), got[p], "vtrans %v: position %d", vtrans, p)
		}
		require.NoError(t, ba.Close())
		require.NoError(t, bb.Close())
	}
}

// saveAndRestore saves state's three full blocks of 13 tokens through ma
// and restores them through mb once it sees them, framed as fr.
func saveAndRestore(t *testing.T, ma, mb *Model, state []byte, tokens []int32, fr Frame) []byte {
	saved, err := ma.SaveState(key0(), state, tokens)
	require.NoError(t, err)
	require.Equal(t, 3, saved.Queued)
	var plan *bridge.Plan
	require.Eventually(t, func() bool {
		plan, err = mb.Lookup(key0(), tokens, 0)
		return err == nil && plan.RestoreTokens == 12
	}, 10*time.Second, time.Millisecond, "b sees a's three blocks")
	blob, res, err := mb.RestoreState(plan, fr, func(n int) []byte { return make([]byte, n) })
	require.NoError(t, err)
	require.Equal(t, 12, res.OKTokens)
	return blob
}

func key0() key.Scope { return key.Scope{} }

// hostRows is the K and V of one cell, per layer, V by token.
func hostRows(h *kvtest.Host, c int) []byte {
	var out []byte
	for l := range h.K {
		out = append(out, h.K[l][c*h.KRow[l]:(c+1)*h.KRow[l]]...)
		if !h.VTrans {
			out = append(out, h.V[l][c*h.VRow[l]:(c+1)*h.VRow[l]]...)
			continue
		}
		for d := 0; d < h.VRow[l]/2; d++ {
			off := d*h.Cells*2 + c*2
			out = append(out, h.V[l][off:off+2]...)
		}
	}
	return out
}

// stateRows is each position's K and V in a parsed state, as hostRows.
func stateRows(t *testing.T, st *llamastate.State) map[int][]byte {
	si, err := st.Sequence()
	require.NoError(t, err)
	s := &st.Streams[si]
	out := map[int][]byte{}
	n := len(s.Cells)
	for i, c := range s.Cells {
		var rows []byte
		for _, ly := range s.Layers {
			kr, vr := int(ly.KRowSize), int(ly.VRowSize)
			rows = append(rows, ly.K[i*kr:(i+1)*kr]...)
			if !s.VTrans {
				rows = append(rows, ly.V[i*vr:(i+1)*vr]...)
				continue
			}
			el := int(ly.VElSize)
			for d := 0; d < int(ly.NEmbdV); d++ {
				rows = append(rows, ly.V[(d*n+i)*el:(d*n+i+1)*el]...)
			}
		}
		out[int(c.Pos)] = rows
	}
	return out
}

// withExts is a state blob whose cells carry the extensions ext gives their
// positions (an M-RoPE or per-layer-embedding cache's).
func withExts(t *testing.T, blob []byte, ext func(pos int32) llamastate.CellExt) []byte {
	st, err := llamastate.Parse(blob)
	require.NoError(t, err)
	st.CellExt = true
	for i := range st.Streams {
		for c := range st.Streams[i].Cells {
			st.Streams[i].Cells[c].Ext = ext(st.Streams[i].Cells[c].Pos)
		}
	}
	b, err := st.Build()
	require.NoError(t, err)
	return b
}

// States whose cells carry extensions: the probe's must be a text prompt's
// (M-RoPE's 2-D position the token's, or none), they get the fingerprint of
// the same KV without them, only the blocks of text cells are saved, and a
// restore writes the text prompt's extensions.
func TestStateCellExtensions(t *testing.T) {
	model := tinyModel(t)
	b := restoringBridges(t, t.Name(), 1)[0]
	defer b.Close()
	h := kvtest.New(t, 2, 32, 32, 48, false)
	probe := ProbeTokens()
	h.Fill(probe, kvtest.SeqCells(8))
	plainProbe := stateOf(t, h, kvtest.SeqCells(8))
	plain, _, err := RegisterState(b, Identity{GGUFPath: model}, plainProbe)
	require.NoError(t, err)

	tokens := kvtest.Tokens(rand.New(rand.NewSource(3)), 13)
	for _, pos2D := range []bool{true, false} {
		text := func(toks []int32) func(int32) llamastate.CellExt {
			return func(p int32) llamastate.CellExt {
				if pos2D {
					return llamastate.CellExt{X: p, Y: p, Tok: toks[p]}
				}
				return llamastate.CellExt{Tok: toks[p]}
			}
		}
		m, nStream, err := RegisterState(b, Identity{GGUFPath: model}, withExts(t, plainProbe, text(probe)))
		require.NoError(t, err, "pos2D %v", pos2D)
		assert.True(t, m.Format.CellExt)
		assert.Equal(t, plain.Fingerprint(), m.Fingerprint(), "pos2D %v: the extensions change no KV byte", pos2D)
		_, _, err = RegisterState(b, Identity{GGUFPath: model}, withExts(t, plainProbe, func(p int32) llamastate.CellExt {
			return llamastate.CellExt{X: p, Y: 2 * p, Tok: probe[p]}
		}))
		assert.Equal(t, status.Unsupported, status.Of(err), "pos2D %v: a probe of no text prompt's cells: %v", pos2D, err)

		cells := kvtest.ScatteredCells(rand.New(rand.NewSource(4)), 13, 32)
		h.Fill(tokens, cells)
		media := func(p int32) llamastate.CellExt {
			if p == 9 {
				return llamastate.CellExt{X: 3, Y: 4, Tok: -1} // an image's
			}
			return text(tokens)(p)
		}
		_, err = m.SaveState(key0(), stateOf(t, h, cells), tokens)
		assert.Equal(t, status.ModelMismatch, status.Of(err), "pos2D %v: a state without extensions: %v", pos2D, err)
		saved, err := m.SaveState(key0(), withExts(t, stateOf(t, h, cells), media), tokens)
		require.NoError(t, err)
		assert.Equal(t, 2, saved.Queued, "pos2D %v: the blocks before the image's cell", pos2D)

		var plan *bridge.Plan
		require.Eventually(t, func() bool {
			plan, err = m.Lookup(key0(), tokens, 0)
			return err == nil && plan.RestoreTokens == 8
		}, 10*time.Second, time.Millisecond)
		blob, res, err := m.RestoreState(plan, Frame{Kind: llamastate.SlotFile, NStream: nStream, SeqID: 1},
			func(n int) []byte { return make([]byte, n) })
		require.NoError(t, err)
		require.Equal(t, 8, res.OKTokens)
		st, err := llamastate.Parse(blob)
		require.NoError(t, err)
		require.True(t, st.CellExt)
		got := stateRows(t, st)
		for p, cell := range st.Streams[0].Cells {
			assert.Equal(t, text(tokens)(cell.Pos), cell.Ext, "pos2D %v: the cell at %d", pos2D, cell.Pos)
			assert.Equal(t, hostRows(h, int(cells[p])), got[p], "pos2D %v: position %d", pos2D, p)
		}
		// Another prompt for the next round.
		tokens = kvtest.Tokens(rand.New(rand.NewSource(5)), 13)
	}
}

// twoCaches is the state of a memory of two KV caches whose second cache
// holds the same rows as the first, from position from on (V by token).
func twoCaches(t *testing.T, blob []byte, from int) []byte {
	st, err := llamastate.Parse(blob)
	require.NoError(t, err)
	si, err := st.Sequence()
	require.NoError(t, err)
	// The slice holds position p in cell p.
	sl, err := st.Slice(len(st.Streams[si].Cells))
	require.NoError(t, err)
	second := sl.Streams[si]
	second.Cells = second.Cells[from:]
	second.Layers = slices.Clone(second.Layers)
	for l := range second.Layers {
		ly := &second.Layers[l]
		ly.K, ly.V = ly.K[uint64(from)*ly.KRowSize:], ly.V[uint64(from)*ly.VRowSize:]
	}
	st.Second = slices.Clone(st.Streams)
	st.Second[si] = second
	b, err := st.Build()
	require.NoError(t, err)
	return b
}

// A memory of two KV caches (an MLA cache and its indexer's) saves and
// restores every layer of both; a second cache that lost the blocks'
// first positions (a sliding window's) publishes nothing.
func TestStateRoundTripTwoCaches(t *testing.T) {
	model := tinyModel(t)
	bs := restoringBridges(t, t.Name(), 2)
	ba, bb := bs[0], bs[1]
	defer ba.Close()
	defer bb.Close()

	h := kvtest.New(t, 2, 32, 32, 48, false)
	h.Fill(ProbeTokens(), kvtest.SeqCells(8))
	probe := twoCaches(t, stateOf(t, h, kvtest.SeqCells(8)), 0)
	ma, _, err := RegisterState(ba, Identity{GGUFPath: model}, probe)
	require.NoError(t, err)
	require.Equal(t, 2, ma.Format.SecondLayers)
	mb, nStream, err := RegisterState(bb, Identity{GGUFPath: model}, probe)
	require.NoError(t, err)

	tokens := kvtest.Tokens(rand.New(rand.NewSource(3)), 13)
	cells := kvtest.SeqCells(13)
	h.Fill(tokens, cells)
	_, err = ma.SaveState(key0(), twoCaches(t, stateOf(t, h, cells), 5), tokens)
	require.ErrorIs(t, err, ErrSecondCacheLacks)
	_, err = ma.SaveState(key0(), stateOf(t, h, cells), tokens)
	require.Error(t, err, "a state of one cache for a model of two")
	blob := saveAndRestore(t, ma, mb, twoCaches(t, stateOf(t, h, cells), 0), tokens, Frame{Kind: llamastate.Memory, NStream: nStream, SeqID: 1})
	st, err := llamastate.ParseTwoCaches(blob)
	require.NoError(t, err)
	merged, err := st.Merge(12)
	require.NoError(t, err)
	got := stateRows(t, merged)
	for p := 0; p < 12; p++ {
		want := hostRows(h, int(cells[p]))
		assert.Equal(t, append(want, want...), got[p], "position %d", p)
	}
}

// headerOnlyGGUF writes a GGUF of metadata alone: the architecture and, when
// window is not 0, its attention window.
func headerOnlyGGUF(t *testing.T, arch string, window uint32) string {
	le := binary.LittleEndian
	str := func(b []byte, s string) []byte { return append(le.AppendUint64(b, uint64(len(s))), s...) }
	n := uint64(1)
	if window > 0 {
		n++
	}
	b := le.AppendUint32(nil, 0x46554747) // "GGUF"
	b = le.AppendUint32(b, 3)
	b = le.AppendUint64(b, 0) // tensors
	b = le.AppendUint64(b, n)
	b = le.AppendUint32(str(b, "general.architecture"), 8) // string
	b = str(b, arch)
	if window > 0 {
		b = le.AppendUint32(str(b, arch+".attention.sliding_window"), 4) // uint32
		b = le.AppendUint32(b, window)
	}
	p := filepath.Join(t.TempDir(), arch+".gguf")
	require.NoError(t, os.WriteFile(p, b, 0o644))
	return p
}

// A state host refuses the states of memories that are not KV caches alone,
// saying which: hybrid and recurrent memories by the pinned release's list
// of architectures, sliding-window ones by the window the file names. A
// state that reads as one KV cache is taken whatever the file names (EXAONE
// 4 names a window and runs one plain cache).
func TestRegisterStateRefusesOtherMemories(t *testing.T) {
	b := openBridge(t)
	h := kvtest.New(t, 2, 16, 32, 32, false)
	cells := kvtest.SeqCells(8)
	h.Fill(ProbeTokens(), cells)
	plain := stateOf(t, h, cells)
	// What follows a hybrid's KV cache section: its recurrent state's.
	tail := append(slices.Clone(plain), 1, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0)
	for _, c := range []struct {
		arch   string
		window uint32
		says   string
	}{
		{"qwen35", 0, "a hybrid memory (qwen35)"},
		{"deepseek4", 128, "a memory of compressed caches (deepseek4)"},
		{"mamba2", 0, "a recurrent memory (mamba2)"},
		{"gemma3", 512, "a sliding-window memory (window 512)"},
	} {
		_, _, err := RegisterState(b, Identity{GGUFPath: headerOnlyGGUF(t, c.arch, c.window)}, tail)
		assert.Equal(t, status.Unsupported, status.Of(err), "%s: %v", c.arch, err)
		assert.ErrorContains(t, err, c.says)
	}
	m, _, err := RegisterState(b, Identity{GGUFPath: headerOnlyGGUF(t, "exaone4", 128)}, plain)
	require.NoError(t, err, "one KV cache's state")
	assert.Zero(t, m.Format.SecondLayers)
	_, _, err = RegisterState(b, Identity{GGUFPath: headerOnlyGGUF(t, "llama", 0)}, tail)
	assert.Equal(t, status.InvalidArg, status.Of(err), "bytes after the state of a model of one KV cache: %v", err)
}

// snapshotBridges opens two bridges sharing an in-process directory, with
// blocks of 4 tokens and a snapshot after every block.
func snapshotBridges(t *testing.T) (*bridge.Bridge, *bridge.Bridge) {
	c := config.Default()
	c.PoolBytes, c.BlockTokens, c.SnapshotBlocks, c.Directory.Name = 16<<20, 4, 1, t.Name()
	c.Arbiter.Policy = "always-restore"
	var out [2]*bridge.Bridge
	for i := range out {
		b, err := bridge.Open(c, bridge.Deps{})
		require.NoError(t, err)
		t.Cleanup(func() { _ = b.Close() })
		out[i] = b
	}
	return out[0], out[1]
}

// planOf waits until mb's lookup of tokens restores n of them.
func planOf(t *testing.T, mb *Model, tokens []int32, n int) *bridge.Plan {
	var plan *bridge.Plan
	var err error
	require.Eventually(t, func() bool {
		plan, err = mb.Lookup(key0(), tokens, 0)
		return err == nil && plan.RestoreTokens == n
	}, 10*time.Second, time.Millisecond, "a lookup that restores %d tokens", n)
	return plan
}

// A state host with snapshots (the proxy) serves a sliding-window memory:
// its states' attention cache goes into blocks, the window cache's state at
// a boundary into a snapshot, and a restore ends at the last snapshot with
// the window cache framed for llama-server's check (one more cell, at
// position 0, of zero rows).
func TestStateSnapshotsOfAWindow(t *testing.T) {
	ba, bb := snapshotBridges(t)
	model := headerOnlyGGUF(t, "gemma3", 4)
	h := kvtest.New(t, 2, 32, 32, 48, false)
	h.Fill(ProbeTokens(), kvtest.SeqCells(8))
	probe := twoCaches(t, stateOf(t, h, kvtest.SeqCells(8)), 4)
	ma, _, err := RegisterState(ba, Identity{GGUFPath: model, StateSnapshots: true}, probe)
	require.NoError(t, err)
	assert.Zero(t, ma.Format.SecondLayers, "the blocks hold the base cache's layers")
	assert.Equal(t, 4, ma.SnapshotTokens(), "a model with a partial state, snapshotted after every block")
	assert.Equal(t, 4, ma.SnapshotsRestoreAfter(), "the window")
	_, _, named, _, err := partialProbe(memory{arch: "gemma3", window: 4}, probe)
	require.NoError(t, err)
	assert.Equal(t, "state window 4 layers 2 K 1 V 1 K 1 V 1", named, "the partial state's name in the fingerprint")
	mb, nStream := registerAgain(t, bb, ma, model, probe)

	tokens, cells := fill(h, 3, 13)
	at8 := twoCaches(t, stateOf(t, h, cells[:8]), 4)
	require.Error(t, ma.SaveStateSnapshot(key0(), at8, tokens[:4]), "a state of 8 positions for 4 tokens")
	require.Error(t, ma.SaveStateSnapshot(key0(), stateOf(t, h, cells[:8]), tokens[:8]), "a state without its window cache")
	require.NoError(t, ma.SaveStateSnapshot(key0(), at8, tokens[:8]))
	assert.Equal(t, []int{12}, ma.MissingSnapshots(key0(), tokens, 0, 0), "the prompt's last boundary")
	assert.Equal(t, []int{4, 12}, ma.MissingSnapshots(key0(), tokens, 0, 4), "and a branch")
	assert.Equal(t, []int{12}, ma.MissingSnapshots(key0(), tokens, 8, 4))
	blob := restoreEight(t, ma, mb, nStream, tokens, twoCaches(t, stateOf(t, h, cells), 9))
	base, n, err := llamastate.ParseLeading(blob)
	require.NoError(t, err)
	checkRows(t, h, cells, "base", stateRows(t, base), 0)
	checkWindow(t, h, cells, nStream, blob[len(blob)-n:])

	// A window that holds position 0 passes no llama-server check: no
	// restore.
	require.NoError(t, ma.SaveStateSnapshot(key0(), twoCaches(t, stateOf(t, h, cells[:4]), 0), tokens[:4]))
	plan := planOf(t, mb, tokens[:5], 4)
	_, res, err := mb.RestoreState(plan, Frame{Kind: llamastate.Memory, NStream: nStream, SeqID: 1}, func(n int) []byte { return make([]byte, n) })
	assert.Equal(t, status.Unsupported, status.Of(err), "%v", err)
	assert.ErrorIs(t, err, llamastate.ErrLeadHeld)
	assert.Zero(t, res.OKTokens)
}

// A sliding-window memory with an indexer cache (dots3,
// llama_kv_cache_dsa_iswa) writes its full-attention cache's state, its
// indexer's (every position too), then its window cache's: blocks carry
// both full caches' layers, and a restore frames both before the window
// snapshot.
func TestStateSnapshotsOfAWindowWithAnIndexer(t *testing.T) {
	ba, bb := snapshotBridges(t)
	model := headerOnlyGGUF(t, "dots3note", 4)
	h := kvtest.New(t, 2, 32, 32, 48, false)
	// The full caches' state and the window cache's, of the same host rows.
	state := func(cells []uint32, from int) []byte {
		full := twoCaches(t, stateOf(t, h, cells), 0)
		withWindow := twoCaches(t, stateOf(t, h, cells), from)
		_, n, err := llamastate.ParseLeading(withWindow)
		require.NoError(t, err)
		return append(full, withWindow[len(withWindow)-n:]...)
	}
	h.Fill(ProbeTokens(), kvtest.SeqCells(8))
	probe := state(kvtest.SeqCells(8), 4)
	ma, _, err := RegisterState(ba, Identity{GGUFPath: model, StateSnapshots: true}, probe)
	require.NoError(t, err)
	assert.Equal(t, 2, ma.Format.SecondLayers, "the blocks hold the indexer cache's layers after the first cache's")
	assert.Equal(t, 4, ma.SnapshotsRestoreAfter(), "the window")
	mb, nStream := registerAgain(t, bb, ma, model, probe)

	tokens, cells := fill(h, 4, 13)
	require.NoError(t, ma.SaveStateSnapshot(key0(), state(cells[:8], 4), tokens[:8]))
	blob := restoreEight(t, ma, mb, nStream, tokens, state(cells, 9))
	base, n, err := llamastate.ParseLeading(blob)
	require.NoError(t, err)
	checkRows(t, h, cells, "full-attention", stateRows(t, base), 0)
	indexer, n, err := llamastate.ParseCacheLeading(blob[len(blob)-n:], false, false)
	require.NoError(t, err)
	checkRows(t, h, cells, "indexer", stateRows(t, &llamastate.State{Streams: indexer}), 0)
	checkWindow(t, h, cells, nStream, blob[len(blob)-n:])
}

// registerAgain registers the model of ma on b from the same probe, which
// must give the same fingerprint, and returns the probe's stream count.
func registerAgain(t *testing.T, b *bridge.Bridge, ma *Model, model string, probe []byte) (*Model, int) {
	t.Helper()
	mb, nStream, err := RegisterState(b, Identity{GGUFPath: model, StateSnapshots: true}, probe)
	require.NoError(t, err)
	require.Equal(t, ma.Fingerprint(), mb.Fingerprint())
	return mb, nStream
}

// fill fills n random tokens (of seed) into h's cells 0..n-1.
func fill(h *kvtest.Host, seed int64, n int) ([]int32, []uint32) {
	tokens, cells := kvtest.Tokens(rand.New(rand.NewSource(seed)), n), kvtest.SeqCells(n)
	h.Fill(tokens, cells)
	return tokens, cells
}

// restoreEight saves full, the state of every one of tokens, through ma, and
// restores the first 8 of them, whose snapshot ma holds, through mb.
func restoreEight(t *testing.T, ma, mb *Model, nStream int, tokens []int32, full []byte) []byte {
	t.Helper()
	saved, err := ma.SaveState(key0(), full, tokens)
	require.NoError(t, err)
	require.Equal(t, 3, saved.Queued)
	plan := planOf(t, mb, tokens, 8)
	blob, res, err := mb.RestoreState(plan, Frame{Kind: llamastate.Memory, NStream: nStream, SeqID: 1}, func(n int) []byte { return make([]byte, n) })
	require.NoError(t, err)
	require.Equal(t, 8, res.OKTokens)
	return blob
}

// checkRows checks that a cache's rows by position (stateRows) are h's at
// cells for positions [from, 8) and nothing else.
func checkRows(t *testing.T, h *kvtest.Host, cells []uint32, name string, got map[int][]byte, from int) {
	t.Helper()
	require.Len(t, got, 8-from, name)
	for p := from; p < 8; p++ {
		assert.Equal(t, hostRows(h, int(cells[p])), got[p], "%s cache, position %d", name, p)
	}
}

// checkWindow checks a restored window cache's state after 8 tokens, a
// window of 4: framed for nStream streams, the window's rows and the lead.
func checkWindow(t *testing.T, h *kvtest.Host, cells []uint32, nStream int, b []byte) {
	t.Helper()
	win, err := llamastate.ParseCache(b, false, false)
	require.NoError(t, err)
	require.Len(t, win, nStream)
	wrows := stateRows(t, &llamastate.State{Streams: win})
	require.Len(t, wrows, 5, "the window's positions 4..7 and the lead")
	assert.Equal(t, make([]byte, len(wrows[0])), wrows[0], "the lead's rows are zero")
	delete(wrows, 0)
	checkRows(t, h, cells, "window", wrows, 4)
}

// A hybrid memory's recurrent state travels as it is: a restore is the
// attention cache's blocks and the snapshot's bytes after them.
func TestStateSnapshotsOfARecurrentState(t *testing.T) {
	ba, bb := snapshotBridges(t)
	model := headerOnlyGGUF(t, "qwen35", 0)
	h := kvtest.New(t, 2, 32, 32, 48, true)
	h.Fill(ProbeTokens(), kvtest.SeqCells(8))
	recurrent := func(b byte) []byte { return bytes.Repeat([]byte{b}, 24) }
	probe := append(stateOf(t, h, kvtest.SeqCells(8)), recurrent(1)...)
	_, _, err := RegisterState(ba, Identity{GGUFPath: model}, probe)
	assert.Equal(t, status.Unsupported, status.Of(err), "a host without snapshots: %v", err)
	ma, _, err := RegisterState(ba, Identity{GGUFPath: model, StateSnapshots: true}, probe)
	require.NoError(t, err)
	assert.Equal(t, 4, ma.SnapshotTokens(), "a model with a partial state, snapshotted after every block")
	_, _, named, _, err := partialProbe(memory{arch: "qwen35"}, probe)
	require.NoError(t, err)
	assert.Equal(t, "state recurrent qwen35 bytes 24", named, "the partial state's name in the fingerprint")
	mb, nStream, err := RegisterState(bb, Identity{GGUFPath: model, StateSnapshots: true}, probe)
	require.NoError(t, err)
	_, _, err = RegisterState(ba, Identity{GGUFPath: headerOnlyGGUF(t, "lfm2", 16), StateSnapshots: true}, probe)
	assert.Equal(t, status.Unsupported, status.Of(err), "lfm2: %v", err)
	assert.ErrorContains(t, err, "a sliding window", "lfm2")

	tokens := kvtest.Tokens(rand.New(rand.NewSource(5)), 13)
	cells := kvtest.ScatteredCells(rand.New(rand.NewSource(6)), 13, 32)
	h.Fill(tokens, cells)
	require.NoError(t, ma.SaveStateSnapshot(key0(), append(stateOf(t, h, cells[:8]), recurrent(8)...), tokens[:8]))
	_, err = ma.SaveState(key0(), append(stateOf(t, h, cells), recurrent(13)...), tokens)
	require.NoError(t, err)

	plan := planOf(t, mb, tokens, 8)
	blob, res, err := mb.RestoreState(plan, Frame{Kind: llamastate.SlotFile, NStream: nStream, SeqID: 0}, func(n int) []byte { return make([]byte, n) })
	require.NoError(t, err)
	require.Equal(t, 8, res.OKTokens)
	base, n, err := llamastate.ParseLeading(blob)
	require.NoError(t, err)
	assert.Equal(t, recurrent(8), blob[len(blob)-n:], "the snapshot after 8 tokens, as it was saved")
	words, err := base.PromptTokens()
	require.NoError(t, err)
	assert.Equal(t, tokens[:8], words)
	got := stateRows(t, base)
	for p := 0; p < 8; p++ {
		assert.Equal(t, hostRows(h, int(cells[p])), got[p], "position %d", p)
	}
}

// A hybrid memory with an indexer cache (qwen4exp, llama_memory_hybrid_idx)
// writes its attention cache's state, its recurrent state, then its
// indexer's (K only): the blocks carry the attention cache, a snapshot the
// recurrent state and the indexer's rows of every position before it, in
// position order whatever cells held them, and a restore frames those for
// the asking host's streams after the blocks' state.
func TestStateSnapshotsOfAHybridWithAnIndexer(t *testing.T) {
	ba, bb := snapshotBridges(t)
	model := headerOnlyGGUF(t, "qwen4exp", 0)
	h := kvtest.New(t, 2, 32, 32, 48, true)
	le := binary.LittleEndian
	recurrent := func(n int) []byte {
		rec := le.AppendUint32(le.AppendUint32(le.AppendUint32(nil, 1), uint32(n-1)), 0)
		return append(rec, bytes.Repeat([]byte{byte(n)}, 24)...)
	}
	idxRow := func(p int) []byte { return bytes.Repeat([]byte{byte(0x80 + p)}, 16) }
	// The indexer's state of positions [0, n), its cells listed from the
	// last position to the first.
	indexer := func(n int) []byte {
		s := llamastate.Stream{Layers: []llamastate.Layer{{KType: 1, KRowSize: 16}}}
		for i := range n {
			p := n - 1 - i
			s.Cells = append(s.Cells, llamastate.Cell{Pos: int32(p), SeqIDs: []int32{0}})
			s.Layers[0].K = append(s.Layers[0].K, idxRow(p)...)
		}
		b, err := (&llamastate.State{Kind: llamastate.Memory, Streams: []llamastate.Stream{s}, KOnly: true}).Build()
		require.NoError(t, err)
		return b[8:] // after the magic and the sequence id
	}
	state := func(cells []uint32) []byte {
		return slices.Concat(stateOf(t, h, cells), recurrent(len(cells)), indexer(len(cells)))
	}
	h.Fill(ProbeTokens(), kvtest.SeqCells(8))
	probe := state(kvtest.SeqCells(8))
	ma, _, err := RegisterState(ba, Identity{GGUFPath: model, StateSnapshots: true}, probe)
	require.NoError(t, err)
	assert.Equal(t, 2, len(ma.Format.Layers), "the blocks hold the attention cache alone")
	_, _, named, _, err := partialProbe(memory{arch: "qwen4exp"}, probe)
	require.NoError(t, err)
	assert.Equal(t, "state recurrent qwen4exp bytes 36 indexer layers 1 K 1 row 16", named)
	mb, _ := registerAgain(t, bb, ma, model, probe)

	tokens, cells := kvtest.Tokens(rand.New(rand.NewSource(7)), 13), kvtest.ScatteredCells(rand.New(rand.NewSource(8)), 13, 32)
	h.Fill(tokens, cells)
	lacking := slices.Concat(stateOf(t, h, cells[:8]), recurrent(8), indexer(7))
	assert.Error(t, ma.SaveStateSnapshot(key0(), lacking, tokens[:8]), "an indexer state lacking a position")
	require.NoError(t, ma.SaveStateSnapshot(key0(), state(cells[:8]), tokens[:8]))
	_, err = ma.SaveState(key0(), state(cells), tokens)
	require.NoError(t, err)

	plan := planOf(t, mb, tokens, 8)
	blob, res, err := mb.RestoreState(plan, Frame{Kind: llamastate.Memory, NStream: 2, SeqID: 1}, func(n int) []byte { return make([]byte, n) })
	require.NoError(t, err)
	require.Equal(t, 8, res.OKTokens)
	base, n, err := llamastate.ParseLeading(blob)
	require.NoError(t, err)
	got := stateRows(t, base)
	for p := range 8 {
		assert.Equal(t, hostRows(h, int(cells[p])), got[p], "attention cache, position %d", p)
	}
	tail := blob[len(blob)-n:]
	require.Greater(t, len(tail), 36)
	assert.Equal(t, recurrent(8), tail[:36], "the recurrent state after 8 tokens")
	idx, err := llamastate.ParseCache(tail[36:], false, true)
	require.NoError(t, err)
	require.Len(t, idx, 2, "framed for the asking context's streams")
	require.Len(t, idx[0].Cells, 8)
	for c, cell := range idx[0].Cells {
		assert.Equal(t, int32(c), cell.Pos, "the indexer's cell %d", c)
		assert.Equal(t, idxRow(c), idx[0].Layers[0].K[16*c:16*(c+1)], "the indexer's row of position %d", c)
	}
	assert.Empty(t, idx[1].Cells)
}

// recurrentSlot is a slot file of a memory that is one recurrent state
// after tokens: the state's cell at the last position, then bytes standing
// for its tensors, which depend on the tokens.
func recurrentSlot(t *testing.T, tokens []int32) []byte {
	t.Helper()
	le := binary.LittleEndian
	rec := le.AppendUint32(le.AppendUint32(le.AppendUint32(nil, 1), uint32(len(tokens)-1)), 0)
	for i := range 40 {
		rec = append(rec, byte(int(tokens[len(tokens)-1])+len(tokens)+i))
	}
	st := &llamastate.State{Kind: llamastate.SlotFile, Words: ServerWords(tokens)}
	out, err := st.AppendRecurrent(nil, rec)
	require.NoError(t, err)
	return out
}

// wholeStateSlot is a slot file of DeepSeek V4's memory after tokens: bytes
// standing for its caches' states, which only llama.cpp reads.
func wholeStateSlot(t *testing.T, tokens []int32) []byte {
	t.Helper()
	mem := binary.LittleEndian.AppendUint32(nil, 0x34565344)
	for i := range 40 {
		mem = append(mem, byte(int(tokens[len(tokens)-1])+len(tokens)+3*i))
	}
	st := &llamastate.State{Kind: llamastate.SlotFile, Words: ServerWords(tokens)}
	out, err := st.AppendFramed(nil, mem)
	require.NoError(t, err)
	return out
}

// A memory that is one recurrent state (Mamba), and one whose state this
// package reads no part of (DeepSeek V4's), register as models without KV
// layers, keyed by their probe's state: their snapshots are their whole
// state, and a restore is the last one on the prompt, framed as the asking
// host reads it.
func TestStateSnapshotsOfMemoriesWithoutKV(t *testing.T) {
	for _, c := range []struct {
		arch string
		slot func(t *testing.T, tokens []int32) []byte
	}{{"mamba2", recurrentSlot}, {"deepseek4", wholeStateSlot}} {
		t.Run(c.arch, func(t *testing.T) { snapshotsWithoutKV(t, c.arch, c.slot) })
	}
}

func snapshotsWithoutKV(t *testing.T, arch string, slot func(t *testing.T, tokens []int32) []byte) {
	ba, bb := snapshotBridges(t)
	model := headerOnlyGGUF(t, arch, 0)
	probe := slot(t, ProbeTokens())
	_, _, err := RegisterState(ba, Identity{GGUFPath: model}, probe)
	assert.Equal(t, status.Unsupported, status.Of(err), "a host without snapshots: %v", err)
	_, _, err = RegisterState(ba, Identity{GGUFPath: model, StateSnapshots: true}, slot(t, ProbeTokens()[:7]))
	assert.Equal(t, status.InvalidArg, status.Of(err), "a probe state of other tokens: %v", err)
	ma, _, err := RegisterState(ba, Identity{GGUFPath: model, StateSnapshots: true}, probe)
	require.NoError(t, err)
	assert.True(t, ma.SnapshotOnly())
	assert.Equal(t, 4, ma.SnapshotTokens())
	assert.Zero(t, ma.SnapshotsRestoreAfter())
	mb, nStream, err := RegisterState(bb, Identity{GGUFPath: model, StateSnapshots: true}, probe)
	require.NoError(t, err)
	require.Equal(t, ma.Fingerprint(), mb.Fingerprint())
	other := append(bytes.Clone(probe[:len(probe)-1]), probe[len(probe)-1]^1)
	mc, _, err := RegisterState(bb, Identity{GGUFPath: model, StateSnapshots: true}, other)
	require.NoError(t, err)
	assert.NotEqual(t, ma.Fingerprint(), mc.Fingerprint(), "other numerics are another model")

	tokens := kvtest.Tokens(rand.New(rand.NewSource(5)), 13)
	require.Error(t, ma.SaveStateSnapshot(key0(), slot(t, tokens[:8]), tokens[:4]), "a state at 8 for a snapshot at 4")
	require.Error(t, ma.SaveStateSnapshot(key0(), slot(t, tokens[1:9]), tokens[:8]), "a file of other tokens")
	require.NoError(t, ma.SaveStateSnapshot(key0(), slot(t, tokens[:8]), tokens[:8]))
	assert.Equal(t, []int{4, 12}, ma.MissingSnapshots(key0(), tokens, 0, 0), "no blocks show a branch: every boundary")
	_, err = ma.SaveState(key0(), slot(t, tokens), tokens)
	assert.Equal(t, status.Unsupported, status.Of(err), "blocks of a memory without KV: %v", err)
	st, err := ma.ParseState(slot(t, tokens))
	require.NoError(t, err)
	words, err := st.PromptTokens()
	require.NoError(t, err)
	assert.Equal(t, tokens, words)

	plan := planOf(t, mb, tokens, 8)
	blob, res, err := mb.RestoreState(plan, Frame{Kind: llamastate.SlotFile, NStream: nStream}, func(n int) []byte { return make([]byte, n) })
	require.NoError(t, err)
	require.Equal(t, 8, res.OKTokens)
	assert.Equal(t, slot(t, tokens[:8]), blob, "the slot file llama-server wrote after 8 tokens")
	blob, res, err = mb.RestoreState(plan, Frame{Kind: llamastate.Memory, NStream: nStream, SeqID: 2}, func(n int) []byte { return make([]byte, n) })
	require.NoError(t, err)
	require.Equal(t, 8, res.OKTokens)
	got, mem, err := llamastate.ParseFramed(blob)
	require.NoError(t, err)
	assert.Equal(t, int32(2), got.SeqID)
	assert.Equal(t, slot(t, tokens[:8])[12+4*len(ServerWords(tokens[:8])):], mem)
}

// A tensor host's window cache snapshot comes back framed for the asking
// context's KV streams, whatever the count of the context that took it:
// llama.cpp refuses a state of another count, and the count is no part of
// the fingerprint (servers of any slot count share a model).
func TestWindowSnapshotForTheContextsStreams(t *testing.T) {
	ba, bb := snapshotBridges(t)
	model := headerOnlyGGUF(t, "gemma3", 4)
	src := kvtest.New(t, 2, 32, 32, 48, false)
	dst := kvtest.New(t, 2, 32, 32, 48, false)
	src.Fill(ProbeTokens(), kvtest.SeqCells(8))
	id := func(streams int) Identity {
		return Identity{LlamaVersion: LlamaVersion, GGUFPath: model, Format: format(src),
			Partial: "iswa window 4 type 1 layers 01 K f16 V f16", PartialKVStreams: streams}
	}
	ma, err := Register(ba, id(1), src.Layout(), kvtest.SeqCells(8))
	require.NoError(t, err)
	mb, err := Register(bb, id(3), src.Layout(), kvtest.SeqCells(8))
	require.NoError(t, err)
	require.Equal(t, ma.Fingerprint(), mb.Fingerprint(), "the stream count is no part of the model")

	tokens := kvtest.Tokens(rand.New(rand.NewSource(9)), 9)
	cells := kvtest.SeqCells(len(tokens))
	src.Fill(tokens, cells)
	at8 := twoCaches(t, stateOf(t, src, cells[:8]), 4)
	_, n, err := llamastate.ParseLeading(at8)
	require.NoError(t, err)
	window := at8[len(at8)-n:]
	// As llama_state_seq_get_data writes a window cache's state: the magic,
	// the sequence id, the cache.
	partial := append(binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint32(nil, llamastate.SeqMagic), 0), window...)
	require.NoError(t, ma.SaveSnapshot(key0(), tokens[:8], partial))
	sv, err := ma.SaveBegin(key0(), src.Layout(), tokens, cells)
	require.NoError(t, err)
	for l := range src.K {
		require.NoError(t, sv.SaveLayer(l))
	}
	_, err = sv.End()
	require.NoError(t, err)

	plan := planOf(t, mb, tokens, 8)
	ld, err := plan.Load(dst.Layout(), kvtest.SeqCells(8))
	require.NoError(t, err)
	for l := range dst.K {
		_, err := ld.WaitLayer(l)
		require.NoError(t, err)
	}
	snap, err := mb.Snapshot(ld)
	require.NoError(t, err)
	require.Equal(t, partial[:8], snap[:8], "the state's magic and sequence id")
	got, err := llamastate.ParseCache(snap[8:], false, false)
	require.NoError(t, err)
	require.Len(t, got, 3, "framed for the asker's three streams")
	want, err := llamastate.ParseCache(window, false, false)
	require.NoError(t, err)
	require.Len(t, want, 1)
	wrows, grows := stateRows(t, &llamastate.State{Streams: want}), stateRows(t, &llamastate.State{Streams: got})
	assert.Equal(t, wrows, grows, "the window's positions 4..7, as taken")
	res, err := ld.End()
	require.NoError(t, err)
	assert.Equal(t, 8, res.OKTokens)
}
