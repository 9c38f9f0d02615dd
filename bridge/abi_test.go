package main

import (
	"bytes"
	"errors"
	"math"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/arbiter"
	"github.com/mcbridge/mcbridge/internal/host"
	"github.com/mcbridge/mcbridge/internal/status"
)

// fixture is one test's host: its memory, the error buffer the C shims
// pass on every call, and the memory directory its bridges share. It fails
// the test when the test leaves handles open.
type fixture struct {
	c    *cmem
	errb []byte
	eb   unsafe.Pointer
	el   uint64
	dir  string
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	start := mcbgo_handles_open()
	t.Cleanup(func() {
		assert.Equal(t, start, mcbgo_handles_open(), "handles open after the test and before it")
	})
	c := newCmem(t, 32<<20)
	errb := c.alloc(t, 1024, 1)
	return &fixture{c: c, errb: errb, eb: pointer(errb), el: uint64(len(errb)), dir: "abi-" + t.Name()}
}

// withErrorBuffer returns a copy of f with its own error buffer, as each
// host thread has its own.
func (f *fixture) withErrorBuffer(t *testing.T) *fixture {
	g := *f
	g.errb = f.c.alloc(t, 1024, 1)
	g.eb, g.el = pointer(g.errb), uint64(len(g.errb))
	return &g
}

func (f *fixture) lastError() string {
	if i := bytes.IndexByte(f.errb, 0); i >= 0 {
		return string(f.errb[:i])
	}
	return string(f.errb)
}

// expect asserts a call's status; the names make a failure readable.
func (f *fixture) expect(t testing.TB, got int32, want status.Code, what string) bool {
	t.Helper()
	return assert.Equalf(t, want.String(), status.Code(got).String(), "%s returned %d; last error %q", what, got, f.lastError())
}

// must is expect for calls the rest of the test depends on.
func (f *fixture) must(t testing.TB, got int32, want status.Code, what string) {
	t.Helper()
	if !f.expect(t, got, want, what) {
		t.FailNow()
	}
}

// config is a small pool and a restore-always arbiter, so that what a
// lookup offers depends on the cache alone, in the test's own directory.
func (f *fixture) config(extra string) string {
	return `{"pool_bytes":16777216,"arbiter":{"policy":"always-restore"},"directory":{"name":"` + f.dir + `"}` + extra + `}`
}

const sentinel = 0x5e47_1e15_5e47_1e15

// out returns a handle output holding sentinel, which a failed call must
// leave there.
func (f *fixture) out(t testing.TB) *uint64 { return putT(t, f.c, uint64(sentinel), 0) }

func (f *fixture) open(t *testing.T, cfg string) uint64 {
	t.Helper()
	out := f.out(t)
	f.must(t, mcbgo_bridge_open(ptr(f.c.cstr(t, cfg)), unsafe.Pointer(out), f.eb, f.el), status.OK, "open")
	b := *out
	// Closing a closed bridge only says BAD_HANDLE: harmless after a test
	// that closed it, and what keeps a failing test from leaking.
	t.Cleanup(func() { mcbgo_bridge_close(b, nil, 0) })
	return b
}

func (f *fixture) registerCall(b uint64, r *registration, out unsafe.Pointer) int32 {
	return mcbgo_model_register(b, unsafe.Pointer(r.params), unsafe.Pointer(r.format), unsafe.Pointer(r.probe.layout), r.pcells, out, f.eb, f.el)
}

func (f *fixture) register(t testing.TB, b uint64, r *registration) uint64 {
	t.Helper()
	out := f.out(t)
	f.must(t, f.registerCall(b, r, unsafe.Pointer(out)), status.OK, "register")
	return *out
}

func (f *fixture) cells(t testing.TB, cells []uint32) unsafe.Pointer {
	if cells == nil {
		return nil
	}
	return ptr(f.c.u32s(t, cells))
}

// lookup asks about the first n tokens of tok, of which the host holds
// cached; a plan it returns is the caller's.
func (f *fixture) lookup(t testing.TB, m uint64, scope *cScope, tok []int32, n, cached int) cLookupResult {
	t.Helper()
	out := putT(t, f.c, cLookupResult{}, 0)
	f.must(t, mcbgo_lookup(m, unsafe.Pointer(scope), f.c.i32s(t, tok), uint64(n), uint64(cached), unsafe.Pointer(out), f.eb, f.el),
		status.OK, "lookup")
	require.Equal(t, out.NRestoreTokens > 0, out.Plan != 0, "a lookup returns a plan exactly when it restores: %+v", *out)
	return *out
}

// peek is a lookup whose plan, if any, is dropped at once.
func (f *fixture) peek(t testing.TB, m uint64, scope *cScope, tok []int32, n int) cLookupResult {
	t.Helper()
	r := f.lookup(t, m, scope, tok, n, 0)
	f.drop(t, r.Plan)
	return r
}

func (f *fixture) drop(t testing.TB, plan uint64) {
	t.Helper()
	if plan != 0 {
		f.expect(t, mcbgo_plan_drop(plan, f.eb, f.el), status.OK, "plan drop")
	}
}

// publishWait bounds every wait for the publisher: another bridge sees
// a save a moment after it ends, never at a known time.
const publishWait = 10 * time.Second

// eventually polls cond, backing off from a millisecond, until it holds;
// it fails the test once publishWait has passed.
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(publishWait)
	for wait := time.Millisecond; !cond(); wait = min(2*wait, 50*time.Millisecond) {
		if time.Now().After(deadline) {
			require.FailNowf(t, "timed out", "%s: not within %s", what, publishWait)
		}
		time.Sleep(wait)
	}
}

// polls counts the lookups a wait made, for tests that check the counters.
type polls struct{ lookups, hits, restores int }

// awaitMatch looks the prompt up until blocks of it match, dropping the
// plans of the lookups that fell short, and returns the last lookup with
// its plan.
func (f *fixture) awaitMatch(t testing.TB, m uint64, scope *cScope, tok []int32, n, blocks int) (cLookupResult, polls) {
	t.Helper()
	var r cLookupResult
	var p polls
	eventually(t, "a match of the saved blocks", func() bool {
		r = f.lookup(t, m, scope, tok, n, 0)
		p.lookups++
		if r.NMatchedBlocks > 0 {
			p.hits++
		}
		if r.Plan != 0 {
			p.restores++
		}
		if int(r.NMatchedBlocks) >= blocks {
			return true
		}
		f.drop(t, r.Plan)
		return false
	})
	return r, p
}

// awaitPublished waits until the publisher of bridge b has settled n
// blocks with the directory. Tests that look blocks up in the bridge that
// saved them wait for it too: the contract is that it sees them at once,
// but it loses sight of each for a moment while the publisher settles it
// (TestOwnBlocksAtOnce), and only that test is about this.
func (f *fixture) awaitPublished(t testing.TB, b uint64, n int) {
	t.Helper()
	eventually(t, "the publisher", func() bool {
		st := f.stats(t, b)
		return st.SavedBlocks+st.DedupedBlocks >= uint64(n)
	})
}

// save runs a whole save of the first n tokens, layer by layer.
func (f *fixture) save(t testing.TB, m uint64, scope *cScope, src *tensors, tok []int32, n int, cells []uint32) cSaveResult {
	t.Helper()
	out := f.out(t)
	f.must(t, mcbgo_save_begin(m, unsafe.Pointer(scope), unsafe.Pointer(src.layout), f.c.i32s(t, tok), uint64(n),
		f.cells(t, cells), unsafe.Pointer(out), f.eb, f.el), status.OK, "save begin")
	for l := 0; l < src.m.layers(); l++ {
		f.expect(t, mcbgo_save_layer(*out, uint32(l), f.eb, f.el), status.OK, "save layer")
	}
	res := putT(t, f.c, cSaveResult{}, 0)
	f.expect(t, mcbgo_save_end(*out, unsafe.Pointer(res), f.eb, f.el), status.OK, "save end")
	return *res
}

// load restores a plan of the first n tokens of tok layer by layer,
// checking the tensors after each layer, and returns the result of the end.
func (f *fixture) load(t testing.TB, plan uint64, dst *tensors, tok []int32, n int, cells []uint32) cLoadResult {
	t.Helper()
	before := dst.snapshot()
	out := f.out(t)
	f.must(t, mcbgo_load_begin(plan, unsafe.Pointer(dst.layout), f.cells(t, cells), unsafe.Pointer(out), f.eb, f.el), status.OK, "load begin")
	nok := putT(t, f.c, uint32(math.MaxUint32), 0)
	prev := n
	for l := 0; l < dst.m.layers(); l++ {
		f.expect(t, mcbgo_load_wait_layer(*out, uint32(l), unsafe.Pointer(nok), f.eb, f.el), status.OK, "wait layer")
		assert.True(t, int(*nok) <= prev && int(*nok)%int(dst.m.block) == 0, "layer %d: %d tokens good after %d", l, *nok, prev)
		prev = int(*nok)
		assert.NoError(t, dst.checkRestore(before, tok, cells, n, prev, l+1), "after layer %d", l)
	}
	res := putT(t, f.c, cLoadResult{}, 0)
	f.expect(t, mcbgo_load_end(*out, unsafe.Pointer(res), f.eb, f.el), status.OK, "load end")
	assert.NoError(t, dst.checkRestore(before, tok, cells, n, int(res.NTokensOK), dst.m.layers()))
	return *res
}

func (f *fixture) stats(t testing.TB, b uint64) cStats {
	t.Helper()
	out := putT(t, f.c, cStats{}, 0)
	f.expect(t, mcbgo_bridge_stats(b, unsafe.Pointer(out), f.eb, f.el), status.OK, "stats")
	return *out
}

// adapter is one entry of a scope's adapter array.
type adapter struct {
	path  string
	scale float32
}

// adapters copies an adapter array into host memory, with room for one
// more entry's worth of misalignment.
func (f *fixture) adapters(t testing.TB, as ...cAdapter) uintptr {
	b := f.c.alloc(t, (len(as)+1)*int(unsafe.Sizeof(cAdapter{})), 8)
	copy(unsafe.Slice((*cAdapter)(pointer(b)), len(as)), as)
	return address(b)
}

// scope builds a struct mcb_scope in host memory.
func (f *fixture) scope(t testing.TB, salt string, adapters ...adapter) *cScope {
	s := cScope{TenantSaltLen: uint64(len(salt)), NAdapters: uint64(len(adapters))}
	if salt != "" {
		s.TenantSalt = f.c.cstr(t, salt)
	}
	if len(adapters) > 0 {
		as := make([]cAdapter, len(adapters))
		for i, a := range adapters {
			as[i] = cAdapter{Path: f.c.cstr(t, a.path), Scale: a.scale}
		}
		s.Adapters = f.adapters(t, as...)
	}
	return putT(t, f.c, s, 0)
}

// testModel has layers of different widths, as models with per-layer GQA do.
func testModel(vtrans bool) model {
	return model{block: 4, kEmbd: []uint32{8, 16, 4}, vEmbd: []uint32{8, 4, 12}, vtrans: vtrans}
}

// kOnlyModel is testModel's K without V, as an MLA cache has it.
func kOnlyModel(vtrans bool) model {
	m := testModel(vtrans)
	m.vEmbd = []uint32{0, 0, 0}
	return m
}

func TestBridgeOpen(t *testing.T) {
	atLimit := func(f *fixture, t *testing.T) unsafe.Pointer {
		s := edgeString(t, maxConfig, 0) // maxConfig-1 bytes and the terminator
		copy(s, "{}")
		for i := 2; i < len(s)-1; i++ {
			s[i] = ' '
		}
		return pointer(s)
	}
	str := func(s string) func(*fixture, *testing.T) unsafe.Pointer {
		return func(f *fixture, t *testing.T) unsafe.Pointer { return ptr(f.c.cstr(t, s)) }
	}
	cases := []struct {
		name string
		cfg  func(*fixture, *testing.T) unsafe.Pointer // nil passes NULL
		env  string                                    // MCB_CONFIG
		out  func(*fixture, *testing.T) unsafe.Pointer // nil passes a good one
		want status.Code
		msg  string
	}{
		{name: "NULL and no MCB_CONFIG", want: status.OK},
		{name: "empty", cfg: str(""), want: status.OK},
		{name: "blank", cfg: str(" \n\t"), want: status.OK},
		{name: "inline", cfg: str(`{"pool_bytes":2097152,"eviction":"cost","directory":{"name":"abi-open"}}`), want: status.OK},
		{name: "MCB_CONFIG inline", env: `{"pool_bytes":2097152}`, want: status.OK},
		{name: "MCB_CONFIG file", env: "testdata/config.json", want: status.OK},
		{name: "argument wins over MCB_CONFIG", cfg: str(`{"pool_bytes":2097152}`), env: `{"pool_bytes":1}`, want: status.OK},
		{name: "longest config", cfg: atLimit, want: status.OK},
		{name: "MCB_CONFIG missing file", env: "testdata/missing.json", want: status.Config, msg: "nor a readable file"},
		{name: "MCB_CONFIG bad JSON", env: `{"pool_bytes":`, want: status.Config, msg: "parsing config"},
		{name: "truncated JSON", cfg: str(`{"pool_bytes":`), want: status.Config, msg: "parsing config"},
		{name: "misspelt key", cfg: str(`{"pool_byte":2097152}`), want: status.Config, msg: "unknown field"},
		{name: "trailing data", cfg: str(`{} {}`), want: status.Config, msg: "trailing data"},
		{name: "wrong type", cfg: str(`{"pool_bytes":"big"}`), want: status.Config},
		{name: "pool too small", cfg: str(`{"pool_bytes":1}`), want: status.Config, msg: "pool_bytes"},
		{name: "unknown eviction", cfg: str(`{"eviction":"fifo"}`), want: status.Config, msg: "eviction"},
		{name: "unknown transport", cfg: str(`{"transport":{"kind":"rdma"}}`), want: status.Config},
		{name: "unknown policy", cfg: str(`{"arbiter":{"policy":"coin"}}`), want: status.Config},
		{name: "etcd without endpoints", cfg: str(`{"directory":{"kind":"etcd"}}`), want: status.Config},
		{name: "pool beyond the address space", cfg: str(`{"pool_bytes":4611686018427387904}`), want: status.PoolFull},
		{name: "unterminated", cfg: func(f *fixture, t *testing.T) unsafe.Pointer { return pointer(edgeString(t, maxConfig, '{')) },
			want: status.InvalidArg, msg: "not terminated"},
		{name: "NULL out", out: func(*fixture, *testing.T) unsafe.Pointer { return nil }, want: status.InvalidArg},
		{name: "misaligned out", out: func(f *fixture, t *testing.T) unsafe.Pointer { return unsafe.Pointer(putT(t, f.c, uint64(0), 4)) },
			want: status.InvalidArg},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv("MCB_CONFIG", c.env)
			f := newFixture(t)
			var cfg unsafe.Pointer
			if c.cfg != nil {
				cfg = c.cfg(f, t)
			}
			out := f.out(t)
			pout := unsafe.Pointer(out)
			if c.out != nil {
				pout = c.out(f, t)
			}
			copy(f.errb, strings.Repeat("Z", len(f.errb)))
			f.must(t, mcbgo_bridge_open(cfg, pout, f.eb, f.el), c.want, "open")
			if c.want != status.OK {
				assert.Equal(t, uint64(sentinel), *out, "a failed open wrote its output")
				assert.NotEmpty(t, f.lastError())
				assert.Contains(t, f.lastError(), c.msg)
				return
			}
			assert.Zero(t, f.errb[0], "a successful open left the error %q", f.lastError())
			require.True(t, *out != 0 && *out != sentinel, "open gave handle %#x", *out)
			f.expect(t, mcbgo_bridge_close(*out, f.eb, f.el), status.OK, "close")
			f.expect(t, mcbgo_bridge_close(*out, f.eb, f.el), status.BadHandle, "second close")
		})
	}
}

