package etcd

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

func TestBlockKeyLayout(t *testing.T) {
	model := key.Fingerprint{0: 0xab, 15: 0x01}
	k := key.BlockKey{0: 0xff, 15: 0x10}
	got := blockKey("/mcbridge", model, k)
	want := "/mcbridge/ab000000000000000000000000000001/b/ff000000000000000000000000000010"
	require.Equal(t, want, got, "blockKey")
	prefix := modelPrefix("/mcbridge", model)
	cases := []struct {
		name string
		in   string
		ok   bool
	}{
		{"written form", want, true},
		{"other model", blockKey("/mcbridge", key.Fingerprint{1}, k), false},
		{"upper case", prefix + strings.ToUpper(k.String()), false},
		{"short", want[:len(want)-1], false},
		{"long", want + "0", false},
		{"not hex", prefix + strings.Repeat("g", 32), false},
		{"bare prefix", prefix, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseBlockKey(prefix, []byte(tc.in))
			if tc.ok {
				require.NoError(t, err, "parseBlockKey(%q)", tc.in)
				require.Equal(t, k, got, "parseBlockKey(%q)", tc.in)
			} else {
				require.Error(t, err, "parseBlockKey(%q) = %s", tc.in, got)
			}
			if err != nil {
				require.Equal(t, status.Directory, status.Of(err), "error %v", err)
			}
		})
	}
}

// FuzzParseBlockKey checks that parseBlockKey accepts exactly the keys
// blockKey writes.
func FuzzParseBlockKey(f *testing.F) {
	model := key.Fingerprint{7}
	prefix := modelPrefix(DefaultPrefix, model)
	f.Add(blockKey(DefaultPrefix, model, key.BlockKey{1, 2, 3}))
	f.Add(prefix + "ZZ")
	f.Add(prefix + strings.Repeat("A", 32))
	f.Add("")
	f.Fuzz(func(t *testing.T, s string) {
		k, err := parseBlockKey(prefix, []byte(s))
		if err != nil {
			require.Equal(t, status.Directory, status.Of(err), "error %v", err)
			return
		}
		require.Equal(t, s, blockKey(DefaultPrefix, model, k), "accepted %q, which names %s, written otherwise", s, k)
	})
}
