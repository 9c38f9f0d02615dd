// Package transport moves KV bytes between registered memory regions, in this
// process or in another one, with the semantics of Mooncake Transfer Engine:
// memory is registered before use, peers are named segments addressed by
// virtual address, requests go out in batches and complete only by polling.
//
// Two implementations sit behind Transport: the Mooncake binding (package
// mooncake, loading libtransfer_engine.so or the mock TE through purego) and
// Loopback, an in-process engine with link shaping and fault injection for
// tests and benchmarks.
package transport

import (
	"context"
	"fmt"
	"runtime"
	"time"

	"github.com/mcbridge/mcbridge/internal/status"
)

// Op is a transfer direction, numbered as Mooncake's opcodes.
type Op int32

const (
	Read  Op = 0 // remote -> local
	Write Op = 1 // local -> remote
)

// SegmentID is an opened peer segment, as returned by OpenSegment.
type SegmentID int32

// Request moves Length bytes between local registered memory at Local and
// the target segment's memory at virtual address Remote.
type Request struct {
	Op      Op
	Local   uintptr
	Segment SegmentID
	Remote  uint64
	Length  uint64
}

// State is a task's progress, numbered as Mooncake's TransferStatusEnum.
type State int32

const (
	Waiting   State = 0
	Pending   State = 1
	Invalid   State = 2
	Canceled  State = 3
	Completed State = 4
	TimedOut  State = 5
	Failed    State = 6
)

func (s State) String() string {
	switch s {
	case Waiting:
		return "waiting"
	case Pending:
		return "pending"
	case Invalid:
		return "invalid"
	case Canceled:
		return "canceled"
	case Completed:
		return "completed"
	case TimedOut:
		return "timeout"
	case Failed:
		return "failed"
	}
	return fmt.Sprintf("state(%d)", int32(s))
}

// Done reports whether a task in state s will not change any more.
func (s State) Done() bool { return s >= Invalid }

// TaskStatus is one request's progress.
type TaskStatus struct {
	State       State
	Transferred uint64
}

// Transport is a transfer engine. Implementations are safe for concurrent use.
type Transport interface {
	// LocalSegment is the name peers open to reach this engine's memory.
	LocalSegment() string
	// RegisterMemory makes [addr, addr+length) usable as a local buffer and,
	// when remoteAccessible, readable and writable by peers. location is
	// "cpu:N", "cuda:N" or "*". Overlapping an existing region is refused.
	RegisterMemory(addr uintptr, length uint64, location string, remoteAccessible bool) error
	// UnregisterMemory removes the region that starts at addr.
	UnregisterMemory(addr uintptr) error
	// OpenSegment resolves a peer's segment name.
	OpenSegment(name string) (SegmentID, error)
	// CloseSegment forgets an opened segment.
	CloseSegment(id SegmentID) error
	// AllocateBatch returns a batch that holds at most capacity requests.
	AllocateBatch(capacity int) (Batch, error)
	// Close releases the engine; batches and registrations must be gone.
	Close() error
}

// ContextOpener is a Transport whose OpenSegment can wait on the peer (a
// handshake, a metadata lookup): OpenSegmentContext gives up when ctx ends,
// with status.Timeout, so a hung peer costs a caller at most its deadline.
type ContextOpener interface {
	OpenSegmentContext(ctx context.Context, name string) (SegmentID, error)
}

// Notification is a short message one engine delivered to another.
type Notification struct {
	Name, Msg string
}

// Notifier is an engine that can send peers short messages over the path
// it already has to them (Mooncake's notify). The bridge tells a block's
// holder through it what its readers restored and what failed to verify.
type Notifier interface {
	// SendNotify delivers (name, msg) to the engine behind segment id, or
	// fails; it gives up with status.Timeout when ctx ends first.
	SendNotify(ctx context.Context, id SegmentID, name, msg string) error
	// Notifications returns and forgets the messages peers sent here.
	Notifications() ([]Notification, error)
}

// Batch is a set of requests submitted together and polled per task. A Batch
// owns the engine's batch id: it can be freed once, never used after free.
type Batch interface {
	// Submit appends requests; their task numbers continue from earlier ones.
	Submit(reqs []Request) error
	// Status reports one task's state.
	Status(task int) (TaskStatus, error)
	// Tasks is the number of requests submitted so far.
	Tasks() int
	// Free releases the batch. It fails while a task is still in flight.
	Free() error
}

// Aborter is a batch that may be able to stop its tasks. Memory that a
// transfer targets cannot be reused until the transfer is done with it; a
// task given up at a deadline may still be running, so only an engine that
// can abort lets a caller land transfers in memory it must have back at the
// deadline (the bridge's KV tensors). Mooncake's engine cannot: its TCP
// transport writes whatever arrives, whenever it arrives.
type Aborter interface {
	// Abort stops the batch: once it returns, no task submitted so far
	// reads or writes local memory, and those not yet done end Canceled.
	// It waits only for copies under way, never on a peer. The batch must
	// still be polled to final states before Free. Unsupported unless the
	// batch's engine CanAbort.
	Abort() error
}

// CanAbort reports whether t's batches are Aborters whose Abort works. It
// asks the engine, not a batch, so that a caller knows before it sizes a
// batch for transfers that only a fence makes safe.
func CanAbort(t Transport) bool {
	a, ok := t.(interface{ CanAbort() bool })
	return ok && a.CanAbort()
}

// Backoff is the polling schedule of Wait: Spins polls that only yield the
// processor, then sleeps that start at Min and double to Max.
type Backoff struct {
	Spins    int
	Min, Max time.Duration
}

// DefaultBackoff spins briefly, then sleeps in the kernel (pause) for
// about 60-80 µs between polls. Spinning longer bought latency with a core:
// on two cores, 256 spins of the poller took a third of the processor from
// the same-host engine's copy threads, and BenchmarkPeerRead (mock,
// same-host) moved 3.0-3.5 GB/s against 4.1-4.4 GB/s with 16 spins and
// kernel sleeps. A sleep costs a layer of a restore (a millisecond or more
// here) a few percent at most.
var DefaultBackoff = Backoff{Spins: 16, Min: time.Microsecond, Max: 25 * time.Microsecond}

// Wait polls tasks [first, first+n) of b until each is done or ctx ends, and
// returns their final statuses. A task still running when ctx ends is
// reported as TimedOut; the batch cannot be freed until it finishes, which
// the caller must then wait out with WaitIdle.
func Wait(ctx context.Context, b Batch, first, n int, bo Backoff) ([]TaskStatus, error) {
	out := make([]TaskStatus, n)
	pending := n
	delay := bo.Min
	for round := 0; ; round++ {
		for i := range out {
			if out[i].State.Done() {
				continue
			}
			st, err := b.Status(first + i)
			if err != nil {
				return out, err
			}
			out[i] = st
			if st.State.Done() {
				pending--
			}
		}
		if pending == 0 {
			return out, nil
		}
		if err := ctx.Err(); err != nil {
			for i := range out {
				if !out[i].State.Done() {
					out[i].State = TimedOut
				}
			}
			return out, status.Wrap(status.Timeout, err, "waiting for transfers")
		}
		if round < bo.Spins {
			runtime.Gosched()
			continue
		}
		pause(delay)
		delay = min(max(2*delay, time.Microsecond), bo.Max)
	}
}

// WaitIdle polls every task of b until none is in flight, ignoring ctx: a
// batch whose requests still target memory must not be freed or reused.
func WaitIdle(b Batch, bo Backoff) {
	_, _ = Wait(context.Background(), b, 0, b.Tasks(), bo)
}