func TestLlamaVersion(t *testing.T) {
	p := mcbgo_llama_version()
	require.NotNil(t, p)
	s, err := cString(uintptr(unsafe.Pointer(p)), 64, "version")
	require.NoError(t, err)
	assert.Equal(t, "v0.5.0", s, "the tag of internal/llamapin/PIN")
	assert.Equal(t, p, mcbgo_llama_version(), "a static string")
}

func TestProbeTokens(t *testing.T) {
	f := newFixture(t)
	require.Equal(t, []int32{1, 2, 3, 5, 8, 13, 21, 34}, probeTokens)
	const canary = -7
	for _, c := range []struct {
		name  string
		skew  int // bytes added to the buffer's address
		cap   uint64
		wrote int
	}{
		{"no room", 0, 0, 0},
		{"room for three", 0, 3, 3},
		{"room for all", 0, 8, 8},
		{"room to spare", 0, 100, 8},
		{"misaligned", 2, 8, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			b := f.c.alloc(t, 4*101+4, 4)
			buf := unsafe.Slice((*int32)(pointer(b)), 101)
			for i := range buf {
				buf[i] = canary
			}
			assert.Equal(t, uint64(len(probeTokens)), mcbgo_probe_tokens(unsafe.Add(pointer(b), c.skew), c.cap))
			if c.skew == 0 {
				assert.Equal(t, probeTokens[:c.wrote], buf[:c.wrote])
				for i := c.wrote; i < len(buf); i++ {
					require.Equal(t, int32(canary), buf[i], "token %d written past the %d asked for", i, c.wrote)
				}
				return
			}
			for i := range buf {
				require.Equal(t, int32(canary), buf[i], "a misaligned buffer was written")
			}
		})
	}
	assert.Equal(t, uint64(len(probeTokens)), mcbgo_probe_tokens(nil, 8), "NULL asks for the count")
}

// regArgs is the argument list of mcb_model_register.
type regArgs struct {
	bridge                            uint64
	params, format, probe, cells, out unsafe.Pointer
}

func TestModelRegister(t *testing.T) {
	type mutation func(f *fixture, t *testing.T, a *regArgs, r *registration)
	params := func(mut func(f *fixture, t *testing.T, p *cModelParams)) mutation {
		return func(f *fixture, t *testing.T, a *regArgs, r *registration) { mut(f, t, r.params) }
	}
	format := func(mut func(f *fixture, t *testing.T, p *cKVFormat)) mutation {
		return func(f *fixture, t *testing.T, a *regArgs, r *registration) { mut(f, t, r.format) }
	}
	probe := func(mut func(f *fixture, t *testing.T, lo *cKVLayout, ls []cKVLayer)) mutation {
		return func(f *fixture, t *testing.T, a *regArgs, r *registration) {
			a.probe = f.relayout(t, r.probe.layout, func(lo *cKVLayout, ls []cKVLayer) { mut(f, t, lo, ls) })
		}
	}
	probeCells := func(mut func([]uint32)) mutation {
		return func(f *fixture, t *testing.T, a *regArgs, r *registration) {
			c := append([]uint32(nil), r.cells...)
			mut(c)
			a.cells = f.cells(t, c)
		}
	}
	path := func(p string) mutation {
		return params(func(f *fixture, t *testing.T, mp *cModelParams) { mp.GGUFPath = f.c.cstr(t, p) })
	}
	unterminated := func(field func(*cModelParams) *uintptr) mutation {
		return params(func(f *fixture, t *testing.T, p *cModelParams) { *field(p) = address(edgeString(t, maxString, 'x')) })
	}
	// variant registers another model, its probe computed as a host would.
	variant := func(g model) mutation {
		return func(f *fixture, t *testing.T, a *regArgs, r *registration) {
			v := g.reg(t, f.c)
			a.params, a.format, a.probe, a.cells = unsafe.Pointer(v.params), unsafe.Pointer(v.format), unsafe.Pointer(v.probe.layout), v.pcells
		}
	}
	gguf, err := os.ReadFile(ggufPath)
	require.NoError(t, err)
	cases := []struct {
		name string
		mut  mutation
		want status.Code
	}{
		{"valid", func(*fixture, *testing.T, *regArgs, *registration) {}, status.OK},
		{"block_tokens 0 takes the default", params(func(f *fixture, t *testing.T, p *cModelParams) { p.BlockTokens = 0 }), status.OK},
		{"longest extra", params(func(f *fixture, t *testing.T, p *cModelParams) { p.Extra = address(edgeString(t, maxString, 0)) }), status.OK},
		{"V transposed", variant(testModel(true)), status.OK},
		{"one layer", variant(model{block: 4, kEmbd: []uint32{1}, vEmbd: []uint32{3}}), status.OK},
		{"K-only (MLA)", variant(kOnlyModel(false)), status.OK},
		{"K-only, V transposed", variant(kOnlyModel(true)), status.OK},
		{"probe in padded strides", func(f *fixture, t *testing.T, a *regArgs, r *registration) {
			p := mustTensors(t, f.c, r.probe.m, 16, false, func(l, kv int) int { return 4*l + 2*kv + 6 })
			p.compute(probeTokens, r.cells, len(r.cells))
			a.probe = unsafe.Pointer(p.layout)
		}, status.OK},
		{"probe location NULL", probe(func(f *fixture, t *testing.T, lo *cKVLayout, _ []cKVLayer) { lo.Location = 0 }), status.OK},
		{"probe on another CPU", probe(func(f *fixture, t *testing.T, lo *cKVLayout, _ []cKVLayer) { lo.Location = f.c.cstr(t, "cpu:3") }), status.OK},

		{"bridge 0", func(f *fixture, t *testing.T, a *regArgs, r *registration) { a.bridge = 0 }, status.BadHandle},
		{"random bridge", func(f *fixture, t *testing.T, a *regArgs, r *registration) { a.bridge = 0x7fff_1234_5678_9abc }, status.BadHandle},
		{"model as bridge", func(f *fixture, t *testing.T, a *regArgs, r *registration) { a.bridge = f.register(t, a.bridge, r) }, status.BadHandle},
		{"closed bridge", func(f *fixture, t *testing.T, a *regArgs, r *registration) {
			a.bridge = f.open(t, f.config(""))
			f.expect(t, mcbgo_bridge_close(a.bridge, f.eb, f.el), status.OK, "close")
		}, status.BadHandle},
		{"NULL out", func(f *fixture, t *testing.T, a *regArgs, r *registration) { a.out = nil }, status.InvalidArg},
		{"misaligned out", func(f *fixture, t *testing.T, a *regArgs, r *registration) { a.out = unsafe.Add(a.out, 4) }, status.InvalidArg},

		{"NULL params", func(f *fixture, t *testing.T, a *regArgs, r *registration) { a.params = nil }, status.InvalidArg},
		{"misaligned params", func(f *fixture, t *testing.T, a *regArgs, r *registration) {
			a.params = unsafe.Pointer(putT(t, f.c, *r.params, 4))
		}, status.InvalidArg},
		{"NULL llama_version", params(func(f *fixture, t *testing.T, p *cModelParams) { p.LlamaVersion = 0 }), status.InvalidArg},
		{"empty llama_version", params(func(f *fixture, t *testing.T, p *cModelParams) { p.LlamaVersion = f.c.cstr(t, "") }), status.InvalidArg},
		{"other llama_version", params(func(f *fixture, t *testing.T, p *cModelParams) { p.LlamaVersion = f.c.cstr(t, "b6000") }),
			status.ModelMismatch},
		{"llama_version with a trailing space", params(func(f *fixture, t *testing.T, p *cModelParams) {
			p.LlamaVersion = f.c.cstr(t, "v0.5.0 ")
		}), status.ModelMismatch},
		{"unterminated llama_version", unterminated(func(p *cModelParams) *uintptr { return &p.LlamaVersion }), status.InvalidArg},
		{"unterminated gguf_path", unterminated(func(p *cModelParams) *uintptr { return &p.GGUFPath }), status.InvalidArg},
		{"unterminated extra", unterminated(func(p *cModelParams) *uintptr { return &p.Extra }), status.InvalidArg},
		{"NULL gguf_path", params(func(f *fixture, t *testing.T, p *cModelParams) { p.GGUFPath = 0 }), status.InvalidArg},
		{"empty gguf_path", path(""), status.InvalidArg},
		{"missing GGUF", path("testdata/missing.gguf"), status.InvalidArg},
		{"GGUF path a directory", path("testdata"), status.InvalidArg},
		{"not a GGUF", path("testdata/weights.bin"), status.InvalidArg},
		{"GGUF cut in its metadata", func(f *fixture, t *testing.T, a *regArgs, r *registration) {
			r.params.GGUFPath = f.c.cstr(t, writeFile(t, "truncated.gguf", gguf[:64]))
		}, status.InvalidArg},
		{"block of 2^17 tokens", params(func(f *fixture, t *testing.T, p *cModelParams) { p.BlockTokens = 1 << 17 }), status.InvalidArg},
		{"a window cache's streams", params(func(f *fixture, t *testing.T, p *cModelParams) {
			p.PartialState, p.PartialKVStreams = f.c.cstr(t, "iswa window 8"), maxKVStreams
		}), status.OK},
		{"KV streams without a partial state", params(func(f *fixture, t *testing.T, p *cModelParams) { p.PartialKVStreams = 2 }), status.InvalidArg},
		{"more KV streams than a context has", params(func(f *fixture, t *testing.T, p *cModelParams) {
			p.PartialState, p.PartialKVStreams = f.c.cstr(t, "iswa window 8"), maxKVStreams+1
		}), status.InvalidArg},
		{"block bigger than half the pool", variant(model{block: 1024, kEmbd: []uint32{2048}, vEmbd: []uint32{2048}}), status.Config},

		{"NULL format", func(f *fixture, t *testing.T, a *regArgs, r *registration) { a.format = nil }, status.InvalidArg},
		{"misaligned format", func(f *fixture, t *testing.T, a *regArgs, r *registration) {
			a.format = unsafe.Pointer(putT(t, f.c, *r.format, 4))
		}, status.InvalidArg},
		{"no layers", format(func(f *fixture, t *testing.T, p *cKVFormat) { p.NLayer = 0 }), status.InvalidArg},
		{"5000 layers", format(func(f *fixture, t *testing.T, p *cKVFormat) { p.NLayer = 5000 }), status.InvalidArg},
		{"NULL n_embd_k_gqa", format(func(f *fixture, t *testing.T, p *cKVFormat) { p.NEmbdKGQA = 0 }), status.InvalidArg},
		{"NULL n_embd_v_gqa", format(func(f *fixture, t *testing.T, p *cKVFormat) { p.NEmbdVGQA = 0 }), status.InvalidArg},
		{"NULL k_row_bytes", format(func(f *fixture, t *testing.T, p *cKVFormat) { p.KRowBytes = 0 }), status.InvalidArg},
		{"NULL v_row_bytes", format(func(f *fixture, t *testing.T, p *cKVFormat) { p.VRowBytes = 0 }), status.InvalidArg},
		{"misaligned k_row_bytes", format(func(f *fixture, t *testing.T, p *cKVFormat) {
			p.KRowBytes = f.c.u32s(t, []uint32{0, 16, 32, 8}) + 2
		}), status.InvalidArg},
		{"no K dimensions", format(func(f *fixture, t *testing.T, p *cKVFormat) { p.NEmbdKGQA = f.c.u32s(t, []uint32{8, 0, 4}) }),
			status.InvalidArg},
		{"no V dimensions", format(func(f *fixture, t *testing.T, p *cKVFormat) { p.NEmbdVGQA = f.c.u32s(t, []uint32{8, 4, 0}) }),
			status.InvalidArg},
		// A layer may have no V (an indexer cache's beside an attention
		// cache's): then its probe layer has no V tensor either.
		{"no V in a layer whose probe has one", format(func(f *fixture, t *testing.T, p *cKVFormat) {
			p.NEmbdVGQA, p.VRowBytes = f.c.u32s(t, []uint32{8, 0, 12}), f.c.u32s(t, []uint32{16, 0, 24})
		}), status.Layout},
		{"V in a layer whose probe has none", func(f *fixture, t *testing.T, a *regArgs, r *registration) {
			variant(kOnlyModel(false))(f, t, a, r)
			fm := (*cKVFormat)(a.format)
			fm.NEmbdVGQA, fm.VRowBytes = f.c.u32s(t, []uint32{0, 0, 12}), f.c.u32s(t, []uint32{0, 0, 24})
		}, status.Layout},
		{"K-only with V rows", func(f *fixture, t *testing.T, a *regArgs, r *registration) {
			variant(kOnlyModel(false))(f, t, a, r)
			(*cKVFormat)(a.format).VRowBytes = f.c.u32s(t, []uint32{16, 16, 16})
		}, status.InvalidArg},
		{"K-only probe with a V tensor", func(f *fixture, t *testing.T, a *regArgs, r *registration) {
			variant(kOnlyModel(false))(f, t, a, r)
			ls := unsafe.Slice((*cKVLayer)(ptr((*cKVLayout)(a.probe).Layers)), 3)
			ls[1].V = ls[1].K
		}, status.Layout},
		{"K rows of other dimensions", format(func(f *fixture, t *testing.T, p *cKVFormat) {
			p.NEmbdKGQA = f.c.u32s(t, []uint32{8, 12, 4})
		}), status.InvalidArg},
		{"empty K row", format(func(f *fixture, t *testing.T, p *cKVFormat) { p.KRowBytes = f.c.u32s(t, []uint32{16, 0, 8}) }),
			status.InvalidArg},
		{"K row of half an element", format(func(f *fixture, t *testing.T, p *cKVFormat) {
			p.KRowBytes = f.c.u32s(t, []uint32{16, 31, 8})
		}), status.InvalidArg},
		{"K of a type no cache has", format(func(f *fixture, t *testing.T, p *cKVFormat) { p.TypeK = 99 }), status.Unsupported},
		{"transposed V of partial elements", func(f *fixture, t *testing.T, a *regArgs, r *registration) {
			variant(testModel(true))(f, t, a, r)
			(*cKVFormat)(a.format).VRowBytes = f.c.u32s(t, []uint32{16, 7, 24})
		}, status.InvalidArg},

		{"NULL probe", func(f *fixture, t *testing.T, a *regArgs, r *registration) { a.probe = nil }, status.InvalidArg},
		{"misaligned probe", func(f *fixture, t *testing.T, a *regArgs, r *registration) {
			a.probe = unsafe.Pointer(putT(t, f.c, *r.probe.layout, 4))
		}, status.InvalidArg},
		{"probe of fewer layers", probe(func(f *fixture, t *testing.T, lo *cKVLayout, _ []cKVLayer) { lo.NLayer-- }), status.Layout},
		{"probe of no layers", probe(func(f *fixture, t *testing.T, lo *cKVLayout, _ []cKVLayer) { lo.NLayer = 0 }), status.Layout},
		{"probe with V transposed", probe(func(f *fixture, t *testing.T, lo *cKVLayout, _ []cKVLayer) { lo.VTrans = true }), status.Layout},
		{"probe K stride below the row", probe(func(f *fixture, t *testing.T, _ *cKVLayout, ls []cKVLayer) { ls[1].KStride-- }), status.Layout},
		{"probe NULL V", probe(func(f *fixture, t *testing.T, _ *cKVLayout, ls []cKVLayer) { ls[2].V = 0 }), status.Layout},
		{"probe in device memory", probe(func(f *fixture, t *testing.T, lo *cKVLayout, _ []cKVLayer) { lo.Location = f.c.cstr(t, "cuda:0") }), status.Unsupported},
		{"probe location unterminated", probe(func(f *fixture, t *testing.T, lo *cKVLayout, _ []cKVLayer) {
			lo.Location = address(edgeString(t, 64, 'x'))
		}), status.InvalidArg},
		{"NULL probe cells", func(f *fixture, t *testing.T, a *regArgs, r *registration) { a.cells = nil }, status.InvalidArg},
		{"misaligned probe cells", func(f *fixture, t *testing.T, a *regArgs, r *registration) { a.cells = unsafe.Add(a.cells, 2) },
			status.InvalidArg},
		{"probe cell beyond the cache", probeCells(func(c []uint32) { c[7] = 16 }), status.Layout},
		{"probe cell 2^32-1", probeCells(func(c []uint32) { c[0] = math.MaxUint32 }), status.Layout},
		{"probe cell twice", probeCells(func(c []uint32) { c[5] = c[2] }), status.Layout},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t)
			r := testModel(false).reg(t, f.c)
			out := putT(t, f.c, [2]uint64{sentinel, sentinel}, 0) // room for a misaligned out
			a := regArgs{bridge: f.open(t, f.config("")), params: unsafe.Pointer(r.params), format: unsafe.Pointer(r.format),
				probe: unsafe.Pointer(r.probe.layout), cells: r.pcells, out: unsafe.Pointer(out)}
			c.mut(f, t, &a, r)
			probed := r.probe.snapshot()
			open := mcbgo_handles_open()
			got := mcbgo_model_register(a.bridge, a.params, a.format, a.probe, a.cells, a.out, f.eb, f.el)
			f.must(t, got, c.want, "register")
			assert.NoError(t, r.probe.checkUntouched(probed), "registering wrote into the probe")
			if c.want != status.OK {
				assert.Equal(t, [2]uint64{sentinel, sentinel}, *out, "a failed register wrote its output")
				assert.Equal(t, open, mcbgo_handles_open(), "a failed register left a handle")
				assert.NotEmpty(t, f.lastError())
				return
			}
			f.expect(t, mcbgo_model_unregister(out[0], f.eb, f.el), status.OK, "unregister")
			f.expect(t, mcbgo_model_unregister(out[0], f.eb, f.el), status.BadHandle, "second unregister")
		})
	}
}

