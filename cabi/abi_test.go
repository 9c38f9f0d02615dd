package main

import (
	"bytes"
	"errors"
	"math"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"github.com/mcbridge/mcbridge/internal/arbiter"
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
		if n := mcbgo_handles_open(); n != start {
			t.Errorf("%d handles open after the test, %d before it", n, start)
		}
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

func (f *fixture) expect(t testing.TB, got int32, want status.Code, what string) bool {
	t.Helper()
	if got != int32(want) {
		t.Errorf("%s = %d (%s), want %d (%s); last error %q", what, got, status.Code(got), int32(want), want, f.lastError())
		return false
	}
	return true
}

// config is a small pool and a restore-always arbiter, so that what a
// lookup offers depends on the cache alone, in the test's own directory.
func (f *fixture) config(extra string) string {
	return `{"pool_bytes":16777216,"arbiter":{"policy":"always-restore"},"directory":{"name":"` + f.dir + `"}` + extra + `}`
}

const sentinel = 0x5e47_1e15_5e47_1e15

// out returns a handle output holding sentinel, which a failed call must
// leave there.
func (f *fixture) out() *uint64 { return put(f.c, uint64(sentinel), 0) }

func (f *fixture) open(t *testing.T, cfg string) uint64 {
	t.Helper()
	out := f.out()
	if !f.expect(t, mcbgo_bridge_open(ptr(f.c.cstr(t, cfg)), unsafe.Pointer(out), f.eb, f.el), status.OK, "open") {
		t.FailNow()
	}
	b := *out
	// Closing a closed bridge only says BAD_HANDLE: harmless after a test
	// that closed it, and what keeps a failing test from leaking.
	t.Cleanup(func() { mcbgo_bridge_close(b, nil, 0) })
	return b
}

func (f *fixture) register(t *testing.T, b uint64, p *cModelParams) uint64 {
	t.Helper()
	out := f.out()
	if !f.expect(t, mcbgo_model_register(b, unsafe.Pointer(p), unsafe.Pointer(out), f.eb, f.el), status.OK, "register") {
		t.FailNow()
	}
	return *out
}

func (f *fixture) cells(t testing.TB, cells []uint32) unsafe.Pointer {
	if cells == nil {
		return nil
	}
	return ptr(f.c.u32s(t, cells))
}

func (f *fixture) lookup(t *testing.T, m uint64, scope *cScope, tok []int32, n int) cLookupResult {
	t.Helper()
	out := put(f.c, cLookupResult{}, 0)
	f.expect(t, mcbgo_lookup(m, unsafe.Pointer(scope), f.c.i32s(t, tok), uint64(n), unsafe.Pointer(out), f.eb, f.el), status.OK, "lookup")
	return *out
}

// save runs a whole save of the first n tokens, layer by layer.
func (f *fixture) save(t *testing.T, m uint64, scope *cScope, src *tensors, tok []int32, n int, cells []uint32) cSaveResult {
	t.Helper()
	out := f.out()
	if !f.expect(t, mcbgo_save_begin(m, unsafe.Pointer(scope), unsafe.Pointer(src.layout), f.c.i32s(t, tok), uint64(n),
		f.cells(t, cells), unsafe.Pointer(out), f.eb, f.el), status.OK, "save begin") {
		t.FailNow()
	}
	for l := 0; l < src.m.layers(); l++ {
		f.expect(t, mcbgo_save_layer(*out, uint32(l), f.eb, f.el), status.OK, "save layer")
	}
	res := put(f.c, cSaveResult{}, 0)
	f.expect(t, mcbgo_save_end(*out, unsafe.Pointer(res), f.eb, f.el), status.OK, "save end")
	return *res
}

// load restores the first n tokens layer by layer, checking the tensors
// after each layer, and returns the result of the end.
func (f *fixture) load(t *testing.T, m uint64, scope *cScope, dst *tensors, tok []int32, n int, cells []uint32) cLoadResult {
	t.Helper()
	before := dst.snapshot()
	out := f.out()
	if !f.expect(t, mcbgo_load_begin(m, unsafe.Pointer(scope), unsafe.Pointer(dst.layout), f.c.i32s(t, tok), uint64(n),
		f.cells(t, cells), unsafe.Pointer(out), f.eb, f.el), status.OK, "load begin") {
		t.FailNow()
	}
	nok := put(f.c, uint32(math.MaxUint32), 0)
	prev := n
	for l := 0; l < dst.m.layers(); l++ {
		f.expect(t, mcbgo_load_wait_layer(*out, uint32(l), unsafe.Pointer(nok), f.eb, f.el), status.OK, "wait layer")
		if int(*nok) > prev || int(*nok)%int(dst.m.block) != 0 {
			t.Errorf("layer %d: %d tokens good after %d", l, *nok, prev)
		}
		prev = int(*nok)
		if err := dst.checkRestore(before, tok, cells, n, prev, l+1); err != nil {
			t.Errorf("after layer %d: %v", l, err)
		}
	}
	res := put(f.c, cLoadResult{}, 0)
	f.expect(t, mcbgo_load_end(*out, unsafe.Pointer(res), f.eb, f.el), status.OK, "load end")
	if err := dst.checkRestore(before, tok, cells, n, int(res.NTokensOK), dst.m.layers()); err != nil {
		t.Error(err)
	}
	return *res
}

func (f *fixture) stats(t *testing.T, b uint64) cStats {
	t.Helper()
	out := put(f.c, cStats{}, 0)
	f.expect(t, mcbgo_bridge_stats(b, unsafe.Pointer(out), f.eb, f.el), status.OK, "stats")
	return *out
}

func (f *fixture) scope(t testing.TB, salt, adapters string) *cScope {
	s := cScope{TenantSaltLen: uint64(len(salt))}
	if salt != "" {
		s.TenantSalt = f.c.cstr(t, salt)
	}
	if adapters != "" {
		s.Adapters = f.c.cstr(t, adapters)
	}
	return put(f.c, s, 0)
}

// testModel has layers of different widths, as models with per-layer GQA do.
func testModel(vtrans bool) model {
	return model{block: 4, kEmbd: []uint32{8, 16, 4}, vEmbd: []uint32{8, 4, 12}, vtrans: vtrans}
}

// wrapCells puts positions into cells that wrap around holes, as
// llama.cpp's find_slot leaves them, starting at first.
func wrapCells(n, first, cells int) []uint32 {
	c := make([]uint32, n)
	for i := range c {
		c[i] = uint32((first + i) % cells)
	}
	return c
}

func reversed(n, cells int) []uint32 {
	c := make([]uint32, n)
	for i := range c {
		c[i] = uint32(cells - 1 - i)
	}
	return c
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
		{name: "MCB_CONFIG missing file", env: "testdata/missing.json", want: status.Config, msg: "reading config file"},
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
		{name: "misaligned out", out: func(f *fixture, t *testing.T) unsafe.Pointer { return unsafe.Pointer(put(f.c, uint64(0), 4)) },
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
			out := f.out()
			pout := unsafe.Pointer(out)
			if c.out != nil {
				pout = c.out(f, t)
			}
			copy(f.errb, strings.Repeat("Z", len(f.errb)))
			got := mcbgo_bridge_open(cfg, pout, f.eb, f.el)
			f.expect(t, got, c.want, "open")
			if c.want != status.OK {
				if *out != sentinel {
					t.Errorf("a failed open wrote %#x into the output", *out)
				}
				if !strings.Contains(f.lastError(), c.msg) || f.lastError() == "" {
					t.Errorf("error %q, want one mentioning %q", f.lastError(), c.msg)
				}
				return
			}
			if f.errb[0] != 0 {
				t.Errorf("a successful open left the error %q", f.lastError())
			}
			if *out == 0 || *out == sentinel {
				t.Fatalf("open gave handle %#x", *out)
			}
			f.expect(t, mcbgo_bridge_close(*out, f.eb, f.el), status.OK, "close")
			f.expect(t, mcbgo_bridge_close(*out, f.eb, f.el), status.BadHandle, "second close")
		})
	}
}

