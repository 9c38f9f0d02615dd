//go:build linux && (amd64 || arm64)

package mooncake

import (
	"context"
	"testing"
	"time"
	"unsafe"

	"github.com/ebitengine/purego"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/transport"
)

// The conformance suite runs every scenario on the mock and on the real
// libtransfer_engine.so ($MCB_TE_REAL_LIB), and asserts what the real
// library does (mooncake-capi/README.md lists it): where the two differed,
// the mock was changed. Scenarios marked mockOnly need the mock's controls.
func TestConformance(t *testing.T) {
	runScenarios(t, []scenario{
		{name: "Registration", run: testRegistration},
		{name: "BatchRegistration", run: testBatchRegistration},
		{name: "Segments", run: testSegments},
		{name: "ReadWrite", run: testReadWrite},
		{name: "ReadWritePaths", mockOnly: "chooses the mock's data path (mock_te_set_path) and reads its byte counters", run: testReadWritePaths},
		{name: "ManyTasks", run: testManyTasks},
		{name: "BatchCapacity", run: testBatchCapacity},
		{name: "StaleBatch", run: testStaleBatch},
		{name: "BusyFree", run: testBusyFree},
		{name: "SeenRule", run: testSeenRule},
		{name: "RangesAtTransferTime", run: testRangesAtTransferTime},
		{name: "RegistrationRecheckedInFlight", mockOnly: "holds a task between submit and its first byte with the stall fault", run: testRecheckedInFlight},
		{name: "RequestEdges", run: testRequestEdges},
		{name: "Notify", run: testNotify},
		{name: "FaultFail", mockOnly: "injects a failure after N bytes", run: testFaultFail},
		{name: "FaultCorrupt", mockOnly: "flips a delivered byte", run: testFaultCorrupt},
		{name: "FaultDelayTimeout", mockOnly: "delays slices past MOCK_TE_TIMEOUT_MS", run: testFaultDelayTimeout},
		{name: "FaultDropPeer", mockOnly: "drops every connection of an engine", run: testFaultDropPeer},
		{name: "CanAbort", run: testCanAbort},
		{name: "Abort", mockOnly: "mock_te_abort_batch is the mock's own", run: testAbort},
		{name: "SameHostEPERMFallback", mockOnly: "simulates Yama's EPERM on the same-host path", run: testEPERMFallback},
	})
}

func read(seg transport.SegmentID, local buffer, remote buffer) transport.Request {
	return transport.Request{Op: transport.Read, Local: local.addr(), Segment: seg, Remote: uint64(remote.addr()), Length: uint64(len(local))}
}

func write(seg transport.SegmentID, local buffer, remote buffer) transport.Request {
	return transport.Request{Op: transport.Write, Local: local.addr(), Segment: seg, Remote: uint64(remote.addr()), Length: uint64(len(local))}
}

// pair is two engines in this process, a reading from b's segment.
type pair struct {
	a, b  *Engine
	seg   transport.SegmentID
	local buffer // registered on a
	peer  buffer // registered on b, filled with seed 1
}

func newPair(t testing.TB, lib string, size int) *pair {
	t.Helper()
	p := &pair{a: openEngine(t, lib), b: openEngine(t, lib)}
	p.local = newBuffer(t, size)
	p.peer = newBuffer(t, size)
	p.peer.fill(1)
	register(t, p.a, p.local)
	register(t, p.b, p.peer)
	seg, err := p.a.OpenSegment(p.b.LocalSegment())
	require.NoError(t, err, "open %s", p.b.LocalSegment())
	p.seg = seg
	return p
}

// raw calls a library function by name with the engine's handle, past
// every check of the binding, and returns its int result.
func raw(t testing.TB, e *Engine, name string, args ...uintptr) int32 {
	t.Helper()
	return int32(rawWord(t, e, name, args...))
}

// rawWord is raw for a function returning a 64-bit value (a batch id).
func rawWord(t testing.TB, e *Engine, name string, args ...uintptr) uintptr {
	t.Helper()
	fn, err := purego.Dlsym(e.lib.handle, name)
	require.NoError(t, err, name)
	var r uintptr
	require.NoError(t, e.use(name, func(h uintptr) error {
		r, _, _ = purego.SyscallN(fn, append([]uintptr{h}, args...)...)
		return nil
	}))
	return r
}

func cstr(t testing.TB, s string) uintptr {
	b, err := cString(s)
	require.NoError(t, err)
	// Kept until the test ends: C may read it at any point of the call.
	t.Cleanup(func() { _ = b[0] })
	return uintptr(unsafe.Pointer(&b[0]))
}

