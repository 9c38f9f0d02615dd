//go:build llamasuite

package llamasuite

import (
	"crypto/sha1"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/mcbridge/mcbridge/internal/gguf"
)

// The suite's models, generated with random weights: the architecture, the
// hyperparameters and the vocabulary kind of the model each replaces, the tokenizer
// of the tree's models/ggml-vocab-<vocab>.gguf. What a test checks of a trained
// model's text (a regex on a story, a relevance order) fails on stock and patched
// alike; what it checks of llama-server (shapes, counts, errors, slots, caching,
// speculative decoding's equality with plain decoding) runs for real.

// model is one generated stand-in.
type model struct {
	name  string // also its file name, <name>.gguf
	vocab string
	// fim appends fill-in-the-middle control tokens to the vocabulary, spelled as
	// llama.cpp recognises them, as the infill model's own tokenizer has them.
	fim   bool
	build func(name string, tok *gguf.Tokenizer) ([]gguf.KV, []gguf.TensorSpec)
}

// hubFile is where the suite finds a model on the hub: ServerPreset's --hf-repo and
// --hf-file (or the file llama.cpp picks for a repo:tag), and the router's list of
// cached models. A file's tag is what follows its name's last '-' or '.'.
type hubFile struct {
	repo, path, model string
}

// stories260K is llama2.c's 260K model (ggml-org/test-model-stories260K, the
// tinyllama2 preset most tests use): 5 layers, n_embd 64, 8 heads, 4 KV heads, n_ff
// 172, trained context 512, a sentencepiece vocabulary. stories15M is llama2.c's 15M
// model (6 layers, n_embd 288, 6 heads, n_ff 768, context 256, LLaMA's own
// sentencepiece vocabulary), the speculative tests' draft; stories15M_MOE is it with
// 4 experts of which 2 are used, the stories15m_moe preset.
var (
	stories260K = llamaShape{ctx: 512, embd: 64, layers: 5, ff: 172, heads: 8, kvHeads: 4}
	stories15M  = llamaShape{ctx: 256, embd: 288, layers: 6, ff: 768, heads: 6, kvHeads: 6}
)

var models = []model{
	{name: "stories260K", vocab: "llama-spm", build: stories260K.build},
	{name: "stories260K-infill", vocab: "llama-spm", fim: true, build: stories260K.build},
	{name: "stories15M", vocab: "llama-spm", build: stories15M.build},
	{name: "stories15M_MOE", vocab: "llama-spm", build: stories15M.withExperts(4, 2).build},
	// bge-small-en-v1.5 (bert_bge_small): the tree's bert-bge vocabulary file carries
	// its shape too.
	{name: "bert-bge-small", vocab: "bert-bge", build: bertShape{arch: "bert", ctx: 512, embd: 384, layers: 12, ff: 1536, heads: 12, pooling: poolingCLS}.build},
	// jina-reranker-v1-tiny-en (jina_reranker_tiny): JinaBERT, 4 layers, n_embd 384,
	// 12 heads, GEGLU feed-forward of 1536, ALiBi up to 8192 positions, a WordPiece
	// vocabulary and a one-logit classifier head.
	{name: "jina-reranker-v1-tiny-en", vocab: "bert-bge", build: bertShape{arch: "jina-bert-v2", ctx: 8192, embd: 384, layers: 4, ff: 1536, heads: 12, pooling: poolingRank}.build},
	// tinygemma3 (the text model of ggml-org/tinygemma3-GGUF): Gemma 3's layout
	// (query and key norms, post-norms, GQA, sliding-window layers five in six) at a
	// tiny size, a sentencepiece vocabulary.
	{name: "tinygemma3", vocab: "llama-spm", build: gemma3Shape{ctx: 32768, embd: 128, layers: 6, ff: 512, heads: 4, kvHeads: 1, headDim: 32, window: 512}.build},
}

var hubFiles = []hubFile{
	{"ggml-org/test-model-stories260K", "stories260K-F32.gguf", "stories260K"},
	{"ggml-org/test-model-stories260K-infill", "stories260K-infill-F32.gguf", "stories260K-infill"},
	{"ggml-org/models", "tinyllamas/stories260K.gguf", "stories260K"},
	{"ggml-org/models", "bert-bge-small/ggml-model-f16.gguf", "bert-bge-small"},
	{"ggml-org/models", "jina-reranker-v1-tiny-en/ggml-model-f16.gguf", "jina-reranker-v1-tiny-en"},
	{"ggml-org/stories15M_MOE", "stories15M_MOE-F16.gguf", "stories15M_MOE"},
	{"ggml-org/tinygemma3-GGUF", "tinygemma3-Q8_0.gguf", "tinygemma3"},
}

