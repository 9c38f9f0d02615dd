package gguf

import (
	"os"
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
