//go:build linux && (amd64 || arm64)

package mooncake

import (
	"bytes"
	"net"
	"runtime"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/transport"
)

// P2PHandshake is the metadata string that needs no metadata service: each
// engine's segment is named by its listener's ip:port.
const P2PHandshake = "P2PHANDSHAKE"

// Mirrors of the C structs in mooncake-capi/include/transfer_engine_c.h, with
// the padding spelled out; layout_test.go pins them to the C numbers.
type (
	cRequest struct {
		opcode       int32
		_            uint32
		source       uintptr
		targetID     int32
		reserved     uint32
		targetOffset uint64
		length       uint64
	}
	cStatus struct {
		state       int32
		_           uint32
		transferred uint64
	}
	cBufferEntry struct {
		addr   uintptr
		length uintptr
	}
	cNotifyMsg struct {
		name uintptr
		msg  uintptr
	}
)

const (
	invalidBatch = ^uint64(0)
	// Some releases return a negative code cast to uint64 instead.
	lowestBatchCode = -1000
)

// Config opens an engine.
type Config struct {
	// Library is the path of libtransfer_engine.so or of the mock; empty
	// means $MCB_MOONCAKE_LIB.
	Library string
	// Metadata is the metadata connection string; empty means P2PHANDSHAKE.
	Metadata string
	// LocalServerName is host[:port]. With P2PHANDSHAKE the engine listens on
	// host only, on a fresh port. Empty means 127.0.0.1: loopback only.
	LocalServerName string
	// IPOrHostName and RPCPort go to the library as they are; empty means
	// LocalServerName's host.
	IPOrHostName string
	RPCPort      uint16
	// AutoDiscover lets the library install transports for the topology it
	// finds; otherwise Protocol is installed.
	AutoDiscover bool
	// Protocol is "tcp" (the default) or "rdma".
	Protocol string
	// ProtocolArgs are installTransport's arguments; for "rdma", the NIC
	// priority matrix as JSON.
	ProtocolArgs []string
	// PeerTimeout is the deadline of the calls that wait on a peer when
	// their caller gives none (OpenSegment, SyncSegmentCache, SendNotify,
	// polls of a batch with a notification pending); 0 means
	// DefaultPeerTimeout. The bridge passes its transfer_timeout_ms.
	PeerTimeout time.Duration
}

// Engine is one Transfer Engine instance. It implements transport.Transport
// and is safe for concurrent use.
type Engine struct {
	lib     *Library
	segment string
	timeout time.Duration // deadline of peer calls whose caller gives none

	// Calls that return at once hold mu shared for their duration; Close
	// holds it exclusively. Calls that wait on a peer run as flights
	// instead (flight.go), which hold the handle without holding mu.
	mu     sync.RWMutex
	handle uintptr // 0 once closed

	stateMu sync.Mutex
	regions map[uintptr]struct{} // starts of registered regions
	batches int                  // allocated and not yet freed
	flights map[string]*flight   // shared flights in the air, by key
	away    int                  // flights not yet returned from the library
	closed  bool                 // Close ran: the last flight to land destroys
}

var (
	_ transport.Transport = (*Engine)(nil)
	_ transport.Notifier  = (*Engine)(nil)
)

// Open loads the library and starts an engine.
func Open(cfg Config) (*Engine, error) {
	lib, err := Load(cfg.Library)
	if err != nil {
		return nil, err
	}
	meta := cfg.Metadata
	if meta == "" {
		meta = P2PHandshake
	}
	if err := lib.checkMetadata(meta); err != nil {
		return nil, err
	}
	local := cfg.LocalServerName
	if local == "" {
		local = "127.0.0.1"
	}
	ip := cfg.IPOrHostName
	if ip == "" {
		ip = hostOf(local)
	}
	proto := cfg.Protocol
	if proto == "" {
		proto = "tcp"
	}
	if proto != "tcp" && proto != "rdma" {
		return nil, status.Errorf(status.Config, "transport protocol %q: want tcp or rdma", proto)
	}
	cMeta, err1 := cString(meta)
	cLocal, err2 := cString(local)
	cIP, err3 := cString(ip)
	for _, err := range []error{err1, err2, err3} {
		if err != nil {
			return nil, err
		}
	}
	h, _ := lib.call("createTransferEngine", lib.sym.createTransferEngine, plain,
		uintptr(unsafe.Pointer(&cMeta[0])), uintptr(unsafe.Pointer(&cLocal[0])),
		uintptr(unsafe.Pointer(&cIP[0])), uintptr(cfg.RPCPort), boolArg(cfg.AutoDiscover))
	if h == 0 {
		return nil, status.Errorf(status.Transfer, "createTransferEngine(%q, %q) failed; the library's log says why", meta, local)
	}
	timeout := cfg.PeerTimeout
	if timeout <= 0 {
		timeout = DefaultPeerTimeout
	}
	e := &Engine{lib: lib, handle: h, timeout: timeout, regions: make(map[uintptr]struct{}), flights: make(map[string]*flight)}
	if err := e.start(cfg, meta, local, proto); err != nil {
		_, _ = lib.call("destroyTransferEngine", lib.sym.destroyTransferEngine, plain, h)
		return nil, err
	}
	return e, nil
}

