package arbiter

import (
	"testing"
	"time"
)

// BenchmarkDecide times one decision for a 128k-token prompt with 512
// matched blocks, the cost paid on every prompt.
func BenchmarkDecide(b *testing.B) {
	b.Run("m=512", func(b *testing.B) {
		a := mustNew(b, Config{})
		a.ObserveTransfer("local", 64<<20, 5*time.Millisecond)
		in := Input{PromptTokens: 512*256 + 64, BlockTokens: 256, MatchedBlocks: 512, KVBytesPerToken: 128 << 10, Link: "local"}
		b.ReportAllocs()
		for b.Loop() {
			a.Decide(in)
		}
	})
}

func BenchmarkObservePrefill(b *testing.B) {
	a := mustNew(b, Config{})
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		n := 256 + i%4096
		a.ObservePrefill(0, n, DefaultPrefill.Time(0, n))
		i++
	}
}
