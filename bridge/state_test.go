package main

import (
	"bytes"
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/host"
	"github.com/mcbridge/mcbridge/internal/llamastate"
	"github.com/mcbridge/mcbridge/internal/status"
)

// The states in internal/llamastate/testdata were written by llama.cpp
// v0.5.0 on the tiny preset (2 layers, K and V rows of 32 f16) over 24
// prompt tokens; whatever their positions 0..7 hold is what a host that
// registers from them calls its probe.
func realState(tb testing.TB, name string) []byte {
	tb.Helper()
	b, err := os.ReadFile(filepath.Join("..", "internal", "llamastate", "testdata", name))
	require.NoError(tb, err)
	return b
}

func parseState(tb testing.TB, b []byte) (*llamastate.State, *llamastate.Stream) {
	tb.Helper()
	st, err := llamastate.Parse(b)
	require.NoError(tb, err)
	si, err := st.Sequence()
	require.NoError(tb, err)
	return st, &st.Streams[si]
}

// stateFormat is the shape of a real state: the states a test builds for
// the model registered from it have the same.
type stateFormat struct {
	vtrans          bool
	nStream, stream int
	layers          []llamastate.Layer // types and row sizes
}

func formatOf(tb testing.TB, blob []byte) stateFormat {
	tb.Helper()
	f, err := stateFormatOf(blob)
	require.NoError(tb, err)
	return f
}

func stateFormatOf(blob []byte) (stateFormat, error) {
	st, err := llamastate.Parse(blob)
	if err != nil {
		return stateFormat{}, err
	}
	si, err := st.Sequence()
	if err != nil {
		return stateFormat{}, err
	}
	s := &st.Streams[si]
	f := stateFormat{vtrans: s.VTrans, nStream: len(st.Streams), stream: si}
	for _, ly := range s.Layers {
		f.layers = append(f.layers, llamastate.Layer{KType: ly.KType, KRowSize: ly.KRowSize, VType: ly.VType, VRowSize: ly.VRowSize,
			VElSize: ly.VElSize, NEmbdV: ly.NEmbdV})
	}
	return f, nil
}

// model is the same shape as tensors, with the probe's block size.
func (sf stateFormat) model(block uint32) model {
	m := model{block: block, vtrans: sf.vtrans}
	for _, ly := range sf.layers {
		m.kEmbd = append(m.kEmbd, uint32(ly.KRowSize/elem))
		m.vEmbd = append(m.vEmbd, uint32(ly.VRowSize/elem))
	}
	return m
}

// build is the state a host's llama_state_seq_get_data gives for positions
// order[c] in cells c of its sequence, computed over tokens: every row
// holds value(), as tensors.compute writes it.
func (sf stateFormat) build(tb testing.TB, kind llamastate.Kind, seq int32, stream int, tokens []int32, order []int) []byte {
	tb.Helper()
	st := &llamastate.State{Kind: kind, SeqID: seq, Streams: make([]llamastate.Stream, sf.nStream)}
	if kind == llamastate.SlotFile {
		st.Words = host.ServerWords(tokens[:len(order)])
	}
	s := &st.Streams[stream]
	s.VTrans = sf.vtrans
	n := len(order)
	for _, p := range order {
		s.Cells = append(s.Cells, llamastate.Cell{Pos: int32(p), SeqIDs: []int32{seq}})
	}
	for l, f := range sf.layers {
		ly := f
		kRow, vRow := int(ly.KRowSize), int(ly.VRowSize)
		ly.K, ly.V = make([]byte, n*kRow), make([]byte, n*vRow)
		for c, p := range order {
			for i := 0; i < kRow; i++ {
				ly.K[c*kRow+i] = value(tokens[p], p, l, 0, i)
			}
			for i := 0; i < vRow; i++ {
				ly.V[vAt(sf.vtrans, int(ly.VElSize), n, vRow, c, i)] = value(tokens[p], p, l, 1, i)
			}
		}
		s.Layers = append(s.Layers, ly)
	}
	b, err := st.Build()
	require.NoError(tb, err)
	return b
}

// vAt is the offset of byte i of cell c's V row in a state's V data of n
// cells: row-major, or one column of elements per dimension.
func vAt(vtrans bool, el, n, vRow, c, i int) int {
	if !vtrans {
		return c*vRow + i
	}
	return (i/el*n+c)*el + i%el
}

// inOrder is cells 0..n-1 holding positions 0..n-1.
func inOrder(n int) []int {
	o := make([]int, n)
	for i := range o {
		o[i] = i
	}
	return o
}

