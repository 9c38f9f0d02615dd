// Package mocklib finds the mock Transfer Engine library for tests: the one
// $MCB_TE_MOCK_LIB names (the CMake build's), else one compiled from
// mooncake-capi/mock with the system C compiler, so `go test ./...` needs
// no prior CMake build.
package mocklib

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
)

// Env names a prebuilt mock library.
const Env = "MCB_TE_MOCK_LIB"

// Find returns the mock's path and a cleanup that removes what it built.
func Find() (path string, cleanup func(), err error) {
	if p := os.Getenv(Env); p != "" {
		if _, err := os.Stat(p); err == nil {
			return p, func() {}, nil
		}
	}
	_, self, _, _ := runtime.Caller(0)
	sources, err := filepath.Glob(filepath.Join(filepath.Dir(self), "../../../../mooncake-capi/mock/*.c"))
	if err != nil || len(sources) == 0 {
		return "", nil, fmt.Errorf("mock sources not found (%v); set %s", err, Env)
	}
	dir, err := os.MkdirTemp("", "mcb-te-mock-")
	if err != nil {
		return "", nil, err
	}
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "cc"
	}
	out := filepath.Join(dir, "libmooncake_te_mock.so")
	args := append([]string{"-shared", "-fPIC", "-O2", "-pthread", "-Wall", "-Wextra", "-Werror", "-o", out}, sources...)
	if msg, err := exec.Command(cc, args...).CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return "", nil, fmt.Errorf("building the mock: %v\n%s", err, msg)
	}
	return out, func() { os.RemoveAll(dir) }, nil
}
