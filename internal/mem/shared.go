package mem

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// Seals a shared region carries: its size can never change, nor its seals.
// A reader maps it only with these present, so no truncation can ever turn
// a read of its mapping into SIGBUS, which would kill a Go process.
const sharedSeals = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL

// MapShared returns n bytes of zeroed memory, as Map, backed by an
// anonymous memory file (memfd) sealed at that size, and the file's
// descriptor, which the caller owns: other processes of the host that
// receive it can map the same pages with MapReadOnly. Nothing on a
// filesystem names the file; its pages live while a descriptor or a
// mapping does, so a process killed while readers map it leaves them a
// valid mapping and leaks nothing once they unmap.
func MapShared(name string, n int) ([]byte, int, error) {
	if n <= 0 {
		return nil, -1, fmt.Errorf("mem: shared map of %d bytes", n)
	}
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, -1, fmt.Errorf("mem: memfd_create: %w", err)
	}
	fail := func(what string, err error) ([]byte, int, error) {
		_ = unix.Close(fd)
		return nil, -1, fmt.Errorf("mem: shared map of %d bytes: %s: %w", n, what, err)
	}
	if err := unix.Ftruncate(fd, int64(n)); err != nil {
		return fail("ftruncate", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, sharedSeals); err != nil {
		return fail("sealing", err)
	}
	b, err := unix.Mmap(fd, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fail("mmap", err)
	}
	return b, fd, nil
}

// MapReadOnly maps n bytes of a descriptor from MapShared, read-only. It
// refuses a file that is not sealed against shrinking or is shorter than
// n: reading such a mapping could fault. The descriptor stays the
// caller's; the mapping outlives it.
func MapReadOnly(fd, n int) ([]byte, error) {
	if n <= 0 {
		return nil, fmt.Errorf("mem: read-only map of %d bytes", n)
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return nil, fmt.Errorf("mem: reading the seals of a shared region: %w", err)
	}
	if seals&unix.F_SEAL_SHRINK == 0 {
		return nil, fmt.Errorf("mem: shared region has seals %#x, none against shrinking", seals)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("mem: stat of a shared region: %w", err)
	}
	if st.Size < int64(n) {
		return nil, fmt.Errorf("mem: shared region of %d bytes, want %d", st.Size, n)
	}
	b, err := unix.Mmap(fd, 0, n, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mem: read-only map of %d bytes: %w", n, err)
	}
	return b, nil
}
