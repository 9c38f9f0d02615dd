//go:build linux && (amd64 || arm64)

package mooncake

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/transport"
)

// The mock's wire format (mooncake-capi/mock/internal.h), rebuilt here so
// that the fuzz targets can start from valid frames.
const (
	wireMagic   = 0x4554434d
	wireVersion = 2
	wireHello   = 1
	wireRead    = 2
	wireWrite   = 3
	wireNotify  = 4
	wireReply   = 0x80
)

func wireRequest(typ uint16, addr, length, tag uint64) []byte {
	h := make([]byte, 32)
	binary.LittleEndian.PutUint32(h[0:], wireMagic)
	binary.LittleEndian.PutUint16(h[4:], wireVersion)
	binary.LittleEndian.PutUint16(h[6:], typ)
	binary.LittleEndian.PutUint64(h[8:], addr)
	binary.LittleEndian.PutUint64(h[16:], length)
	binary.LittleEndian.PutUint64(h[24:], tag)
	return h
}

// hangGuard bounds one exchange with the server: a frame that leaves either
// side waiting is a bug, reported instead of hanging the fuzzer.
const hangGuard = 20 * time.Second

// serverFixture is an engine whose registered region sits between two
// unregistered guard regions, and a second engine that reads it over TCP.
type serverFixture struct {
	server, client *Engine
	seg            transport.SegmentID
	mem            buffer // guard | region | guard
	region, copy   buffer
}

const fixtureRegion = 64 << 10

func newServerFixture(t testing.TB) *serverFixture {
	f := &serverFixture{server: openEngine(t, mockLib), client: openEngine(t, mockLib)}
	f.mem = newBuffer(t, 3*fixtureRegion)
	for i := range f.mem {
		f.mem[i] = 0xee
	}
	f.region = f.mem[fixtureRegion : 2*fixtureRegion]
	f.region.fill(3)
	register(t, f.server, f.region)
	f.copy = newBuffer(t, fixtureRegion)
	register(t, f.client, f.copy)
	require.NoError(t, f.client.SetPath(PathTCP))
	seg, err := f.client.OpenSegment(f.server.LocalSegment())
	require.NoError(t, err)
	f.seg = seg
	return f
}

// send writes raw to the server, half-closes, and drains the replies.
func (f *serverFixture) send(t *testing.T, raw []byte) {
	conn, err := net.Dial("tcp", f.server.LocalSegment())
	require.NoError(t, err, "dial")
	defer conn.Close()
	// A reset on close leaves no TIME_WAIT behind, however long the run.
	_ = conn.(*net.TCPConn).SetLinger(0)
	_ = conn.SetDeadline(time.Now().Add(hangGuard))
	// The server may close first on a bad frame; that is a valid answer.
	_, _ = conn.Write(raw)
	_ = conn.(*net.TCPConn).CloseWrite()
	if _, err := io.Copy(io.Discard, conn); err != nil {
		ne, ok := err.(net.Error)
		require.False(t, ok && ne.Timeout(), "the server neither answered nor closed within %v", hangGuard)
	}
}

// check asserts the guards are intact and the server still serves.
func (f *serverFixture) check(t *testing.T) {
	// One assertion per check, not per byte: each costs a t.Helper call.
	written := -1
	for i, b := range f.mem {
		if (i < fixtureRegion || i >= 2*fixtureRegion) && b != 0xee {
			written = i
			break
		}
	}
	require.Equal(t, -1, written, "a frame wrote outside the registered region, at guard offset %d", written)
	st := transfer(t, f.client, transport.Request{Op: transport.Read, Local: f.copy.addr(), Segment: f.seg, Remote: uint64(f.region.addr()), Length: fixtureRegion})
	require.Equal(t, transport.Completed, st[0].State, "the server stopped serving after a hostile frame: %+v", st[0])
	require.True(t, bytes.Equal(f.copy, f.region), "the server stopped serving after a hostile frame: %+v", st[0])
}

