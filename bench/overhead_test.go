package bench

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/preset"
)

// missAndSave is what the bridge adds to a request that hits nothing: a
// lookup that matches no block, then a save of every full block.
func (r *saveRig) missAndSave() error {
	scope := r.scope()
	res, err := r.model.Lookup(scope, r.tokens, 0)
	if err != nil {
		return err
	}
	if res.MatchedBlocks != 0 {
		return fmt.Errorf("a new scope matched %d blocks", res.MatchedBlocks)
	}
	sr, err := save(r.model, r.host, scope, r.tokens)
	if err == nil && sr.Queued != r.blocks {
		err = fmt.Errorf("queued %d of %d blocks", sr.Queued, r.blocks)
	}
	return err
}

type overheadCase struct {
	g      geometry
	p      preset.Preset
	tokens int
}

func overheadCases() []overheadCase {
	if quick() {
		return []overheadCase{{geoBench, preset.BenchCPU, 1024}}
	}
	return []overheadCase{
		{geoBench, preset.BenchCPU, 1024}, {geoBench, preset.BenchCPU, 4096}, {geoBench, preset.BenchCPU, 16384},
		{geoLlama, preset.Llama3GPU, 1024}, {geoLlama, preset.Llama3GPU, 4096},
	}
}

// BenchmarkMissOverhead times the bridge's work on a request with a 0%
// hit ratio (lookup, then save of every block into host memory, evicting
// as the pool fills) against doing nothing, and reports it as a percentage
// of the preset's prefill time for the same prompt (pct_of_prefill). The
// prefill is the preset's model, not run here: bench-cpu's is measured
// (docs/design.md §15), llama3-8b-gpu's is assumed, and on a GPU the save reads
// device memory through a DMA engine, which this host-memory save does
// not measure. Saves run synchronously after the prompt (the server may
// reuse the cells right after), so the same share comes off tokens/s of a
// server that only prefills.
func BenchmarkMissOverhead(b *testing.B) {
	for _, c := range overheadCases() {
		b.Run(fmt.Sprintf("preset=%s/tokens=%d", c.p.Name, c.tokens), func(b *testing.B) {
			r := newSaveRig(b, c.g, c.tokens)
			r.warm(b)
			b.SetBytes(int64(c.tokens) * c.g.bytesPerToken())
			for b.Loop() {
				require.NoError(b, r.missAndSave())
			}
			prefill := c.p.Prefill.Time(0, c.tokens)
			b.ReportMetric(100*float64(b.Elapsed())/float64(b.N)/float64(prefill), "pct_of_prefill")
		})
	}
}
