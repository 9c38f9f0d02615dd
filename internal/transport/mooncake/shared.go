//go:build linux && (amd64 || arm64)

package mooncake

import (
	"strings"

	"github.com/ebitengine/purego"

	"github.com/mcbridge/mcbridge/internal/status"
)

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

// Symbol is one C function of a binding's table: its name, whether the
// binding needs it, and where its address goes in the binding's symbol
// struct T.
type Symbol[T any] struct {
	Name     string
	Required bool
	Slot     func(*T) *uintptr
}

// OpenSymbols dlopens path RTLD_NOW|RTLD_LOCAL and fills syms from table:
// 0 for a symbol the library lacks, an error naming every missing required
// one (what says what the library should have been).
func OpenSymbols[T any](path, what string, table []Symbol[T], syms *T) (handle uintptr, err error) {
	// RTLD_LOCAL: these libraries export their C++ internals (asio, glog's
	// flags, a whole Transfer Engine), which must not bind the host's
	// symbols, nor another Mooncake library's when both are loaded.
	handle, err = purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		return 0, status.Wrap(status.Config, err, "dlopen "+path)
	}
	var missing []string
	for _, s := range table {
		addr, err := purego.Dlsym(handle, s.Name)
		if err != nil {
			addr = 0
		}
		*s.Slot(syms) = addr
		if addr == 0 && s.Required {
			missing = append(missing, s.Name)
		}
	}
	if len(missing) > 0 {
		// The handle stays open: dlclose of a C++ library whose constructors
		// already ran can leave exit handlers pointing at unmapped code.
		return 0, status.Errorf(status.Unsupported, "%s is not a usable %s library: missing %s", path, what, strings.Join(missing, ", "))
	}
	return handle, nil
}

// HasSymbol reports whether syms, filled from table, holds the named
// function.
func HasSymbol[T any](table []Symbol[T], syms *T, name string) bool {
	for _, s := range table {
		if s.Name == name {
			return *s.Slot(syms) != 0
		}
	}
	return false
}