func testRegistration(t *testing.T, lib string) {
	e := openEngine(t, lib)
	mem := newBuffer(t, 1<<20)
	base := mem.addr()
	require.NoError(t, e.RegisterMemory(base+4096, 8192, "cpu:0", true))
	for _, c := range []struct {
		name string
		addr uintptr
		len  uint64
	}{
		{"same range", base + 4096, 8192},
		{"inside", base + 8192, 100},
		{"overlapping the start", base, 4097},
		{"overlapping the end", base + 12287, 4096},
		{"covering", base, 1 << 20},
	} {
		err := e.RegisterMemory(c.addr, c.len, "cpu:0", true)
		wantCode(t, err, status.InvalidArg, "overlap "+c.name)
		assert.Contains(t, err.Error(), "overlaps", "overlap %s", c.name)
		assert.Contains(t, err.Error(), "code -7", "overlap %s", c.name)
	}
	// Adjacent ranges do not overlap.
	for _, r := range [][2]uintptr{{base, 4096}, {base + 12288, 4096}} {
		require.NoError(t, e.RegisterMemory(r[0], uint64(r[1]), "*", false), "adjacent %#x", r[0])
		require.NoError(t, e.UnregisterMemory(r[0]))
	}
	// The binding refuses what it can tell is wrong; the library's own
	// answer to a zero length is -1.
	wantCode(t, e.RegisterMemory(base, 0, "cpu:0", true), status.InvalidArg, "zero length")
	wantCode(t, e.RegisterMemory(0, 10, "cpu:0", true), status.InvalidArg, "null address")
	wantCode(t, e.RegisterMemory(base, 10, "", true), status.InvalidArg, "empty location")
	assert.EqualValues(t, -1, raw(t, e, "registerLocalMemory", base, 0, cstr(t, "cpu:0"), 1), "raw zero length")
	// Nor does it refuse a NULL start.
	assert.EqualValues(t, 0, raw(t, e, "registerLocalMemory", 0, 10, cstr(t, "cpu:0"), 1), "raw NULL start")
	assert.EqualValues(t, 0, raw(t, e, "unregisterLocalMemory", 0), "raw unregister of the NULL start")
	// A build without CUDA does not look at the location.
	for _, loc := range []string{"cuda:0", "*", "nonsense"} {
		require.NoError(t, e.RegisterMemory(base, 10, loc, true), "location %q", loc)
		require.NoError(t, e.UnregisterMemory(base))
	}
	require.NoError(t, e.UnregisterMemory(base+4096))
	require.NoError(t, e.RegisterMemory(base, 1<<20, "cpu:0", true), "register after unregister")
	wantCode(t, e.Close(), status.State, "close with a registration left")
	require.NoError(t, e.UnregisterMemory(base))
	err := e.UnregisterMemory(base)
	wantCode(t, err, status.InvalidArg, "unregister twice")
	assert.Contains(t, err.Error(), "code -3")
	err = e.UnregisterMemory(base + 8)
	wantCode(t, err, status.InvalidArg, "unregister a start never registered")
	assert.Contains(t, err.Error(), "code -3")
}

func testBatchRegistration(t *testing.T, lib string) {
	e := openEngine(t, lib)
	mem := newBuffer(t, 1<<20)
	base := mem.addr()
	wantCode(t, e.RegisterMemoryBatch([]Region{{base, 8192}, {base + 4096, 4096}}, "cpu:0"), status.InvalidArg, "overlapping batch")
	regions := []Region{{base, 4096}, {base + 65536, 4096}, {base + 8192, 8192}}
	require.NoError(t, e.RegisterMemoryBatch(regions, "cpu:0"))
	// All or none: one overlap refuses the whole list.
	wantCode(t, e.RegisterMemoryBatch([]Region{{base + 200000, 10}, {base + 9000, 10}}, "cpu:0"), status.InvalidArg, "batch overlapping a region")
	require.NoError(t, e.RegisterMemory(base+200000, 10, "cpu:0", true), "the refused batch left a registration behind")
	// A list with a start that is not registered is refused whole, before
	// the library sees it (which would stop serving the known starts and
	// still count them in its overlap check).
	err := e.UnregisterMemoryBatch([]uintptr{base, base + 65536, base + 5})
	wantCode(t, err, status.InvalidArg, "unregister batch with an unknown start")
	wantCode(t, e.UnregisterMemoryBatch([]uintptr{base, base}), status.InvalidArg, "unregister batch with a start twice")
	require.NoError(t, e.UnregisterMemoryBatch([]uintptr{base, base + 65536, base + 8192, base + 200000}), "the refused lists left every region registered")
}

func testSegments(t *testing.T, lib string) {
	e := openEngine(t, lib)
	seg, err := e.OpenSegment(e.LocalSegment())
	require.NoError(t, err, "own segment")
	assert.EqualValues(t, 0, seg, "own segment is the local segment")
	for _, name := range []string{"127.0.0.1:1", "no-port-given", "[::1"} {
		_, err := e.OpenSegment(name)
		wantCode(t, err, status.Transfer, "open "+name)
	}
	_, err = e.OpenSegment("")
	wantCode(t, err, status.InvalidArg, "empty name")
	assert.EqualValues(t, -1, raw(t, e, "openSegment", cstr(t, "")), "raw openSegment of an empty name")

	// An engine with no transport installed opens nothing, its own name
	// included.
	bare := createBare(t, e.lib)
	for _, name := range []string{e.LocalSegment(), bare.name} {
		r, _, _ := purego.SyscallN(bare.openSegment, bare.h, cstr(t, name))
		assert.EqualValues(t, -1, int32(r), "openSegment(%q) before installTransport", name)
	}

	p := newPair(t, lib, 64<<10)
	assert.GreaterOrEqual(t, int(p.seg), 1, "a peer's id")
	again, err := p.a.OpenSegment(p.b.LocalSegment())
	require.NoError(t, err)
	assert.Equal(t, p.seg, again, "reopen returns the cached id")
	// Closing changes nothing: the id keeps working, and a reopen gives it
	// back.
	require.NoError(t, p.a.CloseSegment(p.seg))
	require.NoError(t, p.a.CloseSegment(999), "close an id never opened")
	st := transfer(t, p.a, read(p.seg, p.local, p.peer))
	assert.Equal(t, transport.Completed, st[0].State, "read through a closed segment id")
	again, err = p.a.OpenSegment(p.b.LocalSegment())
	require.NoError(t, err)
	assert.Equal(t, p.seg, again, "reopen after close")
	// So does uninstalling the transport.
	assert.EqualValues(t, 0, raw(t, p.a, "uninstallTransport", cstr(t, "tcp")))
	clear(p.local)
	st = transfer(t, p.a, read(p.seg, p.local, p.peer))
	assert.Equal(t, transport.Completed, st[0].State, "read after uninstallTransport")
	assert.Equal(t, -1, p.local.firstMismatch(1))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, p.a.SyncSegmentCache(ctx))
}

