package transport

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

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
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	return l
}

func mapped(t testing.TB, n int) []byte {
	t.Helper()
	b, err := mem.Map(n)
	require.NoError(t, err)
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
	require.NoError(t, p.a.RegisterMemory(mem.Addr(p.local), uint64(size), "cpu:0", false))
	require.NoError(t, p.b.RegisterMemory(mem.Addr(p.remote), uint64(size), "cpu:0", true))
	seg, err := p.a.OpenSegment(p.b.LocalSegment())
	require.NoError(t, err)
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
	require.NoError(t, err)
	require.NoError(t, b.Submit(reqs))
	return b
}

func state(t testing.TB, b Batch, task int) TaskStatus {
	t.Helper()
	st, err := b.Status(task)
	require.NoError(t, err)
	return st
}

func TestNewLoopbackNames(t *testing.T) {
	_, err := NewLoopback(LoopbackOptions{})
	require.Equal(t, status.InvalidArg, status.Of(err), "empty name: %v", err)
	name := t.Name() + "-seg"
	l, err := NewLoopback(LoopbackOptions{Name: name})
	require.NoError(t, err)
	require.Equal(t, name, l.LocalSegment(), "LocalSegment")
	_, err = NewLoopback(LoopbackOptions{Name: name})
	require.Equal(t, status.InvalidArg, status.Of(err), "duplicate name: %v", err)
	require.NoError(t, l.Close())
	err = l.Close()
	require.Equal(t, status.State, status.Of(err), "second Close: %v", err)
	again, err := NewLoopback(LoopbackOptions{Name: name})
	require.NoError(t, err, "the name of a closed engine is not free again")
	_ = again.Close()
}

func TestRegisterMemory(t *testing.T) {
	e := newEngine(t, LoopbackOptions{})
	buf := mapped(t, 1<<16)
	base := mem.Addr(buf)
	reg := func(off, n uint64) error { return e.RegisterMemory(base+uintptr(off), n, "cpu:0", true) }
	require.NoError(t, reg(0x1000, 0x1000))
	require.NoError(t, reg(0x4000, 0x1000))
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
		err := reg(tc.off, tc.n)
		assert.Equal(t, status.InvalidArg, status.Of(err), "%s [%#x, +%#x): %v", tc.name, tc.off, tc.n, err)
	}
	for _, off := range []uint64{0, 0x2000, 0x3000, 0x5000} {
		assert.NoError(t, reg(off, 0x1000), "adjacent region at %#x", off)
	}
	err := e.RegisterMemory(0, 64, "cpu:0", true)
	assert.Equal(t, status.InvalidArg, status.Of(err), "NULL address: %v", err)
	err = e.RegisterMemory(^uintptr(0)-10, 64, "cpu:0", true)
	assert.Equal(t, status.InvalidArg, status.Of(err), "a range that wraps the address space: %v", err)

	err = e.UnregisterMemory(base + 0x1800)
	assert.Equal(t, status.InvalidArg, status.Of(err), "unregistering the middle of a region: %v", err)
	require.NoError(t, e.UnregisterMemory(base+0x1000))
	err = e.UnregisterMemory(base + 0x1000)
	assert.Equal(t, status.InvalidArg, status.Of(err), "unregistering twice: %v", err)
	assert.NoError(t, reg(0x1000, 0x1000), "registering a freed range again")
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
		if tc.ok {
			assert.NoError(t, err, "location %q", tc.loc)
		} else {
			assert.Equal(t, status.InvalidArg, status.Of(err), "location %q: %v", tc.loc, err)
		}
	}
}