func TestModelRegister(t *testing.T) {
	type args struct {
		bridge uint64
		params unsafe.Pointer
		out    unsafe.Pointer
	}
	unterminated := func(field func(*cModelParams) *uintptr) func(*fixture, *testing.T, *args, *cModelParams) {
		return func(f *fixture, t *testing.T, a *args, p *cModelParams) {
			*field(p) = address(edgeString(t, maxString, 'x'))
		}
	}
	cases := []struct {
		name string
		mut  func(f *fixture, t *testing.T, a *args, p *cModelParams)
		want status.Code
	}{
		{"valid", func(*fixture, *testing.T, *args, *cModelParams) {}, status.OK},
		{"longest arch", func(f *fixture, t *testing.T, a *args, p *cModelParams) {
			p.Arch = address(edgeString(t, maxString, 0))
		}, status.OK},
		{"GGUF file", func(f *fixture, t *testing.T, a *args, p *cModelParams) {
			p.GGUFPath = f.c.cstr(t, "testdata/weights.bin")
		}, status.OK},
		{"bridge 0", func(f *fixture, t *testing.T, a *args, p *cModelParams) { a.bridge = 0 }, status.BadHandle},
		{"random bridge", func(f *fixture, t *testing.T, a *args, p *cModelParams) { a.bridge = 0x7fff_1234_5678_9abc }, status.BadHandle},
		{"model as bridge", func(f *fixture, t *testing.T, a *args, p *cModelParams) {
			a.bridge = f.register(t, a.bridge, p)
		}, status.BadHandle},
		{"closed bridge", func(f *fixture, t *testing.T, a *args, p *cModelParams) {
			a.bridge = f.open(t, f.config(""))
			f.expect(t, mcbgo_bridge_close(a.bridge, f.eb, f.el), status.OK, "close")
		}, status.BadHandle},
		{"NULL out", func(f *fixture, t *testing.T, a *args, p *cModelParams) { a.out = nil }, status.InvalidArg},
		{"misaligned out", func(f *fixture, t *testing.T, a *args, p *cModelParams) { a.out = unsafe.Add(a.out, 4) }, status.InvalidArg},
		{"NULL params", func(f *fixture, t *testing.T, a *args, p *cModelParams) { a.params = nil }, status.InvalidArg},
		{"misaligned params", func(f *fixture, t *testing.T, a *args, p *cModelParams) {
			a.params = unsafe.Pointer(put(f.c, *p, 4))
		}, status.InvalidArg},
		{"no layers", func(f *fixture, t *testing.T, a *args, p *cModelParams) { p.NLayer = 0 }, status.InvalidArg},
		{"5000 layers", func(f *fixture, t *testing.T, a *args, p *cModelParams) { p.NLayer = 5000 }, status.InvalidArg},
		{"NULL n_embd_k_gqa", func(f *fixture, t *testing.T, a *args, p *cModelParams) { p.NEmbdKGQA = 0 }, status.InvalidArg},
		{"NULL n_embd_v_gqa", func(f *fixture, t *testing.T, a *args, p *cModelParams) { p.NEmbdVGQA = 0 }, status.InvalidArg},
		{"NULL k_row_bytes", func(f *fixture, t *testing.T, a *args, p *cModelParams) { p.KRowBytes = 0 }, status.InvalidArg},
		{"NULL v_row_bytes", func(f *fixture, t *testing.T, a *args, p *cModelParams) { p.VRowBytes = 0 }, status.InvalidArg},
		{"misaligned k_row_bytes", func(f *fixture, t *testing.T, a *args, p *cModelParams) {
			p.KRowBytes = f.c.u32s(t, []uint32{0, 16, 32, 8}) + 2
		}, status.InvalidArg},
		{"empty K row", func(f *fixture, t *testing.T, a *args, p *cModelParams) {
			p.KRowBytes = f.c.u32s(t, []uint32{16, 0, 8})
		}, status.InvalidArg},
		{"block of 2^17 tokens", func(f *fixture, t *testing.T, a *args, p *cModelParams) { p.BlockTokens = 1 << 17 }, status.InvalidArg},
		{"transposed V of partial elements", func(f *fixture, t *testing.T, a *args, p *cModelParams) {
			p.VTrans = true
			p.VRowBytes = f.c.u32s(t, []uint32{16, 7, 24})
		}, status.InvalidArg},
		{"block bigger than half the pool", func(f *fixture, t *testing.T, a *args, p *cModelParams) {
			p.KRowBytes = f.c.u32s(t, []uint32{1 << 22, 32, 8})
		}, status.Config},
		{"unterminated llama_version", unterminated(func(p *cModelParams) *uintptr { return &p.LlamaVersion }), status.InvalidArg},
		{"unterminated arch", unterminated(func(p *cModelParams) *uintptr { return &p.Arch }), status.InvalidArg},
		{"unterminated gguf_path", unterminated(func(p *cModelParams) *uintptr { return &p.GGUFPath }), status.InvalidArg},
		{"unterminated extra", unterminated(func(p *cModelParams) *uintptr { return &p.Extra }), status.InvalidArg},
		{"missing GGUF", func(f *fixture, t *testing.T, a *args, p *cModelParams) {
			p.GGUFPath = f.c.cstr(t, "testdata/missing.gguf")
		}, status.InvalidArg},
		{"GGUF path a directory", func(f *fixture, t *testing.T, a *args, p *cModelParams) { p.GGUFPath = f.c.cstr(t, "testdata") }, status.InvalidArg},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t)
			p := testModel(false).params(t, f.c)
			out := put(f.c, [2]uint64{sentinel, sentinel}, 0) // room for a misaligned out
			a := args{bridge: f.open(t, f.config("")), params: unsafe.Pointer(p), out: unsafe.Pointer(out)}
			c.mut(f, t, &a, p)
			open := mcbgo_handles_open()
			got := mcbgo_model_register(a.bridge, a.params, a.out, f.eb, f.el)
			f.expect(t, got, c.want, "register")
			if c.want != status.OK {
				if *out != [2]uint64{sentinel, sentinel} {
					t.Errorf("a failed register wrote %#x", *out)
				}
				if n := mcbgo_handles_open(); n != open {
					t.Errorf("a failed register left %d handles, %d before", n, open)
				}
				return
			}
			f.expect(t, mcbgo_model_unregister(out[0], f.eb, f.el), status.OK, "unregister")
			f.expect(t, mcbgo_model_unregister(out[0], f.eb, f.el), status.BadHandle, "second unregister")
		})
	}
}

