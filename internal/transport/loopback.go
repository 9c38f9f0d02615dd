package transport

import (
	"context"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/mcbridge/mcbridge/internal/mem"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Link shapes Loopback transfers like a network link: each batch's requests
// share the link in submission order, and a request completes Latency after
// submission plus its bytes at Bandwidth. Zero values mean unshaped.
type Link struct {
	Bandwidth float64 // bytes per second; 0 = as fast as memcpy
	Latency   time.Duration
}

// FaultKind names an injected failure.
type FaultKind int

const (
	NoFault   FaultKind = iota
	FailAll             // every request ends Failed with nothing moved
	FailAfter           // the link dies after Arg bytes: later requests fail, the straddling one is partial
	Corrupt             // requests complete, but one byte of each payload is flipped
	Delay               // every request completes Arg nanoseconds later than shaped
	DropPeer            // the peer is gone: every request to it, new or in flight, ends Failed
)

// Fault configures one injected failure on the engine that serves requests.
type Fault struct {
	Kind FaultKind
	Arg  int64
}

// LoopbackOptions configures NewLoopback.
type LoopbackOptions struct {
	Name string // segment name; must be unique in the process
	Link Link
	Now  func() time.Time // injected clock; time.Now when nil
}

type region struct {
	addr, length uint64
	remote       bool
}

// Loopback is an in-process transfer engine: segments are other Loopback
// engines of this process, addressed by virtual address exactly like
// Mooncake's memory segments, so code under test runs the same request
// sequence it will run against a real engine.
type Loopback struct {
	opts LoopbackOptions

	mu       sync.Mutex
	regions  []region // sorted by addr
	segments map[SegmentID]*Loopback
	nextSeg  SegmentID
	fault    Fault
	moved    int64     // bytes served while a FailAfter fault is armed
	linkFree time.Time // when the shaped link is next idle
	inbox    []Notification
	closed   bool
}

var loopbacks = struct {
	sync.Mutex
	byName map[string]*Loopback
}{byName: map[string]*Loopback{}}

// NewLoopback creates an engine whose segment peers open by opts.Name.
func NewLoopback(opts LoopbackOptions) (*Loopback, error) {
	if opts.Name == "" {
		return nil, status.Errorf(status.InvalidArg, "loopback: empty segment name")
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	l := &Loopback{opts: opts, segments: map[SegmentID]*Loopback{}}
	loopbacks.Lock()
	defer loopbacks.Unlock()
	if _, dup := loopbacks.byName[opts.Name]; dup {
		return nil, status.Errorf(status.InvalidArg, "loopback: segment %q exists", opts.Name)
	}
	loopbacks.byName[opts.Name] = l
	return l, nil
}

func (l *Loopback) LocalSegment() string { return l.opts.Name }

// SetFault arms a fault on requests that this engine serves, as target.
func (l *Loopback) SetFault(f Fault) {
	l.mu.Lock()
	l.fault, l.moved = f, 0
	l.mu.Unlock()
}

func (l *Loopback) RegisterMemory(addr uintptr, length uint64, location string, remoteAccessible bool) error {
	if addr == 0 || length == 0 {
		return status.Errorf(status.InvalidArg, "register: empty range")
	}
	if uint64(addr)+length < uint64(addr) {
		// A wrapping range would slip past the overlap checks below.
		return status.Errorf(status.InvalidArg, "register: [%#x, +%d) wraps the address space", addr, length)
	}
	if err := checkLocation(location); err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	a := uint64(addr)
	i := sort.Search(len(l.regions), func(i int) bool { return l.regions[i].addr >= a })
	if i < len(l.regions) && l.regions[i].addr < a+length ||
		i > 0 && l.regions[i-1].addr+l.regions[i-1].length > a {
		return status.Errorf(status.InvalidArg, "register: [%#x, +%d) overlaps a registered region", a, length)
	}
	l.regions = append(l.regions, region{})
	copy(l.regions[i+1:], l.regions[i:])
	l.regions[i] = region{addr: a, length: length, remote: remoteAccessible}
	return nil
}

func checkLocation(loc string) error {
	if loc == "*" {
		return nil
	}
	// The whole index must be digits: a scanf-style parse also took
	// "cpu:0x" and "cuda:-1", hiding a malformed name from tests.
	for _, prefix := range []string{"cpu:", "cuda:"} {
		if n, ok := strings.CutPrefix(loc, prefix); ok {
			if _, err := strconv.ParseUint(n, 10, 31); err == nil {
				return nil
			}
		}
	}
	return status.Errorf(status.InvalidArg, "register: location %q is not cpu:N, cuda:N or *", loc)
}

func (l *Loopback) UnregisterMemory(addr uintptr) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for i, r := range l.regions {
		if r.addr == uint64(addr) {
			l.regions = append(l.regions[:i], l.regions[i+1:]...)
			return nil
		}
	}
	return status.Errorf(status.InvalidArg, "unregister: %#x is not the start of a registered region", addr)
}

// covers reports whether [a, a+n) lies inside one region (remote-accessible
// when remote is set). The caller holds l.mu.
func (l *Loopback) covers(a, n uint64, remote bool) bool {
	i := sort.Search(len(l.regions), func(i int) bool { return l.regions[i].addr > a }) - 1
	if i < 0 {
		return false
	}
	r := l.regions[i]
	return a-r.addr <= r.length && n <= r.length-(a-r.addr) && (!remote || r.remote)
}

func (l *Loopback) OpenSegment(name string) (SegmentID, error) {
	loopbacks.Lock()
	peer := loopbacks.byName[name]
	loopbacks.Unlock()
	if peer == nil {
		return -1, status.Errorf(status.Transfer, "open segment %q: no such engine", name)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.nextSeg++
	l.segments[l.nextSeg] = peer
	return l.nextSeg, nil
}

func (l *Loopback) CloseSegment(id SegmentID) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.segments[id]; !ok {
		return status.Errorf(status.InvalidArg, "close segment %d: not open", id)
	}
	delete(l.segments, id)
	return nil
}

func (l *Loopback) Close() error {
	loopbacks.Lock()
	defer loopbacks.Unlock()
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return status.Errorf(status.State, "loopback %q: closed twice", l.opts.Name)
	}
	l.closed = true
	delete(loopbacks.byName, l.opts.Name)
	return nil
}

