//go:build linux && (amd64 || arm64)

package mooncake

import (
	"context"
	"os"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/transport"
)

// The conformance suite runs the same scenarios against any Transfer Engine
// library: the mock always, a real libtransfer_engine.so when
// $MCB_MOONCAKE_LIB names one. Scenarios that need the mock's fault
// injection skip themselves on a real library.

func TestConformanceMock(t *testing.T) { conformance(t, mockLib) }

func TestConformanceReal(t *testing.T) {
	lib := os.Getenv(EnvLibrary)
	if lib == "" {
		t.Skipf("no real Transfer Engine configured: set %s to a libtransfer_engine.so built with -DBUILD_SHARED_LIBS=ON", EnvLibrary)
	}
	conformance(t, lib)
}

func conformance(t *testing.T, lib string) {
	for _, sc := range []struct {
		name string
		run  func(*testing.T, string)
	}{
		{"Registration", testRegistration},
		{"BatchRegistration", testBatchRegistration},
		{"Segments", testSegments},
		{"ReadWrite", testReadWrite},
		{"ManyTasks", testManyTasks},
		{"BatchCapacity", testBatchCapacity},
		{"BatchLifecycle", testBatchLifecycle},
		{"BusyFree", testBusyFree},
		{"UnregisteredRanges", testUnregisteredRanges},
		{"Notify", testNotify},
		{"FaultFail", testFaultFail},
		{"FaultCorrupt", testFaultCorrupt},
		{"FaultDelayTimeout", testFaultDelayTimeout},
		{"FaultDropPeer", testFaultDropPeer},
		{"SameHostEPERMFallback", testEPERMFallback},
		{"TwoProcesses", testTwoProcesses},
		{"KilledPeer", testKilledPeer},
	} {
		t.Run(sc.name, func(t *testing.T) { sc.run(t, lib) })
	}
}

func needMock(t *testing.T, e *Engine) {
	t.Helper()
	if !e.IsMock() {
		t.Skip("needs the mock's fault injection")
	}
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
	peer  buffer // registered on b, remote-accessible, filled with seed 1
}

func newPair(t testing.TB, lib string, size int) *pair {
	p := &pair{a: openEngine(t, lib), b: openEngine(t, lib)}
	p.local = newBuffer(t, size)
	p.peer = newBuffer(t, size)
	p.peer.fill(1)
	register(t, p.a, p.local, false)
	register(t, p.b, p.peer, true)
	seg, err := p.a.OpenSegment(p.b.LocalSegment())
	require.NoError(t, err, "open %s", p.b.LocalSegment())
	p.seg = seg
	return p
}

func testRegistration(t *testing.T, lib string) {
	e := openEngine(t, lib)
	mem := newBuffer(t, 1<<20)
	base := mem.addr()
	require.NoError(t, e.RegisterMemory(base+4096, 8192, "cpu:0", true), "register")
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
		assert.ErrorContains(t, err, "overlaps", "overlap %s: does not say why", c.name)
	}
	// Adjacent ranges do not overlap.
	for _, r := range []struct {
		addr uintptr
		len  uint64
	}{{base, 4096}, {base + 12288, 4096}} {
		require.NoError(t, e.RegisterMemory(r.addr, r.len, "*", false), "adjacent %#x", r.addr)
		require.NoError(t, e.UnregisterMemory(r.addr), "unregister adjacent")
	}
	wantCode(t, e.RegisterMemory(base, 0, "cpu:0", true), status.InvalidArg, "zero length")
	wantCode(t, e.RegisterMemory(0, 10, "cpu:0", true), status.InvalidArg, "null address")
	wantCode(t, e.RegisterMemory(base, 10, "", true), status.InvalidArg, "empty location")
	require.NoError(t, e.UnregisterMemory(base+4096), "unregister")
	require.NoError(t, e.RegisterMemory(base, 1<<20, "cpu:0", true), "register after unregister")
	err := e.Close()
	require.Equal(t, status.State, status.Of(err), "close with a registration left: %v", err)
	require.NoError(t, e.UnregisterMemory(base), "unregister")
	if e.IsMock() {
		wantCode(t, e.UnregisterMemory(base), status.InvalidArg, "unregister twice")
		wantCode(t, e.RegisterMemory(base, 10, "cuda:0", true), status.Unsupported, "device memory on the mock")
	}
}

