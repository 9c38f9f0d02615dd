package chunksum

import (
	"runtime"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/zeebo/xxh3"

	"github.com/mcbridge/mcbridge/internal/mem"
)

// aligned returns n bytes starting on a 32-byte boundary.
func aligned(n int) []byte {
	b := make([]byte, n+32)
	off := int(-mem.Addr(b) & 31)
	return b[off : off+n]
}

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	x := uint32(seed) + 1
	for i := range b {
		x = x*1664525 + 1013904223
		b[i] = byte(x >> 24)
	}
	return b
}

// sumCopy copies src through Chunk cut at the given stripe counts (the
// rest in one last segment) and returns the copy and the sum.
func sumCopy(t testing.TB, src []byte, cuts []int) ([]byte, uint64) {
	dst := aligned(len(src))
	c := New(len(src))
	at := 0
	for _, k := range cuts {
		end := min(at+k*stripe, len(src))
		c.Copy(dst[at:end], src[at:end])
		at = end
	}
	c.Copy(dst[at:], src[at:])
	return dst, c.Sum64()
}

func TestMatchesXXH3(t *testing.T) {
	if !fused {
		t.Skip("no AVX2: Fits is false and nothing calls Copy")
	}
	for _, n := range []int{256, 320, 1024, 1088, 2048, 16 << 10, 64<<10 - 64, 64 << 10, 64<<10 + 64} {
		src := pattern(n, byte(n))
		require.True(t, Fits(n))
		for _, cuts := range [][]int{nil, {1}, {15, 1, 1}, {16}, {17, 3}, {n / stripe / 2}} {
			dst, sum := sumCopy(t, src, cuts)
			require.Equal(t, src, dst, "n=%d cuts=%v", n, cuts)
			require.Equal(t, xxh3.Hash(src), sum, "n=%d cuts=%v", n, cuts)
		}
	}
}

func TestFits(t *testing.T) {
	require.False(t, Fits(192), "short inputs take XXH3's other paths")
	require.False(t, Fits(240))
	require.False(t, Fits(1000), "not whole stripes")
	require.Equal(t, fused, Fits(256))
}

func TestMisuse(t *testing.T) {
	if !fused {
		t.Skip("no AVX2: Fits is false and nothing calls Copy")
	}
	src := pattern(512, 1)
	dst := aligned(512 + 32)
	c := New(512)
	require.Panics(t, func() { c.Copy(dst[:100], src[:100]) }, "a partial stripe")
	require.Panics(t, func() { c.Copy(dst[1:65], src[:64]) }, "an unaligned destination")
	require.Panics(t, func() { c.Sum64() }, "a chunk not copied whole")
	c.Copy(dst[:512], src)
	require.Panics(t, func() { c.Copy(dst[:64], src[:64]) }, "past the chunk's end")
}

// FuzzMatchesXXH3: any chunk of whole stripes, cut anywhere between
// stripes, sums as xxh3.Hash and copies exactly.
func FuzzMatchesXXH3(f *testing.F) {
	f.Add([]byte("seed"), uint16(300), uint8(3), uint8(17))
	f.Fuzz(func(t *testing.T, seed []byte, stripes uint16, cut1, cut2 uint8) {
		if !fused {
			t.Skip("no AVX2")
		}
		n := (int(stripes)%2048 + 4) * stripe
		src := pattern(n, byte(len(seed)))
		for i, b := range seed {
			src[i%n] ^= b
		}
		dst, sum := sumCopy(t, src, []int{int(cut1), int(cut2)})
		require.Equal(t, src, dst)
		require.Equal(t, xxh3.Hash(src), sum)
	})
}

// BenchmarkCopy: 64 KiB chunks of memory far larger than the caches,
// copied on every CPU: with streaming stores alone (the floor), then
// summed after the copy (what a restore did before) and as they are copied.
func BenchmarkCopy(b *testing.B) {
	const total, chunk = 96 << 20, 64 << 10
	src, dst := pattern(total, 7), aligned(total)
	copy(dst, src) // paged in before any timing
	for _, c := range []struct {
		name string
		f    func(d, s []byte) uint64
	}{
		{"stream", func(d, s []byte) uint64 { mem.Stream(d, s); return 0 }},
		{"stream-then-sum", func(d, s []byte) uint64 { mem.Stream(d, s); return xxh3.Hash(s) }},
		{"fused", func(d, s []byte) uint64 { c := New(len(s)); c.Copy(d, s); return c.Sum64() }},
	} {
		b.Run(c.name, func(b *testing.B) {
			workers := runtime.GOMAXPROCS(0)
			b.SetBytes(total)
			for range b.N {
				var wg sync.WaitGroup
				per := total / workers / chunk * chunk
				for w := range workers {
					wg.Go(func() {
						for off := w * per; off < (w+1)*per; off += chunk {
							c.f(dst[off:off+chunk], src[off:off+chunk])
						}
					})
				}
				wg.Wait()
			}
		})
	}
}
