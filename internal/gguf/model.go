package gguf

import (
	"fmt"
	"math"

	"github.com/mcbridge/mcbridge/internal/status"
)

// Config describes a llama-architecture model. The shape fields map one to one to
// the llama.* metadata keys; Seed picks the random weights.
type Config struct {
	Name              string // general.name
	Seed              uint64
	ContextLength     int // llama.context_length: the training context
	EmbeddingLength   int // n_embd
	BlockCount        int // n_layer
	FeedForwardLength int // n_ff
	HeadCount         int
	HeadCountKV       int
	VocabSize         int // byte tokens, BOS, EOS and merged pairs
	RMSNormEpsilon    float32
	RopeFreqBase      float32
	// Tokenizer, when set, replaces the generated vocabulary: its tokenizer.*
	// metadata is copied as is, and VocabSize must be its Size.
	Tokenizer *Tokenizer
}

// Presets are the models tests and benchmarks share. Copy one and change fields for
// a variant (another seed, another layer count).
//
// tiny loads and runs in milliseconds, for unit and smoke tests. bench has the shape
// docs/design.md §15 measured (12 layers, n_embd 768, 4 KV heads: 12 KiB of f16 KV a
// token), so that its prefill costs what a small real model's does.
var Presets = map[string]Config{
	"tiny": {
		Name: "mcbridge-tiny", Seed: 1,
		ContextLength: 4096, EmbeddingLength: 64, BlockCount: 2, FeedForwardLength: 128,
		HeadCount: 4, HeadCountKV: 2, VocabSize: 512,
		RMSNormEpsilon: 1e-5, RopeFreqBase: 10000,
	},
	"bench": {
		Name: "mcbridge-bench", Seed: 1,
		ContextLength: 16384, EmbeddingLength: 768, BlockCount: 12, FeedForwardLength: 2048,
		HeadCount: 12, HeadCountKV: 4, VocabSize: 4096,
		RMSNormEpsilon: 1e-5, RopeFreqBase: 10000,
	},
}

// maxDim bounds every dimension, far above any preset, so that tensor sizes never
// overflow and a typo fails instead of writing terabytes.
const maxDim = 1 << 20

// Validate reports the first field llama.cpp would reject or that this writer cannot
// produce.
func (c Config) Validate() error {
	dims := []struct {
		name string
		v    int
	}{
		{"ContextLength", c.ContextLength}, {"EmbeddingLength", c.EmbeddingLength},
		{"BlockCount", c.BlockCount}, {"FeedForwardLength", c.FeedForwardLength},
		{"HeadCount", c.HeadCount}, {"HeadCountKV", c.HeadCountKV},
	}
	for _, d := range dims {
		if d.v <= 0 || d.v > maxDim {
			return status.Errorf(status.InvalidArg, "gguf: %s %d outside [1, %d]", d.name, d.v, maxDim)
		}
	}
	switch {
	case c.Name == "":
		return status.Errorf(status.InvalidArg, "gguf: empty Name")
	case c.EmbeddingLength%c.HeadCount != 0:
		return status.Errorf(status.InvalidArg, "gguf: EmbeddingLength %d not a multiple of HeadCount %d", c.EmbeddingLength, c.HeadCount)
	case c.HeadCount%c.HeadCountKV != 0:
		return status.Errorf(status.InvalidArg, "gguf: HeadCount %d not a multiple of HeadCountKV %d", c.HeadCount, c.HeadCountKV)
	case c.headDim()%2 != 0:
		return status.Errorf(status.InvalidArg, "gguf: head size %d is odd; rope rotates pairs", c.headDim())
	case !(c.RMSNormEpsilon > 0) || math.IsInf(float64(c.RMSNormEpsilon), 0):
		return status.Errorf(status.InvalidArg, "gguf: RMSNormEpsilon %v not positive and finite", c.RMSNormEpsilon)
	case !(c.RopeFreqBase > 0) || math.IsInf(float64(c.RopeFreqBase), 0):
		return status.Errorf(status.InvalidArg, "gguf: RopeFreqBase %v not positive and finite", c.RopeFreqBase)
	case c.Tokenizer != nil && c.VocabSize != c.Tokenizer.Size():
		return status.Errorf(status.InvalidArg, "gguf: VocabSize %d, the tokenizer has %d tokens", c.VocabSize, c.Tokenizer.Size())
	case c.Tokenizer == nil && (c.VocabSize < minVocab || c.VocabSize > maxVocab):
		return status.Errorf(status.InvalidArg, "gguf: VocabSize %d outside [%d, %d]", c.VocabSize, minVocab, maxVocab)
	}
	return nil
}

