package main

import (
	"bytes"
	"fmt"
	"math"
	"slices"
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/mcbridge/mcbridge/internal/status"
)

// A fuzz program is a sequence of records, one export call each: an
// opcode byte and argBytes argument bytes. Every choice maps its smallest
// residues to hostile arguments, so benign (the value of a byte past the
// end) picks the ordinary case everywhere and seeds stay readable.
const (
	argBytes = 16
	record   = 1 + argBytes
	benign   = 0x7f
	maxCalls = 64
)

type op byte

const (
	opOpen op = iota
	opClose
	opStats
	opRegister
	opUnregister
	opObserve
	opLookup
	opSaveBegin
	opSaveLayer
	opSaveEnd
	opLoadBegin
	opWaitLayer
	opLoadEnd
	nOps
)

// FuzzABI runs programs of export calls with arguments drawn from the
// input, valid and hostile, over KV tensors in host memory. It fails when
// a call returns MCB_STATUS_INTERNAL or a status outside the enum, when a
// refused call changed an output, when any byte of the tensors outside the
// rows a load may write changes (guard gaps, stride padding, other cells,
// the sources of saves), when a restored row does not hold its value, and
// when handles stay open after the program closes everything. Each call's
// status is checked against what its arguments allow.
func FuzzABI(f *testing.F) {
	for _, seed := range fuzzSeeds() {
		f.Add(seed)
	}
	edges := &edgeStrings{
		config:   address(edgeString(f, maxConfig, '{')),
		str:      address(edgeString(f, maxString, 'x')),
		location: address(edgeString(f, 64, 'x')),
	}
	f.Fuzz(func(t *testing.T, prog []byte) {
		w := newWorld(t, edges)
		for i := 0; i < len(prog) && i/record < maxCalls; i += record {
			w.args = prog[i+1 : min(i+record, len(prog))]
			w.call = i / record
			w.step(op(prog[i] % byte(nOps)))
		}
		w.closeAll(true)
	})
}

// rec encodes one call of a seed program; missing arguments read benign.
func rec(o op, args ...byte) []byte {
	r := bytes.Repeat([]byte{benign}, record)
	r[0] = byte(o)
	copy(r[1:], args)
	return r
}

// register is the record of a model of two layers, four-token blocks and
// rows of 8 and 24 f16 elements on the live bridge picked by bridge;
// vtrans 0 transposes V, mutation below 8 breaks the parameters.
func register(bridge, vtrans, mutation, detail byte) []byte {
	return rec(opRegister, benign, bridge, benign, 1, 3, 3, 3, 4, 4, benign, benign, vtrans, mutation, detail)
}

func fuzzSeeds() [][]byte {
	cat := func(recs ...[]byte) []byte { return bytes.Join(recs, nil) }
	saveLoad := func(vtrans byte) []byte {
		return cat(
			rec(opOpen, 1), register(benign, vtrans, benign, benign),
			rec(opLookup),
			rec(opSaveBegin), rec(opSaveLayer), rec(opSaveLayer), rec(opSaveEnd),
			rec(opLookup), rec(opStats),
			rec(opLoadBegin), rec(opWaitLayer), rec(opWaitLayer), rec(opLoadEnd),
			rec(opStats), rec(opClose),
		)
	}
	// Save 28 tokens of a tenant from 41 shuffled cells with padded
	// strides, restore 20 of them into 64 shuffled cells of a transposed V.
	scattered := cat(
		rec(opOpen, 1), register(benign, 1, benign, benign),
		rec(opSaveBegin, benign, benign, benign, 3, 40, benign, 1, 9, benign, benign, 2, 5, benign, 30, 3, 17),
		rec(opSaveLayer), rec(opSaveLayer), rec(opSaveEnd),
		rec(opLoadBegin, benign, benign, benign, 3, 63, 0, 2, 4, benign, benign, 2, 5, benign, 20, 4, 99),
		rec(opWaitLayer), rec(opLoadEnd),
	)
	// Restore from another bridge's pool, whose bridge closes mid-load.
	peers := cat(
		rec(opOpen, 1), rec(opOpen, 2),
		register(0, 1, benign, benign), register(1, 1, benign, benign),
		rec(opSaveBegin, benign, 0), rec(opSaveLayer), rec(opSaveLayer), rec(opSaveEnd),
		rec(opLookup, benign, 1),
		rec(opLoadBegin, benign, 1), rec(opWaitLayer), rec(opClose, benign, 0), rec(opLoadEnd),
		rec(opClose, benign, 0),
	)
	hostile := cat(
		rec(opOpen, 4), rec(opOpen, 6), rec(opOpen, 1, 0), rec(opOpen, 1),
		register(benign, 1, 2, 0), register(benign, 1, 6, 1), register(benign, 1, 4, 3), register(benign, 1, benign, benign),
		rec(opLookup, 0), rec(opLookup, benign, benign, 0), rec(opLookup, benign, benign, benign, 0),
		rec(opLookup, benign, benign, benign, benign, benign, benign, 1),
		rec(opSaveBegin, benign, benign, benign, benign, benign, benign, 0, 1),
		rec(opSaveBegin, benign, benign, benign, benign, benign, benign, benign, benign, 10),
		rec(opLoadBegin, benign, benign, benign, benign, benign, benign, benign, benign, 5),
		rec(opLoadBegin, benign, benign, benign, benign, benign, benign, benign, benign, benign, benign, benign, benign, benign, benign, 1),
		rec(opSaveBegin), rec(opClose), rec(opSaveLayer, benign, benign, benign, 0, 9), rec(opSaveEnd), rec(opSaveEnd),
		rec(opObserve, benign, benign, 3), rec(opObserve), rec(opUnregister), rec(opUnregister),
		rec(opStats, 2), rec(opClose, 1),
	)
	return [][]byte{saveLoad(1), saveLoad(0), scattered, peers, hostile}
}

