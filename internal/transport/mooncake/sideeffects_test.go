//go:build linux && (amd64 || arm64)

package mooncake

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/testenv"
)

// processEffects is what a child saw loading and opening a library.
type processEffects struct {
	SigpipeIgnoredBefore    bool
	SigpipeIgnoredAfterLoad bool
	NofileBefore            uint64
	NofileHard              uint64
	NofileAfterOpen         uint64
	ThreadsAfterLoad        int
	ThreadsAfterOpen        int
	stderr                  string
}

// sideEffects runs the "sideeffects" child on lib. The environment the
// binding sets is left out, so that the child's binding sets it afresh.
func sideEffects(t *testing.T, lib string, env ...string) processEffects {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "MC_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(append(cmd.Env, envChild+"=sideeffects", envChildLib+"="+lib), env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	require.NoError(t, cmd.Run(), "side-effects child: %s", stderr.String())
	var fx processEffects
	require.NoError(t, json.Unmarshal(stdout.Bytes(), &fx), "child said %q", stdout.String())
	fx.stderr = stderr.String()
	return fx
}

// sideEffectsMain lowers RLIMIT_NOFILE (Go raised it at start), loads the
// library, opens and closes an engine, and prints what changed as JSON.
func sideEffectsMain() int {
	var fx processEffects
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	fx.NofileHard = rl.Max
	rl.Cur = min(1024, rl.Max)
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	fx.NofileBefore = rl.Cur
	fx.SigpipeIgnoredBefore = testenv.SigpipeIgnored()
	if _, err := Load(os.Getenv(envChildLib)); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	fx.SigpipeIgnoredAfterLoad = testenv.SigpipeIgnored()
	fx.ThreadsAfterLoad = testenv.Threads()
	e, err := Open(Config{Library: os.Getenv(envChildLib)})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	fx.ThreadsAfterOpen = testenv.Threads()
	_ = syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl)
	fx.NofileAfterOpen = rl.Cur
	if err := e.Close(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if err := json.NewEncoder(os.Stdout).Encode(fx); err != nil {
		return 1
	}
	return 0
}
