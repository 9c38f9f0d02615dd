//go:build linux && (amd64 || arm64)

package mooncake

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"testing"
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/transport"
	"github.com/mcbridge/mcbridge/internal/transport/mooncake/mocklib"
)

// mockLib is the mock library the tests run against.
var mockLib string

func TestMain(m *testing.M) {
	if os.Getenv(envChild) != "" {
		os.Exit(max(childMain(), leakCheck()))
	}
	cleanup, err := findMock()
	if err != nil {
		fmt.Fprintln(os.Stderr, "mooncake tests:", err)
		os.Exit(2)
	}
	code := m.Run()
	cleanup()
	os.Exit(max(code, leakCheck()))
}

// leakCheck runs LeakSanitizer when the process carries it (a sanitizer
// build of the mock, with libasan preloaded): os.Exit skips the exit hook
// that would run it otherwise. It returns 1 when leaks were found.
func leakCheck() int {
	sym, err := purego.Dlsym(purego.RTLD_DEFAULT, "__lsan_do_recoverable_leak_check")
	if err != nil || sym == 0 {
		return 0
	}
	if r, _, _ := purego.SyscallN(sym); int32(r) != 0 {
		fmt.Fprintln(os.Stderr, "mooncake tests: LeakSanitizer found leaks")
		return 1
	}
	return 0
}

func findMock() (func(), error) {
	p, cleanup, err := mocklib.Find()
	mockLib = p
	return cleanup, err
}

// buffer is memory outside the Go heap, as the engines' worker threads may
// touch it at any time.
type buffer []byte

func newBuffer(t testing.TB, n int) buffer {
	t.Helper()
	b, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		t.Fatalf("mmap %d: %v", n, err)
	}
	t.Cleanup(func() { _ = syscall.Munmap(b) })
	return b
}

func (b buffer) addr() uintptr { return uintptr(unsafe.Pointer(&b[0])) }

// pattern is the byte at offset i of a buffer seeded with seed.
func pattern(seed byte, i int) byte { return byte(i*131+i>>9) ^ seed }

func (b buffer) fill(seed byte) {
	for i := range b {
		b[i] = pattern(seed, i)
	}
}

// firstMismatch is the first offset whose byte differs from the pattern, or -1.
func (b buffer) firstMismatch(seed byte) int {
	for i := range b {
		if b[i] != pattern(seed, i) {
			return i
		}
	}
	return -1
}

func openEngine(t testing.TB, lib string) *Engine {
	t.Helper()
	e, err := Open(Config{Library: lib})
	if err != nil {
		t.Fatalf("open engine on %s: %v", lib, err)
	}
	t.Cleanup(func() {
		if err := e.Close(); err != nil {
			t.Errorf("close engine: %v", err)
		}
	})
	return e
}

func register(t testing.TB, e *Engine, b buffer, remote bool) {
	t.Helper()
	if err := e.RegisterMemory(b.addr(), uint64(len(b)), "cpu:0", remote); err != nil {
		t.Fatalf("register %d bytes: %v", len(b), err)
	}
	t.Cleanup(func() {
		if err := e.UnregisterMemory(b.addr()); err != nil {
			t.Errorf("unregister: %v", err)
		}
	})
}

func allocate(t testing.TB, e *Engine, capacity int) *Batch {
	t.Helper()
	tb, err := e.AllocateBatch(capacity)
	if err != nil {
		t.Fatalf("allocate batch of %d: %v", capacity, err)
	}
	b := tb.(*Batch)
	t.Cleanup(func() {
		transport.WaitIdle(b, transport.DefaultBackoff)
		if err := b.Free(); err != nil && status.Of(err) != status.State {
			t.Errorf("free batch: %v", err)
		}
	})
	return b
}

func wantCode(t testing.TB, err error, want status.Code, what string) {
	t.Helper()
	if got := status.Of(err); got != want {
		t.Fatalf("%s: got %v (code %v), want code %v", what, err, got, want)
	}
}

// transfer submits reqs in a fresh batch and waits for every task.
func transfer(t testing.TB, e *Engine, reqs ...transport.Request) []transport.TaskStatus {
	t.Helper()
	b := allocate(t, e, len(reqs))
	if err := b.Submit(reqs); err != nil {
		t.Fatalf("submit: %v", err)
	}
	st, err := transport.Wait(context.Background(), b, 0, len(reqs), transport.DefaultBackoff)
	if err != nil {
		t.Fatalf("wait: %v", err)
	}
	if err := b.Free(); err != nil {
		t.Fatalf("free: %v", err)
	}
	return st
}

// ---- the child process of the two-process tests ---------------------------

const (
	envChild     = "MCB_TE_CHILD"
	envChildLib  = "MCB_TE_CHILD_LIB"
	envChildSize = "MCB_TE_CHILD_SIZE"
	childSeed    = 0x5a
)

// childMain registers a patterned buffer, prints "READY segment addr len",
// and serves until its standard input closes.
func childMain() int {
	size, err := strconv.Atoi(os.Getenv(envChildSize))
	if err != nil || size <= 0 {
		fmt.Fprintln(os.Stderr, "child: bad size:", err)
		return 2
	}
	e, err := Open(Config{Library: os.Getenv(envChildLib)})
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	mem, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	b := buffer(mem)
	b.fill(childSeed)
	if err := e.RegisterMemory(b.addr(), uint64(size), "cpu:0", true); err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	fmt.Printf("READY %s %d %d\n", e.LocalSegment(), b.addr(), size)
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	if err := e.UnregisterMemory(b.addr()); err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	if err := e.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	return 0
}

// child is a running child process holding a registered buffer.
type child struct {
	cmd     *exec.Cmd
	stdin   interface{ Close() error }
	segment string
	addr    uint64
	size    int
}

func startChild(t testing.TB, lib string, size int) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envChild+"=1", envChildLib+"="+lib, envChildSize+"="+strconv.Itoa(size))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start child: %v", err)
	}
	c := &child{cmd: cmd, stdin: stdin}
	t.Cleanup(func() {
		_ = c.stdin.Close()
		_ = c.cmd.Wait()
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		_ = cmd.Process.Kill()
		t.Fatalf("child did not report its segment: %v", err)
	}
	if _, err := fmt.Sscanf(line, "READY %s %d %d", &c.segment, &c.addr, &c.size); err != nil {
		_ = cmd.Process.Kill()
		t.Fatalf("child said %q: %v", line, err)
	}
	return c
}

// stop asks the child to unregister and exit, and checks that it did.
func (c *child) stop(t testing.TB) {
	t.Helper()
	_ = c.stdin.Close()
	if err := c.cmd.Wait(); err != nil {
		t.Fatalf("child exit: %v", err)
	}
}