func TestSegments(t *testing.T) {
	a := newEngine(t, LoopbackOptions{})
	b := newEngine(t, LoopbackOptions{})
	id, err := a.OpenSegment("no-such-engine")
	require.Equal(t, status.Transfer, status.Of(err), "open unknown: %v", err)
	require.Equal(t, SegmentID(-1), id, "open unknown")
	s1, err := a.OpenSegment(b.LocalSegment())
	require.NoError(t, err)
	s2, err := a.OpenSegment(a.LocalSegment())
	require.NoError(t, err, "open self")
	require.NotEqual(t, s1, s2, "open self: the same segment as b's")
	require.NoError(t, a.CloseSegment(s1))
	err = a.CloseSegment(s1)
	require.Equal(t, status.InvalidArg, status.Of(err), "close twice: %v", err)
	buf := mapped(t, 64)
	require.NoError(t, a.RegisterMemory(mem.Addr(buf), 64, "*", true))
	batch, _ := a.AllocateBatch(1)
	r := Request{Op: Read, Local: mem.Addr(buf), Segment: s1, Remote: uint64(mem.Addr(buf)), Length: 8}
	err = batch.Submit([]Request{r})
	require.Equal(t, status.InvalidArg, status.Of(err), "submit to a closed segment: %v", err)
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
		require.NoError(t, err)
		// A bad request refuses the whole submission: no task is added.
		err = b.Submit([]Request{good, tc.req()})
		assert.Equal(t, status.InvalidArg, status.Of(err), "%s: %v", tc.name, err)
		assert.Zero(t, b.Tasks(), "%s: tasks a refused submit added", tc.name)
	}

	// Remote addresses are checked by the target when it serves: the task fails.
	private := mapped(t, 4096)
	require.NoError(t, p.b.RegisterMemory(mem.Addr(private), 4096, "cpu:0", false))
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
		st := state(t, b, 0)
		assert.Equal(t, Failed, st.State, "%s: %+v", tc.name, st)
		assert.Zero(t, st.Transferred, "%s: bytes moved", tc.name)
		assert.True(t, bytes.Equal(p.local, make([]byte, len(p.local))), "%s: a failed read wrote local memory", tc.name)
	}
}

func TestBatchCapacity(t *testing.T) {
	p := newPair(t, 4096, Link{})
	for _, n := range []int{0, -1} {
		_, err := p.a.AllocateBatch(n)
		assert.Equal(t, status.InvalidArg, status.Of(err), "AllocateBatch(%d): %v", n, err)
	}
	b, err := p.a.AllocateBatch(3)
	require.NoError(t, err)
	require.NoError(t, b.Submit([]Request{p.read(0, 8), p.read(8, 8)}))
	err = b.Submit([]Request{p.read(16, 8), p.read(24, 8)})
	require.Equal(t, status.InvalidArg, status.Of(err), "submitting past the capacity: %v", err)
	require.NoError(t, b.Submit([]Request{p.read(16, 8)}), "filling the batch")
	require.Equal(t, 3, b.Tasks(), "tasks after filling the batch")
	// Task numbers continue across submissions.
	st := state(t, b, 2)
	require.Equal(t, Completed, st.State, "task 2: %+v", st)
	require.Equal(t, p.remote[16:24], p.local[16:24], "task 2's bytes")
	_, err = b.Status(3)
	require.Equal(t, status.InvalidArg, status.Of(err), "status of task 3 of 3: %v", err)
	_, err = b.Status(-1)
	require.Equal(t, status.InvalidArg, status.Of(err), "status of task -1: %v", err)
}

func TestReadWriteMoveTheRightBytes(t *testing.T) {
	p := newPair(t, 8192, Link{})
	b := submit(t, p.a, p.read(100, 1000), p.read(5000, 3))
	for i := 0; i < 2; i++ {
		st := state(t, b, i)
		require.Equal(t, Completed, st.State, "read %d: %+v", i, st)
	}
	require.Equal(t, uint64(1000), state(t, b, 0).Transferred, "bytes read 0 moved")
	want := make([]byte, len(p.local))
	copy(want[100:1100], p.remote[100:1100])
	copy(want[5000:5003], p.remote[5000:5003])
	require.True(t, bytes.Equal(p.local, want), "local memory after two reads differs from the expected bytes")

	pattern(p.local, 99)
	before := append([]byte{}, p.remote...)
	b = submit(t, p.a, p.write(4096, 4096))
	require.Equal(t, TaskStatus{Completed, 4096}, state(t, b, 0), "write")
	copy(before[4096:], p.local[4096:])
	require.True(t, bytes.Equal(p.remote, before), "remote memory after a write differs from the expected bytes")

	// An engine reaches its own memory through its own segment.
	self, err := p.b.OpenSegment(p.b.LocalSegment())
	require.NoError(t, err)
	own := mapped(t, 64)
	require.NoError(t, p.b.RegisterMemory(mem.Addr(own), 64, "cpu:0", false))
	b = submit(t, p.b, Request{Op: Read, Local: mem.Addr(own), Segment: self, Remote: uint64(mem.Addr(p.remote)), Length: 64})
	st := state(t, b, 0)
	require.Equal(t, Completed, st.State, "self read: %+v", st)
	require.Equal(t, p.remote[:64], own, "self read's bytes")
}