func testBatchRegistration(t *testing.T, lib string) {
	e := openEngine(t, lib)
	mem := newBuffer(t, 1<<20)
	base := mem.addr()
	overlapping := []Region{{base, 8192}, {base + 4096, 4096}}
	wantCode(t, e.RegisterMemoryBatch(overlapping, "cpu:0"), status.InvalidArg, "overlapping batch")
	regions := []Region{{base, 4096}, {base + 65536, 4096}, {base + 8192, 8192}}
	require.NoError(t, e.RegisterMemoryBatch(regions, "cpu:0"), "register batch")
	// All or none: one overlap refuses the whole list.
	wantCode(t, e.RegisterMemoryBatch([]Region{{base + 200000, 10}, {base + 9000, 10}}, "cpu:0"), status.InvalidArg, "batch overlapping a region")
	require.NoError(t, e.RegisterMemory(base+200000, 10, "cpu:0", true), "the refused batch left a registration behind")
	addrs := []uintptr{base, base + 65536, base + 8192, base + 200000}
	require.NoError(t, e.UnregisterMemoryBatch(addrs), "unregister batch")
}

func testSegments(t *testing.T, lib string) {
	e := openEngine(t, lib)
	seg, err := e.OpenSegment(e.LocalSegment())
	require.NoError(t, err, "own segment")
	require.Equal(t, transport.SegmentID(0), seg, "own segment: want the local segment 0")
	other := openEngine(t, lib)
	for _, name := range []string{"127.0.0.1:1", "no-port-given", "[::1"} {
		_, err := e.OpenSegment(name)
		require.Equal(t, status.Transfer, status.Of(err), "open %q: %v", name, err)
	}
	wantCode(t, func() error { _, err := e.OpenSegment(""); return err }(), status.InvalidArg, "empty name")
	id, err := e.OpenSegment(other.LocalSegment())
	require.NoError(t, err, "open live peer")
	again, err := e.OpenSegment(other.LocalSegment())
	require.NoError(t, err, "reopen")
	require.Equal(t, id, again, "reopen: want the cached id")
	require.NoError(t, e.CloseSegment(id), "close segment")
	require.NoError(t, e.SyncSegmentCache(), "sync segment cache")
}