// scattered is n positions in cells that wrap around, as a context that
// held other sequences leaves them.
func scattered(n int) []int {
	o := make([]int, n)
	for c := range o {
		o[c] = (c + n - 5%n) % n
	}
	return o
}

// stateParams is a model's names for a host that registers from states:
// blocks of four tokens.
func (f *fixture) stateParams(t testing.TB) *cModelParams {
	p := model{block: 4}.params(f.c, ggufPath)
	require.NotNil(t, p)
	return p
}

func (f *fixture) registerState(t testing.TB, b uint64, p *cModelParams, blob []byte) uint64 {
	t.Helper()
	out := f.out(t)
	f.must(t, mcbgo_model_register_state(b, unsafe.Pointer(p), f.c.bytes(t, blob), uint64(len(blob)), unsafe.Pointer(out), f.eb, f.el),
		status.OK, "register state")
	return *out
}

func (f *fixture) saveState(t testing.TB, m uint64, scope *cScope, blob []byte, tok []int32, n int) cSaveResult {
	t.Helper()
	out := putT(t, f.c, cSaveResult{}, 0)
	state := f.c.bytes(t, blob)
	f.must(t, mcbgo_state_save(m, unsafe.Pointer(scope), state, uint64(len(blob)), f.c.i32s(t, tok), uint64(n), unsafe.Pointer(out), f.eb, f.el),
		status.OK, "state save")
	assert.Equal(t, blob, unsafe.Slice((*byte)(state), len(blob)), "a save wrote into its state")
	return *out
}

// restoreState restores a plan into a new state and returns a copy of it,
// freeing the library's.
func (f *fixture) restoreState(t testing.TB, plan uint64) ([]byte, cLoadResult) {
	t.Helper()
	blob, n := putT(t, f.c, uintptr(0), 0), putT(t, f.c, uint64(0), 0)
	res := putT(t, f.c, cLoadResult{}, 0)
	f.must(t, mcbgo_state_restore(plan, unsafe.Pointer(blob), unsafe.Pointer(n), unsafe.Pointer(res), f.eb, f.el), status.OK, "state restore")
	require.NotZero(t, *blob)
	out := append([]byte(nil), unsafe.Slice((*byte)(ptr(*blob)), *n)...)
	mcbgo_state_free(ptr(*blob))
	return out, *res
}

func TestRegisterState(t *testing.T) {
	fa := realState(t, "seq-fa-on.bin")
	withWord := func(b []byte, off int, v uint32) []byte {
		b = append([]byte(nil), b...)
		binary.LittleEndian.PutUint32(b[off:], v)
		return b
	}
	sliced := func(name string, n int) []byte {
		st, _ := parseState(t, realState(t, name))
		sl, err := st.Slice(n)
		require.NoError(t, err)
		b, err := sl.Build()
		require.NoError(t, err)
		return b
	}
	// A slot file of the probe prompt, as the proxy's probe slot writes it.
	probeSlot := func() []byte {
		st, _ := parseState(t, realState(t, "slot-fa-on.bin"))
		st.Words = host.ServerWords(append(append([]int32(nil), probeTokens...), prompt(16, 0, 16)...))
		b, err := st.Build()
		require.NoError(t, err)
		return b
	}
	noCells := func() []byte {
		st, s := parseState(t, fa)
		s.Cells, s.Layers = nil, nil
		b, err := st.Build()
		require.NoError(t, err)
		return b
	}
	sf := formatOf(t, fa)
	cases := []struct {
		name string
		blob []byte
		want status.Code
	}{
		{"flash attention on", fa, status.OK},
		{"flash attention off", realState(t, "seq-fa-off.bin"), status.OK},
		{"K in f32", realState(t, "seq-f32k.bin"), status.OK},
		{"the sequence in a second stream", realState(t, "seq-two-streams-fa-off.bin"), status.OK},
		{"scattered cells", realState(t, "seq-scattered-fa-off.bin"), status.OK},
		{"exactly the probe", sliced("seq-fa-on.bin", len(probeTokens)), status.OK},
		{"a slot file of the probe", probeSlot(), status.OK},
		{"a state a host built", sf.build(t, llamastate.Memory, 3, 0, probeTokens, scattered(len(probeTokens))), status.OK},
		{"a slot file of other tokens", realState(t, "slot-fa-on.bin"), status.InvalidArg},
		{"fewer cells than the probe", sliced("seq-fa-on.bin", len(probeTokens)-1), status.InvalidArg},
		{"no cells", noCells(), status.NotFound},
		{"a position missing", sf.build(t, llamastate.Memory, 0, 0, prompt(13, 0, 13), append(inOrder(12)[1:], 12)), status.InvalidArg},
		{"a position twice", sf.build(t, llamastate.Memory, 0, 0, prompt(12, 0, 12), append(inOrder(11), 3)), status.InvalidArg},
		{"truncated", fa[:len(fa)-1], status.InvalidArg},
		{"a byte after the state", append(append([]byte(nil), fa...), 0), status.InvalidArg},
		// A memory of two KV caches (an MLA cache and its indexer's) in a
		// model that names no sliding window: the first cache's state, then
		// the second's. A sliding-window model's is refused (TestLibllamaModels).
		{"the states of two caches", append(append([]byte(nil), fa...), fa[8:]...), status.OK},
		{"the states of three caches", append(append(append([]byte(nil), fa...), fa[8:]...), fa[8:]...), status.Unsupported},
		{"the header alone", fa[:12], status.InvalidArg},
		{"another magic", withWord(fa, 0, 0xdeadbeef), status.Unsupported},
		{"a slot file of another version", withWord(realState(t, "slot-fa-on.bin"), 4, 2), status.Unsupported},
		{"2^32-1 streams", withWord(fa, 8, 0xffffffff), status.InvalidArg},
		{"2^32-1 cells", withWord(fa, 12, 0xffffffff), status.InvalidArg},
		{"four bytes", fa[:4], status.InvalidArg},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t)
			b := f.open(t, f.config(""))
			out := putT(t, f.c, [2]uint64{sentinel, sentinel}, 0)
			// The blob ends where memory does: the library reads only its bytes.
			state := edgeBytes(t, len(c.blob))
			copy(state, c.blob)
			open := mcbgo_handles_open()
			got := mcbgo_model_register_state(b, unsafe.Pointer(f.stateParams(t)), pointer(state), uint64(len(state)), unsafe.Pointer(out), f.eb, f.el)
			f.expect(t, got, c.want, "register state")
			assert.Equal(t, c.blob, state, "registering wrote into the state")
			if c.want != status.OK {
				assert.Equal(t, [2]uint64{sentinel, sentinel}, *out, "a failed register wrote its output")
				assert.Equal(t, open, mcbgo_handles_open(), "a failed register left a handle")
				assert.NotEmpty(t, f.lastError())
				return
			}
			f.expect(t, mcbgo_model_unregister(out[0], f.eb, f.el), status.OK, "unregister")
		})
	}
}

