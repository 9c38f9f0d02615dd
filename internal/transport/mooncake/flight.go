//go:build linux && (amd64 || arm64)

package mooncake

import (
	"context"
	"fmt"
	"time"
	"unsafe"

	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/transport"
)

// DefaultPeerTimeout is the deadline of a call that waits on a peer when
// neither the caller nor Config.PeerTimeout gives one: the bridge's default
// transfer timeout.
const DefaultPeerTimeout = 5 * time.Second

// A flight is one library call that may wait on a peer. The real engine
// cannot interrupt one (its handshake with a peer that accepts but does not
// answer blocks for up to a minute), so the call runs on a goroutine of its
// own and callers wait for it only until their deadline: the call stays in
// the air and lands when the library gives up. Callers asking the same thing
// share one flight, so a hung peer holds one thread, not one per caller.
type flight struct {
	done chan struct{}
	r    int32 // the call's result, set before done closes
}

// launch starts f on its own goroutine, or returns the flight already in the
// air under key ("" never shares). f gets the engine's handle and must own
// what it passes to C: its caller may have given up by the time it runs.
// Until f returns the engine is kept: Close leaves destroying it to the last
// flight to land.
func (e *Engine) launch(op, key string, f func(h uintptr) int32) (*flight, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.handle == 0 {
		return nil, status.Errorf(status.BadHandle, "%s: engine is closed", op)
	}
	h := e.handle
	e.stateMu.Lock()
	defer e.stateMu.Unlock()
	if fl := e.flights[key]; key != "" && fl != nil {
		return fl, nil
	}
	fl := &flight{done: make(chan struct{})}
	if key != "" {
		e.flights[key] = fl
	}
	e.away++
	go func() {
		fl.r = f(h)
		e.stateMu.Lock()
		if key != "" && e.flights[key] == fl {
			delete(e.flights, key)
		}
		e.away--
		destroy := e.away == 0 && e.closed
		e.stateMu.Unlock()
		close(fl.done)
		if destroy {
			_, _ = e.lib.call("destroyTransferEngine", e.lib.sym.destroyTransferEngine, plain, h)
		}
	}()
	return fl, nil
}

// wait returns the flight's result, or a status.Timeout error once ctx ends
// first; the flight goes on without this caller.
func (fl *flight) wait(ctx context.Context, what string) (int32, error) {
	select {
	case <-fl.done:
		return fl.r, nil
	case <-ctx.Done():
	}
	select {
	case <-fl.done:
		return fl.r, nil
	default:
		return 0, status.Wrap(status.Timeout, ctx.Err(), what+": no answer from the peer in time (the call goes on inside the Transfer Engine)")
	}
}

// fly launches f and waits for it until ctx ends.
func (e *Engine) fly(ctx context.Context, op, key, what string, f func(h uintptr) int32) (int32, error) {
	if err := ctx.Err(); err != nil {
		return 0, status.Wrap(status.Timeout, err, what)
	}
	fl, err := e.launch(op, key, f)
	if err != nil {
		return 0, err
	}
	return fl.wait(ctx, what)
}

// flightsAway is the number of calls still inside the library.
func (e *Engine) flightsAway() int {
	e.stateMu.Lock()
	defer e.stateMu.Unlock()
	return e.away
}

// OpenSegment implements transport.Transport, with the engine's
// PeerTimeout as its deadline.
func (e *Engine) OpenSegment(name string) (transport.SegmentID, error) {
	ctx, cancel := context.WithTimeout(context.Background(), e.timeout)
	defer cancel()
	return e.OpenSegmentContext(ctx, name)
}

// OpenSegmentContext resolves a peer's segment name, or fails with
// status.Timeout when ctx ends first. A call given up on stays inside the
// library until it gives up itself; another OpenSegment of the same name
// meanwhile waits for that call rather than starting one. The id such a call
// returns late is not lost: the library caches ids by name, so the next
// OpenSegment of the name returns it at once, and ids need no closing
// (CloseSegment changes nothing).
func (e *Engine) OpenSegmentContext(ctx context.Context, name string) (transport.SegmentID, error) {
	if name == "" {
		return 0, status.Errorf(status.InvalidArg, "open segment: empty name")
	}
	cName, err := cString(name)
	if err != nil {
		return 0, err
	}
	what := fmt.Sprintf("open segment %q", name)
	id, err := e.fly(ctx, "openSegment", "open\x00"+name, what, func(h uintptr) int32 {
		r, _ := e.lib.call("openSegment", e.lib.sym.openSegment, plain, h, uintptr(unsafe.Pointer(&cName[0])))
		return int32(r)
	})
	if err != nil {
		return 0, err
	}
	if id < 0 {
		return 0, status.Errorf(status.Transfer, "%s: unknown segment or unreachable peer (Transfer Engine code %d)", what, id)
	}
	return transport.SegmentID(id), nil
}

// CloseSegment implements transport.Transport. Both engines keep the id
// valid afterwards, so closing is only bookkeeping for the caller.
func (e *Engine) CloseSegment(id transport.SegmentID) error {
	return e.use("closeSegment", func(h uintptr) error {
		_, err := e.lib.call("closeSegment", e.lib.sym.closeSegment, negativeCode, h, uintptr(int32(id)))
		return err
	})
}

// SyncSegmentCache refetches the descriptors of every opened segment, which
// asks every peer; it fails with status.Timeout when ctx ends first.
func (e *Engine) SyncSegmentCache(ctx context.Context) error {
	r, err := e.fly(ctx, "syncSegmentCache", "sync", "sync segment cache", func(h uintptr) int32 {
		r, _ := e.lib.call("syncSegmentCache", e.lib.sym.syncSegmentCache, plain, h)
		return int32(r)
	})
	if err == nil && r < 0 {
		err = codeError("syncSegmentCache", negativeCode, r)
	}
	return err
}

// SendNotify delivers (name, msg) to the engine behind segment id, or fails
// with status.Timeout when ctx ends first.
func (e *Engine) SendNotify(ctx context.Context, id transport.SegmentID, name, msg string) error {
	cName, err1 := cString(name)
	cMsg, err2 := cString(msg)
	if err1 != nil || err2 != nil {
		return status.Errorf(status.InvalidArg, "notify: strings must not contain NUL bytes")
	}
	if id < 0 {
		return status.Errorf(status.InvalidArg, "notify: segment %d", id)
	}
	if e.lib.sym.genNotifyInEngine == 0 {
		return status.Errorf(status.Unsupported, "genNotifyInEngine is not exported by %s", e.lib.path)
	}
	r, err := e.fly(ctx, "genNotifyInEngine", "", fmt.Sprintf("notify segment %d", id), func(h uintptr) int32 {
		// notify_msg_t, two pointers, travels by value in two integer
		// registers on both supported ABIs: exactly as two pointer arguments.
		r, _ := e.lib.call("genNotifyInEngine", e.lib.sym.genNotifyInEngine, plain,
			h, uintptr(id), uintptr(unsafe.Pointer(&cName[0])), uintptr(unsafe.Pointer(&cMsg[0])))
		return int32(r)
	})
	if err == nil && r < 0 {
		err = codeError("genNotifyInEngine", negativeCode, r)
	}
	return err
}