// start installs the transport and learns the segment name.
func (e *Engine) start(cfg Config, meta, local, proto string) error {
	if !cfg.AutoDiscover {
		var pin runtime.Pinner
		defer pin.Unpin()
		cProto, err := cString(proto)
		if err != nil {
			return err
		}
		argv, err := cArgv(&pin, cfg.ProtocolArgs)
		if err != nil {
			return err
		}
		t, _ := e.lib.call("installTransport", e.lib.sym.installTransport, plain,
			e.handle, uintptr(unsafe.Pointer(&cProto[0])), argv)
		if t == 0 {
			return status.Errorf(status.Unsupported, "installTransport(%q) failed", proto)
		}
	}
	if meta != P2PHandshake {
		e.segment = local
		return nil
	}
	if e.lib.sym.getLocalIPAndPort == 0 {
		return status.Errorf(status.Unsupported, "%s lacks getLocalIpAndPort, which P2PHANDSHAKE needs to name the segment", e.lib.path)
	}
	buf := make([]byte, 256)
	if _, err := e.lib.call("getLocalIpAndPort", e.lib.sym.getLocalIPAndPort, negativeCode,
		e.handle, uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf))); err != nil {
		return err
	}
	e.segment = goString(buf)
	if e.segment == "" {
		return status.Errorf(status.Transfer, "getLocalIpAndPort returned an empty segment name")
	}
	return nil
}

// checkMetadata refuses metadata the library cannot serve: the real engine
// aborts the process on a scheme it has no plugin for, so the plugin's
// library must be among its dependencies.
func (l *Library) checkMetadata(meta string) error {
	plugins := []struct{ scheme, lib string }{
		{"etcd://", "libetcd-cpp-api"},
		{"redis://", "libhiredis"},
		{"http://", "libcurl"},
		{"https://", "libcurl"},
	}
	if meta == P2PHandshake {
		return nil
	}
	for _, p := range plugins {
		if strings.HasPrefix(meta, p.scheme) {
			if !l.needs(p.lib) {
				return status.Errorf(status.Config, "metadata %q needs a Transfer Engine built with %s; %s does not link it", meta, p.lib, l.path)
			}
			return nil
		}
	}
	return status.Errorf(status.Config, "metadata %q: unknown scheme (want %s, etcd://, redis:// or http://)", meta, P2PHandshake)
}

func hostOf(hostPort string) string {
	if h, _, err := net.SplitHostPort(hostPort); err == nil {
		return h
	}
	return strings.Trim(hostPort, "[]")
}

func boolArg(b bool) uintptr {
	if b {
		return 1
	}
	return 0
}

// cString is s with a terminating NUL; C cannot see past an inner one.
func cString(s string) ([]byte, error) {
	if strings.IndexByte(s, 0) >= 0 {
		return nil, status.Errorf(status.InvalidArg, "string %q contains a NUL byte", s)
	}
	return append([]byte(s), 0), nil
}

// cArgv builds a NULL-terminated char* array, pinned so that C may read the
// Go pointers inside it. 0 for no arguments.
func cArgv(pin *runtime.Pinner, args []string) (uintptr, error) {
	if len(args) == 0 {
		return 0, nil
	}
	ptrs := make([]unsafe.Pointer, len(args)+1)
	for i, a := range args {
		b, err := cString(a)
		if err != nil {
			return 0, err
		}
		pin.Pin(&b[0])
		ptrs[i] = unsafe.Pointer(&b[0])
	}
	pin.Pin(&ptrs[0])
	return uintptr(unsafe.Pointer(&ptrs[0])), nil
}