// TestModelKeySpaces checks the header's promise that two registrations
// whose fields differ never share blocks, and that equal ones do.
func TestModelKeySpaces(t *testing.T) {
	f := newFixture(t)
	b := f.open(t, f.config(""))
	g := testModel(false)
	m := f.register(t, b, g.params(t, f.c))
	tok := prompt(31, 0, 31)
	src := newTensors(f.c, g, 64, false, tight)
	src.compute(tok, nil, len(tok))
	if r := f.save(t, m, nil, src, tok, len(tok), nil); r.NPublished != 7 {
		t.Fatalf("saved %+v", r)
	}
	same := func(*cModelParams) {}
	cases := []struct {
		name   string
		mut    func(*cModelParams)
		shared bool
	}{
		{"same parameters", same, true},
		{"llama_version", func(p *cModelParams) { p.LlamaVersion = f.c.cstr(t, "b6001") }, false},
		{"arch", func(p *cModelParams) { p.Arch = f.c.cstr(t, "qwen2") }, false},
		{"content_hash", func(p *cModelParams) { p.ContentHash[15] = 1 }, false},
		{"gguf_path", func(p *cModelParams) { p.GGUFPath = f.c.cstr(t, "testdata/weights.bin") }, false},
		{"kv_probe", func(p *cModelParams) { p.KVProbe[0] = 1 }, false},
		{"block_tokens", func(p *cModelParams) { p.BlockTokens = 2 }, false},
		{"block_tokens 0 takes the default", func(p *cModelParams) { p.BlockTokens = 0 }, false},
		{"n_embd_k_gqa", func(p *cModelParams) {
			p.NEmbdKGQA = f.c.u32s(t, []uint32{8, 16, 8})
			p.KRowBytes = f.c.u32s(t, []uint32{16, 32, 16})
		}, false},
		{"type_k", func(p *cModelParams) { p.TypeK = 8 }, false},
		{"type_v", func(p *cModelParams) { p.TypeV = 0 }, false},
		{"rope_type", func(p *cModelParams) { p.RopeType = 2 }, false},
		{"rope_freq_base", func(p *cModelParams) { p.RopeFreqBase = 500000 }, false},
		{"rope_freq_scale", func(p *cModelParams) { p.RopeFreqScale = 0.25 }, false},
		{"n_ctx_orig", func(p *cModelParams) { p.NCtxOrig = 8192 }, false},
		{"v_trans", func(p *cModelParams) { p.VTrans = true }, false},
		{"attn_rot_k", func(p *cModelParams) { p.AttnRotK = true }, false},
		{"attn_rot_v", func(p *cModelParams) { p.AttnRotV = true }, false},
		{"extra", func(p *cModelParams) { p.Extra = f.c.cstr(t, "swa=4096") }, false},
		{"empty extra is no extra", func(p *cModelParams) { p.Extra = f.c.cstr(t, "") }, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := g.params(t, f.c)
			c.mut(p)
			m2 := f.register(t, b, p)
			defer func() { f.expect(t, mcbgo_model_unregister(m2, f.eb, f.el), status.OK, "unregister") }()
			r := f.lookup(t, m2, nil, tok, len(tok))
			if shared := r.NMatchedBlocks > 0; shared != c.shared {
				t.Errorf("matched %d blocks of the other registration", r.NMatchedBlocks)
			}
		})
	}
	scopes := []struct {
		name   string
		scope  *cScope
		shared bool
	}{
		{"no scope", nil, true},
		{"empty scope", f.scope(t, "", ""), true},
		{"salt pointer with length 0", put(f.c, cScope{TenantSalt: f.c.cstr(t, "ignored")}, 0), true},
		{"empty adapters", put(f.c, cScope{Adapters: f.c.cstr(t, "")}, 0), true},
		{"tenant salt", f.scope(t, "tenant-a", ""), false},
		{"salt with a NUL", put(f.c, cScope{TenantSalt: f.c.cstr(t, "a\x00b"), TenantSaltLen: 3}, 0), false},
		{"adapters", f.scope(t, "", "lora-a@1.0"), false},
	}
	for _, c := range scopes {
		t.Run("scope/"+c.name, func(t *testing.T) {
			r := f.lookup(t, m, c.scope, tok, len(tok))
			if shared := r.NMatchedBlocks > 0; shared != c.shared {
				t.Errorf("matched %d blocks saved without a scope", r.NMatchedBlocks)
			}
		})
	}
}