func (c Config) headDim() int { return c.EmbeddingLength / c.HeadCount }

// KVBytesPerToken is the f16 K and V a token occupies in llama.cpp's cache, all
// layers together.
func (c Config) KVBytesPerToken() int {
	return 2 * c.BlockCount * c.HeadCountKV * c.headDim() * 2
}

// header is the model's metadata: the generated vocabulary's unless a Tokenizer is set.
func (c Config) header() []KV {
	if c.Tokenizer != nil {
		return c.metadata(nil)
	}
	return c.metadata(newVocab(c.VocabSize))
}

func (c Config) metadata(v *vocab) []KV {
	u32 := func(n int) Value { return Uint32(uint32(n)) }
	kvs := []KV{
		{"general.architecture", String("llama")},
		{"general.name", String(c.Name)},
		{"general.alignment", Uint32(DefaultAlignment)},
		{"general.file_type", Uint32(1)}, // LLAMA_FTYPE_MOSTLY_F16
		{"llama.context_length", u32(c.ContextLength)},
		{"llama.embedding_length", u32(c.EmbeddingLength)},
		{"llama.block_count", u32(c.BlockCount)},
		{"llama.feed_forward_length", u32(c.FeedForwardLength)},
		{"llama.attention.head_count", u32(c.HeadCount)},
		{"llama.attention.head_count_kv", u32(c.HeadCountKV)},
		{"llama.attention.layer_norm_rms_epsilon", Float32(c.RMSNormEpsilon)},
		{"llama.rope.freq_base", Float32(c.RopeFreqBase)},
		{"llama.rope.dimension_count", u32(c.headDim())},
		{"llama.vocab_size", u32(c.VocabSize)},
	}
	if c.Tokenizer != nil {
		return append(kvs, c.Tokenizer.metadata...)
	}
	return append(kvs, []KV{
		{"tokenizer.ggml.model", String("gpt2")},
		{"tokenizer.ggml.pre", String("default")},
		{"tokenizer.ggml.tokens", Strings(v.tokens)},
		{"tokenizer.ggml.token_type", Int32s(v.types)},
		{"tokenizer.ggml.merges", Strings(v.merges)},
		{"tokenizer.ggml.bos_token_id", Uint32(v.bos)},
		{"tokenizer.ggml.eos_token_id", Uint32(v.eos)},
		// A prompt of token ids is then exactly the tokens the KV cache holds.
		{"tokenizer.ggml.add_bos_token", Bool(false)},
	}...)
}

// tensor is one tensor to write: its directory entry and how to make its bytes.
type tensor struct {
	name  string
	typ   TensorType
	shape []uint64 // ne[0] first
	// fill writes the next len(dst) bytes of the tensor, whole elements.
	fill func(dst []byte, rng *splitMix64)
}

func (t tensor) size() uint64 {
	n := tensorTypes[t.typ].typeSize
	for _, d := range t.shape {
		n *= d
	}
	return n
}

// tensors lists the model's tensors in llama.cpp's order. A matrix of fan-in n gets
// uniform weights of standard deviation 1/sqrt(n): with RMS norms before every block
// the residual stream and the logits stay of order one, never Inf or NaN.
func (c Config) tensors() []tensor {
	embd, ff, vocab := uint64(c.EmbeddingLength), uint64(c.FeedForwardLength), uint64(c.VocabSize)
	kv := uint64(c.HeadCountKV * c.headDim())
	matrix := func(name string, in, out uint64) tensor {
		return TensorSpec{name, []uint64{in, out}, Random}.tensor()
	}
	norm := func(name string) tensor { return TensorSpec{name, []uint64{embd}, Ones}.tensor() }

	ts := []tensor{
		matrix("token_embd.weight", embd, vocab),
		norm("output_norm.weight"),
		matrix("output.weight", embd, vocab),
	}
	for i := range c.BlockCount {
		blk := func(s string) string { return fmt.Sprintf("blk.%d.%s.weight", i, s) }
		ts = append(ts,
			norm(blk("attn_norm")),
			matrix(blk("attn_q"), embd, embd),
			matrix(blk("attn_k"), embd, kv),
			matrix(blk("attn_v"), embd, kv),
			matrix(blk("attn_output"), embd, embd),
			norm(blk("ffn_norm")),
			matrix(blk("ffn_gate"), embd, ff),
			matrix(blk("ffn_down"), ff, embd),
			matrix(blk("ffn_up"), embd, ff),
		)
	}
	return ts
}