// edgeStrings are unterminated strings that end at an unreadable page, one
// for each length limit of the ABI, shared by a fuzz process's programs.
type edgeStrings struct{ config, str, location uintptr }

type kind int

const (
	bridgeKind kind = iota + 1
	modelKind
	loadKind
	saveKind
)

// object is what the program knows about one handle it was given.
type object struct {
	kind   kind
	live   bool
	bridge uint64 // the bridge a model, load or save belongs to
	block  uint32 // bridges: the configured block size
	pool   uint64 // bridges: the pool's size
	m      model  // models, loads and saves
	ts     *tensors
	tok    []int32
	cells  []uint32
	n      int
	before []byte // loads: the tensors before the load began
	nok    int    // loads: the good prefix so far
	placed int    // loads: layers waited for
	saved  []bool // saves: layers saved
}

type world struct {
	t       *testing.T
	c       *cmem // structs, strings and arrays
	kv      *cmem // tensors
	edges   *edgeStrings
	errb    []byte
	eb      unsafe.Pointer
	el      uint64
	dir     string
	start   uint64
	args    []byte
	call    int // the record being run, for failure messages
	rng     uint64
	issued  []uint64
	objects map[uint64]*object
	shadow  map[*tensors][]byte // what each tensor set must hold
	order   []*tensors
}

var programs atomic.Uint64

func newWorld(t *testing.T, edges *edgeStrings) *world {
	c := newCmem(t, 4<<20)
	errb := c.alloc(t, 1024, 1)
	w := &world{t: t, c: c, kv: newCmem(t, 16<<20), edges: edges, errb: errb, eb: pointer(errb), el: uint64(len(errb)),
		dir: fmt.Sprintf("fuzz-%d", programs.Add(1)), start: mcbgo_handles_open(),
		objects: map[uint64]*object{}, shadow: map[*tensors][]byte{}}
	t.Cleanup(func() { w.closeAll(false) }) // after a failure, so later programs start clean
	return w
}

func (w *world) arg(i int) byte {
	if i < len(w.args) {
		return w.args[i]
	}
	return benign
}

func (w *world) seed(i int) { w.rng = uint64(w.arg(i))*0x9e3779b97f4a7c15 + 1 }

func (w *world) rand(n int) int {
	w.rng ^= w.rng << 13
	w.rng ^= w.rng >> 7
	w.rng ^= w.rng << 17
	return int(w.rng % uint64(n))
}

func (w *world) lastError() string {
	if i := bytes.IndexByte(w.errb, 0); i >= 0 {
		return string(w.errb[:i])
	}
	return string(w.errb)
}

// check fails the program on MCB_STATUS_INTERNAL, on a status outside the
// enum, and on one outside want.
func (w *world) check(what string, got int32, want ...status.Code) status.Code {
	w.t.Helper()
	if got < 0 || got >= int32(status.Count) || got == int32(status.Internal) {
		w.fail("%s = %d: %q", what, got, w.lastError())
	}
	if !slices.Contains(want, status.Code(got)) {
		w.fail("%s = %d (%s), want one of %v: %q", what, got, status.Code(got), want, w.lastError())
	}
	return status.Code(got)
}

// fail stops the program, naming the call that went wrong.
func (w *world) fail(format string, args ...any) {
	w.t.Helper()
	w.t.Fatalf("call %d: "+format, append([]any{w.call}, args...)...)
}

// expect is the statuses a call may give: BAD_HANDLE alone for a handle
// that is not a live one of its kind, else one of the faults its arguments
// have, else one of ok.
func expect(handleOK bool, faults []status.Code, ok ...status.Code) []status.Code {
	switch {
	case !handleOK:
		return []status.Code{status.BadHandle}
	case len(faults) > 0:
		return faults
	}
	return ok
}