// bareEngine is an engine created past the binding, with no transport.
type bareEngine struct {
	h, openSegment uintptr
	name           string
}

func createBare(t *testing.T, lib *Library) bareEngine {
	open, err := purego.Dlsym(lib.handle, "openSegment")
	require.NoError(t, err)
	h, _ := lib.call("createTransferEngine", lib.sym.createTransferEngine, plain,
		cstr(t, P2PHandshake), cstr(t, "127.0.0.1"), cstr(t, "127.0.0.1"), 0, 0)
	require.NotZero(t, h, "createTransferEngine")
	t.Cleanup(func() { _, _ = lib.call("destroyTransferEngine", lib.sym.destroyTransferEngine, plain, h) })
	buf := make([]byte, 256)
	_, err = lib.call("getLocalIpAndPort", lib.sym.getLocalIPAndPort, negativeCode, h, uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf)))
	require.NoError(t, err)
	return bareEngine{h: h, openSegment: open, name: goString(buf)}
}

func testReadWrite(t *testing.T, lib string) {
	const size = 3<<20 + 12345 // not a multiple of any slice size
	p := newPair(t, lib, size)
	clear(p.local)
	st := transfer(t, p.a, read(p.seg, p.local, p.peer))
	require.Equal(t, transport.TaskStatus{State: transport.Completed, Transferred: size}, st[0], "read")
	require.Equal(t, -1, p.local.firstMismatch(1), "read bytes")
	p.local.fill(2)
	st = transfer(t, p.a, write(p.seg, p.local, p.peer))
	require.Equal(t, transport.TaskStatus{State: transport.Completed, Transferred: size}, st[0], "write")
	require.Equal(t, -1, p.peer.firstMismatch(2), "written bytes")
	// The local segment: an engine reads its own registered memory.
	half := len(p.local) / 2
	p.local.fill(3)
	st = transfer(t, p.a, transport.Request{Op: transport.Read, Local: p.local.addr(), Segment: 0, Remote: uint64(p.local.addr()) + uint64(half), Length: uint64(half)})
	require.Equal(t, transport.Completed, st[0].State, "read from the local segment")
	for i := 0; i < half; i++ {
		require.Equal(t, pattern(3, half+i), p.local[i], "local-segment byte %d", i)
	}
}

func testReadWritePaths(t *testing.T, lib string) {
	const size = 3<<20 + 12345
	p := newPair(t, lib, size)
	for _, path := range []Path{PathVM, PathTCP} {
		require.NoError(t, p.a.SetPath(path))
		before, err := p.a.MockStats()
		require.NoError(t, err)
		clear(p.local)
		st := transfer(t, p.a, read(p.seg, p.local, p.peer))
		require.Equal(t, transport.Completed, st[0].State, "path %d read", path)
		require.Equal(t, -1, p.local.firstMismatch(1), "path %d read bytes", path)
		p.local.fill(2)
		st = transfer(t, p.a, write(p.seg, p.local, p.peer))
		require.Equal(t, transport.Completed, st[0].State, "path %d write", path)
		require.Equal(t, -1, p.peer.firstMismatch(2), "path %d written bytes", path)
		p.peer.fill(1)
		after, err := p.a.MockStats()
		require.NoError(t, err)
		vm, tcp := after.VMBytes-before.VMBytes, after.TCPBytes-before.TCPBytes
		if path == PathVM {
			assert.Equal(t, [2]uint64{2 * size, 0}, [2]uint64{vm, tcp}, "bytes moved by process_vm and by TCP")
		} else {
			assert.Equal(t, [2]uint64{0, 2 * size}, [2]uint64{vm, tcp}, "bytes moved by process_vm and by TCP")
		}
	}
}

func testManyTasks(t *testing.T, lib string) {
	const block, n = 64 << 10, 48
	p := newPair(t, lib, block*n)
	// Scatter: task i reads peer block n-1-i into local block i.
	reqs := make([]transport.Request, n)
	for i := range reqs {
		reqs[i] = transport.Request{Op: transport.Read, Local: p.local.addr() + uintptr(i*block), Segment: p.seg,
			Remote: uint64(p.peer.addr()) + uint64((n-1-i)*block), Length: block}
	}
	b := allocate(t, p.a, n)
	// Two submissions: task numbers continue across them.
	require.NoError(t, b.Submit(reqs[:n/2]))
	require.NoError(t, b.Submit(reqs[n/2:]))
	require.Equal(t, n, b.Tasks())
	st, err := transport.Wait(context.Background(), b, 0, n, transport.DefaultBackoff)
	require.NoError(t, err)
	for i, s := range st {
		require.Equal(t, transport.TaskStatus{State: transport.Completed, Transferred: block}, s, "task %d", i)
		for j := 0; j < block; j++ {
			require.Equal(t, pattern(1, (n-1-i)*block+j), p.local[i*block+j], "task %d byte %d", i, j)
		}
	}
}

