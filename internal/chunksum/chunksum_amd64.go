package chunksum

import "golang.org/x/sys/cpu"

var fused = cpu.X86.HasAVX2

// streamSum copies stripes 64-byte stripes from src to 32-byte aligned dst
// with VMOVNTDQ and accumulates each into acc as XXH3 does, inner being the
// stripes of the current XXH3 block already accumulated; it scrambles acc
// whenever a block completes and returns the new inner. It fences its
// stores (SFENCE) before it returns.
//
//go:noescape
func streamSum(dst, src *byte, stripes uintptr, acc *[8]uint64, secret *byte, inner uintptr) uintptr