// downloads are the files tests fetch with utils.download_file, which keeps a file
// already in tmp/: the draft model of test_speculative.
var downloads = map[string]string{"stories15M-q4_0.gguf": "stories15M"}

// writeModels generates every stand-in into dir and returns their paths by name.
func writeModels(src, dir string) (map[string]string, error) {
	out := map[string]string{}
	for i, m := range models {
		tok, err := gguf.ReadTokenizer(filepath.Join(src, "models", "ggml-vocab-"+m.vocab+".gguf"))
		if err != nil {
			return nil, err
		}
		if m.fim {
			if tok, err = tok.WithControlTokens("<PRE>", "<SUF>", "<MID>", "<EOT>"); err != nil {
				return nil, err
			}
		}
		kvs, ts := m.build(m.name+" (random-weight stand-in)", tok)
		p := filepath.Join(dir, m.name+".gguf")
		if err := gguf.WriteModelFile(p, kvs, ts, uint64(1000+i)); err != nil {
			return nil, fmt.Errorf("the stand-in %s: %w", m.name, err)
		}
		out[m.name] = p
	}
	return out, nil
}

// writeHubCache lays the stand-ins out in dir as the hub's cache that llama.cpp reads
// (models--<org>--<name>/refs/main naming a commit, snapshots/<commit>/<path>, the
// layout of common/hf-cache.cpp), as symbolic links, so that each run of the suite
// has its own cache to change, and puts the downloads in dir.
func writeHubCache(dir string, paths map[string]string) error {
	link := func(target, at string) error {
		if err := os.MkdirAll(filepath.Dir(at), 0o755); err != nil {
			return err
		}
		return os.Symlink(target, at)
	}
	for _, f := range hubFiles {
		repo := filepath.Join(dir, "models--"+strings.ReplaceAll(f.repo, "/", "--"))
		sum := sha1.Sum([]byte(f.repo))
		commit := hex.EncodeToString(sum[:])
		if err := os.MkdirAll(filepath.Join(repo, "refs"), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(repo, "refs", "main"), []byte(commit), 0o644); err != nil {
			return err
		}
		if err := link(paths[f.model], filepath.Join(repo, "snapshots", commit, f.path)); err != nil {
			return err
		}
	}
	for name, m := range downloads {
		if err := link(paths[m], filepath.Join(dir, name)); err != nil {
			return err
		}
	}
	return nil
}

func u32(n int) gguf.Value { return gguf.Uint32(uint32(n)) }

func blk(i int, s string) string { return fmt.Sprintf("blk.%d.%s", i, s) }

func matrix(name string, shape ...int) gguf.TensorSpec {
	dims := make([]uint64, len(shape))
	for i, d := range shape {
		dims[i] = uint64(d)
	}
	return gguf.TensorSpec{Name: name, Shape: dims, Init: gguf.Random}
}

func norm(name string, n int) gguf.TensorSpec {
	return gguf.TensorSpec{Name: name, Shape: []uint64{uint64(n)}, Init: gguf.Ones}
}

func bias(name string, n int) gguf.TensorSpec {
	return gguf.TensorSpec{Name: name, Shape: []uint64{uint64(n)}, Init: gguf.Zeros}
}

// header is the metadata every stand-in opens with: architecture, name, f16.
func header(arch, name string) []gguf.KV {
	return []gguf.KV{
		{Key: "general.architecture", Value: gguf.String(arch)},
		{Key: "general.name", Value: gguf.String(name)},
		{Key: "general.file_type", Value: u32(1)}, // LLAMA_FTYPE_MOSTLY_F16
	}
}

// llamaShape is a llama-architecture model, dense or a mixture of experts
// (src/models/llama.cpp's tensors).
type llamaShape struct {
	ctx, embd, layers, ff, heads, kvHeads int
	experts, expertsUsed                  int
}

func (s llamaShape) withExperts(n, used int) llamaShape {
	s.experts, s.expertsUsed = n, used
	return s
}