// handle picks a handle argument for a call that wants kind k: mostly a
// live one of that kind, else 0, a random number, any handle issued so far
// (closed ones and other kinds) or one never issued.
func (w *world) handle(k kind) uint64 {
	sel, idx := w.arg(0)%8, int(w.arg(1))
	switch sel {
	case 0:
		return 0
	case 1:
		w.seed(1)
		return uint64(w.rand(math.MaxInt)) << 1
	case 2:
		if len(w.issued) > 0 {
			return w.issued[idx%len(w.issued)]
		}
		return 0
	case 3:
		return slices.Max(append([]uint64{1 << 40}, w.issued...)) + 1 + uint64(idx)
	}
	var live []uint64
	for _, h := range w.issued {
		if o := w.objects[h]; o.live && o.kind == k {
			live = append(live, h)
		}
	}
	if len(live) == 0 {
		return 0
	}
	return live[idx%len(live)]
}

func (w *world) valid(h uint64, k kind) bool {
	o := w.objects[h]
	return o != nil && o.live && o.kind == k
}

func (w *world) issue(h uint64, o *object) {
	if h == 0 || w.objects[h] != nil {
		w.fail("handle %d issued twice or zero", h)
	}
	o.live = true
	w.issued = append(w.issued, h)
	w.objects[h] = o
}

// out returns an output of size bytes aligned to align holding sentinel
// bytes, NULL or misaligned as sel says, and whether it is bad.
func (w *world) out(sel byte, size, align int) (unsafe.Pointer, []byte, bool) {
	b := w.c.alloc(w.t, size+align, align)
	for i := range b {
		b[i] = 0xa5
	}
	switch sel % 16 {
	case 0:
		return nil, b, true
	case 1:
		return unsafe.Add(pointer(b), align/2), b, true
	}
	return pointer(b), b, false
}

func untouched(b []byte) bool {
	for _, x := range b {
		if x != 0xa5 {
			return false
		}
	}
	return true
}

func (w *world) step(o op) {
	switch o {
	case opOpen:
		w.open()
	case opClose:
		w.close()
	case opStats:
		w.stats()
	case opRegister:
		w.register()
	case opUnregister:
		h := w.handle(modelKind)
		ok := w.valid(h, modelKind)
		w.check("unregister", mcbgo_model_unregister(h, w.eb, w.el), expect(ok, nil, status.OK)...)
		if ok {
			w.objects[h].live = false
		}
	case opObserve:
		w.observe()
	case opLookup:
		w.lookup()
	case opSaveBegin:
		w.begin(true)
	case opSaveLayer:
		w.saveLayer()
	case opSaveEnd:
		w.saveEnd(w.handle(saveKind), w.arg(2))
	case opLoadBegin:
		w.begin(false)
	case opWaitLayer:
		w.waitLayer()
	case opLoadEnd:
		w.loadEnd(w.handle(loadKind), w.arg(2))
	}
}

func (w *world) open() {
	configs := []struct {
		doc   string
		fault status.Code
		block uint32
		pool  uint64
	}{
		{doc: `{"pool_bytes":1048576,"directory":{"name":"%s"}}`, block: 256, pool: 1 << 20},
		{doc: `{"pool_bytes":2097152,"block_tokens":4,"eviction":"cost","directory":{"name":"%s"}}`, block: 4, pool: 2 << 20},
		{doc: `{"pool_bytes":4194304,"arbiter":{"policy":"always-restore"},"directory":{"name":"%s"}}`, block: 256, pool: 4 << 20},
		{doc: `{"pool_bytes":1048576,"block_tokens":8,"arbiter":{"policy":"always-recompute"},"directory":{"name":"%s"}}`, block: 8, pool: 1 << 20},
		{doc: `{"pool_bytes":`, fault: status.Config},
		{doc: `{"pool_bytes":1048575,"directory":{"name":"%s"}}`, fault: status.Config},
		{fault: status.InvalidArg}, // unterminated
		{doc: `{"directory":{"name":"%s"},"pool":1}`, fault: status.Config},
	}
	c := configs[w.arg(0)%byte(len(configs))]
	cfg := w.edges.config
	if c.doc != "" {
		cfg = w.c.cstr(w.t, fmt.Sprintf(c.doc, w.dir))
	}
	out, ob, bad := w.out(w.arg(1), 8, 8)
	var faults []status.Code
	if bad {
		faults = append(faults, status.InvalidArg)
	}
	if c.fault != status.OK {
		faults = append(faults, c.fault)
	}
	if w.check("open", mcbgo_bridge_open(ptr(cfg), out, w.eb, w.el), expect(true, faults, status.OK)...) != status.OK {
		if !untouched(ob) {
			w.fail("a failed open wrote its output")
		}
		return
	}
	w.issue(*(*uint64)(out), &object{kind: bridgeKind, block: c.block, pool: c.pool})
}

// busy reports whether a bridge has a load or save not ended.
func (w *world) busy(b uint64) bool {
	for _, o := range w.objects {
		if o.live && (o.kind == loadKind || o.kind == saveKind) && o.bridge == b {
			return true
		}
	}
	return false
}

