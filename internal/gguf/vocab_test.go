package gguf

import (
	"strings"
	"testing"
	"unicode"
)

func TestVocab(t *testing.T) {
	for _, size := range []int{minVocab, 512, 4096, maxVocab} {
		v := newVocab(size)
		if len(v.tokens) != size || len(v.types) != size {
			t.Fatalf("size %d: %d tokens, %d types", size, len(v.tokens), len(v.types))
		}
		if len(v.merges) != size-byteTokens-specials || len(v.merges) < 1 {
			t.Fatalf("size %d: %d merges", size, len(v.merges))
		}
		ids := map[string]int{}
		for i, tok := range v.tokens {
			if j, dup := ids[tok]; dup {
				t.Fatalf("size %d: tokens %d and %d are both %q", size, j, i, tok)
			}
			ids[tok] = i
		}
		if v.tokens[v.bos] != bosTokenStr || v.tokens[v.eos] != eosTokenStr ||
			v.types[v.bos] != tokenControl || v.types[v.eos] != tokenControl {
			t.Fatalf("size %d: bos %d eos %d", size, v.bos, v.eos)
		}
		// llama.cpp splits a merge at its first space after byte 0, and the result
		// must be a token: the concatenation of two tokens.
		for r, m := range v.merges {
			a, b, ok := strings.Cut(m[1:], " ")
			a = m[:1] + a
			if !ok || strings.Contains(b, " ") {
				t.Fatalf("merge %d %q does not split in two", r, m)
			}
			_, okA := ids[a]
			_, okB := ids[b]
			id, okAB := ids[a+b]
			if !okA || !okB || !okAB || v.types[id] != tokenNormal {
				t.Fatalf("merge %d %q: parts or result missing", r, m)
			}
		}
	}
}

// The byte tokens are GPT-2's alphabet: 256 distinct printable runes, one per byte.
func TestByteToUnicode(t *testing.T) {
	m := byteToUnicode()
	seen := map[rune]bool{}
	for b, r := range m {
		if seen[r] || !unicode.IsPrint(r) || unicode.IsSpace(r) {
			t.Fatalf("byte %#02x -> %q", b, r)
		}
		seen[r] = true
	}
	for _, c := range []struct {
		b byte
		r rune
	}{{'a', 'a'}, {' ', 'Ġ'}, {'\n', 'Ċ'}, {0, 'Ā'}, {0xad, 'Ń'}, {0xff, 'ÿ'}} {
		if m[c.b] != c.r {
			t.Errorf("byte %#02x -> %q, want %q", c.b, m[c.b], c.r)
		}
	}
	order := mergeOrder()
	distinct := map[byte]bool{}
	for _, b := range order {
		distinct[b] = true
	}
	if len(order) != 256 || len(distinct) != 256 || order[0] != 'a' {
		t.Errorf("merge order is not a permutation of the bytes starting at 'a': %v", order)
	}
}