func TestShapedLink(t *testing.T) {
	const mb = 1_000_000
	lat := 10 * time.Microsecond
	p := newPair(t, 4*mb, Link{Bandwidth: 1e9, Latency: lat})
	b := submit(t, p.a, p.read(0, mb))
	due := time.Millisecond + lat // 1 MB at 1 GB/s, then the latency
	p.clock.Advance(due - time.Nanosecond)
	st := state(t, b, 0)
	require.Equal(t, Pending, st.State, "1 ns before due: %+v", st)
	require.Zero(t, p.local[mb-1], "last byte 1 ns before due")
	p.clock.Advance(time.Nanosecond)
	require.Equal(t, TaskStatus{Completed, mb}, state(t, b, 0), "at due")
	require.True(t, bytes.Equal(p.local[:mb], p.remote[:mb]), "at due: the read did not deliver the bytes")
	require.NoError(t, b.Free())

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
			require.Equal(t, want, state(t, b, task).State, "at %v request %d", at, i)
		}
	}
	for _, at := range []time.Duration{time.Millisecond, time.Millisecond + lat, 2*time.Millisecond + lat - 1, 2*time.Millisecond + lat, 3*time.Millisecond + lat, 4*time.Millisecond + lat} {
		check(at)
	}

	// An idle link starts the next request from now, not from its last busy time.
	p.clock.Advance(time.Second)
	b3 := submit(t, p.a, p.read(0, mb))
	p.clock.Advance(due)
	st = state(t, b3, 0)
	require.Equal(t, Completed, st.State, "after an idle second: %+v", st)

	// Unshaped, a request completes on its first poll.
	p.a.SetLink(Link{})
	st = state(t, submit(t, p.a, p.read(0, mb)), 0)
	require.Equal(t, Completed, st.State, "unshaped: %+v", st)
}

func TestFaultFailAll(t *testing.T) {
	p := newPair(t, 4096, Link{})
	p.b.SetFault(Fault{Kind: FailAll})
	b := submit(t, p.a, p.read(0, 4096), p.write(0, 64))
	for i := 0; i < 2; i++ {
		require.Equal(t, TaskStatus{Failed, 0}, state(t, b, i), "task %d", i)
	}
	require.True(t, bytes.Equal(p.local, make([]byte, 4096)), "a failed read moved bytes")
	require.Equal(t, byte(1), p.remote[0], "a failed write moved bytes")
	p.b.SetFault(Fault{})
	st := state(t, submit(t, p.a, p.read(0, 4096)), 0)
	require.Equal(t, Completed, st.State, "after clearing the fault: %+v", st)
}