// FuzzServerFrame sends one request built from fields, aimed around the
// registered region, then checks that nothing outside it changed.
func FuzzServerFrame(f *testing.F) {
	fx := newServerFixture(f)
	f.Add(uint16(wireRead), uint8(2), int64(0), uint64(4096), uint8(0), []byte{})
	f.Add(uint16(wireWrite), uint8(2), int64(100), uint64(8), uint8(0), []byte("12345678"))
	f.Add(uint16(wireWrite), uint8(3), int64(-4), uint64(8), uint8(0), []byte("spillage"))
	f.Add(uint16(wireWrite), uint8(1), int64(0), uint64(8), uint8(0), []byte("guard!!!"))
	f.Add(uint16(wireWrite), uint8(2), int64(0), uint64(1<<40), uint8(0), []byte("x"))
	f.Add(uint16(wireRead), uint8(0), int64(-1), uint64(2), uint8(0), []byte{})
	f.Add(uint16(wireHello), uint8(0), int64(0), uint64(0), uint8(0), []byte{})
	f.Add(uint16(wireHello), uint8(0), int64(5), uint64(7), uint8(0), []byte{})
	f.Add(uint16(wireNotify), uint8(0), int64(0), uint64(12), uint8(0), []byte{2, 0, 0, 0, 2, 0, 0, 0, 'a', 'b', 'c', 'd'})
	f.Add(uint16(wireNotify), uint8(0), int64(0), uint64(12), uint8(0), []byte{255, 255, 255, 255, 2, 0, 0, 0, 'a', 'b', 'c', 'd'})
	f.Add(uint16(wireRead), uint8(2), int64(0), uint64(16), uint8(1), []byte{})
	f.Add(uint16(wireRead), uint8(2), int64(0), uint64(16), uint8(0x72), []byte{})
	f.Add(uint16(99), uint8(2), int64(0), uint64(16), uint8(0), []byte{})
	f.Fuzz(func(t *testing.T, typ uint16, base uint8, off int64, length uint64, flags uint8, payload []byte) {
		bases := []uint64{0, uint64(fx.mem.addr()), uint64(fx.region.addr()), uint64(fx.region.addr()) + fixtureRegion, uint64(fx.mem.addr()) + 2*fixtureRegion}
		h := wireRequest(typ, bases[int(base)%len(bases)]+uint64(off), length, 7)
		if flags&1 != 0 {
			h[0] ^= 0xff
		}
		if flags&2 != 0 {
			binary.LittleEndian.PutUint16(h[4:], uint16(flags>>4))
		}
		fx.send(t, append(h, payload...))
		fx.check(t)
		_, _ = fx.server.Notifications()
	})
}

// FuzzServerBytes sends arbitrary bytes, several frames' worth at most.
func FuzzServerBytes(f *testing.F) {
	fx := newServerFixture(f)
	f.Add([]byte{})
	f.Add(wireRequest(wireHello, 0, 0, 1))
	f.Add(append(wireRequest(wireHello, 0, 0, 1), wireRequest(wireRead, 0, 16, 2)...))
	f.Add(append(wireRequest(wireWrite, 0, 4, 1), 1, 2, 3))
	f.Add(bytes.Repeat([]byte{0x4d, 0x43, 0x54, 0x45}, 20))
	f.Fuzz(func(t *testing.T, raw []byte) {
		fx.send(t, raw)
		fx.check(t)
		_, _ = fx.server.Notifications()
	})
}

// helloReply is a valid HELLO answer as the mock's server writes it; table
// is where the peer claims its registration table is.
func helloReply(tag uint64, pid int32, pidns uint64, bootID, name string, table uint64) []byte {
	p := make([]byte, 56, 64+len(name))
	binary.LittleEndian.PutUint32(p[0:], uint32(pid))
	binary.LittleEndian.PutUint32(p[4:], uint32(len(name)))
	binary.LittleEndian.PutUint64(p[8:], pidns)
	copy(p[16:56], bootID)
	p = append(p, name...)
	p = binary.LittleEndian.AppendUint64(p, table)
	h := make([]byte, 32)
	binary.LittleEndian.PutUint32(h[0:], wireMagic)
	binary.LittleEndian.PutUint16(h[4:], wireVersion)
	binary.LittleEndian.PutUint16(h[6:], wireHello|wireReply)
	binary.LittleEndian.PutUint64(h[16:], uint64(len(p)))
	binary.LittleEndian.PutUint64(h[24:], tag)
	return append(h, p...)
}

