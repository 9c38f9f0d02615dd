package replay

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseBytes(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
		ok   bool
	}{
		{"0", 0, true},
		{"4096", 4096, true},
		{"64K", 64 << 10, true},
		{"64KiB", 64 << 10, true},
		{"64KB", 64 << 10, true},
		{" 1.5G ", 3 << 29, true},
		{"2T", 2 << 40, true},
		{"12B", 12, true},
		{"", 0, false},
		{"G", 0, false},
		{"-1", 0, false},
		{"1e9", 0, false},
		{"0x10", 0, false},
		{"NaN", 0, false},
		{"Inf", 0, false},
		{"10P", 0, false},
		{"9000000T", 0, false},
		{"1 G", 0, false},
	} {
		got, err := ParseBytes(tc.in)
		if tc.ok {
			assert.NoError(t, err, "ParseBytes(%q)", tc.in)
		} else {
			assert.Error(t, err, "ParseBytes(%q) = %d", tc.in, got)
		}
		assert.Equal(t, tc.want, got, "ParseBytes(%q)", tc.in)
	}
}

func FuzzParseBytes(f *testing.F) {
	for _, s := range []string{"0", "64K", "1.5GiB", "2TB", "-3", "1e3", "B", "iB"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		v, err := ParseBytes(s)
		if err == nil {
			require.GreaterOrEqual(t, v, int64(0), "ParseBytes(%q)", s)
		}
	})
}
