//go:build linux && (amd64 || arm64)

package mooncake

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/transport"
)

// restoreShape is a restore of 48 MiB cut into requests as the bridge cuts
// it. prefix is a 4096-token prefix of a 12-layer model at 12 KiB per
// token: 16 blocks of 3 MiB, one request per block and layer, every block's
// layer 0 first.
type restoreShape struct {
	name          string
	blocks        int
	layers        int
	bytesPerLayer int
}

const restoreBytes = 48 << 20

var restoreShapes = []restoreShape{
	{"prefix48MiB", 16, 12, 256 << 10},
	{"blocks1MiB", 48, 1, 1 << 20},
	{"blocks16MiB", 3, 1, 16 << 20},
}

// requests are the shape's transfers at offset-equal addresses of local
// and remote.
func (s restoreShape) requests(local uintptr, seg transport.SegmentID, remote uint64) []transport.Request {
	var reqs []transport.Request
	block := s.layers * s.bytesPerLayer
	for l := 0; l < s.layers; l++ {
		for j := 0; j < s.blocks; j++ {
			off := j*block + l*s.bytesPerLayer
			reqs = append(reqs, transport.Request{Op: transport.Read, Local: local + uintptr(off), Segment: seg, Remote: remote + uint64(off), Length: uint64(s.bytesPerLayer)})
		}
	}
	return reqs
}

// BenchmarkPeerRead reads 48 MiB from a peer PROCESS into local registered
// memory, in each shape, through the real engine's TCP transport over
// loopback, the mock's same-host path (process_vm_readv), the mock's TCP
// path, and as a memcpy of the same requests within this process; all in
// one run, so that MB/s compare. x_memcpy divides a path's throughput by
// the memcpy's of the same shape in this run.
//
// The real engine runs with the binding's defaults (libraryEnvironment):
// MC_TCP_ENABLE_CONNECTION_POOL=1, which restored 1.3 to 2 times faster than
// without the pool here (prefix48MiB 0.98-1.40 against 0.61-1.18 GB/s on a
// loaded two-core machine), and the TCP transport's own slice size (64 KiB)
// and lane count (4): MC_TCP_SLICE_SIZE of 1 or 4 MiB stayed within the
// run-to-run noise (1.2-2.8 GB/s for all three), and 1 or 2 lanes were
// slower (0.86-0.89 GB/s for the prefix), 8 no faster. Set them around
// `go test` to try others; both sides read them once per process.
func BenchmarkPeerRead(b *testing.B) {
	memcpyNs := map[string]float64{}
	b.Run("way=memcpy", func(b *testing.B) {
		src, dst := newBuffer(b, restoreBytes), newBuffer(b, restoreBytes)
		src.fill(childSeed)
		dst.fill(0) // page faults out of the timed loop
		for _, s := range restoreShapes {
			b.Run("shape="+s.name, func(b *testing.B) {
				reqs := s.requests(dst.addr(), 0, uint64(src.addr()))
				b.SetBytes(restoreBytes)
				start := time.Now()
				for i := 0; i < b.N; i++ {
					for _, r := range reqs {
						off := r.Local - dst.addr()
						copy(dst[off:off+uintptr(r.Length)], src[off:off+uintptr(r.Length)])
					}
				}
				memcpyNs[s.name] = float64(time.Since(start).Nanoseconds()) / float64(b.N)
				require.Equal(b, -1, dst.firstMismatch(childSeed))
			})
		}
	})
	for _, way := range []struct {
		name string
		lib  func(testing.TB) string
		path Path
	}{
		{"mock-samehost", func(testing.TB) string { return mockLib }, PathVM},
		{"mock-tcp", func(testing.TB) string { return mockLib }, PathTCP},
		{"real-tcp", realLib, PathAuto},
	} {
		b.Run("way="+way.name, func(b *testing.B) {
			lib := way.lib(b)
			c := startChild(b, lib, restoreBytes)
			e := openEngine(b, lib)
			if e.IsMock() {
				require.NoError(b, e.SetPath(way.path))
			}
			local := newBuffer(b, restoreBytes)
			register(b, e, local)
			seg, err := e.OpenSegment(c.segment)
			require.NoError(b, err)
			for _, s := range restoreShapes {
				b.Run("shape="+s.name, func(b *testing.B) {
					reqs := s.requests(local.addr(), seg, c.addr)
					restore := func() {
						tb, err := e.AllocateBatch(len(reqs))
						require.NoError(b, err)
						require.NoError(b, tb.Submit(reqs))
						st, err := transport.Wait(context.Background(), tb, 0, len(reqs), transport.DefaultBackoff)
						require.NoError(b, err)
						for i, x := range st {
							require.Equal(b, transport.Completed, x.State, "request %d", i)
						}
						require.NoError(b, tb.Free())
					}
					clear(local)
					restore() // connections, page tables and lanes warm
					require.Equal(b, -1, local.firstMismatch(childSeed), "restored bytes")
					b.SetBytes(restoreBytes)
					b.ResetTimer()
					start := time.Now()
					for i := 0; i < b.N; i++ {
						restore()
					}
					ns := float64(time.Since(start).Nanoseconds()) / float64(b.N)
					if m := memcpyNs[s.name]; m > 0 {
						b.ReportMetric(m/ns, "x_memcpy")
					}
				})
			}
			c.stop(b)
		})
	}
}