func TestObservePrefill(t *testing.T) {
	f := newFixture(t)
	b := f.open(t, f.config(""))
	m := f.register(t, b, testModel(false).params(t, f.c))
	gone := f.register(t, b, testModel(false).params(t, f.c))
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
// prompt's blocks layer by layer from one set of tensors, look them up,
// and restore them layer by layer into other cells of other tensors,
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
		salt     string
		adapters string
	}{
		{name: "row-major", src: wrapCells(n, 40, cells), dst: reversed(n, cells), pad: tight},
		{name: "transposed V", vtrans: true, src: wrapCells(n, 40, cells), dst: reversed(n, cells), pad: tight},
		{name: "identity cells", pad: tight},
		{name: "padded strides", src: wrapCells(n, 50, cells), dst: wrapCells(n, 3, cells), pad: padded},
		{name: "padded transposed", vtrans: true, src: reversed(n, cells), dst: wrapCells(n, 60, cells), pad: padded},
		{name: "tenant and adapters", src: wrapCells(n, 9, cells), dst: reversed(n, cells), pad: tight,
			salt: "tenant-a", adapters: "lora-a@0.5;lora-b@1"},
		{name: "from a peer", peer: true, src: wrapCells(n, 40, cells), dst: reversed(n, cells), pad: tight},
		{name: "from a peer, transposed", peer: true, vtrans: true, src: wrapCells(n, 33, cells), dst: wrapCells(n, 1, cells), pad: padded},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t)
			g := testModel(c.vtrans)
			saver := f.open(t, f.config(""))
			loader := saver
			if c.peer {
				loader = f.open(t, f.config(""))
			}
			ms := f.register(t, saver, g.params(t, f.c))
			ml := ms
			if c.peer {
				ml = f.register(t, loader, g.params(t, f.c))
			}
			var scope *cScope
			if c.salt != "" || c.adapters != "" {
				scope = f.scope(t, c.salt, c.adapters)
			}
			tok := prompt(40, 0, 40)
			B := int(g.block)

			lk := f.lookup(t, ml, scope, tok, n)
			if lk != (cLookupResult{NBlockTokens: g.block, Reason: int32(arbiter.NoMatch), EstRestoreMS: lk.EstRestoreMS,
				EstRecomputeMS: lk.EstRecomputeMS, EstTotalMS: lk.EstTotalMS}) {
				t.Errorf("cold lookup: %+v", lk)
			}

			src := newTensors(f.c, g, cells, c.vtrans, c.pad)
			src.compute(tok, c.src, n)
			computed := src.snapshot()
			if r := f.save(t, ms, scope, src, tok, n, c.src); r != (cSaveResult{NBlocks: 7, NWritten: 7, NPublished: 7}) {
				t.Errorf("save: %+v", r)
			}
			if err := src.checkUntouched(computed); err != nil {
				t.Errorf("the save wrote into its source: %v", err)
			}

			lk = f.lookup(t, ml, scope, tok, n)
			if lk.NMatchedBlocks != 7 || lk.NRestoreTokens != uint32(7*B) || lk.Reason != int32(arbiter.PolicyForced) ||
				lk.NBlockTokens != g.block || !(lk.EstRestoreMS >= 0) || !(lk.EstTotalMS >= 0) {
				t.Errorf("warm lookup: %+v", lk)
			}
			// The last token is always computed, so a prompt of exactly 7
			// blocks can restore 6 of them.
			if r := f.lookup(t, ml, scope, tok, 7*B); r.NMatchedBlocks != 6 || r.NRestoreTokens != uint32(6*B) {
				t.Errorf("lookup of 7 whole blocks: %+v", r)
			}

			dst := newTensors(f.c, g, cells, c.vtrans, c.pad)
			want := cLoadResult{NBlocks: 7, NBlocksOK: 7, NTokensOK: uint32(7 * B), NBytes: uint64(7 * g.payload())}
			if r := f.load(t, ml, scope, dst, tok, int(lk.NRestoreTokens), c.dst); r != want {
				t.Errorf("load: %+v, want %+v", r, want)
			}
			// Asking for more blocks than are cached restores those that are.
			more := newTensors(f.c, g, cells, c.vtrans, c.pad)
			if r := f.load(t, ml, scope, more, tok, 10*B, wrapCells(10*B, 17, cells)); r != want {
				t.Errorf("load of 10 blocks: %+v, want %+v", r, want)
			}
			if r := f.save(t, ms, scope, src, tok, n, c.src); r != (cSaveResult{NBlocks: 7, NKnown: 7}) {
				t.Errorf("second save: %+v", r)
			}

			st := f.stats(t, loader)
			if st.Lookups != 3 || st.Hits != 2 || st.Misses != 1 || st.DecidedRestore != 2 || st.Loads != 2 || st.LoadFailures != 0 ||
				st.RestoredTokens != uint64(14*B) || st.RestoredBytes != uint64(14*g.payload()) || st.PoolBytes != 16<<20 {
				t.Errorf("loader stats: %+v", st)
			}
			st = f.stats(t, saver)
			if st.Saves != 2 || st.SavedBlocks != 7 || st.SaveFailures != 0 || st.ResidentBlocks != 7 ||
				st.ResidentBytes < uint64(7*g.payload()) || st.ResidentBytes > st.PoolBytes {
				t.Errorf("saver stats: %+v", st)
			}
			if c.peer {
				f.expect(t, mcbgo_bridge_close(loader, f.eb, f.el), status.OK, "close loader")
			}
			f.expect(t, mcbgo_bridge_close(saver, f.eb, f.el), status.OK, "close")
			f.expect(t, mcbgo_lookup(ms, nil, f.c.i32s(t, tok), n, unsafe.Pointer(put(f.c, cLookupResult{}, 0)), f.eb, f.el),
				status.BadHandle, "lookup after close")
		})
	}
}

// transfer is the argument list load_begin and save_begin share.
type transfer struct {
	model  uint64
	scope  unsafe.Pointer
	layout unsafe.Pointer
	tokens unsafe.Pointer
	n      uint64
	cells  unsafe.Pointer
	out    unsafe.Pointer
}

func (f *fixture) begin(save bool, x transfer) int32 {
	if save {
		return mcbgo_save_begin(x.model, x.scope, x.layout, x.tokens, x.n, x.cells, x.out, f.eb, f.el)
	}
	return mcbgo_load_begin(x.model, x.scope, x.layout, x.tokens, x.n, x.cells, x.out, f.eb, f.el)
}

// relayout copies a layout and its layer array into new host memory and
// lets mut change the copy.
func (f *fixture) relayout(t testing.TB, lo *cKVLayout, mut func(lo *cKVLayout, layers []cKVLayer)) unsafe.Pointer {
	n := int(lo.NLayer)
	b := f.c.alloc(t, n*int(unsafe.Sizeof(cKVLayer{})), 8)
	layers := unsafe.Slice((*cKVLayer)(pointer(b)), n)
	copy(layers, unsafe.Slice((*cKVLayer)(ptr(lo.Layers)), n))
	cp := put(f.c, *lo, 0)
	cp.Layers = address(b)
	mut(cp, layers)
	return unsafe.Pointer(cp)
}

// TestTransferArguments passes load_begin and save_begin one bad argument
// at a time. Each is refused with its status, the output keeps its value,
// no handle appears, and a refused load leaves the tensors untouched.
func TestTransferArguments(t *testing.T) {
	for _, vtrans := range []bool{false, true} {
		t.Run(map[bool]string{false: "row-major", true: "transposed"}[vtrans], func(t *testing.T) {
			transferArguments(t, vtrans)
		})
	}
}