func (s llamaShape) build(name string, tok *gguf.Tokenizer) ([]gguf.KV, []gguf.TensorSpec) {
	headDim, vocab := s.embd/s.heads, tok.Size()
	kv := s.kvHeads * headDim
	kvs := append(header("llama", name),
		gguf.KV{Key: "llama.context_length", Value: u32(s.ctx)},
		gguf.KV{Key: "llama.embedding_length", Value: u32(s.embd)},
		gguf.KV{Key: "llama.block_count", Value: u32(s.layers)},
		gguf.KV{Key: "llama.feed_forward_length", Value: u32(s.ff)},
		gguf.KV{Key: "llama.attention.head_count", Value: u32(s.heads)},
		gguf.KV{Key: "llama.attention.head_count_kv", Value: u32(s.kvHeads)},
		gguf.KV{Key: "llama.attention.layer_norm_rms_epsilon", Value: gguf.Float32(1e-5)},
		gguf.KV{Key: "llama.rope.freq_base", Value: gguf.Float32(10000)},
		gguf.KV{Key: "llama.rope.dimension_count", Value: u32(headDim)},
		gguf.KV{Key: "llama.vocab_size", Value: u32(vocab)},
	)
	if s.experts > 0 {
		kvs = append(kvs,
			gguf.KV{Key: "llama.expert_count", Value: u32(s.experts)},
			gguf.KV{Key: "llama.expert_used_count", Value: u32(s.expertsUsed)})
	}
	kvs = append(kvs, tok.KVs()...)
	ts := []gguf.TensorSpec{
		matrix("token_embd.weight", s.embd, vocab),
		norm("output_norm.weight", s.embd),
		matrix("output.weight", s.embd, vocab),
	}
	for i := range s.layers {
		ts = append(ts,
			norm(blk(i, "attn_norm.weight"), s.embd),
			matrix(blk(i, "attn_q.weight"), s.embd, s.embd),
			matrix(blk(i, "attn_k.weight"), s.embd, kv),
			matrix(blk(i, "attn_v.weight"), s.embd, kv),
			matrix(blk(i, "attn_output.weight"), s.embd, s.embd),
			norm(blk(i, "ffn_norm.weight"), s.embd),
		)
		if s.experts == 0 {
			ts = append(ts,
				matrix(blk(i, "ffn_gate.weight"), s.embd, s.ff),
				matrix(blk(i, "ffn_down.weight"), s.ff, s.embd),
				matrix(blk(i, "ffn_up.weight"), s.embd, s.ff))
			continue
		}
		ts = append(ts,
			matrix(blk(i, "ffn_gate_inp.weight"), s.embd, s.experts),
			matrix(blk(i, "ffn_gate_exps.weight"), s.embd, s.ff, s.experts),
			matrix(blk(i, "ffn_down_exps.weight"), s.ff, s.embd, s.experts),
			matrix(blk(i, "ffn_up_exps.weight"), s.embd, s.ff, s.experts))
	}
	return kvs, ts
}

// llama.cpp's enum llama_pooling_type.
const (
	poolingCLS  = 2
	poolingRank = 4
)

// bertShape is an encoder: BERT (src/models/bert.cpp: learned positions) or JinaBERT
// (src/models/jina-bert-v2.cpp: ALiBi, GEGLU feed-forward, a classifier head).
type bertShape struct {
	arch                         string
	ctx, embd, layers, ff, heads int
	pooling                      int
}