func testBatchCapacity(t *testing.T, lib string) {
	p := newPair(t, lib, 4096)
	_, err := p.a.AllocateBatch(0)
	wantCode(t, err, status.InvalidArg, "capacity 0")
	b := allocate(t, p.a, 2)
	r := read(p.seg, p.local, p.peer)
	wantCode(t, b.Submit([]transport.Request{r, r, r}), status.InvalidArg, "three requests in a batch of two")
	require.NoError(t, b.Submit([]transport.Request{r}))
	wantCode(t, b.Submit([]transport.Request{r, r}), status.InvalidArg, "capacity counts earlier submissions")
	// The engine enforces the limit too: past the binding's own check, the
	// raw call fails with TooManyRequests (code 2).
	creq := []cRequest{{source: r.Local, targetID: int32(r.Segment), targetOffset: r.Remote, length: r.Length}}
	creq = append(creq, creq[0])
	assert.EqualValues(t, 2, raw(t, p.a, "submitTransfer", uintptr(b.id), uintptr(unsafe.Pointer(&creq[0])), uintptr(len(creq))), "raw over-capacity submit")
	_, err = transport.Wait(context.Background(), b, 0, b.Tasks(), transport.DefaultBackoff)
	require.NoError(t, err)
}

// testStaleBatch: the real engine hands a freed batch's address out again,
// and a poll of a freed batch crashes it, so the binding refuses every use
// of a freed Batch before calling the library. On the real library the test
// passing at all is the proof; the mock also counts calls naming a batch it
// does not know.
func testStaleBatch(t *testing.T, lib string) {
	p := newPair(t, lib, 4096)
	tb, err := p.a.AllocateBatch(4)
	require.NoError(t, err)
	b := tb.(*Batch)
	require.NoError(t, b.Free(), "free an empty batch")
	before, _ := p.a.MockStats()
	// New batches may reuse the freed one's address; the old Batch must
	// still refuse, and the new ones work.
	var fresh []*Batch
	for i := 0; i < 8; i++ {
		fresh = append(fresh, allocate(t, p.a, 1))
	}
	wantCode(t, b.Free(), status.State, "double free")
	_, err = b.Status(0)
	wantCode(t, err, status.State, "status after free")
	wantCode(t, b.Submit([]transport.Request{read(p.seg, p.local, p.peer)}), status.State, "submit after free")
	if after, _ := p.a.MockStats(); p.a.IsMock() {
		assert.Equal(t, before.InvalidBatchCalls, after.InvalidBatchCalls, "calls that named a freed batch")
	}
	for _, f := range fresh {
		require.NoError(t, f.Submit([]transport.Request{read(p.seg, p.local, p.peer)}))
		st, err := transport.Wait(context.Background(), f, 0, 1, transport.DefaultBackoff)
		require.NoError(t, err)
		require.Equal(t, transport.Completed, st[0].State)
	}
	wantCode(t, p.a.Close(), status.State, "close with batches allocated")
	_, err = fresh[0].Status(1)
	wantCode(t, err, status.InvalidArg, "status of a task never submitted")
	// Past the binding, the library answers 1 for a task index past the end.
	s := new(cStatus)
	assert.EqualValues(t, 1, raw(t, p.a, "getTransferStatus", uintptr(fresh[0].id), 5, uintptr(unsafe.Pointer(s))))
}

func testBusyFree(t *testing.T, lib string) {
	p := newPair(t, lib, 8<<20)
	b := allocate(t, p.a, 1)
	require.NoError(t, b.Submit([]transport.Request{read(p.seg, p.local, p.peer)}))
	wantCode(t, b.Free(), status.State, "free with a task never polled")
	// Past the binding's check the engine refuses too (code 4): the task is
	// not seen finished, whether or not it has finished.
	assert.EqualValues(t, 4, raw(t, p.a, "freeBatchID", uintptr(b.id)), "raw freeBatchID of a batch never polled")
	transport.WaitIdle(b, transport.DefaultBackoff)
	require.NoError(t, b.Free(), "free after completion")
}

// rawBatch drives a batch past the binding, for the rules about which tasks
// the engine counts as seen: the binding's own Free is stricter.
type rawBatch struct {
	t  *testing.T
	e  *Engine
	id uintptr
}

func newRawBatch(t *testing.T, e *Engine, reqs []transport.Request) *rawBatch {
	rb := &rawBatch{t: t, e: e}
	rb.id = rawWord(t, e, "allocateBatchID", uintptr(len(reqs)))
	cr := make([]cRequest, len(reqs))
	for i, r := range reqs {
		cr[i] = cRequest{opcode: int32(r.Op), source: r.Local, targetID: int32(r.Segment), targetOffset: r.Remote, length: r.Length}
	}
	require.EqualValues(t, 0, raw(t, e, "submitTransfer", rb.id, uintptr(unsafe.Pointer(&cr[0])), uintptr(len(cr))))
	t.Cleanup(func() {
		if rb.id == 0 {
			return
		}
		// Every task polled to its end: the batch is free-able.
		for i := range reqs {
			rb.waitDone(i)
		}
		assert.EqualValues(t, 0, rb.free())
	})
	return rb
}

