//go:build linux && (amd64 || arm64)

package mooncake

import (
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestCArchive builds testdata/carchive as a Go c-archive, links it into a C
// program, as llama.cpp links the bridge, and runs a transfer through the
// binding from C's main thread and from a thread C created.
func TestCArchive(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a c-archive and links a C program")
	}
	dir := t.TempDir()
	archive := filepath.Join(dir, "libselftest.a")
	out, err := exec.Command("go", "build", "-buildmode=c-archive", "-o", archive, "./testdata/carchive").CombinedOutput()
	require.NoError(t, err, "go build -buildmode=c-archive: %s", out)
	prog := filepath.Join(dir, "selftest")
	out, err = exec.Command("cc", "-o", prog, "testdata/carchive/main.c", archive, "-lpthread", "-ldl").CombinedOutput()
	require.NoError(t, err, "link: %s", out)
	runScenarios(t, []scenario{{name: "Selftest", run: func(t *testing.T, lib string) {
		out, err := exec.Command(prog, lib).CombinedOutput()
		require.NoError(t, err, "the C program said: %s", out)
		require.Contains(t, string(out), "selftest ok")
	}}})
}