func (w *world) close() {
	h := w.handle(bridgeKind)
	ok := w.valid(h, bridgeKind)
	want := status.OK
	if ok && w.busy(h) {
		want = status.State
	}
	if w.check("close", mcbgo_bridge_close(h, w.eb, w.el), expect(ok, nil, want)...) != status.OK {
		return
	}
	w.objects[h].live = false
	for _, o := range w.objects {
		if o.kind == modelKind && o.bridge == h {
			o.live = false
		}
	}
}

func (w *world) stats() {
	h := w.handle(bridgeKind)
	out, ob, bad := w.out(w.arg(2), int(unsafe.Sizeof(cStats{})), 8)
	var faults []status.Code
	if bad {
		faults = append(faults, status.InvalidArg)
	}
	if w.check("stats", mcbgo_bridge_stats(h, out, w.eb, w.el), expect(w.valid(h, bridgeKind), faults, status.OK)...) != status.OK {
		if !untouched(ob) {
			w.fail("failed stats wrote their output")
		}
		return
	}
	s := (*cStats)(out)
	if s.Hits+s.Misses != s.Lookups || s.DecidedRestore+s.DecidedRecompute != s.Hits || s.LoadFailures > s.Loads ||
		s.ResidentBytes > s.PoolBytes || s.PoolBytes != w.objects[h].pool {
		w.fail("stats do not add up: %+v", *s)
	}
}

// geometry draws a model: one to three layers of different widths.
func (w *world) geometry(at int) model {
	blocks := []uint32{0, 1, 2, 4, 8, 16}
	embd := []uint32{1, 2, 3, 8, 24, 64, 512}
	m := model{block: blocks[w.arg(at+1)%byte(len(blocks))], vtrans: w.arg(at+8)%2 == 0}
	for l := 0; l < 1+int(w.arg(at))%3; l++ {
		m.kEmbd = append(m.kEmbd, embd[w.arg(at+2+2*l)%byte(len(embd))])
		m.vEmbd = append(m.vEmbd, embd[w.arg(at+3+2*l)%byte(len(embd))])
	}
	return m
}

// misalign copies n uint32s to an address two bytes off their alignment.
func (w *world) misalign(p uintptr, n int) uintptr {
	b := w.c.alloc(w.t, 4*n+4, 4)
	copy(b[2:], mem32(p, n))
	return address(b) + 2
}

func mem32(p uintptr, n int) []byte { return unsafe.Slice((*byte)(ptr(p)), 4*n) }

func (w *world) register() {
	h := w.handle(bridgeKind)
	out, ob, bad := w.out(w.arg(2), 8, 8)
	g := w.geometry(3)
	p := g.params(w.t, w.c)
	arrays := []*uintptr{&p.NEmbdKGQA, &p.NEmbdVGQA, &p.KRowBytes, &p.VRowBytes}
	strs := []*uintptr{&p.LlamaVersion, &p.Arch, &p.GGUFPath, &p.Extra}
	detail := int(w.arg(13))
	mutation := w.arg(12) % 16
	switch mutation {
	case 0:
		p.NLayer = 0
	case 1:
		p.NLayer = 5000
	case 2:
		*arrays[detail%4] = 0
	case 3:
		a := arrays[detail%4]
		*a = w.misalign(*a, g.layers())
	case 4:
		rows := make([]uint32, g.layers())
		for l := range rows {
			rows[l] = uint32(g.row(l, detail%2))
		}
		rows[detail%len(rows)] = 0
		*arrays[2+detail%2] = w.c.u32s(w.t, rows)
	case 5:
		p.BlockTokens = 1 << 17
	case 6:
		*strs[detail%4] = w.edges.str
	case 7:
		p.GGUFPath = w.c.cstr(w.t, "testdata/missing.gguf")
	}
	var faults []status.Code
	if bad || mutation < 8 {
		faults = append(faults, status.InvalidArg)
	}
	success := []status.Code{status.OK}
	if b := w.objects[h]; w.valid(h, bridgeKind) && mutation >= 8 {
		if g.block == 0 {
			g.block = b.block
		}
		// A block that does not fit twice in the pool is refused as
		// configuration; near that, the header's rounding decides.
		switch size := uint64(g.payload()); {
		case 2*size > b.pool:
			faults = append(faults, status.Config)
		case 2*size+64<<10 > b.pool:
			success = append(success, status.Config)
		}
	}
	got := w.check("register", mcbgo_model_register(h, unsafe.Pointer(p), out, w.eb, w.el), expect(w.valid(h, bridgeKind), faults, success...)...)
	if got != status.OK {
		if !untouched(ob) {
			w.fail("a failed register wrote its output")
		}
		return
	}
	w.issue(*(*uint64)(out), &object{kind: modelKind, bridge: h, m: g})
}

