package mooncake

import (
	"io"
	"net"
	"sync"
	"testing"
	"time"

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
	r := &relay{l: l, target: target, budget: -1}
	r.cond = sync.NewCond(&r.mu)
	t.Cleanup(func() { _ = l.Close(); r.hold(-1) })
	go r.serve()
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
