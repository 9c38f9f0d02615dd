//go:build linux && (amd64 || arm64)

package mooncake

import "github.com/mcbridge/mcbridge/internal/status"

// What other bindings of Mooncake libraries share with this one. Mooncake
// Store's C client (libmooncake_store.so, bound by internal/store/mooncake)
// whole-archives a copy of the Transfer Engine, so it has the same load-time
// hazards and reads the same environment.

// CheckLibrary resolves path the way Load does and inspects the file and its
// DT_NEEDED closure before anything maps it: a library that is, or needs, a
// Go c-shared object is refused (it would start a second Go runtime). It
// returns the resolved path and the closure's sonames.
func CheckLibrary(path string) (canon string, needed []string, err error) {
	canon, err = canonicalPath(path)
	if err != nil {
		return "", nil, status.Wrap(status.Config, err, "library "+path)
	}
	needed, err = checkSingleGoRuntime(canon)
	return canon, needed, err
}

// PrepareEnvironment sets what an embedded Transfer Engine reads from the
// environment (libraryEnvironment), where the host has not set it, under the
// same lock as Load.
func PrepareEnvironment() error {
	libraries.Lock()
	defer libraries.Unlock()
	return setLibraryEnvironment()
}