func (w *world) observe() {
	h := w.handle(modelKind)
	start, end, secs := uint32(w.arg(3))*16, uint32(w.arg(3))*16+1+uint32(w.arg(4))*16, 0.001*float64(1+w.arg(5))
	var faults []status.Code
	switch w.arg(2) % 8 {
	case 0:
		end = start
	case 1:
		start, end = end, start
	case 2:
		secs = 0
	case 3:
		secs = math.NaN()
	case 4:
		secs = math.Inf(-1)
	case 5:
		secs = 1e300 // beyond a time.Duration: a measurement too wild to use, not an error
	}
	if end <= start || !(secs > 0) || math.IsInf(secs, 0) {
		faults = append(faults, status.InvalidArg)
	}
	w.check("observe prefill", mcbgo_model_observe_prefill(h, start, end, secs, w.eb, w.el), expect(w.valid(h, modelKind), faults, status.OK)...)
}

// scope draws a scope argument and whether it is malformed.
func (w *world) scope(sel byte) (unsafe.Pointer, bool) {
	switch sel % 16 {
	case 0:
		return unsafe.Pointer(put(w.c, cScope{TenantSaltLen: 5}, 0)), true
	case 1:
		return unsafe.Pointer(put(w.c, cScope{}, 4)), true
	case 2:
		return unsafe.Pointer(put(w.c, cScope{Adapters: w.edges.str}, 0)), true
	case 3:
		return unsafe.Pointer(put(w.c, cScope{TenantSalt: w.c.cstr(w.t, "t1"), TenantSaltLen: 2}, 0)), false
	case 4:
		return unsafe.Pointer(put(w.c, cScope{Adapters: w.c.cstr(w.t, "lora@1")}, 0)), false
	}
	return nil, false
}

// tokens draws a prompt of up to limit tokens, or a hostile count or
// pointer; n is only meaningful when bad is false.
func (w *world) tokens(at, limit int, block uint32) (p unsafe.Pointer, tok []int32, n int, bad bool) {
	tok = prompt(96, int(w.arg(at))%3, int(w.arg(at+1))%96)
	p = w.c.i32s(w.t, tok)
	sel := w.arg(at + 2)
	n = 1 + int(w.arg(at+3))%limit
	if sel%32 >= 16 && block > 0 {
		n = max(n/int(block), 1) * int(block)
		if n > limit {
			n = 1 + int(w.arg(at+3))%limit
		}
	}
	switch sel % 32 {
	case 0:
		return p, tok, 0, true
	case 1:
		return p, tok, 1 << 40, true
	case 2:
		return p, tok, maxTokens + 1, true
	case 3:
		return unsafe.Add(p, 2), tok, n, true
	case 4:
		return nil, tok, n, true
	}
	return p, tok, n, false
}

func (w *world) lookup() {
	h := w.handle(modelKind)
	out, ob, outBad := w.out(w.arg(2), int(unsafe.Sizeof(cLookupResult{})), 8)
	scope, scopeBad := w.scope(w.arg(3))
	var g model
	if o := w.objects[h]; o != nil {
		g = o.m
	}
	tp, _, n, tokBad := w.tokens(4, 96, g.block)
	var faults []status.Code
	if outBad || scopeBad || tokBad {
		faults = append(faults, status.InvalidArg)
	}
	if w.check("lookup", mcbgo_lookup(h, scope, tp, uint64(n), out, w.eb, w.el), expect(w.valid(h, modelKind), faults, status.OK)...) != status.OK {
		if !untouched(ob) {
			w.fail("a failed lookup wrote its output")
		}
		return
	}
	r := (*cLookupResult)(out)
	B := r.NBlockTokens
	if B != g.block || r.NRestoreTokens%B != 0 || r.NRestoreTokens > r.NMatchedBlocks*B || int(r.NRestoreTokens) > n-1 ||
		int(r.NMatchedBlocks) > (n-1)/int(B) || r.Reason < 0 || r.Reason > 6 ||
		!(r.EstRestoreMS >= 0) || !(r.EstRecomputeMS >= 0) || !(r.EstTotalMS >= 0) {
		w.fail("lookup of %d tokens, block %d: %+v", n, g.block, *r)
	}
}

