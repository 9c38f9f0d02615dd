package gguf

import (
	"bytes"
	"encoding/binary"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A tokenizer read from one model and written into another arrives unchanged, with
// the other model's shape.
func TestTokenizerCopied(t *testing.T) {
	dir := t.TempDir()
	from := filepath.Join(dir, "from.gguf")
	src := tinyWith(func(c *Config) { c.VocabSize = 300 })
	require.NoError(t, WriteFile(from, src))
	tok, err := ReadTokenizer(from)
	require.NoError(t, err)
	require.Equal(t, 300, tok.Size())

	cfg := tinyWith(func(c *Config) { c.BlockCount = 3; c.Tokenizer = tok; c.VocabSize = tok.Size() })
	f, err := Read(bytes.NewReader(write(t, cfg)))
	require.NoError(t, err)
	got, want := tokenizerKVs(f.Metadata), tokenizerKVs(src.header())
	require.Len(t, got, len(want))
	for i := range want {
		assert.Equal(t, want[i].Key, got[i].Key)
		assert.True(t, want[i].Value.Equal(got[i].Value), "%s = %v, want %v", got[i].Key, got[i].Value, want[i].Value)
	}
	n, _ := f.Lookup("llama.block_count")
	assert.Equal(t, "3", n.String())
	require.Len(t, f.Tensors, 3+9*3)
	assert.Equal(t, []uint64{64, 300}, f.Tensors[0].Shape, "token_embd spans the copied vocabulary")
}

func tokenizerKVs(kvs []KV) []KV {
	var out []KV
	for _, kv := range kvs {
		if strings.HasPrefix(kv.Key, "tokenizer.") {
			out = append(out, kv)
		}
	}
	return out
}

func TestTokenizerErrors(t *testing.T) {
	dir := t.TempDir()
	from := filepath.Join(dir, "from.gguf")
	require.NoError(t, WriteFile(from, Presets["tiny"]))
	tok, err := ReadTokenizer(from)
	require.NoError(t, err)
	assert.Error(t, tinyWith(func(c *Config) { c.Tokenizer = tok; c.VocabSize = tok.Size() + 1 }).Validate(), "a vocabulary size that is not the tokenizer's")

	_, err = ReadTokenizer(filepath.Join(dir, "missing.gguf"))
	assert.Error(t, err)
	junk := filepath.Join(dir, "junk.gguf")
	require.NoError(t, os.WriteFile(junk, []byte("GGUF junk"), 0o644))
	_, err = ReadTokenizer(junk)
	assert.Error(t, err)
	var buf bytes.Buffer
	require.NoError(t, encode(&buf, func(e *encoder) { e.write([]KV{{"general.architecture", String("llama")}}, nil, 1) }))
	empty := filepath.Join(dir, "empty.gguf")
	require.NoError(t, os.WriteFile(empty, buf.Bytes(), 0o644))
	_, err = ReadTokenizer(empty)
	assert.ErrorContains(t, err, "no tokenizer.ggml.tokens")
}

// Appended control tokens extend the tokens, scores and types alike; the rest of the
// tokenizer is unchanged.
func TestWithControlTokens(t *testing.T) {
	p := filepath.Join(t.TempDir(), "m.gguf")
	require.NoError(t, WriteFile(p, tinyWith(func(c *Config) { c.VocabSize = 300 })))
	tok, err := ReadTokenizer(p)
	require.NoError(t, err)
	ext, err := tok.WithControlTokens("<PRE>", "<SUF>")
	require.NoError(t, err)
	require.Equal(t, 302, ext.Size())
	require.Equal(t, 300, tok.Size(), "the original is unchanged")
	for _, kv := range ext.KVs() {
		switch kv.Key {
		case "tokenizer.ggml.tokens":
			s, _ := kv.Value.Strings()
			require.Len(t, s, 302)
			assert.Equal(t, []string{"<PRE>", "<SUF>"}, s[300:])
		case "tokenizer.ggml.token_type":
			v, _ := kv.Value.Ints()
			require.Len(t, v, 302)
			assert.Equal(t, []int64{tokenControl, tokenControl}, v[300:])
		default:
			old := tokenizerKVs(tok.KVs())
			i := slices.IndexFunc(old, func(o KV) bool { return o.Key == kv.Key })
			require.GreaterOrEqual(t, i, 0, kv.Key)
			assert.True(t, old[i].Value.Equal(kv.Value), kv.Key)
		}
	}

	// A model written with it has the longer vocabulary.
	q := filepath.Join(t.TempDir(), "n.gguf")
	require.NoError(t, WriteFile(q, tinyWith(func(c *Config) { c.Tokenizer = ext; c.VocabSize = ext.Size() })))
	back, err := ReadTokenizer(q)
	require.NoError(t, err)
	assert.Equal(t, 302, back.Size())
}

// A sentencepiece vocabulary's scores get 0 for the new tokens; arrays that do not
// match the vocabulary are refused.
func TestWithControlTokensScores(t *testing.T) {
	f32s := func(v ...float32) Value {
		var raw []byte
		for _, x := range v {
			raw = binary.LittleEndian.AppendUint32(raw, math.Float32bits(x))
		}
		return Value{typ: TypeArray, elem: TypeFloat32, n: uint64(len(v)), raw: raw}
	}
	tok := &Tokenizer{size: 2, metadata: []KV{
		{"tokenizer.ggml.tokens", Strings([]string{"a", "b"})},
		{"tokenizer.ggml.scores", f32s(-1, -2)},
	}}
	ext, err := tok.WithControlTokens("<MID>")
	require.NoError(t, err)
	assert.True(t, ext.KVs()[1].Value.Equal(f32s(-1, -2, 0)), "%v", ext.KVs()[1].Value)

	tok.metadata[1].Value = f32s(-1)
	_, err = tok.WithControlTokens("<MID>")
	require.Error(t, err)
}