// TestRegisterStateArguments: the arguments around the blob, refused as
// mcb_model_register refuses them.
func TestRegisterStateArguments(t *testing.T) {
	f := newFixture(t)
	b := f.open(t, f.config(""))
	fa := realState(t, "seq-fa-on.bin")
	state := f.c.bytes(t, fa)
	m := f.registerState(t, b, f.stateParams(t), fa)
	closed := f.open(t, f.config(""))
	f.expect(t, mcbgo_bridge_close(closed, f.eb, f.el), status.OK, "close")
	type args struct {
		bridge        uint64
		params, state unsafe.Pointer
		n             uint64
		out           unsafe.Pointer
	}
	params := func(mut func(p *cModelParams)) func(*args) {
		return func(a *args) {
			p := f.stateParams(t)
			mut(p)
			a.params = unsafe.Pointer(p)
		}
	}
	cases := []struct {
		name string
		mut  func(a *args)
		want status.Code
	}{
		{"valid", func(*args) {}, status.OK},
		{"bridge 0", func(a *args) { a.bridge = 0 }, status.BadHandle},
		{"model as bridge", func(a *args) { a.bridge = m }, status.BadHandle},
		{"closed bridge", func(a *args) { a.bridge = closed }, status.BadHandle},
		{"NULL out", func(a *args) { a.out = nil }, status.InvalidArg},
		{"misaligned out", func(a *args) { a.out = unsafe.Add(a.out, 4) }, status.InvalidArg},
		{"NULL params", func(a *args) { a.params = nil }, status.InvalidArg},
		{"misaligned params", func(a *args) { a.params = unsafe.Pointer(putT(t, f.c, *f.stateParams(t), 4)) }, status.InvalidArg},
		{"other llama_version", params(func(p *cModelParams) { p.LlamaVersion = f.c.cstr(t, "b6000") }), status.ModelMismatch},
		{"NULL llama_version", params(func(p *cModelParams) { p.LlamaVersion = 0 }), status.InvalidArg},
		{"missing GGUF", params(func(p *cModelParams) { p.GGUFPath = f.c.cstr(t, "testdata/missing.gguf") }), status.InvalidArg},
		{"not a GGUF", params(func(p *cModelParams) { p.GGUFPath = f.c.cstr(t, "testdata/weights.bin") }), status.InvalidArg},
		{"unterminated extra", params(func(p *cModelParams) { p.Extra = address(edgeString(t, maxString, 'x')) }), status.InvalidArg},
		{"block bigger than half the pool", params(func(p *cModelParams) { p.BlockTokens = 1 << 16 }), status.Config},
		{"NULL state", func(a *args) { a.state = nil }, status.InvalidArg},
		{"no bytes", func(a *args) { a.n = 0 }, status.InvalidArg},
		{"over 16 GiB", func(a *args) { a.n = 16<<30 + 1 }, status.InvalidArg},
		{"2^64-1 bytes", func(a *args) { a.n = 1<<64 - 1 }, status.InvalidArg},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			out := putT(t, f.c, [2]uint64{sentinel, sentinel}, 0)
			a := args{bridge: b, params: unsafe.Pointer(f.stateParams(t)), state: state, n: uint64(len(fa)), out: unsafe.Pointer(out)}
			c.mut(&a)
			open := mcbgo_handles_open()
			f.must(t, mcbgo_model_register_state(a.bridge, a.params, a.state, a.n, a.out, f.eb, f.el), c.want, "register state")
			if c.want == status.OK {
				f.expect(t, mcbgo_model_unregister(out[0], f.eb, f.el), status.OK, "unregister")
				return
			}
			assert.Equal(t, [2]uint64{sentinel, sentinel}, *out, "a failed register wrote its output")
			assert.Equal(t, open, mcbgo_handles_open(), "a failed register left a handle")
		})
	}
}