// layout builds tensors for g and the layout argument describing them,
// with a stride below its row and one other hostile change at most, and
// the statuses those changes call for.
func (w *world) layout(g model) (*tensors, unsafe.Pointer, []status.Code) {
	cells := uint32(1 + int(w.arg(4))%64)
	vtrans := g.vtrans != (w.arg(5)%16 == 0)
	var faults []status.Code
	w.seed(7)
	short := -1
	if w.arg(6)%8 == 0 {
		short = w.rand(2 * g.layers())
		faults = append(faults, status.Layout)
	}
	pads := w.arg(6)%8 < 3
	pad := func(l, kv int) int {
		switch {
		case 2*l+kv == short:
			return -1
		case pads:
			return w.rand(9)
		}
		return 0
	}
	ts := newTensors(w.kv, g, cells, vtrans, pad)
	if ts == nil {
		return nil, nil, []status.Code{status.InvalidArg} // host memory used up: pass NULL
	}
	switch w.arg(8) % 32 {
	case 0:
		return ts, nil, append(faults, status.InvalidArg)
	case 1:
		return ts, unsafe.Pointer(put(w.c, *ts.layout, 4)), append(faults, status.InvalidArg)
	}
	n := g.layers()
	l := int(w.arg(9)) % n
	// Two K strides of 2^63 wrap the address space; with fewer cells the
	// rows would sit at an address no host has, so the stride stays.
	wraps := status.Layout
	if cells < 3 {
		wraps = status.OK
	}
	changes := []struct {
		mut   func(lo *cKVLayout, ls []cKVLayer)
		fault status.Code
	}{
		{func(lo *cKVLayout, _ []cKVLayer) { lo.NLayer = 0 }, status.Layout},
		{func(lo *cKVLayout, _ []cKVLayer) { lo.NLayer = 5000 }, status.Layout},
		{func(lo *cKVLayout, _ []cKVLayer) { lo.NLayer-- }, status.Layout},
		{func(lo *cKVLayout, _ []cKVLayer) { lo.NLayer++ }, status.Layout},
		{func(lo *cKVLayout, _ []cKVLayer) { lo.Layers = 0 }, status.InvalidArg},
		{func(lo *cKVLayout, _ []cKVLayer) { lo.Layers += 4 }, status.InvalidArg},
		{func(lo *cKVLayout, _ []cKVLayer) { lo.NCells = 0 }, status.Layout},
		{func(_ *cKVLayout, ls []cKVLayer) { ls[l].K = 0 }, status.Layout},
		{func(_ *cKVLayout, ls []cKVLayer) { ls[l].V = 0 }, status.Layout},
		{func(_ *cKVLayout, ls []cKVLayer) { // K rows running past the top of the address space
			ls[l].K = ^uintptr(0) - uintptr(uint64(cells-1)*ls[l].KStride+uint64(g.krow(l))) + 1
		}, status.Layout},
		{func(_ *cKVLayout, ls []cKVLayer) {
			if wraps != status.OK {
				ls[l].KStride = 1 << 63
			}
		}, wraps},
		{func(lo *cKVLayout, _ []cKVLayer) { lo.Location = w.c.cstr(w.t, "cuda:0") }, status.Unsupported},
		{func(lo *cKVLayout, _ []cKVLayer) { lo.Location = w.edges.location }, status.InvalidArg},
		{func(lo *cKVLayout, _ []cKVLayer) { lo.Location = w.c.cstr(w.t, "cpu:3") }, status.OK},
		{func(lo *cKVLayout, _ []cKVLayer) { lo.Location = 0 }, status.OK},
		{func(lo *cKVLayout, _ []cKVLayer) { lo.Location = w.c.cstr(w.t, "") }, status.OK},
	}
	i := int(w.arg(8)%32) - 2
	if i >= len(changes) {
		return ts, unsafe.Pointer(ts.layout), faults
	}
	// The copy's layer array has a spare entry, so that a layout claiming
	// one layer more still names memory the host owns.
	b := w.c.alloc(w.t, (n+1)*int(unsafe.Sizeof(cKVLayer{})), 8)
	ls := unsafe.Slice((*cKVLayer)(pointer(b)), n+1)
	copy(ls, ts.layers)
	ls[n] = ls[n-1]
	lo := put(w.c, *ts.layout, 0)
	lo.Layers = address(b)
	changes[i].mut(lo, ls[:n])
	if changes[i].fault != status.OK {
		faults = append(faults, changes[i].fault)
	}
	return ts, unsafe.Pointer(lo), faults
}

// cellsArg draws where positions live: NULL (cell i), a shuffle of the
// cells, one with a cell given twice or one beyond the tensors, or a
// misaligned array. It returns the cells and the status a check of the
// first checked positions calls for.
func (w *world) cellsArg(n int, cells uint32, checked int) (unsafe.Pointer, []uint32, []status.Code) {
	var faults []status.Code
	mode := w.arg(14) % 8
	if mode >= 5 {
		if checked > int(cells) {
			faults = append(faults, status.Layout)
		}
		return nil, nil, faults
	}
	w.seed(15)
	perm := make([]uint32, max(n, int(cells)))
	for i := range perm {
		perm[i] = uint32(i)
	}
	for i := int(cells) - 1; i > 0; i-- {
		j := w.rand(i + 1)
		perm[i], perm[j] = perm[j], perm[i]
	}
	cs := perm[:n]
	switch mode {
	case 1:
		if n >= 2 {
			j := 1 + w.rand(n-1)
			cs[j] = cs[w.rand(j)]
		}
	case 2:
		cs[w.rand(n)] = cells + uint32(w.rand(3))
	}
	seen := map[uint32]bool{}
	for _, c := range cs[:min(checked, n)] {
		if c >= cells || seen[c] {
			faults = append(faults, status.Layout)
			break
		}
		seen[c] = true
	}
	p := ptr(w.c.u32s(w.t, cs))
	if mode == 0 {
		p = ptr(w.misalign(uintptr(p), n))
		faults = append(faults, status.InvalidArg)
	}
	return p, cs, faults
}

