package gguf

import (
	"math"

	"github.com/mcbridge/mcbridge/internal/status"
)

// Init says how a TensorSpec's data is made.
type Init int

const (
	// Random is f16, uniform with standard deviation 1/sqrt(Shape[0]) (the fan-in),
	// as the llama Config's matrices: activations stay of order one.
	Random Init = iota
	// Ones is f32 1: a norm's weight.
	Ones
	// Zeros is f32 0: a bias.
	Zeros
	// RandomF32 is Random's values in f32, for a tensor ggml adds to activations as it
	// is (BERT's token type rows): its CPU backend adds no f16 to f32.
	RandomF32
)

// TensorSpec is one tensor of WriteModelFile: its name, ggml's shape (ne[0] first)
// and how its data is made.
type TensorSpec struct {
	Name  string
	Shape []uint64
	Init  Init
}

func (s TensorSpec) tensor() tensor {
	switch s.Init {
	case Ones:
		return tensor{s.Name, TensorF32, s.Shape, func(dst []byte, _ *splitMix64) { fillF32Const(dst, 1) }}
	case Zeros:
		return tensor{s.Name, TensorF32, s.Shape, func(dst []byte, _ *splitMix64) { fillF32Const(dst, 0) }}
	}
	scale := float32(math.Sqrt(3 / float64(s.Shape[0])))
	if s.Init == RandomF32 {
		return tensor{s.Name, TensorF32, s.Shape, func(dst []byte, rng *splitMix64) { fillF32(dst, rng, scale) }}
	}
	return tensor{s.Name, TensorF16, s.Shape, func(dst []byte, rng *splitMix64) { fillF16(dst, rng, scale) }}
}

func (s TensorSpec) validate() error {
	if s.Name == "" || len(s.Name) >= maxNameLen {
		return status.Errorf(status.InvalidArg, "gguf: tensor name %q: 1 to %d bytes", s.Name, maxNameLen-1)
	}
	if len(s.Shape) == 0 || len(s.Shape) > maxDims {
		return status.Errorf(status.InvalidArg, "gguf: tensor %s has %d dimensions (1..%d)", s.Name, len(s.Shape), maxDims)
	}
	for _, d := range s.Shape {
		if d == 0 || d > maxDim {
			return status.Errorf(status.InvalidArg, "gguf: tensor %s: dimension %d outside [1, %d]", s.Name, d, maxDim)
		}
	}
	if s.Init < Random || s.Init > RandomF32 {
		return status.Errorf(status.InvalidArg, "gguf: tensor %s: unknown Init %d", s.Name, s.Init)
	}
	return nil
}

// WriteModelFile writes a model of any architecture, for the shapes Config does not
// describe (BERT, mixtures of experts, Gemma 3, ...): the metadata as given, then
// general.alignment, and the tensors made from seed, each from its name and the seed
// only. The caller names the tensors llama.cpp's loader requires for the
// architecture; llama.cpp itself checks them when it loads the file. Written
// atomically, as WriteFile.
func WriteModelFile(path string, kvs []KV, specs []TensorSpec, seed uint64) error {
	seen := map[string]bool{}
	for _, kv := range kvs {
		if kv.Key == "" || seen[kv.Key] || kv.Key == "general.alignment" {
			return status.Errorf(status.InvalidArg, "gguf: metadata key %q empty, repeated or reserved", kv.Key)
		}
		seen[kv.Key] = true
	}
	ts := make([]tensor, len(specs))
	names := map[string]bool{}
	for i, s := range specs {
		if err := s.validate(); err != nil {
			return err
		}
		if names[s.Name] {
			return status.Errorf(status.InvalidArg, "gguf: tensor %s repeated", s.Name)
		}
		names[s.Name] = true
		ts[i] = s.tensor()
	}
	kvs = append(kvs[:len(kvs):len(kvs)], KV{"general.alignment", Uint32(DefaultAlignment)})
	return writeAtomic(path, func(e *encoder) { e.write(kvs, ts, seed) })
}