func TestFaultFailAfter(t *testing.T) {
	p := newPair(t, 4096, Link{})
	p.b.SetFault(Fault{Kind: FailAfter, Arg: 1000})
	b := submit(t, p.a, p.read(0, 600), p.read(600, 600), p.read(1200, 600))
	want := []TaskStatus{{Completed, 600}, {Failed, 400}, {Failed, 0}}
	for i, w := range want {
		require.Equal(t, w, state(t, b, i), "task %d", i)
	}
	// Exactly the reported bytes arrived.
	require.True(t, bytes.Equal(p.local[:1000], p.remote[:1000]), "bytes moved differ from the reported counts")
	require.True(t, bytes.Equal(p.local[1000:], make([]byte, 4096-1000)), "bytes moved past the reported counts")
	// Re-arming starts a fresh budget.
	p.b.SetFault(Fault{Kind: FailAfter, Arg: 10})
	require.Equal(t, TaskStatus{Failed, 10}, state(t, submit(t, p.a, p.write(0, 64)), 0), "after re-arming")
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
	require.Equal(t, TaskStatus{Completed, 4096}, state(t, submit(t, p.a, p.read(0, 4096)), 0), "corrupt read")
	require.Equal(t, 1, diff(p.local, p.remote), "bytes a corrupt read changed")
	pattern(p.local, 50)
	st := state(t, submit(t, p.a, p.write(10, 1)), 0)
	require.Equal(t, Completed, st.State, "corrupt write: %+v", st)
	require.NotEqual(t, p.local[10], p.remote[10], "a one-byte corrupt write arrived intact")
	require.Equal(t, byte(9*7+1), p.remote[9], "a corrupt write touched bytes outside its range")
	require.Equal(t, byte(11*7+1), p.remote[11], "a corrupt write touched bytes outside its range")
}

func TestFaultDelay(t *testing.T) {
	p := newPair(t, 4096, Link{Bandwidth: 1e9})
	delay := 5 * time.Millisecond
	p.b.SetFault(Fault{Kind: Delay, Arg: int64(delay)})
	b := submit(t, p.a, p.read(0, 1000), p.read(1000, 1000)) // shaped due at 1 us and 2 us
	// Polling late must not push completion later than shaped + delay.
	p.clock.Advance(3 * time.Millisecond)
	for i := 0; i < 2; i++ {
		st := state(t, b, i)
		require.Equal(t, Pending, st.State, "task %d 3 ms in: %+v", i, st)
	}
	p.clock.Advance(delay + time.Microsecond - 3*time.Millisecond - time.Nanosecond)
	st0, st1 := state(t, b, 0), state(t, b, 1)
	require.Equal(t, Pending, st0.State, "1 ns before the first delayed due: %+v %+v", st0, st1)
	require.Equal(t, Pending, st1.State, "1 ns before the first delayed due: %+v %+v", st0, st1)
	p.clock.Advance(time.Nanosecond)
	st0, st1 = state(t, b, 0), state(t, b, 1)
	require.Equal(t, Completed, st0.State, "at the first delayed due: %+v %+v", st0, st1)
	require.Equal(t, Pending, st1.State, "at the first delayed due: %+v %+v", st0, st1)
	p.clock.Advance(time.Microsecond)
	st := state(t, b, 1)
	require.Equal(t, Completed, st.State, "at the second delayed due: %+v", st)
	require.True(t, bytes.Equal(p.local[:2000], p.remote[:2000]), "at the second delayed due: the reads did not deliver the bytes")
}

func TestFaultDropPeer(t *testing.T) {
	p := newPair(t, 4096, Link{Bandwidth: 1e9})
	inFlight := submit(t, p.a, p.read(0, 4096))
	p.b.SetFault(Fault{Kind: DropPeer})
	after := submit(t, p.a, p.write(0, 64))
	p.clock.Advance(time.Second)
	for name, b := range map[string]Batch{"in flight": inFlight, "submitted after": after} {
		require.Equal(t, TaskStatus{Failed, 0}, state(t, b, 0), name)
	}
	require.True(t, bytes.Equal(p.local, make([]byte, 4096)), "a dropped peer moved bytes")
	require.Equal(t, byte(1), p.remote[0], "a dropped peer moved bytes")
}

func TestPeerClosedInFlight(t *testing.T) {
	p := newPair(t, 4096, Link{Bandwidth: 1e9})
	b := submit(t, p.a, p.read(0, 4096))
	require.NoError(t, p.b.Close())
	p.clock.Advance(time.Second)
	st := state(t, b, 0)
	require.Equal(t, Failed, st.State, "request to a closed peer: %+v", st)
	_, err := p.a.OpenSegment(p.b.LocalSegment())
	require.Equal(t, status.Transfer, status.Of(err), "opening a closed engine: %v", err)
}