func (rb *rawBatch) poll(task int) transport.State {
	s := new(cStatus)
	require.EqualValues(rb.t, 0, raw(rb.t, rb.e, "getTransferStatus", rb.id, uintptr(task), uintptr(unsafe.Pointer(s))))
	return transport.State(s.state)
}

func (rb *rawBatch) waitDone(task int) transport.State {
	deadline := time.Now().Add(10 * time.Second)
	for {
		if s := rb.poll(task); s.Done() {
			return s
		}
		require.True(rb.t, time.Now().Before(deadline), "task %d never finished", task)
		time.Sleep(time.Millisecond)
	}
}

func (rb *rawBatch) free() int32 {
	r := raw(rb.t, rb.e, "freeBatchID", rb.id)
	if r == 0 {
		rb.id = 0
	}
	return r
}

// testSeenRule: a task counts as seen once a poll reported it finished, and
// a poll that answers COMPLETED also counts every task of the batch already
// finished, up to and including the first FAILED one.
func testSeenRule(t *testing.T, lib string) {
	// Each case on a fresh pair: a refused range makes the real engine's
	// server drop that connection, and a request queued behind it on the
	// same lane then waits about a second for the lane to reconnect.
	type fixture struct {
		p       *pair
		ok      func(i int) transport.Request
		bad     transport.Request
		arrived func(i int) // waits until ok(i)'s bytes are in, without polling
	}
	fresh := func() fixture {
		p := newPair(t, lib, 3*4096)
		return fixture{
			p: p,
			ok: func(i int) transport.Request {
				return transport.Request{Op: transport.Read, Local: p.local.addr() + uintptr(i*4096), Segment: p.seg, Remote: uint64(p.peer.addr()) + uint64(i*4096), Length: 4096}
			},
			bad: transport.Request{Op: transport.Read, Local: p.local.addr(), Segment: p.seg, Remote: uint64(p.peer.addr()) + 3*4096 - 8, Length: 4096},
			arrived: func(i int) {
				require.Eventually(t, func() bool {
					for j := 0; j < 4096; j++ {
						if p.local[i*4096+j] != pattern(1, i*4096+j) {
							return false
						}
					}
					return true
				}, 10*time.Second, time.Millisecond, "the bytes of task %d", i)
				// The state is set right after the last byte lands.
				time.Sleep(50 * time.Millisecond)
			},
		}
	}

	f := fresh()
	rb := newRawBatch(t, f.p.a, []transport.Request{f.ok(0), f.ok(1), f.ok(2)})
	f.arrived(0)
	f.arrived(1)
	rb.waitDone(2)
	assert.EqualValues(t, 0, rb.free(), "free after one COMPLETED poll of a finished batch")

	// The sweep stops at the first FAILED task: the one after is unseen.
	f = fresh()
	rb = newRawBatch(t, f.p.a, []transport.Request{f.ok(0), f.bad, f.ok(2)})
	require.Equal(t, transport.Failed, rb.waitDone(1))
	f.arrived(0)
	f.arrived(2)
	require.Equal(t, transport.Completed, rb.poll(0))
	assert.EqualValues(t, 4, rb.free(), "free with a task past the first FAILED unseen")
	require.Equal(t, transport.Completed, rb.poll(2))
	assert.EqualValues(t, 0, rb.free(), "free once the last task was seen")

	// A FAILED answer sweeps nothing.
	f = fresh()
	rb = newRawBatch(t, f.p.a, []transport.Request{f.ok(0), f.bad})
	f.arrived(0)
	require.Equal(t, transport.Failed, rb.waitDone(1))
	assert.EqualValues(t, 4, rb.free(), "free after only a FAILED poll")

	// The first FAILED task itself counts as seen. Nothing shows that it
	// has failed but a poll, which would count it: the test gives it time
	// (one round trip on an idle lane of a fresh pair).
	f = fresh()
	rb = newRawBatch(t, f.p.a, []transport.Request{f.bad, f.ok(1)})
	f.arrived(1)
	time.Sleep(500 * time.Millisecond)
	require.Equal(t, transport.Completed, rb.poll(1))
	assert.EqualValues(t, 0, rb.free(), "free after the sweep saw the FAILED task")
}

