package tree

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// envLlamaSrc names the pinned llama.cpp source tree (scripts/llama/fetch.sh;
// make test sets it from build/e2e.env).
const envLlamaSrc = "MCB_LLAMA_SRC"

// The series cut again from the commits llama-patches/recut.sh makes of it
// is the committed series, byte for byte: a re-cut after an edit changes
// only what was edited.
func TestRecutIsIdentity(t *testing.T) {
	src := os.Getenv(envLlamaSrc)
	require.NotEmpty(t, src, "%s is not set: it names the pinned llama.cpp tree (make test sets it)", envLlamaSrc)
	top, _ := repoFiles(t)
	recut := filepath.Join(top, "llama-patches", "recut.sh")
	dir, out := filepath.Join(t.TempDir(), "tree"), t.TempDir()
	run := func(args ...string) {
		t.Helper()
		msg, err := exec.Command(recut, args...).CombinedOutput()
		require.NoError(t, err, "recut.sh %v:\n%s", args, msg)
	}
	run("tree", src, dir)
	run("cut", dir, out)

	committed, err := filepath.Glob(filepath.Join(top, "llama-patches", "[0-9][0-9][0-9][0-9]-*.patch"))
	require.NoError(t, err)
	require.NotEmpty(t, committed)
	cut, err := filepath.Glob(filepath.Join(out, "*"))
	require.NoError(t, err)
	require.Len(t, cut, len(committed), "one patch a commit")
	for _, p := range committed {
		want, err := os.ReadFile(p)
		require.NoError(t, err)
		got, err := os.ReadFile(filepath.Join(out, filepath.Base(p)))
		require.NoError(t, err, "the re-cut has no %s", filepath.Base(p))
		require.Equal(t, string(want), string(got), "%s re-cut", filepath.Base(p))
	}
}