// begin starts a save or a load with drawn arguments.
func (w *world) begin(save bool) {
	what := map[bool]string{false: "load begin", true: "save begin"}[save]
	h := w.handle(modelKind)
	g := model{block: 4, kEmbd: []uint32{8}, vEmbd: []uint32{8}}
	if o := w.objects[h]; o != nil && o.kind == modelKind {
		g = o.m
	}
	B := int(g.block)
	out, ob, outBad := w.out(w.arg(2), 8, 8)
	scope, scopeBad := w.scope(w.arg(3))
	ts, layout, layoutFaults := w.layout(g)
	limit := 8
	if ts != nil {
		limit += int(ts.cells)
	}
	tp, tok, n, tokBad := w.tokens(10, limit, g.block)
	var faults []status.Code
	if outBad || scopeBad || tokBad {
		faults = append(faults, status.InvalidArg)
	}
	faults = append(faults, layoutFaults...)
	checked := n // a load checks every cell, a save those of whole blocks
	switch {
	case tokBad:
		checked = 0
	case save && n < B:
		faults = append(faults, status.InvalidArg)
	case save:
		checked = n / B * B
	case n%B != 0:
		faults = append(faults, status.InvalidArg)
	}
	var cp unsafe.Pointer
	var cells []uint32
	if ts != nil && !tokBad {
		var cf []status.Code
		cp, cells, cf = w.cellsArg(n, ts.cells, checked)
		faults = append(faults, cf...)
	}
	ok := w.valid(h, modelKind)
	if ts != nil {
		if save && ok && len(faults) == 0 {
			ts.compute(tok, cells, checked) // the host's decode
		}
		w.shadow[ts] = ts.snapshot()
		w.order = append(w.order, ts)
	}
	success := []status.Code{status.OK, status.NotFound}
	call := mcbgo_load_begin
	if save {
		success, call = []status.Code{status.OK, status.PoolFull}, mcbgo_save_begin
	}
	got := w.check(what, call(h, scope, layout, tp, uint64(n), cp, out, w.eb, w.el), expect(ok, faults, success...)...)
	if ts != nil && !bytes.Equal(ts.region, w.shadow[ts]) {
		w.fail("%s (status %d) changed the tensors", what, got)
	}
	if got != status.OK {
		if !untouched(ob) {
			w.fail("a failed %s wrote its output", what)
		}
		return
	}
	o := &object{bridge: w.objects[h].bridge, m: g, ts: ts, tok: tok, cells: cells, n: n}
	if save {
		o.kind, o.saved = saveKind, make([]bool, g.layers())
	} else {
		o.kind, o.before, o.nok = loadKind, w.shadow[ts], n
	}
	w.issue(*(*uint64)(out), o)
}

// layerArg is mostly the next layer a host would name, sometimes any.
func (w *world) layerArg(next, layers int) uint32 {
	if w.arg(3)%8 == 0 {
		return uint32(w.arg(4))
	}
	return uint32(min(next, layers-1))
}

func (w *world) saveLayer() {
	h := w.handle(saveKind)
	o := w.objects[h]
	ok := w.valid(h, saveKind)
	var il uint32
	want := status.OK
	if ok {
		next := slices.Index(o.saved, false)
		if next < 0 {
			next = 0
		}
		il = w.layerArg(next, len(o.saved))
		switch {
		case int(il) >= len(o.saved):
			want = status.InvalidArg
		case o.saved[il]:
			want = status.State
		}
	}
	if w.check("save layer", mcbgo_save_layer(h, il, w.eb, w.el), expect(ok, nil, want)...) == status.OK {
		o.saved[il] = true
	}
	if ok && !bytes.Equal(o.ts.region, w.shadow[o.ts]) {
		w.fail("save layer wrote into its source")
	}
}

func (w *world) saveEnd(h uint64, sel byte) {
	o := w.objects[h]
	ok := w.valid(h, saveKind)
	out, ob, bad := w.out(sel, int(unsafe.Sizeof(cSaveResult{})), 4)
	var faults []status.Code
	if bad {
		faults = append(faults, status.InvalidArg)
	}
	success := []status.Code{status.OK, status.PoolFull}
	if ok && slices.Contains(o.saved, false) {
		success = append(success, status.State) // unless it had nothing to write
	}
	got := w.check("save end", mcbgo_save_end(h, out, w.eb, w.el), expect(ok, faults, success...)...)
	if !ok || bad {
		if !untouched(ob) {
			w.fail("a refused save end wrote its output")
		}
		return
	}
	o.live = false
	r := (*cSaveResult)(out)
	B := int(o.m.block)
	if int(r.NBlocks) != o.n/B || r.NKnown+r.NWritten > r.NBlocks || (got == status.OK && r.NPublished+r.NDeduped != r.NWritten) {
		w.fail("save of %d tokens, block %d: status %d, %+v", o.n, B, got, *r)
	}
	if !bytes.Equal(o.ts.region, w.shadow[o.ts]) {
		w.fail("a save wrote into its source")
	}
}