// maxInbox bounds the notifications an engine keeps unread, as a real
// engine's memory would.
const maxInbox = 1 << 12

// SendNotify implements Notifier. A DropPeer or FailAll fault on the
// peer, or a peer gone, fails it.
func (l *Loopback) SendNotify(ctx context.Context, id SegmentID, name, msg string) error {
	if err := ctx.Err(); err != nil {
		return status.Wrap(status.Timeout, err, "notify")
	}
	l.mu.Lock()
	peer := l.segments[id]
	l.mu.Unlock()
	if peer == nil {
		return status.Errorf(status.InvalidArg, "notify: segment %d is not open", id)
	}
	peer.mu.Lock()
	defer peer.mu.Unlock()
	switch {
	case peer.closed || peer.fault.Kind == DropPeer || peer.fault.Kind == FailAll:
		return status.Errorf(status.Transfer, "notify %q: peer unreachable", peer.opts.Name)
	case len(peer.inbox) >= maxInbox:
		return status.Errorf(status.Transfer, "notify %q: %d messages unread", peer.opts.Name, maxInbox)
	}
	peer.inbox = append(peer.inbox, Notification{Name: name, Msg: msg})
	return nil
}

// Notifications implements Notifier.
func (l *Loopback) Notifications() ([]Notification, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := l.inbox
	l.inbox = nil
	return out, nil
}

// CanAbort: the engine copies inside Status, under the batch's lock, so an
// abort that takes the lock fences every copy.
func (l *Loopback) CanAbort() bool { return true }

func (l *Loopback) AllocateBatch(capacity int) (Batch, error) {
	if capacity <= 0 {
		return nil, status.Errorf(status.InvalidArg, "batch capacity %d", capacity)
	}
	return &loopbackBatch{eng: l, capacity: capacity}, nil
}

type loopbackTask struct {
	req     Request
	peer    *Loopback
	due     time.Time
	delayed bool // a Delay fault has pushed due out already
	done    TaskStatus
}

type loopbackBatch struct {
	eng      *Loopback
	mu       sync.Mutex
	capacity int
	tasks    []loopbackTask
	freed    bool
}

var _ Aborter = (*loopbackBatch)(nil)

func (b *loopbackBatch) Abort() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.freed {
		return status.Errorf(status.State, "abort of a freed batch")
	}
	for i := range b.tasks {
		if !b.tasks[i].done.State.Done() {
			b.tasks[i].done = TaskStatus{State: Canceled}
		}
	}
	return nil
}

func (b *loopbackBatch) Tasks() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.tasks)
}