// goString reads a NUL-terminated string from a Go buffer C wrote into.
func goString(buf []byte) string {
	if i := bytes.IndexByte(buf, 0); i >= 0 {
		buf = buf[:i]
	}
	return string(buf)
}

// cPointer turns an address returned by C into a pointer; the memory is C's.
func cPointer(addr uintptr) unsafe.Pointer {
	return *(*unsafe.Pointer)(unsafe.Pointer(&addr))
}

// goStringAt copies a NUL-terminated C string of at most limit bytes.
func goStringAt(addr uintptr, limit int) string {
	if addr == 0 {
		return ""
	}
	p := cPointer(addr)
	n := 0
	for n < limit && *(*byte)(unsafe.Add(p, n)) != 0 {
		n++
	}
	return string(unsafe.Slice((*byte)(p), n))
}

// use runs f with the engine's handle while holding the engine open.
func (e *Engine) use(op string, f func(h uintptr) error) error {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.handle == 0 {
		return status.Errorf(status.BadHandle, "%s: engine is closed", op)
	}
	return f(e.handle)
}

// Library is the library the engine runs on.
func (e *Engine) Library() *Library { return e.lib }

// LocalSegment is the name peers open to reach this engine's memory.
func (e *Engine) LocalSegment() string { return e.segment }

// RegisterMemory implements transport.Transport.
func (e *Engine) RegisterMemory(addr uintptr, length uint64, location string, remoteAccessible bool) error {
	if addr == 0 || length == 0 {
		return status.Errorf(status.InvalidArg, "register memory: empty range [%#x, +%d)", addr, length)
	}
	if location == "" {
		return status.Errorf(status.InvalidArg, "register memory: empty location (want cpu:N, cuda:N or *)")
	}
	loc, err := cString(location)
	if err != nil {
		return err
	}
	return e.use("registerLocalMemory", func(h uintptr) error {
		if _, err := e.lib.call("registerLocalMemory", e.lib.sym.registerLocalMemory, negativeCode,
			h, addr, uintptr(length), uintptr(unsafe.Pointer(&loc[0])), boolArg(remoteAccessible)); err != nil {
			return err
		}
		e.stateMu.Lock()
		e.regions[addr] = struct{}{}
		e.stateMu.Unlock()
		return nil
	})
}

// UnregisterMemory implements transport.Transport.
func (e *Engine) UnregisterMemory(addr uintptr) error {
	return e.use("unregisterLocalMemory", func(h uintptr) error {
		if _, err := e.lib.call("unregisterLocalMemory", e.lib.sym.unregisterLocalMemory, negativeCode, h, addr); err != nil {
			return err
		}
		e.stateMu.Lock()
		delete(e.regions, addr)
		e.stateMu.Unlock()
		return nil
	})
}

// Region is a range of memory for RegisterMemoryBatch.
type Region struct {
	Addr   uintptr
	Length uint64
}

// RegisterMemoryBatch registers remote-accessible regions, all or none.
func (e *Engine) RegisterMemoryBatch(regions []Region, location string) error {
	if len(regions) == 0 {
		return nil
	}
	loc, err := cString(location)
	if err != nil {
		return err
	}
	entries := make([]cBufferEntry, len(regions))
	for i, r := range regions {
		if r.Addr == 0 || r.Length == 0 {
			return status.Errorf(status.InvalidArg, "register memory: region %d is empty", i)
		}
		entries[i] = cBufferEntry{addr: r.Addr, length: uintptr(r.Length)}
	}
	return e.use("registerLocalMemoryBatch", func(h uintptr) error {
		if _, err := e.lib.call("registerLocalMemoryBatch", e.lib.sym.registerLocalMemoryBatch, negativeCode,
			h, uintptr(unsafe.Pointer(&entries[0])), uintptr(len(entries)), uintptr(unsafe.Pointer(&loc[0]))); err != nil {
			return err
		}
		e.stateMu.Lock()
		for _, r := range regions {
			e.regions[r.Addr] = struct{}{}
		}
		e.stateMu.Unlock()
		return nil
	})
}

