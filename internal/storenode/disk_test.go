package storenode_test

import (
	"fmt"
	"log/slog"
	"math/rand"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/bridge/bridgetest"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/disk"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/residency"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/storenode"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// diskStore opens a store node with a disk tier in dir and starts it.
func diskStore(t *testing.T, cfg config.Config, dir string, budget int64, codec disk.Codec) (*storeNode, *disk.Tier) {
	t.Helper()
	tier, err := disk.Open(disk.Config{Dir: dir, Bytes: budget, Codec: codec, Policy: residency.Frequency})
	require.NoError(t, err)
	return replicating(t, cfg, "store", tier), tier
}

// saved has an owner compute and save a prompt of n full blocks (and one
// token), and returns the owner, which the caller closes.
func saved(t *testing.T, cfg config.Config, owner string, seed int64, blocks int) (*bridge.Bridge, []int32) {
	t.Helper()
	o, err := bridge.Open(bridgetest.WithOwner(cfg, owner), bridge.Deps{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = o.Close() })
	h := bigBlocks(t)
	m := bridgetest.Register(t, o, h, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(seed)), 4*blocks+1)
	h.Fill(tokens, kvtest.SeqCells(len(tokens)))
	bridgetest.SaveAll(t, m, h, key.Scope{}, tokens, kvtest.SeqCells(len(tokens)))
	return o, tokens
}

// takenOver has an owner save a prompt of n full blocks, waits until the
// store's tier has written them, closes the owner and waits until the
// store has published its copies.
func takenOver(t *testing.T, cfg config.Config, store *storeNode, tier *disk.Tier, seed int64, blocks int) []int32 {
	t.Helper()
	owner, tokens := saved(t, cfg, "owner", seed, blocks)
	bridgetest.WaitFor(t, fmt.Sprintf("the store to write %d blocks", blocks), func() bool { return tier.Stats().Files == int64(blocks) })
	require.NoError(t, owner.Close())
	bridgetest.WaitFor(t, "the store to publish its copies", func() bool { return store.Stats().TakenOver == int64(blocks) })
	return tokens
}

// reader opens a bridge named name with bigBlocks' model registered.
func reader(t *testing.T, cfg config.Config, name string) *bridge.Model {
	t.Helper()
	return bridgetest.Register(t, bridgetest.Open(t, cfg, name), bigBlocks(t), 4)
}

// waitMatched waits until mr's lookup of tokens finds blocks blocks.
func waitMatched(t *testing.T, what string, mr *bridge.Model, tokens []int32, blocks int) {
	t.Helper()
	bridgetest.WaitFor(t, what, func() bool {
		lk, err := mr.Lookup(key.Scope{}, tokens, 0)
		require.NoError(t, err)
		return lk.MatchedBlocks == blocks
	})
}

// A store node with a disk tier writes every block it copies to its file;
// closed and opened again on the same directory, it reads them back into
// its pool and publishes them, and a reader restores them byte for byte.
func TestDiskTierOutlivesTheStore(t *testing.T) {
	cfg := bridgetest.Config(t)
	cfg.Arbiter.Policy = "always-restore"
	dir := t.TempDir()
	store, tier := diskStore(t, storeNodeConfig(cfg, 12, "frequency"), dir, 64<<20, disk.Zstd)
	tokens := takenOver(t, cfg, store, tier, 3, 5)
	require.NoError(t, store.Close())

	again, _ := diskStore(t, storeNodeConfig(cfg, 12, "frequency"), dir, 64<<20, disk.Zstd)
	require.Equal(t, 5, again.RefillFromDisk())
	bridgetest.WaitFor(t, "the store to publish what came back", func() bool { return again.Stats().TakenOver == 5 })
	n, seg := restoreFrom(t, cfg, reader(t, cfg, "reader"), tokens)
	assert.Equal(t, 20, n)
	assert.Equal(t, again.Segment(), seg)
	assert.Zero(t, again.Node.DiskStats().Dropped)
}

// Files torn or changed while the store was down are dropped and counted
// when it opens; what comes back is the prefix before them, verified, and
// the reader computes the rest.
func TestDiskTierDropsTornFiles(t *testing.T) {
	cfg := bridgetest.Config(t)
	cfg.Arbiter.Policy = "always-restore"
	dir := t.TempDir()
	store, tier := diskStore(t, storeNodeConfig(cfg, 12, "frequency"), dir, 64<<20, disk.Zstd)
	owner, tokens := saved(t, cfg, "owner", 4, 4)
	bridgetest.WaitFor(t, "the store to write 4 blocks", func() bool { return tier.Stats().Files == 4 })
	require.NoError(t, owner.Close())
	require.NoError(t, store.Close())
	chain := key.Chain(key.Root(registeredFP(t, cfg), key.Scope{}), tokens[:16], 4)
	path := func(k key.BlockKey) string { return tier.Dir() + "/" + k.String()[:2] + "/" + k.String() }
	st, err := os.Stat(path(chain[2]))
	require.NoError(t, err)
	require.NoError(t, os.Truncate(path(chain[2]), st.Size()/2))

	again, tier2 := diskStore(t, storeNodeConfig(cfg, 12, "frequency"), dir, 64<<20, disk.Zstd)
	assert.Equal(t, int64(1), tier2.Stats().Dropped, "the torn file")
	again.RefillFromDisk()
	mr := reader(t, cfg, "reader")
	waitMatched(t, "the reader to find what came back", mr, tokens, 2)
	n, _ := restoreFrom(t, cfg, mr, tokens)
	assert.Equal(t, 8, n, "the two blocks before the torn one")
}