// relayout copies a layout and its layer array into new host memory and
// lets mut change the copy.
func (f *fixture) relayout(t testing.TB, lo *cKVLayout, mut func(lo *cKVLayout, layers []cKVLayer)) unsafe.Pointer {
	n := int(lo.NLayer)
	b := f.c.alloc(t, n*int(unsafe.Sizeof(cKVLayer{})), 8)
	layers := unsafe.Slice((*cKVLayer)(pointer(b)), n)
	copy(layers, unsafe.Slice((*cKVLayer)(ptr(lo.Layers)), n))
	cp := putT(t, f.c, *lo, 0)
	cp.Layers = address(b)
	mut(cp, layers)
	return unsafe.Pointer(cp)
}

// TestModelKeySpaces checks the header's promise that registrations whose
// identity differs (the GGUF's bytes, the KV format, the probe's KV, the
// block size, extra) never share blocks, and that equal ones do, wherever
// the file or the probe's cells are.
func TestModelKeySpaces(t *testing.T) {
	f := newFixture(t)
	b := f.open(t, f.config(`,"block_tokens":4`))
	g := testModel(false)
	m := f.register(t, b, g.reg(t, f.c))
	tok := prompt(31, 0, 31)
	src := mustTensors(t, f.c, g, 64, false, tight)
	src.compute(tok, nil, len(tok))
	require.Equal(t, cSaveResult{NBlocks: 7, NWritten: 7, NQueued: 7}, f.save(t, m, nil, src, tok, len(tok), nil))
	f.awaitPublished(t, b, 7)

	gguf, err := os.ReadFile(ggufPath)
	require.NoError(t, err)
	copied := writeFile(t, "copy.gguf", gguf)
	same := func(*fixture, *testing.T, *registration) {}
	// reprobe computes the probe again in another cache, at cells.
	reprobe := func(n uint32, cells []uint32, pad func(l, kv int) int) func(*fixture, *testing.T, *registration) {
		return func(f *fixture, t *testing.T, r *registration) {
			p := mustTensors(t, f.c, r.probe.m, n, r.probe.vtrans, pad)
			p.compute(probeTokens, cells, len(cells))
			r.probe, r.cells, r.pcells = p, cells, f.cells(t, cells)
		}
	}
	cases := []struct {
		name   string
		g      model
		mut    func(f *fixture, t *testing.T, r *registration)
		shared bool
	}{
		{"same registration", g, same, true},
		{"a copy of the GGUF elsewhere", g, func(f *fixture, t *testing.T, r *registration) { r.params.GGUFPath = f.c.cstr(t, copied) }, true},
		{"block_tokens 0 takes the default", g, func(f *fixture, t *testing.T, r *registration) { r.params.BlockTokens = 0 }, true},
		{"empty extra is no extra", g, func(f *fixture, t *testing.T, r *registration) { r.params.Extra = f.c.cstr(t, "") }, true},
		{"probe at identity cells", g, reprobe(8, wrapCells(8, 0, 8), tight), true},
		{"probe in padded strides of a bigger cache", g, reprobe(40, reversed(8, 40), func(l, kv int) int { return 2*l + kv + 2 }), true},
		{"other weights", g, func(f *fixture, t *testing.T, r *registration) { r.params.GGUFPath = f.c.cstr(t, otherGGUF) }, false},
		{"block_tokens", g, func(f *fixture, t *testing.T, r *registration) { r.params.BlockTokens = 2 }, false},
		{"extra", g, func(f *fixture, t *testing.T, r *registration) { r.params.Extra = f.c.cstr(t, "swa=4096") }, false},
		{"n_embd_k_gqa", model{block: 4, kEmbd: []uint32{8, 16, 8}, vEmbd: []uint32{8, 4, 12}}, same, false},
		{"one layer less", model{block: 4, kEmbd: []uint32{8, 16}, vEmbd: []uint32{8, 4}}, same, false},
		{"type_k f32", g, func(f *fixture, t *testing.T, r *registration) {
			r.format.TypeK = 0 // the same rows hold half the elements
			r.format.NEmbdKGQA = f.c.u32s(t, []uint32{4, 8, 2})
		}, false},
		{"type_v bf16", g, func(f *fixture, t *testing.T, r *registration) { r.format.TypeV = 30 }, false},
		{"V transposed", testModel(true), same, false},
		{"probe KV one bit off", g, func(f *fixture, t *testing.T, r *registration) {
			r.probe.region[r.probe.at(1, 1, r.cells[3], 2)] ^= 1
		}, false},
		{"probe of other tokens", g, func(f *fixture, t *testing.T, r *registration) {
			r.probe.compute(prompt(len(probeTokens), 0, 0), r.cells, len(probeTokens))
		}, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := c.g.reg(t, f.c)
			c.mut(f, t, r)
			m2 := f.register(t, b, r)
			defer func() { f.expect(t, mcbgo_model_unregister(m2, f.eb, f.el), status.OK, "unregister") }()
			lk := f.peek(t, m2, nil, tok, len(tok))
			assert.Equal(t, c.shared, lk.NMatchedBlocks > 0, "matched %d blocks of the first registration", lk.NMatchedBlocks)
		})
	}

	// Scopes: the blocks saved without one, and under tenant-a with two
	// adapters, are found by the scopes that name the same key space.
	a, aCopy, bb := writeFile(t, "a.lora", []byte("adapter a")), writeFile(t, "a-copy.lora", []byte("adapter a")), writeFile(t, "b.lora", []byte("adapter b"))
	tenant := f.scope(t, "tenant-a", adapter{a, 0.5}, adapter{bb, 1})
	require.Equal(t, cSaveResult{NBlocks: 7, NWritten: 7, NQueued: 7}, f.save(t, m, tenant, src, tok, len(tok), nil))
	f.awaitPublished(t, b, 14)
	none := f.scopeID(t, nil)
	scoped := f.scopeID(t, tenant)
	scopes := []struct {
		name           string
		scope          *cScope
		base, inTenant bool
	}{
		{"no scope", nil, true, false},
		{"empty scope", f.scope(t, ""), true, false},
		{"salt pointer with length 0", putT(t, f.c, cScope{TenantSalt: f.c.cstr(t, "ignored")}, 0), true, false},
		{"adapters pointer with none", putT(t, f.c, cScope{Adapters: address(f.c.alloc(t, 16, 8))}, 0), true, false},
		{"an adapter at scale 0", f.scope(t, "", adapter{a, 0}), true, false},
		{"a missing adapter at scale 0", f.scope(t, "", adapter{"testdata/missing.lora", 0}), true, false},
		{"the tenant alone", f.scope(t, "tenant-a"), false, false},
		{"salt with a NUL", putT(t, f.c, cScope{TenantSalt: f.c.cstr(t, "a\x00b"), TenantSaltLen: 3}, 0), false, false},
		{"the adapters alone", f.scope(t, "", adapter{a, 0.5}, adapter{bb, 1}), false, false},
		{"the same scope", f.scope(t, "tenant-a", adapter{a, 0.5}, adapter{bb, 1}), false, true},
		{"adapters in the other order", f.scope(t, "tenant-a", adapter{bb, 1}, adapter{a, 0.5}), false, true},
		{"an adapter from another path", f.scope(t, "tenant-a", adapter{aCopy, 0.5}, adapter{bb, 1}), false, true},
		{"and one more at scale 0", f.scope(t, "tenant-a", adapter{a, 0.5}, adapter{aCopy, 0}, adapter{bb, 1}), false, true},
		{"an adapter at another scale", f.scope(t, "tenant-a", adapter{a, 0.25}, adapter{bb, 1}), false, false},
		{"an adapter at a negative scale", f.scope(t, "tenant-a", adapter{a, -0.5}, adapter{bb, 1}), false, false},
		{"another tenant", f.scope(t, "tenant-b", adapter{a, 0.5}, adapter{bb, 1}), false, false},
		{"one adapter less", f.scope(t, "tenant-a", adapter{a, 0.5}), false, false},
	}
	for _, c := range scopes {
		t.Run("scope/"+c.name, func(t *testing.T) {
			lk := f.peek(t, m, c.scope, tok, len(tok))
			assert.Equal(t, c.base || c.inTenant, lk.NMatchedBlocks > 0, "matched %d blocks", lk.NMatchedBlocks)
			id := f.scopeID(t, c.scope)
			assert.Equal(t, c.base, id == none, "scope id %x, no scope's %x", id, none)
			assert.Equal(t, c.inTenant, id == scoped, "scope id %x, the tenant's %x", id, scoped)
		})
	}
}

// scopeID is mcb_scope_id of a scope that must be valid.
func (f *fixture) scopeID(t testing.TB, scope *cScope) [16]byte {
	t.Helper()
	out := putT(t, f.c, [16]byte{}, 0)
	f.must(t, mcbgo_scope_id(unsafe.Pointer(scope), unsafe.Pointer(out), f.eb, f.el), status.OK, "scope id")
	return *out
}

