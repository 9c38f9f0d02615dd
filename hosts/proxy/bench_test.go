package proxy

import (
	"fmt"
	"testing"
)

// benchFormat is the bench model's KV (bridge/gguf preset bench): 12 layers,
// 4 KV heads of 64, f16, 12 KiB per token.
func benchFormat(vtrans bool) kvFormat {
	f := kvFormat{NStream: 2, VTrans: vtrans}
	for range 12 {
		lf := layerFormat{KType: 1, KRow: 512, VType: 1, VRow: 512}
		if vtrans {
			lf.VElSize, lf.NEmbdV = 2, 256
		}
		f.Layers = append(f.Layers, lf)
	}
	return f
}

// BenchmarkNewRestoreFile is the framing of a restore: the slot file the
// blocks are then loaded into, before any of their bytes move.
func BenchmarkNewRestoreFile(b *testing.B) {
	for _, n := range []int{1024, 4096, 8192} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			f := benchFormat(false)
			tokens := seqTokens(n, 7, 3)
			b.SetBytes(int64(n) * 12 << 10)
			for b.Loop() {
				if _, err := f.newRestoreFile(1, tokens); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
