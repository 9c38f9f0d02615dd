package etcd

import (
	"strings"
	"testing"

	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

func TestBlockKeyLayout(t *testing.T) {
	model := key.Fingerprint{0: 0xab, 15: 0x01}
	k := key.BlockKey{0: 0xff, 15: 0x10}
	got := blockKey("/mcbridge", model, k)
	want := "/mcbridge/ab000000000000000000000000000001/b/ff000000000000000000000000000010"
	if got != want {
		t.Fatalf("blockKey = %q, want %q", got, want)
	}
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
			if tc.ok != (err == nil) || (tc.ok && got != k) {
				t.Fatalf("parseBlockKey(%q) = %s, %v", tc.in, got, err)
			}
			if err != nil && status.Of(err) != status.Directory {
				t.Fatalf("error %v has status %v", err, status.Of(err))
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
			if status.Of(err) != status.Directory {
				t.Fatalf("error %v has status %v", err, status.Of(err))
			}
			return
		}
		if again := blockKey(DefaultPrefix, model, k); again != s {
			t.Fatalf("accepted %q, which names %s, written %q", s, k, again)
		}
	})
}