// registeredFP is the fingerprint bigBlocks' model registers under.
func registeredFP(t *testing.T, cfg config.Config) key.Fingerprint {
	t.Helper()
	b := bridgetest.Open(t, cfg, "fp")
	return bridgetest.Register(t, b, bigBlocks(t), 4).Fingerprint()
}

// Blocks evicted from the store's pool stay on its disk; a reader whose
// lookup finds the chain's first blocks asks for the rest, which come
// back into the pool and are published, and its next restore takes them
// all. A file changed on the disk meanwhile is refused on the way back:
// the reader restores what is before it and computes the rest.
func TestDiskTierBringsBackWhatReadersWant(t *testing.T) {
	for _, tc := range []struct {
		name    string
		changed bool
	}{{"whole files", false}, {"a file changed", true}} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := bridgetest.Config(t)
			cfg.Arbiter.Policy = "always-restore"
			store, tier := diskStore(t, storeNodeConfig(cfg, 12, "lru"), t.TempDir(), 64<<20, disk.Raw)
			tokens := takenOver(t, cfg, store, tier, 7, 6)
			chain := key.Chain(key.Root(registeredFP(t, cfg), key.Scope{}), tokens[:24], 4)
			// Eviction takes the chain's last four blocks, as the pool's
			// budget would: leaves first.
			require.Equal(t, 4, evictChainTail(t, store.Bridge, chain, 2))
			flush(t, store.Bridge)
			if tc.changed {
				flipFileByte(t, tier.Dir()+"/"+chain[3].String()[:2]+"/"+chain[3].String())
			}
			mr := reader(t, cfg, "reader")
			want := 6
			if tc.changed {
				want = 3
			}
			// The reader's lookups find the two blocks still in the pool
			// and ask for the rest; the store brings back what its disk
			// holds whole.
			waitMatched(t, "the store to bring the wanted blocks back", mr, tokens, want)
			n, _ := restoreFrom(t, cfg, mr, tokens)
			assert.Equal(t, 4*want, n)
			if tc.changed {
				assert.Equal(t, int64(1), tier.Stats().Dropped, "the changed file")
				assert.Equal(t, int64(1), store.Stats().PagedIn)
			} else {
				assert.Equal(t, int64(4), store.Stats().PagedIn)
			}
		})
	}
}

// evictChainTail evicts chain[keep:] from b's pool, the only chain it
// holds, as its budget would (leaves first), and returns how many went.
func evictChainTail(t *testing.T, b *bridge.Bridge, chain []key.BlockKey, keep int) int {
	t.Helper()
	before := b.Stats().Evictions
	blk, ok := b.Holdings().Get(chain[keep])
	require.True(t, ok, "block %d is held", keep)
	require.NoError(t, b.Holdings().Evict(int64(len(chain)-keep)*blk.Size))
	for i, k := range chain {
		_, held := b.Holdings().Get(k)
		require.Equal(t, i < keep, held, "block %d held after the eviction", i)
	}
	return int(b.Stats().Evictions - before)
}

// flush waits until b's publisher has handed the directory everything.
func flush(t *testing.T, b *bridge.Bridge) {
	t.Helper()
	bridgetest.Published(t, b, b.Stats())
}

func flipFileByte(t *testing.T, path string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	require.NoError(t, err)
	defer f.Close()
	var c [1]byte
	_, err = f.ReadAt(c[:], disk.HeaderSize+777)
	require.NoError(t, err)
	c[0] ^= 1
	_, err = f.WriteAt(c[:], disk.HeaderSize+777)
	require.NoError(t, err)
}

// A block evicted before the write-behind reached it is written on its
// way out.
func TestEvictionSpills(t *testing.T) {
	cfg := bridgetest.Config(t)
	store, tier := diskStore(t, storeNodeConfig(cfg, 12, "lru"), t.TempDir(), 64<<20, disk.Raw)
	_, tokens := saved(t, cfg, "owner", 8, 3)
	bridgetest.WaitFor(t, "the store to write 3 blocks", func() bool { return tier.Stats().Files == 3 })
	chain := key.Chain(key.Root(registeredFP(t, cfg), key.Scope{}), tokens[:12], 4)
	// As if the write-behind had not got to the last block yet.
	tier.Remove(chain[2])
	require.NoError(t, store.Holdings().Evict(store.Holdings().Size()))
	assert.True(t, tier.Has(chain[2]), "the evicted block is on the disk")
	assert.Equal(t, int64(1), store.Stats().Spilled)
}

