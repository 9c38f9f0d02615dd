//go:build linux && (amd64 || arm64)

package mooncake

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/store/mooncake/mastertest"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// Child roles: a test runs this binary again as a store client in another
// process, which it can SIGKILL.
const (
	envChild       = "MCB_STORE_CHILD"
	envChildMaster = "MCB_STORE_CHILD_MASTER"
	envChildArg    = "MCB_STORE_CHILD_ARG"
)

// envIsolated marks a process that runs one test by itself.
const envIsolated = "MCB_STORE_ISOLATED"

// isolated runs the calling test in a process of its own (testenv.Alone)
// and reports whether this is that process. The library's RPC threads are
// per process: after a test had stopped and killed its master under a
// client of this process, the next test's client could not reach its own,
// new master for 30 s ("Client not available", CI, on TestRefusedArguments
// after TestMasterDown and TestMasterStopped). Tests that do that to a
// master run alone.
func isolated(t *testing.T) bool { return testenv.Alone(t, envIsolated) }

func TestMain(m *testing.M) {
	if role := os.Getenv(envChild); role != "" {
		os.Exit(childMain(role))
	}
	os.Exit(m.Run())
}

func childMain(role string) int {
	switch role {
	case "holder":
		return holderMain()
	case "sideeffects":
		return sideEffectsMain()
	case "benchholder":
		return benchHolderMain()
	}
	fmt.Fprintln(os.Stderr, "unknown child role", role)
	return 2
}

// holderMain contributes a segment, puts the keys it is told (name=replicas,
// preferring its own segment), prints its segment name and waits to be
// killed.
func holderMain() int {
	ctx := context.Background()
	c, err := Open(ctx, Config{Library: os.Getenv(EnvLibrary), Master: os.Getenv(envChildMaster), SegmentBytes: 32 << 20})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	buf, err := syscall.Mmap(-1, 0, 1<<20, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fill(buf, 7)
	addr := uintptr(unsafe.Pointer(&buf[0]))
	if err := c.Register(ctx, addr, uint64(len(buf))); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	for _, spec := range strings.Split(os.Getenv(envChildArg), ",") {
		name, n, _ := strings.Cut(spec, "=")
		replicas, _ := strconv.Atoi(n)
		errs, err := c.PutFrom(ctx, []string{name}, []Buffer{{addr, uint64(len(buf))}}, PutOptions{Replicas: replicas, Preferred: []string{c.Segment()}})
		if err == nil {
			err = errs[0]
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	fmt.Println(c.Segment())
	select {}
}

// startHolder runs a holder child that puts keys ("name=replicas,...").
func startHolder(t *testing.T, m *mastertest.Master, keys string) (segment string, kill func()) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envChild+"=holder", envChildMaster+"="+m.Addr(), envChildArg+"="+keys, EnvLibrary+"="+mastertest.Lib(t))
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	stderr := &testenv.LockedBuffer{}
	cmd.Stderr = stderr
	require.NoError(t, cmd.Start())
	killed := false
	kill = func() {
		if !killed {
			killed = true
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	}
	t.Cleanup(kill)
	line := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		if sc.Scan() {
			line <- sc.Text()
		}
		close(line)
	}()
	select {
	case segment = <-line:
	case <-time.After(60 * time.Second):
	}
	require.NotEmpty(t, segment, "the holder child did not come up: %s", stderr.String())
	return segment, kill
}

// fill writes the pattern of seed into b.
func fill(b []byte, seed byte) {
	for i := range b {
		b[i] = byte(i*131+i>>9) ^ seed
	}
}

// sideEffectsMain loads the library and opens a client, and prints what
// changed in the process as JSON.
func sideEffectsMain() int {
	var fx processEffects
	fx.SigpipeIgnoredBefore = testenv.SigpipeIgnored()
	fx.ThreadsBefore = testenv.Threads()
	if _, err := Load(os.Getenv(EnvLibrary)); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	fx.SigpipeIgnoredAfterLoad = testenv.SigpipeIgnored()
	c, err := Open(context.Background(), Config{Library: os.Getenv(EnvLibrary), Master: os.Getenv(envChildMaster), SegmentBytes: 16 << 20})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	fx.ThreadsAfterOpen = testenv.Threads()
	start := time.Now()
	if err := c.Close(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fx.CloseSeconds = time.Since(start).Seconds()
	fx.ThreadsAfterClose = testenv.Threads()
	fx.LogLevel = os.Getenv("MC_LOG_LEVEL")
	fx.RPCTimeout = os.Getenv("MC_RPC_TIMEOUT_MS")
	if err := json.NewEncoder(os.Stdout).Encode(fx); err != nil {
		return 1
	}
	return 0
}

type processEffects struct {
	SigpipeIgnoredBefore, SigpipeIgnoredAfterLoad bool
	ThreadsBefore, ThreadsAfterOpen               int
	ThreadsAfterClose                             int
	CloseSeconds                                  float64
	LogLevel, RPCTimeout                          string
}
