package gguf

import (
	"encoding/binary"
	"os"
	"slices"
	"strings"

	"github.com/mcbridge/mcbridge/internal/status"
)

// Tokenizer is the tokenizer.* metadata of a GGUF model, copied as is into a generated
// one (Config.Tokenizer): the generated model then tokenizes as that file's model
// does. llama.cpp's models/ggml-vocab-*.gguf are such files, one per vocabulary kind
// (sentencepiece, BPE, WordPiece, ...).
type Tokenizer struct {
	metadata []KV
	size     int
}

// Size is the number of tokens.
func (t *Tokenizer) Size() int { return t.size }

// ReadTokenizer reads the tokenizer of the GGUF file at path.
func ReadTokenizer(path string) (*Tokenizer, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	g, err := Read(f)
	if err != nil {
		return nil, status.Wrap(status.InvalidArg, err, path)
	}
	t := &Tokenizer{}
	for _, kv := range g.Metadata {
		if strings.HasPrefix(kv.Key, "tokenizer.") {
			t.metadata = append(t.metadata, kv)
		}
	}
	v, _ := g.Lookup("tokenizer.ggml.tokens")
	tokens, ok := v.Strings()
	if !ok || len(tokens) == 0 {
		return nil, status.Errorf(status.InvalidArg, "gguf: %s has no tokenizer.ggml.tokens", path)
	}
	t.size = len(tokens)
	return t, nil
}

// KVs is the tokenizer.* metadata, for WriteModelFile.
func (t *Tokenizer) KVs() []KV { return slices.Clone(t.metadata) }

// WithControlTokens returns a copy of t with the tokens appended as control tokens
// (score 0 where the vocabulary has scores), the way a model's own special tokens
// (fill-in-the-middle markers, say) extend a base vocabulary.
func (t *Tokenizer) WithControlTokens(tokens ...string) (*Tokenizer, error) {
	out := &Tokenizer{size: t.size + len(tokens)}
	for _, kv := range t.metadata {
		v := kv.Value
		switch kv.Key {
		case "tokenizer.ggml.tokens":
			v = Strings(append(slices.Clone(v.strs), tokens...))
		case "tokenizer.ggml.scores", "tokenizer.ggml.token_type":
			if v.typ != TypeArray || v.elem.size() != 4 || v.n != uint64(t.size) {
				return nil, status.Errorf(status.InvalidArg, "gguf: %s is not %d 4-byte elements", kv.Key, t.size)
			}
			elem := uint32(0) // f32 0 or, for token_type, control
			if kv.Key == "tokenizer.ggml.token_type" {
				elem = tokenControl
			}
			raw := slices.Clone(v.raw)
			for range tokens {
				raw = binary.LittleEndian.AppendUint32(raw, elem)
			}
			v = Value{typ: TypeArray, elem: v.elem, n: uint64(out.size), raw: raw}
		}
		out.metadata = append(out.metadata, KV{kv.Key, v})
	}
	return out, nil
}
