package testenv

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/transport/mooncake/mocklib"
)

// Main is the TestMain of a package whose tests use testenv: it runs m,
// removes what the run built (Cleanup) and exits with m's status.
func Main(m *testing.M) {
	code := m.Run()
	Cleanup()
	os.Exit(code)
}

// MainMockTE is Main for tests that load the mock Transfer Engine: *lib
// names the mock (mocklib.Find: $MCB_TE_MOCK_LIB, else one built for this
// run and removed after it) while m runs. A mock that can be neither found
// nor built ends the process with status 2 before any test runs.
func MainMockTE(m *testing.M, lib *string) {
	p, cleanup, err := mocklib.Find()
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: the mock Transfer Engine: %v\n", filepath.Base(os.Args[0]), err)
		os.Exit(2)
	}
	*lib = p
	code := m.Run()
	cleanup()
	Cleanup()
	os.Exit(code)
}

// Child is a helper process a test talks to over its stdin and stdout.
type Child struct {
	Cmd   *exec.Cmd
	Stdin io.WriteCloser
	Out   *bufio.Reader // its stdout
}

// StartChild starts cmd, nil for this test binary again running no test
// (its TestMain then takes the role env gives it), with env added to this
// process's environment, its stderr this process's. The caller ends it.
func StartChild(tb testing.TB, cmd *exec.Cmd, env ...string) *Child {
	tb.Helper()
	if cmd == nil {
		cmd = exec.Command(os.Args[0], "-test.run=^$")
	}
	cmd.Env = append(os.Environ(), env...)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	require.NoError(tb, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(tb, err)
	require.NoError(tb, cmd.Start())
	return &Child{Cmd: cmd, Stdin: stdin, Out: bufio.NewReader(stdout)}
}