// TestStateIdentity: the probe digest is of the probe's KV bytes in
// position order, so registering from a state or from tensors, from any
// cells, streams or framing, gives the same model exactly when those bytes
// are the same.
func TestStateIdentity(t *testing.T) {
	f := newFixture(t)
	b := f.open(t, f.config(""))
	fa := realState(t, "seq-fa-on.bin")
	sf := formatOf(t, fa)
	g := sf.model(4)
	m := f.registerState(t, b, f.stateParams(t), fa)
	tok := prompt(31, 0, 31)
	require.Equal(t, cSaveResult{NBlocks: 7, NWritten: 7, NQueued: 7}, f.saveState(t, m, nil, sf.build(t, llamastate.Memory, 0, 0, tok, inOrder(31)), tok, 31))
	f.awaitPublished(t, b, 7)

	st, s := parseState(t, fa)
	// flip changes one byte of position p's V row in layer 1.
	flip := func(p int) []byte {
		out := append([]byte(nil), fa...)
		at, err := st.PositionCells(len(s.Cells))
		require.NoError(t, err)
		ly := s.Layers[1]
		out[ly.VOff+vAt(s.VTrans, int(ly.VElSize), len(s.Cells), int(ly.VRowSize), at[p], 5)] ^= 0x40
		return out
	}
	// reorder moves the cells of the state around, rows with them.
	reorder := func() []byte {
		at, err := st.PositionCells(len(s.Cells))
		require.NoError(t, err)
		n := len(s.Cells)
		order := scattered(n)
		cp := &llamastate.State{Kind: st.Kind, SeqID: 9, Streams: make([]llamastate.Stream, 2)}
		d := &cp.Streams[1]
		d.VTrans = s.VTrans
		for _, p := range order {
			d.Cells = append(d.Cells, llamastate.Cell{Pos: int32(p), SeqIDs: []int32{9}})
		}
		for _, ly := range s.Layers {
			k, v := make([]byte, len(ly.K)), make([]byte, len(ly.V))
			kr, vr := int(ly.KRowSize), int(ly.VRowSize)
			for c, p := range order {
				copy(k[c*kr:(c+1)*kr], ly.K[at[p]*kr:])
				for i := 0; i < vr; i++ {
					v[vAt(s.VTrans, int(ly.VElSize), n, vr, c, i)] = ly.V[vAt(s.VTrans, int(ly.VElSize), n, vr, at[p], i)]
				}
			}
			ly.K, ly.V = k, v
			d.Layers = append(d.Layers, ly)
		}
		b, err := cp.Build()
		require.NoError(t, err)
		return b
	}
	cases := []struct {
		name   string
		blob   []byte
		shared bool
	}{
		{"the same state", fa, true},
		{"its cells elsewhere, in a second stream", reorder(), true},
		{"a byte after the probe changed", flip(len(probeTokens)), true},
		{"a byte of the probe changed", flip(3), false},
		{"V transposed", realState(t, "seq-fa-off.bin"), false},
		{"K in f32", realState(t, "seq-f32k.bin"), false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m2 := f.registerState(t, b, f.stateParams(t), c.blob)
			defer func() { f.expect(t, mcbgo_model_unregister(m2, f.eb, f.el), status.OK, "unregister") }()
			lk := f.peek(t, m2, nil, tok, 31)
			assert.Equal(t, c.shared, lk.NMatchedBlocks > 0, "matched %d blocks", lk.NMatchedBlocks)
		})
	}

	// A host with tensors whose probe rows are the state's registers the
	// same model, and restores the state host's blocks into its tensors.
	t.Run("from tensors", func(t *testing.T) {
		r := g.reg(t, f.c)
		at, err := st.PositionCells(len(probeTokens))
		require.NoError(t, err)
		for p, c := range at {
			for l, ly := range s.Layers {
				for i := 0; i < int(ly.KRowSize); i++ {
					r.probe.region[r.probe.at(l, 0, r.cells[p], i)] = ly.K[c*int(ly.KRowSize)+i]
				}
				for i := 0; i < int(ly.VRowSize); i++ {
					r.probe.region[r.probe.at(l, 1, r.cells[p], i)] = ly.V[vAt(s.VTrans, int(ly.VElSize), len(s.Cells), int(ly.VRowSize), c, i)]
				}
			}
		}
		mt := f.register(t, b, r)
		defer func() { f.expect(t, mcbgo_model_unregister(mt, f.eb, f.el), status.OK, "unregister") }()
		lk := f.lookup(t, mt, nil, tok, 31, 0)
		require.Equal(t, uint32(28), lk.NRestoreTokens, "the tensor host's lookup: %+v", lk)
		dst := mustTensors(t, f.c, g, 40, false, tight)
		assert.Equal(t, cLoadResult{NBlocks: 7, NBlocksOK: 7, NTokensOK: 28, NBytes: uint64(7 * g.payload())},
			f.load(t, lk.Plan, dst, tok, 28, reversed(28, 40)))
	})
}

