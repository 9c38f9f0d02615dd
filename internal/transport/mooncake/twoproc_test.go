//go:build linux && (amd64 || arm64)

package mooncake

import (
	"context"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/transport"
)

// The two-process tests run the peer as a child process (this test binary
// run again), on the mock and on the real library.
func TestTwoProcesses(t *testing.T) {
	runScenarios(t, []scenario{
		{name: "Read", run: testTwoProcesses},
		{name: "ReadPaths", mockOnly: "chooses the mock's data path", run: testTwoProcessPaths},
		{name: "KilledPeer", run: testKilledPeer},
		{name: "KilledPeerMidTransfer", mockOnly: "holds a transfer after 8 MiB with the stall fault", run: testKilledMidTransfer},
		{name: "HungPeer", run: testHungPeer},
		{name: "CloseWhileHung", run: testCloseWhileHung},
	})
}

// sameAsReal puts the mock on its TCP path where a test stops the peer:
// the mock's same-host path reads a stopped process's memory, which the
// real TCP transport, and the mock's TCP path, cannot.
func sameAsReal(t *testing.T, e *Engine) {
	t.Helper()
	if e.IsMock() {
		require.NoError(t, e.SetPath(PathTCP))
	}
}

func testTwoProcesses(t *testing.T, lib string) {
	const size = 6<<20 + 777
	c := startChild(t, lib, size)
	e := openEngine(t, lib)
	local := newBuffer(t, size)
	register(t, e, local)
	seg, err := e.OpenSegment(c.segment)
	require.NoError(t, err, "open the child's segment %s", c.segment)
	st := transfer(t, e, transport.Request{Op: transport.Read, Local: local.addr(), Segment: seg, Remote: c.addr, Length: size})
	require.Equal(t, transport.TaskStatus{State: transport.Completed, Transferred: size}, st[0])
	require.Equal(t, -1, local.firstMismatch(childSeed))
	c.stop(t)
}

func testTwoProcessPaths(t *testing.T, lib string) {
	const size = 6<<20 + 777
	c := startChild(t, lib, size)
	e := openEngine(t, lib)
	local := newBuffer(t, size)
	register(t, e, local)
	seg, err := e.OpenSegment(c.segment)
	require.NoError(t, err)
	for _, path := range []Path{PathVM, PathTCP} {
		require.NoError(t, e.SetPath(path))
		before, err := e.MockStats()
		require.NoError(t, err)
		clear(local)
		st := transfer(t, e, transport.Request{Op: transport.Read, Local: local.addr(), Segment: seg, Remote: c.addr, Length: size})
		require.Equal(t, transport.Completed, st[0].State, "path %d", path)
		require.Equal(t, -1, local.firstMismatch(childSeed), "path %d", path)
		after, err := e.MockStats()
		require.NoError(t, err)
		moved := after.TCPBytes - before.TCPBytes
		if path == PathVM {
			moved = after.VMBytes - before.VMBytes
		}
		assert.EqualValues(t, size, moved, "path %d: bytes on its own path", path)
	}
	c.stop(t)
}

