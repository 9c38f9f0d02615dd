package testenv

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// What a native library does to the process it is loaded into, as
// /proc/self/status shows it: the side-effects tests of the Mooncake
// bindings measure it in a child before and after loading.

// ProcStatus reads a field of /proc/self/status ("" when absent).
func ProcStatus(field string) string {
	b, _ := os.ReadFile("/proc/self/status")
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, field+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// SigpipeIgnored reports whether the process ignores SIGPIPE.
func SigpipeIgnored() bool {
	mask, err := strconv.ParseUint(ProcStatus("SigIgn"), 16, 64)
	return err == nil && mask&(1<<(uint(syscall.SIGPIPE)-1)) != 0
}

// Threads is the process's thread count.
func Threads() int {
	n, _ := strconv.Atoi(ProcStatus("Threads"))
	return n
}

// Freeze stops process pid (SIGSTOP) and waits until every thread of it
// is stopped: kill returns before that, and a thread still running for a
// few milliseconds can answer a request sent right after.
func Freeze(tb testing.TB, pid int) {
	tb.Helper()
	require.NoError(tb, syscall.Kill(pid, syscall.SIGSTOP))
	require.Eventually(tb, func() bool { return threadsStopped(pid) }, 10*time.Second, 100*time.Microsecond, "process %d never stopped", pid)
}

// threadsStopped reports whether every thread of pid is stopped.
func threadsStopped(pid int) bool {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil || len(tasks) == 0 {
		return false
	}
	for _, task := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", pid, task.Name()))
		// The state is the first field after the command's closing
		// parenthesis: T (stopped) or t (traced).
		i := bytes.LastIndexByte(b, ')')
		if err != nil || i < 0 || i+2 >= len(b) || (b[i+2] != 'T' && b[i+2] != 't') {
			return false
		}
	}
	return true
}

// LoadAverage is the machine's 1, 5 and 15 minute load averages, for
// benchmark reports to say how quiet the machine was.
func LoadAverage() string {
	b, _ := os.ReadFile("/proc/loadavg")
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return ""
	}
	return strings.Join(f[:3], " ")
}