func testReadWrite(t *testing.T, lib string) {
	const size = 3<<20 + 12345 // not a multiple of any slice size
	paths := []Path{PathAuto}
	p := newPair(t, lib, size)
	if p.a.IsMock() {
		paths = []Path{PathVM, PathTCP}
	}
	for _, path := range paths {
		if p.a.IsMock() {
			require.NoError(t, p.a.SetPath(path))
		}
		before, _ := p.a.MockStats()
		clear(p.local)
		st := transfer(t, p.a, read(p.seg, p.local, p.peer))
		require.Equal(t, transport.Completed, st[0].State, "path %d read: %+v", path, st[0])
		require.Equal(t, uint64(size), st[0].Transferred, "path %d read: %+v", path, st[0])
		require.Negative(t, p.local.firstMismatch(1), "path %d read: first byte off the pattern", path)
		p.local.fill(2)
		st = transfer(t, p.a, write(p.seg, p.local, p.peer))
		require.Equal(t, transport.Completed, st[0].State, "path %d write: %+v", path, st[0])
		require.Equal(t, uint64(size), st[0].Transferred, "path %d write: %+v", path, st[0])
		require.Negative(t, p.peer.firstMismatch(2), "path %d write: first byte off the pattern", path)
		p.peer.fill(1)
		if p.a.IsMock() {
			after, _ := p.a.MockStats()
			vm, tcp := after.VMBytes-before.VMBytes, after.TCPBytes-before.TCPBytes
			if path == PathVM {
				require.Equal(t, uint64(2*size), vm, "path %d: bytes moved by process_vm", path)
				require.Zero(t, tcp, "path %d: bytes moved by TCP", path)
			}
			if path == PathTCP {
				require.Equal(t, uint64(2*size), tcp, "path %d: bytes moved by TCP", path)
				require.Zero(t, vm, "path %d: bytes moved by process_vm", path)
			}
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
	require.Equal(t, n, b.Tasks(), "tasks")
	st, err := transport.Wait(context.Background(), b, 0, n, transport.DefaultBackoff)
	require.NoError(t, err)
	for i, s := range st {
		require.Equal(t, transport.Completed, s.State, "task %d: %+v", i, s)
		require.Equal(t, uint64(block), s.Transferred, "task %d: %+v", i, s)
		for j := 0; j < block; j++ {
			if p.local[i*block+j] != pattern(1, (n-1-i)*block+j) {
				require.FailNowf(t, "wrong byte", "task %d byte %d wrong", i, j)
			}
		}
	}
}

func testBatchCapacity(t *testing.T, lib string) {
	p := newPair(t, lib, 4096)
	_, err := p.a.AllocateBatch(0)
	require.Equal(t, status.InvalidArg, status.Of(err), "capacity 0: %v", err)
	b := allocate(t, p.a, 2)
	r := read(p.seg, p.local, p.peer)
	wantCode(t, b.Submit([]transport.Request{r, r, r}), status.InvalidArg, "three requests in a batch of two")
	require.NoError(t, b.Submit([]transport.Request{r}))
	wantCode(t, b.Submit([]transport.Request{r, r}), status.InvalidArg, "capacity counts earlier submissions")
	// The engine enforces the limit too: past the binding's own check, the
	// raw call must fail with TooManyRequests (code 2).
	creq := []cRequest{{opcode: 0, source: r.Local, targetID: int32(r.Segment), targetOffset: r.Remote, length: r.Length}}
	creq = append(creq, creq[0])
	err = p.a.use("submitTransfer", func(h uintptr) error {
		_, err := p.a.lib.call("submitTransfer", p.a.lib.sym.submitTransfer, statusCode,
			h, uintptr(b.id), uintptr(unsafe.Pointer(&creq[0])), uintptr(len(creq)))
		return err
	})
	require.ErrorContains(t, err, "code 2)", "raw over-capacity submit: want Transfer Engine code 2")
	_, err = transport.Wait(context.Background(), b, 0, b.Tasks(), transport.DefaultBackoff)
	require.NoError(t, err)
}

func testBatchLifecycle(t *testing.T, lib string) {
	p := newPair(t, lib, 4096)
	tb, err := p.a.AllocateBatch(4)
	require.NoError(t, err)
	b := tb.(*Batch)
	require.NoError(t, b.Free(), "free an empty batch")
	before, _ := p.a.MockStats()
	wantCode(t, b.Free(), status.State, "double free")
	_, err = b.Status(0)
	wantCode(t, err, status.State, "status after free")
	wantCode(t, b.Submit([]transport.Request{read(p.seg, p.local, p.peer)}), status.State, "submit after free")
	after, _ := p.a.MockStats()
	require.Equal(t, before.InvalidBatchCalls, after.InvalidBatchCalls, "times the binding passed a freed batch id to the engine")
	b2 := allocate(t, p.a, 1)
	err = p.a.Close()
	require.Equal(t, status.State, status.Of(err), "close with a batch allocated: %v", err)
	_, err = b2.Status(0)
	wantCode(t, err, status.InvalidArg, "status of a task never submitted")
	require.NoError(t, b2.Submit([]transport.Request{read(p.seg, p.local, p.peer)}))
	_, err = b2.Status(1)
	require.Equal(t, status.InvalidArg, status.Of(err), "status past the last task: %v", err)
}

func testBusyFree(t *testing.T, lib string) {
	p := newPair(t, lib, 8<<20)
	b := allocate(t, p.a, 1)
	if p.a.IsMock() {
		// Hold the transfer mid-way so that it is certainly in flight.
		require.NoError(t, p.a.SetFault(FaultStallAfter, 1<<20))
	}
	require.NoError(t, b.Submit([]transport.Request{read(p.seg, p.local, p.peer)}))
	wantCode(t, b.Free(), status.State, "free with a task never polled")
	if p.a.IsMock() {
		waitTransferred(t, b, 0, 1<<20)
		wantCode(t, b.Free(), status.State, "free with a task in flight")
		// Past the binding's check the engine refuses too (code 4): the task
		// is not finished.
		err := p.a.use("freeBatchID", func(h uintptr) error {
			_, err := p.a.lib.call("freeBatchID", p.a.lib.sym.freeBatchID, statusCode, h, uintptr(b.id))
			return err
		})
		wantCode(t, err, status.State, "raw freeBatchID of a busy batch")
		require.NoError(t, p.a.SetFault(FaultStallAfter, -1))
	}
	transport.WaitIdle(b, transport.DefaultBackoff)
	require.NoError(t, b.Free(), "free after completion")
}

// waitTransferred polls task until it has moved at least n bytes.
func waitTransferred(t *testing.T, b *Batch, task int, n uint64) transport.TaskStatus {
	t.Helper()
	for {
		st, err := b.Status(task)
		require.NoError(t, err)
		if st.Transferred >= n || st.State.Done() {
			return st
		}
	}
}

func testUnregisteredRanges(t *testing.T, lib string) {
	p := newPair(t, lib, 8192)
	private := newBuffer(t, 8192) // registered on b, not remote-accessible
	register(t, p.b, private, false)
	loose := newBuffer(t, 8192) // registered nowhere
	for _, c := range []struct {
		name string
		req  transport.Request
	}{
		{"local range not registered", transport.Request{Op: transport.Read, Local: loose.addr(), Segment: p.seg, Remote: uint64(p.peer.addr()), Length: 4096}},
		{"local range past the region", transport.Request{Op: transport.Read, Local: p.local.addr() + 4096, Segment: p.seg, Remote: uint64(p.peer.addr()), Length: 8192}},
		{"remote range not registered", transport.Request{Op: transport.Write, Local: p.local.addr(), Segment: p.seg, Remote: uint64(loose.addr()), Length: 4096}},
		{"remote range past the region", transport.Request{Op: transport.Write, Local: p.local.addr(), Segment: p.seg, Remote: uint64(p.peer.addr()) + 8191, Length: 2}},
		{"remote range not remote-accessible", transport.Request{Op: transport.Read, Local: p.local.addr(), Segment: p.seg, Remote: uint64(private.addr()), Length: 4096}},
		{"unknown segment", transport.Request{Op: transport.Read, Local: p.local.addr(), Segment: 999, Remote: uint64(p.peer.addr()), Length: 4096}},
	} {
		b := allocate(t, p.a, 1)
		err := b.Submit([]transport.Request{c.req})
		wantCode(t, err, status.InvalidArg, c.name)
		if p.a.IsMock() {
			require.Zero(t, b.Tasks(), "%s: tasks the refused request left", c.name)
		}
	}
	require.Negative(t, p.peer.firstMismatch(1), "a refused request touched the peer's memory")
	require.True(t, allZero(private), "a refused request touched private memory")
	require.True(t, allZero(loose), "a refused request touched unregistered memory")
}

func allZero(b buffer) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

func testNotify(t *testing.T, lib string) {
	p := newPair(t, lib, 4096)
	if !p.a.Library().Has("genNotifyInEngine") || !p.a.Library().Has("freeNotifsMsgBuf") {
		t.Skip("library predates notifications")
	}
	require.NoError(t, p.a.SendNotify(p.seg, "hello", "world"))
	b := allocate(t, p.a, 1)
	require.NoError(t, b.SubmitWithNotify([]transport.Request{read(p.seg, p.local, p.peer)}, "block", "42 done"))
	st, err := transport.Wait(context.Background(), b, 0, 1, transport.DefaultBackoff)
	require.NoError(t, err, "notified transfer")
	require.Equal(t, transport.Completed, st[0].State, "notified transfer: %+v", st)
	got, err := p.b.Notifications()
	require.NoError(t, err)
	require.Equal(t, []Notification{{"hello", "world"}, {"block", "42 done"}}, got, "notifications")
	again, err := p.b.Notifications()
	require.NoError(t, err, "notifications are delivered once")
	require.Empty(t, again, "notifications are delivered once")
}

func testFaultFail(t *testing.T, lib string) {
	const size = 8 << 20
	p := newPair(t, lib, size)
	needMock(t, p.a)
	for _, path := range []Path{PathVM, PathTCP} {
		require.NoError(t, p.a.SetPath(path))
		require.NoError(t, p.a.SetFault(FaultFailAfter, 3<<20))
		clear(p.local)
		st := transfer(t, p.a, read(p.seg, p.local, p.peer))
		require.Equal(t, transport.Failed, st[0].State, "path %d: %+v", path, st[0])
		require.Equal(t, uint64(3<<20), st[0].Transferred, "path %d: want failed after exactly 3 MiB", path)
		// Every byte reported as transferred is right.
		require.Negative(t, p.local[:st[0].Transferred].firstMismatch(1), "path %d: first wrong byte of the transferred prefix", path)
		require.NoError(t, p.a.SetFault(FaultNone, 0))
		st = transfer(t, p.a, read(p.seg, p.local, p.peer))
		require.Equal(t, transport.Completed, st[0].State, "path %d after the fault: %+v", path, st[0])
	}
}

func testFaultCorrupt(t *testing.T, lib string) {
	const size = 1 << 20
	p := newPair(t, lib, size)
	needMock(t, p.a)
	for _, path := range []Path{PathVM, PathTCP} {
		require.NoError(t, p.a.SetPath(path))
		require.NoError(t, p.a.SetFault(FaultCorrupt, 2))
		// Corruption is the one fault that reports success: the bridge's
		// checksums must catch it, so the bytes must really differ.
		clear(p.local)
		st := transfer(t, p.a, read(p.seg, p.local, p.peer))
		require.Equal(t, transport.Completed, st[0].State, "path %d read: %+v", path, st[0])
		require.Equal(t, 1, countMismatches(p.local, 1), "path %d read: bytes that differ", path)
		p.local.fill(1)
		st = transfer(t, p.a, write(p.seg, p.local, p.peer))
		require.Equal(t, transport.Completed, st[0].State, "path %d write: %+v", path, st[0])
		require.Equal(t, 1, countMismatches(p.peer, 1), "path %d write: bytes of the peer that differ", path)
		p.peer.fill(1)
		// The budget was two tasks: the next one is clean.
		st = transfer(t, p.a, read(p.seg, p.local, p.peer))
		require.Equal(t, transport.Completed, st[0].State, "path %d: %+v", path, st[0])
		require.Zero(t, countMismatches(p.local, 1), "path %d: corruption outlived its budget", path)
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
	needMock(t, p.a)
	// Each slice waits 50 ms, past the 10 ms task deadline after the first.
	require.NoError(t, p.a.SetFault(FaultDelay, 50000))
	clear(p.local)
	st := transfer(t, p.a, read(p.seg, p.local, p.peer))
	require.Equal(t, transport.TimedOut, st[0].State, "delayed transfer: %+v", st[0])
	require.Less(t, st[0].Transferred, uint64(12<<20), "delayed transfer: want a timeout before the end")
	require.Negative(t, p.local[:st[0].Transferred].firstMismatch(1), "first wrong byte of the reported prefix")
	// Within the deadline a delay costs only time.
	small := newPair(t, lib, 4096)
	require.NoError(t, small.a.SetFault(FaultDelay, 1000))
	st = transfer(t, small.a, read(small.seg, small.local, small.peer))
	require.Equal(t, transport.Completed, st[0].State, "delayed small transfer: %+v", st[0])
	require.Negative(t, small.local.firstMismatch(1), "delayed small transfer: first byte off the pattern")
}

func testFaultDropPeer(t *testing.T, lib string) {
	p := newPair(t, lib, 1<<20)
	needMock(t, p.a)
	require.NoError(t, p.a.SetPath(PathTCP))
	// Warm a pooled connection, then have the peer drop everything.
	st := transfer(t, p.a, read(p.seg, p.local, p.peer))
	require.Equal(t, transport.Completed, st[0].State, "warm-up: %+v", st[0])
	require.NoError(t, p.b.SetFault(FaultDrop, 1))
	clear(p.local)
	for _, r := range []transport.Request{read(p.seg, p.local, p.peer), write(p.seg, p.local, p.peer)} {
		st := transfer(t, p.a, r)
		require.Equal(t, transport.Failed, st[0].State, "op %d against a dropping peer: %+v", r.Op, st[0])
	}
	require.Negative(t, p.peer.firstMismatch(1), "a dropped write reached the peer")
	// The initiator dropping its peers fails on every path.
	require.NoError(t, p.b.SetFault(FaultNone, 0))
	require.NoError(t, p.a.SetFault(FaultDrop, 1))
	for _, path := range []Path{PathVM, PathTCP} {
		_ = p.a.SetPath(path)
		st := transfer(t, p.a, read(p.seg, p.local, p.peer))
		require.Equal(t, transport.Failed, st[0].State, "path %d with dropped peers: %+v", path, st[0])
	}
	require.NoError(t, p.a.SetFault(FaultNone, 0))
	st = transfer(t, p.a, read(p.seg, p.local, p.peer))
	require.Equal(t, transport.Completed, st[0].State, "after the drop ended: %+v", st[0])
	require.Negative(t, p.local.firstMismatch(1), "after the drop ended: first byte off the pattern")
}

func testEPERMFallback(t *testing.T, lib string) {
	const size = 5 << 20
	p := newPair(t, lib, size)
	needMock(t, p.a)
	require.NoError(t, p.a.SetFault(FaultVMEPERM, 1))
	require.NoError(t, p.a.SetPath(PathVM))
	forced := transfer(t, p.a, read(p.seg, p.local, p.peer))
	require.Equal(t, transport.Failed, forced[0].State, "forced same-host path under EPERM: %+v", forced[0])
	require.Zero(t, forced[0].Transferred, "forced same-host path under EPERM: %+v", forced[0])
	require.NoError(t, p.a.SetPath(PathAuto))
	before, _ := p.a.MockStats()
	clear(p.local)
	st := transfer(t, p.a, read(p.seg, p.local, p.peer))
	after, _ := p.a.MockStats()
	require.Equal(t, transport.Completed, st[0].State, "fallback read: %+v", st[0])
	require.Equal(t, uint64(size), st[0].Transferred, "fallback read: %+v", st[0])
	require.Negative(t, p.local.firstMismatch(1), "fallback read: first byte off the pattern")
	require.Equal(t, before.VMFallbacks+1, after.VMFallbacks, "fallback stats %+v -> %+v: want one fallback", before, after)
	require.Equal(t, uint64(size), after.TCPBytes-before.TCPBytes, "fallback stats %+v -> %+v: want every byte over TCP", before, after)
	require.Equal(t, before.VMBytes, after.VMBytes, "fallback stats %+v -> %+v: want no byte by process_vm", before, after)
}

func testTwoProcesses(t *testing.T, lib string) {
	const size = 6<<20 + 777
	c := startChild(t, lib, size)
	e := openEngine(t, lib)
	local := newBuffer(t, size)
	register(t, e, local, false)
	seg, err := e.OpenSegment(c.segment)
	require.NoError(t, err, "open the child's segment %s", c.segment)
	paths := []Path{PathAuto}
	if e.IsMock() {
		paths = []Path{PathVM, PathTCP}
	}
	for _, path := range paths {
		if e.IsMock() {
			_ = e.SetPath(path)
		}
		clear(local)
		st := transfer(t, e, transport.Request{Op: transport.Read, Local: local.addr(), Segment: seg, Remote: c.addr, Length: size})
		require.Equal(t, transport.Completed, st[0].State, "path %d: %+v", path, st[0])
		require.Equal(t, uint64(size), st[0].Transferred, "path %d: %+v", path, st[0])
		require.Negative(t, local.firstMismatch(childSeed), "path %d: first byte off the pattern", path)
	}
	c.stop(t)
}

func testKilledPeer(t *testing.T, lib string) {
	const size = 64 << 20
	probe := openEngine(t, lib)
	needMock(t, probe)
	for _, path := range []Path{PathVM, PathTCP} {
		c := startChild(t, lib, size)
		e := openEngine(t, lib)
		_ = e.SetPath(path)
		local := newBuffer(t, size)
		register(t, e, local, false)
		seg, err := e.OpenSegment(c.segment)
		require.NoError(t, err)
		// Stop the transfer at 8 MiB, kill the child there, then let it go on.
		require.NoError(t, e.SetFault(FaultStallAfter, 8<<20))
		b := allocate(t, e, 1)
		require.NoError(t, b.Submit([]transport.Request{{Op: transport.Read, Local: local.addr(), Segment: seg, Remote: c.addr, Length: size}}))
		ws := waitTransferred(t, b, 0, 8<<20)
		require.False(t, ws.State.Done(), "path %d: the transfer ended before the kill: %+v", path, ws)
		require.NoError(t, c.cmd.Process.Kill())
		_ = c.cmd.Wait()
		require.NoError(t, e.SetFault(FaultStallAfter, -1))
		st, err := transport.Wait(context.Background(), b, 0, 1, transport.DefaultBackoff)
		require.NoError(t, err)
		require.Equal(t, transport.Failed, st[0].State, "path %d: read from a killed peer ended %+v", path, st[0])
		require.Less(t, st[0].Transferred, uint64(size), "path %d: read from a killed peer ended %+v", path, st[0])
		require.Negative(t, local[:st[0].Transferred].firstMismatch(childSeed), "path %d: first wrong byte of the reported prefix", path)
		require.NoError(t, b.Free())
		// The engine carries on with a live peer.
		p := newPair(t, lib, 1<<20)
		_ = p.a.SetPath(path)
		st = transfer(t, p.a, read(p.seg, p.local, p.peer))
		require.Equal(t, transport.Completed, st[0].State, "path %d after the kill: %+v", path, st[0])
		require.Negative(t, p.local.firstMismatch(1), "path %d after the kill: first byte off the pattern", path)
		// A new request to the dead peer fails too, rather than hanging.
		st = transfer(t, e, transport.Request{Op: transport.Read, Local: local.addr(), Segment: seg, Remote: c.addr, Length: 4096})
		require.Equal(t, transport.Failed, st[0].State, "path %d: read from a dead peer: %+v", path, st[0])
	}
}
