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
	msg, err := exec.Command("go", "build", "-buildmode=c-archive", "-o", archive, "./testdata/carchive").CombinedOutput()
	require.NoError(t, err, "go build -buildmode=c-archive:\n%s", msg)
	prog := filepath.Join(dir, "selftest")
	msg, err = exec.Command("cc", "-o", prog, "testdata/carchive/main.c", archive, "-lpthread", "-ldl").CombinedOutput()
	require.NoError(t, err, "link:\n%s", msg)
	out, err := exec.Command(prog, mockLib).CombinedOutput()
	require.NoError(t, err, "the C program said:\n%s", out)
	require.Contains(t, string(out), "selftest ok", "the C program's output")
}
