package testenv

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

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
