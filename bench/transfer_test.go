package bench

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvhost"
	"github.com/mcbridge/mcbridge/internal/mem"
)

// blocksFor is how many blocks of g one restore or save moves.
func blocksFor(g geometry) int { return max(int(restoreBytes()/g.blockBytes()), 2) }

// BenchmarkRestore restores a prefix through the bridge (LoadBegin,
// WaitLayer per layer, End: transfer, verification, placement into the
// host's tensors) for each block size and link. x_memcpy is its throughput
// over a memcpy of the same bytes between the same tensors, timed in the
// same run (fastest against fastest); on shaped links x_linerate is its
// fastest throughput over the link's.
// "local" restores from the reader's own pool, "unshaped" from a peer's
// over an unshaped Loopback link (a CPU memcpy where RDMA would use the
// NIC's DMA engine).
func BenchmarkRestore(b *testing.B) {
	for _, g := range blockGeometries() {
		for _, l := range links() {
			b.Run(fmt.Sprintf("block=%s/link=%s", g.name, l.name), func(b *testing.B) {
				r := newRestoreRig(b, g, blocksFor(g), l)
				require.NoError(b, r.restore()) // pools and tensors paged in
				var p pairTimer
				b.SetBytes(r.payload)
				b.ResetTimer()
				for range b.N {
					p.run(b, r.restore, r.memcpy)
				}
				b.ReportMetric(p.xMemcpy(), "x_memcpy")
				if l.GBps > 0 {
					rate := float64(r.payload) / p.minOp.Seconds()
					b.ReportMetric(rate/(l.GBps*1e9), "x_linerate")
				}
			})
		}
	}
}

// saveRig saves the same tensors under a new scope each time, so every
// save writes new blocks; the pool holds two saves' worth, so from the
// third save on it evicts as it goes, as a full pool does.
type saveRig struct {
	host   *kvhost.Host
	model  *bridge.Model
	tokens []int32
	blocks int
	salt   uint64
	sink   []byte // memcpy target
}

func newSaveRig(tb testing.TB, g geometry, tokens int) *saveRig {
	tb.Helper()
	blocks := tokens / blockTokens
	r := &saveRig{host: newHost(tb, g, tokens), tokens: promptTokens(tokens, 7), blocks: blocks}
	br := openBridge(tb, newDir(tb), "saver", g, 2*int64(blocks)+2, linkLocal)
	r.model = register(tb, br, r.host, g.name)
	r.host.Compute(r.tokens, 0, tokens)
	sink, err := mem.Map(int(int64(tokens) * g.bytesPerToken()))
	require.NoError(tb, err)
	tb.Cleanup(func() { _ = mem.Unmap(sink) })
	r.sink = sink
	return r
}

// scope moves to a new scope and returns it.
func (r *saveRig) scope() key.Scope {
	r.salt++
	return r.scopeOf(r.salt)
}

func (r *saveRig) scopeOf(salt uint64) key.Scope {
	return key.Scope{TenantSalt: fmt.Appendf(nil, "save-%d", salt)}
}

// save seals every block of the prompt under a new scope and queues it for
// the publisher: what a host's thread pays for a save.
func (r *saveRig) save() error {
	res, err := save(r.model, r.host, r.scope(), r.tokens)
	if err == nil && res.Queued != r.blocks {
		err = fmt.Errorf("queued %d of %d blocks: %+v", res.Queued, r.blocks, res)
	}
	return err
}

func (r *saveRig) memcpy() { r.host.CopyTo(r.sink, len(r.tokens)) }

// warm saves twice, which touches every page of the pool (it holds two
// saves), so that no timed save pays for faulting fresh memory in.
func (r *saveRig) warm(tb testing.TB) {
	for range 2 {
		require.NoError(tb, r.save())
	}
	r.memcpy()
}

// BenchmarkSave saves new blocks through the bridge (SaveBegin,
// SaveLayer per layer: gather and checksum, End: headers, publish, index),
// evicting older blocks as the pool fills. Saves never cross a link: a
// process saves into its own pool. x_memcpy compares with a memcpy of the
// same rows into one buffer.
func BenchmarkSave(b *testing.B) {
	for _, g := range blockGeometries() {
		b.Run("block="+g.name, func(b *testing.B) {
			r := newSaveRig(b, g, blocksFor(g)*blockTokens)
			r.warm(b)
			var p pairTimer
			b.SetBytes(int64(len(r.tokens)) * g.bytesPerToken())
			b.ResetTimer()
			for range b.N {
				p.run(b, r.save, r.memcpy)
			}
			b.ReportMetric(p.xMemcpy(), "x_memcpy")
		})
	}
}
