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
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/testenv"
	"github.com/mcbridge/mcbridge/internal/transport"
	"github.com/mcbridge/mcbridge/internal/transport/mooncake/mocklib"
)

// EnvRealLibrary names the real libtransfer_engine.so the tests run every
// transport case against, beside the mock (make test sets it from
// scripts/mooncake/build.sh te).
const EnvRealLibrary = "MCB_TE_REAL_LIB"

// mockLib is the mock library the tests run against.
var mockLib string

func TestMain(m *testing.M) {
	if role := os.Getenv(envChild); role != "" {
		os.Exit(max(childMain(role), leakCheck()))
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

// realLib is the real library's path. A real variant that cannot run fails:
// skipping it would report a suite that never ran as passing.
func realLib(t testing.TB) string {
	t.Helper()
	p := os.Getenv(EnvRealLibrary)
	require.NotEmpty(t, p, "%s is unset: it must name the real libtransfer_engine.so (make test sets it from scripts/mooncake/build.sh te); the real-library variant cannot run", EnvRealLibrary)
	lib, err := Load(p)
	require.NoError(t, err, "%s=%s does not load", EnvRealLibrary, p)
	require.False(t, lib.Has("mock_te_set_fault"), "%s=%s is the mock, not the real library", EnvRealLibrary, p)
	return p
}

// impl is one Transfer Engine library the tests run on.
type impl struct {
	name string
	lib  func(testing.TB) string
}

func (i impl) mock() bool { return i.name == "mock" }

var impls = []impl{
	{"mock", func(testing.TB) string { return mockLib }},
	{"real", realLib},
}

// scenario is a case that runs once per implementation, as subtests /mock
// and /real. mockOnly, when set, says why the case runs on the mock alone:
// it needs one of the mock's mock_te_* controls.
type scenario struct {
	name     string
	mockOnly string
	run      func(t *testing.T, lib string)
}

func runScenarios(t *testing.T, scs []scenario) {
	for _, sc := range scs {
		t.Run(sc.name, func(t *testing.T) {
			for _, im := range impls {
				if sc.mockOnly != "" && !im.mock() {
					continue
				}
				t.Run(im.name, func(t *testing.T) {
					// The mock the parent found goes to the child, so
					// that the child need not build one.
					if !im.mock() && !testenv.Alone(t, envIsolated, mocklib.Env+"="+mockLib) {
						return
					}
					sc.run(t, im.lib(t))
				})
			}
		})
	}
}

// envIsolated marks a process that runs one real-library case by itself.
// The real engine hands a freed batch's memory out again, and its TCP
// threads run a slice's continuation after the task already reads as done;
// a late write of its in a shared heap could land in whatever the mock
// allocates next (the likeliest cause of a mock failure CI saw once): each
// real case gets a heap the mock never touches.
const envIsolated = "MCB_TE_ISOLATED"

// buffer is memory outside the Go heap, as the engines' worker threads may
// touch it at any time.
type buffer []byte

func newBuffer(t testing.TB, n int) buffer {
	t.Helper()
	b, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	require.NoError(t, err, "mmap %d", n)
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
	require.NoError(t, err, "open engine on %s", lib)
	t.Cleanup(func() { assert.NoError(t, e.Close(), "close engine") })
	return e
}

func register(t testing.TB, e *Engine, b buffer) {
	t.Helper()
	require.NoError(t, e.RegisterMemory(b.addr(), uint64(len(b)), "cpu:0", true), "register %d bytes", len(b))
	t.Cleanup(func() { assert.NoError(t, e.UnregisterMemory(b.addr()), "unregister") })
}

func allocate(t testing.TB, e *Engine, capacity int) *Batch {
	t.Helper()
	tb, err := e.AllocateBatch(capacity)
	require.NoError(t, err, "allocate batch of %d", capacity)
	b := tb.(*Batch)
	t.Cleanup(func() {
		transport.WaitIdle(b, transport.DefaultBackoff)
		if err := b.Free(); status.Of(err) != status.State {
			assert.NoError(t, err, "free batch")
		}
	})
	return b
}

func wantCode(t testing.TB, err error, want status.Code, what string) {
	t.Helper()
	require.Equal(t, want, status.Of(err), "%s: got %v", what, err)
}

// transfer submits reqs in a fresh batch and waits for every task.
func transfer(t testing.TB, e *Engine, reqs ...transport.Request) []transport.TaskStatus {
	t.Helper()
	b := allocate(t, e, len(reqs))
	require.NoError(t, b.Submit(reqs), "submit")
	st, err := transport.Wait(context.Background(), b, 0, len(reqs), transport.DefaultBackoff)
	require.NoError(t, err, "wait")
	require.NoError(t, b.Free(), "free")
	return st
}

// ---- the child process of the two-process tests ---------------------------

const (
	envChild     = "MCB_TE_CHILD"
	envChildLib  = "MCB_TE_CHILD_LIB"
	envChildSize = "MCB_TE_CHILD_SIZE"
	childSeed    = 0x5a
)

// childMain runs the child's role: "serve" registers a patterned buffer,
// prints "READY segment addr len", and serves until its standard input
// closes; "sideeffects" reports what loading and opening did to the process.
func childMain(role string) int {
	if role == "sideeffects" {
		return sideEffectsMain()
	}
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
	cmd.Env = append(os.Environ(), envChild+"=serve", envChildLib+"="+lib, envChildSize+"="+strconv.Itoa(size))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start(), "start child")
	c := &child{cmd: cmd, stdin: stdin}
	t.Cleanup(func() {
		// A child left stopped by a failed test would never exit.
		_ = c.cmd.Process.Signal(syscall.SIGCONT)
		_ = c.stdin.Close()
		_ = c.cmd.Wait()
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		_ = cmd.Process.Kill()
		require.NoError(t, err, "child did not report its segment")
	}
	if _, err := fmt.Sscanf(line, "READY %s %d %d", &c.segment, &c.addr, &c.size); err != nil {
		_ = cmd.Process.Kill()
		require.NoError(t, err, "child said %q", line)
	}
	return c
}

// stop asks the child to unregister and exit, and checks that it did.
func (c *child) stop(t testing.TB) {
	t.Helper()
	_ = c.stdin.Close()
	require.NoError(t, c.cmd.Wait(), "child exit")
}

func (c *child) signal(t testing.TB, sig syscall.Signal) {
	t.Helper()
	require.NoError(t, c.cmd.Process.Signal(sig), "signal %v to the child", sig)
}

// halt stops the child (SIGSTOP) and waits until every thread of it is
// stopped (testenv.Freeze).
func (c *child) halt(t testing.TB) {
	t.Helper()
	testenv.Freeze(t, c.cmd.Process.Pid)
}

// kill ends the child at once and reaps it.
func (c *child) kill(t testing.TB) {
	t.Helper()
	require.NoError(t, c.cmd.Process.Kill())
	_ = c.cmd.Wait()
}