// UnregisterMemoryBatch unregisters the regions that start at addrs. It
// refuses, before calling the library, a list with a start this engine did
// not register (or the same start twice): the real library then stops
// serving the known starts but keeps them in its overlap check, so they can
// be neither unregistered nor registered again.
func (e *Engine) UnregisterMemoryBatch(addrs []uintptr) error {
	if len(addrs) == 0 {
		return nil
	}
	list := append([]uintptr(nil), addrs...)
	return e.use("unregisterLocalMemoryBatch", func(h uintptr) error {
		e.stateMu.Lock()
		defer e.stateMu.Unlock()
		seen := make(map[uintptr]bool, len(list))
		for _, a := range list {
			if _, ok := e.regions[a]; !ok || seen[a] {
				return status.Errorf(status.InvalidArg, "unregister memory: %#x is not a registered start, or is listed twice", a)
			}
			seen[a] = true
		}
		if _, err := e.lib.call("unregisterLocalMemoryBatch", e.lib.sym.unregisterLocalMemoryBatch, negativeCode,
			h, uintptr(unsafe.Pointer(&list[0])), uintptr(len(list))); err != nil {
			return err
		}
		for _, a := range list {
			delete(e.regions, a)
		}
		return nil
	})
}

// CanAbort reports whether the engine's batches can be aborted (see
// transport.Aborter): the mock exports an abort, the real engine has none.
func (e *Engine) CanAbort() bool { return e.lib.sym.mockAbort != 0 }

// AllocateBatch implements transport.Transport.
func (e *Engine) AllocateBatch(capacity int) (transport.Batch, error) {
	if capacity <= 0 {
		return nil, status.Errorf(status.InvalidArg, "allocate batch: capacity %d", capacity)
	}
	var b *Batch
	err := e.use("allocateBatchID", func(h uintptr) error {
		r, _ := e.lib.call("allocateBatchID", e.lib.sym.allocateBatchID, plain, h, uintptr(capacity))
		id := uint64(r)
		if id == 0 || id == invalidBatch || (int64(id) < 0 && int64(id) >= lowestBatchCode) {
			return status.Errorf(status.Transfer, "allocateBatchID(%d) failed (Transfer Engine returned %d)", capacity, int64(id))
		}
		e.stateMu.Lock()
		e.batches++
		e.stateMu.Unlock()
		b = &Batch{e: e, id: id, capacity: capacity}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return b, nil
}

// Close implements transport.Transport. It refuses while batches or
// registrations remain: destroying the engine under them would leave tasks
// writing into memory that the caller believes idle. While a call given up
// at its deadline is still inside the library (a hung peer), Close returns
// at once and the engine is destroyed when that call comes back: destroying
// it under the call would free what the call is using.
func (e *Engine) Close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.handle == 0 {
		return status.Errorf(status.BadHandle, "close: engine is already closed")
	}
	e.stateMu.Lock()
	batches, regions := e.batches, len(e.regions)
	if batches > 0 || regions > 0 {
		e.stateMu.Unlock()
		return status.Errorf(status.State, "close: %d batches and %d registered regions remain", batches, regions)
	}
	h := e.handle
	e.handle = 0
	e.closed = true
	away := e.away
	e.stateMu.Unlock()
	if away > 0 {
		return nil
	}
	_, err := e.lib.call("destroyTransferEngine", e.lib.sym.destroyTransferEngine, plain, h)
	return err
}

// Notification is a message delivered to this engine by a peer.
type Notification = transport.Notification

// notifyLimit bounds the strings read back from the library.
const notifyLimit = 1 << 20

// Notifications returns and forgets the messages peers sent to this engine.
func (e *Engine) Notifications() ([]Notification, error) {
	if e.lib.sym.freeNotifsMsgBuf == 0 {
		// Without it the returned array could be neither freed nor left.
		return nil, status.Errorf(status.Unsupported, "%s lacks freeNotifsMsgBuf", e.lib.path)
	}
	var out []Notification
	err := e.use("getNotifsFromEngine", func(h uintptr) error {
		size := new(int32)
		r, err := e.lib.call("getNotifsFromEngine", e.lib.sym.getNotifsFromEngine, plain, h, uintptr(unsafe.Pointer(size)))
		if err != nil || r == 0 || *size <= 0 {
			return err
		}
		msgs := unsafe.Slice((*cNotifyMsg)(cPointer(r)), int(*size))
		for _, m := range msgs {
			out = append(out, Notification{Name: goStringAt(m.name, notifyLimit), Msg: goStringAt(m.msg, notifyLimit)})
		}
		_, err = e.lib.call("freeNotifsMsgBuf", e.lib.sym.freeNotifsMsgBuf, negativeCode, r, uintptr(*size))
		return err
	})
	return out, err
}