// A disk that fills keeps what fits, a chain's first blocks; the store
// runs on, its pool serving every block, and a restart brings back what
// the disk kept.
func TestDiskTierFull(t *testing.T) {
	cfg := bridgetest.Config(t)
	cfg.Arbiter.Policy = "always-restore"
	dir := testenv.TmpFS(t, "200k")
	store, tier := diskStore(t, storeNodeConfig(cfg, 12, "lru"), dir, 64<<20, disk.Raw)
	owner, tokens := saved(t, cfg, "owner", 9, 5)
	bridgetest.WaitFor(t, "the store to copy 5 blocks", func() bool { return store.Stats().Replicated == 5 })
	bridgetest.WaitFor(t, "the write-behind to try them all", func() bool {
		st := tier.Stats()
		return st.Written+st.WriteErrors >= 5
	})
	st := tier.Stats()
	require.Positive(t, st.WriteErrors, "200 KiB holds fewer than 5 blocks of 64 KiB")
	require.Positive(t, st.Files)
	assert.Less(t, st.Budget, int64(64<<20), "the budget follows the filesystem")
	require.NoError(t, owner.Close())
	bridgetest.WaitFor(t, "the store to publish its copies", func() bool { return store.Stats().TakenOver == 5 })
	n, _ := restoreFrom(t, cfg, reader(t, cfg, "reader"), tokens)
	assert.Equal(t, 20, n, "the pool serves what the disk could not take")
	require.NoError(t, store.Close())

	again, _ := diskStore(t, storeNodeConfig(cfg, 12, "lru"), dir, 64<<20, disk.Raw)
	back := again.RefillFromDisk()
	require.Equal(t, int(st.Files), back)
	mr := reader(t, cfg, "reader-2")
	waitMatched(t, "the reader to find what came back", mr, tokens, back)
	n, _ = restoreFrom(t, cfg, mr, tokens)
	assert.Equal(t, 4*back, n, "the chain's first blocks, whole")
}

// A holder that restarts under the same segment name (a store node on a
// fixed address) fails its reader's next load once, which retires the
// cached segment; the load after it opens the new holder and restores.
func TestRestartedHolderIsReopened(t *testing.T) {
	cfg := bridgetest.Config(t)
	cfg.Arbiter.Policy = "always-restore"
	dir := t.TempDir()
	store, tier := diskStore(t, storeNodeConfig(cfg, 12, "frequency"), dir, 64<<20, disk.Raw)
	tokens := takenOver(t, cfg, store, tier, 11, 2)
	mr := reader(t, cfg, "reader")
	n, _ := restoreFrom(t, cfg, mr, tokens)
	require.Equal(t, 8, n)
	require.NoError(t, store.Close())

	again, _ := diskStore(t, storeNodeConfig(cfg, 12, "frequency"), dir, 64<<20, disk.Raw)
	require.Equal(t, 2, again.RefillFromDisk())
	waitMatched(t, "the reader to find what came back", mr, tokens, 2)
	h := bigBlocks(t)
	_, err := bridgetest.LoadAll(t, mr, h, key.Scope{}, tokens[:8], kvtest.SeqCells(8))
	require.Equal(t, status.Transfer, status.Of(err), "the cached segment names the old holder")
	n, _ = restoreFrom(t, cfg, mr, tokens)
	assert.Equal(t, 8, n, "reopened")
}

// A store node restarted while the owner of its blocks still runs copies
// them again (replication starts first) as it reads its files back: a block
// the pool came to hold meanwhile is in, not lost, and the read-back says
// nothing of it.
func TestDiskTierRefillAfterReplication(t *testing.T) {
	cfg := bridgetest.Config(t)
	dir := t.TempDir()
	store, tier := diskStore(t, storeNodeConfig(cfg, 12, "frequency"), dir, 64<<20, disk.Raw)
	_, tokens := saved(t, cfg, "owner", 21, 3)
	bridgetest.WaitFor(t, "the store to write 3 blocks", func() bool { return tier.Stats().Files == 3 })
	require.NoError(t, store.Close())

	tier2, err := disk.Open(disk.Config{Dir: dir, Bytes: 64 << 20, Codec: disk.Raw, Policy: residency.Frequency})
	require.NoError(t, err)
	var logged testenv.LockedBuffer
	b := bridgetest.Open(t, storeNodeConfig(cfg, 12, "frequency"), "store")
	n, err := storenode.New(b, storenode.Config{Disk: tier2, Log: slog.New(slog.NewTextHandler(&logged, nil))})
	require.NoError(t, err)
	require.NoError(t, n.Replicate())
	bridgetest.WaitFor(t, "the store to copy the owner's 3 blocks again", func() bool { return n.Stats().Replicated == 3 })

	assert.Zero(t, n.RefillFromDisk(), "every block is in the pool already")
	assert.NotContains(t, logged.String(), "cannot come back")
	assert.Zero(t, n.Stats().PagedIn)
	n2, _ := restoreFrom(t, cfg, reader(t, cfg, "reader"), tokens)
	assert.Equal(t, 12, n2)
}