// TestStateRoundTrip: a state host saves a state's blocks in one bridge;
// another bridge, once the publisher has shown them to it, restores them
// into a new state that is byte for byte what llama.cpp would have
// written for the prefix: the cells in position order, in the first
// stream, as sequence 0.
func TestStateRoundTrip(t *testing.T) {
	cases := []struct {
		name  string
		probe string
		kind  llamastate.Kind
		order func(n int) []int
		peer  bool
	}{
		{"row-major V", "seq-fa-on.bin", llamastate.Memory, inOrder, true},
		{"transposed V", "seq-fa-off.bin", llamastate.Memory, inOrder, true},
		{"K in f32, scattered cells", "seq-f32k.bin", llamastate.Memory, scattered, true},
		{"two streams", "seq-two-streams-fa-off.bin", llamastate.Memory, scattered, true},
		{"a slot file", "seq-fa-on.bin", llamastate.SlotFile, inOrder, false},
		{"in one bridge", "seq-fa-off.bin", llamastate.Memory, scattered, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t)
			probe := realState(t, c.probe)
			sf := formatOf(t, probe)
			g := sf.model(4)
			saver := f.open(t, f.config(""))
			loader := saver
			if c.peer {
				loader = f.open(t, f.config(""))
			}
			ms := f.registerState(t, saver, f.stateParams(t), probe)
			ml := f.registerState(t, loader, f.stateParams(t), probe)
			scope := f.scope(t, "tenant-a", adapter{writeFile(t, "a.lora", []byte("a")), 0.5})
			tok := prompt(27, 0, 27)
			state := sf.build(t, c.kind, int32(sf.stream), sf.stream, tok, c.order(len(tok)))
			assert.Equal(t, cSaveResult{NBlocks: 6, NWritten: 6, NQueued: 6}, f.saveState(t, ms, scope, state, tok, len(tok)))

			lk, _ := f.awaitMatch(t, ml, scope, tok, len(tok), 6)
			require.Equal(t, uint32(24), lk.NRestoreTokens, "%+v", lk)
			got, res := f.restoreState(t, lk.Plan)
			assert.Equal(t, cLoadResult{NBlocks: 6, NBlocksOK: 6, NTokensOK: 24, NBytes: uint64(6 * g.payload())}, res)
			restored := sf
			restored.stream = 0 // a restore fills the first stream
			assert.Equal(t, restored.build(t, llamastate.Memory, 0, 0, tok, inOrder(24)), got, "the restored state")

			// A restored state saves as the same blocks: known, once the
			// loader's mirror holds them (a peer's did when it matched).
			f.awaitPublished(t, saver, 6)
			assert.Equal(t, cSaveResult{NBlocks: 6, NKnown: 6}, f.saveState(t, ml, scope, got, tok, 24))

			// A state host's plan loads into tensors as well.
			lk = f.lookup(t, ml, scope, tok, len(tok), 0)
			dst := mustTensors(t, f.c, g, 32, sf.vtrans, tight)
			assert.Equal(t, res, f.load(t, lk.Plan, dst, tok, 24, wrapCells(24, 20, 32)))

			st := f.stats(t, loader)
			assert.Equal(t, uint64(2), st.Loads)
			assert.Equal(t, uint64(48), st.RestoredTokens)
			assert.Zero(t, st.LoadFailures)
		})
	}
}