// testRangesAtTransferTime: the engine checks the owner's ranges when the
// bytes move, not at submit: a request outside the owner's registrations
// is accepted and ends FAILED with nothing moved, and the local side is not
// checked at all.
func testRangesAtTransferTime(t *testing.T, lib string) {
	p := newPair(t, lib, 8192)
	private := newBuffer(t, 8192) // registered on b without remote access
	private.fill(4)
	require.NoError(t, p.b.RegisterMemory(private.addr(), uint64(len(private)), "cpu:0", false))
	t.Cleanup(func() { _ = p.b.UnregisterMemory(private.addr()) })
	loose := newBuffer(t, 8192) // registered nowhere
	for _, c := range []struct {
		name string
		req  transport.Request
	}{
		{"remote range past the end", transport.Request{Op: transport.Read, Local: p.local.addr(), Segment: p.seg, Remote: uint64(p.peer.addr()) + 8191, Length: 2}},
		{"remote range straddling the start", transport.Request{Op: transport.Read, Local: p.local.addr(), Segment: p.seg, Remote: uint64(p.peer.addr()) - 16, Length: 64}},
		{"remote range not registered", transport.Request{Op: transport.Read, Local: p.local.addr(), Segment: p.seg, Remote: uint64(loose.addr()), Length: 4096}},
		{"write past the end", transport.Request{Op: transport.Write, Local: p.local.addr(), Segment: p.seg, Remote: uint64(p.peer.addr()) + 8191, Length: 2}},
		{"write not registered", transport.Request{Op: transport.Write, Local: p.local.addr(), Segment: p.seg, Remote: uint64(loose.addr()), Length: 4096}},
		{"local segment, range not registered", transport.Request{Op: transport.Read, Local: p.local.addr(), Segment: 0, Remote: uint64(loose.addr()), Length: 4096}},
	} {
		p.local.fill(7)
		st := transfer(t, p.a, c.req)
		assert.Equal(t, transport.TaskStatus{State: transport.Failed}, st[0], c.name)
		assert.Equal(t, -1, p.local.firstMismatch(7), "%s: the local buffer changed", c.name)
	}
	assert.Equal(t, -1, p.peer.firstMismatch(1), "a refused write reached the owner")
	assert.Equal(t, make([]byte, len(loose)), []byte(loose), "a refused write reached unregistered memory")

	// remote_accessible is not looked at: a registered range is served.
	clear(p.local)
	st := transfer(t, p.a, transport.Request{Op: transport.Read, Local: p.local.addr(), Segment: p.seg, Remote: uint64(private.addr()), Length: 4096})
	assert.Equal(t, transport.Completed, st[0].State, "read of a range registered without remote access")
	assert.Equal(t, -1, buffer(p.local[:4096]).firstMismatch(4))

	// The local side: an unregistered buffer receives the bytes.
	st = transfer(t, p.a, transport.Request{Op: transport.Read, Local: loose.addr(), Segment: p.seg, Remote: uint64(p.peer.addr()), Length: 8192})
	assert.Equal(t, transport.Completed, st[0].State, "read into an unregistered local buffer")
	assert.Equal(t, -1, loose.firstMismatch(1))

	// Registrations are looked up when the bytes move: memory the owner
	// registers after the segment was opened is reachable, and memory it
	// unregisters is not, with no refresh of the segment in between.
	late := newBuffer(t, 4096)
	late.fill(5)
	require.NoError(t, p.b.RegisterMemory(late.addr(), 4096, "cpu:0", true))
	st = transfer(t, p.a, transport.Request{Op: transport.Read, Local: p.local.addr(), Segment: p.seg, Remote: uint64(late.addr()), Length: 4096})
	assert.Equal(t, transport.Completed, st[0].State, "read of memory registered after the open")
	assert.Equal(t, -1, buffer(p.local[:4096]).firstMismatch(5))
	require.NoError(t, p.b.UnregisterMemory(late.addr()))
	st = transfer(t, p.a, transport.Request{Op: transport.Read, Local: p.local.addr(), Segment: p.seg, Remote: uint64(late.addr()), Length: 4096})
	assert.Equal(t, transport.Failed, st[0].State, "read of memory unregistered after the open")

	// An id never opened is refused at submit, and nothing is queued.
	b := allocate(t, p.a, 1)
	wantCode(t, b.Submit([]transport.Request{{Op: transport.Read, Local: p.local.addr(), Segment: 999, Remote: uint64(p.peer.addr()), Length: 16}}), status.InvalidArg, "unknown segment")
	assert.Zero(t, b.Tasks())
}

// testRecheckedInFlight: a task held between submit and its first byte
// fails if the owner unregisters the range meanwhile, on every data path.
func testRecheckedInFlight(t *testing.T, lib string) {
	for _, path := range []Path{PathVM, PathTCP} {
		for _, op := range []transport.Op{transport.Read, transport.Write} {
			p := newPair(t, lib, 4096)
			require.NoError(t, p.a.SetPath(path))
			victim := newBuffer(t, 4096)
			victim.fill(6)
			require.NoError(t, p.b.RegisterMemory(victim.addr(), 4096, "cpu:0", true))
			require.NoError(t, p.a.SetFault(FaultStallAfter, 0))
			p.local.fill(8)
			b := allocate(t, p.a, 1)
			require.NoError(t, b.Submit([]transport.Request{{Op: op, Local: p.local.addr(), Segment: p.seg, Remote: uint64(victim.addr()), Length: 4096}}))
			require.NoError(t, p.b.UnregisterMemory(victim.addr()))
			require.NoError(t, p.a.SetFault(FaultStallAfter, -1))
			st, err := transport.Wait(context.Background(), b, 0, 1, transport.DefaultBackoff)
			require.NoError(t, err)
			assert.Equal(t, transport.Failed, st[0].State, "path %d op %d: a range unregistered in flight", path, op)
			assert.Equal(t, -1, p.local.firstMismatch(8), "path %d op %d: local bytes changed", path, op)
			assert.Equal(t, -1, victim.firstMismatch(6), "path %d op %d: unregistered memory changed", path, op)
		}
	}
}

// testRequestEdges: a zero length completes, even without a buffer, and an
// opcode the engine does not know reads.
func testRequestEdges(t *testing.T, lib string) {
	p := newPair(t, lib, 4096)
	st := transfer(t, p.a, transport.Request{Op: transport.Read, Local: 0, Segment: p.seg, Remote: uint64(p.peer.addr()), Length: 0})
	assert.Equal(t, transport.TaskStatus{State: transport.Completed}, st[0], "zero length")
	rb := newRawBatch(t, p.a, []transport.Request{{Op: 7, Local: p.local.addr(), Segment: p.seg, Remote: uint64(p.peer.addr()), Length: 4096}})
	assert.Equal(t, transport.Completed, rb.waitDone(0), "opcode 7")
	assert.Equal(t, -1, p.local.firstMismatch(1), "opcode 7 read the peer")
}

