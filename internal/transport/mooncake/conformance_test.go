//go:build linux && (amd64 || arm64)

package mooncake

import (
	"context"
	"os"
	"strings"
	"testing"
	"unsafe"

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
	if err != nil {
		t.Fatalf("open %s: %v", p.b.LocalSegment(), err)
	}
	p.seg = seg
	return p
}

func testRegistration(t *testing.T, lib string) {
	e := openEngine(t, lib)
	mem := newBuffer(t, 1<<20)
	base := mem.addr()
	if err := e.RegisterMemory(base+4096, 8192, "cpu:0", true); err != nil {
		t.Fatalf("register: %v", err)
	}
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
		if !strings.Contains(err.Error(), "overlaps") {
			t.Errorf("overlap %s: %v does not say why", c.name, err)
		}
	}
	// Adjacent ranges do not overlap.
	for _, r := range []struct {
		addr uintptr
		len  uint64
	}{{base, 4096}, {base + 12288, 4096}} {
		if err := e.RegisterMemory(r.addr, r.len, "*", false); err != nil {
			t.Fatalf("adjacent %#x: %v", r.addr, err)
		}
		if err := e.UnregisterMemory(r.addr); err != nil {
			t.Fatalf("unregister adjacent: %v", err)
		}
	}
	wantCode(t, e.RegisterMemory(base, 0, "cpu:0", true), status.InvalidArg, "zero length")
	wantCode(t, e.RegisterMemory(0, 10, "cpu:0", true), status.InvalidArg, "null address")
	wantCode(t, e.RegisterMemory(base, 10, "", true), status.InvalidArg, "empty location")
	if err := e.UnregisterMemory(base + 4096); err != nil {
		t.Fatalf("unregister: %v", err)
	}
	if err := e.RegisterMemory(base, 1<<20, "cpu:0", true); err != nil {
		t.Fatalf("register after unregister: %v", err)
	}
	if err := e.Close(); status.Of(err) != status.State {
		t.Fatalf("close with a registration left: %v, want a State error", err)
	}
	if err := e.UnregisterMemory(base); err != nil {
		t.Fatalf("unregister: %v", err)
	}
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
	if err := e.RegisterMemoryBatch(regions, "cpu:0"); err != nil {
		t.Fatalf("register batch: %v", err)
	}
	// All or none: one overlap refuses the whole list.
	wantCode(t, e.RegisterMemoryBatch([]Region{{base + 200000, 10}, {base + 9000, 10}}, "cpu:0"), status.InvalidArg, "batch overlapping a region")
	if err := e.RegisterMemory(base+200000, 10, "cpu:0", true); err != nil {
		t.Fatalf("the refused batch left a registration behind: %v", err)
	}
	addrs := []uintptr{base, base + 65536, base + 8192, base + 200000}
	if err := e.UnregisterMemoryBatch(addrs); err != nil {
		t.Fatalf("unregister batch: %v", err)
	}
}