func transferArguments(t *testing.T, vtrans bool) {
	const cells = 64
	f := newFixture(t)
	g := testModel(vtrans)
	B := int(g.block)
	b := f.open(t, f.config(""))
	m := f.register(t, b, g.params(t, f.c))
	gone := f.register(t, b, g.params(t, f.c))
	f.expect(t, mcbgo_model_unregister(gone, f.eb, f.el), status.OK, "unregister")
	tok := prompt(100, 0, 100)
	cs := reversed(7*B, cells)
	src := newTensors(f.c, g, cells, vtrans, tight)
	src.compute(tok, cs, 7*B)
	f.save(t, m, nil, src, tok, 7*B+2, append(cs, 20, 21))
	dst := newTensors(f.c, g, cells, vtrans, tight)
	base := transfer{model: m, layout: unsafe.Pointer(dst.layout), tokens: f.c.i32s(t, tok), n: uint64(7 * B), cells: f.cells(t, cs)}

	layout := func(mut func(lo *cKVLayout, layers []cKVLayer)) func(*fixture, *transfer) {
		return func(f *fixture, x *transfer) { x.layout = f.relayout(t, (*cKVLayout)(x.layout), mut) }
	}
	cellsWith := func(mut func([]uint32)) func(*fixture, *transfer) {
		return func(f *fixture, x *transfer) {
			c := append([]uint32(nil), cs...)
			mut(c)
			x.cells = f.cells(t, c)
		}
	}
	shortV := func(lo *cKVLayout, ls []cKVLayer) { ls[2].VStride = uint64(g.vrow(2) - 1) }
	if vtrans {
		shortV = func(lo *cKVLayout, ls []cKVLayer) { ls[2].VStride = uint64((cells - 1) * elem) }
	}
	cases := []struct {
		name       string
		mut        func(f *fixture, x *transfer)
		load, save status.Code
	}{
		{"model 0", func(f *fixture, x *transfer) { x.model = 0 }, status.BadHandle, status.BadHandle},
		{"random model", func(f *fixture, x *transfer) { x.model = 0x4000_0000_0000_0001 }, status.BadHandle, status.BadHandle},
		{"bridge as model", func(f *fixture, x *transfer) { x.model = b }, status.BadHandle, status.BadHandle},
		{"unregistered model", func(f *fixture, x *transfer) { x.model = gone }, status.BadHandle, status.BadHandle},
		{"NULL out", func(f *fixture, x *transfer) { x.out = nil }, status.InvalidArg, status.InvalidArg},
		{"misaligned out", func(f *fixture, x *transfer) { x.out = unsafe.Add(x.out, 4) }, status.InvalidArg, status.InvalidArg},
		{"misaligned scope", func(f *fixture, x *transfer) { x.scope = unsafe.Pointer(put(f.c, cScope{}, 4)) }, status.InvalidArg, status.InvalidArg},
		{"salt NULL with a length", func(f *fixture, x *transfer) { x.scope = unsafe.Pointer(put(f.c, cScope{TenantSaltLen: 8}, 0)) },
			status.InvalidArg, status.InvalidArg},
		{"salt of 5000 bytes", func(f *fixture, x *transfer) {
			x.scope = unsafe.Pointer(put(f.c, cScope{TenantSalt: address(f.c.alloc(t, 5000, 1)), TenantSaltLen: 5000}, 0))
		}, status.InvalidArg, status.InvalidArg},
		{"unterminated adapters", func(f *fixture, x *transfer) {
			x.scope = unsafe.Pointer(put(f.c, cScope{Adapters: address(edgeString(t, maxString, 'x'))}, 0))
		}, status.InvalidArg, status.InvalidArg},
		{"NULL layout", func(f *fixture, x *transfer) { x.layout = nil }, status.InvalidArg, status.InvalidArg},
		{"misaligned layout", func(f *fixture, x *transfer) { x.layout = unsafe.Pointer(put(f.c, *(*cKVLayout)(x.layout), 4)) },
			status.InvalidArg, status.InvalidArg},
		{"layout of 0 layers", layout(func(lo *cKVLayout, _ []cKVLayer) { lo.NLayer = 0 }), status.Layout, status.Layout},
		{"layout of 5000 layers", layout(func(lo *cKVLayout, _ []cKVLayer) { lo.NLayer = 5000 }), status.Layout, status.Layout},
		{"layout of fewer layers", layout(func(lo *cKVLayout, _ []cKVLayer) { lo.NLayer-- }), status.Layout, status.Layout},
		{"NULL layers", layout(func(lo *cKVLayout, _ []cKVLayer) { lo.Layers = 0 }), status.InvalidArg, status.InvalidArg},
		{"misaligned layers", layout(func(lo *cKVLayout, _ []cKVLayer) { lo.Layers += 4 }), status.InvalidArg, status.InvalidArg},
		{"no cells", layout(func(lo *cKVLayout, _ []cKVLayer) { lo.NCells = 0 }), status.Layout, status.Layout},
		{"fewer cells than used", layout(func(lo *cKVLayout, _ []cKVLayer) { lo.NCells = cells - 1 }), status.Layout, status.Layout},
		{"NULL K", layout(func(_ *cKVLayout, ls []cKVLayer) { ls[1].K = 0 }), status.Layout, status.Layout},
		{"NULL V", layout(func(_ *cKVLayout, ls []cKVLayer) { ls[0].V = 0 }), status.Layout, status.Layout},
		{"K stride below the row", layout(func(_ *cKVLayout, ls []cKVLayer) { ls[1].KStride = uint64(g.krow(1) - 1) }),
			status.Layout, status.Layout},
		{"V stride too short", layout(shortV), status.Layout, status.Layout},
		{"K running past the top of the address space", layout(func(_ *cKVLayout, ls []cKVLayer) { ls[0].K = ^uintptr(0) - 511 }),
			status.Layout, status.Layout},
		{"V stride wrapping around", layout(func(_ *cKVLayout, ls []cKVLayer) { ls[2].VStride = 1 << 63 }), status.Layout, status.Layout},
		{"K stride wrapping around", layout(func(_ *cKVLayout, ls []cKVLayer) { ls[0].KStride = math.MaxUint64 / 2 }),
			status.Layout, status.Layout},
		{"device location", layout(func(lo *cKVLayout, _ []cKVLayer) { lo.Location = f.c.cstr(t, "cuda:0") }),
			status.Unsupported, status.Unsupported},
		{"location without a device", layout(func(lo *cKVLayout, _ []cKVLayer) { lo.Location = f.c.cstr(t, "cpu:") }),
			status.Unsupported, status.Unsupported},
		{"unterminated location", layout(func(lo *cKVLayout, _ []cKVLayer) { lo.Location = address(edgeString(t, 64, 'x')) }),
			status.InvalidArg, status.InvalidArg},
		{"NULL tokens", func(f *fixture, x *transfer) { x.tokens = nil }, status.InvalidArg, status.InvalidArg},
		{"misaligned tokens", func(f *fixture, x *transfer) { x.tokens = unsafe.Add(x.tokens, 2) }, status.InvalidArg, status.InvalidArg},
		{"no tokens", func(f *fixture, x *transfer) { x.n = 0 }, status.InvalidArg, status.InvalidArg},
		{"2^40 tokens", func(f *fixture, x *transfer) { x.n = 1 << 40 }, status.InvalidArg, status.InvalidArg},
		{"one token over the limit", func(f *fixture, x *transfer) { x.n = maxTokens + 1 }, status.InvalidArg, status.InvalidArg},
		{"2^64-1 tokens", func(f *fixture, x *transfer) { x.n = math.MaxUint64 }, status.InvalidArg, status.InvalidArg},
		{"tokens below a block", func(f *fixture, x *transfer) { x.n = uint64(B - 1) }, status.InvalidArg, status.InvalidArg},
		// A save ignores a trailing partial block; a load restores whole
		// blocks only.
		{"tokens not whole blocks", func(f *fixture, x *transfer) { x.n-- }, status.InvalidArg, status.OK},
		{"misaligned cells", func(f *fixture, x *transfer) { x.cells = unsafe.Add(x.cells, 1) }, status.InvalidArg, status.InvalidArg},
		{"cell beyond the tensors", cellsWith(func(c []uint32) { c[5] = cells }), status.Layout, status.Layout},
		{"last cell 2^32-1", cellsWith(func(c []uint32) { c[len(c)-1] = math.MaxUint32 }), status.Layout, status.Layout},
		{"duplicated cell", cellsWith(func(c []uint32) { c[9] = c[2] }), status.Layout, status.Layout},
		{"identity cells past the tensors", func(f *fixture, x *transfer) { x.cells, x.n = nil, uint64(17*B) }, status.Layout, status.Layout},
		{"prompt not cached", func(f *fixture, x *transfer) { x.tokens = f.c.i32s(t, prompt(100, 3, 0)) }, status.NotFound, status.OK},
		{"another tenant", func(f *fixture, x *transfer) { x.scope = unsafe.Pointer(f.scope(t, "tenant-b", "")) }, status.NotFound, status.OK},
	}
	// The base arguments work, so each refusal below is the one argument's.
	for _, save := range []bool{false, true} {
		x := base
		if save {
			x.layout = unsafe.Pointer(src.layout)
		}
		x.out = unsafe.Pointer(f.out())
		if f.expect(t, f.begin(save, x), status.OK, "the base arguments") {
			finish(t, f, save, *(*uint64)(x.out), g.layers())
		}
	}
	if err := dst.checkRestore(dst.snapshot(), tok, cs, 7*B, 7*B, g.layers()); err != nil {
		t.Fatalf("the base load: %v", err)
	}
	restored := dst.snapshot()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			for _, save := range []bool{false, true} {
				x := base
				want := c.load
				if save {
					x.layout, want = unsafe.Pointer(src.layout), c.save
				}
				out := put(f.c, [2]uint64{sentinel, sentinel}, 0)
				x.out = unsafe.Pointer(out)
				c.mut(f, &x)
				open := mcbgo_handles_open()
				got := f.begin(save, x)
				what := map[bool]string{false: "load begin", true: "save begin"}[save]
				if !f.expect(t, got, want, what) {
					if got == int32(status.OK) {
						finish(t, f, save, out[0], g.layers())
					}
					continue
				}
				if err := dst.checkUntouched(restored); err != nil {
					t.Errorf("%s: %v", what, err)
				}
				if want == status.OK {
					finish(t, f, save, out[0], g.layers())
					continue
				}
				if *out != [2]uint64{sentinel, sentinel} {
					t.Errorf("%s wrote %#x on failure", what, *out)
				}
				if n := mcbgo_handles_open(); n != open {
					t.Errorf("%s: %d handles after a refusal, %d before", what, n, open)
				}
			}
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
		f.expect(t, mcbgo_save_end(h, unsafe.Pointer(put(f.c, cSaveResult{}, 0)), f.eb, f.el), status.OK, "save end")
		return
	}
	f.expect(t, mcbgo_load_end(h, unsafe.Pointer(put(f.c, cLoadResult{}, 0)), f.eb, f.el), status.OK, "load end")
}