// FuzzHelloReply plays a hostile peer: openSegment's handshake gets data as
// the answer (with the request's tag patched in when echoTag is set), and
// must end in an error or a segment, never a crash or a hang. A segment that
// opens is then read from, which makes the same-host path read the table
// the answer points at.
func FuzzHelloReply(f *testing.F) {
	e := openEngine(f, mockLib)
	// Same-host copies only: the hostile peer serves no TCP transfers, and
	// a read over TCP would wait out the mock's socket timeout.
	require.NoError(f, e.SetPath(PathVM))
	local := newBuffer(f, 4096)
	register(f, e, local)
	peer := newHostilePeer(f)
	boot, _ := os.ReadFile("/proc/sys/kernel/random/boot_id")
	pidns, _ := os.Readlink("/proc/self/ns/pid")
	var ino uint64
	_, _ = fmt.Sscanf(pidns, "pid:[%d]", &ino)
	self := string(bytes.TrimSpace(boot))
	f.Add(true, helloReply(0, int32(os.Getpid()), ino, self, "127.0.0.1:9", uint64(local.addr())))
	f.Add(true, helloReply(0, int32(os.Getpid()), ino, self, "127.0.0.1:9", 0))
	f.Add(true, helloReply(0, 1, 2, "x", "n", 0))
	f.Add(true, helloReply(0, 1, 2, "x", "", 0))
	f.Add(false, helloReply(0, 1, 2, "x", "n", ^uint64(0)))
	f.Add(true, helloReply(0, 1, 2, "x", "n", 1)[:70])
	f.Add(true, []byte("not a frame at all"))
	f.Fuzz(func(t *testing.T, echoTag bool, data []byte) {
		done := peer.answer(data, echoTag)
		// openSegmentNoCache handshakes afresh: a plain open of the same
		// name would return the id cached from an earlier input.
		seg := raw(t, e, "openSegmentNoCache", cstr(t, peer.addr))
		<-done
		if seg > 0 {
			st := transfer(t, e, transport.Request{Op: transport.Read, Local: local.addr(), Segment: transport.SegmentID(seg), Remote: uint64(local.addr()), Length: 64})
			require.Contains(t, []transport.State{transport.Failed, transport.Completed}, st[0].State, "a read from a fuzzed segment ended %+v", st[0])
		}
	})
}

// hostilePeer answers one handshake per answer call with canned bytes. One
// listener serves every input, and connections end with a reset, so that a
// long fuzzing run does not use up the ephemeral ports in TIME_WAIT.
type hostilePeer struct {
	ln   *net.TCPListener
	addr string
}

func newHostilePeer(tb testing.TB) *hostilePeer {
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(tb, err)
	tb.Cleanup(func() { ln.Close() })
	return &hostilePeer{ln: ln, addr: ln.Addr().String()}
}

func (p *hostilePeer) answer(data []byte, echoTag bool) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = p.ln.SetDeadline(time.Now().Add(hangGuard))
		conn, err := p.ln.AcceptTCP()
		if err != nil {
			return
		}
		_ = conn.SetLinger(0)
		defer conn.Close()
		_ = conn.SetDeadline(time.Now().Add(hangGuard))
		req := make([]byte, 32)
		if _, err := io.ReadFull(conn, req); err != nil {
			return
		}
		reply := append([]byte(nil), data...)
		if echoTag && len(reply) >= 32 {
			copy(reply[24:32], req[24:32])
		}
		_, _ = conn.Write(reply)
		// Let the engine read the reply before the reset discards it.
		_ = conn.CloseWrite()
		_, _ = io.Copy(io.Discard, conn)
	}()
	return done
}

// FuzzInspectELF feeds arbitrary bytes to the load-time ELF check, which
// must answer, the same way twice, without crashing the host process: a
// huge allocation or an unrecovered panic there would take llama.cpp down.
func FuzzInspectELF(f *testing.F) {
	lib, err := os.ReadFile(mockLib)
	require.NoError(f, err)
	f.Add(lib)
	f.Add(lib[:64])
	f.Add(lib[:len(lib)/2])
	f.Add([]byte("\x7fELF\x02\x01\x01"))
	f.Fuzz(func(t *testing.T, data []byte) {
		a, errA := inspectELF(bytes.NewReader(data))
		b, errB := inspectELF(bytes.NewReader(data))
		agree := (errA == nil) == (errB == nil) && a.goRuntime == b.goRuntime && len(a.needed) == len(b.needed)
		require.True(t, agree, "two inspections disagree: %+v %v / %+v %v", a, errA, b, errB)
	})
}
