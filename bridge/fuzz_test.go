package main

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/mcbridge/mcbridge/internal/host"
	"github.com/mcbridge/mcbridge/internal/llamastate"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/stretchr/testify/require"
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
	opRegisterState
	opUnregister
	opObserve
	opScopeID
	opLookup
	opPlanDrop
	opSaveBegin
	opSaveLayer
	opSaveEnd
	opLoadBegin
	opWaitLayer
	opLoadEnd
	opStateSave
	opStateRestore
	opMetrics
	opProbeTokens
	opLoadProgress
	opSnapshotSave
	opLoadSnapshot
	nOps
)

// FuzzABI runs programs of export calls with arguments drawn from the
// input, valid and hostile, over KV tensors and state blobs in host
// memory. It fails when a call returns MCB_STATUS_INTERNAL or a status
// outside the enum, when a refused call changed an output, when any byte
// of the tensors outside the rows a load may write changes (guard gaps,
// stride padding, other cells, the sources of saves, the probes of
// registrations, states handed to a save), when a verified row does not
// hold its value, when a restored state is not the prefix it says, and
// when handles stay open after the program closes everything. Each call's
// status is checked against what its arguments allow.
func FuzzABI(f *testing.F) {
	for _, seed := range fuzzSeeds() {
		f.Add(seed)
	}
	dir := f.TempDir()
	env := &fuzzEnv{
		config:   address(edgeString(f, maxConfig, '{')),
		str:      address(edgeString(f, maxString, 'x')),
		location: address(edgeString(f, 64, 'x')),
		adapters: []string{writeFile(f, "a.lora", []byte("adapter a")), writeFile(f, "b.lora", []byte("adapter b")),
			filepath.Join(dir, "missing.lora")},
	}
	for _, name := range []string{"seq-fa-on.bin", "seq-fa-off.bin", "seq-f32k.bin", "seq-two-streams-fa-off.bin", "seq-scattered-fa-off.bin"} {
		env.states = append(env.states, realState(f, name))
	}
	f.Fuzz(func(t *testing.T, prog []byte) {
		w := newWorld(t, env)
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
// vtrans 0 transposes V, mutation below 14 breaks the registration.
func register(bridge, vtrans, mutation, detail byte) []byte {
	return rec(opRegister, benign, bridge, benign, 1, 3, 3, 3, 4, 4, benign, benign, vtrans, mutation, detail)
}

// registerState is the record of a state host's model on the live bridge
// picked by bridge, from real state number state, blocks of four tokens;
// mutation below 8 breaks the blob.
func registerState(bridge, state, mutation byte) []byte {
	return rec(opRegisterState, benign, bridge, benign, state, 1, mutation)
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
			rec(opStats), rec(opMetrics), rec(opClose),
		)
	}
	// Save 28 tokens of a tenant from 41 shuffled cells with padded
	// strides, restore what a lookup plans into 64 shuffled cells of a
	// transposed V.
	scattered := cat(
		rec(opOpen, 1), register(benign, 1, benign, benign),
		rec(opSaveBegin, benign, benign, benign, 3, 40, benign, 1, 9, benign, benign, 2, 5, benign, 30, 3, 17),
		rec(opSaveLayer), rec(opSaveLayer), rec(opSaveEnd),
		rec(opLookup, benign, benign, benign, 3, 2, 5, benign, 30),
		rec(opLoadBegin, benign, benign, benign, benign, 63, 0, 2, 4, benign, benign, benign, benign, benign, benign, 4, 99),
		rec(opWaitLayer), rec(opLoadEnd),
	)
	// Restore from another bridge's pool, whose bridge closes mid-load.
	peers := cat(
		rec(opOpen, 1), rec(opOpen, 2),
		register(0, 1, benign, benign), register(1, 1, benign, benign),
		rec(opSaveBegin, benign, 0), rec(opSaveLayer), rec(opSaveLayer), rec(opSaveEnd),
		rec(opLookup, benign, 1), rec(opLookup, benign, 1), rec(opLookup, benign, 1),
		rec(opLoadBegin), rec(opWaitLayer), rec(opClose, benign, 0), rec(opLoadEnd),
		rec(opClose, benign, 0),
	)
	// A state host saves, looks up, restores into a state and into
	// tensors, and drops a plan.
	states := cat(
		rec(opOpen, 1), registerState(benign, 0, benign), registerState(benign, 1, benign),
		rec(opStateSave), rec(opStateSave, benign, 1),
		rec(opLookup), rec(opStateRestore),
		rec(opLookup), rec(opLoadBegin), rec(opLoadEnd),
		rec(opLookup), rec(opPlanDrop), rec(opPlanDrop),
		rec(opScopeID), rec(opProbeTokens), rec(opMetrics, benign, benign, 3),
	)
	hostile := cat(
		rec(opOpen, 4), rec(opOpen, 6), rec(opOpen, 1, 0), rec(opOpen, 1),
		register(benign, 1, 2, 0), register(benign, 1, 6, 1), register(benign, 1, 4, 3), register(benign, 1, 8, 0),
		register(benign, 1, 11, 0), register(benign, 1, benign, benign),
		registerState(benign, 2, 0), registerState(benign, 3, 3), registerState(benign, 4, 5),
		rec(opLookup, 0), rec(opLookup, benign, benign, 0), rec(opLookup, benign, benign, benign, 0),
		rec(opLookup, benign, benign, benign, 7), rec(opLookup, benign, benign, benign, benign, benign, benign, 1),
		rec(opLookup, benign, benign, benign, benign, benign, benign, benign, benign, 0),
		rec(opSaveBegin, benign, benign, benign, benign, benign, benign, 0, 1),
		rec(opSaveBegin, benign, benign, benign, 9, benign, benign, benign, benign, 10),
		rec(opLoadBegin, benign, benign, benign, benign, benign, benign, benign, benign, 5),
		rec(opLoadBegin, 0), rec(opPlanDrop, 2, 3),
		rec(opStateSave, benign, benign, benign, 2), rec(opStateSave, benign, benign, benign, benign, 0),
		rec(opStateRestore, benign, benign, 1), rec(opScopeID, 6), rec(opScopeID, 10, 0),
		rec(opMetrics, 0, 0, 1), rec(opMetrics, 2, 1, 0, 3), rec(opProbeTokens, 1), rec(opProbeTokens, benign, 2),
		rec(opSaveBegin), rec(opClose), rec(opSaveLayer, benign, benign, benign, 0, 9), rec(opSaveEnd), rec(opSaveEnd),
		rec(opObserve, benign, benign, 3), rec(opObserve), rec(opUnregister), rec(opUnregister),
		rec(opStats, 2), rec(opClose, 1),
	)
	return [][]byte{saveLoad(1), saveLoad(0), scattered, peers, states, hostile}
}

// fuzzEnv is what a fuzz process's programs share: unterminated strings
// that end at an unreadable page (one for each length limit of the ABI),
// adapter files (the last missing) and real llama.cpp states.
type fuzzEnv struct {
	config, str, location uintptr
	adapters              []string
	states                [][]byte
}

type kind int

const (
	bridgeKind kind = iota + 1
	modelKind
	planKind
	loadKind
	saveKind
)

// object is what the program knows about one handle it was given.
type object struct {
	kind   kind
	live   bool
	bridge uint64 // the bridge a model, plan, load or save belongs to
	block  uint32 // bridges: the configured block size
	pool   uint64 // bridges: the pool's size
	m      model  // models, plans, loads and saves
	state  *stateFormat
	model  uint64 // plans: their model
	ts     *tensors
	tok    []int32 // plans, loads and saves: the tokens they move
	cells  []uint32
	n      int
	before []byte // loads: the tensors before the load began
	nok    int    // loads: the good prefix so far
	placed int    // loads: layers waited for
	saved  []bool // saves: layers saved
}

type world struct {
	t       *testing.T
	c       *cmem // structs, strings, arrays and states
	kv      *cmem // tensors
	env     *fuzzEnv
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

func newWorld(t *testing.T, env *fuzzEnv) *world {
	c := newCmem(t, 8<<20)
	errb := c.alloc(t, 1024, 1)
	w := &world{t: t, c: c, kv: newCmem(t, 16<<20), env: env, errb: errb, eb: pointer(errb), el: uint64(len(errb)),
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
	require.FailNow(w.t, fmt.Sprintf("call %d: "+format, append([]any{w.call}, args...)...))
}

// anyStatus is every status but INTERNAL: what input the library cannot
// read (a garbage state, say) may give.
func anyStatus() []status.Code {
	var out []status.Code
	for c := status.Code(0); c < status.Internal; c++ {
		out = append(out, c)
	}
	return out
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
	case opRegisterState:
		w.registerState()
	case opUnregister:
		h := w.handle(modelKind)
		ok := w.valid(h, modelKind)
		w.check("unregister", mcbgo_model_unregister(h, w.eb, w.el), expect(ok, nil, status.OK)...)
		if ok {
			w.objects[h].live = false
		}
	case opObserve:
		w.observe()
	case opScopeID:
		w.scopeID()
	case opLookup:
		w.lookup()
	case opPlanDrop:
		h := w.handle(planKind)
		ok := w.valid(h, planKind)
		w.check("plan drop", mcbgo_plan_drop(h, w.eb, w.el), expect(ok, nil, status.OK)...)
		if ok {
			w.objects[h].live = false
		}
	case opSaveBegin:
		w.saveBegin()
	case opSaveLayer:
		w.saveLayer()
	case opSaveEnd:
		w.saveEnd(w.handle(saveKind), w.arg(2))
	case opLoadBegin:
		w.loadBegin()
	case opWaitLayer:
		w.waitLayer()
	case opLoadEnd:
		w.loadEnd(w.handle(loadKind), w.arg(2))
	case opStateSave:
		w.stateSave()
	case opStateRestore:
		w.stateRestore()
	case opMetrics:
		w.metrics()
	case opProbeTokens:
		w.probeTokens()
	case opLoadProgress:
		w.loadProgress()
	case opSnapshotSave:
		w.snapshotSave()
	case opLoadSnapshot:
		w.loadSnapshot()
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
	cfg := w.env.config
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
		if (o.kind == modelKind || o.kind == planKind) && o.bridge == h {
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
	if s.Hits+s.Misses != s.Lookups || s.DecidedRestore+s.DecidedRecompute+s.DecidedLocal != s.Hits || s.LoadFailures > s.Loads ||
		s.ResidentBytes > s.PoolBytes || s.PoolBytes != w.objects[h].pool {
		w.fail("stats do not add up: %+v", *s)
	}
}

// geometry draws a model: one to three layers of different widths, with V
// or, K-only (MLA), without, or with V but for the last of several (an
// indexer cache's beside an attention cache's).
func (w *world) geometry(at int) model {
	blocks := []uint32{0, 1, 2, 4, 8, 16}
	embd := []uint32{1, 2, 3, 8, 24, 64, 512}
	m := model{block: blocks[w.arg(at+1)%byte(len(blocks))], vtrans: w.arg(at+8)%2 == 0}
	kOnly, lastWithoutV := w.arg(at+8)%8 >= 4, w.arg(at+8)%8 == 2
	n := 1 + int(w.arg(at))%3
	for l := 0; l < n; l++ {
		m.kEmbd = append(m.kEmbd, embd[w.arg(at+2+2*l)%byte(len(embd))])
		v := embd[w.arg(at+3+2*l)%byte(len(embd))]
		if kOnly || lastWithoutV && n > 1 && l == n-1 {
			v = 0
		}
		m.vEmbd = append(m.vEmbd, v)
	}
	return m
}

// misalign copies n uint32s to an address two bytes off their alignment.
func (w *world) misalign(p uintptr, n int) uintptr {
	b := w.c.alloc(w.t, 4*n+4, 4)
	copy(b[2:], unsafe.Slice((*byte)(ptr(p)), 4*n))
	return address(b) + 2
}

// registered adds what a registration's success needs to its statuses:
// a block that does not fit twice in the pool is refused as configuration,
// and near that the header's rounding decides.
func (w *world) registered(h uint64, g *model, faults []status.Code) ([]status.Code, []status.Code) {
	success := []status.Code{status.OK}
	b := w.objects[h]
	if !w.valid(h, bridgeKind) || len(faults) > 0 {
		return faults, success
	}
	if g.block == 0 {
		g.block = b.block
	}
	switch size := uint64(g.payload()); {
	case 2*size > b.pool:
		faults = append(faults, status.Config)
	case 2*size+64<<10 > b.pool:
		success = append(success, status.Config)
	}
	return faults, success
}

func (w *world) register() {
	h := w.handle(bridgeKind)
	out, ob, bad := w.out(w.arg(2), 8, 8)
	g := w.geometry(3)
	r := g.registration(w.c, ggufPath)
	if r == nil {
		w.fail("host memory used up")
	}
	p, fm := r.params, r.format
	probe, cells := unsafe.Pointer(r.probe.layout), r.pcells
	arrays := []*uintptr{&fm.NEmbdKGQA, &fm.NEmbdVGQA, &fm.KRowBytes, &fm.VRowBytes}
	strs := []*uintptr{&p.LlamaVersion, &p.GGUFPath, &p.Extra, &p.PartialState}
	detail := int(w.arg(13))
	var faults []status.Code
	if bad {
		faults = append(faults, status.InvalidArg)
	}
	switch w.arg(12) % 16 {
	case 0:
		fm.NLayer, faults = 0, append(faults, status.InvalidArg)
	case 1:
		fm.NLayer, faults = 5000, append(faults, status.InvalidArg)
	case 2:
		*arrays[detail%4], faults = 0, append(faults, status.InvalidArg)
	case 3:
		a := arrays[detail%4]
		*a, faults = w.misalign(*a, g.layers()), append(faults, status.InvalidArg)
	case 4:
		rows := make([]uint32, g.layers())
		for l := range rows {
			rows[l] = uint32(g.row(l, detail%2))
		}
		rows[detail%len(rows)] = 0
		if g.vEmbd[detail%len(rows)] == 0 && detail%2 == 1 {
			rows[detail%len(rows)] = elem // a V row in a layer without V
		}
		*arrays[2+detail%2] = w.c.u32s(w.t, rows)
		faults = append(faults, status.InvalidArg)
	case 5:
		p.BlockTokens, faults = 1<<17, append(faults, status.InvalidArg)
	case 6:
		*strs[detail%4], faults = w.env.str, append(faults, status.InvalidArg)
	case 7:
		p.GGUFPath, faults = w.c.cstr(w.t, "testdata/missing.gguf"), append(faults, status.InvalidArg)
	case 8:
		p.LlamaVersion, faults = w.c.cstr(w.t, "b6000"), append(faults, status.ModelMismatch)
	case 9:
		probe, faults = nil, append(faults, status.InvalidArg)
	case 10:
		cells, faults = nil, append(faults, status.InvalidArg)
	case 11:
		c := slices.Clone(r.cells)
		c[detail%len(c)] = c[(detail+1)%len(c)] + uint32(detail%2)*16 // twice, or beyond the probe's cache
		cells, faults = ptr(w.c.u32s(w.t, c)), append(faults, status.Layout)
	case 12:
		lo := putT(w.t, w.c, *r.probe.layout, 0)
		lo.VTrans = !lo.VTrans
		probe, faults = unsafe.Pointer(lo), append(faults, status.Layout)
	case 13:
		p.GGUFPath = w.c.cstr(w.t, otherGGUF)
	case 14:
		// KV streams name a window cache's framing: none without a partial state.
		p.PartialKVStreams, faults = uint32(1+detail%maxKVStreams), append(faults, status.InvalidArg)
	case 15:
		p.PartialState = w.c.cstr(w.t, "iswa window 8")
		p.PartialKVStreams, faults = uint32(maxKVStreams+1+detail), append(faults, status.InvalidArg)
	}
	faults, success := w.registered(h, &g, faults)
	probed := r.probe.snapshot()
	got := w.check("register", mcbgo_model_register(h, unsafe.Pointer(p), unsafe.Pointer(fm), probe, cells, out, w.eb, w.el),
		expect(w.valid(h, bridgeKind), faults, success...)...)
	if err := r.probe.checkUntouched(probed); err != nil {
		w.fail("register wrote into its probe: %v", err)
	}
	if got != status.OK {
		if !untouched(ob) {
			w.fail("a failed register wrote its output")
		}
		return
	}
	w.issue(*(*uint64)(out), &object{kind: modelKind, bridge: h, m: g})
}

// snapshotSave stores a snapshot through a model of the program's, none
// of which keeps a partial state: what it may answer is what its arguments
// allow, and it never writes into the state it is handed.
func (w *world) snapshotSave() {
	h := w.handle(modelKind)
	ok := w.valid(h, modelKind)
	scope, scopeBad := w.scope(w.arg(2))
	tp, _, n, tokBad := w.tokens(3, 40, w.modelOf(h).block)
	blob := bytes.Repeat([]byte{w.arg(7)}, 1+int(w.arg(8)))
	state, size, stateBad := w.stateArgs(blob, w.arg(9))
	var faults []status.Code
	if scopeBad || tokBad || stateBad {
		faults = append(faults, status.InvalidArg)
	}
	w.check("snapshot save", mcbgo_snapshot_save(h, scope, tp, uint64(n), state, size, w.eb, w.el), expect(ok, faults, status.Unsupported)...)
	if state != nil && !bytes.Equal(blob, unsafe.Slice((*byte)(state), len(blob))) {
		w.fail("snapshot save wrote into its state")
	}
	if got := mcbgo_model_snapshot_tokens(h); got != 0 {
		w.fail("a model without a partial state snapshots every %d tokens", got)
	}
}

// loadSnapshot asks a load for its snapshot: NULL and 0 for a model
// without a partial state, outputs untouched when refused.
func (w *world) loadSnapshot() {
	h := w.handle(loadKind)
	ok := w.valid(h, loadKind)
	state, sb, stateBad := w.out(w.arg(2), 8, 8)
	n, nb, nBad := w.out(w.arg(3), 8, 8)
	var faults []status.Code
	if stateBad || nBad {
		faults = append(faults, status.InvalidArg)
	}
	got := w.check("load snapshot", mcbgo_load_snapshot(h, state, n, w.eb, w.el), expect(ok, faults, status.OK)...)
	if got != status.OK {
		if !untouched(sb) || !untouched(nb) {
			w.fail("a refused load snapshot wrote its outputs")
		}
		return
	}
	if *(*unsafe.Pointer)(state) != nil || *(*uint64)(n) != 0 {
		w.fail("a load of a model without a partial state handed back a snapshot")
	}
}

// stateBlob draws a state: one of the real ones, or a built one, with a
// hostile change at most, and whether the state is as llama.cpp wrote it.
func (w *world) stateBlob(at int) ([]byte, bool) {
	blob := slices.Clone(w.env.states[int(w.arg(at))%len(w.env.states)])
	w.seed(at + 2)
	switch w.arg(at+2) % 16 {
	case 0:
		return blob[:w.rand(len(blob))], false
	case 1:
		return append(blob, byte(w.rand(256))), false
	case 2, 3:
		blob[w.rand(len(blob))] ^= byte(1 + w.rand(255))
		return blob, false
	case 4:
		binary.LittleEndian.PutUint32(blob[4*w.rand(8):], uint32(w.rand(math.MaxInt32))<<1)
		return blob, false
	case 5:
		b := make([]byte, 1+w.rand(64))
		for i := range b {
			b[i] = byte(w.rand(256))
		}
		return b, false
	}
	return blob, true
}

// stateArgs puts a state into host memory, or passes NULL or no bytes.
func (w *world) stateArgs(blob []byte, sel byte) (unsafe.Pointer, uint64, bool) {
	p := w.c.bytes(w.t, blob)
	switch sel % 16 {
	case 0:
		return nil, uint64(len(blob)), true
	case 1:
		return p, 0, true
	case 2:
		return p, 16<<30 + 1, true
	}
	return p, uint64(len(blob)), len(blob) == 0
}

func (w *world) registerState() {
	h := w.handle(bridgeKind)
	out, ob, bad := w.out(w.arg(2), 8, 8)
	blob, intact := w.stateBlob(3)
	state, n, stateBad := w.stateArgs(blob, w.arg(6))
	blocks := []uint32{0, 4, 8}
	g := model{block: blocks[int(w.arg(4))%len(blocks)]}
	p := g.params(w.c, ggufPath)
	if p == nil {
		w.fail("host memory used up")
	}
	// Arguments refused before the state is read give INVALID_ARG; what
	// the library reads in the state decides the rest.
	var faults []status.Code
	if bad || stateBad {
		faults = append(faults, status.InvalidArg)
	}
	mismatch := false
	switch w.arg(7) % 8 {
	case 0:
		p.LlamaVersion, mismatch = w.c.cstr(w.t, "b6000"), true
	case 1:
		p.GGUFPath, faults = w.env.str, append(faults, status.InvalidArg)
	case 2:
		p, faults = nil, append(faults, status.InvalidArg)
	}
	success := []status.Code{status.OK}
	sf, err := stateFormatOf(blob)
	switch {
	case len(faults) > 0:
	case !intact:
		success = anyStatus()
	case mismatch:
		faults = []status.Code{status.ModelMismatch}
	default:
		g = sf.model(g.block)
		faults, success = w.registered(h, &g, nil)
	}
	got := w.check("register state", mcbgo_model_register_state(h, unsafe.Pointer(p), state, n, out, w.eb, w.el),
		expect(w.valid(h, bridgeKind), faults, success...)...)
	if state != nil && !bytes.Equal(blob, unsafe.Slice((*byte)(state), len(blob))) {
		w.fail("register state wrote into its state")
	}
	if got != status.OK {
		if !untouched(ob) {
			w.fail("a failed register state wrote its output")
		}
		return
	}
	m := *(*uint64)(out)
	// A garbage state that still parses may name rows these tensors do
	// not lay out (odd rows, transposed V of other elements): such a model
	// goes again.
	fits := err == nil
	for _, ly := range sf.layers {
		fits = fits && ly.KRowSize%elem == 0 && ly.VRowSize%elem == 0 && (!sf.vtrans || ly.VElSize == elem)
	}
	if !fits {
		w.check("unregister", mcbgo_model_unregister(m, w.eb, w.el), status.OK)
		return
	}
	if !intact {
		g = sf.model(g.block)
		if g.block == 0 {
			g.block = w.objects[h].block
		}
	}
	w.issue(m, &object{kind: modelKind, bridge: h, m: g, state: &sf})
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

// scope draws a scope argument and whether it is malformed: salts,
// adapter arrays and the adapters in them, each hostile in its way.
func (w *world) scope(sel byte) (unsafe.Pointer, bool) {
	a := func(i int, scale float32) cAdapter {
		return cAdapter{Path: w.c.cstr(w.t, w.env.adapters[i]), Scale: scale}
	}
	arr := func(as ...cAdapter) uintptr {
		b := w.c.alloc(w.t, (len(as)+1)*int(unsafe.Sizeof(cAdapter{})), 8)
		copy(unsafe.Slice((*cAdapter)(pointer(b)), len(as)), as)
		return address(b)
	}
	scope := func(s cScope, skew int) unsafe.Pointer { return unsafe.Pointer(putT(w.t, w.c, s, skew)) }
	salt := w.c.cstr(w.t, "t1")
	switch sel % 32 {
	case 0:
		return scope(cScope{TenantSaltLen: 5}, 0), true
	case 1:
		return scope(cScope{}, 4), true
	case 2:
		return scope(cScope{NAdapters: 1}, 0), true
	case 3:
		return scope(cScope{Adapters: arr(a(0, 1), a(0, 1)) + 4, NAdapters: 1}, 0), true
	case 4:
		return scope(cScope{Adapters: arr(a(0, 1)), NAdapters: 1 << 40}, 0), true
	case 5:
		return scope(cScope{Adapters: arr(a(0, 1), cAdapter{Path: w.env.str, Scale: 1}), NAdapters: 2}, 0), true
	case 6:
		return scope(cScope{Adapters: arr(cAdapter{Scale: 1}), NAdapters: 1}, 0), true
	case 7:
		return scope(cScope{Adapters: arr(a(1, float32(math.NaN()))), NAdapters: 1}, 0), true
	case 8:
		return scope(cScope{Adapters: arr(a(2, 0.5)), NAdapters: 1}, 0), true
	case 9:
		return scope(cScope{TenantSalt: salt, TenantSaltLen: maxSaltBytes + 1}, 0), true
	case 10:
		return scope(cScope{TenantSalt: salt, TenantSaltLen: 2}, 0), false
	case 11:
		return scope(cScope{Adapters: arr(a(0, 1), a(1, 0.5)), NAdapters: 2}, 0), false
	case 12:
		return scope(cScope{Adapters: arr(a(1, 0.5), a(0, 1)), NAdapters: 2}, 0), false // case 11 in another order
	case 13:
		return scope(cScope{TenantSalt: salt, TenantSaltLen: 2, Adapters: arr(a(2, 0), a(0, -1)), NAdapters: 2}, 0), false
	}
	return nil, false
}

func (w *world) scopeID() {
	scope, bad := w.scope(w.arg(0))
	// An id is 16 bytes of no alignment: an odd address is fine.
	b := w.c.alloc(w.t, 18, 1)
	for i := range b {
		b[i] = 0xa5
	}
	out := unsafe.Pointer(&b[1])
	switch w.arg(1) % 4 {
	case 0:
		out = nil
	case 1:
		out = pointer(b)
	}
	var faults []status.Code
	if bad || out == nil {
		faults = append(faults, status.InvalidArg)
	}
	if w.check("scope id", mcbgo_scope_id(scope, out, w.eb, w.el), expect(true, faults, status.OK)...) != status.OK {
		if !untouched(b) {
			w.fail("a failed scope id wrote its output")
		}
		return
	}
	again := w.c.alloc(w.t, 16, 1)
	w.check("scope id again", mcbgo_scope_id(scope, pointer(again), w.eb, w.el), status.OK)
	id := unsafe.Slice((*byte)(out), 17)
	if !bytes.Equal(id[:16], again) || id[16] != 0xa5 {
		w.fail("scope id %x, then %x", id, again)
	}
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
	o := w.objects[h]
	var g model
	if o != nil {
		g = o.m
	}
	tp, tok, n, tokBad := w.tokens(4, 96, g.block)
	cached := uint64(0)
	switch w.arg(8) % 8 {
	case 0:
		cached = uint64(n) + 1 + uint64(w.arg(9))<<40
	case 1:
		cached = uint64(w.arg(9)) % uint64(n+1)
	}
	var faults []status.Code
	if outBad || scopeBad || tokBad || (cached > uint64(n) && !tokBad) {
		faults = append(faults, status.InvalidArg)
	}
	if w.check("lookup", mcbgo_lookup(h, scope, tp, uint64(n), cached, out, w.eb, w.el), expect(w.valid(h, modelKind), faults, status.OK)...) != status.OK {
		if !untouched(ob) {
			w.fail("a failed lookup wrote its output")
		}
		return
	}
	r := (*cLookupResult)(out)
	B := r.NBlockTokens
	if B != g.block || r.NRestoreTokens%B != 0 || r.NRestoreTokens > r.NMatchedBlocks*B || int(r.NRestoreTokens) > n-1 ||
		int(r.NMatchedBlocks) > (n-1)/int(B) || r.Reason < 0 || r.Reason > 7 || (r.NRestoreTokens > 0) != (r.Plan != 0) ||
		(r.NRestoreTokens > 0 && uint64(r.NRestoreTokens) <= cached) ||
		!(r.EstRestoreMS >= 0) || !(r.EstRecomputeMS >= 0) || !(r.EstTotalMS >= 0) {
		w.fail("lookup of %d tokens, %d held, block %d: %+v", n, cached, g.block, *r)
	}
	if r.Plan != 0 {
		w.issue(r.Plan, &object{kind: planKind, bridge: o.bridge, model: h, m: g, state: o.state, tok: tok[:r.NRestoreTokens], n: int(r.NRestoreTokens)})
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
		return ts, unsafe.Pointer(putT(w.t, w.c, *ts.layout, 4)), append(faults, status.InvalidArg)
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
		{func(_ *cKVLayout, ls []cKVLayer) { // no V tensor in a layer with V, one in a layer without
			if g.vEmbd[l] == 0 {
				ls[l].V = ls[l].K
			} else {
				ls[l].V = 0
			}
		}, status.Layout},
		{func(_ *cKVLayout, ls []cKVLayer) { // K rows running past the top of the address space
			ls[l].K = ^uintptr(0) - uintptr(uint64(cells-1)*ls[l].KStride+uint64(g.krow(l))) + 1
		}, status.Layout},
		{func(_ *cKVLayout, ls []cKVLayer) {
			if wraps != status.OK {
				ls[l].KStride = 1 << 63
			}
		}, wraps},
		{func(lo *cKVLayout, _ []cKVLayer) { lo.Location = w.c.cstr(w.t, "cuda:0") }, status.Unsupported},
		{func(lo *cKVLayout, _ []cKVLayer) { lo.Location = w.env.location }, status.InvalidArg},
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
	lo := putT(w.t, w.c, *ts.layout, 0)
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

// track records tensors whose every byte the program checks at its end.
func (w *world) track(ts *tensors) {
	w.shadow[ts] = ts.snapshot()
	w.order = append(w.order, ts)
}

// modelOf is the geometry of the model behind a handle, or a small one
// for a handle that names none.
func (w *world) modelOf(h uint64) model {
	if o := w.objects[h]; o != nil && (o.kind == modelKind || o.kind == planKind) {
		return o.m
	}
	return model{block: 4, kEmbd: []uint32{8}, vEmbd: []uint32{8}}
}

func (w *world) saveBegin() {
	h := w.handle(modelKind)
	g := w.modelOf(h)
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
	checked := n / B * B // a save checks the cells of whole blocks
	switch {
	case tokBad:
		checked = 0
	case n < B:
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
		if ok && len(faults) == 0 {
			ts.compute(tok, cells, checked) // the host's decode
		}
		w.track(ts)
	}
	got := w.check("save begin", mcbgo_save_begin(h, scope, layout, tp, uint64(n), cp, out, w.eb, w.el),
		expect(ok, faults, status.OK, status.PoolFull)...)
	if ts != nil && !bytes.Equal(ts.region, w.shadow[ts]) {
		w.fail("save begin (status %d) changed its source", got)
	}
	if got != status.OK {
		if !untouched(ob) {
			w.fail("a failed save begin wrote its output")
		}
		return
	}
	w.issue(*(*uint64)(out), &object{kind: saveKind, bridge: w.objects[h].bridge, m: g, ts: ts, tok: tok, cells: cells, n: n,
		saved: make([]bool, g.layers())})
}

// loadBegin loads a plan into drawn tensors.
func (w *world) loadBegin() {
	h := w.handle(planKind)
	o := w.objects[h]
	ok := w.valid(h, planKind)
	g := w.modelOf(h)
	out, ob, outBad := w.out(w.arg(2), 8, 8)
	ts, layout, faults := w.layout(g)
	if outBad {
		faults = append(faults, status.InvalidArg)
	}
	var cp unsafe.Pointer
	var cells []uint32
	if ok && ts != nil {
		var cf []status.Code
		cp, cells, cf = w.cellsArg(o.n, ts.cells, o.n)
		faults = append(faults, cf...)
	}
	if ts != nil {
		w.track(ts)
	}
	got := w.check("load begin", mcbgo_load_begin(h, layout, cp, out, w.eb, w.el), expect(ok, faults, status.OK, status.NotFound)...)
	if ok {
		o.live = false // consumed, also by a refusal
	}
	if got != status.OK {
		if ts != nil && !bytes.Equal(ts.region, w.shadow[ts]) {
			w.fail("a refused load begin (status %d) touched the tensors", got)
		}
		if !untouched(ob) {
			w.fail("a failed load begin wrote its output")
		}
		return
	}
	if err := ts.checkRestore(w.shadow[ts], o.tok, cells, o.n, 0, 0); err != nil {
		w.fail("load begin: %v", err)
	}
	w.issue(*(*uint64)(out), &object{kind: loadKind, bridge: o.bridge, m: g, ts: ts, tok: o.tok, cells: cells, n: o.n,
		before: w.shadow[ts], nok: o.n})
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
	w.checkSaved("save", got, (*cSaveResult)(out), o.n, o.m)
	if !bytes.Equal(o.ts.region, w.shadow[o.ts]) {
		w.fail("a save wrote into its source")
	}
}

// checkSaved checks a save's result against the tokens it was given.
func (w *world) checkSaved(what string, got status.Code, r *cSaveResult, n int, g model) {
	B := int(g.block)
	if int(r.NBlocks) != n/B || r.NKnown+r.NWritten > r.NBlocks || (got == status.OK && r.NQueued < r.NWritten) {
		w.fail("%s of %d tokens, block %d: status %d, %+v", what, n, B, got, *r)
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
	if ok {
		il = w.layerArg(o.placed, o.m.layers())
		if int(il) >= o.m.layers() {
			faults = append(faults, status.InvalidArg)
		}
	}
	if w.check("wait layer", mcbgo_load_wait_layer(h, il, out, w.eb, w.el), expect(ok, faults, status.OK)...) != status.OK {
		if !untouched(ob) {
			w.fail("a failed wait wrote its output")
		}
		if ok {
			if err := o.ts.checkRestore(o.before, o.tok, o.cells, o.n, o.nok, o.placed); err != nil {
				w.fail("after a refused wait: %v", err)
			}
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

// loadProgress asks how far a load is: the layers it reports placed hold
// their verified rows, and the good prefix never grows.
func (w *world) loadProgress() {
	h := w.handle(loadKind)
	o := w.objects[h]
	ok := w.valid(h, loadKind)
	outL, obL, badL := w.out(w.arg(2), 4, 4)
	outT, obT, badT := w.out(w.arg(3), 4, 4)
	var faults []status.Code
	if badL || badT {
		faults = append(faults, status.InvalidArg)
	}
	if w.check("load progress", mcbgo_load_progress(h, outL, outT, w.eb, w.el), expect(ok, faults, status.OK)...) != status.OK {
		if !untouched(obL) || !untouched(obT) {
			w.fail("a refused progress wrote its output")
		}
		return
	}
	layers, nok := int(*(*uint32)(outL)), int(*(*uint32)(outT))
	if layers > o.m.layers() || nok > o.nok || nok%int(o.m.block) != 0 {
		w.fail("progress: %d of %d layers, %d tokens good after %d", layers, o.m.layers(), nok, o.nok)
	}
	o.nok, o.placed = nok, max(o.placed, layers)
	if err := o.ts.checkRestore(o.before, o.tok, o.cells, o.n, o.nok, o.placed); err != nil {
		w.fail("after progress reported %d layers: %v", layers, err)
	}
}

// checkLoaded checks a load's result against the plan it loaded.
func (w *world) checkLoaded(what string, got status.Code, r *cLoadResult, n, nok int, g model) {
	B := int(g.block)
	if int(r.NBlocks) > n/B || r.NBlocks == 0 || r.NBlocksOK > r.NBlocks || int(r.NTokensOK) != int(r.NBlocksOK)*B ||
		int(r.NTokensOK) > nok || r.NBytes != uint64(r.NBlocksOK)*uint64(g.payload()) ||
		r.FirstError != int32(got) || (got == status.OK) != (r.NBlocksOK == r.NBlocks) {
		w.fail("%s of %d tokens, block %d: status %d, %+v", what, n, B, got, *r)
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
	w.checkLoaded("load", got, r, o.n, o.nok, o.m)
	if err := o.ts.checkRestore(o.before, o.tok, o.cells, o.n, int(r.NTokensOK), o.m.layers()); err != nil {
		w.fail("%v", err)
	}
	w.shadow[o.ts] = o.ts.snapshot()
}

// stateOf is the state format of the model behind a handle: its own for a
// state host's, the first real state's otherwise.
func (w *world) stateOf(h uint64) stateFormat {
	if o := w.objects[h]; o != nil && o.state != nil {
		return *o.state
	}
	sf, err := stateFormatOf(w.env.states[0])
	if err != nil {
		w.fail("%v", err)
	}
	return sf
}

func (w *world) stateSave() {
	h := w.handle(modelKind)
	o := w.objects[h]
	ok := w.valid(h, modelKind)
	out, ob, outBad := w.out(w.arg(2), int(unsafe.Sizeof(cSaveResult{})), 4)
	scope, scopeBad := w.scope(w.arg(3))
	g := w.modelOf(h)
	tp, tok, n, tokBad := w.tokens(4, 40, g.block)
	sf := w.stateOf(h)
	cells := 1 + int(w.arg(8))%40
	order := inOrder(cells)
	if w.arg(9)%2 == 0 {
		order = scattered(cells)
	}
	intact := w.arg(10)%4 != 0
	if !intact && !tokBad {
		// What a garbage state saves is garbage: tokens no other call
		// draws keep its blocks out of every prefix the program checks.
		for i := range tok {
			tok[i] += 1 << 20
		}
		tp = w.c.i32s(w.t, tok)
	}
	blob := sf.build(w.t, llamastate.Memory, int32(sf.stream), sf.stream, tok, order)
	if !intact {
		w.seed(11)
		blob[w.rand(len(blob))] ^= byte(1 + w.rand(255))
	}
	state, size, stateBad := w.stateArgs(blob, w.arg(12))
	var faults []status.Code
	if outBad || scopeBad || tokBad || stateBad {
		faults = append(faults, status.InvalidArg)
	}
	success := []status.Code{status.OK, status.PoolFull}
	if min(n, cells) < int(g.block) {
		success = []status.Code{status.InvalidArg} // no full block
	}
	if o == nil || o.state == nil {
		success = append(success, status.ModelMismatch) // a tensor host's model, of its own format
	}
	if !intact {
		success = anyStatus()
	}
	got := w.check("state save", mcbgo_state_save(h, scope, state, size, tp, uint64(n), out, w.eb, w.el), expect(ok, faults, success...)...)
	if state != nil && !bytes.Equal(blob, unsafe.Slice((*byte)(state), len(blob))) {
		w.fail("state save wrote into its state")
	}
	if !ok || len(faults) > 0 {
		if !untouched(ob) {
			w.fail("a refused state save wrote its output")
		}
		return
	}
	if got == status.OK {
		w.checkSaved("state save", got, (*cSaveResult)(out), min(n, cells), g)
	}
}

func (w *world) stateRestore() {
	h := w.handle(planKind)
	o := w.objects[h]
	ok := w.valid(h, planKind)
	blobOut, bb, blobBad := w.out(w.arg(2), 8, 8)
	sizeOut, sb, sizeBad := w.out(w.arg(3), 8, 8)
	out, ob, outBad := w.out(w.arg(4), int(unsafe.Sizeof(cLoadResult{})), 8)
	var faults []status.Code
	if blobBad || sizeBad || outBad {
		faults = append(faults, status.InvalidArg)
	}
	success := []status.Code{status.OK, status.NotFound, status.Transfer, status.Corrupt, status.Timeout}
	if ok && o.state == nil {
		success = []status.Code{status.Unsupported} // a tensor host's plan
	}
	got := w.check("state restore", mcbgo_state_restore(h, blobOut, sizeOut, out, w.eb, w.el), expect(ok, faults, success...)...)
	if ok {
		o.live = false // consumed, also by a refusal
	}
	if got != status.OK {
		if !untouched(bb) || !untouched(sb) {
			w.fail("a failed state restore set a blob")
		}
		if (!ok || len(faults) > 0) && !untouched(ob) {
			w.fail("a refused state restore wrote its result")
		}
		return
	}
	r := (*cLoadResult)(out)
	blob := *(*unsafe.Pointer)(blobOut)
	n := *(*uint64)(sizeOut)
	if blob == nil || n == 0 {
		w.fail("state restore gave %d bytes at %p", n, blob)
	}
	restored := bytes.Clone(unsafe.Slice((*byte)(blob), n))
	mcbgo_state_free(blob)
	// A restore that verified some blocks gives them as a state, with the
	// failure of the next in its result.
	B := int(o.m.block)
	if r.NBlocksOK == 0 || r.NBlocksOK > r.NBlocks || int(r.NBlocks) > o.n/B || int(r.NTokensOK) != int(r.NBlocksOK)*B ||
		r.NBytes != uint64(r.NBlocksOK)*uint64(o.m.payload()) || (r.NBlocksOK == r.NBlocks) != (r.FirstError == int32(status.OK)) {
		w.fail("state restore of %d tokens, block %d: %+v", o.n, B, *r)
	}
	sf := *o.state
	sf.stream = 0 // a restore fills the first stream
	if want := sf.build(w.t, llamastate.Memory, 0, 0, o.tok, inOrder(int(r.NTokensOK))); !bytes.Equal(restored, want) {
		w.fail("state restore of %d tokens: %d bytes, not the %d of the prefix", r.NTokensOK, len(restored), len(want))
	}
}

func (w *world) metrics() {
	h := w.handle(bridgeKind)
	var off unsafe.Pointer
	switch w.arg(2) % 8 {
	case 0:
		off = ptr(w.env.str)
	case 1:
		off = ptr(w.c.cstr(w.t, "draft model"))
	case 2:
		off = ptr(w.c.cstr(w.t, ""))
	}
	caps := []uint64{0, 1, 2, 64, 1 << 16}
	capacity := caps[int(w.arg(3))%len(caps)]
	buf := w.c.alloc(w.t, int(capacity)+8, 1)
	for i := range buf {
		buf[i] = 0xa5
	}
	p := pointer(buf)
	if w.arg(4)%8 == 0 {
		p = nil
	}
	n := mcbgo_metrics_text(h, off, p, capacity)
	if n < uint64(len("# HELP mcbridge_up")) {
		w.fail("metrics text of %d bytes", n)
	}
	if p == nil || capacity == 0 {
		if !untouched(buf) {
			w.fail("metrics wrote a buffer it was not given")
		}
		return
	}
	k := min(n, capacity-1)
	if buf[k] != 0 || !untouched(buf[capacity:]) || bytes.IndexByte(buf[:k], 0) >= 0 ||
		!strings.HasPrefix("# HELP mcbridge_up", string(buf[:min(k, 18)])) {
		w.fail("metrics text of %d bytes into %d: %q", n, capacity, buf[:min(k, 64)])
	}
}

func (w *world) probeTokens() {
	b := w.c.alloc(w.t, 4*16+4, 4)
	for i := range b {
		b[i] = 0xa5
	}
	p := pointer(b)
	switch w.arg(0) % 8 {
	case 0:
		p = nil
	case 1:
		p = unsafe.Add(p, 2)
	}
	capacity := uint64(w.arg(1)) % 17
	if n := mcbgo_probe_tokens(p, capacity); n != uint64(len(host.ProbeTokens())) {
		w.fail("%d probe tokens", n)
	}
	k := int(min(capacity, uint64(len(probeTokens))))
	if p != pointer(b) {
		k = 0
	}
	got := unsafe.Slice((*int32)(pointer(b)), k)
	if !slices.Equal(got, probeTokens[:k]) || !untouched(b[4*k:]) {
		w.fail("probe tokens into %d of %p: %x", capacity, p, b)
	}
}

// closeAll ends every load and save, drops every plan and closes every
// bridge. Strict, it checks that each succeeds, that no handle is left and
// that every tensor set holds what it must; after a failure it only
// cleans up.
func (w *world) closeAll(strict bool) {
	for _, k := range []kind{loadKind, saveKind, planKind, bridgeKind} {
		for _, h := range w.issued {
			o := w.objects[h]
			if !o.live || o.kind != k {
				continue
			}
			switch {
			case !strict && k == loadKind:
				mcbgo_load_end(h, unsafe.Pointer(new(cLoadResult)), nil, 0)
			case !strict && k == saveKind:
				mcbgo_save_end(h, unsafe.Pointer(new(cSaveResult)), nil, 0)
			case !strict && k == planKind:
				mcbgo_plan_drop(h, nil, 0)
			case !strict:
				mcbgo_bridge_close(h, nil, 0)
			case k == loadKind:
				w.loadEnd(h, benign)
			case k == saveKind:
				w.saveEnd(h, benign)
			case k == planKind:
				w.check("plan drop at exit", mcbgo_plan_drop(h, w.eb, w.el), status.OK)
			default:
				w.check("close at exit", mcbgo_bridge_close(h, w.eb, w.el), status.OK)
			}
			o.live = false
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