func testNotify(t *testing.T, lib string) {
	p := newPair(t, lib, 4096)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, p.a.SendNotify(ctx, p.seg, "hello", "world"))
	b := allocate(t, p.a, 1)
	require.NoError(t, b.SubmitWithNotify([]transport.Request{read(p.seg, p.local, p.peer)}, "block", "42 done"))
	st, err := transport.Wait(context.Background(), b, 0, 1, transport.DefaultBackoff)
	require.NoError(t, err)
	require.Equal(t, transport.Completed, st[0].State)
	got, err := p.b.Notifications()
	require.NoError(t, err)
	assert.Equal(t, []Notification{{Name: "hello", Msg: "world"}, {Name: "block", Msg: "42 done"}}, got)
	again, err := p.b.Notifications()
	require.NoError(t, err)
	assert.Empty(t, again, "notifications are delivered once")
	// A batch that fails sends nothing.
	fb := allocate(t, p.a, 1)
	require.NoError(t, fb.SubmitWithNotify([]transport.Request{{Op: transport.Read, Local: p.local.addr(), Segment: p.seg, Remote: uint64(p.peer.addr()) + 4000, Length: 4096}}, "never", "sent"))
	st, err = transport.Wait(context.Background(), fb, 0, 1, transport.DefaultBackoff)
	require.NoError(t, err)
	require.Equal(t, transport.Failed, st[0].State)
	got, err = p.b.Notifications()
	require.NoError(t, err)
	assert.Empty(t, got, "a failed batch notified")
}

// waitMoved waits until the mock has moved at least n bytes on e's behalf:
// a task reports no progress before it ends, as in the real engine.
func waitMoved(t *testing.T, e *Engine, n uint64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		st, err := e.MockStats()
		require.NoError(t, err)
		if st.VMBytes+st.TCPBytes >= n {
			return
		}
		require.True(t, time.Now().Before(deadline), "the mock moved only %d of %d bytes", st.VMBytes+st.TCPBytes, n)
		time.Sleep(time.Millisecond)
	}
}

func testFaultFail(t *testing.T, lib string) {
	const size = 8 << 20
	p := newPair(t, lib, size)
	for _, path := range []Path{PathVM, PathTCP} {
		require.NoError(t, p.a.SetPath(path))
		require.NoError(t, p.a.SetFault(FaultFailAfter, 3<<20))
		clear(p.local)
		st := transfer(t, p.a, read(p.seg, p.local, p.peer))
		assert.Equal(t, transport.TaskStatus{State: transport.Failed}, st[0], "path %d: failed, reporting no bytes", path)
		require.NoError(t, p.a.SetFault(FaultNone, 0))
		st = transfer(t, p.a, read(p.seg, p.local, p.peer))
		assert.Equal(t, transport.Completed, st[0].State, "path %d after the fault", path)
		assert.Equal(t, -1, p.local.firstMismatch(1))
	}
}

func testFaultCorrupt(t *testing.T, lib string) {
	const size = 1 << 20
	p := newPair(t, lib, size)
	for _, path := range []Path{PathVM, PathTCP} {
		require.NoError(t, p.a.SetPath(path))
		require.NoError(t, p.a.SetFault(FaultCorrupt, 2))
		// Corruption is the one fault that reports success: the bridge's
		// checksums must catch it, so the bytes must really differ.
		clear(p.local)
		st := transfer(t, p.a, read(p.seg, p.local, p.peer))
		require.Equal(t, transport.Completed, st[0].State, "path %d read", path)
		assert.Equal(t, 1, countMismatches(p.local, 1), "path %d read: bytes that differ", path)
		p.local.fill(1)
		st = transfer(t, p.a, write(p.seg, p.local, p.peer))
		require.Equal(t, transport.Completed, st[0].State, "path %d write", path)
		assert.Equal(t, 1, countMismatches(p.peer, 1), "path %d write: bytes of the peer that differ", path)
		p.peer.fill(1)
		// The budget was two tasks: the next one is clean.
		st = transfer(t, p.a, read(p.seg, p.local, p.peer))
		require.Equal(t, transport.Completed, st[0].State)
		assert.Zero(t, countMismatches(p.local, 1), "path %d: corruption outlived its budget", path)
	}
}

func countMismatches(b buffer, seed byte) int {
	n := 0
	for i := range b {
		if b[i] != pattern(seed, i) {
			n++
		}
	}
	return n
}

func testFaultDelayTimeout(t *testing.T, lib string) {
	t.Setenv("MOCK_TE_TIMEOUT_MS", "10")
	p := newPair(t, lib, 12<<20) // three 4 MiB slices
	// Each slice waits 50 ms, past the 10 ms task deadline after the first.
	require.NoError(t, p.a.SetFault(FaultDelay, 50000))
	clear(p.local)
	st := transfer(t, p.a, read(p.seg, p.local, p.peer))
	assert.Equal(t, transport.TaskStatus{State: transport.TimedOut}, st[0], "delayed transfer")
	// Within the deadline a delay costs only time.
	small := newPair(t, lib, 4096)
	require.NoError(t, small.a.SetFault(FaultDelay, 1000))
	st = transfer(t, small.a, read(small.seg, small.local, small.peer))
	assert.Equal(t, transport.Completed, st[0].State, "delayed small transfer")
	assert.Equal(t, -1, small.local.firstMismatch(1))
}

