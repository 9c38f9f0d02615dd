package pool

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mcbridge/mcbridge/internal/mem"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Shared pools: a pool in a sealed memfd (mem.MapShared) that processes of
// the same host map read-only and restore from in place, with the copy and
// check of the own pool, instead of through a transfer engine and its
// staging. docs/design.md §8.2 has the why.
//
// The descriptor is handed over a unix socket with SCM_RIGHTS. A path in
// /proc/PID/fd would need the reader to pass ptrace's access check on the
// holder (same user only), and a file in /dev/shm outlives a killed holder
// and can be truncated under its readers; a memfd sealed against shrinking
// can be neither, and its pages go with the last mapping. The socket sits
// in a directory only the owner (and a configured group) can enter, and
// every connection's peer credentials are checked again, so a process of
// another user gets nothing even where the directory is misconfigured.

// Address names a shared pool: the unix socket that hands it out and a
// random identity of the pool, so that a reader never takes the pool of
// a holder restarted under the same path for the one an entry names.
type Address struct {
	ID   uint64
	Path string
}

// String is the form directory entries carry: the ID in 16 hex digits, a
// colon, the path.
func (a Address) String() string { return fmt.Sprintf("%016x:%s", a.ID, a.Path) }

// MaxSocketPath is the longest path a unix socket address holds.
const MaxSocketPath = 107

// ParseAddress reads an Address from its String form.
func ParseAddress(s string) (Address, error) {
	id, path, ok := strings.Cut(s, ":")
	if !ok || len(id) != 16 {
		return Address{}, status.Errorf(status.InvalidArg, "shared pool address %q: want 16 hex digits, a colon, a path", s)
	}
	n, err := strconv.ParseUint(id, 16, 64)
	if err != nil || strings.ToLower(id) != id {
		return Address{}, status.Errorf(status.InvalidArg, "shared pool address %q: bad identity", s)
	}
	if !filepath.IsAbs(path) || len(path) > MaxSocketPath || strings.IndexByte(path, 0) >= 0 {
		return Address{}, status.Errorf(status.InvalidArg, "shared pool address %q: the socket path must be absolute, at most %d bytes", s, MaxSocketPath)
	}
	return Address{ID: n, Path: path}, nil
}

// NewShared is New with the region in a sealed memfd, which Share hands to
// readers of the same host.
func NewShared(size int64) (*Pool, error) {
	size = int64(alignUp(int(size)))
	if size <= 0 {
		return nil, status.Errorf(status.Config, "pool of %d bytes", size)
	}
	region, fd, err := mem.MapShared("mcbridge-pool", int(size))
	if err != nil {
		return nil, status.Wrap(status.PoolFull, err, "mapping the shared pool")
	}
	var id [8]byte
	_, _ = rand.Read(id[:])
	return &Pool{region: region, free: []extent{{0, size}}, fd: fd, id: binary.LittleEndian.Uint64(id[:])}, nil
}

// Access says who may map a shared pool besides the owner's user: the
// members of group GID, or nobody else when GID is negative.
type Access struct{ GID int }

// handshake is what a pool's socket sends each accepted reader, with the
// descriptor: magic, then the pool's identity, base address and size.
const (
	handshakeMagic = "MCBPOOL1"
	handshakeSize  = 32
)

// Server hands a shared pool's descriptor to readers. Close stops it.
type Server struct {
	p      *Pool
	l      *net.UnixListener
	access Access
	uid    int
	done   chan struct{}
	path   string
}

// Share listens on a unix socket at dir/name and hands the pool to every
// reader that access admits. dir is created (or checked) as a directory
// of the process's user that only it, and the group, can enter.
func (p *Pool) Share(dir, name string, access Access) (*Server, error) {
	if p.fd < 0 {
		return nil, status.Errorf(status.Internal, "sharing a pool that is not in shared memory")
	}
	if err := SocketDir(dir, access); err != nil {
		return nil, err
	}
	path := filepath.Join(dir, name)
	if len(path) > MaxSocketPath {
		return nil, status.Errorf(status.Config, "shared pool socket %q is longer than %d bytes", path, MaxSocketPath)
	}
	sweepSockets(dir)
	_ = os.Remove(path) // a socket a killed process of this name left
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, status.Wrap(status.Config, err, "listening for same-host readers of the pool")
	}
	l.SetUnlinkOnClose(true)
	// Connecting needs write permission on the socket; the directory,
	// which only the user and the group can enter, covers the moment
	// between bind and these.
	mode := os.FileMode(0o600)
	if access.GID >= 0 {
		mode = 0o660
		err = os.Chown(path, -1, access.GID)
	}
	if err == nil {
		err = os.Chmod(path, mode)
	}
	if err != nil {
		_ = l.Close()
		return nil, status.Wrap(status.Config, err, "setting the pool socket's owner and mode")
	}
	s := &Server{p: p, l: l, access: access, uid: os.Geteuid(), done: make(chan struct{}), path: path}
	go s.serve()
	return s, nil
}

