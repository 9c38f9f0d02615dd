// Package llamapin holds the llama.cpp version pin (PIN) that the patches,
// the state-format parsers and every model fingerprint are written against.
// The Go side embeds the same file that llama-patches/apply.sh, the build
// scripts and the CMake hook read, so the pin is stated once.
package llamapin

import (
	_ "embed"
	"strings"
)

//go:embed PIN
var pin string

// Tag is PIN's LLAMA_TAG, e.g. "v0.5.0".
var Tag = value("LLAMA_TAG")

func value(name string) string {
	for _, line := range strings.Split(pin, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), name+"="); ok {
			return v
		}
	}
	panic("internal/llamapin/PIN has no " + name)
}
