//go:build linux && (amd64 || arm64)

package mooncake

import (
	"context"
	"sync"
	"unsafe"

	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/transport"
)

// Batch owns one engine batch id. The real engine hands a freed batch's
// address out again, so a stale id would name someone else's batch or
// freed memory: every use of the id happens under mu and only while id is
// non-zero, so the id is freed once and never passed to the library after.
type Batch struct {
	e        *Engine
	capacity int

	mu     sync.Mutex
	id     uint64 // 0 once freed
	done   []bool // per task: a final state has been seen
	notify bool   // a notification is pending (see SubmitWithNotify)
	// A poll given up at its deadline and still inside the library; the
	// batch is not touched again until it lands.
	poll     *flight
	pollTask int
	pollSt   *cStatus
}

var (
	_ transport.Batch   = (*Batch)(nil)
	_ transport.Aborter = (*Batch)(nil)
)

// Abort implements transport.Aborter (mock_te_abort_batch). It runs even
// while a poll given up earlier is still inside the library: the mock
// serialises the two under its engine lock.
func (b *Batch) Abort() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.id == 0 {
		return status.Errorf(status.State, "abort: batch already freed")
	}
	return b.e.use("mock_te_abort_batch", func(h uintptr) error {
		_, err := b.e.lib.call("mock_te_abort_batch", b.e.lib.sym.mockAbort, negativeCode, h, uintptr(b.id))
		return err
	})
}

// Submit implements transport.Batch. Neither engine waits on a peer here:
// the mock queues to its workers, and the real TCP transport, with the
// connection pool the binding turns on (see Load), queues to its lanes.
func (b *Batch) Submit(reqs []transport.Request) error {
	return b.submit(reqs, nil)
}

// SubmitWithNotify submits reqs and has the engine deliver (name, msg) to
// the first request's segment once every task of the batch has completed.
// The engine sends it from inside the poll that first sees the batch
// complete, which then waits on that peer; such polls run as flights and
// give up after the engine's PeerTimeout.
func (b *Batch) SubmitWithNotify(reqs []transport.Request, name, msg string) error {
	cName, err1 := cString(name)
	cMsg, err2 := cString(msg)
	if err1 != nil || err2 != nil {
		return status.Errorf(status.InvalidArg, "notify: strings must not contain NUL bytes")
	}
	return b.submit(reqs, &[2][]byte{cName, cMsg})
}

func (b *Batch) submit(reqs []transport.Request, notify *[2][]byte) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.id == 0 {
		return status.Errorf(status.State, "submit: batch already freed")
	}
	if err := b.landed(); err != nil {
		return err
	}
	if len(reqs) == 0 {
		return nil
	}
	if len(b.done)+len(reqs) > b.capacity {
		return status.Errorf(status.InvalidArg, "submit: %d tasks do not fit a batch of capacity %d holding %d", len(reqs), b.capacity, len(b.done))
	}
	cr := make([]cRequest, len(reqs))
	for i, r := range reqs {
		if r.Op != transport.Read && r.Op != transport.Write {
			return status.Errorf(status.InvalidArg, "submit: request %d has op %d", i, r.Op)
		}
		// Both engines complete a zero-length request without touching
		// memory; any other needs a buffer.
		if r.Local == 0 && r.Length > 0 {
			return status.Errorf(status.InvalidArg, "submit: request %d moves [%#x, +%d)", i, r.Local, r.Length)
		}
		cr[i] = cRequest{opcode: int32(r.Op), source: r.Local, targetID: int32(r.Segment), targetOffset: r.Remote, length: r.Length}
	}
	err := b.e.use("submitTransfer", func(h uintptr) error {
		var err error
		if notify == nil {
			_, err = b.e.lib.call("submitTransfer", b.e.lib.sym.submitTransfer, statusCode,
				h, uintptr(b.id), uintptr(unsafe.Pointer(&cr[0])), uintptr(len(cr)))
		} else {
			_, err = b.e.lib.call("submitTransferWithNotify", b.e.lib.sym.submitTransferWithNotify, statusCode,
				h, uintptr(b.id), uintptr(unsafe.Pointer(&cr[0])), uintptr(len(cr)),
				uintptr(unsafe.Pointer(&notify[0][0])), uintptr(unsafe.Pointer(&notify[1][0])))
		}
		if err != nil && status.Of(err) != status.BadHandle && status.Of(err) != status.Unsupported {
			// Some releases add tasks before a later step fails; Free must
			// wait for those too.
			b.adoptTasks(h, len(reqs))
		}
		return err
	})
	if err == nil {
		b.done = append(b.done, make([]bool, len(reqs))...)
		b.notify = b.notify || notify != nil
	}
	return err
}

