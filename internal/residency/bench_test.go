package residency

import (
	"encoding/binary"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/key"
)

// A block of 256 tokens at 12 KiB of KV per token, the bench model's figure.
const benchBlockBytes = 256 * 12 << 10

var benchSizes = []int{1e3, 1e4, 1e5, 1e6}

// benchKey spreads n over the key space as a hash would.
func benchKey(n uint64) key.BlockKey {
	var k key.BlockKey
	binary.LittleEndian.PutUint64(k[:8], n*0x9e3779b97f4a7c15)
	binary.LittleEndian.PutUint64(k[8:], n)
	return k
}

// benchChains hands out fresh chains: a new scope root per chain, fresh keys,
// and a cost that grows with depth as attention does.
type benchChains struct {
	next uint64
	buf  []Block[int]
}

func (c *benchChains) chain(n int) (key.Hash, []Block[int]) {
	c.next++
	root := benchKey(c.next)
	c.buf = c.buf[:0]
	for i := range n {
		c.next++
		c.buf = append(c.buf, Block[int]{Key: benchKey(c.next), Value: i, Bytes: benchBlockBytes, Cost: float64(i + 1)})
	}
	return root, c.buf
}

// fill inserts blocks chains of chainLen blocks (the last one shorter).
func (c *benchChains) fill(b *testing.B, tr *Tree[int], blocks, chainLen int) {
	for blocks > 0 {
		root, bs := c.chain(min(chainLen, blocks))
		_, err := tr.InsertChain(root, bs)
		require.NoError(b, err)
		blocks -= len(bs)
	}
}

func benchTree(b *testing.B, cfg Config) *Tree[int] {
	tr, err := New[int](cfg)
	require.NoError(b, err)
	return tr
}

// reportPerBlock reports the timed part of the run per block handled.
func reportPerBlock(b *testing.B, blocksPerOp int) {
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*blocksPerOp), "ns/block")
}

// BenchmarkInsert inserts 64-block chains into an index of the given size.
func BenchmarkInsert(b *testing.B) {
	const chainLen = 64
	for _, size := range benchSizes {
		b.Run(fmt.Sprintf("blocks=%d", size), func(b *testing.B) {
			var c benchChains
			tr := benchTree(b, Config{})
			c.fill(b, tr, size, chainLen)
			b.ResetTimer()
			for range b.N {
				root, bs := c.chain(chainLen)
				_, err := tr.InsertChain(root, bs)
				require.NoError(b, err)
			}
			reportPerBlock(b, chainLen)
		})
	}
}

// BenchmarkMatch matches a 512-block chain, a 131072-token prompt at 256
// tokens per block, that is fully indexed, against an index of the given size.
func BenchmarkMatch(b *testing.B) {
	const chainLen = 512
	for _, size := range benchSizes {
		b.Run(fmt.Sprintf("blocks=%d", size), func(b *testing.B) {
			var c benchChains
			tr := benchTree(b, Config{})
			root, bs := c.chain(chainLen)
			_, err := tr.InsertChain(root, bs)
			require.NoError(b, err)
			chain := make([]key.BlockKey, len(bs))
			for i := range bs {
				chain[i] = bs[i].Key
			}
			c.fill(b, tr, size-chainLen, chainLen)
			b.ResetTimer()
			for range b.N {
				require.Equal(b, chainLen, tr.Match(root, chain), "Match")
			}
			reportPerBlock(b, chainLen)
		})
	}
}

// BenchmarkEvict frees one 64-block chain's worth of bytes from a full index
// of the given size, then refills it untimed.
func BenchmarkEvict(b *testing.B) {
	const chainLen = 64
	for _, policy := range []Policy{LRU, CostAware} {
		for _, size := range benchSizes {
			b.Run(fmt.Sprintf("policy=%s/blocks=%d", policy, size), func(b *testing.B) {
				var c benchChains
				tr := benchTree(b, Config{BudgetBytes: int64(size) * benchBlockBytes, Policy: policy})
				c.fill(b, tr, size, chainLen)
				b.ResetTimer()
				for range b.N {
					es, err := tr.Evict(chainLen * benchBlockBytes)
					require.NoError(b, err, "Evict")
					require.Len(b, es, chainLen, "Evict")
					b.StopTimer()
					c.fill(b, tr, chainLen, chainLen)
					b.StartTimer()
				}
				reportPerBlock(b, chainLen)
			})
		}
	}
}