// TestStateSaveArguments passes mcb_state_save one bad argument at a time:
// each is refused with its status, leaves the result as it was, and
// neither writes into the state nor leaves a handle.
func TestStateSaveArguments(t *testing.T) {
	f := newFixture(t)
	b := f.open(t, f.config(""))
	fa := realState(t, "seq-fa-on.bin")
	sf := formatOf(t, fa)
	m := f.registerState(t, b, f.stateParams(t), fa)
	gone := f.registerState(t, b, f.stateParams(t), fa)
	f.expect(t, mcbgo_model_unregister(gone, f.eb, f.el), status.OK, "unregister")
	mt := f.register(t, b, sf.model(4).reg(t, f.c)) // a tensor host's model of the same format
	tok := prompt(40, 0, 40)
	blob := sf.build(t, llamastate.Memory, 0, 0, tok, scattered(20))
	f32 := formatOf(t, realState(t, "seq-f32k.bin")).build(t, llamastate.Memory, 0, 0, tok, inOrder(20))
	withWord := func(off int, v uint32) []byte {
		b := append([]byte(nil), blob...)
		binary.LittleEndian.PutUint32(b[off:], v)
		return b
	}
	type args struct {
		model        uint64
		scope, state unsafe.Pointer
		n            uint64
		tokens       unsafe.Pointer
		nTokens      uint64
		out          unsafe.Pointer
	}
	state := func(b []byte) func(*args) {
		return func(a *args) { a.state, a.n = f.c.bytes(t, b), uint64(len(b)) }
	}
	cases := []struct {
		name   string
		mut    func(*args)
		want   status.Code
		blocks uint32 // written by a save that succeeds
	}{
		{"valid", func(*args) {}, status.OK, 5},
		{"more tokens than cells", func(a *args) { a.nTokens = 40 }, status.OK, 5},
		{"fewer tokens than cells", func(a *args) { a.nTokens = 9 }, status.OK, 2},
		{"a tensor host's model", func(a *args) { a.model = mt }, status.OK, 5},
		{"a tenant", func(a *args) { a.scope = unsafe.Pointer(f.scope(t, "tenant-b")) }, status.OK, 5},
		{"model 0", func(a *args) { a.model = 0 }, status.BadHandle, 0},
		{"bridge as model", func(a *args) { a.model = b }, status.BadHandle, 0},
		{"unregistered model", func(a *args) { a.model = gone }, status.BadHandle, 0},
		{"NULL out", func(a *args) { a.out = nil }, status.InvalidArg, 0},
		{"misaligned out", func(a *args) { a.out = unsafe.Add(a.out, 2) }, status.InvalidArg, 0},
		{"misaligned scope", func(a *args) { a.scope = unsafe.Pointer(putT(t, f.c, cScope{}, 4)) }, status.InvalidArg, 0},
		{"an adapter missing", func(a *args) { a.scope = unsafe.Pointer(f.scope(t, "", adapter{"testdata/missing.lora", 1})) }, status.InvalidArg, 0},
		{"NULL state", func(a *args) { a.state = nil }, status.InvalidArg, 0},
		{"no bytes", func(a *args) { a.n = 0 }, status.InvalidArg, 0},
		{"over 16 GiB", func(a *args) { a.n = 16<<30 + 1 }, status.InvalidArg, 0},
		{"NULL tokens", func(a *args) { a.tokens = nil }, status.InvalidArg, 0},
		{"misaligned tokens", func(a *args) { a.tokens = unsafe.Add(a.tokens, 1) }, status.InvalidArg, 0},
		{"no tokens", func(a *args) { a.nTokens = 0 }, status.InvalidArg, 0},
		{"one token over the limit", func(a *args) { a.nTokens = maxTokens + 1 }, status.InvalidArg, 0},
		{"tokens below a block", func(a *args) { a.nTokens = 3 }, status.InvalidArg, 0},
		{"truncated", state(blob[:len(blob)-3]), status.InvalidArg, 0},
		{"another magic", state(withWord(0, 0x12345678)), status.Unsupported, 0},
		{"2^32-1 cells", state(withWord(12, 0xffffffff)), status.InvalidArg, 0},
		{"another format", state(f32), status.ModelMismatch, 0},
		{"a position missing", state(sf.build(t, llamastate.Memory, 0, 0, tok, append(inOrder(20)[1:], 21))), status.Unsupported, 0},
		{"no cells", state(sf.build(t, llamastate.Memory, 0, 0, tok, nil)), status.NotFound, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			out := putT(t, f.c, [2]cSaveResult{{NBlocks: 0xdead, NKnown: 0xbeef}}, 0)
			a := args{model: m, state: f.c.bytes(t, blob), n: uint64(len(blob)), tokens: f.c.i32s(t, tok), nTokens: 20, out: unsafe.Pointer(out)}
			c.mut(&a)
			open := mcbgo_handles_open()
			var before []byte
			if a.state != nil && a.n <= uint64(len(blob)) {
				before = append(before, unsafe.Slice((*byte)(a.state), a.n)...)
			}
			f.must(t, mcbgo_state_save(a.model, a.scope, a.state, a.n, a.tokens, a.nTokens, a.out, f.eb, f.el), c.want, "state save")
			assert.Equal(t, open, mcbgo_handles_open(), "a state save left a handle")
			if before != nil {
				assert.Equal(t, before, unsafe.Slice((*byte)(a.state), a.n), "a save wrote into its state")
			}
			if c.want == status.OK {
				assert.Equal(t, c.blocks, out[0].NBlocks, "%+v", out[0])
				return
			}
			assert.NotEmpty(t, f.lastError())
			assert.Equal(t, cSaveResult{NBlocks: 0xdead, NKnown: 0xbeef}, out[0], "a refused save wrote its result")
		})
	}
}