// TestScopeID passes mcb_scope_id hostile scopes and outputs: each is
// refused with INVALID_ARG and leaves the output as it was. (Which scopes
// name the same key space is TestModelKeySpaces's.)
func TestScopeID(t *testing.T) {
	f := newFixture(t)
	a := writeFile(t, "a.lora", []byte("adapter a"))
	good := cAdapter{Path: f.c.cstr(t, a), Scale: 1}
	many := make([]cAdapter, host.MaxAdapters+1)
	for i := range many {
		many[i] = good
	}
	cases := []struct {
		name  string
		scope *cScope
		want  status.Code
	}{
		{"NULL", nil, status.OK},
		{"an adapter", f.scope(t, "t", adapter{a, 1}), status.OK},
		{"salt at the limit", putT(t, f.c, cScope{TenantSalt: address(f.c.alloc(t, maxSaltBytes, 1)), TenantSaltLen: maxSaltBytes}, 0), status.OK},
		{"the most adapters", putT(t, f.c, cScope{Adapters: f.adapters(t, many[1:]...), NAdapters: host.MaxAdapters}, 0), status.OK},
		{"misaligned", putT(t, f.c, cScope{}, 4), status.InvalidArg},
		{"salt NULL with a length", putT(t, f.c, cScope{TenantSaltLen: 8}, 0), status.InvalidArg},
		{"salt over the limit",
			putT(t, f.c, cScope{TenantSalt: address(f.c.alloc(t, maxSaltBytes+1, 1)), TenantSaltLen: maxSaltBytes + 1}, 0), status.InvalidArg},
		{"salt of 2^64-1 bytes", putT(t, f.c, cScope{TenantSalt: f.c.cstr(t, "s"), TenantSaltLen: math.MaxUint64}, 0), status.InvalidArg},
		{"adapters NULL with a count", putT(t, f.c, cScope{NAdapters: 1}, 0), status.InvalidArg},
		{"misaligned adapters", putT(t, f.c, cScope{Adapters: f.adapters(t, good, good) + 4, NAdapters: 1}, 0), status.InvalidArg},
		{"one adapter over the limit", putT(t, f.c, cScope{Adapters: f.adapters(t, many...), NAdapters: host.MaxAdapters + 1}, 0), status.InvalidArg},
		{"2^40 adapters", putT(t, f.c, cScope{Adapters: f.adapters(t, good), NAdapters: 1 << 40}, 0), status.InvalidArg},
		{"adapter path NULL", putT(t, f.c, cScope{Adapters: f.adapters(t, good, cAdapter{Scale: 1}), NAdapters: 2}, 0), status.InvalidArg},
		{"adapter path empty at scale 0", f.scope(t, "", adapter{"", 0}), status.InvalidArg},
		{"adapter path unterminated",
			putT(t, f.c, cScope{Adapters: f.adapters(t, cAdapter{Path: address(edgeString(t, maxString, 'x')), Scale: 1}), NAdapters: 1}, 0),
			status.InvalidArg},
		{"longest adapter path", putT(t, f.c, cScope{Adapters: f.adapters(t, cAdapter{Path: address(edgeString(t, maxString, 0))}), NAdapters: 1}, 0),
			status.OK},
		{"missing adapter file", f.scope(t, "", adapter{a, 1}, adapter{"testdata/missing.lora", 0.5}), status.InvalidArg},
		{"adapter a directory", f.scope(t, "", adapter{"testdata", 1}), status.InvalidArg},
		{"adapter at scale NaN", f.scope(t, "", adapter{a, float32(math.NaN())}), status.InvalidArg},
		{"adapter at scale -Inf", f.scope(t, "", adapter{a, float32(math.Inf(-1))}), status.InvalidArg},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			out := putT(t, f.c, [17]byte{}, 0)
			for i := range out {
				out[i] = 0xa5
			}
			f.expect(t, mcbgo_scope_id(unsafe.Pointer(c.scope), unsafe.Pointer(out), f.eb, f.el), c.want, "scope id")
			assert.Equal(t, byte(0xa5), out[16], "wrote past the 16 bytes of the id")
			if c.want != status.OK {
				assert.Equal(t, bytes.Repeat([]byte{0xa5}, 17), out[:], "a refused scope id wrote its output")
				assert.NotEmpty(t, f.lastError())
				return
			}
			// An id is a digest: the same scope gives it again, into any
			// bytes (the output has no alignment).
			odd := unsafe.Add(unsafe.Pointer(putT(t, f.c, [17]byte{}, 0)), 1)
			f.expect(t, mcbgo_scope_id(unsafe.Pointer(c.scope), odd, f.eb, f.el), status.OK, "scope id into odd bytes")
			assert.Equal(t, out[:16], unsafe.Slice((*byte)(odd), 16))
			assert.NotEqual(t, make([]byte, 16), out[:16])
		})
	}
	f.expect(t, mcbgo_scope_id(nil, nil, f.eb, f.el), status.InvalidArg, "scope id into NULL")
	assert.NotEqual(t, f.scopeID(t, f.scope(t, "t1")), f.scopeID(t, f.scope(t, "t2")), "salts name tenants")
}

func TestObservePrefill(t *testing.T) {
	f := newFixture(t)
	b := f.open(t, f.config(""))
	m := f.register(t, b, testModel(false).reg(t, f.c))
	gone := f.register(t, b, testModel(false).reg(t, f.c))
	f.expect(t, mcbgo_model_unregister(gone, f.eb, f.el), status.OK, "unregister")
	cases := []struct {
		name       string
		model      uint64
		start, end uint32
		seconds    float64
		want       status.Code
	}{
		{"valid", m, 0, 512, 0.25, status.OK},
		{"continuation", m, 512, 1024, 0.3, status.OK},
		{"beyond a time.Duration", m, 0, 64, 1e300, status.OK},
		{"empty range", m, 64, 64, 0.1, status.InvalidArg},
		{"backwards", m, 128, 64, 0.1, status.InvalidArg},
		{"zero seconds", m, 0, 64, 0, status.InvalidArg},
		{"negative seconds", m, 0, 64, -1, status.InvalidArg},
		{"NaN seconds", m, 0, 64, math.NaN(), status.InvalidArg},
		{"infinite seconds", m, 0, 64, math.Inf(1), status.InvalidArg},
		{"model 0", 0, 0, 64, 0.1, status.BadHandle},
		{"bridge as model", b, 0, 64, 0.1, status.BadHandle},
		{"unregistered model", gone, 0, 64, 0.1, status.BadHandle},
		{"random model", 0x0123_4567_89ab_cdef, 0, 64, 0.1, status.BadHandle},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f.expect(t, mcbgo_model_observe_prefill(c.model, c.start, c.end, c.seconds, f.eb, f.el), c.want, "observe prefill")
		})
	}
}

// TestRoundTrip drives every export the way llama.cpp does: save a
// prompt's blocks layer by layer from one set of tensors, look them up
// (from another bridge: until the publisher has shown them to it), and
// restore the plan layer by layer into other cells of other tensors,
// checking every byte of the tensors after each layer.
func TestRoundTrip(t *testing.T) {
	const cells, n = 64, 7*4 + 3
	padded := func(l, kv int) int { return 8*l + 2*kv + 6 }
	cases := []struct {
		name     string
		vtrans   bool
		peer     bool // restore through the transport from another bridge's pool
		pad      func(l, kv int) int
		src, dst []uint32
		scoped   bool
		kOnly    bool // the model has no V (MLA)
		mixed    bool // its last layer has no V (an indexer cache's beside an attention cache's)
	}{
		{name: "row-major", src: wrapCells(n, 40, cells), dst: reversed(n, cells), pad: tight},
		{name: "transposed V", vtrans: true, src: wrapCells(n, 40, cells), dst: reversed(n, cells), pad: tight},
		{name: "identity cells", pad: tight},
		{name: "padded strides", src: wrapCells(n, 50, cells), dst: wrapCells(n, 3, cells), pad: padded},
		{name: "padded transposed", vtrans: true, src: reversed(n, cells), dst: wrapCells(n, 60, cells), pad: padded},
		{name: "tenant and adapters", src: wrapCells(n, 9, cells), dst: reversed(n, cells), pad: tight, scoped: true},
		{name: "from a peer", peer: true, src: wrapCells(n, 40, cells), dst: reversed(n, cells), pad: tight},
		{name: "from a peer, transposed", peer: true, vtrans: true, src: wrapCells(n, 33, cells), dst: wrapCells(n, 1, cells), pad: padded},
		{name: "from a peer, scoped", peer: true, src: reversed(n, cells), dst: wrapCells(n, 20, cells), pad: tight, scoped: true},
		{name: "K-only", kOnly: true, src: wrapCells(n, 40, cells), dst: reversed(n, cells), pad: tight},
		{name: "K-only padded, V transposed", kOnly: true, vtrans: true, src: reversed(n, cells), dst: wrapCells(n, 60, cells), pad: padded},
		{name: "K-only from a peer", kOnly: true, peer: true, src: wrapCells(n, 33, cells), dst: wrapCells(n, 1, cells), pad: tight},
		{name: "a layer without V from a peer", mixed: true, peer: true, src: wrapCells(n, 33, cells), dst: reversed(n, cells), pad: padded},
		{name: "a layer without V, V transposed", mixed: true, vtrans: true, src: reversed(n, cells), dst: wrapCells(n, 60, cells), pad: tight},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t)
			g := testModel(c.vtrans)
			if c.kOnly {
				g = kOnlyModel(c.vtrans)
			}
			if c.mixed {
				g.vEmbd = []uint32{8, 4, 0}
			}
			saver := f.open(t, f.config(""))
			loader := saver
			if c.peer {
				loader = f.open(t, f.config(""))
			}
			ms := f.register(t, saver, g.reg(t, f.c))
			ml := ms
			if c.peer {
				ml = f.register(t, loader, g.reg(t, f.c))
			}
			var scope *cScope
			if c.scoped {
				scope = f.scope(t, "tenant-a", adapter{writeFile(t, "a.lora", []byte("a")), 0.5}, adapter{writeFile(t, "b.lora", []byte("b")), 1})
			}
			tok := prompt(40, 0, 40)
			B := int(g.block)

			lk := f.lookup(t, ml, scope, tok, n, 0)
			assert.Equal(t, cLookupResult{NBlockTokens: g.block, Reason: int32(arbiter.NoMatch), EstRestoreMS: lk.EstRestoreMS,
				EstRecomputeMS: lk.EstRecomputeMS, EstTotalMS: lk.EstTotalMS}, lk, "cold lookup")

			src := mustTensors(t, f.c, g, cells, c.vtrans, c.pad)
			src.compute(tok, c.src, n)
			computed := src.snapshot()
			assert.Equal(t, cSaveResult{NBlocks: 7, NWritten: 7, NQueued: 7}, f.save(t, ms, scope, src, tok, n, c.src), "save")
			assert.NoError(t, src.checkUntouched(computed), "the save wrote into its source")

			lk, p := f.awaitMatch(t, ml, scope, tok, n, 7)
			f.awaitPublished(t, saver, 7)
			assert.True(t, lk.NMatchedBlocks == 7 && lk.NRestoreTokens == uint32(7*B) && lk.Reason == int32(arbiter.PolicyForced) &&
				lk.NBlockTokens == g.block && lk.EstRestoreMS >= 0 && lk.EstTotalMS >= 0, "warm lookup: %+v", lk)
			// The last token is always computed, so a prompt of exactly 7
			// blocks can restore 6 of them.
			r := f.peek(t, ml, scope, tok, 7*B)
			assert.True(t, r.NMatchedBlocks == 6 && r.NRestoreTokens == uint32(6*B), "lookup of 7 whole blocks: %+v", r)

			dst := mustTensors(t, f.c, g, cells, c.vtrans, c.pad)
			want := cLoadResult{NBlocks: 7, NBlocksOK: 7, NTokensOK: uint32(7 * B), NBytes: uint64(7 * g.payload())}
			assert.Equal(t, want, f.load(t, lk.Plan, dst, tok, 7*B, c.dst), "load")

			// What the host now holds no restore can beat; holding less,
			// it gets every block again.
			held := f.lookup(t, ml, scope, tok, n, 7*B)
			assert.Equal(t, cLookupResult{NBlockTokens: g.block, NMatchedBlocks: 7, Reason: int32(arbiter.Local), EstRestoreMS: held.EstRestoreMS,
				EstRecomputeMS: held.EstRecomputeMS, EstTotalMS: held.EstTotalMS}, held, "lookup holding the restored prefix")
			part := f.lookup(t, ml, scope, tok, n, 7*B-1)
			require.Equal(t, uint32(7*B), part.NRestoreTokens, "lookup holding less than the restored prefix: %+v", part)
			more := mustTensors(t, f.c, g, cells, c.vtrans, c.pad)
			assert.Equal(t, want, f.load(t, part.Plan, more, tok, 7*B, wrapCells(7*B, 17, cells)), "second load")

			assert.Equal(t, cSaveResult{NBlocks: 7, NKnown: 7}, f.save(t, ms, scope, src, tok, n, c.src), "second save")

			st := f.stats(t, loader)
			assert.Equal(t, uint64(p.lookups+4), st.Lookups, "loader lookups")
			assert.Equal(t, uint64(p.hits+3), st.Hits, "loader hits")
			assert.Equal(t, uint64(1+p.lookups-p.hits), st.Misses, "loader misses")
			assert.Equal(t, uint64(p.restores+2), st.DecidedRestore, "loader restores")
			assert.Equal(t, uint64(1), st.DecidedLocal, "loader local decisions")
			assert.Equal(t, uint64(p.hits-p.restores), st.DecidedRecompute, "loader recomputes")
			assert.True(t, st.Loads == 2 && st.LoadFailures == 0 && st.RestoredTokens == uint64(14*B) &&
				st.RestoredBytes == uint64(14*g.payload()) && st.PoolBytes == 16<<20, "loader stats: %+v", st)
			st = f.stats(t, saver)
			assert.True(t, st.Saves == 2 && st.SavedBlocks == 7 && st.DedupedBlocks == 0 && st.SaveFailures == 0 && st.ResidentBlocks == 7 &&
				st.ResidentBytes >= uint64(7*g.payload()) && st.ResidentBytes <= st.PoolBytes, "saver stats: %+v", st)
			if c.peer {
				f.expect(t, mcbgo_bridge_close(loader, f.eb, f.el), status.OK, "close loader")
			}
			f.expect(t, mcbgo_bridge_close(saver, f.eb, f.el), status.OK, "close")
			f.expect(t, mcbgo_lookup(ms, nil, f.c.i32s(t, tok), n, 0, unsafe.Pointer(putT(t, f.c, cLookupResult{}, 0)), f.eb, f.el),
				status.BadHandle, "lookup after close")
		})
	}
}

// published opens a bridge, registers the test model and publishes the
// first saved tokens of a 40-token prompt computed into 64 cells: where
// most tests of lookups and loads start.
func (f *fixture) published(t *testing.T, vtrans bool, saved int) (g model, b, m uint64, tok []int32, src *tensors) {
	t.Helper()
	g = testModel(vtrans)
	b = f.open(t, f.config(""))
	m = f.register(t, b, g.reg(t, f.c))
	tok = prompt(40, 0, 40)
	src = mustTensors(t, f.c, g, 64, vtrans, tight)
	src.compute(tok, nil, 40)
	f.save(t, m, nil, src, tok, saved, nil)
	f.awaitPublished(t, b, saved/int(g.block))
	return g, b, m, tok, src
}

