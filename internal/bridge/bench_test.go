package bridge_test

import (
	"fmt"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge/bridgetest"
	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
)

// BenchmarkLookup measures Lookup of a 131072-token prompt (512 blocks of
// 256 tokens, all cached) against a mirror that also holds up to a million
// other blocks, as a process in a large swarm sees: hashing, the walk of
// the mirror and the arbiter's decision.
func BenchmarkLookup(b *testing.B) {
	for _, others := range []int{0, 1e5, 1e6} {
		b.Run(fmt.Sprintf("mirror=%d", others+512), func(b *testing.B) {
			cfg := bridgetest.Config(b)
			cfg.BlockTokens = 256
			br := bridgetest.Open(b, cfg, "bench")
			h := kvtest.New(b, 2, 16, 64, 64, false)
			m := bridgetest.Register(b, br, h, 256)
			r := rand.New(rand.NewSource(1))
			tokens := kvtest.Tokens(r, 131072)
			root := key.Root(m.Fingerprint(), key.Scope{})
			mirror := func(chain []key.BlockKey, parent key.Hash) {
				for _, k := range chain {
					m.Apply(directory.Event{Kind: directory.Put, Entry: directory.Entry{Model: m.Fingerprint(), Key: k, Parent: parent,
						Loc: directory.Location{Segment: "peer", Length: uint64(m.BlockBytes())}}})
					parent = k
				}
			}
			mirror(key.Chain(root, tokens, 256), root)
			for i := 0; i < others; i += 512 {
				var other [16]byte
				r.Read(other[:])
				other[0] ^= 0x80
				chain := make([]key.BlockKey, 512)
				for j := range chain {
					chain[j] = key.BlockHash(other, []int32{int32(i + j)}, nil)
				}
				mirror(chain, other)
			}
			b.SetBytes(int64(4 * len(tokens)))
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				res, err := m.Lookup(key.Scope{}, tokens, 0)
				require.NoError(b, err, "lookup")
				require.Equal(b, 511, res.MatchedBlocks, "lookup: %+v", res)
			}
		})
	}
}
