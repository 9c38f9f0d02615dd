package testenv

import (
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Alone runs the test t names in a process of its own, the test binary
// again with env set (and extra added to its environment), and reports
// whether this is that process, which goes on with the test. The parent
// fails when the child fails or never ran the test. For tests of libraries
// whose state is per process, where one test's leftovers would reach the
// next.
func Alone(t *testing.T, env string, extra ...string) bool {
	t.Helper()
	if os.Getenv(env) != "" {
		return true
	}
	var pattern []string
	for _, part := range strings.Split(t.Name(), "/") {
		pattern = append(pattern, "^"+regexp.QuoteMeta(part)+"$")
	}
	args := []string{"-test.run=" + strings.Join(pattern, "/"), "-test.count=1", "-test.v"}
	if d, ok := t.Deadline(); ok {
		args = append(args, "-test.timeout="+time.Until(d).Round(time.Second).String())
	}
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(append(os.Environ(), env+"=1"), extra...)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s in its own process:\n%s", t.Name(), out)
	require.Contains(t, string(out), "--- PASS: "+t.Name()+" ", "%s never ran in its own process:\n%s", t.Name(), out)
	return false
}