// TestLookupCached: what the host already holds is part of the decision.
// A restore must go past it; one that cannot is LOCAL, with no plan.
func TestLookupCached(t *testing.T) {
	f := newFixture(t)
	g, b, m, tok, _ := f.published(t, false, 28)
	B := int(g.block)
	cases := []struct {
		name    string
		n       int
		cached  uint64
		restore int
		reason  arbiter.ReasonCode
	}{
		{"nothing held", 31, 0, 7 * B, arbiter.PolicyForced},
		{"a block held", 31, uint64(B), 7 * B, arbiter.PolicyForced},
		{"all but a token of the match held", 31, uint64(7*B - 1), 7 * B, arbiter.PolicyForced},
		{"the match held", 31, uint64(7 * B), 0, arbiter.Local},
		{"more than the match held", 40, 30, 0, arbiter.Local},
		{"the whole prompt held", 31, 31, 0, arbiter.Local},
		{"a longer prompt, its match held", 40, uint64(7 * B), 0, arbiter.Local},
		{"all but the last token held", 40, 39, 0, arbiter.Local},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := f.lookup(t, m, nil, tok, c.n, int(c.cached))
			defer f.drop(t, r.Plan)
			assert.Equal(t, c.restore, int(r.NRestoreTokens), "%+v", r)
			assert.Equal(t, c.reason.String(), arbiter.ReasonCode(r.Reason).String(), "%+v", r)
			assert.Equal(t, uint32(7), r.NMatchedBlocks)
		})
	}
	res := putT(t, f.c, cLookupResult{NBlockTokens: 12345}, 0)
	for _, cached := range []uint64{32, 1 << 40, math.MaxUint64} {
		f.expect(t, mcbgo_lookup(m, nil, f.c.i32s(t, tok), 31, cached, unsafe.Pointer(res), f.eb, f.el), status.InvalidArg, "lookup holding more than the prompt")
		assert.Equal(t, cLookupResult{NBlockTokens: 12345}, *res, "a refused lookup wrote its output")
	}
	st := f.stats(t, b)
	assert.Equal(t, cStats{Lookups: 8, Hits: 8, DecidedRestore: 3, DecidedLocal: 5, Saves: 1, SavedBlocks: st.SavedBlocks,
		ResidentBlocks: 7, ResidentBytes: st.ResidentBytes, PoolBytes: 16 << 20}, st)
}

// TestOwnBlocksAtOnce: the bridge that sealed blocks restores them at
// once, before and while the publisher shows them to the directory, and
// after: every lookup from the save's end on matches all of them.
func TestOwnBlocksAtOnce(t *testing.T) {
	f := newFixture(t)
	g := testModel(false)
	b := f.open(t, f.config(""))
	m := f.register(t, b, g.reg(t, f.c))
	src := mustTensors(t, f.c, g, 40, false, tight)
	for r := 0; r < 50; r++ {
		tok := prompt(33, r, 0)
		src.compute(tok, nil, 33)
		f.save(t, m, nil, src, tok, 33, nil)
		for i := 0; i < 20; i++ {
			require.EqualValues(t, 8, f.peek(t, m, nil, tok, 33).NMatchedBlocks, "prompt %d, lookup %d after the save", r, i)
		}
	}
}

// TestPlanLifecycle: a plan is a handle like any other (counted, never
// reused, BAD_HANDLE to a call that wants another kind) and is used once:
// loaded, restored into a state or dropped. A load that is refused
// consumes it as one that begins does, and closing its bridge drops it.
func TestPlanLifecycle(t *testing.T) {
	f := newFixture(t)
	g := testModel(false)
	b := f.open(t, f.config(""))
	r := g.reg(t, f.c)
	m := f.register(t, b, r)
	tok := prompt(40, 0, 40)
	src := mustTensors(t, f.c, g, 64, false, tight)
	src.compute(tok, nil, 40)
	f.save(t, m, nil, src, tok, 40, nil)
	f.awaitPublished(t, b, 10)
	const restore = 36 // the nine blocks before the last token
	plan := func(t *testing.T) uint64 {
		t.Helper()
		open := mcbgo_handles_open()
		lk := f.lookup(t, m, nil, tok, 40, 0)
		require.Equal(t, uint32(restore), lk.NRestoreTokens)
		require.Equal(t, open+1, mcbgo_handles_open(), "a plan is a handle")
		return lk.Plan
	}
	dst := mustTensors(t, f.c, g, 64, false, tight)
	lo := unsafe.Pointer(dst.layout)
	ld := f.out(t)
	nok := unsafe.Pointer(putT(t, f.c, uint32(0), 0))
	lres := unsafe.Pointer(putT(t, f.c, cLoadResult{}, 0))
	sres := unsafe.Pointer(putT(t, f.c, cSaveResult{}, 0))
	lkres := unsafe.Pointer(putT(t, f.c, cLookupResult{}, 0))
	stats := unsafe.Pointer(putT(t, f.c, cStats{}, 0))
	blob, blobLen := unsafe.Pointer(putT(t, f.c, uintptr(0), 0)), unsafe.Pointer(putT(t, f.c, uint64(0), 0))
	toks := f.c.i32s(t, tok)

	t.Run("dropped", func(t *testing.T) {
		p := plan(t)
		f.expect(t, mcbgo_plan_drop(p, f.eb, f.el), status.OK, "drop")
		f.expect(t, mcbgo_plan_drop(p, f.eb, f.el), status.BadHandle, "drop twice")
		f.expect(t, mcbgo_load_begin(p, lo, nil, unsafe.Pointer(ld), f.eb, f.el), status.BadHandle, "load a dropped plan")
		f.expect(t, mcbgo_state_restore(p, blob, blobLen, lres, f.eb, f.el), status.BadHandle, "restore a dropped plan")
		assert.Equal(t, uint64(sentinel), *ld)
	})
	t.Run("loaded", func(t *testing.T) {
		p := plan(t)
		before := dst.snapshot()
		f.must(t, mcbgo_load_begin(p, lo, nil, unsafe.Pointer(ld), f.eb, f.el), status.OK, "load")
		f.expect(t, mcbgo_load_begin(p, lo, nil, unsafe.Pointer(f.out(t)), f.eb, f.el), status.BadHandle, "load twice")
		f.expect(t, mcbgo_plan_drop(p, f.eb, f.el), status.BadHandle, "drop a loaded plan")
		f.expect(t, mcbgo_load_end(*ld, lres, f.eb, f.el), status.OK, "load end")
		assert.NoError(t, dst.checkRestore(before, tok, nil, restore, restore, g.layers()))
	})
	stale := wrapCells(restore, 60, 64)
	ld = f.out(t) // the outputs of refused loads, which keep their sentinel
	refusals := []struct {
		name string
		call func(p uint64) int32
		want status.Code
	}{
		{"NULL out", func(p uint64) int32 { return mcbgo_load_begin(p, lo, nil, nil, f.eb, f.el) }, status.InvalidArg},
		{"NULL layout", func(p uint64) int32 { return mcbgo_load_begin(p, nil, nil, unsafe.Pointer(ld), f.eb, f.el) }, status.InvalidArg},
		{"a layout of another model", func(p uint64) int32 {
			return mcbgo_load_begin(p, f.relayout(t, dst.layout, func(lo *cKVLayout, _ []cKVLayer) { lo.NLayer-- }), nil, unsafe.Pointer(ld), f.eb, f.el)
		}, status.Layout},
		{"device memory", func(p uint64) int32 {
			return mcbgo_load_begin(p, f.relayout(t, dst.layout, func(lo *cKVLayout, _ []cKVLayer) { lo.Location = f.c.cstr(t, "cuda:0") }), nil,
				unsafe.Pointer(ld), f.eb, f.el)
		}, status.Unsupported},
		{"a cell twice", func(p uint64) int32 {
			c := append([]uint32(nil), stale...)
			c[30] = c[3]
			return mcbgo_load_begin(p, lo, f.cells(t, c), unsafe.Pointer(ld), f.eb, f.el)
		}, status.Layout},
		{"into a state", func(p uint64) int32 { return mcbgo_state_restore(p, blob, blobLen, lres, f.eb, f.el) }, status.Unsupported},
		{"into a state, NULL blob", func(p uint64) int32 { return mcbgo_state_restore(p, nil, blobLen, lres, f.eb, f.el) }, status.InvalidArg},
	}
	for _, c := range refusals {
		t.Run("consumed by a refusal/"+c.name, func(t *testing.T) {
			p := plan(t)
			before := dst.snapshot()
			open := mcbgo_handles_open()
			f.expect(t, c.call(p), c.want, c.name)
			assert.NoError(t, dst.checkUntouched(before), "a refused load touched the tensors")
			assert.Equal(t, open-1, mcbgo_handles_open(), "the plan outlived its refusal")
			f.expect(t, mcbgo_plan_drop(p, f.eb, f.el), status.BadHandle, "drop after a refusal")
			assert.Equal(t, uint64(sentinel), *ld)
			assert.Zero(t, *(*uintptr)(blob))
		})
	}
	t.Run("wrong kinds", func(t *testing.T) {
		p := plan(t)
		load := f.out(t)
		f.must(t, mcbgo_load_begin(plan(t), lo, f.cells(t, stale), unsafe.Pointer(load), f.eb, f.el), status.OK, "load")
		out := unsafe.Pointer(f.out(t))
		calls := []struct {
			name string
			call func() int32
		}{
			{"lookup on a plan", func() int32 { return mcbgo_lookup(p, nil, toks, 40, 0, lkres, f.eb, f.el) }},
			{"save on a plan", func() int32 { return mcbgo_save_begin(p, nil, lo, toks, 40, nil, out, f.eb, f.el) }},
			{"save a state on a plan", func() int32 { return mcbgo_state_save(p, nil, toks, 160, toks, 40, sres, f.eb, f.el) }},
			{"observe on a plan", func() int32 { return mcbgo_model_observe_prefill(p, 0, 64, 0.1, f.eb, f.el) }},
			{"unregister a plan", func() int32 { return mcbgo_model_unregister(p, f.eb, f.el) }},
			{"stats of a plan", func() int32 { return mcbgo_bridge_stats(p, stats, f.eb, f.el) }},
			{"close a plan", func() int32 { return mcbgo_bridge_close(p, f.eb, f.el) }},
			{"register on a plan", func() int32 { return f.registerCall(p, r, out) }},
			{"register a state on a plan", func() int32 {
				return mcbgo_model_register_state(p, unsafe.Pointer(r.params), toks, 160, out, f.eb, f.el)
			}},
			{"wait on a plan", func() int32 { return mcbgo_load_wait_layer(p, 0, nok, f.eb, f.el) }},
			{"end a plan", func() int32 { return mcbgo_load_end(p, lres, f.eb, f.el) }},
			{"save a layer of a plan", func() int32 { return mcbgo_save_layer(p, 0, f.eb, f.el) }},
			{"end a plan as a save", func() int32 { return mcbgo_save_end(p, sres, f.eb, f.el) }},
			{"drop a model", func() int32 { return mcbgo_plan_drop(m, f.eb, f.el) }},
			{"drop a bridge", func() int32 { return mcbgo_plan_drop(b, f.eb, f.el) }},
			{"drop a load", func() int32 { return mcbgo_plan_drop(*load, f.eb, f.el) }},
			{"drop plan 0", func() int32 { return mcbgo_plan_drop(0, f.eb, f.el) }},
			{"drop a handle never issued", func() int32 { return mcbgo_plan_drop(p+1<<40, f.eb, f.el) }},
			{"load a model", func() int32 { return mcbgo_load_begin(m, lo, nil, out, f.eb, f.el) }},
			{"load a load", func() int32 { return mcbgo_load_begin(*load, lo, nil, out, f.eb, f.el) }},
			{"restore a model into a state", func() int32 { return mcbgo_state_restore(m, blob, blobLen, lres, f.eb, f.el) }},
		}
		for _, c := range calls {
			f.expect(t, c.call(), status.BadHandle, c.name)
		}
		assert.Equal(t, uint64(sentinel), *(*uint64)(out), "a call on a wrong handle wrote its output")
		f.expect(t, mcbgo_load_wait_layer(*load, uint32(g.layers()-1), nok, f.eb, f.el), status.OK, "the load, after all that")
		f.expect(t, mcbgo_load_end(*load, lres, f.eb, f.el), status.OK, "its end")
		f.expect(t, mcbgo_plan_drop(p, f.eb, f.el), status.OK, "the plan, after all that")
	})
	t.Run("dropped with their bridge", func(t *testing.T) {
		b2 := f.open(t, f.config(""))
		m2 := f.register(t, b2, g.reg(t, f.c))
		first, _ := f.awaitMatch(t, m2, nil, tok, 40, restore/int(g.block))
		second := f.lookup(t, m2, nil, tok, 40, 0)
		require.NotZero(t, second.Plan)
		open := mcbgo_handles_open()
		f.expect(t, mcbgo_bridge_close(b2, f.eb, f.el), status.OK, "close with plans open")
		assert.Equal(t, open-4, mcbgo_handles_open(), "the bridge, its model and its two plans")
		f.expect(t, mcbgo_plan_drop(first.Plan, f.eb, f.el), status.BadHandle, "drop a plan of a closed bridge")
		f.expect(t, mcbgo_load_begin(second.Plan, lo, nil, unsafe.Pointer(ld), f.eb, f.el), status.BadHandle, "load a plan of a closed bridge")
	})
}

// loadArgs is the argument list of mcb_load_begin.
type loadArgs struct {
	plan               uint64
	layout, cells, out unsafe.Pointer
}

// layoutChange is a hostile change to a layout and what it calls for.
type layoutChange struct {
	name string
	mut  func(f *fixture, t *testing.T, lo *cKVLayout, ls []cKVLayer)
	want status.Code
}

