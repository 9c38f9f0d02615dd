package bench

import (
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/key"
)

// stallRun is what the compute side saw in one layer-wise restore.
type stallRun struct {
	total, first, maxLater time.Duration // stalls: all layers, layer 0, worst later layer
	compute                time.Duration // busy-wait actually spent
}

// pipelined restores layer by layer as a host does: wait for layer i, then
// compute layer i for compute (busy-waiting, as a CPU would be busy), and
// reports the time spent waiting.
func (r *restoreRig) pipelined(compute time.Duration) (stallRun, error) {
	var s stallRun
	ld, err := r.reader.LoadBegin(key.Scope{}, r.dst.Layout(), r.tokens, r.cells)
	if err != nil {
		return s, err
	}
	for l := range r.dst.Layers() {
		start := time.Now()
		if _, err := ld.WaitLayer(l); err != nil {
			_, _ = ld.End()
			return s, err
		}
		wait := time.Since(start)
		s.total += wait
		if l == 0 {
			s.first = wait
		} else {
			s.maxLater = max(s.maxLater, wait)
		}
		s.compute += spin(compute)
	}
	res, err := ld.End()
	if err == nil && res.OKBlocks != r.blocks {
		err = fmt.Errorf("restored %d of %d blocks", res.OKBlocks, r.blocks)
	}
	return s, err
}

// spin busy-waits for d and returns the time it took.
func spin(d time.Duration) time.Duration {
	start := time.Now()
	for time.Since(start) < d {
	}
	return time.Since(start)
}

func stallBlocks() int {
	if quick() {
		return 4
	}
	return 4096 / blockTokens
}

func stallLinks() []float64 {
	if quick() {
		return []float64{10}
	}
	return []float64{1, 10, 25, 50}
}

// BenchmarkLayerStall restores the bench model's 4096 tokens over a 1, 10,
// 25 or 50 GB/s link while the compute side computes each layer for a fixed
// multiple of one layer's transfer time (the layer's bytes at the link's
// rate). It reports stalls (time in WaitLayer) as multiples of that
// transfer time, means over the iterations: stall_layers for all layers
// together, first_layers for layer 0 (which no pipeline hides),
// max_later_layers for the worst later layer of any iteration; the
// iteration with the least stall gives best_stall_layers and
// best_first_layers. compute_layers is the busy-wait measured in the same
// run, and path_layers the time per layer of the same restore with no
// compute at all: above 1, the restore path itself (copy, verification,
// placement, in the load's worker) is slower than the link. The Loopback
// engine copies in the thread that polls it, the load's worker, where a NIC
// would copy by DMA: on this 2-core machine the worker and the computing
// host thread each take a core.
func BenchmarkLayerStall(b *testing.B) {
	for _, gbps := range stallLinks() {
		for _, factor := range []float64{0.5, 1, 2} {
			b.Run(fmt.Sprintf("link=%gGBps/compute=%gxlayer", gbps, factor), func(b *testing.B) {
				r := newRestoreRig(b, geoBench, stallBlocks(), shaped(gbps))
				layers := geoBench.layers
				layer := time.Duration(float64(r.payload) / float64(layers) / (gbps * 1e9) * float64(time.Second))
				var path time.Duration
				for i := range 3 {
					s, err := r.pipelined(0)
					require.NoError(b, err)
					if i == 0 || s.total < path {
						path = s.total
					}
				}
				// Means over the iterations, and the least disturbed one: the
				// machine may be shared, and a preempted busy-wait or a late
				// timer shows as stall.
				var sum stallRun
				least := stallRun{total: math.MaxInt64}
				for b.Loop() {
					s, err := r.pipelined(time.Duration(factor * float64(layer)))
					require.NoError(b, err)
					sum.total += s.total
					sum.first += s.first
					sum.maxLater = max(sum.maxLater, s.maxLater)
					sum.compute += s.compute
					if s.total < least.total {
						least = s
					}
				}
				per := func(d time.Duration) float64 { return float64(d) / float64(b.N) / float64(layer) }
				b.ReportMetric(per(sum.total), "stall_layers")
				b.ReportMetric(per(sum.first), "first_layers")
				b.ReportMetric(float64(sum.maxLater)/float64(layer), "max_later_layers")
				b.ReportMetric(float64(least.total)/float64(layer), "best_stall_layers")
				b.ReportMetric(float64(least.first)/float64(layer), "best_first_layers")
				b.ReportMetric(per(sum.compute)/float64(layers), "compute_layers")
				b.ReportMetric(float64(path)/float64(layers)/float64(layer), "path_layers")
			})
		}
	}
}
