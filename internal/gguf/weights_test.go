package gguf

import (
	"math"
	"testing"
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
		if got := f32ToF16(tt.in); got != tt.want {
			t.Errorf("f32ToF16(%g) = %#04x, want %#04x", tt.in, got, tt.want)
		}
	}
}

// Every half value converts back to itself through float32.
func TestF16RoundTrip(t *testing.T) {
	for h := range 1 << 16 {
		f := f16ToF32(uint16(h))
		got := f32ToF16(f)
		if f != f { // NaN payloads are canonicalised
			if got&0x7c00 != 0x7c00 || got&0x3ff == 0 {
				t.Fatalf("NaN %#04x became %#04x", h, got)
			}
			continue
		}
		if got != uint16(h) {
			t.Fatalf("%#04x -> %g -> %#04x", h, f, got)
		}
	}
}

func TestUniformRange(t *testing.T) {
	rng := tensorRand(1, "x")
	const scale = 0.25
	var sum float64
	const n = 100000
	for range n {
		v := rng.uniform(scale)
		if v < -scale || v >= scale {
			t.Fatalf("uniform(%g) = %g", float32(scale), v)
		}
		sum += float64(v)
	}
	// The mean of n uniform draws has standard deviation scale/sqrt(3n) ~ 4.6e-4.
	if mean := sum / n; math.Abs(mean) > 5e-3 {
		t.Errorf("mean %g, want about 0", mean)
	}
}

func TestTensorRandStreams(t *testing.T) {
	a, b, c := tensorRand(1, "a"), tensorRand(1, "a"), tensorRand(1, "b")
	d := tensorRand(2, "a")
	for range 4 {
		x := a.next()
		if y := b.next(); x != y {
			t.Fatalf("same seed and name: %x != %x", x, y)
		}
		if x == c.next() || x == d.next() {
			t.Fatal("different name or seed gave the same stream")
		}
	}
}