// layoutChanges are the hostile layouts loads and saves alike refuse.
func layoutChanges(g model, cells uint32) []layoutChange {
	shortV := func(f *fixture, t *testing.T, lo *cKVLayout, ls []cKVLayer) { ls[2].VStride = uint64(g.vrow(2) - 1) }
	if g.vtrans {
		shortV = func(f *fixture, t *testing.T, lo *cKVLayout, ls []cKVLayer) {
			ls[2].VStride = uint64((cells - 1) * elem)
		}
	}
	return []layoutChange{
		{"layout of 0 layers", func(f *fixture, t *testing.T, lo *cKVLayout, _ []cKVLayer) { lo.NLayer = 0 }, status.Layout},
		{"layout of 5000 layers", func(f *fixture, t *testing.T, lo *cKVLayout, _ []cKVLayer) { lo.NLayer = 5000 }, status.Layout},
		{"layout of fewer layers", func(f *fixture, t *testing.T, lo *cKVLayout, _ []cKVLayer) { lo.NLayer-- }, status.Layout},
		{"NULL layers", func(f *fixture, t *testing.T, lo *cKVLayout, _ []cKVLayer) { lo.Layers = 0 }, status.InvalidArg},
		{"misaligned layers", func(f *fixture, t *testing.T, lo *cKVLayout, _ []cKVLayer) { lo.Layers += 4 }, status.InvalidArg},
		{"no cells", func(f *fixture, t *testing.T, lo *cKVLayout, _ []cKVLayer) { lo.NCells = 0 }, status.Layout},
		{"fewer cells than used", func(f *fixture, t *testing.T, lo *cKVLayout, _ []cKVLayer) { lo.NCells = cells - 1 }, status.Layout},
		{"NULL K", func(f *fixture, t *testing.T, _ *cKVLayout, ls []cKVLayer) { ls[1].K = 0 }, status.Layout},
		{"NULL V", func(f *fixture, t *testing.T, _ *cKVLayout, ls []cKVLayer) { ls[0].V = 0 }, status.Layout},
		{"K stride below the row", func(f *fixture, t *testing.T, _ *cKVLayout, ls []cKVLayer) { ls[1].KStride = uint64(g.krow(1) - 1) }, status.Layout},
		{"V stride too short", shortV, status.Layout},
		{"K running past the top of the address space", func(f *fixture, t *testing.T, _ *cKVLayout, ls []cKVLayer) { ls[0].K = ^uintptr(0) - 511 },
			status.Layout},
		{"V stride wrapping around", func(f *fixture, t *testing.T, _ *cKVLayout, ls []cKVLayer) { ls[2].VStride = 1 << 63 }, status.Layout},
		{"K stride wrapping around", func(f *fixture, t *testing.T, _ *cKVLayout, ls []cKVLayer) { ls[0].KStride = math.MaxUint64 / 2 },
			status.Layout},
		{"device location", func(f *fixture, t *testing.T, lo *cKVLayout, _ []cKVLayer) { lo.Location = f.c.cstr(t, "cuda:0") }, status.Unsupported},
		{"location without a device", func(f *fixture, t *testing.T, lo *cKVLayout, _ []cKVLayer) { lo.Location = f.c.cstr(t, "cpu:") },
			status.Unsupported},
		{"unterminated location", func(f *fixture, t *testing.T, lo *cKVLayout, _ []cKVLayer) {
			lo.Location = address(edgeString(t, 64, 'x'))
		},
			status.InvalidArg},
		{"location on another CPU", func(f *fixture, t *testing.T, lo *cKVLayout, _ []cKVLayer) { lo.Location = f.c.cstr(t, "cpu:3") }, status.OK},
		{"NULL location", func(f *fixture, t *testing.T, lo *cKVLayout, _ []cKVLayer) { lo.Location = 0 }, status.OK},
	}
}

// TestLoadArguments passes load_begin one bad argument at a time, each
// with a plan of its own. Each is refused with its status, the plan is
// consumed (or, for a wrong handle, left alone), the output keeps its
// value, no handle appears and the tensors are untouched.
func TestLoadArguments(t *testing.T) {
	for _, vtrans := range []bool{false, true} {
		t.Run(map[bool]string{false: "row-major", true: "transposed"}[vtrans], func(t *testing.T) { loadArguments(t, vtrans) })
	}
}

func loadArguments(t *testing.T, vtrans bool) {
	const cells = 64
	f := newFixture(t)
	g := testModel(vtrans)
	B := int(g.block)
	b := f.open(t, f.config(""))
	m := f.register(t, b, g.reg(t, f.c))
	tok := prompt(100, 0, 100)
	cs := reversed(7*B, cells)
	src := mustTensors(t, f.c, g, cells, vtrans, tight)
	src.compute(tok, cs, 7*B)
	f.save(t, m, nil, src, tok, 7*B, cs)
	f.awaitPublished(t, b, 7)
	plan := func(t *testing.T) uint64 {
		lk := f.lookup(t, m, nil, tok, 7*B+1, 0)
		require.Equal(t, uint32(7*B), lk.NRestoreTokens)
		return lk.Plan
	}
	cellsWith := func(mut func([]uint32)) func(*fixture, *testing.T, *loadArgs) {
		return func(f *fixture, t *testing.T, x *loadArgs) {
			c := append([]uint32(nil), cs...)
			mut(c)
			x.cells = f.cells(t, c)
		}
	}
	type loadCase struct {
		name string
		mut  func(f *fixture, t *testing.T, x *loadArgs)
		want status.Code
	}
	cases := []loadCase{
		{"valid", func(*fixture, *testing.T, *loadArgs) {}, status.OK},
		{"identity cells", func(f *fixture, t *testing.T, x *loadArgs) { x.cells = nil }, status.OK},
		{"plan 0", func(f *fixture, t *testing.T, x *loadArgs) { x.plan = 0 }, status.BadHandle},
		{"random plan", func(f *fixture, t *testing.T, x *loadArgs) { x.plan = 0x4000_0000_0000_0001 }, status.BadHandle},
		{"model as plan", func(f *fixture, t *testing.T, x *loadArgs) { x.plan = m }, status.BadHandle},
		{"bridge as plan", func(f *fixture, t *testing.T, x *loadArgs) { x.plan = b }, status.BadHandle},
		{"a dropped plan", func(f *fixture, t *testing.T, x *loadArgs) {
			p := plan(t)
			f.drop(t, p)
			x.plan = p
		}, status.BadHandle},
		{"NULL out", func(f *fixture, t *testing.T, x *loadArgs) { x.out = nil }, status.InvalidArg},
		{"misaligned out", func(f *fixture, t *testing.T, x *loadArgs) { x.out = unsafe.Add(x.out, 4) }, status.InvalidArg},
		{"NULL layout", func(f *fixture, t *testing.T, x *loadArgs) { x.layout = nil }, status.InvalidArg},
		{"misaligned layout", func(f *fixture, t *testing.T, x *loadArgs) {
			x.layout = unsafe.Pointer(putT(t, f.c, *(*cKVLayout)(x.layout), 4))
		}, status.InvalidArg},
		{"misaligned cells", func(f *fixture, t *testing.T, x *loadArgs) { x.cells = unsafe.Add(x.cells, 1) }, status.InvalidArg},
		{"cell beyond the tensors", cellsWith(func(c []uint32) { c[5] = cells }), status.Layout},
		{"last cell 2^32-1", cellsWith(func(c []uint32) { c[len(c)-1] = math.MaxUint32 }), status.Layout},
		{"duplicated cell", cellsWith(func(c []uint32) { c[9] = c[2] }), status.Layout},
		{"identity cells past a small cache", func(f *fixture, t *testing.T, x *loadArgs) {
			x.cells = nil
			x.layout = f.relayout(t, (*cKVLayout)(x.layout), func(lo *cKVLayout, _ []cKVLayer) { lo.NCells = uint32(7*B - 1) })
		}, status.Layout},
	}
	for _, lc := range layoutChanges(g, cells) {
		cases = append(cases, loadCase{lc.name, func(f *fixture, t *testing.T, x *loadArgs) {
			x.layout = f.relayout(t, (*cKVLayout)(x.layout), func(lo *cKVLayout, ls []cKVLayer) { lc.mut(f, t, lo, ls) })
		}, lc.want})
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dst := mustTensors(t, f.c, g, cells, vtrans, tight)
			before := dst.snapshot()
			out := putT(t, f.c, [2]uint64{sentinel, sentinel}, 0)
			x := loadArgs{plan: plan(t), layout: unsafe.Pointer(dst.layout), cells: f.cells(t, cs), out: unsafe.Pointer(out)}
			own := x.plan
			c.mut(f, t, &x)
			open := mcbgo_handles_open()
			got := mcbgo_load_begin(x.plan, x.layout, x.cells, x.out, f.eb, f.el)
			f.expect(t, got, c.want, "load begin")
			if got == int32(status.OK) {
				res := putT(t, f.c, cLoadResult{}, 0)
				f.expect(t, mcbgo_load_end(out[0], unsafe.Pointer(res), f.eb, f.el), status.OK, "load end")
				assert.Equal(t, uint32(7*B), res.NTokensOK)
				var placed []uint32
				if x.cells != nil {
					placed = cs
				}
				assert.NoError(t, dst.checkRestore(before, tok, placed, 7*B, int(res.NTokensOK), g.layers()))
			} else {
				assert.NoError(t, dst.checkUntouched(before), "a refused load touched the tensors")
				assert.Equal(t, [2]uint64{sentinel, sentinel}, *out, "a refused load wrote its output")
				assert.NotEmpty(t, f.lastError())
			}
			if x.plan == own {
				assert.Equal(t, open-1, mcbgo_handles_open(), "the plan is consumed")
				f.expect(t, mcbgo_plan_drop(own, f.eb, f.el), status.BadHandle, "drop the plan")
				return
			}
			assert.Equal(t, open, mcbgo_handles_open(), "a load of a wrong handle changed the handles")
			f.expect(t, mcbgo_plan_drop(own, f.eb, f.el), status.OK, "the plan a wrong handle left alone")
		})
	}
}

// TestSaveArguments passes save_begin one bad argument at a time. Each is
// refused with its status, the output keeps its value, no handle appears
// and the source tensors are untouched.
func TestSaveArguments(t *testing.T) {
	for _, vtrans := range []bool{false, true} {
		t.Run(map[bool]string{false: "row-major", true: "transposed"}[vtrans], func(t *testing.T) { saveArguments(t, vtrans) })
	}
}

// transfer is the argument list of mcb_save_begin.
type transfer struct {
	model  uint64
	scope  unsafe.Pointer
	layout unsafe.Pointer
	tokens unsafe.Pointer
	n      uint64
	cells  unsafe.Pointer
	out    unsafe.Pointer
}

func saveArguments(t *testing.T, vtrans bool) {
	const cells = 64
	f := newFixture(t)
	g := testModel(vtrans)
	B := int(g.block)
	b := f.open(t, f.config(""))
	m := f.register(t, b, g.reg(t, f.c))
	gone := f.register(t, b, g.reg(t, f.c))
	f.expect(t, mcbgo_model_unregister(gone, f.eb, f.el), status.OK, "unregister")
	tok := prompt(100, 0, 100)
	cs := reversed(7*B, cells)
	src := mustTensors(t, f.c, g, cells, vtrans, tight)
	src.compute(tok, cs, 7*B)
	computed := src.snapshot()
	base := transfer{model: m, layout: unsafe.Pointer(src.layout), tokens: f.c.i32s(t, tok), n: uint64(7 * B), cells: f.cells(t, cs)}

	cellsWith := func(mut func([]uint32)) func(*fixture, *transfer) {
		return func(f *fixture, x *transfer) {
			c := append([]uint32(nil), cs...)
			mut(c)
			x.cells = f.cells(t, c)
		}
	}
	scope := func(s cScope, skew int) func(*fixture, *transfer) {
		return func(f *fixture, x *transfer) { x.scope = unsafe.Pointer(putT(t, f.c, s, skew)) }
	}
	type saveCase struct {
		name string
		mut  func(f *fixture, x *transfer)
		want status.Code
	}
	cases := []saveCase{
		{"valid", func(*fixture, *transfer) {}, status.OK},
		{"a trailing partial block", func(f *fixture, x *transfer) { x.n += 2; x.cells = f.cells(t, append(cs, 20, 21)) }, status.OK},
		{"another tenant", func(f *fixture, x *transfer) { x.scope = unsafe.Pointer(f.scope(t, "tenant-b")) }, status.OK},
		{"model 0", func(f *fixture, x *transfer) { x.model = 0 }, status.BadHandle},
		{"random model", func(f *fixture, x *transfer) { x.model = 0x4000_0000_0000_0001 }, status.BadHandle},
		{"bridge as model", func(f *fixture, x *transfer) { x.model = b }, status.BadHandle},
		{"unregistered model", func(f *fixture, x *transfer) { x.model = gone }, status.BadHandle},
		{"NULL out", func(f *fixture, x *transfer) { x.out = nil }, status.InvalidArg},
		{"misaligned out", func(f *fixture, x *transfer) { x.out = unsafe.Add(x.out, 4) }, status.InvalidArg},
		{"misaligned scope", scope(cScope{}, 4), status.InvalidArg},
		{"salt NULL with a length", scope(cScope{TenantSaltLen: 8}, 0), status.InvalidArg},
		{"salt of 5000 bytes", scope(cScope{TenantSalt: address(f.c.alloc(t, 5000, 1)), TenantSaltLen: 5000}, 0), status.InvalidArg},
		{"adapters NULL with a count", scope(cScope{NAdapters: 2}, 0), status.InvalidArg},
		{"2^63 adapters", scope(cScope{Adapters: address(f.c.alloc(t, 16, 8)), NAdapters: 1 << 63}, 0), status.InvalidArg},
		{"adapter missing", func(f *fixture, x *transfer) {
			x.scope = unsafe.Pointer(f.scope(t, "", adapter{"testdata/missing.lora", 1}))
		}, status.InvalidArg},
		{"NULL layout", func(f *fixture, x *transfer) { x.layout = nil }, status.InvalidArg},
		{"misaligned layout", func(f *fixture, x *transfer) { x.layout = unsafe.Pointer(putT(t, f.c, *(*cKVLayout)(x.layout), 4)) },
			status.InvalidArg},
		{"NULL tokens", func(f *fixture, x *transfer) { x.tokens = nil }, status.InvalidArg},
		{"misaligned tokens", func(f *fixture, x *transfer) { x.tokens = unsafe.Add(x.tokens, 2) }, status.InvalidArg},
		{"no tokens", func(f *fixture, x *transfer) { x.n = 0 }, status.InvalidArg},
		{"2^40 tokens", func(f *fixture, x *transfer) { x.n = 1 << 40 }, status.InvalidArg},
		{"one token over the limit", func(f *fixture, x *transfer) { x.n = maxTokens + 1 }, status.InvalidArg},
		{"2^64-1 tokens", func(f *fixture, x *transfer) { x.n = math.MaxUint64 }, status.InvalidArg},
		{"tokens below a block", func(f *fixture, x *transfer) { x.n = uint64(B - 1) }, status.InvalidArg},
		{"misaligned cells", func(f *fixture, x *transfer) { x.cells = unsafe.Add(x.cells, 1) }, status.InvalidArg},
		{"cell beyond the tensors", cellsWith(func(c []uint32) { c[5] = cells }), status.Layout},
		{"last cell 2^32-1", cellsWith(func(c []uint32) { c[len(c)-1] = math.MaxUint32 }), status.Layout},
		{"duplicated cell", cellsWith(func(c []uint32) { c[9] = c[2] }), status.Layout},
		{"identity cells past the tensors", func(f *fixture, x *transfer) { x.cells, x.n = nil, uint64(17*B) }, status.Layout},
	}
	for _, lc := range layoutChanges(g, cells) {
		cases = append(cases, saveCase{lc.name, func(f *fixture, x *transfer) {
			x.layout = f.relayout(t, (*cKVLayout)(x.layout), func(lo *cKVLayout, ls []cKVLayer) { lc.mut(f, t, lo, ls) })
		}, lc.want})
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			x := base
			out := putT(t, f.c, [2]uint64{sentinel, sentinel}, 0)
			x.out = unsafe.Pointer(out)
			c.mut(f, &x)
			open := mcbgo_handles_open()
			got := mcbgo_save_begin(x.model, x.scope, x.layout, x.tokens, x.n, x.cells, x.out, f.eb, f.el)
			f.expect(t, got, c.want, "save begin")
			assert.NoError(t, src.checkUntouched(computed), "save begin wrote into its source")
			if got == int32(status.OK) {
				finish(t, f, true, out[0], g.layers())
				return
			}
			assert.Equal(t, [2]uint64{sentinel, sentinel}, *out, "a refused save wrote its output")
			assert.Equal(t, open, mcbgo_handles_open(), "a refused save left a handle")
			assert.NotEmpty(t, f.lastError())
		})
	}
}

