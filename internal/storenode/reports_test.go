package storenode_test

import (
	"math/rand"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/bridge/bridgetest"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
)

// A store node keeps the prefix its readers restore through a stream of
// blocks nobody reads again, because readers report their restores to it;
// the same stream pushes out a prefix nobody restores.
func TestStoreKeepsWhatReadersRestore(t *testing.T) {
	for _, tc := range []struct {
		name     string
		restored bool
	}{{"restored by readers", true}, {"restored by nobody", false}} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := bridgetest.Config(t)
			cfg.Arbiter.Policy = "always-restore"
			cfg.PoolBytes = 32 << 20
			store := replicating(t, storeNodeConfig(cfg, 12, "frequency"), "store", nil)
			p, err := bridge.Open(bridgetest.WithOwner(cfg, "producer"), bridge.Deps{})
			require.NoError(t, err)
			src := bigBlocks(t)
			mp := bridgetest.Register(t, p, src, 4)
			hot := kvtest.Tokens(rand.New(rand.NewSource(1)), 17)
			src.Fill(hot, kvtest.SeqCells(17))
			bridgetest.SaveAll(t, mp, src, key.Scope{}, hot, kvtest.SeqCells(17))
			bridgetest.WaitFor(t, "the store to copy the prefix", func() bool { return store.Stats().Replicated == 4 })
			require.NoError(t, p.Close())
			bridgetest.WaitFor(t, "the store to publish its copies", func() bool { return store.Stats().TakenOver == 4 })

			r := bridgetest.Open(t, cfg, "reader")
			mr := bridgetest.Register(t, r, bigBlocks(t), 4)
			c := bridgetest.Open(t, cfg, "churn")
			hc := bigBlocks(t)
			mc := bridgetest.Register(t, c, hc, 4)
			for i := range 20 {
				if tc.restored {
					uses := store.Stats().PeerUses
					n, seg := restoreFrom(t, cfg, mr, hot)
					require.Equal(t, 16, n, "round %d", i)
					require.Equal(t, store.Segment(), seg)
					bridgetest.WaitFor(t, "the store to hear of the restore", func() bool { return store.Stats().PeerUses >= uses+4 })
				}
				cold := kvtest.Tokens(rand.New(rand.NewSource(int64(100+i))), 16)
				hc.Fill(cold, kvtest.SeqCells(16))
				before := store.Stats().Replicated
				bridgetest.SaveAll(t, mc, hc, key.Scope{}, cold, kvtest.SeqCells(16))
				bridgetest.WaitFor(t, "the store to copy the cold blocks", func() bool { return store.Stats().Replicated >= before+4 })
			}
			require.Positive(t, store.Stats().Evictions, "the stream must make the store evict")
			var held int
			for _, k := range key.Chain(key.Root(mr.Fingerprint(), key.Scope{}), hot[:16], 4) {
				if _, ok := store.Holdings().Get(k); ok {
					held++
				}
			}
			if tc.restored {
				assert.Equal(t, 4, held, "the prefix readers restore, after 80 blocks nobody reads")
			} else {
				assert.Less(t, held, 4, "a prefix nobody restores outlived 80 newer blocks")
			}
		})
	}
}