func TestLookupArguments(t *testing.T) {
	f := newFixture(t)
	g := testModel(false)
	b := f.open(t, f.config(""))
	m := f.register(t, b, g.params(t, f.c))
	tok := prompt(31, 0, 31)
	cases := []struct {
		name   string
		model  uint64
		scope  unsafe.Pointer
		tokens func() unsafe.Pointer // nil passes the prompt
		n      uint64
		skew   int // added to the output's address; -1 passes NULL
		want   status.Code
	}{
		{name: "valid", model: m, n: 31, want: status.OK},
		{name: "one token", model: m, n: 1, want: status.OK},
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
		{name: "misaligned scope", model: m, scope: unsafe.Pointer(put(f.c, cScope{}, 4)), n: 31, want: status.InvalidArg},
		{name: "salt NULL with a length", model: m, scope: unsafe.Pointer(put(f.c, cScope{TenantSaltLen: 1}, 0)), n: 31, want: status.InvalidArg},
		{name: "salt longer than the limit", model: m,
			scope: unsafe.Pointer(put(f.c, cScope{TenantSalt: address(f.c.alloc(t, maxSaltBytes+1, 1)), TenantSaltLen: maxSaltBytes + 1}, 0)),
			n:     31, want: status.InvalidArg},
		{name: "salt at the limit", model: m,
			scope: unsafe.Pointer(put(f.c, cScope{TenantSalt: address(f.c.alloc(t, maxSaltBytes, 1)), TenantSaltLen: maxSaltBytes}, 0)),
			n:     31, want: status.OK},
		{name: "unterminated adapters", model: m, scope: unsafe.Pointer(put(f.c, cScope{Adapters: address(edgeString(t, maxString, 'x'))}, 0)),
			n: 31, want: status.InvalidArg},
		{name: "longest adapters", model: m, scope: unsafe.Pointer(put(f.c, cScope{Adapters: address(edgeString(t, maxString, 0))}, 0)),
			n: 31, want: status.OK},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tokens := f.c.i32s(t, tok)
			if c.tokens != nil {
				tokens = c.tokens()
			}
			res := put(f.c, [2]cLookupResult{{NBlockTokens: sentinel & math.MaxUint32}}, 0)
			out := unsafe.Add(unsafe.Pointer(res), max(c.skew, 0))
			if c.skew < 0 {
				out = nil
			}
			f.expect(t, mcbgo_lookup(c.model, c.scope, tokens, c.n, out, f.eb, f.el), c.want, "lookup")
			if c.want != status.OK && res[0].NBlockTokens != sentinel&math.MaxUint32 {
				t.Errorf("a failed lookup wrote %+v", res[0])
			}
			if c.want == status.OK && res[0].NBlockTokens != g.block {
				t.Errorf("lookup: %+v", res[0])
			}
		})
	}
}