// sweepSockets removes the sockets in dir that nothing listens on any
// more: a holder killed with SIGKILL cannot unlink its own. Connecting
// tells: refused where the listener is gone, accepted (into the backlog)
// where it lives, stopped or not.
func sweepSockets(dir string) {
	names, _ := filepath.Glob(filepath.Join(dir, "*.sock"))
	for _, n := range names {
		if !listening(n) {
			_ = os.Remove(n)
		}
	}
}

// Address is where readers find the pool.
func (s *Server) Address() Address { return Address{ID: s.p.id, Path: s.path} }

// Close stops handing the pool out; mappings readers hold stay valid.
func (s *Server) Close() error {
	err := s.l.Close()
	<-s.done
	return err
}

func (s *Server) serve() {
	defer close(s.done)
	for {
		c, err := s.l.AcceptUnix()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond) // EMFILE and the like pass
			continue
		}
		s.hand(c)
	}
}

// hand sends the pool to one reader if its credentials admit it. A write
// of one short message into a fresh socket's buffer does not block; the
// deadline covers a reader that never drains it.
func (s *Server) hand(c *net.UnixConn) {
	defer c.Close()
	if !s.admits(c) {
		return
	}
	var msg [handshakeSize]byte
	copy(msg[:], handshakeMagic)
	binary.LittleEndian.PutUint64(msg[8:], s.p.id)
	binary.LittleEndian.PutUint64(msg[16:], uint64(s.p.Base()))
	binary.LittleEndian.PutUint64(msg[24:], uint64(s.p.Size()))
	_ = c.SetWriteDeadline(time.Now().Add(time.Second))
	_, _, _ = c.WriteMsgUnix(msg[:], unix.UnixRights(s.p.fd), nil)
}

// admits checks the connecting process's credentials, as the kernel gives
// them: the pool's user, or a member of the configured group.
func (s *Server) admits(c *net.UnixConn) bool {
	raw, err := c.SyscallConn()
	if err != nil {
		return false
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) { cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) }); err != nil || cerr != nil {
		return false
	}
	if int(cred.Uid) == s.uid {
		return true
	}
	return s.access.GID >= 0 && (int(cred.Gid) == s.access.GID || inGroup(int(cred.Pid), s.access.GID))
}

// inGroup reads a process's supplementary groups, which SO_PEERCRED does
// not carry.
func inGroup(pid, gid int) bool {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "Groups:"); ok {
			for _, g := range strings.Fields(rest) {
				if g == strconv.Itoa(gid) {
					return true
				}
			}
			return false
		}
	}
	return false
}

