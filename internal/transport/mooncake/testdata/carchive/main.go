// Command carchive is built by TestCArchive with -buildmode=c-archive and
// linked into a C program, the way llama.cpp links the bridge: it checks
// that the purego binding works in a Go runtime started by C, on threads
// that C created.
package main

import "C"

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"syscall"
	"unsafe"

	"github.com/mcbridge/mcbridge/internal/transport"
	"github.com/mcbridge/mcbridge/internal/transport/mooncake"
)

//export mcb_te_selftest
func mcb_te_selftest(lib *C.char) C.int {
	if err := selftest(C.GoString(lib)); err != nil {
		fmt.Fprintln(os.Stderr, "selftest:", err)
		return 1
	}
	return 0
}

// selftest reads a peer engine's buffer into a local one and compares them.
func selftest(lib string) (err error) {
	const size = 5 << 20
	engines := make([]*mooncake.Engine, 2)
	bufs := make([][]byte, 2)
	for i := range engines {
		if engines[i], err = mooncake.Open(mooncake.Config{Library: lib}); err != nil {
			return err
		}
		defer func(e *mooncake.Engine) {
			if cerr := e.Close(); err == nil {
				err = cerr
			}
		}(engines[i])
		if bufs[i], err = syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE); err != nil {
			return err
		}
		defer syscall.Munmap(bufs[i])
		addr := uintptr(unsafe.Pointer(&bufs[i][0]))
		if err = engines[i].RegisterMemory(addr, size, "cpu:0", true); err != nil {
			return err
		}
		defer func(e *mooncake.Engine) {
			if uerr := e.UnregisterMemory(addr); err == nil {
				err = uerr
			}
		}(engines[i])
	}
	for i := range bufs[1] {
		bufs[1][i] = byte(i * 7)
	}
	seg, err := engines[0].OpenSegment(engines[1].LocalSegment())
	if err != nil {
		return err
	}
	b, err := engines[0].AllocateBatch(1)
	if err != nil {
		return err
	}
	req := transport.Request{Op: transport.Read, Local: uintptr(unsafe.Pointer(&bufs[0][0])), Segment: seg,
		Remote: uint64(uintptr(unsafe.Pointer(&bufs[1][0]))), Length: size}
	if err := b.Submit([]transport.Request{req}); err != nil {
		return err
	}
	st, err := transport.Wait(context.Background(), b, 0, 1, transport.DefaultBackoff)
	if err != nil {
		return err
	}
	if err := b.Free(); err != nil {
		return err
	}
	if st[0].State != transport.Completed || !bytes.Equal(bufs[0], bufs[1]) {
		return fmt.Errorf("read ended %+v with equal bytes %v", st[0], bytes.Equal(bufs[0], bufs[1]))
	}
	return nil
}

func main() {}
