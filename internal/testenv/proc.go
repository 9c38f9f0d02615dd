package testenv

import (
	"os"
	"strconv"
	"strings"
	"syscall"
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