func (s bertShape) build(name string, tok *gguf.Tokenizer) ([]gguf.KV, []gguf.TensorSpec) {
	a, vocab := s.arch, tok.Size()
	jina := a == "jina-bert-v2"
	kvs := append(header(a, name),
		gguf.KV{Key: a + ".context_length", Value: u32(s.ctx)},
		gguf.KV{Key: a + ".embedding_length", Value: u32(s.embd)},
		gguf.KV{Key: a + ".block_count", Value: u32(s.layers)},
		gguf.KV{Key: a + ".feed_forward_length", Value: u32(s.ff)},
		gguf.KV{Key: a + ".attention.head_count", Value: u32(s.heads)},
		gguf.KV{Key: a + ".attention.layer_norm_epsilon", Value: gguf.Float32(1e-12)},
		gguf.KV{Key: a + ".attention.causal", Value: gguf.Bool(false)},
		gguf.KV{Key: a + ".pooling_type", Value: u32(s.pooling)},
	)
	kvs = append(kvs, tok.KVs()...)
	ts := []gguf.TensorSpec{
		matrix("token_embd.weight", s.embd, vocab),
		{Name: "token_types.weight", Shape: []uint64{uint64(s.embd), 2}, Init: gguf.RandomF32},
		norm("token_embd_norm.weight", s.embd),
		bias("token_embd_norm.bias", s.embd),
	}
	if jina {
		ts = append(ts, matrix("cls.weight", s.embd, 1), bias("cls.bias", 1))
	} else {
		ts = append(ts, matrix("position_embd.weight", s.embd, s.ctx))
	}
	up := s.ff
	if jina {
		up = 2 * s.ff // GEGLU: gate and up in one matrix
	}
	for i := range s.layers {
		for _, t := range []string{"attn_q", "attn_k", "attn_v", "attn_output"} {
			ts = append(ts, matrix(blk(i, t+".weight"), s.embd, s.embd), bias(blk(i, t+".bias"), s.embd))
		}
		ts = append(ts,
			norm(blk(i, "attn_output_norm.weight"), s.embd),
			bias(blk(i, "attn_output_norm.bias"), s.embd),
			matrix(blk(i, "ffn_up.weight"), s.embd, up),
			bias(blk(i, "ffn_up.bias"), up),
			matrix(blk(i, "ffn_down.weight"), s.ff, s.embd),
			bias(blk(i, "ffn_down.bias"), s.embd),
			norm(blk(i, "layer_output_norm.weight"), s.embd),
			bias(blk(i, "layer_output_norm.bias"), s.embd),
		)
	}
	return kvs, ts
}

// gemma3Shape is src/models/gemma3.cpp's layout.
type gemma3Shape struct {
	ctx, embd, layers, ff, heads, kvHeads, headDim, window int
}

func (s gemma3Shape) build(name string, tok *gguf.Tokenizer) ([]gguf.KV, []gguf.TensorSpec) {
	vocab, q, kv := tok.Size(), s.heads*s.headDim, s.kvHeads*s.headDim
	kvs := append(header("gemma3", name),
		gguf.KV{Key: "gemma3.context_length", Value: u32(s.ctx)},
		gguf.KV{Key: "gemma3.embedding_length", Value: u32(s.embd)},
		gguf.KV{Key: "gemma3.block_count", Value: u32(s.layers)},
		gguf.KV{Key: "gemma3.feed_forward_length", Value: u32(s.ff)},
		gguf.KV{Key: "gemma3.attention.head_count", Value: u32(s.heads)},
		gguf.KV{Key: "gemma3.attention.head_count_kv", Value: u32(s.kvHeads)},
		gguf.KV{Key: "gemma3.attention.key_length", Value: u32(s.headDim)},
		gguf.KV{Key: "gemma3.attention.value_length", Value: u32(s.headDim)},
		gguf.KV{Key: "gemma3.attention.layer_norm_rms_epsilon", Value: gguf.Float32(1e-6)},
		gguf.KV{Key: "gemma3.attention.sliding_window", Value: u32(s.window)},
		gguf.KV{Key: "gemma3.rope.freq_base", Value: gguf.Float32(1e6)},
	)
	kvs = append(kvs, tok.KVs()...)
	ts := []gguf.TensorSpec{
		matrix("token_embd.weight", s.embd, vocab),
		norm("output_norm.weight", s.embd),
	}
	for i := range s.layers {
		ts = append(ts,
			norm(blk(i, "attn_norm.weight"), s.embd),
			matrix(blk(i, "attn_q.weight"), s.embd, q),
			matrix(blk(i, "attn_k.weight"), s.embd, kv),
			matrix(blk(i, "attn_v.weight"), s.embd, kv),
			matrix(blk(i, "attn_output.weight"), q, s.embd),
			norm(blk(i, "post_attention_norm.weight"), s.embd),
			norm(blk(i, "attn_k_norm.weight"), s.headDim),
			norm(blk(i, "attn_q_norm.weight"), s.headDim),
			norm(blk(i, "ffn_norm.weight"), s.embd),
			matrix(blk(i, "ffn_gate.weight"), s.embd, s.ff),
			matrix(blk(i, "ffn_up.weight"), s.embd, s.ff),
			matrix(blk(i, "ffn_down.weight"), s.ff, s.embd),
			norm(blk(i, "post_ffw_norm.weight"), s.embd),
		)
	}
	return kvs, ts
}