func testSegments(t *testing.T, lib string) {
	e := openEngine(t, lib)
	if seg, err := e.OpenSegment(e.LocalSegment()); err != nil || seg != 0 {
		t.Fatalf("own segment: %d, %v; want the local segment 0", seg, err)
	}
	other := openEngine(t, lib)
	for _, name := range []string{"127.0.0.1:1", "no-port-given", "[::1"} {
		if _, err := e.OpenSegment(name); status.Of(err) != status.Transfer {
			t.Fatalf("open %q: %v, want a Transfer error", name, err)
		}
	}
	wantCode(t, func() error { _, err := e.OpenSegment(""); return err }(), status.InvalidArg, "empty name")
	id, err := e.OpenSegment(other.LocalSegment())
	if err != nil {
		t.Fatalf("open live peer: %v", err)
	}
	again, err := e.OpenSegment(other.LocalSegment())
	if err != nil || again != id {
		t.Fatalf("reopen: %d, %v; want the cached id %d", again, err, id)
	}
	if err := e.CloseSegment(id); err != nil {
		t.Fatalf("close segment: %v", err)
	}
	if err := e.SyncSegmentCache(); err != nil {
		t.Fatalf("sync segment cache: %v", err)
	}
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
			if err := p.a.SetPath(path); err != nil {
				t.Fatal(err)
			}
		}
		before, _ := p.a.MockStats()
		clear(p.local)
		st := transfer(t, p.a, read(p.seg, p.local, p.peer))
		if st[0].State != transport.Completed || st[0].Transferred != size {
			t.Fatalf("path %d read: %+v", path, st[0])
		}
		if i := p.local.firstMismatch(1); i >= 0 {
			t.Fatalf("path %d read: byte %d is %#x, want %#x", path, i, p.local[i], pattern(1, i))
		}
		p.local.fill(2)
		st = transfer(t, p.a, write(p.seg, p.local, p.peer))
		if st[0].State != transport.Completed || st[0].Transferred != size {
			t.Fatalf("path %d write: %+v", path, st[0])
		}
		if i := p.peer.firstMismatch(2); i >= 0 {
			t.Fatalf("path %d write: byte %d is %#x, want %#x", path, i, p.peer[i], pattern(2, i))
		}
		p.peer.fill(1)
		if p.a.IsMock() {
			after, _ := p.a.MockStats()
			vm, tcp := after.VMBytes-before.VMBytes, after.TCPBytes-before.TCPBytes
			if (path == PathVM && (vm != 2*size || tcp != 0)) || (path == PathTCP && (tcp != 2*size || vm != 0)) {
				t.Fatalf("path %d moved %d bytes by process_vm and %d by TCP; want %d on its own path", path, vm, tcp, 2*size)
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
	if err := b.Submit(reqs[:n/2]); err != nil {
		t.Fatal(err)
	}
	if err := b.Submit(reqs[n/2:]); err != nil {
		t.Fatal(err)
	}
	if b.Tasks() != n {
		t.Fatalf("tasks = %d, want %d", b.Tasks(), n)
	}
	st, err := transport.Wait(context.Background(), b, 0, n, transport.DefaultBackoff)
	if err != nil {
		t.Fatal(err)
	}
	for i, s := range st {
		if s.State != transport.Completed || s.Transferred != block {
			t.Fatalf("task %d: %+v", i, s)
		}
		for j := 0; j < block; j++ {
			if p.local[i*block+j] != pattern(1, (n-1-i)*block+j) {
				t.Fatalf("task %d byte %d wrong", i, j)
			}
		}
	}
}

func testBatchCapacity(t *testing.T, lib string) {
	p := newPair(t, lib, 4096)
	if _, err := p.a.AllocateBatch(0); status.Of(err) != status.InvalidArg {
		t.Fatalf("capacity 0: %v", err)
	}
	b := allocate(t, p.a, 2)
	r := read(p.seg, p.local, p.peer)
	wantCode(t, b.Submit([]transport.Request{r, r, r}), status.InvalidArg, "three requests in a batch of two")
	if err := b.Submit([]transport.Request{r}); err != nil {
		t.Fatal(err)
	}
	wantCode(t, b.Submit([]transport.Request{r, r}), status.InvalidArg, "capacity counts earlier submissions")
	// The engine enforces the limit too: past the binding's own check, the
	// raw call must fail with TooManyRequests (code 2).
	creq := []cRequest{{opcode: 0, source: r.Local, targetID: int32(r.Segment), targetOffset: r.Remote, length: r.Length}}
	creq = append(creq, creq[0])
	err := p.a.use("submitTransfer", func(h uintptr) error {
		_, err := p.a.lib.call("submitTransfer", p.a.lib.sym.submitTransfer, statusCode,
			h, uintptr(b.id), uintptr(unsafe.Pointer(&creq[0])), uintptr(len(creq)))
		return err
	})
	if err == nil || !strings.Contains(err.Error(), "code 2)") {
		t.Fatalf("raw over-capacity submit: %v, want Transfer Engine code 2", err)
	}
	if _, err := transport.Wait(context.Background(), b, 0, b.Tasks(), transport.DefaultBackoff); err != nil {
		t.Fatal(err)
	}
}

func testBatchLifecycle(t *testing.T, lib string) {
	p := newPair(t, lib, 4096)
	tb, err := p.a.AllocateBatch(4)
	if err != nil {
		t.Fatal(err)
	}
	b := tb.(*Batch)
	if err := b.Free(); err != nil {
		t.Fatalf("free an empty batch: %v", err)
	}
	before, _ := p.a.MockStats()
	wantCode(t, b.Free(), status.State, "double free")
	_, err = b.Status(0)
	wantCode(t, err, status.State, "status after free")
	wantCode(t, b.Submit([]transport.Request{read(p.seg, p.local, p.peer)}), status.State, "submit after free")
	if after, _ := p.a.MockStats(); after.InvalidBatchCalls != before.InvalidBatchCalls {
		t.Fatalf("the binding passed a freed batch id to the engine %d times", after.InvalidBatchCalls-before.InvalidBatchCalls)
	}
	b2 := allocate(t, p.a, 1)
	if err := p.a.Close(); status.Of(err) != status.State {
		t.Fatalf("close with a batch allocated: %v, want a State error", err)
	}
	_, err = b2.Status(0)
	wantCode(t, err, status.InvalidArg, "status of a task never submitted")
	if err := b2.Submit([]transport.Request{read(p.seg, p.local, p.peer)}); err != nil {
		t.Fatal(err)
	}
	if _, err := b2.Status(1); status.Of(err) != status.InvalidArg {
		t.Fatalf("status past the last task: %v", err)
	}
}

func testBusyFree(t *testing.T, lib string) {
	p := newPair(t, lib, 8<<20)
	b := allocate(t, p.a, 1)
	if p.a.IsMock() {
		// Hold the transfer mid-way so that it is certainly in flight.
		if err := p.a.SetFault(FaultStallAfter, 1<<20); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.Submit([]transport.Request{read(p.seg, p.local, p.peer)}); err != nil {
		t.Fatal(err)
	}
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
		if err := p.a.SetFault(FaultStallAfter, -1); err != nil {
			t.Fatal(err)
		}
	}
	transport.WaitIdle(b, transport.DefaultBackoff)
	if err := b.Free(); err != nil {
		t.Fatalf("free after completion: %v", err)
	}
}

// waitTransferred polls task until it has moved at least n bytes.
func waitTransferred(t *testing.T, b *Batch, task int, n uint64) transport.TaskStatus {
	t.Helper()
	for {
		st, err := b.Status(task)
		if err != nil {
			t.Fatal(err)
		}
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
		if p.a.IsMock() && b.Tasks() != 0 {
			t.Fatalf("%s: the refused request left %d tasks", c.name, b.Tasks())
		}
	}
	if p.peer.firstMismatch(1) >= 0 || !allZero(private) || !allZero(loose) {
		t.Fatalf("a refused request touched memory")
	}
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
	if err := p.a.SendNotify(p.seg, "hello", "world"); err != nil {
		t.Fatal(err)
	}
	b := allocate(t, p.a, 1)
	if err := b.SubmitWithNotify([]transport.Request{read(p.seg, p.local, p.peer)}, "block", "42 done"); err != nil {
		t.Fatal(err)
	}
	st, err := transport.Wait(context.Background(), b, 0, 1, transport.DefaultBackoff)
	if err != nil || st[0].State != transport.Completed {
		t.Fatalf("notified transfer: %+v %v", st, err)
	}
	got, err := p.b.Notifications()
	if err != nil {
		t.Fatal(err)
	}
	want := []Notification{{"hello", "world"}, {"block", "42 done"}}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("notifications %+v, want %+v", got, want)
	}
	if again, err := p.b.Notifications(); err != nil || len(again) != 0 {
		t.Fatalf("notifications are delivered once: %+v %v", again, err)
	}
}

