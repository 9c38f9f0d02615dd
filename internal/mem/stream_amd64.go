package mem

import "golang.org/x/sys/cpu"

var streamStores = cpu.X86.HasAVX2

// streamCopy copies n bytes, a multiple of 128, from src to a 32-byte
// aligned dst with VMOVNTDQ, then SFENCE.
//
//go:noescape
func streamCopy(dst, src *byte, n uintptr)