// SocketDir makes dir, or checks the one there, as a directory that holds
// pool sockets safely: a real directory (not a link) of this user, that
// nobody else can write, and that only the user (and the group of access)
// can enter.
func SocketDir(dir string, access Access) error {
	mode := os.FileMode(0o700)
	if access.GID >= 0 {
		mode = 0o750
	}
	if err := os.MkdirAll(dir, mode); err != nil {
		return status.Wrap(status.Config, err, "the shared pool directory")
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return status.Wrap(status.Config, err, "the shared pool directory")
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	switch {
	case !fi.IsDir() || !ok:
		return status.Errorf(status.Config, "shared pool directory %s is not a directory", dir)
	case int(st.Uid) != os.Geteuid():
		return status.Errorf(status.Config, "shared pool directory %s belongs to user %d, not this process's %d", dir, st.Uid, os.Geteuid())
	}
	if access.GID >= 0 && int(st.Gid) != access.GID {
		if err := os.Chown(dir, -1, access.GID); err != nil {
			return status.Wrap(status.Config, err, "giving the shared pool directory to its group")
		}
	}
	if fi.Mode().Perm() != mode {
		if err := os.Chmod(dir, mode); err != nil {
			return status.Wrap(status.Config, err, "the shared pool directory's mode")
		}
	}
	return nil
}

// Mapped is another process's shared pool, mapped read-only.
type Mapped struct {
	addr   Address
	base   uint64
	region []byte
}

// Map asks the holder at addr for its pool and maps it read-only. It waits
// for the holder to answer until ctx ends: a stopped holder delays only
// this, never a read of a pool already mapped.
func Map(ctx context.Context, addr Address) (*Mapped, error) {
	m, err := mapAt(ctx, addr.Path)
	if err != nil {
		return nil, err
	}
	if m.addr.ID != addr.ID {
		id := m.addr.ID
		_ = m.Close()
		return nil, status.Errorf(status.NotFound, "the shared pool %s is another pool now (%016x, want %016x)", addr.Path, id, addr.ID)
	}
	return m, nil
}

// mapAt maps whatever pool the socket at path hands out; its Address says
// which.
func mapAt(ctx context.Context, path string) (*Mapped, error) {
	addr := Address{Path: path}
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, status.Wrap(status.Transfer, err, "reaching the shared pool "+addr.Path)
	}
	defer c.Close()
	uc := c.(*net.UnixConn)
	stop := context.AfterFunc(ctx, func() { _ = uc.SetReadDeadline(time.Unix(1, 0)) })
	defer stop()
	var msg [handshakeSize + 1]byte
	oob := make([]byte, unix.CmsgSpace(4*4))
	n, oobn, _, _, err := uc.ReadMsgUnix(msg[:], oob)
	if ctx.Err() != nil {
		return nil, status.Wrap(status.Timeout, ctx.Err(), "waiting for the shared pool "+addr.Path)
	}
	if err != nil {
		return nil, status.Wrap(status.Transfer, err, "reading the shared pool "+addr.Path)
	}
	fds := receivedFDs(oob[:oobn])
	defer func() {
		for _, fd := range fds {
			_ = unix.Close(fd)
		}
	}()
	if n == 0 {
		return nil, status.Errorf(status.Transfer, "the shared pool %s refused this process", addr.Path)
	}
	le := binary.LittleEndian
	switch {
	case n != handshakeSize || string(msg[:8]) != handshakeMagic || len(fds) != 1:
		return nil, status.Errorf(status.Transfer, "the shared pool %s answered %d bytes and %d descriptors", addr.Path, n, len(fds))
	}
	addr.ID = le.Uint64(msg[8:])
	base, size := le.Uint64(msg[16:]), le.Uint64(msg[24:])
	if size == 0 || size > 1<<50 || base+size < base {
		return nil, status.Errorf(status.Transfer, "the shared pool %s has %d bytes at %#x", addr.Path, size, base)
	}
	region, err := mem.MapReadOnly(fds[0], int(size))
	if err != nil {
		return nil, status.Wrap(status.Transfer, err, "mapping the shared pool "+addr.Path)
	}
	return &Mapped{addr: addr, base: base, region: region}, nil
}

func receivedFDs(oob []byte) []int {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil
	}
	var fds []int
	for i := range msgs {
		if r, err := unix.ParseUnixRights(&msgs[i]); err == nil {
			fds = append(fds, r...)
		}
	}
	return fds
}

// Block returns the n bytes at the holder's address addr, which a
// directory entry names. They are the holder's live memory: only a
// generation read after the copy (Generation) says they did not change.
func (m *Mapped) Block(addr, n uint64) ([]byte, error) {
	off := addr - m.base
	if addr < m.base || n == 0 || off > uint64(len(m.region)) || n > uint64(len(m.region))-off || off%align != 0 {
		return nil, status.Errorf(status.Corrupt, "block of %d bytes at %#x is outside the shared pool %s", n, addr, m.addr.Path)
	}
	return m.region[off : off+n : off+n], nil
}

// Close unmaps the pool; no slice from Block may be used afterwards.
func (m *Mapped) Close() error { return mem.Unmap(m.region) }

// HostID names this machine for directory entries: its running kernel's
// boot id, which every process of the host reads alike and no other host
// shares. Two processes with one HostID may still not reach each other's
// sockets (containers with their own filesystems); a reader then falls
// back to the transport.
func HostID() (string, error) {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return "", status.Wrap(status.Unsupported, err, "reading the host's boot id for shared pools")
	}
	return strings.TrimSpace(string(b)), nil
}