// adoptTasks counts tasks the engine holds beyond the known ones, by asking
// for their status. Caller holds mu and the engine.
func (b *Batch) adoptTasks(h uintptr, max int) {
	for i := 0; i < max; i++ {
		st := new(cStatus)
		if _, err := b.e.lib.call("getTransferStatus", b.e.lib.sym.getTransferStatus, statusCode,
			h, uintptr(b.id), uintptr(len(b.done)), uintptr(unsafe.Pointer(st))); err != nil {
			return
		}
		b.done = append(b.done, transport.State(st.state).Done())
	}
}

// landed takes in the result of a poll given up earlier, or refuses with
// status.Timeout while it is still inside the library. Caller holds mu.
func (b *Batch) landed() error {
	if b.poll == nil {
		return nil
	}
	select {
	case <-b.poll.done:
	default:
		return status.Errorf(status.Timeout, "a poll of this batch is still inside the Transfer Engine, waiting on the peer its notification goes to")
	}
	if b.poll.r == 0 && transport.State(b.pollSt.state).Done() {
		b.done[b.pollTask] = true
	}
	b.poll, b.pollSt = nil, nil
	return nil
}

// Status implements transport.Batch.
func (b *Batch) Status(task int) (transport.TaskStatus, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.id == 0 {
		return transport.TaskStatus{}, status.Errorf(status.State, "status: batch already freed")
	}
	if err := b.landed(); err != nil {
		return transport.TaskStatus{}, err
	}
	if task < 0 || task >= len(b.done) {
		return transport.TaskStatus{}, status.Errorf(status.InvalidArg, "status: task %d of %d", task, len(b.done))
	}
	st := new(cStatus)
	var err error
	if b.notify {
		err = b.pollAway(task, st)
	} else {
		err = b.e.use("getTransferStatus", func(h uintptr) error {
			_, err := b.e.lib.call("getTransferStatus", b.e.lib.sym.getTransferStatus, statusCode,
				h, uintptr(b.id), uintptr(task), uintptr(unsafe.Pointer(st)))
			return err
		})
	}
	if err != nil {
		return transport.TaskStatus{}, err
	}
	s := transport.State(st.state)
	if s.Done() {
		b.done[task] = true
	}
	return transport.TaskStatus{State: s, Transferred: st.transferred}, nil
}

// pollAway polls as a flight, for a batch whose poll may send its
// notification. A poll that outlives the engine's PeerTimeout is kept, and
// the batch waits for it to land. Caller holds mu.
func (b *Batch) pollAway(task int, st *cStatus) error {
	id := b.id
	ctx, cancel := context.WithTimeout(context.Background(), b.e.timeout)
	defer cancel()
	fl, err := b.e.launch("getTransferStatus", "", func(h uintptr) int32 {
		r, _ := b.e.lib.call("getTransferStatus", b.e.lib.sym.getTransferStatus, plain,
			h, uintptr(id), uintptr(task), uintptr(unsafe.Pointer(st)))
		return int32(r)
	})
	if err != nil {
		return err
	}
	r, err := fl.wait(ctx, "poll of a batch with a notification")
	if err != nil {
		b.poll, b.pollTask, b.pollSt = fl, task, st
		return err
	}
	if r != 0 {
		return codeError("getTransferStatus", statusCode, r)
	}
	return nil
}

// Tasks implements transport.Batch.
func (b *Batch) Tasks() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.done)
}

// Free implements transport.Batch. A task counts as in flight until Status
// has reported a final state for it; the engine applies the same rule.
func (b *Batch) Free() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.id == 0 {
		return status.Errorf(status.State, "free: batch already freed")
	}
	if err := b.landed(); err != nil {
		return err
	}
	for i, d := range b.done {
		if !d {
			return status.Errorf(status.State, "free: task %d is still in flight (poll it to a final state first)", i)
		}
	}
	err := b.e.use("freeBatchID", func(h uintptr) error {
		_, err := b.e.lib.call("freeBatchID", b.e.lib.sym.freeBatchID, statusCode, h, uintptr(b.id))
		return err
	})
	if err != nil {
		return err
	}
	b.id = 0
	b.e.stateMu.Lock()
	b.e.batches--
	b.e.stateMu.Unlock()
	return nil
}