// TestLoadSaveHandles drives wait, end and save-layer with wrong handles,
// bad outputs and calls out of order.
func TestLoadSaveHandles(t *testing.T) {
	f := newFixture(t)
	g := testModel(false)
	B := int(g.block)
	b := f.open(t, f.config(""))
	m := f.register(t, b, g.params(t, f.c))
	tok := prompt(40, 0, 40)
	src := newTensors(f.c, g, 64, false, tight)
	src.compute(tok, nil, 40)
	f.save(t, m, nil, src, tok, 28, nil)
	dst := newTensors(f.c, g, 64, false, tight)
	before := dst.snapshot()

	ld, sv := f.out(), f.out()
	f.expect(t, mcbgo_load_begin(m, nil, unsafe.Pointer(dst.layout), f.c.i32s(t, tok), 28, nil, unsafe.Pointer(ld), f.eb, f.el), status.OK, "load begin")
	other := prompt(40, 1, 0) // blocks not cached, so the save has rows to copy
	src.compute(other, nil, 40)
	f.expect(t, mcbgo_save_begin(m, nil, unsafe.Pointer(src.layout), f.c.i32s(t, other), 40, nil, unsafe.Pointer(sv), f.eb, f.el), status.OK, "save begin")

	nok := put(f.c, [2]uint32{math.MaxUint32, math.MaxUint32}, 0)
	lres := put(f.c, [2]cLoadResult{}, 0)
	sres := put(f.c, [2]cSaveResult{}, 0)
	steps := []struct {
		name string
		call func() int32
		want status.Code
	}{
		{"wait on load 0", func() int32 { return mcbgo_load_wait_layer(0, 0, unsafe.Pointer(nok), f.eb, f.el) }, status.BadHandle},
		{"wait on a save", func() int32 { return mcbgo_load_wait_layer(*sv, 0, unsafe.Pointer(nok), f.eb, f.el) }, status.BadHandle},
		{"wait on a model", func() int32 { return mcbgo_load_wait_layer(m, 0, unsafe.Pointer(nok), f.eb, f.el) }, status.BadHandle},
		{"wait with NULL count", func() int32 { return mcbgo_load_wait_layer(*ld, 0, nil, f.eb, f.el) }, status.InvalidArg},
		{"wait with misaligned count", func() int32 { return mcbgo_load_wait_layer(*ld, 0, unsafe.Add(unsafe.Pointer(nok), 2), f.eb, f.el) },
			status.InvalidArg},
		{"wait past the last layer", func() int32 { return mcbgo_load_wait_layer(*ld, uint32(g.layers()), unsafe.Pointer(nok), f.eb, f.el) },
			status.InvalidArg},
		{"wait on layer 2^32-1", func() int32 { return mcbgo_load_wait_layer(*ld, math.MaxUint32, unsafe.Pointer(nok), f.eb, f.el) },
			status.InvalidArg},
		{"wait on layer 1", func() int32 { return mcbgo_load_wait_layer(*ld, 1, unsafe.Pointer(nok), f.eb, f.el) }, status.OK},
		{"wait on layer 0 again", func() int32 { return mcbgo_load_wait_layer(*ld, 0, unsafe.Pointer(nok), f.eb, f.el) }, status.OK},
		{"end with NULL result", func() int32 { return mcbgo_load_end(*ld, nil, f.eb, f.el) }, status.InvalidArg},
		{"end with misaligned result", func() int32 { return mcbgo_load_end(*ld, unsafe.Add(unsafe.Pointer(lres), 4), f.eb, f.el) },
			status.InvalidArg},
		{"end a save as a load", func() int32 { return mcbgo_load_end(*sv, unsafe.Pointer(lres), f.eb, f.el) }, status.BadHandle},
		{"wait after refused ends", func() int32 { return mcbgo_load_wait_layer(*ld, 2, unsafe.Pointer(nok), f.eb, f.el) }, status.OK},
		{"end", func() int32 { return mcbgo_load_end(*ld, unsafe.Pointer(lres), f.eb, f.el) }, status.OK},
		{"end twice", func() int32 { return mcbgo_load_end(*ld, unsafe.Pointer(lres), f.eb, f.el) }, status.BadHandle},
		{"wait after end", func() int32 { return mcbgo_load_wait_layer(*ld, 0, unsafe.Pointer(nok), f.eb, f.el) }, status.BadHandle},
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
		if s.name == "wait on layer 1" && nok[0] != uint32(7*B) {
			t.Errorf("wait: %d tokens good, want %d", nok[0], 7*B)
		}
	}
	if lres[0] != (cLoadResult{NBlocks: 7, NBlocksOK: 7, NTokensOK: uint32(7 * B), NBytes: uint64(7 * g.payload())}) {
		t.Errorf("load result %+v", lres[0])
	}
	if sres[0] != (cSaveResult{NBlocks: 10}) {
		t.Errorf("save ended early: %+v, want the blocks counted and nothing written", sres[0])
	}
	if err := dst.checkRestore(before, tok, nil, 28, 28, g.layers()); err != nil {
		t.Error(err)
	}
	// A save of blocks all known copies nothing and needs no layer.
	known := f.out()
	f.expect(t, mcbgo_save_begin(m, nil, unsafe.Pointer(src.layout), f.c.i32s(t, tok), 28, nil, unsafe.Pointer(known), f.eb, f.el),
		status.OK, "save of known blocks")
	f.expect(t, mcbgo_save_end(*known, unsafe.Pointer(sres), f.eb, f.el), status.OK, "its end")
	if sres[0] != (cSaveResult{NBlocks: 7, NKnown: 7}) {
		t.Errorf("save of known blocks: %+v", sres[0])
	}
	if st := f.stats(t, b); st.Saves != 2 || st.SaveFailures != 1 || st.SavedBlocks != 7 || st.Loads != 1 {
		t.Errorf("stats %+v", st)
	}
}

func TestStatsArguments(t *testing.T) {
	f := newFixture(t)
	b := f.open(t, f.config(""))
	m := f.register(t, b, testModel(false).params(t, f.c))
	closed := f.open(t, f.config(""))
	f.expect(t, mcbgo_bridge_close(closed, f.eb, f.el), status.OK, "close")
	st := put(f.c, [2]cStats{{Lookups: sentinel}}, 0)
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
		if st[0].Lookups != sentinel {
			t.Errorf("%s wrote the stats", c.name)
		}
	}
	f.expect(t, mcbgo_bridge_stats(b, unsafe.Pointer(st), f.eb, f.el), status.OK, "stats")
	if st[0] != (cStats{PoolBytes: 16 << 20}) {
		t.Errorf("stats of a new bridge: %+v", st[0])
	}
}

