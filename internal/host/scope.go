package host

import (
	"math"
	"sort"
	"strconv"
	"strings"

	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Adapter is a LoRA adapter applied to a request, by its file and scale.
type Adapter struct {
	Path  string
	Scale float32
}

// MaxAdapters bounds a request's adapter set.
const MaxAdapters = 256

// NewScope is the key space of a request: its tenant salt and the adapters
// it runs with. An adapter is named by the digest of its file, not its
// path, so hosts that load the same adapter from different places share
// its KV; adapters at scale 0 change nothing and are left out; the set is
// sorted, so the order a request lists them in does not matter.
func NewScope(tenant []byte, adapters []Adapter) (key.Scope, error) {
	if len(adapters) > MaxAdapters {
		return key.Scope{}, status.Errorf(status.InvalidArg, "%d adapters (at most %d)", len(adapters), MaxAdapters)
	}
	parts := make([]string, 0, len(adapters))
	for _, a := range adapters {
		if math.IsNaN(float64(a.Scale)) || math.IsInf(float64(a.Scale), 0) {
			return key.Scope{}, status.Errorf(status.InvalidArg, "adapter %s at scale %v", a.Path, a.Scale)
		}
		if a.Scale == 0 {
			continue
		}
		d, err := key.FileDigest(a.Path)
		if err != nil {
			return key.Scope{}, status.Wrap(status.InvalidArg, err, "digesting adapter "+a.Path)
		}
		parts = append(parts, d.String()+"@"+strconv.FormatFloat(float64(a.Scale), 'g', -1, 32))
	}
	sort.Strings(parts)
	s := key.Scope{Adapters: strings.Join(parts, ";")}
	if len(tenant) > 0 {
		s.TenantSalt = append([]byte(nil), tenant...)
	}
	return s, nil
}
