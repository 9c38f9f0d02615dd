package mooncake

import (
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/transport"
)

// relay forwards TCP connections to a peer engine, and holds back what the
// peer sends past a budget of bytes, as a peer stopped mid-reply would:
// it reads the peer's side in full (so the peer never waits on a full
// socket) and writes the client's side only within the budget.
type relay struct {
	l      net.Listener
	target string
	mu     sync.Mutex
	cond   *sync.Cond
	budget int64 // bytes the next replies may carry; negative: no limit
}

func newRelay(t *testing.T, target string) *relay {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	r := relayOn(t, l, target)
	go r.serve()
	return r
}

// relayOn makes a relay on l that the caller starts (go r.serve()).
func relayOn(t *testing.T, l net.Listener, target string) *relay {
	r := &relay{l: l, target: target, budget: -1}
	r.cond = sync.NewCond(&r.mu)
	t.Cleanup(func() { _ = l.Close(); r.hold(-1) })
	return r
}

// newSlowDoor is a relay to target whose TCP handshakes stall: its accept
// queue holds one connection (backlog 0) and already holds one, so the
// kernel drops a dialer's SYN until the relay starts accepting, after
// opening, and the dialer's retransmission (about 1 s later) gets in.
func newSlowDoor(t *testing.T, target string, opening time.Duration) *relay {
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	f := os.NewFile(uintptr(fd), "slow door")
	defer f.Close()
	require.NoError(t, syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}))
	require.NoError(t, syscall.Listen(fd, 0))
	l, err := net.FileListener(f)
	require.NoError(t, err)
	r := relayOn(t, l, target)
	filler, err := net.Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = filler.Close() })
	time.AfterFunc(opening, r.serve)
	return r
}

// hold limits the bytes passed to clients from now on; -1 lifts it.
func (r *relay) hold(budget int64) {
	r.mu.Lock()
	r.budget = budget
	r.cond.Broadcast()
	r.mu.Unlock()
}

func (r *relay) serve() {
	for {
		c, err := r.l.Accept()
		if err != nil {
			return
		}
		p, err := net.Dial("tcp", r.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		go func() { _, _ = io.Copy(p, c); _ = p.(*net.TCPConn).CloseWrite() }()
		go r.back(c, p)
	}
}

// back passes the peer's bytes to the client within the budget.
func (r *relay) back(c, p net.Conn) {
	defer c.Close()
	defer p.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := p.Read(buf)
		for out := buf[:n]; len(out) > 0; {
			r.mu.Lock()
			for r.budget == 0 {
				r.cond.Wait()
			}
			k := int64(len(out))
			if r.budget > 0 {
				k = min(k, r.budget)
				r.budget -= k
			}
			r.mu.Unlock()
			if _, werr := c.Write(out[:k]); werr != nil {
				return
			}
			out = out[k:]
		}
		if err != nil {
			return
		}
	}
}

// As in the real TCP transport, only a status frame has a deadline: a
// peer that goes silent mid-payload holds the read past it (until it
// resumes), and one silent before its status frame times the read out.
func TestMockHangsMidPayloadLikeTheRealTransport(t *testing.T) {
	const ioTimeout = 200 * time.Millisecond
	t.Setenv("MOCK_TE_IO_TIMEOUT_MS", "200")
	server, client := openEngine(t, mockLib), openEngine(t, mockLib)
	const size = 1 << 20
	src, dst := newBuffer(t, size), newBuffer(t, size)
	src.fill(9)
	register(t, server, src)
	register(t, client, dst)
	require.NoError(t, client.SetPath(PathTCP))
	r := newRelay(t, server.LocalSegment())
	seg, err := client.OpenSegment(r.l.Addr().String())
	require.NoError(t, err)
	read := transport.Request{Op: transport.Read, Local: dst.addr(), Segment: seg, Remote: uint64(src.addr()), Length: size}

	// The status frame and 64 KiB of the payload, then silence.
	r.hold(32 + 64<<10)
	b := allocate(t, client, 1)
	require.NoError(t, b.Submit([]transport.Request{read}))
	time.Sleep(5 * ioTimeout)
	st, err := b.Status(0)
	require.NoError(t, err)
	require.False(t, st.State.Done(), "a read silent mid-payload ended %v within %v; the real transport waits on", st.State, 5*ioTimeout)
	r.hold(-1)
	sts := waitAll(t, b)
	require.Equal(t, transport.Completed, sts[0].State)
	require.Equal(t, -1, dst.firstMismatch(9))

	// Silent before the status frame: the frame's deadline ends it.
	r.hold(0)
	b2 := allocate(t, client, 1)
	require.NoError(t, b2.Submit([]transport.Request{read}))
	sts = waitAll(t, b2)
	require.Contains(t, []transport.State{transport.TimedOut, transport.Failed}, sts[0].State, "a read whose status frame never came")
	r.hold(-1)
}

func waitAll(t *testing.T, b *Batch) []transport.TaskStatus {
	t.Helper()
	st, err := transport.Wait(t.Context(), b, 0, b.Tasks(), transport.DefaultBackoff)
	require.NoError(t, err)
	return st
}

// A signal landing on the thread that dials a peer must not fail the
// dial. A Go host's threads take signals at any time (preemption, SIGCHLD,
// SIGPROF), and a connect bounded by SO_SNDTIMEO returns EINTR on one
// (signal(7)); the mock took that for an unreachable peer, a conformance
// run's rare "unknown segment or unreachable peer" on loopback.
func TestMockDialSurvivesSignals(t *testing.T) {
	server, client := openEngine(t, mockLib), openEngine(t, mockLib)
	door := newSlowDoor(t, server.LocalSegment(), 50*time.Millisecond)
	name := cstr(t, door.l.Addr().String())

	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	pid, tid := syscall.Getpid(), syscall.Gettid()
	stop, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		for sent := 0; ; sent++ {
			select {
			case <-stop:
				assert.Positive(t, sent, "no signal reached the dialing thread")
				return
			case <-time.After(5 * time.Millisecond):
				// SIGURG: the runtime's own preemption signal, which a
				// thread in a C call ignores.
				_ = syscall.Tgkill(pid, tid, syscall.SIGURG)
			}
		}
	}()
	start := time.Now()
	id := raw(t, client, "openSegment", name)
	close(stop)
	<-stopped
	assert.Positive(t, id, "openSegment through a stalled handshake, signalled every 5 ms for %v", time.Since(start))
}