func testFaultDropPeer(t *testing.T, lib string) {
	p := newPair(t, lib, 1<<20)
	require.NoError(t, p.a.SetPath(PathTCP))
	// Warm a pooled connection, then have the peer drop everything.
	st := transfer(t, p.a, read(p.seg, p.local, p.peer))
	require.Equal(t, transport.Completed, st[0].State, "warm-up")
	require.NoError(t, p.b.SetFault(FaultDrop, 1))
	clear(p.local)
	for _, r := range []transport.Request{read(p.seg, p.local, p.peer), write(p.seg, p.local, p.peer)} {
		st := transfer(t, p.a, r)
		assert.Equal(t, transport.Failed, st[0].State, "op %d against a dropping peer", r.Op)
	}
	assert.Equal(t, -1, p.peer.firstMismatch(1), "a dropped write reached the peer")
	// The initiator dropping its peers fails on every path.
	require.NoError(t, p.b.SetFault(FaultNone, 0))
	require.NoError(t, p.a.SetFault(FaultDrop, 1))
	for _, path := range []Path{PathVM, PathTCP} {
		require.NoError(t, p.a.SetPath(path))
		st := transfer(t, p.a, read(p.seg, p.local, p.peer))
		assert.Equal(t, transport.Failed, st[0].State, "path %d with dropped peers", path)
	}
	require.NoError(t, p.a.SetFault(FaultNone, 0))
	st = transfer(t, p.a, read(p.seg, p.local, p.peer))
	assert.Equal(t, transport.Completed, st[0].State, "after the drop ended")
	assert.Equal(t, -1, p.local.firstMismatch(1))
}

// testCanAbort: only the mock can abort; the binding says so before any
// transfer depends on it.
func testCanAbort(t *testing.T, lib string) {
	p := newPair(t, lib, 4096)
	b := allocate(t, p.a, 1)
	assert.Equal(t, p.a.IsMock(), transport.CanAbort(p.a), "CanAbort on %s", lib)
	if !p.a.CanAbort() {
		wantCode(t, b.Abort(), status.Unsupported, "abort on the real engine")
	}
}

// testAbort: tasks held before their first byte (a stall) or between slices
// (a delay far past the test's deadline) end Canceled once the batch is
// aborted, and no byte reaches local memory after the abort returned, on
// either data path, even when what held them lets go.
func testAbort(t *testing.T, lib string) {
	for _, path := range []Path{PathVM, PathTCP} {
		for _, fault := range []Fault{FaultStallAfter, FaultDelay} {
			p := newPair(t, lib, 12<<20) // three slices
			require.NoError(t, p.a.SetPath(path))
			arg := int64(0)
			if fault == FaultDelay {
				arg = int64(time.Hour / time.Microsecond)
			}
			require.NoError(t, p.a.SetFault(fault, arg))
			p.local.fill(8)
			b := allocate(t, p.a, 2)
			require.NoError(t, b.Submit([]transport.Request{read(p.seg, p.local[:6<<20], p.peer[:6<<20]), read(p.seg, p.local[6<<20:], p.peer[6<<20:])}))
			require.NoError(t, b.Abort(), "path %d fault %d", path, fault)
			require.NoError(t, p.a.SetFault(FaultNone, 0))
			st, err := transport.Wait(context.Background(), b, 0, 2, transport.DefaultBackoff)
			require.NoError(t, err)
			for i := range st {
				assert.Equal(t, transport.Canceled, st[i].State, "path %d fault %d task %d", path, fault, i)
			}
			assert.Equal(t, -1, p.local.firstMismatch(8), "path %d fault %d: bytes landed after the abort", path, fault)
			require.NoError(t, b.Free())
			wantCode(t, b.Abort(), status.State, "abort after free")
			// The engine goes on serving new batches.
			st = transfer(t, p.a, read(p.seg, p.local, p.peer))
			assert.Equal(t, transport.Completed, st[0].State, "path %d: after an abort", path)
			assert.Equal(t, -1, p.local.firstMismatch(1))
		}
	}
}

func testEPERMFallback(t *testing.T, lib string) {
	const size = 5 << 20
	p := newPair(t, lib, size)
	require.NoError(t, p.a.SetFault(FaultVMEPERM, 1))
	require.NoError(t, p.a.SetPath(PathVM))
	st := transfer(t, p.a, read(p.seg, p.local, p.peer))
	assert.Equal(t, transport.TaskStatus{State: transport.Failed}, st[0], "forced same-host path under EPERM")
	require.NoError(t, p.a.SetPath(PathAuto))
	before, _ := p.a.MockStats()
	clear(p.local)
	st = transfer(t, p.a, read(p.seg, p.local, p.peer))
	after, _ := p.a.MockStats()
	assert.Equal(t, transport.TaskStatus{State: transport.Completed, Transferred: size}, st[0], "fallback read")
	assert.Equal(t, -1, p.local.firstMismatch(1))
	assert.Equal(t, before.VMFallbacks+1, after.VMFallbacks, "fallbacks")
	assert.EqualValues(t, size, after.TCPBytes-before.TCPBytes, "bytes over TCP")
	assert.Equal(t, before.VMBytes, after.VMBytes, "bytes over process_vm")
}
