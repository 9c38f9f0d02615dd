//go:build linux && (amd64 || arm64)

package mooncake

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
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
	if msg, err := exec.Command("go", "build", "-buildmode=c-archive", "-o", archive, "./testdata/carchive").CombinedOutput(); err != nil {
		t.Fatalf("go build -buildmode=c-archive: %v\n%s", err, msg)
	}
	prog := filepath.Join(dir, "selftest")
	if msg, err := exec.Command("cc", "-o", prog, "testdata/carchive/main.c", archive, "-lpthread", "-ldl").CombinedOutput(); err != nil {
		t.Fatalf("link: %v\n%s", err, msg)
	}
	out, err := exec.Command(prog, mockLib).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "selftest ok") {
		t.Fatalf("the C program said: %v\n%s", err, out)
	}
}