func testFaultFail(t *testing.T, lib string) {
	const size = 8 << 20
	p := newPair(t, lib, size)
	needMock(t, p.a)
	for _, path := range []Path{PathVM, PathTCP} {
		if err := p.a.SetPath(path); err != nil {
			t.Fatal(err)
		}
		if err := p.a.SetFault(FaultFailAfter, 3<<20); err != nil {
			t.Fatal(err)
		}
		clear(p.local)
		st := transfer(t, p.a, read(p.seg, p.local, p.peer))
		if st[0].State != transport.Failed || st[0].Transferred != 3<<20 {
			t.Fatalf("path %d: %+v, want failed after exactly 3 MiB", path, st[0])
		}
		// Every byte reported as transferred is right.
		if i := p.local[:st[0].Transferred].firstMismatch(1); i >= 0 {
			t.Fatalf("path %d: byte %d of the transferred prefix is wrong", path, i)
		}
		if err := p.a.SetFault(FaultNone, 0); err != nil {
			t.Fatal(err)
		}
		if st := transfer(t, p.a, read(p.seg, p.local, p.peer)); st[0].State != transport.Completed {
			t.Fatalf("path %d after the fault: %+v", path, st[0])
		}
	}
}

func testFaultCorrupt(t *testing.T, lib string) {
	const size = 1 << 20
	p := newPair(t, lib, size)
	needMock(t, p.a)
	for _, path := range []Path{PathVM, PathTCP} {
		if err := p.a.SetPath(path); err != nil {
			t.Fatal(err)
		}
		if err := p.a.SetFault(FaultCorrupt, 2); err != nil {
			t.Fatal(err)
		}
		// Corruption is the one fault that reports success: the bridge's
		// checksums must catch it, so the bytes must really differ.
		clear(p.local)
		st := transfer(t, p.a, read(p.seg, p.local, p.peer))
		if st[0].State != transport.Completed {
			t.Fatalf("path %d read: %+v", path, st[0])
		}
		if diff := countMismatches(p.local, 1); diff != 1 {
			t.Fatalf("path %d read: %d bytes differ, want exactly 1", path, diff)
		}
		p.local.fill(1)
		st = transfer(t, p.a, write(p.seg, p.local, p.peer))
		if st[0].State != transport.Completed {
			t.Fatalf("path %d write: %+v", path, st[0])
		}
		if diff := countMismatches(p.peer, 1); diff != 1 {
			t.Fatalf("path %d write: %d bytes of the peer differ, want exactly 1", path, diff)
		}
		p.peer.fill(1)
		// The budget was two tasks: the next one is clean.
		st = transfer(t, p.a, read(p.seg, p.local, p.peer))
		if st[0].State != transport.Completed || countMismatches(p.local, 1) != 0 {
			t.Fatalf("path %d: corruption outlived its budget", path)
		}
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
	if err := p.a.SetFault(FaultDelay, 50000); err != nil {
		t.Fatal(err)
	}
	clear(p.local)
	st := transfer(t, p.a, read(p.seg, p.local, p.peer))
	if st[0].State != transport.TimedOut || st[0].Transferred >= 12<<20 {
		t.Fatalf("delayed transfer: %+v, want a timeout before the end", st[0])
	}
	if i := p.local[:st[0].Transferred].firstMismatch(1); i >= 0 {
		t.Fatalf("byte %d of the reported prefix is wrong", i)
	}
	// Within the deadline a delay costs only time.
	small := newPair(t, lib, 4096)
	if err := small.a.SetFault(FaultDelay, 1000); err != nil {
		t.Fatal(err)
	}
	if st := transfer(t, small.a, read(small.seg, small.local, small.peer)); st[0].State != transport.Completed || small.local.firstMismatch(1) >= 0 {
		t.Fatalf("delayed small transfer: %+v", st[0])
	}
}

func testFaultDropPeer(t *testing.T, lib string) {
	p := newPair(t, lib, 1<<20)
	needMock(t, p.a)
	if err := p.a.SetPath(PathTCP); err != nil {
		t.Fatal(err)
	}
	// Warm a pooled connection, then have the peer drop everything.
	if st := transfer(t, p.a, read(p.seg, p.local, p.peer)); st[0].State != transport.Completed {
		t.Fatalf("warm-up: %+v", st[0])
	}
	if err := p.b.SetFault(FaultDrop, 1); err != nil {
		t.Fatal(err)
	}
	clear(p.local)
	for _, r := range []transport.Request{read(p.seg, p.local, p.peer), write(p.seg, p.local, p.peer)} {
		if st := transfer(t, p.a, r); st[0].State != transport.Failed {
			t.Fatalf("op %d against a dropping peer: %+v", r.Op, st[0])
		}
	}
	if p.peer.firstMismatch(1) >= 0 {
		t.Fatalf("a dropped write reached the peer")
	}
	// The initiator dropping its peers fails on every path.
	if err := p.b.SetFault(FaultNone, 0); err != nil {
		t.Fatal(err)
	}
	if err := p.a.SetFault(FaultDrop, 1); err != nil {
		t.Fatal(err)
	}
	for _, path := range []Path{PathVM, PathTCP} {
		_ = p.a.SetPath(path)
		if st := transfer(t, p.a, read(p.seg, p.local, p.peer)); st[0].State != transport.Failed {
			t.Fatalf("path %d with dropped peers: %+v", path, st[0])
		}
	}
	if err := p.a.SetFault(FaultNone, 0); err != nil {
		t.Fatal(err)
	}
	if st := transfer(t, p.a, read(p.seg, p.local, p.peer)); st[0].State != transport.Completed || p.local.firstMismatch(1) >= 0 {
		t.Fatalf("after the drop ended: %+v", st[0])
	}
}

func testEPERMFallback(t *testing.T, lib string) {
	const size = 5 << 20
	p := newPair(t, lib, size)
	needMock(t, p.a)
	if err := p.a.SetFault(FaultVMEPERM, 1); err != nil {
		t.Fatal(err)
	}
	if err := p.a.SetPath(PathVM); err != nil {
		t.Fatal(err)
	}
	if st := transfer(t, p.a, read(p.seg, p.local, p.peer)); st[0].State != transport.Failed || st[0].Transferred != 0 {
		t.Fatalf("forced same-host path under EPERM: %+v, want failed", st[0])
	}
	if err := p.a.SetPath(PathAuto); err != nil {
		t.Fatal(err)
	}
	before, _ := p.a.MockStats()
	clear(p.local)
	st := transfer(t, p.a, read(p.seg, p.local, p.peer))
	after, _ := p.a.MockStats()
	if st[0].State != transport.Completed || st[0].Transferred != size || p.local.firstMismatch(1) >= 0 {
		t.Fatalf("fallback read: %+v", st[0])
	}
	if after.VMFallbacks != before.VMFallbacks+1 || after.TCPBytes-before.TCPBytes != size || after.VMBytes != before.VMBytes {
		t.Fatalf("fallback stats %+v -> %+v: want one fallback and every byte over TCP", before, after)
	}
}

func testTwoProcesses(t *testing.T, lib string) {
	const size = 6<<20 + 777
	c := startChild(t, lib, size)
	e := openEngine(t, lib)
	local := newBuffer(t, size)
	register(t, e, local, false)
	seg, err := e.OpenSegment(c.segment)
	if err != nil {
		t.Fatalf("open the child's segment %s: %v", c.segment, err)
	}
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
		if st[0].State != transport.Completed || st[0].Transferred != size {
			t.Fatalf("path %d: %+v", path, st[0])
		}
		if i := local.firstMismatch(childSeed); i >= 0 {
			t.Fatalf("path %d: byte %d is %#x, want %#x", path, i, local[i], pattern(childSeed, i))
		}
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
		if err != nil {
			t.Fatal(err)
		}
		// Stop the transfer at 8 MiB, kill the child there, then let it go on.
		if err := e.SetFault(FaultStallAfter, 8<<20); err != nil {
			t.Fatal(err)
		}
		b := allocate(t, e, 1)
		if err := b.Submit([]transport.Request{{Op: transport.Read, Local: local.addr(), Segment: seg, Remote: c.addr, Length: size}}); err != nil {
			t.Fatal(err)
		}
		if st := waitTransferred(t, b, 0, 8<<20); st.State.Done() {
			t.Fatalf("path %d: the transfer ended before the kill: %+v", path, st)
		}
		if err := c.cmd.Process.Kill(); err != nil {
			t.Fatal(err)
		}
		_ = c.cmd.Wait()
		if err := e.SetFault(FaultStallAfter, -1); err != nil {
			t.Fatal(err)
		}
		st, err := transport.Wait(context.Background(), b, 0, 1, transport.DefaultBackoff)
		if err != nil {
			t.Fatal(err)
		}
		if st[0].State != transport.Failed || st[0].Transferred >= size {
			t.Fatalf("path %d: read from a killed peer ended %+v, want failed", path, st[0])
		}
		if i := local[:st[0].Transferred].firstMismatch(childSeed); i >= 0 {
			t.Fatalf("path %d: byte %d of the reported prefix is wrong", path, i)
		}
		if err := b.Free(); err != nil {
			t.Fatal(err)
		}
		// The engine carries on with a live peer.
		p := newPair(t, lib, 1<<20)
		_ = p.a.SetPath(path)
		if st := transfer(t, p.a, read(p.seg, p.local, p.peer)); st[0].State != transport.Completed || p.local.firstMismatch(1) >= 0 {
			t.Fatalf("path %d after the kill: %+v", path, st[0])
		}
		// A new request to the dead peer fails too, rather than hanging.
		if st := transfer(t, e, transport.Request{Op: transport.Read, Local: local.addr(), Segment: seg, Remote: c.addr, Length: 4096}); st[0].State != transport.Failed {
			t.Fatalf("path %d: read from a dead peer: %+v", path, st[0])
		}
	}
}
