package gguf

import (
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestF32ToF16(t *testing.T) {
	tests := []struct {
		in   float32
		want uint16
	}{
		{0, 0x0000},
		{float32(math.Copysign(0, -1)), 0x8000},
		{1, 0x3c00},
		{-2, 0xc000},
		{0.5, 0x3800},
		{1.0 / 3, 0x3555},
		{65504, 0x7bff}, // largest half
		{65519, 0x7bff}, // rounds down
		{65520, 0x7c00}, // rounds up to Inf
		{1e10, 0x7c00},  // overflow
		{float32(math.Inf(-1)), 0xfc00},
		{float32(math.NaN()), 0x7e00},
		{6.103515625e-05, 0x0400},    // smallest normal
		{5.960464477539063e-08, 1},   // smallest subnormal
		{2.98023223876953125e-08, 0}, // half of it: ties to even
		{4.5e-08, 1},                 // above the tie
		{1e-9, 0},                    // underflow
		{1 + 1.0/2048, 0x3c00},       // tie between 1 and 1+2^-10: even
		{1 + 3.0/2048, 0x3c02},       // tie: rounds up to even
		{-1.5e-5, 0x80fc},            // negative subnormal: -252 * 2^-24
	}
	for _, tt := range tests {
		got := f32ToF16(tt.in)
		assert.Equal(t, tt.want, got, "f32ToF16(%g) = %#04x, want %#04x", tt.in, got, tt.want)
	}
}

// Every half value converts back to itself through float32.
func TestF16RoundTrip(t *testing.T) {
	for h := range 1 << 16 {
		f := f16ToF32(uint16(h))
		got := f32ToF16(f)
		if f != f { // NaN payloads are canonicalised
			require.Equal(t, uint16(0x7c00), got&0x7c00, "NaN %#04x became %#04x", h, got)
			require.NotZero(t, got&0x3ff, "NaN %#04x became %#04x", h, got)
			continue
		}
		require.Equal(t, uint16(h), got, "%#04x -> %g -> %#04x", h, f, got)
	}
}

func TestUniformRange(t *testing.T) {
	rng := tensorRand(1, "x")
	const scale = 0.25
	var sum float64
	const n = 100000
	for range n {
		v := rng.uniform(scale)
		require.False(t, v < -scale || v >= scale, "uniform(%g) = %g", float32(scale), v)
		sum += float64(v)
	}
	// The mean of n uniform draws has standard deviation scale/sqrt(3n) ~ 4.6e-4.
	assert.InDelta(t, 0, sum/n, 5e-3, "mean of uniform draws")
}

func TestTensorRandStreams(t *testing.T) {
	a, b, c := tensorRand(1, "a"), tensorRand(1, "a"), tensorRand(1, "b")
	d := tensorRand(2, "a")
	for range 4 {
		x := a.next()
		require.Equal(t, x, b.next(), "same seed and name")
		require.NotEqual(t, x, c.next(), "different name gave the same stream")
		require.NotEqual(t, x, d.next(), "different seed gave the same stream")
	}
}
