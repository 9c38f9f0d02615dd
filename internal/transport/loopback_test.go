package transport

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mcbridge/mcbridge/internal/mem"
	"github.com/mcbridge/mcbridge/internal/status"
)

// fakeClock is the injected clock of the shaping tests: time moves only
// when the test says so.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{now: time.Unix(1000, 0)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

var engineSeq atomic.Int64

func newEngine(t testing.TB, opts LoopbackOptions) *Loopback {
	t.Helper()
	if opts.Name == "" {
		opts.Name = fmt.Sprintf("%s-%d", t.Name(), engineSeq.Add(1))
	}
	l, err := NewLoopback(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	return l
}

func mapped(t testing.TB, n int) []byte {
	t.Helper()
	b, err := mem.Map(n)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = mem.Unmap(b) })
	return b
}

func pattern(b []byte, seed byte) {
	for i := range b {
		b[i] = byte(i*7) + seed
	}
}

// pair is an initiator a with local memory and a target b with remote
// memory, b opened from a as seg.
type pair struct {
	a, b          *Loopback
	local, remote []byte
	seg           SegmentID
	clock         *fakeClock
}

func newPair(t testing.TB, size int, link Link) *pair {
	t.Helper()
	p := &pair{clock: newFakeClock()}
	p.a = newEngine(t, LoopbackOptions{Link: link, Now: p.clock.Now})
	p.b = newEngine(t, LoopbackOptions{Now: p.clock.Now})
	p.local, p.remote = mapped(t, size), mapped(t, size)
	pattern(p.remote, 1)
	if err := p.a.RegisterMemory(mem.Addr(p.local), uint64(size), "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	if err := p.b.RegisterMemory(mem.Addr(p.remote), uint64(size), "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	seg, err := p.a.OpenSegment(p.b.LocalSegment())
	if err != nil {
		t.Fatal(err)
	}
	p.seg = seg
	return p
}

func (p *pair) read(off, n int) Request {
	return Request{Op: Read, Local: mem.Addr(p.local) + uintptr(off), Segment: p.seg, Remote: uint64(mem.Addr(p.remote)) + uint64(off), Length: uint64(n)}
}

func (p *pair) write(off, n int) Request {
	r := p.read(off, n)
	r.Op = Write
	return r
}

func submit(t testing.TB, e *Loopback, reqs ...Request) Batch {
	t.Helper()
	b, err := e.AllocateBatch(len(reqs))
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Submit(reqs); err != nil {
		t.Fatal(err)
	}
	return b
}

func state(t testing.TB, b Batch, task int) TaskStatus {
	t.Helper()
	st, err := b.Status(task)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func TestNewLoopbackNames(t *testing.T) {
	if _, err := NewLoopback(LoopbackOptions{}); status.Of(err) != status.InvalidArg {
		t.Fatalf("empty name: %v", err)
	}
	name := t.Name() + "-seg"
	l, err := NewLoopback(LoopbackOptions{Name: name})
	if err != nil {
		t.Fatal(err)
	}
	if l.LocalSegment() != name {
		t.Fatalf("LocalSegment = %q", l.LocalSegment())
	}
	if _, err := NewLoopback(LoopbackOptions{Name: name}); status.Of(err) != status.InvalidArg {
		t.Fatalf("duplicate name: %v", err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); status.Of(err) != status.State {
		t.Fatalf("second Close: %v", err)
	}
	again, err := NewLoopback(LoopbackOptions{Name: name})
	if err != nil {
		t.Fatalf("the name of a closed engine is not free again: %v", err)
	}
	_ = again.Close()
}

func TestRegisterMemory(t *testing.T) {
	e := newEngine(t, LoopbackOptions{})
	buf := mapped(t, 1<<16)
	base := mem.Addr(buf)
	reg := func(off, n uint64) error { return e.RegisterMemory(base+uintptr(off), n, "cpu:0", true) }
	if err := reg(0x1000, 0x1000); err != nil {
		t.Fatal(err)
	}
	if err := reg(0x4000, 0x1000); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		off, n uint64
	}{
		{"same", 0x1000, 0x1000},
		{"inside", 0x1800, 0x10},
		{"over the start", 0x800, 0x900},
		{"over the end", 0x1fff, 0x10},
		{"enclosing", 0, 0x3000},
		{"bridging two", 0x1fff, 0x2002},
		{"empty", 0x8000, 0},
	} {
		if err := reg(tc.off, tc.n); status.Of(err) != status.InvalidArg {
			t.Errorf("%s [%#x, +%#x): %v, want InvalidArg", tc.name, tc.off, tc.n, err)
		}
	}
	for _, off := range []uint64{0, 0x2000, 0x3000, 0x5000} {
		if err := reg(off, 0x1000); err != nil {
			t.Errorf("adjacent region at %#x: %v", off, err)
		}
	}
	if err := e.RegisterMemory(0, 64, "cpu:0", true); status.Of(err) != status.InvalidArg {
		t.Errorf("NULL address: %v", err)
	}
	if err := e.RegisterMemory(^uintptr(0)-10, 64, "cpu:0", true); status.Of(err) != status.InvalidArg {
		t.Errorf("a range that wraps the address space: %v", err)
	}

	if err := e.UnregisterMemory(base + 0x1800); status.Of(err) != status.InvalidArg {
		t.Errorf("unregistering the middle of a region: %v", err)
	}
	if err := e.UnregisterMemory(base + 0x1000); err != nil {
		t.Fatal(err)
	}
	if err := e.UnregisterMemory(base + 0x1000); status.Of(err) != status.InvalidArg {
		t.Errorf("unregistering twice: %v", err)
	}
	if err := reg(0x1000, 0x1000); err != nil {
		t.Errorf("registering a freed range again: %v", err)
	}
}

func TestRegisterLocation(t *testing.T) {
	e := newEngine(t, LoopbackOptions{})
	buf := mapped(t, 4096)
	for i, tc := range []struct {
		loc string
		ok  bool
	}{
		{"cpu:0", true}, {"cpu:12", true}, {"cuda:0", true}, {"cuda:7", true}, {"*", true},
		{"", false}, {"cpu", false}, {"cpu:", false}, {"cuda:", false}, {"gpu:0", false},
		{"cpu:x", false}, {"cpu:0x", false}, {"cuda:-1", false}, {"cpu:+1", false}, {" cpu:0", false}, {"**", false},
	} {
		addr := mem.Addr(buf) + uintptr(i*64)
		err := e.RegisterMemory(addr, 64, tc.loc, false)
		if (err == nil) != tc.ok || err != nil && status.Of(err) != status.InvalidArg {
			t.Errorf("location %q: %v, want ok=%v", tc.loc, err, tc.ok)
		}
	}
}

func TestSegments(t *testing.T) {
	a := newEngine(t, LoopbackOptions{})
	b := newEngine(t, LoopbackOptions{})
	if id, err := a.OpenSegment("no-such-engine"); status.Of(err) != status.Transfer || id != -1 {
		t.Fatalf("open unknown: %d, %v", id, err)
	}
	s1, err := a.OpenSegment(b.LocalSegment())
	if err != nil {
		t.Fatal(err)
	}
	s2, err := a.OpenSegment(a.LocalSegment())
	if err != nil || s1 == s2 {
		t.Fatalf("open self: %d, %v (b is %d)", s2, err, s1)
	}
	if err := a.CloseSegment(s1); err != nil {
		t.Fatal(err)
	}
	if err := a.CloseSegment(s1); status.Of(err) != status.InvalidArg {
		t.Fatalf("close twice: %v", err)
	}
	buf := mapped(t, 64)
	if err := a.RegisterMemory(mem.Addr(buf), 64, "*", true); err != nil {
		t.Fatal(err)
	}
	batch, _ := a.AllocateBatch(1)
	r := Request{Op: Read, Local: mem.Addr(buf), Segment: s1, Remote: uint64(mem.Addr(buf)), Length: 8}
	if err := batch.Submit([]Request{r}); status.Of(err) != status.InvalidArg {
		t.Fatalf("submit to a closed segment: %v", err)
	}
}

func TestSubmitValidation(t *testing.T) {
	p := newPair(t, 4096, Link{})
	good := p.read(0, 64)
	for _, tc := range []struct {
		name string
		req  func() Request
	}{
		{"unopened segment", func() Request { r := good; r.Segment = p.seg + 100; return r }},
		{"opcode", func() Request { r := good; r.Op = 2; return r }},
		{"empty", func() Request { r := good; r.Length = 0; return r }},
		{"local unregistered", func() Request { r := good; r.Local = mem.Addr(p.remote); return r }},
		{"local past the region", func() Request { return p.read(4096-32, 64) }},
	} {
		b, err := p.a.AllocateBatch(4)
		if err != nil {
			t.Fatal(err)
		}
		// A bad request refuses the whole submission: no task is added.
		if err := b.Submit([]Request{good, tc.req()}); status.Of(err) != status.InvalidArg {
			t.Errorf("%s: %v, want InvalidArg", tc.name, err)
		}
		if b.Tasks() != 0 {
			t.Errorf("%s: a refused submit added %d tasks", tc.name, b.Tasks())
		}
	}

	// Remote addresses are checked by the target when it serves: the task fails.
	private := mapped(t, 4096)
	if err := p.b.RegisterMemory(mem.Addr(private), 4096, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		req  Request
	}{
		{"remote not remote-accessible", Request{Op: Read, Local: mem.Addr(p.local), Segment: p.seg, Remote: uint64(mem.Addr(private)), Length: 64}},
		{"remote past the region", p.read(4096-32, 32)},
		{"remote unregistered", Request{Op: Write, Local: mem.Addr(p.local), Segment: p.seg, Remote: uint64(mem.Addr(p.local)), Length: 64}},
	} {
		if tc.name == "remote past the region" {
			tc.req.Remote += 16 // local stays inside, remote runs 16 bytes out
		}
		clear(p.local)
		b := submit(t, p.a, tc.req)
		if st := state(t, b, 0); st.State != Failed || st.Transferred != 0 {
			t.Errorf("%s: %+v, want Failed with nothing moved", tc.name, st)
		}
		if !bytes.Equal(p.local, make([]byte, len(p.local))) {
			t.Errorf("%s: a failed read wrote local memory", tc.name)
		}
	}
}

func TestBatchCapacity(t *testing.T) {
	p := newPair(t, 4096, Link{})
	for _, n := range []int{0, -1} {
		if _, err := p.a.AllocateBatch(n); status.Of(err) != status.InvalidArg {
			t.Errorf("AllocateBatch(%d): %v", n, err)
		}
	}
	b, err := p.a.AllocateBatch(3)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Submit([]Request{p.read(0, 8), p.read(8, 8)}); err != nil {
		t.Fatal(err)
	}
	if err := b.Submit([]Request{p.read(16, 8), p.read(24, 8)}); status.Of(err) != status.InvalidArg {
		t.Fatalf("submitting past the capacity: %v", err)
	}
	if err := b.Submit([]Request{p.read(16, 8)}); err != nil || b.Tasks() != 3 {
		t.Fatalf("filling the batch: %v, %d tasks", err, b.Tasks())
	}
	// Task numbers continue across submissions.
	if st := state(t, b, 2); st.State != Completed || !bytes.Equal(p.local[16:24], p.remote[16:24]) {
		t.Fatalf("task 2: %+v", st)
	}
	if _, err := b.Status(3); status.Of(err) != status.InvalidArg {
		t.Fatalf("status of task 3 of 3: %v", err)
	}
	if _, err := b.Status(-1); status.Of(err) != status.InvalidArg {
		t.Fatalf("status of task -1: %v", err)
	}
}

func TestReadWriteMoveTheRightBytes(t *testing.T) {
	p := newPair(t, 8192, Link{})
	b := submit(t, p.a, p.read(100, 1000), p.read(5000, 3))
	for i := 0; i < 2; i++ {
		if st := state(t, b, i); st.State != Completed {
			t.Fatalf("read %d: %+v", i, st)
		}
	}
	if st := state(t, b, 0); st.Transferred != 1000 {
		t.Fatalf("read 0 moved %d bytes", st.Transferred)
	}
	want := make([]byte, len(p.local))
	copy(want[100:1100], p.remote[100:1100])
	copy(want[5000:5003], p.remote[5000:5003])
	if !bytes.Equal(p.local, want) {
		t.Fatalf("local memory after two reads differs from the expected bytes")
	}

	pattern(p.local, 99)
	before := append([]byte{}, p.remote...)
	b = submit(t, p.a, p.write(4096, 4096))
	if st := state(t, b, 0); st.State != Completed || st.Transferred != 4096 {
		t.Fatalf("write: %+v", st)
	}
	copy(before[4096:], p.local[4096:])
	if !bytes.Equal(p.remote, before) {
		t.Fatalf("remote memory after a write differs from the expected bytes")
	}

	// An engine reaches its own memory through its own segment.
	self, err := p.b.OpenSegment(p.b.LocalSegment())
	if err != nil {
		t.Fatal(err)
	}
	own := mapped(t, 64)
	if err := p.b.RegisterMemory(mem.Addr(own), 64, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	b = submit(t, p.b, Request{Op: Read, Local: mem.Addr(own), Segment: self, Remote: uint64(mem.Addr(p.remote)), Length: 64})
	if st := state(t, b, 0); st.State != Completed || !bytes.Equal(own, p.remote[:64]) {
		t.Fatalf("self read: %+v", st)
	}
}

func TestShapedLink(t *testing.T) {
	const mb = 1_000_000
	lat := 10 * time.Microsecond
	p := newPair(t, 4*mb, Link{Bandwidth: 1e9, Latency: lat})
	b := submit(t, p.a, p.read(0, mb))
	due := time.Millisecond + lat // 1 MB at 1 GB/s, then the latency
	p.clock.Advance(due - time.Nanosecond)
	if st := state(t, b, 0); st.State != Pending || p.local[mb-1] != 0 {
		t.Fatalf("1 ns before due: %+v, last byte %d", st, p.local[mb-1])
	}
	p.clock.Advance(time.Nanosecond)
	if st := state(t, b, 0); st.State != Completed || st.Transferred != mb || !bytes.Equal(p.local[:mb], p.remote[:mb]) {
		t.Fatalf("at due: %+v", st)
	}
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}

	// Requests share the link one after another, across batches too.
	start := p.clock.Now()
	b1 := submit(t, p.a, p.read(0, mb), p.read(mb, mb), p.read(2*mb, mb))
	p.clock.Advance(500 * time.Microsecond)
	b2 := submit(t, p.a, p.read(3*mb, mb))
	dues := []time.Duration{1, 2, 3, 4}
	check := func(at time.Duration) {
		t.Helper()
		p.clock.Advance(start.Add(at).Sub(p.clock.Now()))
		for i, d := range dues {
			b, task := b1, i
			if i == 3 {
				b, task = b2, 0
			}
			want := Pending
			if at >= d*time.Millisecond+lat {
				want = Completed
			}
			if st := state(t, b, task); st.State != want {
				t.Fatalf("at %v request %d is %v, want %v", at, i, st.State, want)
			}
		}
	}
	for _, at := range []time.Duration{time.Millisecond, time.Millisecond + lat, 2*time.Millisecond + lat - 1, 2*time.Millisecond + lat, 3*time.Millisecond + lat, 4*time.Millisecond + lat} {
		check(at)
	}

	// An idle link starts the next request from now, not from its last busy time.
	p.clock.Advance(time.Second)
	b3 := submit(t, p.a, p.read(0, mb))
	p.clock.Advance(due)
	if st := state(t, b3, 0); st.State != Completed {
		t.Fatalf("after an idle second: %+v", st)
	}

	// Unshaped, a request completes on its first poll.
	p.a.SetLink(Link{})
	if st := state(t, submit(t, p.a, p.read(0, mb)), 0); st.State != Completed {
		t.Fatalf("unshaped: %+v", st)
	}
}

func TestFaultFailAll(t *testing.T) {
	p := newPair(t, 4096, Link{})
	p.b.SetFault(Fault{Kind: FailAll})
	b := submit(t, p.a, p.read(0, 4096), p.write(0, 64))
	for i := 0; i < 2; i++ {
		if st := state(t, b, i); st.State != Failed || st.Transferred != 0 {
			t.Fatalf("task %d: %+v", i, st)
		}
	}
	if !bytes.Equal(p.local, make([]byte, 4096)) || p.remote[0] != 1 {
		t.Fatalf("a failed request moved bytes")
	}
	p.b.SetFault(Fault{})
	if st := state(t, submit(t, p.a, p.read(0, 4096)), 0); st.State != Completed {
		t.Fatalf("after clearing the fault: %+v", st)
	}
}

func TestFaultFailAfter(t *testing.T) {
	p := newPair(t, 4096, Link{})
	p.b.SetFault(Fault{Kind: FailAfter, Arg: 1000})
	b := submit(t, p.a, p.read(0, 600), p.read(600, 600), p.read(1200, 600))
	want := []TaskStatus{{Completed, 600}, {Failed, 400}, {Failed, 0}}
	for i, w := range want {
		if st := state(t, b, i); st != w {
			t.Fatalf("task %d: %+v, want %+v", i, st, w)
		}
	}
	// Exactly the reported bytes arrived.
	if !bytes.Equal(p.local[:1000], p.remote[:1000]) || !bytes.Equal(p.local[1000:], make([]byte, 4096-1000)) {
		t.Fatalf("bytes moved differ from the reported counts")
	}
	// Re-arming starts a fresh budget.
	p.b.SetFault(Fault{Kind: FailAfter, Arg: 10})
	if st := state(t, submit(t, p.a, p.write(0, 64)), 0); st != (TaskStatus{Failed, 10}) {
		t.Fatalf("after re-arming: %+v", st)
	}
}

func TestFaultCorrupt(t *testing.T) {
	p := newPair(t, 4096, Link{})
	p.b.SetFault(Fault{Kind: Corrupt})
	diff := func(x, y []byte) int {
		n := 0
		for i := range x {
			if x[i] != y[i] {
				n++
			}
		}
		return n
	}
	if st := state(t, submit(t, p.a, p.read(0, 4096)), 0); st.State != Completed || st.Transferred != 4096 {
		t.Fatalf("corrupt read: %+v", st)
	}
	if n := diff(p.local, p.remote); n != 1 {
		t.Fatalf("corrupt read changed %d bytes, want 1", n)
	}
	pattern(p.local, 50)
	if st := state(t, submit(t, p.a, p.write(10, 1)), 0); st.State != Completed {
		t.Fatalf("corrupt write: %+v", st)
	}
	if p.remote[10] == p.local[10] {
		t.Fatalf("a one-byte corrupt write arrived intact")
	}
	if p.remote[9] != byte(9*7+1) || p.remote[11] != byte(11*7+1) {
		t.Fatalf("a corrupt write touched bytes outside its range")
	}
}

func TestFaultDelay(t *testing.T) {
	p := newPair(t, 4096, Link{Bandwidth: 1e9})
	delay := 5 * time.Millisecond
	p.b.SetFault(Fault{Kind: Delay, Arg: int64(delay)})
	b := submit(t, p.a, p.read(0, 1000), p.read(1000, 1000)) // shaped due at 1 us and 2 us
	// Polling late must not push completion later than shaped + delay.
	p.clock.Advance(3 * time.Millisecond)
	for i := 0; i < 2; i++ {
		if st := state(t, b, i); st.State != Pending {
			t.Fatalf("task %d 3 ms in: %+v", i, st)
		}
	}
	p.clock.Advance(delay + time.Microsecond - 3*time.Millisecond - time.Nanosecond)
	if st0, st1 := state(t, b, 0), state(t, b, 1); st0.State != Pending || st1.State != Pending {
		t.Fatalf("1 ns before the first delayed due: %+v %+v", st0, st1)
	}
	p.clock.Advance(time.Nanosecond)
	if st0, st1 := state(t, b, 0), state(t, b, 1); st0.State != Completed || st1.State != Pending {
		t.Fatalf("at the first delayed due: %+v %+v", st0, st1)
	}
	p.clock.Advance(time.Microsecond)
	if st := state(t, b, 1); st.State != Completed || !bytes.Equal(p.local[:2000], p.remote[:2000]) {
		t.Fatalf("at the second delayed due: %+v", st)
	}
}

func TestFaultDropPeer(t *testing.T) {
	p := newPair(t, 4096, Link{Bandwidth: 1e9})
	inFlight := submit(t, p.a, p.read(0, 4096))
	p.b.SetFault(Fault{Kind: DropPeer})
	after := submit(t, p.a, p.write(0, 64))
	p.clock.Advance(time.Second)
	for name, b := range map[string]Batch{"in flight": inFlight, "submitted after": after} {
		if st := state(t, b, 0); st.State != Failed || st.Transferred != 0 {
			t.Fatalf("%s: %+v", name, st)
		}
	}
	if !bytes.Equal(p.local, make([]byte, 4096)) || p.remote[0] != 1 {
		t.Fatalf("a dropped peer moved bytes")
	}
}

func TestPeerClosedInFlight(t *testing.T) {
	p := newPair(t, 4096, Link{Bandwidth: 1e9})
	b := submit(t, p.a, p.read(0, 4096))
	if err := p.b.Close(); err != nil {
		t.Fatal(err)
	}
	p.clock.Advance(time.Second)
	if st := state(t, b, 0); st.State != Failed {
		t.Fatalf("request to a closed peer: %+v", st)
	}
	if _, err := p.a.OpenSegment(p.b.LocalSegment()); status.Of(err) != status.Transfer {
		t.Fatalf("opening a closed engine: %v", err)
	}
}

func TestFree(t *testing.T) {
	p := newPair(t, 4096, Link{Bandwidth: 1e9})
	b := submit(t, p.a, p.read(0, 4096))
	if err := b.Free(); status.Of(err) != status.State {
		t.Fatalf("free with a task in flight: %v", err)
	}
	p.clock.Advance(time.Second)
	// Due but never polled is still in flight: only Status completes it.
	if err := b.Free(); status.Of(err) != status.State {
		t.Fatalf("free before the task was polled: %v", err)
	}
	state(t, b, 0)
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	if err := b.Free(); status.Of(err) != status.State {
		t.Fatalf("second free: %v", err)
	}
	if _, err := b.Status(0); status.Of(err) != status.State {
		t.Fatalf("status after free: %v", err)
	}
	if err := b.Submit([]Request{p.read(0, 8)}); status.Of(err) != status.State {
		t.Fatalf("submit after free: %v", err)
	}
}

func TestWait(t *testing.T) {
	p := newPair(t, 4096, Link{Bandwidth: 1e9})
	b := submit(t, p.a, p.read(0, 1000), p.read(1000, 1000), p.read(2000, 1000))

	// The fake clock never moves: the tasks stay Pending and the deadline ends the wait.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Millisecond)
	defer cancel()
	st, err := Wait(ctx, b, 0, 3, Backoff{Min: time.Microsecond, Max: 50 * time.Microsecond})
	if status.Of(err) != status.Timeout {
		t.Fatalf("Wait past its deadline: %v, want Timeout", err)
	}
	for i, s := range st {
		if s.State != TimedOut {
			t.Fatalf("task %d after the deadline: %+v", i, s)
		}
	}

	p.clock.Advance(2 * time.Microsecond)
	st, err = Wait(context.Background(), b, 0, 2, DefaultBackoff)
	if err != nil || st[0] != (TaskStatus{Completed, 1000}) || st[1] != (TaskStatus{Completed, 1000}) {
		t.Fatalf("Wait for the first two: %+v, %v", st, err)
	}
	// A finished task is reported even when the context has already ended.
	done, cancelDone := context.WithCancel(context.Background())
	cancelDone()
	if st, err := Wait(done, b, 1, 1, DefaultBackoff); err != nil || st[0].State != Completed {
		t.Fatalf("Wait on a done task with a cancelled context: %+v, %v", st, err)
	}
	if _, err := Wait(context.Background(), b, 2, 2, DefaultBackoff); status.Of(err) != status.InvalidArg {
		t.Fatalf("Wait past the last task: %v", err)
	}

	p.clock.Advance(time.Microsecond)
	WaitIdle(b, DefaultBackoff)
	if err := b.Free(); err != nil {
		t.Fatalf("free after WaitIdle: %v", err)
	}
}

func TestStateString(t *testing.T) {
	for s, want := range map[State]string{Waiting: "waiting", Pending: "pending", Invalid: "invalid", Canceled: "canceled",
		Completed: "completed", TimedOut: "timeout", Failed: "failed", 9: "state(9)"} {
		if s.String() != want {
			t.Errorf("State(%d) = %q, want %q", int32(s), s.String(), want)
		}
	}
	for s := Waiting; s <= Failed; s++ {
		if s.Done() != (s >= Invalid) {
			t.Errorf("%v.Done() = %v", s, s.Done())
		}
	}
}

// Concurrent batches on engines that serve each other; run under -race.
func TestConcurrentBatches(t *testing.T) {
	a := newEngine(t, LoopbackOptions{})
	b := newEngine(t, LoopbackOptions{})
	const n = 1 << 16
	ma, mb := mapped(t, n), mapped(t, n)
	pattern(ma, 3)
	pattern(mb, 4)
	for _, e := range []struct {
		eng *Loopback
		buf []byte
	}{{a, ma}, {b, mb}} {
		if err := e.eng.RegisterMemory(mem.Addr(e.buf), n, "cpu:0", true); err != nil {
			t.Fatal(err)
		}
	}
	sa, _ := a.OpenSegment(b.LocalSegment())
	sb, _ := b.OpenSegment(a.LocalSegment())
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			// Each worker owns one 8 KiB slice: it reads the peer's bytes
			// into its own memory.
			eng, seg, local, remote := a, sa, ma, mb
			if w%2 == 1 {
				eng, seg, local, remote = b, sb, mb, ma
			}
			off := (w / 2) * (n / 4)
			for i := 0; i < 50; i++ {
				bt, err := eng.AllocateBatch(2)
				if err != nil {
					errs <- err
					return
				}
				half := n / 8
				req := func(o int) Request {
					return Request{Op: Read, Local: mem.Addr(local) + uintptr(o), Segment: seg, Remote: uint64(mem.Addr(remote)) + uint64(o), Length: uint64(half)}
				}
				o := off + (w%2)*half
				if err := bt.Submit([]Request{req(o)}); err != nil {
					errs <- err
					return
				}
				st, err := Wait(context.Background(), bt, 0, 1, DefaultBackoff)
				if err != nil || st[0].State != Completed {
					errs <- fmt.Errorf("worker %d: %+v, %v", w, st, err)
					return
				}
				if err := bt.Free(); err != nil {
					errs <- err
					return
				}
			}
		}(w)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for k := 0; k < 4; k++ {
		o, half := k*n/4, n/8
		if !bytes.Equal(ma[o:o+half], mb[o:o+half]) || !bytes.Equal(mb[o+half:o+2*half], ma[o+half:o+2*half]) {
			t.Fatalf("slice %d: reads did not deliver the peer's bytes", k)
		}
	}
}

func benchmarkRead(b *testing.B, size int) {
	p := newPair(b, size, Link{})
	var loopNs, copyNs time.Duration
	b.SetBytes(int64(size))
	for b.Loop() {
		t0 := time.Now()
		bt, err := p.a.AllocateBatch(1)
		if err != nil {
			b.Fatal(err)
		}
		if err := bt.Submit([]Request{p.read(0, size)}); err != nil {
			b.Fatal(err)
		}
		if st, err := Wait(context.Background(), bt, 0, 1, DefaultBackoff); err != nil || st[0].State != Completed {
			b.Fatalf("%+v, %v", st, err)
		}
		if err := bt.Free(); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		// The baseline moves the same bytes between the same buffers,
		// timed apart from StopTimer, which reads the memory statistics.
		b.StopTimer()
		c0 := time.Now()
		copy(p.local, p.remote)
		c1 := time.Now()
		b.StartTimer()
		loopNs += t1.Sub(t0)
		copyNs += c1.Sub(c0)
	}
	if !bytes.Equal(p.local, p.remote) {
		b.Fatal("the read did not deliver the bytes")
	}
	b.ReportMetric(copyNs.Seconds()/loopNs.Seconds(), "x_memcpy")
}

func BenchmarkLoopbackRead(b *testing.B) {
	for _, size := range []int{1 << 20, 16 << 20} {
		b.Run(fmt.Sprintf("%dMiB", size>>20), func(b *testing.B) { benchmarkRead(b, size) })
	}
}