// finish ends a load or save that began, so that the test leaks nothing.
func finish(t *testing.T, f *fixture, save bool, h uint64, layers int) {
	t.Helper()
	if save {
		for l := 0; l < layers; l++ {
			f.expect(t, mcbgo_save_layer(h, uint32(l), f.eb, f.el), status.OK, "save layer")
		}
		f.expect(t, mcbgo_save_end(h, unsafe.Pointer(putT(t, f.c, cSaveResult{}, 0)), f.eb, f.el), status.OK, "save end")
		return
	}
	f.expect(t, mcbgo_load_end(h, unsafe.Pointer(putT(t, f.c, cLoadResult{}, 0)), f.eb, f.el), status.OK, "load end")
}

func TestLookupArguments(t *testing.T) {
	f := newFixture(t)
	g := testModel(false)
	b := f.open(t, f.config(""))
	m := f.register(t, b, g.reg(t, f.c))
	tok := prompt(31, 0, 31)
	a := writeFile(t, "a.lora", []byte("adapter a"))
	scope := func(s cScope, skew int) unsafe.Pointer { return unsafe.Pointer(putT(t, f.c, s, skew)) }
	cases := []struct {
		name   string
		model  uint64
		scope  unsafe.Pointer
		tokens func() unsafe.Pointer // nil passes the prompt
		n      uint64
		cached uint64
		skew   int // added to the output's address; -1 passes NULL
		want   status.Code
	}{
		{name: "valid", model: m, n: 31, want: status.OK},
		{name: "one token", model: m, n: 1, want: status.OK},
		{name: "all held", model: m, n: 31, cached: 31, want: status.OK},
		{name: "one token held", model: m, n: 1, cached: 1, want: status.OK},
		{name: "model 0", model: 0, n: 31, want: status.BadHandle},
		{name: "bridge as model", model: b, n: 31, want: status.BadHandle},
		{name: "random model", model: 1 << 50, n: 31, want: status.BadHandle},
		{name: "NULL out", model: m, n: 31, skew: -1, want: status.InvalidArg},
		{name: "misaligned out", model: m, n: 31, skew: 4, want: status.InvalidArg},
		{name: "NULL tokens", model: m, tokens: func() unsafe.Pointer { return nil }, n: 31, want: status.InvalidArg},
		{name: "misaligned tokens", model: m, tokens: func() unsafe.Pointer { return unsafe.Add(f.c.i32s(t, tok), 1) }, n: 30,
			want: status.InvalidArg},
		{name: "no tokens", model: m, n: 0, want: status.InvalidArg},
		{name: "2^40 tokens", model: m, n: 1 << 40, want: status.InvalidArg},
		{name: "one token over the limit", model: m, n: maxTokens + 1, want: status.InvalidArg},
		{name: "more held than the prompt", model: m, n: 31, cached: 32, want: status.InvalidArg},
		{name: "2^64-1 held", model: m, n: 31, cached: math.MaxUint64, want: status.InvalidArg},
		{name: "misaligned scope", model: m, scope: scope(cScope{}, 4), n: 31, want: status.InvalidArg},
		{name: "salt NULL with a length", model: m, scope: scope(cScope{TenantSaltLen: 1}, 0), n: 31, want: status.InvalidArg},
		{name: "salt longer than the limit", model: m,
			scope: scope(cScope{TenantSalt: address(f.c.alloc(t, maxSaltBytes+1, 1)), TenantSaltLen: maxSaltBytes + 1}, 0),
			n:     31, want: status.InvalidArg},
		{name: "salt at the limit", model: m,
			scope: scope(cScope{TenantSalt: address(f.c.alloc(t, maxSaltBytes, 1)), TenantSaltLen: maxSaltBytes}, 0),
			n:     31, want: status.OK},
		{name: "adapters NULL with a count", model: m, scope: scope(cScope{NAdapters: 1}, 0), n: 31, want: status.InvalidArg},
		{name: "an adapter unterminated", model: m, n: 31, want: status.InvalidArg,
			scope: scope(cScope{Adapters: f.adapters(t, cAdapter{Path: address(edgeString(t, maxString, 'x')), Scale: 1}), NAdapters: 1}, 0)},
		{name: "an adapter missing", model: m, scope: unsafe.Pointer(f.scope(t, "", adapter{"testdata/missing.lora", 1})), n: 31,
			want: status.InvalidArg},
		{name: "an adapter", model: m, scope: unsafe.Pointer(f.scope(t, "", adapter{a, 1})), n: 31, want: status.OK},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tokens := f.c.i32s(t, tok)
			if c.tokens != nil {
				tokens = c.tokens()
			}
			res := putT(t, f.c, [2]cLookupResult{{NBlockTokens: sentinel & math.MaxUint32, Plan: sentinel}}, 0)
			out := unsafe.Add(unsafe.Pointer(res), max(c.skew, 0))
			if c.skew < 0 {
				out = nil
			}
			f.expect(t, mcbgo_lookup(c.model, c.scope, tokens, c.n, c.cached, out, f.eb, f.el), c.want, "lookup")
			if c.want != status.OK {
				assert.Equal(t, cLookupResult{NBlockTokens: sentinel & math.MaxUint32, Plan: sentinel}, res[0], "a failed lookup wrote its output")
				assert.NotEmpty(t, f.lastError())
				return
			}
			reason := arbiter.NoMatch
			if c.n <= uint64(g.block) {
				reason = arbiter.TooShort // no whole block before the last token
			}
			assert.Equal(t, cLookupResult{NBlockTokens: g.block, Reason: int32(reason), EstRestoreMS: res[0].EstRestoreMS,
				EstRecomputeMS: res[0].EstRecomputeMS, EstTotalMS: res[0].EstTotalMS}, res[0], "lookup of an empty cache")
		})
	}
}

// TestLoadSaveHandles drives wait, end and save-layer with wrong handles,
// bad outputs and calls out of order.
func TestLoadSaveHandles(t *testing.T) {
	f := newFixture(t)
	g, b, m, tok, src := f.published(t, false, 28)
	B := int(g.block)
	dst := mustTensors(t, f.c, g, 64, false, tight)
	before := dst.snapshot()

	lk := f.lookup(t, m, nil, tok, 29, 0)
	require.Equal(t, uint32(7*B), lk.NRestoreTokens)
	ld, sv := f.out(t), f.out(t)
	f.must(t, mcbgo_load_begin(lk.Plan, unsafe.Pointer(dst.layout), nil, unsafe.Pointer(ld), f.eb, f.el), status.OK, "load begin")
	other := prompt(40, 1, 0) // blocks not cached, so the save has rows to copy
	src.compute(other, nil, 40)
	f.must(t, mcbgo_save_begin(m, nil, unsafe.Pointer(src.layout), f.c.i32s(t, other), 40, nil, unsafe.Pointer(sv), f.eb, f.el),
		status.OK, "save begin")

	nok := putT(t, f.c, [2]uint32{math.MaxUint32, math.MaxUint32}, 0)
	lres := putT(t, f.c, [2]cLoadResult{}, 0)
	sres := putT(t, f.c, [2]cSaveResult{}, 0)
	done := putT(t, f.c, [2]bool{}, 0)
	steps := []struct {
		name string
		call func() int32
		want status.Code
	}{
		{"wait on load 0", func() int32 { return mcbgo_load_wait_layer(0, 0, unsafe.Pointer(nok), f.eb, f.el) }, status.BadHandle},
		{"wait on a save", func() int32 { return mcbgo_load_wait_layer(*sv, 0, unsafe.Pointer(nok), f.eb, f.el) }, status.BadHandle},
		{"wait on a model", func() int32 { return mcbgo_load_wait_layer(m, 0, unsafe.Pointer(nok), f.eb, f.el) }, status.BadHandle},
		{"wait on the loaded plan", func() int32 { return mcbgo_load_wait_layer(lk.Plan, 0, unsafe.Pointer(nok), f.eb, f.el) }, status.BadHandle},
		{"wait with NULL count", func() int32 { return mcbgo_load_wait_layer(*ld, 0, nil, f.eb, f.el) }, status.InvalidArg},
		{"wait with misaligned count", func() int32 { return mcbgo_load_wait_layer(*ld, 0, unsafe.Add(unsafe.Pointer(nok), 2), f.eb, f.el) },
			status.InvalidArg},
		{"wait past the last layer", func() int32 { return mcbgo_load_wait_layer(*ld, uint32(g.layers()), unsafe.Pointer(nok), f.eb, f.el) },
			status.InvalidArg},
		{"wait on layer 2^32-1", func() int32 { return mcbgo_load_wait_layer(*ld, math.MaxUint32, unsafe.Pointer(nok), f.eb, f.el) },
			status.InvalidArg},
		{"wait on layer 1", func() int32 { return mcbgo_load_wait_layer(*ld, 1, unsafe.Pointer(nok), f.eb, f.el) }, status.OK},
		{"wait on layer 0 again", func() int32 { return mcbgo_load_wait_layer(*ld, 0, unsafe.Pointer(nok), f.eb, f.el) }, status.OK},
		{"poll on load 0", func() int32 { return mcbgo_load_poll(0, 0, unsafe.Pointer(done), f.eb, f.el) }, status.BadHandle},
		{"poll on a save", func() int32 { return mcbgo_load_poll(*sv, 0, unsafe.Pointer(done), f.eb, f.el) }, status.BadHandle},
		{"poll with NULL done", func() int32 { return mcbgo_load_poll(*ld, 0, nil, f.eb, f.el) }, status.InvalidArg},
		{"poll until over", func() int32 { return mcbgo_load_poll(*ld, math.MaxUint32, unsafe.Pointer(done), f.eb, f.el) }, status.OK},
		{"cancel load 0", func() int32 { return mcbgo_load_cancel(0, f.eb, f.el) }, status.BadHandle},
		{"cancel a save", func() int32 { return mcbgo_load_cancel(*sv, f.eb, f.el) }, status.BadHandle},
		{"cancel once over", func() int32 { return mcbgo_load_cancel(*ld, f.eb, f.el) }, status.OK},
		{"end with NULL result", func() int32 { return mcbgo_load_end(*ld, nil, f.eb, f.el) }, status.InvalidArg},
		{"end with misaligned result", func() int32 { return mcbgo_load_end(*ld, unsafe.Add(unsafe.Pointer(lres), 4), f.eb, f.el) },
			status.InvalidArg},
		{"end a save as a load", func() int32 { return mcbgo_load_end(*sv, unsafe.Pointer(lres), f.eb, f.el) }, status.BadHandle},
		{"wait after refused ends", func() int32 { return mcbgo_load_wait_layer(*ld, 2, unsafe.Pointer(nok), f.eb, f.el) }, status.OK},
		{"end", func() int32 { return mcbgo_load_end(*ld, unsafe.Pointer(lres), f.eb, f.el) }, status.OK},
		{"end twice", func() int32 { return mcbgo_load_end(*ld, unsafe.Pointer(lres), f.eb, f.el) }, status.BadHandle},
		{"wait after end", func() int32 { return mcbgo_load_wait_layer(*ld, 0, unsafe.Pointer(nok), f.eb, f.el) }, status.BadHandle},
		{"poll after end", func() int32 { return mcbgo_load_poll(*ld, 0, unsafe.Pointer(done), f.eb, f.el) }, status.BadHandle},
		{"cancel after end", func() int32 { return mcbgo_load_cancel(*ld, f.eb, f.el) }, status.BadHandle},
		{"save layer on a load", func() int32 { return mcbgo_save_layer(*ld, 0, f.eb, f.el) }, status.BadHandle},
		{"save layer on save 0", func() int32 { return mcbgo_save_layer(0, 0, f.eb, f.el) }, status.BadHandle},
		{"save past the last layer", func() int32 { return mcbgo_save_layer(*sv, uint32(g.layers()), f.eb, f.el) }, status.InvalidArg},
		{"save layer 0", func() int32 { return mcbgo_save_layer(*sv, 0, f.eb, f.el) }, status.OK},
		{"save layer 0 twice", func() int32 { return mcbgo_save_layer(*sv, 0, f.eb, f.el) }, status.State},
		{"save end with NULL result", func() int32 { return mcbgo_save_end(*sv, nil, f.eb, f.el) }, status.InvalidArg},
		{"save end with misaligned result", func() int32 { return mcbgo_save_end(*sv, unsafe.Add(unsafe.Pointer(sres), 2), f.eb, f.el) },
			status.InvalidArg},
		{"save end of a load", func() int32 { return mcbgo_save_end(*ld, unsafe.Pointer(sres), f.eb, f.el) }, status.BadHandle},
		{"save end before every layer", func() int32 { return mcbgo_save_end(*sv, unsafe.Pointer(sres), f.eb, f.el) }, status.State},
		{"save end twice", func() int32 { return mcbgo_save_end(*sv, unsafe.Pointer(sres), f.eb, f.el) }, status.BadHandle},
		{"save layer after end", func() int32 { return mcbgo_save_layer(*sv, 1, f.eb, f.el) }, status.BadHandle},
	}
	for _, s := range steps {
		f.expect(t, s.call(), s.want, s.name)
		if s.name == "wait on layer 1" {
			assert.Equal(t, uint32(7*B), nok[0], "wait: tokens good")
		}
		if s.name == "poll until over" {
			assert.True(t, done[0], "poll: the load is over")
		}
	}
	assert.Equal(t, cLoadResult{NBlocks: 7, NBlocksOK: 7, NTokensOK: uint32(7 * B), NBytes: uint64(7 * g.payload())}, lres[0],
		"load result: a cancel once the load is over changes nothing")
	assert.Equal(t, cSaveResult{NBlocks: 10}, sres[0], "a save ended early counts the blocks and seals nothing")
	assert.NoError(t, dst.checkRestore(before, tok, nil, 7*B, 7*B, g.layers()))
	// A save of blocks all known copies nothing and needs no layer.
	known := f.out(t)
	f.must(t, mcbgo_save_begin(m, nil, unsafe.Pointer(src.layout), f.c.i32s(t, tok), 28, nil, unsafe.Pointer(known), f.eb, f.el),
		status.OK, "save of known blocks")
	f.expect(t, mcbgo_save_end(*known, unsafe.Pointer(sres), f.eb, f.el), status.OK, "its end")
	assert.Equal(t, cSaveResult{NBlocks: 7, NKnown: 7}, sres[0], "save of known blocks")
	st := f.stats(t, b)
	assert.True(t, st.Saves == 2 && st.SaveFailures == 1 && st.SavedBlocks == 7 && st.Loads == 1, "stats %+v", st)
}

