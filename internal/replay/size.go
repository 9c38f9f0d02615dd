package replay

import (
	"math"
	"strconv"
	"strings"

	"github.com/mcbridge/mcbridge/internal/status"
)

// ParseBytes reads a byte count: a number, optionally fractional, and an
// optional binary unit K, M, G or T, each optionally followed by "iB" or
// "B" ("64G", "1.5TiB", "4096").
func ParseBytes(s string) (int64, error) {
	num := strings.TrimSpace(s)
	scale := 1.0
	for _, suffix := range []string{"iB", "B"} {
		if len(num) > len(suffix) && strings.HasSuffix(num, suffix) {
			num = num[:len(num)-len(suffix)]
			break
		}
	}
	if n := len(num); n > 0 {
		if i := strings.IndexByte("KMGT", num[n-1]); i >= 0 {
			scale = math.Pow(1024, float64(i+1))
			num = num[:n-1]
		}
	}
	v, err := strconv.ParseFloat(num, 64)
	if err != nil || !(v >= 0) || strings.ContainsAny(num, "eEnNxXpP_+") {
		return 0, status.Errorf(status.InvalidArg, "byte count %q: want a number and an optional K, M, G or T", s)
	}
	if v*scale >= math.MaxInt64 {
		return 0, status.Errorf(status.InvalidArg, "byte count %q overflows", s)
	}
	return int64(v * scale), nil
}