func (b *loopbackBatch) Submit(reqs []Request) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.freed {
		return status.Errorf(status.State, "submit to a freed batch")
	}
	if len(b.tasks)+len(reqs) > b.capacity {
		return status.Errorf(status.InvalidArg, "batch holds %d requests, %d submitted", b.capacity, len(b.tasks)+len(reqs))
	}
	l := b.eng
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.opts.Now()
	tasks := make([]loopbackTask, 0, len(reqs))
	for _, r := range reqs {
		peer := l.segments[r.Segment]
		switch {
		case peer == nil:
			return status.Errorf(status.InvalidArg, "segment %d is not open", r.Segment)
		case r.Op != Read && r.Op != Write:
			return status.Errorf(status.InvalidArg, "opcode %d", r.Op)
		case r.Length == 0:
			return status.Errorf(status.InvalidArg, "empty request")
		case !l.covers(uint64(r.Local), r.Length, false):
			return status.Errorf(status.InvalidArg, "local [%#x, +%d) is not registered", r.Local, r.Length)
		}
		tasks = append(tasks, loopbackTask{req: r, peer: peer})
	}
	// The link serialises requests: a shaped link is busy until the last
	// submitted byte has crossed it, and each request lands Latency later.
	k := l.opts.Link
	cursor := now
	if l.linkFree.After(cursor) {
		cursor = l.linkFree
	}
	for i := range tasks {
		if k.Bandwidth > 0 {
			cursor = cursor.Add(time.Duration(float64(tasks[i].req.Length) / k.Bandwidth * float64(time.Second)))
			tasks[i].due = cursor.Add(k.Latency)
		} else {
			tasks[i].due = now.Add(k.Latency)
		}
	}
	l.linkFree = cursor
	b.tasks = append(b.tasks, tasks...)
	return nil
}

func (b *loopbackBatch) Status(task int) (TaskStatus, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.freed {
		return TaskStatus{}, status.Errorf(status.State, "status of a freed batch")
	}
	if task < 0 || task >= len(b.tasks) {
		return TaskStatus{}, status.Errorf(status.InvalidArg, "task %d of %d", task, len(b.tasks))
	}
	t := &b.tasks[task]
	if t.done.State.Done() {
		return t.done, nil
	}
	now := b.eng.opts.Now()
	if now.Before(t.due) {
		return TaskStatus{State: Pending}, nil
	}
	t.done = t.peer.serve(t, now)
	if !t.done.State.Done() {
		return TaskStatus{State: Pending}, nil
	}
	return t.done, nil
}

// serve moves one task's bytes with the faults armed on this (target)
// engine. A Delay fault pushes each task's due time out once, from its
// shaped due time, and reports Pending until then.
func (p *Loopback) serve(t *loopbackTask, now time.Time) TaskStatus {
	p.mu.Lock()
	defer p.mu.Unlock()
	f := p.fault
	if p.closed || f.Kind == DropPeer || f.Kind == FailAll {
		return TaskStatus{State: Failed}
	}
	if f.Kind == Delay && !t.delayed {
		t.delayed = true
		t.due = t.due.Add(time.Duration(f.Arg))
		if now.Before(t.due) {
			return TaskStatus{State: Pending}
		}
	}
	r := t.req
	if !p.covers(r.Remote, r.Length, true) {
		return TaskStatus{State: Failed}
	}
	n := r.Length
	if f.Kind == FailAfter {
		left := uint64(max(f.Arg-p.moved, 0))
		n = min(n, left)
		p.moved += int64(n)
	}
	local := mem.Bytes(r.Local, int(n))
	remote := mem.Bytes(uintptr(r.Remote), int(n))
	// Streaming stores, as a NIC's DMA writes memory without the CPU's
	// caches reading it first.
	if r.Op == Read {
		mem.Stream(local, remote)
	} else {
		mem.Stream(remote, local)
	}
	if n < r.Length {
		return TaskStatus{State: Failed, Transferred: n}
	}
	if f.Kind == Corrupt {
		dst := local
		if r.Op == Write {
			dst = remote
		}
		dst[len(dst)/2] ^= 0x5a
	}
	return TaskStatus{State: Completed, Transferred: n}
}

func (b *loopbackBatch) Free() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.freed {
		return status.Errorf(status.State, "batch freed twice")
	}
	for i := range b.tasks {
		if !b.tasks[i].done.State.Done() {
			return status.Errorf(status.State, "free of a batch with task %d in flight", i)
		}
	}
	b.freed = true
	return nil
}
