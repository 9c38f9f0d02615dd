package gguf

import (
	"bytes"
	"os"
	"path/filepath"
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
