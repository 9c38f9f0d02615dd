package mem

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"
)

// Every alignment of either side, lengths around the thresholds and steps,
// and bytes around the destination untouched.
func TestStream(t *testing.T) {
	src := make([]byte, 3*streamMin+300)
	for i := range src {
		src[i] = byte(i*131 + i>>8)
	}
	buf := make([]byte, len(src)+128)
	for _, n := range []int{0, 1, 31, streamMin - 1, streamMin, streamMin + 1, streamMin + 127, streamMin + 128, 2*streamMin + 255, 3 * streamMin} {
		for _, dOff := range []int{0, 1, 7, 31, 32, 33} {
			for _, sOff := range []int{0, 3, 32} {
				for i := range buf {
					buf[i] = 0xa5
				}
				dst := buf[dOff : dOff+n]
				require.Equal(t, n, Stream(dst, src[sOff:sOff+n]))
				require.True(t, bytes.Equal(dst, src[sOff:sOff+n]), "n %d, dst +%d, src +%d", n, dOff, sOff)
				require.Equal(t, bytes.Repeat([]byte{0xa5}, dOff), buf[:dOff])
				require.Equal(t, bytes.Repeat([]byte{0xa5}, len(buf)-dOff-n), buf[dOff+n:])
			}
		}
	}
}

func TestStreamShorterSide(t *testing.T) {
	src := bytes.Repeat([]byte{1, 2, 3}, 2*streamMin)
	dst := make([]byte, streamMin+5)
	require.Equal(t, len(dst), Stream(dst, src))
	require.Equal(t, src[:len(dst)], dst)
}

func FuzzStream(f *testing.F) {
	f.Add(uint16(5000), uint8(3), uint8(9))
	f.Fuzz(func(t *testing.T, n uint16, dOff, sOff uint8) {
		src := make([]byte, int(n)+int(sOff))
		for i := range src {
			src[i] = byte(i * 7)
		}
		buf := make([]byte, int(n)+int(dOff)+64)
		Stream(buf[dOff:int(dOff)+int(n)], src[sOff:])
		require.Equal(t, src[sOff:int(sOff)+int(n)], buf[dOff:int(dOff)+int(n)])
		require.Equal(t, make([]byte, 64), buf[int(dOff)+int(n):])
	})
}

// The figure in Stream's comment: 64 KiB copies into memory far larger
// than the caches, with copy and with Stream.
func BenchmarkStream(b *testing.B) {
	const total = 96 << 20
	src, dst := make([]byte, total), make([]byte, total)
	for _, c := range []struct {
		name string
		f    func(dst, src []byte) int
	}{{"copy", func(d, s []byte) int { return copy(d, s) }}, {"stream", Stream}} {
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(total)
			for range b.N {
				for off := 0; off < total; off += 64 << 10 {
					c.f(dst[off:off+64<<10], src[off:off+64<<10])
				}
			}
		})
	}
}