func TestFree(t *testing.T) {
	p := newPair(t, 4096, Link{Bandwidth: 1e9})
	b := submit(t, p.a, p.read(0, 4096))
	err := b.Free()
	require.Equal(t, status.State, status.Of(err), "free with a task in flight: %v", err)
	p.clock.Advance(time.Second)
	// Due but never polled is still in flight: only Status completes it.
	err = b.Free()
	require.Equal(t, status.State, status.Of(err), "free before the task was polled: %v", err)
	state(t, b, 0)
	require.NoError(t, b.Free())
	err = b.Free()
	require.Equal(t, status.State, status.Of(err), "second free: %v", err)
	_, err = b.Status(0)
	require.Equal(t, status.State, status.Of(err), "status after free: %v", err)
	err = b.Submit([]Request{p.read(0, 8)})
	require.Equal(t, status.State, status.Of(err), "submit after free: %v", err)
}

func TestWait(t *testing.T) {
	p := newPair(t, 4096, Link{Bandwidth: 1e9})
	b := submit(t, p.a, p.read(0, 1000), p.read(1000, 1000), p.read(2000, 1000))

	// The fake clock never moves: the tasks stay Pending and the deadline ends the wait.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Millisecond)
	defer cancel()
	st, err := Wait(ctx, b, 0, 3, Backoff{Min: time.Microsecond, Max: 50 * time.Microsecond})
	require.Equal(t, status.Timeout, status.Of(err), "Wait past its deadline: %v", err)
	for i, s := range st {
		require.Equal(t, TimedOut, s.State, "task %d after the deadline: %+v", i, s)
	}

	p.clock.Advance(2 * time.Microsecond)
	st, err = Wait(context.Background(), b, 0, 2, DefaultBackoff)
	require.NoError(t, err, "Wait for the first two")
	require.Equal(t, TaskStatus{Completed, 1000}, st[0], "Wait for the first two: task 0")
	require.Equal(t, TaskStatus{Completed, 1000}, st[1], "Wait for the first two: task 1")
	// A finished task is reported even when the context has already ended.
	done, cancelDone := context.WithCancel(context.Background())
	cancelDone()
	st, err = Wait(done, b, 1, 1, DefaultBackoff)
	require.NoError(t, err, "Wait on a done task with a cancelled context")
	require.Equal(t, Completed, st[0].State, "Wait on a done task with a cancelled context: %+v", st)
	_, err = Wait(context.Background(), b, 2, 2, DefaultBackoff)
	require.Equal(t, status.InvalidArg, status.Of(err), "Wait past the last task: %v", err)

	p.clock.Advance(time.Microsecond)
	WaitIdle(b, DefaultBackoff)
	require.NoError(t, b.Free(), "free after WaitIdle")
}

func TestStateString(t *testing.T) {
	for s, want := range map[State]string{Waiting: "waiting", Pending: "pending", Invalid: "invalid", Canceled: "canceled",
		Completed: "completed", TimedOut: "timeout", Failed: "failed", 9: "state(9)"} {
		assert.Equal(t, want, s.String(), "State(%d)", int32(s))
	}
	for s := Waiting; s <= Failed; s++ {
		assert.Equal(t, s >= Invalid, s.Done(), "%v.Done()", s)
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
		require.NoError(t, e.eng.RegisterMemory(mem.Addr(e.buf), n, "cpu:0", true))
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
		assert.NoError(t, err)
	}
	for k := 0; k < 4; k++ {
		o, half := k*n/4, n/8
		require.True(t, bytes.Equal(ma[o:o+half], mb[o:o+half]), "slice %d: reads did not deliver the peer's bytes", k)
		require.True(t, bytes.Equal(mb[o+half:o+2*half], ma[o+half:o+2*half]), "slice %d: reads did not deliver the peer's bytes", k)
	}
}

