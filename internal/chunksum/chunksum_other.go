//go:build !amd64

package chunksum

const fused = false

func streamSum(dst, src *byte, stripes uintptr, acc *[8]uint64, secret *byte, inner uintptr) uintptr {
	panic("chunksum: no fused copy on this platform")
}