// TestStateRestoreArguments: the outputs of mcb_state_restore, which
// consumes its plan also when it refuses them.
func TestStateRestoreArguments(t *testing.T) {
	f := newFixture(t)
	b := f.open(t, f.config(""))
	fa := realState(t, "seq-fa-on.bin")
	sf := formatOf(t, fa)
	m := f.registerState(t, b, f.stateParams(t), fa)
	tok := prompt(20, 0, 20)
	f.saveState(t, m, nil, sf.build(t, llamastate.Memory, 0, 0, tok, inOrder(20)), tok, 20)
	f.awaitPublished(t, b, 5)
	plan := func(t *testing.T) uint64 {
		lk := f.lookup(t, m, nil, tok, 20, 0)
		require.Equal(t, uint32(16), lk.NRestoreTokens)
		return lk.Plan
	}
	type outs struct{ state, n, res unsafe.Pointer }
	cases := []struct {
		name  string
		mut   func(p *uint64, o *outs)
		want  status.Code
		plans int // plans left after the call
	}{
		{"plan 0", func(p *uint64, o *outs) { *p = 0 }, status.BadHandle, 1},
		{"model as plan", func(p *uint64, o *outs) { *p = m }, status.BadHandle, 1},
		{"NULL state", func(p *uint64, o *outs) { o.state = nil }, status.InvalidArg, 0},
		{"misaligned state", func(p *uint64, o *outs) { o.state = unsafe.Add(o.state, 4) }, status.InvalidArg, 0},
		{"NULL size", func(p *uint64, o *outs) { o.n = nil }, status.InvalidArg, 0},
		{"misaligned size", func(p *uint64, o *outs) { o.n = unsafe.Add(o.n, 4) }, status.InvalidArg, 0},
		{"NULL result", func(p *uint64, o *outs) { o.res = nil }, status.InvalidArg, 0},
		{"misaligned result", func(p *uint64, o *outs) { o.res = unsafe.Add(o.res, 4) }, status.InvalidArg, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			own := plan(t)
			p := own
			mem := putT(t, f.c, [3][2]uint64{{sentinel, sentinel}, {sentinel, sentinel}, {sentinel, sentinel}}, 0)
			res := putT(t, f.c, [2]cLoadResult{{NBlocks: 0xdead}}, 0)
			o := outs{state: unsafe.Pointer(&mem[0]), n: unsafe.Pointer(&mem[1]), res: unsafe.Pointer(res)}
			c.mut(&p, &o)
			open := mcbgo_handles_open()
			f.expect(t, mcbgo_state_restore(p, o.state, o.n, o.res, f.eb, f.el), c.want, "state restore")
			assert.Equal(t, [3][2]uint64{{sentinel, sentinel}, {sentinel, sentinel}, {sentinel, sentinel}}, *mem, "a refused restore wrote a blob")
			assert.Equal(t, cLoadResult{NBlocks: 0xdead}, res[0], "a refused restore wrote its result")
			assert.Equal(t, open-1+uint64(c.plans), mcbgo_handles_open())
			if c.plans == 1 {
				f.drop(t, own)
			}
		})
	}
	mcbgo_state_free(nil)
}