func benchmarkRead(b *testing.B, size int) {
	p := newPair(b, size, Link{})
	var loopNs, copyNs time.Duration
	b.SetBytes(int64(size))
	for b.Loop() {
		t0 := time.Now()
		bt, err := p.a.AllocateBatch(1)
		require.NoError(b, err)
		require.NoError(b, bt.Submit([]Request{p.read(0, size)}))
		st, err := Wait(context.Background(), bt, 0, 1, DefaultBackoff)
		require.NoError(b, err)
		require.Equal(b, Completed, st[0].State, "%+v", st)
		require.NoError(b, bt.Free())
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
	require.True(b, bytes.Equal(p.local, p.remote), "the read did not deliver the bytes")
	b.ReportMetric(copyNs.Seconds()/loopNs.Seconds(), "x_memcpy")
}

func BenchmarkLoopbackRead(b *testing.B) {
	for _, size := range []int{1 << 20, 16 << 20} {
		b.Run(fmt.Sprintf("%dMiB", size>>20), func(b *testing.B) { benchmarkRead(b, size) })
	}
}

var _ Notifier = (*Loopback)(nil)

// Notifications reach the peer once, in order; a dropped, failing or
// closed peer refuses them, and a full inbox too.
func TestNotify(t *testing.T) {
	p := newPair(t, 64, Link{})
	ctx := context.Background()
	require.NoError(t, p.a.SendNotify(ctx, p.seg, "a", "1"))
	require.NoError(t, p.a.SendNotify(ctx, p.seg, "b", "2"))
	got, err := p.b.Notifications()
	require.NoError(t, err)
	require.Equal(t, []Notification{{Name: "a", Msg: "1"}, {Name: "b", Msg: "2"}}, got)
	got, err = p.b.Notifications()
	require.NoError(t, err)
	require.Empty(t, got, "delivered twice")

	require.Equal(t, status.InvalidArg, status.Of(p.a.SendNotify(ctx, p.seg+100, "x", "")), "unknown segment")
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	require.Equal(t, status.Timeout, status.Of(p.a.SendNotify(cancelled, p.seg, "x", "")), "ended context")
	for range maxInbox {
		require.NoError(t, p.a.SendNotify(ctx, p.seg, "n", ""))
	}
	require.Equal(t, status.Transfer, status.Of(p.a.SendNotify(ctx, p.seg, "n", "")), "full inbox")
	_, _ = p.b.Notifications()
	for _, f := range []FaultKind{DropPeer, FailAll} {
		p.b.SetFault(Fault{Kind: f})
		require.Equal(t, status.Transfer, status.Of(p.a.SendNotify(ctx, p.seg, "x", "")), "fault %d", f)
	}
	p.b.SetFault(Fault{})
	require.NoError(t, p.b.Close())
	require.Equal(t, status.Transfer, status.Of(p.a.SendNotify(ctx, p.seg, "x", "")), "closed peer")
}

// An abort cancels what has not landed, and nothing lands after it, however
// long the batch is polled; what landed before stays.
func TestAbort(t *testing.T) {
	const mb = 1_000_000
	p := newPair(t, 2*mb, Link{Bandwidth: 1e9})
	b := submit(t, p.a, p.read(0, mb), p.read(mb, mb))
	require.True(t, CanAbort(p.a))
	p.clock.Advance(time.Millisecond)
	require.Equal(t, TaskStatus{Completed, mb}, state(t, b, 0), "the first request is due")
	require.NoError(t, b.(Aborter).Abort())
	p.clock.Advance(time.Second)
	require.Equal(t, TaskStatus{Completed, mb}, state(t, b, 0), "a landed task stays completed")
	require.Equal(t, TaskStatus{State: Canceled}, state(t, b, 1), "past its due time")
	require.True(t, bytes.Equal(p.local[:mb], p.remote[:mb]), "the landed bytes")
	require.Equal(t, make([]byte, mb), p.local[mb:], "bytes landed after the abort")
	require.NoError(t, b.Free())
	require.Equal(t, status.State, status.Of(b.(Aborter).Abort()), "abort of a freed batch")
}