// TestCloseWithWorkOpen: a bridge refuses to close under a load or save,
// stays usable, and closes once they end; its models go with it.
func TestCloseWithWorkOpen(t *testing.T) {
	f := newFixture(t)
	g := testModel(true)
	b := f.open(t, f.config(""))
	m := f.register(t, b, g.params(t, f.c))
	m2 := f.register(t, b, g.params(t, f.c))
	tok := prompt(40, 0, 40)
	src := newTensors(f.c, g, 64, true, tight)
	src.compute(tok, nil, 40)
	f.save(t, m, nil, src, tok, 40, nil)

	sv, ld := f.out(), f.out()
	f.expect(t, mcbgo_save_begin(m, nil, unsafe.Pointer(src.layout), f.c.i32s(t, tok), 40, nil, unsafe.Pointer(sv), f.eb, f.el), status.OK, "save begin")
	f.expect(t, mcbgo_bridge_close(b, f.eb, f.el), status.State, "close under a save")
	dst := newTensors(f.c, g, 64, true, tight)
	f.expect(t, mcbgo_load_begin(m2, nil, unsafe.Pointer(dst.layout), f.c.i32s(t, tok), 40, nil, unsafe.Pointer(ld), f.eb, f.el), status.OK, "load begin")
	f.expect(t, mcbgo_save_end(*sv, unsafe.Pointer(put(f.c, cSaveResult{}, 0)), f.eb, f.el), status.OK, "save end")
	f.expect(t, mcbgo_bridge_close(b, f.eb, f.el), status.State, "close under a load")
	f.expect(t, mcbgo_load_end(*ld, unsafe.Pointer(put(f.c, cLoadResult{}, 0)), f.eb, f.el), status.OK, "load end")
	f.expect(t, mcbgo_bridge_close(b, f.eb, f.el), status.OK, "close")
	res := unsafe.Pointer(put(f.c, cLookupResult{}, 0))
	for _, h := range []uint64{m, m2} {
		f.expect(t, mcbgo_lookup(h, nil, f.c.i32s(t, tok), 40, res, f.eb, f.el), status.BadHandle, "lookup on a closed bridge's model")
		f.expect(t, mcbgo_model_unregister(h, f.eb, f.el), status.BadHandle, "unregister on a closed bridge")
	}
	f.expect(t, mcbgo_bridge_close(b, f.eb, f.el), status.BadHandle, "close twice")
}

// TestErrorBuffer: the library writes at most errlen bytes, always
// terminated, tolerates no buffer, and clears the message on success.
func TestErrorBuffer(t *testing.T) {
	f := newFixture(t)
	b := f.open(t, f.config(""))
	out := unsafe.Pointer(put(f.c, cStats{}, 0))
	full := func() string {
		mcbgo_bridge_stats(0, out, f.eb, f.el)
		return f.lastError()
	}()
	if !strings.Contains(full, "not an open bridge handle") {
		t.Fatalf("message %q", full)
	}
	buf := f.c.alloc(t, 64, 1)
	for _, n := range []uint64{0, 1, 2, 16, uint64(len(full)), uint64(len(full)) + 1} {
		copy(buf, strings.Repeat("Z", len(buf)))
		f.expect(t, mcbgo_bridge_stats(0, out, pointer(buf), n), status.BadHandle, "stats")
		if n == 0 {
			if buf[0] != 'Z' {
				t.Errorf("errlen 0: the buffer was written")
			}
			continue
		}
		k := min(int(n)-1, len(full))
		if string(buf[:k]) != full[:k] || buf[k] != 0 || buf[n] != 'Z' {
			t.Errorf("errlen %d: buffer %q", n, buf[:n+1])
		}
	}
	f.expect(t, mcbgo_bridge_stats(0, out, nil, 1024), status.BadHandle, "stats without an error buffer")
	f.expect(t, mcbgo_bridge_stats(b, out, f.eb, f.el), status.OK, "stats")
	if f.errb[0] != 0 {
		t.Errorf("a success left the message %q", f.lastError())
	}
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
			if msg := f.lastError(); !strings.Contains(msg, c.msg) || (c.msg == "") != (msg == "") {
				t.Errorf("message %q, want %q", msg, c.msg)
			}
		})
	}
}

// TestConcurrentHosts runs several host threads over one bridge at once,
// each with its own error buffer, model handle and tensors, all sharing
// prompts: what the race detector needs to see the handle table and the
// bridge under load.
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
		h.m = f.register(t, b, g.params(t, f.c))
		for r := 0; r < rounds; r++ {
			tok := prompt(33, r%3, 8*(r%3)) // prompts share prefixes across hosts and rounds
			h.tok = append(h.tok, tok)
			src := newTensors(f.c, g, 48, false, tight)
			src.compute(tok, nil, len(tok))
			h.src = append(h.src, src)
			h.dst = append(h.dst, newTensors(f.c, g, 48, false, tight))
		}
	}
	var wg sync.WaitGroup
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
			calls[r] = call{tok: f.c.i32s(t, h.tok[r]), out: unsafe.Pointer(f.out()), res: unsafe.Pointer(put(f.c, cLoadResult{}, 0)),
				nk: unsafe.Pointer(put(f.c, uint32(0), 0)), before: h.dst[r].snapshot()}
		}
		saveRes := unsafe.Pointer(put(f.c, cSaveResult{}, 0))
		lk := unsafe.Pointer(put(f.c, cLookupResult{}, 0))
		wg.Go(func() {
			hf := h.f
			for r, c := range calls {
				hf.expect(t, mcbgo_lookup(h.m, nil, c.tok, 33, lk, hf.eb, hf.el), status.OK, "lookup")
				if hf.expect(t, mcbgo_save_begin(h.m, nil, unsafe.Pointer(h.src[r].layout), c.tok, 33, nil, c.out, hf.eb, hf.el), status.OK, "save begin") {
					sv := *(*uint64)(c.out)
					for l := 0; l < g.layers(); l++ {
						hf.expect(t, mcbgo_save_layer(sv, uint32(l), hf.eb, hf.el), status.OK, "save layer")
					}
					hf.expect(t, mcbgo_save_end(sv, saveRes, hf.eb, hf.el), status.OK, "save end")
				}
				if !hf.expect(t, mcbgo_load_begin(h.m, nil, unsafe.Pointer(h.dst[r].layout), c.tok, uint64(8*B), nil, c.out, hf.eb, hf.el),
					status.OK, "load begin") {
					continue
				}
				ld := *(*uint64)(c.out)
				hf.expect(t, mcbgo_load_wait_layer(ld, 0, c.nk, hf.eb, hf.el), status.OK, "wait")
				hf.expect(t, mcbgo_load_end(ld, c.res, hf.eb, hf.el), status.OK, "load end")
				res := (*cLoadResult)(c.res)
				if res.NTokensOK != uint32(8*B) {
					t.Errorf("load restored %+v", *res)
				}
				if err := h.dst[r].checkRestore(c.before, h.tok[r], nil, 8*B, int(res.NTokensOK), g.layers()); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	if st := f.stats(t, b); st.Loads != hosts*rounds || st.LoadFailures != 0 || st.Lookups != hosts*rounds {
		t.Errorf("stats %+v", st)
	}
}
