package gguf

import (
	"strings"
	"testing"
	"unicode"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestVocab(t *testing.T) {
	for _, size := range []int{minVocab, 512, 4096, maxVocab} {
		v := newVocab(size)
		require.Equal(t, size, len(v.tokens), "size %d: tokens", size)
		require.Equal(t, size, len(v.types), "size %d: types", size)
		require.Equal(t, size-byteTokens-specials, len(v.merges), "size %d: merges", size)
		require.NotEmpty(t, v.merges, "size %d: merges", size)
		ids := map[string]int{}
		for i, tok := range v.tokens {
			j, dup := ids[tok]
			require.False(t, dup, "size %d: tokens %d and %d are both %q", size, j, i, tok)
			ids[tok] = i
		}
		require.Equal(t, bosTokenStr, v.tokens[v.bos], "size %d: bos %d", size, v.bos)
		require.Equal(t, eosTokenStr, v.tokens[v.eos], "size %d: eos %d", size, v.eos)
		require.Equal(t, int32(tokenControl), v.types[v.bos], "size %d: bos %d", size, v.bos)
		require.Equal(t, int32(tokenControl), v.types[v.eos], "size %d: eos %d", size, v.eos)
		// llama.cpp splits a merge at its first space after byte 0, and the result
		// must be a token: the concatenation of two tokens.
		for r, m := range v.merges {
			a, b, ok := strings.Cut(m[1:], " ")
			a = m[:1] + a
			require.True(t, ok, "merge %d %q does not split in two", r, m)
			require.False(t, strings.Contains(b, " "), "merge %d %q does not split in two", r, m)
			_, okA := ids[a]
			_, okB := ids[b]
			id, okAB := ids[a+b]
			require.True(t, okA, "merge %d %q: first part missing", r, m)
			require.True(t, okB, "merge %d %q: second part missing", r, m)
			require.True(t, okAB, "merge %d %q: result missing", r, m)
			require.True(t, v.types[id] == tokenNormal, "merge %d %q: result of type %d", r, m, v.types[id])
		}
	}
}

// The byte tokens are GPT-2's alphabet: 256 distinct printable runes, one per byte.
func TestByteToUnicode(t *testing.T) {
	m := byteToUnicode()
	seen := map[rune]bool{}
	for b, r := range m {
		require.False(t, seen[r], "byte %#02x -> %q, seen before", b, r)
		require.True(t, unicode.IsPrint(r), "byte %#02x -> %q, not printable", b, r)
		require.False(t, unicode.IsSpace(r), "byte %#02x -> %q, a space", b, r)
		seen[r] = true
	}
	for _, c := range []struct {
		b byte
		r rune
	}{{'a', 'a'}, {' ', 'Ġ'}, {'\n', 'Ċ'}, {0, 'Ā'}, {0xad, 'Ń'}, {0xff, 'ÿ'}} {
		assert.Equal(t, c.r, m[c.b], "byte %#02x -> %q, want %q", c.b, m[c.b], c.r)
	}
	order := mergeOrder()
	distinct := map[byte]bool{}
	for _, b := range order {
		distinct[b] = true
	}
	assert.Len(t, distinct, 256, "merge order is not a permutation of the bytes: %v", order)
	if assert.Len(t, order, 256, "merge order is not a permutation of the bytes") {
		assert.Equal(t, byte('a'), order[0], "merge order does not start at 'a'")
	}
}