// testKilledPeer: the owner dies with 20 reads of 16 MiB in flight (held
// by stopping it first, so that none can have finished): every task ends
// FAILED with nothing reported within a few seconds, nothing lands in the
// local buffer, a new request to the dead segment fails too, the segment
// id stays cached, and the engine carries on with a live peer.
func testKilledPeer(t *testing.T, lib string) {
	const block, n = 16 << 20, 20
	c := startChild(t, lib, block*n)
	e := openEngine(t, lib)
	sameAsReal(t, e)
	local := newBuffer(t, block*n)
	register(t, e, local)
	seg, err := e.OpenSegment(c.segment)
	require.NoError(t, err)
	c.halt(t)
	reqs := make([]transport.Request, n)
	for i := range reqs {
		reqs[i] = transport.Request{Op: transport.Read, Local: local.addr() + uintptr(i*block), Segment: seg, Remote: c.addr + uint64(i*block), Length: block}
	}
	b := allocate(t, e, n)
	require.NoError(t, b.Submit(reqs))
	// Give the requests time to reach the stopped peer's sockets.
	time.Sleep(200 * time.Millisecond)
	killed := time.Now()
	c.kill(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st, err := transport.Wait(ctx, b, 0, n, transport.DefaultBackoff)
	require.NoError(t, err, "tasks to a killed peer must end")
	t.Logf("%d reads to a killed peer ended %v after the kill", n, time.Since(killed))
	assert.Less(t, time.Since(killed), 5*time.Second, "tasks to a killed peer took too long to end")
	for i, s := range st {
		assert.Equal(t, transport.TaskStatus{State: transport.Failed}, s, "task %d", i)
	}
	assert.Equal(t, make([]byte, len(local)), []byte(local), "bytes from a peer that never answered")
	require.NoError(t, b.Free())

	st = transfer(t, e, transport.Request{Op: transport.Read, Local: local.addr(), Segment: seg, Remote: c.addr, Length: 4096})
	assert.Equal(t, transport.Failed, st[0].State, "a new read from the dead peer")
	again, err := e.OpenSegment(c.segment)
	require.NoError(t, err, "the dead peer's id is cached")
	assert.Equal(t, seg, again)

	p := newPair(t, lib, 1<<20)
	st = transfer(t, p.a, read(p.seg, p.local, p.peer))
	assert.Equal(t, transport.Completed, st[0].State, "a live peer after the kill")
	assert.Equal(t, -1, p.local.firstMismatch(1))
}

// testKilledMidTransfer: the owner dies while a task has moved part of its
// bytes; the task fails, on either path, and the engine carries on.
func testKilledMidTransfer(t *testing.T, lib string) {
	const size = 64 << 20
	for _, path := range []Path{PathVM, PathTCP} {
		c := startChild(t, lib, size)
		e := openEngine(t, lib)
		require.NoError(t, e.SetPath(path))
		local := newBuffer(t, size)
		register(t, e, local)
		seg, err := e.OpenSegment(c.segment)
		require.NoError(t, err)
		require.NoError(t, e.SetFault(FaultStallAfter, 8<<20))
		b := allocate(t, e, 1)
		require.NoError(t, b.Submit([]transport.Request{{Op: transport.Read, Local: local.addr(), Segment: seg, Remote: c.addr, Length: size}}))
		waitMoved(t, e, 8<<20)
		c.kill(t)
		require.NoError(t, e.SetFault(FaultStallAfter, -1))
		st, err := transport.Wait(context.Background(), b, 0, 1, transport.DefaultBackoff)
		require.NoError(t, err)
		assert.Equal(t, transport.TaskStatus{State: transport.Failed}, st[0], "path %d: a read from a peer killed mid-transfer", path)
		require.NoError(t, b.Free())
		st = transfer(t, e, transport.Request{Op: transport.Read, Local: local.addr(), Segment: seg, Remote: c.addr, Length: 4096})
		assert.Equal(t, transport.Failed, st[0].State, "path %d: a new read from the dead peer", path)
	}
}

// hungDeadline is the deadline of the hung-peer tests, and hungSlack what
// a loaded two-core machine may add to it.
const (
	hungDeadline = 500 * time.Millisecond
	hungSlack    = 400 * time.Millisecond
)

func openWithTimeout(t *testing.T, lib string, timeout time.Duration) *Engine {
	t.Helper()
	e, err := Open(Config{Library: lib, PeerTimeout: timeout})
	require.NoError(t, err)
	return e
}

// within checks that f failed with status.Timeout after about d.
func within(t *testing.T, d time.Duration, what string, f func() error) {
	t.Helper()
	start := time.Now()
	err := f()
	took := time.Since(start)
	wantCode(t, err, status.Timeout, what)
	assert.GreaterOrEqual(t, took, d-10*time.Millisecond, "%s gave up before its deadline", what)
	assert.Less(t, took, d+hungSlack, "%s overran its deadline", what)
}

// testHungPeer: a peer that is alive but does not answer (SIGSTOP) costs
// each call at most its deadline: openSegment (which the real library
// would block for a minute), the poll of a read from it, and submit, which
// returns at once; meanwhile the engine serves other peers, and once the
// peer resumes everything drains.
func testHungPeer(t *testing.T, lib string) {
	e := openWithTimeout(t, lib, hungDeadline)
	sameAsReal(t, e)
	local := newBuffer(t, 1<<20)
	require.NoError(t, e.RegisterMemory(local.addr(), uint64(len(local)), "cpu:0", true))
	held := startChild(t, lib, 1<<20) // opened, then stopped
	heldSeg, err := e.OpenSegment(held.segment)
	require.NoError(t, err)
	hung := startChild(t, lib, 4096) // stopped before it is ever opened
	held.halt(t)
	hung.halt(t)

	within(t, hungDeadline, "openSegment of a stopped peer", func() error {
		_, err := e.OpenSegment(hung.segment)
		return err
	})
	// A caller with its own, shorter deadline joins the call in the air
	// instead of starting another.
	within(t, 200*time.Millisecond, "openSegment with a caller's deadline", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		_, err := e.OpenSegmentContext(ctx, hung.segment)
		return err
	})
	assert.Equal(t, 1, e.flightsAway(), "calls inside the library")

	tb, err := e.AllocateBatch(1)
	require.NoError(t, err)
	b := tb.(*Batch)
	start := time.Now()
	require.NoError(t, b.Submit([]transport.Request{{Op: transport.Read, Local: local.addr(), Segment: heldSeg, Remote: held.addr, Length: 1 << 20}}))
	assert.Less(t, time.Since(start), hungDeadline, "submit to a stopped peer")
	var st []transport.TaskStatus
	within(t, hungDeadline, "polling a read from a stopped peer", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), hungDeadline)
		defer cancel()
		st, err = transport.Wait(ctx, b, 0, 1, transport.DefaultBackoff)
		return err
	})
	assert.Equal(t, transport.TimedOut, st[0].State)
	wantCode(t, b.Free(), status.State, "free with the read in flight")

	// Other peers are served while the open is stuck inside the library.
	other := startChild(t, lib, 1<<20)
	otherSeg, err := e.OpenSegment(other.segment)
	require.NoError(t, err, "open a live peer while a stopped one holds a call")
	clear(local)
	sts := transfer(t, e, transport.Request{Op: transport.Read, Local: local.addr(), Segment: otherSeg, Remote: other.addr, Length: 1 << 20})
	require.Equal(t, transport.Completed, sts[0].State, "read from a live peer")
	require.Equal(t, -1, local.firstMismatch(childSeed))

	held.signal(t, syscall.SIGCONT)
	hung.signal(t, syscall.SIGCONT)
	st, err = transport.Wait(context.Background(), b, 0, 1, transport.DefaultBackoff)
	require.NoError(t, err)
	assert.Equal(t, transport.Completed, st[0].State, "the read once the peer resumed")
	require.NoError(t, b.Free())
	require.Eventually(t, func() bool { return e.flightsAway() == 0 }, 70*time.Second, 10*time.Millisecond, "the stuck open never came back")
	start = time.Now()
	_, err = e.OpenSegment(hung.segment)
	require.NoError(t, err, "open the resumed peer")
	assert.Less(t, time.Since(start), hungDeadline, "the id that came back late is cached")
	require.NoError(t, e.UnregisterMemory(local.addr()))
	require.NoError(t, e.Close())
}

// testCloseWhileHung: Close does not wait for a call stuck on a hung peer,
// and does not destroy the engine under it: the call, once it lands,
// destroys it.
func testCloseWhileHung(t *testing.T, lib string) {
	e := openWithTimeout(t, lib, 300*time.Millisecond)
	hung := startChild(t, lib, 4096)
	hung.halt(t)
	_, err := e.OpenSegment(hung.segment)
	wantCode(t, err, status.Timeout, "openSegment of a stopped peer")
	start := time.Now()
	require.NoError(t, e.Close())
	assert.Less(t, time.Since(start), 100*time.Millisecond, "Close waited for the stuck call")
	assert.Equal(t, 1, e.flightsAway(), "the stuck call is still inside the library")
	_, err = e.OpenSegment(hung.segment)
	wantCode(t, err, status.BadHandle, "open on a closed engine")
	hung.signal(t, syscall.SIGCONT)
	require.Eventually(t, func() bool { return e.flightsAway() == 0 }, 70*time.Second, 10*time.Millisecond, "the stuck open never came back")
}