func (w *world) waitLayer() {
	h := w.handle(loadKind)
	o := w.objects[h]
	ok := w.valid(h, loadKind)
	out, ob, bad := w.out(w.arg(2), 4, 4)
	var il uint32
	var faults []status.Code
	if bad {
		faults = append(faults, status.InvalidArg)
	}
	var before []byte
	if ok {
		il = w.layerArg(o.placed, o.m.layers())
		if int(il) >= o.m.layers() {
			faults = append(faults, status.InvalidArg)
		}
		before = o.ts.snapshot()
	}
	if w.check("wait layer", mcbgo_load_wait_layer(h, il, out, w.eb, w.el), expect(ok, faults, status.OK)...) != status.OK {
		if !untouched(ob) {
			w.fail("a failed wait wrote its output")
		}
		if ok && !bytes.Equal(o.ts.region, before) {
			w.fail("a refused wait placed rows")
		}
		return
	}
	nok := int(*(*uint32)(out))
	if nok > o.nok || nok%int(o.m.block) != 0 {
		w.fail("wait on layer %d: %d tokens good after %d", il, nok, o.nok)
	}
	o.nok, o.placed = nok, max(o.placed, int(il)+1)
	if err := o.ts.checkRestore(o.before, o.tok, o.cells, o.n, o.nok, o.placed); err != nil {
		w.fail("after waiting on layer %d: %v", il, err)
	}
}

func (w *world) loadEnd(h uint64, sel byte) {
	o := w.objects[h]
	ok := w.valid(h, loadKind)
	out, ob, bad := w.out(sel, int(unsafe.Sizeof(cLoadResult{})), 8)
	var faults []status.Code
	if bad {
		faults = append(faults, status.InvalidArg)
	}
	failures := []status.Code{status.OK, status.Transfer, status.Corrupt, status.Timeout}
	got := w.check("load end", mcbgo_load_end(h, out, w.eb, w.el), expect(ok, faults, failures...)...)
	if !ok || bad {
		if !untouched(ob) {
			w.fail("a refused load end wrote its output")
		}
		return
	}
	o.live = false
	r := (*cLoadResult)(out)
	B := int(o.m.block)
	if int(r.NBlocks) > o.n/B || r.NBlocks == 0 || r.NBlocksOK > r.NBlocks || int(r.NTokensOK) != int(r.NBlocksOK)*B ||
		int(r.NTokensOK) > o.nok || r.NBytes != uint64(r.NBlocksOK)*uint64(o.m.payload()) ||
		r.FirstError != int32(got) || (got == status.OK) != (r.NBlocksOK == r.NBlocks) {
		w.fail("load of %d tokens, block %d: status %d, %+v", o.n, B, got, *r)
	}
	if err := o.ts.checkRestore(o.before, o.tok, o.cells, o.n, int(r.NTokensOK), o.m.layers()); err != nil {
		w.fail("%v", err)
	}
	w.shadow[o.ts] = o.ts.snapshot()
}

// closeAll ends every load and save and closes every bridge. Strict, it
// checks that each succeeds, that no handle is left and that every tensor
// set holds what it must; after a failure it only cleans up.
func (w *world) closeAll(strict bool) {
	for _, k := range []kind{loadKind, saveKind, bridgeKind} {
		for _, h := range w.issued {
			o := w.objects[h]
			if !o.live || o.kind != k {
				continue
			}
			switch {
			case !strict && k == loadKind:
				mcbgo_load_end(h, unsafe.Pointer(new(cLoadResult)), nil, 0)
				o.live = false
			case !strict && k == saveKind:
				mcbgo_save_end(h, unsafe.Pointer(new(cSaveResult)), nil, 0)
				o.live = false
			case !strict:
				mcbgo_bridge_close(h, nil, 0)
				o.live = false
			case k == loadKind:
				w.loadEnd(h, benign)
			case k == saveKind:
				w.saveEnd(h, benign)
			default:
				w.check("close at exit", mcbgo_bridge_close(h, w.eb, w.el), status.OK)
				o.live = false
			}
		}
	}
	if !strict {
		return
	}
	if n := mcbgo_handles_open(); n != w.start {
		w.fail("%d handles open after closing everything, %d before the program", n, w.start)
	}
	for _, ts := range w.order {
		if err := ts.checkUntouched(w.shadow[ts]); err != nil {
			w.fail("%v", err)
		}
	}
}
