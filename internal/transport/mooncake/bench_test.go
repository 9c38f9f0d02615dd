//go:build linux && (amd64 || arm64)

package mooncake

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/transport"
)

// BenchmarkRestore reads 64 MiB from a peer engine in blocks of 1 or 16 MiB,
// one task per block in one batch, and reports the throughput as a multiple
// of a memcpy of the same bytes in the same run (x_memcpy; the design's
// target for restores of >= 1 MiB blocks is 0.8). Both engines live in this
// process; the same-host path makes the same process_vm_readv calls it makes
// between processes.
func BenchmarkRestore(b *testing.B) {
	for _, path := range []struct {
		name string
		path Path
	}{{"samehost", PathVM}, {"tcp", PathTCP}} {
		for _, block := range []int{1 << 20, 16 << 20} {
			b.Run(fmt.Sprintf("%s/%dMiB", path.name, block>>20), func(b *testing.B) {
				benchRestore(b, path.path, block)
			})
		}
	}
}

func benchRestore(b *testing.B, path Path, block int) {
	const total = 64 << 20
	n := total / block
	p := newPair(b, mockLib, total)
	require.NoError(b, p.a.SetPath(path))
	reqs := make([]transport.Request, n)
	for i := range reqs {
		off := i * block
		reqs[i] = transport.Request{Op: transport.Read, Local: p.local.addr() + uintptr(off), Segment: p.seg,
			Remote: uint64(p.peer.addr()) + uint64(off), Length: uint64(block)}
	}
	restore := func() {
		tb, err := p.a.AllocateBatch(n)
		require.NoError(b, err)
		require.NoError(b, tb.Submit(reqs))
		st, err := transport.Wait(context.Background(), tb, 0, n, transport.DefaultBackoff)
		require.NoError(b, err)
		for i, s := range st {
			require.Equal(b, transport.Completed, s.State, "block %d: %+v", i, s)
		}
		require.NoError(b, tb.Free())
	}
	restore() // connections and page tables warm
	// Each restore is paired with a memcpy right after it, so that load from
	// other processes on the machine weighs on both sides of the ratio.
	var transferTime, memcpyTime time.Duration
	b.SetBytes(total)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		restore()
		transferTime += time.Since(start)
		b.StopTimer()
		start = time.Now()
		copy(p.local, p.peer)
		memcpyTime += time.Since(start)
		b.StartTimer()
	}
	b.ReportMetric(float64(memcpyTime)/float64(transferTime), "x_memcpy")
}
