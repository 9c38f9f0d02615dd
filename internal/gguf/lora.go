package gguf

import (
	"fmt"
	"math"

	"github.com/mcbridge/mcbridge/internal/status"
)

// LoRA describes a LoRA adapter for a model of Config Base: rank-Rank pairs
// for every layer's attn_k and attn_v (so that it changes the KV cache
// itself, which is what a scope must keep apart), as llama.cpp v0.5.0
// loads them (llama-adapter.cpp): general.type "adapter", adapter.type
// "lora", lora_a of shape [in, rank] and lora_b of shape [rank, out].
type LoRA struct {
	Base  Config
	Rank  int
	Alpha float32
	Seed  uint64
}

// Validate reports what llama.cpp would refuse or this writer cannot write.
func (a LoRA) Validate() error {
	if err := a.Base.Validate(); err != nil {
		return err
	}
	if a.Rank <= 0 || a.Rank > a.Base.EmbeddingLength {
		return status.Errorf(status.InvalidArg, "gguf: LoRA rank %d (1..%d)", a.Rank, a.Base.EmbeddingLength)
	}
	if !(a.Alpha > 0) || math.IsInf(float64(a.Alpha), 0) {
		return status.Errorf(status.InvalidArg, "gguf: LoRA alpha %v not positive and finite", a.Alpha)
	}
	return nil
}

func (a LoRA) metadata() []KV {
	return []KV{
		{"general.architecture", String("llama")},
		{"general.type", String("adapter")},
		{"general.name", String(a.Base.Name + "-lora")},
		{"general.alignment", Uint32(DefaultAlignment)},
		{"adapter.type", String("lora")},
		{"adapter.lora.alpha", Float32(a.Alpha)},
	}
}

// tensors gives B weights of the base's scale, so that the adapter moves K
// and V by about as much as the base weights do: any restore of base KV
// into an adapted request, or the reverse, changes the greedy output.
func (a LoRA) tensors() []tensor {
	c := a.Base
	embd, r := uint64(c.EmbeddingLength), uint64(a.Rank)
	kv := uint64(c.HeadCountKV * c.headDim())
	pair := func(name string, in, out uint64) []tensor {
		sa := float32(math.Sqrt(3 / float64(in)))
		sb := float32(math.Sqrt(3 / float64(r)))
		return []tensor{
			{name + ".lora_a", TensorF32, []uint64{in, r}, func(dst []byte, rng *splitMix64) { fillF32(dst, rng, sa) }},
			{name + ".lora_b", TensorF32, []uint64{r, out}, func(dst []byte, rng *splitMix64) { fillF32(dst, rng, sb) }},
		}
	}
	var ts []tensor
	for i := range c.BlockCount {
		ts = append(ts, pair(fmt.Sprintf("blk.%d.attn_k.weight", i), embd, kv)...)
		ts = append(ts, pair(fmt.Sprintf("blk.%d.attn_v.weight", i), embd, kv)...)
	}
	return ts
}

// WriteLoRAFile writes the adapter to path, atomically as WriteFile does.
func WriteLoRAFile(path string, a LoRA) error {
	if err := a.Validate(); err != nil {
		return err
	}
	return writeAtomic(path, func(e *encoder) { e.write(a.metadata(), a.tensors(), a.Seed) })
}