// TestPartialOnlyModel: a model whose whole state is its partial state
// (Mamba's recurrent state) registers from the probe's partial state,
// saves snapshots alone and loads them with no layout, and keys its
// snapshots by that probe state: another host's numerics find nothing.
func TestPartialOnlyModel(t *testing.T) {
	f := newFixture(t)
	b := f.open(t, f.config(`,"snapshot_blocks":2`))
	probe := bytes.Repeat([]byte{7, 1, 9}, 40)
	params := func(partial string, streams uint32) *cModelParams {
		p := f.stateParams(t)
		p.PartialState, p.PartialKVStreams = f.c.cstr(t, partial), streams
		return p
	}
	register := func(p *cModelParams, state []byte) (uint64, int32) {
		out := f.out(t)
		got := mcbgo_model_register_state(b, unsafe.Pointer(p), f.c.bytes(t, state), uint64(len(state)), unsafe.Pointer(out), f.eb, f.el)
		return *out, got
	}
	m, got := register(params("recurrent test", 0), probe)
	f.must(t, got, status.OK, "register a model without KV rows")
	require.EqualValues(t, 8, mcbgo_model_snapshot_tokens(m), "block 4 times snapshot_blocks 2")

	_, got = register(params("recurrent test", 1), probe)
	f.expect(t, got, status.InvalidArg, "partial_kv_streams beside a partial state alone")
	other, got := register(params("recurrent test", 0), append([]byte{8}, probe[1:]...))
	f.must(t, got, status.OK, "register another host's numerics")

	scope := f.scope(t, "")
	tok := []int32{4, 8, 15, 16, 23, 42, 4, 8, 15, 16, 23, 42, 1, 2}
	snap := []byte("the state after eight tokens")
	f.must(t, mcbgo_snapshot_save(m, unsafe.Pointer(scope), f.c.i32s(t, tok), 8, f.c.bytes(t, snap), uint64(len(snap)), f.eb, f.el),
		status.OK, "snapshot save")

	r, _ := f.awaitMatch(t, m, scope, tok, len(tok), 2)
	require.EqualValues(t, 8, r.NRestoreTokens, "restored to the snapshot")
	assert.Zero(t, f.peek(t, other, scope, tok, len(tok)).NMatchedBlocks, "another probe state's model matched")

	// A layout is refused (the plan is consumed); none loads the snapshot.
	lo := putT(t, f.c, cKVLayout{}, 0)
	out := f.out(t)
	f.expect(t, mcbgo_load_begin(r.Plan, unsafe.Pointer(lo), nil, unsafe.Pointer(out), f.eb, f.el), status.Layout, "load into a layout")
	r = f.lookup(t, m, scope, tok, len(tok), 0)
	require.NotZero(t, r.Plan)
	f.must(t, mcbgo_load_begin(r.Plan, nil, nil, unsafe.Pointer(out), f.eb, f.el), status.OK, "load begin")
	state, n := putT(t, f.c, uintptr(0), 0), putT(t, f.c, uint64(0), 0)
	f.must(t, mcbgo_load_snapshot(*out, unsafe.Pointer(state), unsafe.Pointer(n), f.eb, f.el), status.OK, "load snapshot")
	assert.Equal(t, snap, append([]byte(nil), unsafe.Slice((*byte)(ptr(*state)), *n)...))
	mcbgo_state_free(ptr(*state))
	res := putT(t, f.c, cLoadResult{}, 0)
	f.must(t, mcbgo_load_end(*out, unsafe.Pointer(res), f.eb, f.el), status.OK, "load end")
	assert.EqualValues(t, 8, res.NTokensOK)

	// A state host's restore is not this model's.
	r = f.lookup(t, m, scope, tok, len(tok), 0)
	blob, bn := putT(t, f.c, uintptr(0), 0), putT(t, f.c, uint64(0), 0)
	f.expect(t, mcbgo_state_restore(r.Plan, unsafe.Pointer(blob), unsafe.Pointer(bn), unsafe.Pointer(res), f.eb, f.el),
		status.Unsupported, "state restore")
	f.expect(t, mcbgo_model_unregister(m, f.eb, f.el), status.OK, "unregister")
	f.expect(t, mcbgo_model_unregister(other, f.eb, f.el), status.OK, "unregister")
}