func TestStatsArguments(t *testing.T) {
	f := newFixture(t)
	b := f.open(t, f.config(""))
	m := f.register(t, b, testModel(false).reg(t, f.c))
	closed := f.open(t, f.config(""))
	f.expect(t, mcbgo_bridge_close(closed, f.eb, f.el), status.OK, "close")
	st := putT(t, f.c, [2]cStats{{Lookups: sentinel}}, 0)
	for _, c := range []struct {
		name   string
		bridge uint64
		out    unsafe.Pointer
		want   status.Code
	}{
		{"bridge 0", 0, unsafe.Pointer(st), status.BadHandle},
		{"model as bridge", m, unsafe.Pointer(st), status.BadHandle},
		{"closed bridge", closed, unsafe.Pointer(st), status.BadHandle},
		{"NULL out", b, nil, status.InvalidArg},
		{"misaligned out", b, unsafe.Add(unsafe.Pointer(st), 4), status.InvalidArg},
	} {
		f.expect(t, mcbgo_bridge_stats(c.bridge, c.out, f.eb, f.el), c.want, c.name)
		assert.Equal(t, cStats{Lookups: sentinel}, st[0], "%s wrote the stats", c.name)
	}
	f.expect(t, mcbgo_bridge_stats(b, unsafe.Pointer(st), f.eb, f.el), status.OK, "stats")
	assert.Equal(t, cStats{PoolBytes: 16 << 20}, st[0], "stats of a new bridge")
}

// TestWaitPublished: the wait returns OK at once with nothing saved, and
// once a save's blocks are published the bridge that saved them counts
// them as its own; a handle that is not an open bridge is refused.
func TestWaitPublished(t *testing.T) {
	f := newFixture(t)
	g := testModel(false)
	b := f.open(t, f.config(""))
	m := f.register(t, b, g.reg(t, f.c))
	f.expect(t, mcbgo_bridge_wait_published(b, 0, f.eb, f.el), status.OK, "nothing saved")
	tok := prompt(41, 0, 40)
	src := mustTensors(t, f.c, g, 64, false, tight)
	src.compute(tok, nil, 40)
	f.save(t, m, nil, src, tok, 32, nil)
	f.expect(t, mcbgo_bridge_wait_published(b, 10_000, f.eb, f.el), status.OK, "after a save")
	st := f.stats(t, b)
	assert.Equal(t, uint64(32/g.block), st.SavedBlocks+st.DedupedBlocks, "blocks settled with the directory when the wait returned")
	closed := f.open(t, f.config(""))
	f.expect(t, mcbgo_bridge_close(closed, f.eb, f.el), status.OK, "close")
	for _, c := range []struct {
		name   string
		bridge uint64
	}{{"bridge 0", 0}, {"model as bridge", m}, {"closed bridge", closed}} {
		f.expect(t, mcbgo_bridge_wait_published(c.bridge, 0, f.eb, f.el), status.BadHandle, c.name)
	}
}

// TestCloseWithWorkOpen: a bridge refuses to close under a load or save,
// stays usable, and closes once they end; its models and plans go with it.
func TestCloseWithWorkOpen(t *testing.T) {
	f := newFixture(t)
	g, b, m, tok, src := f.published(t, true, 40)
	m2 := f.register(t, b, g.reg(t, f.c))

	sv, ld := f.out(t), f.out(t)
	f.must(t, mcbgo_save_begin(m, nil, unsafe.Pointer(src.layout), f.c.i32s(t, tok), 40, nil, unsafe.Pointer(sv), f.eb, f.el), status.OK, "save begin")
	f.expect(t, mcbgo_bridge_close(b, f.eb, f.el), status.State, "close under a save")
	dst := mustTensors(t, f.c, g, 64, true, tight)
	lk := f.lookup(t, m2, nil, tok, 40, 0)
	f.must(t, mcbgo_load_begin(lk.Plan, unsafe.Pointer(dst.layout), nil, unsafe.Pointer(ld), f.eb, f.el), status.OK, "load begin")
	f.expect(t, mcbgo_save_end(*sv, unsafe.Pointer(putT(t, f.c, cSaveResult{}, 0)), f.eb, f.el), status.OK, "save end")
	f.expect(t, mcbgo_bridge_close(b, f.eb, f.el), status.State, "close under a load")
	f.expect(t, mcbgo_load_end(*ld, unsafe.Pointer(putT(t, f.c, cLoadResult{}, 0)), f.eb, f.el), status.OK, "load end")
	open := f.lookup(t, m, nil, tok, 40, 0)
	require.NotZero(t, open.Plan)
	f.expect(t, mcbgo_bridge_close(b, f.eb, f.el), status.OK, "close with a plan open")
	res := unsafe.Pointer(putT(t, f.c, cLookupResult{}, 0))
	for _, h := range []uint64{m, m2} {
		f.expect(t, mcbgo_lookup(h, nil, f.c.i32s(t, tok), 40, 0, res, f.eb, f.el), status.BadHandle, "lookup on a closed bridge's model")
		f.expect(t, mcbgo_model_unregister(h, f.eb, f.el), status.BadHandle, "unregister on a closed bridge")
	}
	f.expect(t, mcbgo_plan_drop(open.Plan, f.eb, f.el), status.BadHandle, "a plan of a closed bridge")
	f.expect(t, mcbgo_bridge_close(b, f.eb, f.el), status.BadHandle, "close twice")
}

// TestErrorBuffer: the library writes at most errlen bytes, always
// terminated, tolerates no buffer, and clears the message on success.
func TestErrorBuffer(t *testing.T) {
	f := newFixture(t)
	b := f.open(t, f.config(""))
	out := unsafe.Pointer(putT(t, f.c, cStats{}, 0))
	mcbgo_bridge_stats(0, out, f.eb, f.el)
	full := f.lastError()
	require.Contains(t, full, "not an open bridge handle")
	buf := f.c.alloc(t, 64, 1)
	for _, n := range []uint64{0, 1, 2, 16, uint64(len(full)), uint64(len(full)) + 1} {
		copy(buf, strings.Repeat("Z", len(buf)))
		f.expect(t, mcbgo_bridge_stats(0, out, pointer(buf), n), status.BadHandle, "stats")
		if n == 0 {
			assert.Equal(t, byte('Z'), buf[0], "errlen 0: the buffer was written")
			continue
		}
		k := min(int(n)-1, len(full))
		assert.Equal(t, full[:k]+"\x00Z", string(buf[:k+2]), "errlen %d", n)
		assert.Equal(t, byte('Z'), buf[n], "errlen %d: written past the buffer", n)
	}
	f.expect(t, mcbgo_bridge_stats(0, out, nil, 1024), status.BadHandle, "stats without an error buffer")
	f.expect(t, mcbgo_bridge_stats(b, out, f.eb, f.el), status.OK, "stats")
	assert.Zero(t, f.errb[0], "a success left the message %q", f.lastError())
}

// TestGuard: whatever goes wrong inside an export comes back as
// MCB_STATUS_INTERNAL with a message, never as a crash of the host or a
// success.
func TestGuard(t *testing.T) {
	f := newFixture(t)
	unreadable := unsafe.Add(pointer(edgeString(t, 16, 0)), 16)
	cases := []struct {
		name string
		fn   func() error
		want status.Code
		msg  string
	}{
		{"panic", func() error { panic("boom") }, status.Internal, "internal error: boom"},
		{"fault", func() error { return status.Errorf(status.OK, "read %d", *(*byte)(unreadable)) }, status.Internal, "internal error"},
		{"error without a status", func() error { return errors.New("plain") }, status.Internal, "plain"},
		{"status error", func() error { return status.Errorf(status.Corrupt, "bad block") }, status.Corrupt, "bad block"},
		{"success", func() error { return nil }, status.OK, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			copy(f.errb, "stale")
			f.expect(t, guard(f.eb, f.el, c.fn), c.want, c.name)
			assert.Contains(t, f.lastError(), c.msg)
			assert.Equal(t, c.msg == "", f.lastError() == "", "message %q", f.lastError())
		})
	}
}

// TestConcurrentHosts runs several host threads over one bridge at once,
// each with its own error buffer, model handle and tensors, all sharing
// prompts: what the race detector needs to see the handle table, plans
// and the bridge under load.
func TestConcurrentHosts(t *testing.T) {
	const hosts, rounds = 4, 6
	f := newFixture(t)
	g := testModel(false)
	B := int(g.block)
	b := f.open(t, f.config(""))
	type host struct {
		f        *fixture
		m        uint64
		src, dst []*tensors
		tok      [][]int32
	}
	hs := make([]host, hosts)
	for i := range hs {
		h := &hs[i]
		h.f = f.withErrorBuffer(t)
		h.m = f.register(t, b, g.reg(t, f.c))
		for r := 0; r < rounds; r++ {
			tok := prompt(33, r%3, 8*(r%3)) // prompts share prefixes across hosts and rounds
			h.tok = append(h.tok, tok)
			src := mustTensors(t, f.c, g, 48, false, tight)
			src.compute(tok, nil, len(tok))
			h.src = append(h.src, src)
			h.dst = append(h.dst, mustTensors(t, f.c, g, 48, false, tight))
		}
	}
	var wg sync.WaitGroup
	var lookups atomic.Uint64
	for i := range hs {
		h := &hs[i]
		// Memory the goroutine passes to the library comes from here, before
		// they start: host memory is handed out by one thread.
		type call struct {
			tok          unsafe.Pointer
			out, res, nk unsafe.Pointer
			before       []byte
		}
		calls := make([]call, rounds)
		for r := range calls {
			calls[r] = call{tok: f.c.i32s(t, h.tok[r]), out: unsafe.Pointer(f.out(t)), res: unsafe.Pointer(putT(t, f.c, cLoadResult{}, 0)),
				nk: unsafe.Pointer(putT(t, f.c, uint32(0), 0)), before: h.dst[r].snapshot()}
		}
		saveRes := unsafe.Pointer(putT(t, f.c, cSaveResult{}, 0))
		lkp := putT(t, f.c, cLookupResult{}, 0)
		lk := unsafe.Pointer(lkp)
		wg.Go(func() {
			hf := h.f
			for r, c := range calls {
				// Other hosts may have saved this prompt already: a plan
				// this host does not load it drops.
				lookups.Add(1)
				if hf.expect(t, mcbgo_lookup(h.m, nil, c.tok, 33, 0, lk, hf.eb, hf.el), status.OK, "lookup") && lkp.Plan != 0 {
					hf.expect(t, mcbgo_plan_drop(lkp.Plan, hf.eb, hf.el), status.OK, "plan drop")
				}
				if hf.expect(t, mcbgo_save_begin(h.m, nil, unsafe.Pointer(h.src[r].layout), c.tok, 33, nil, c.out, hf.eb, hf.el), status.OK, "save begin") {
					sv := *(*uint64)(c.out)
					for l := 0; l < g.layers(); l++ {
						hf.expect(t, mcbgo_save_layer(sv, uint32(l), hf.eb, hf.el), status.OK, "save layer")
					}
					hf.expect(t, mcbgo_save_end(sv, saveRes, hf.eb, hf.el), status.OK, "save end")
				}
				// The blocks are sealed: this bridge restores them at once.
				lookups.Add(1)
				hf.expect(t, mcbgo_lookup(h.m, nil, c.tok, 33, 0, lk, hf.eb, hf.el), status.OK, "lookup")
				if !assert.Equal(t, uint32(8*B), lkp.NRestoreTokens, "lookup after the save: %+v", *lkp) {
					if lkp.Plan != 0 {
						hf.expect(t, mcbgo_plan_drop(lkp.Plan, hf.eb, hf.el), status.OK, "plan drop")
					}
					continue
				}
				if !hf.expect(t, mcbgo_load_begin(lkp.Plan, unsafe.Pointer(h.dst[r].layout), nil, c.out, hf.eb, hf.el), status.OK, "load begin") {
					continue
				}
				ld := *(*uint64)(c.out)
				hf.expect(t, mcbgo_load_wait_layer(ld, 0, c.nk, hf.eb, hf.el), status.OK, "wait")
				hf.expect(t, mcbgo_load_end(ld, c.res, hf.eb, hf.el), status.OK, "load end")
				res := (*cLoadResult)(c.res)
				assert.Equal(t, uint32(8*B), res.NTokensOK, "load restored %+v", *res)
				assert.NoError(t, h.dst[r].checkRestore(c.before, h.tok[r], nil, 8*B, int(res.NTokensOK), g.layers()))
			}
		})
	}
	wg.Wait()
	st := f.stats(t, b)
	assert.True(t, st.Loads == hosts*rounds && st.LoadFailures == 0 && st.Lookups == lookups.Load(), "stats %+v", st)
}
