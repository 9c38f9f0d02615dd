package gguf

import (
	"encoding/binary"
	"hash/fnv"
	"math"
)

// splitMix64 is the weights' generator: a fixed algorithm (not math/rand's, which
// may change between Go releases), so a seed names the same model forever.
type splitMix64 struct{ state uint64 }

func (s *splitMix64) next() uint64 {
	s.state += 0x9e3779b97f4a7c15
	z := s.state
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// tensorRand gives each tensor its own stream, so a tensor's values depend on the
// seed and its name only, not on which tensors precede it.
func tensorRand(seed uint64, name string) *splitMix64 {
	h := fnv.New64a()
	h.Write([]byte(name))
	return &splitMix64{state: seed ^ h.Sum64()}
}

// uniform returns a value in [-scale, scale).
func (s *splitMix64) uniform(scale float32) float32 {
	u := float32(s.next()>>40) * (1.0 / (1 << 24)) // 24 random bits: exact in float32
	return (2*u - 1) * scale
}

// fillF16 fills dst (2 bytes an element) with uniform values in [-scale, scale).
func fillF16(dst []byte, rng *splitMix64, scale float32) {
	for i := 0; i+1 < len(dst); i += 2 {
		binary.LittleEndian.PutUint16(dst[i:], f32ToF16(rng.uniform(scale)))
	}
}

// fillF32Const fills dst (4 bytes an element) with v.
func fillF32(dst []byte, rng *splitMix64, scale float32) {
	for i := 0; i+4 <= len(dst); i += 4 {
		binary.LittleEndian.PutUint32(dst[i:], math.Float32bits(rng.uniform(scale)))
	}
}

func fillF32Const(dst []byte, v float32) {
	bits := math.Float32bits(v)
	for i := 0; i+3 < len(dst); i += 4 {
		binary.LittleEndian.PutUint32(dst[i:], bits)
	}
}

// f32ToF16 converts to IEEE half precision, rounding to nearest even, as ggml does.
func f32ToF16(f float32) uint16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int32(b>>23) & 0xff
	mant := b & 0x7fffff
	switch {
	case exp == 0xff: // Inf or NaN; NaN stays NaN
		if mant != 0 {
			return sign | 0x7e00
		}
		return sign | 0x7c00
	case exp > 127+15: // too large: Inf
		return sign | 0x7c00
	case exp >= 127-14: // normal half
		h := uint32(exp-127+15)<<10 | mant>>13
		rest := mant & 0x1fff
		if rest > 0x1000 || rest == 0x1000 && h&1 == 1 {
			h++ // may carry into the exponent, up to Inf: still correct
		}
		return sign | uint16(h)
	case exp >= 127-25: // subnormal half
		m := mant | 0x800000
		shift := uint32(126 - exp) // h counts units of 2^-24
		h := m >> shift
		rest := m & (1<<shift - 1)
		half := uint32(1) << (shift - 1)
		if rest > half || rest == half && h&1 == 1 {
			h++
		}
		return sign | uint16(h)
	}
	return sign
}
