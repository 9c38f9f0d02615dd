package bench

import (
	"context"
	"fmt"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvhost"
	"github.com/mcbridge/mcbridge/internal/status"
)

// blockTokens is the bridge's default block size.
const blockTokens = 256

// quick reports whether benchmarks run in the CI's quick mode: smaller
// sizes, so that every case runs once in seconds.
func quick() bool { return os.Getenv("MCB_BENCH_QUICK") != "" || testing.Short() }

// geometry is a model's KV shape: layers of K and V rows of row bytes.
type geometry struct {
	name   string
	layers int
	row    int
}

func (g geometry) bytesPerToken() int64 { return int64(2 * g.layers * g.row) }
func (g geometry) blockBytes() int64    { return blockTokens * g.bytesPerToken() }

// Geometries that give each block size, named after a model of that shape
// where one exists (f16 KV, 256-token blocks).
var (
	geo64K   = geometry{"64KiB", 2, 64}
	geo256K  = geometry{"256KiB", 4, 128}
	geo1M    = geometry{"1MiB", 8, 256}
	geoBench = geometry{"3MiB-bench-cpu", 12, 512} // docs/design.md §15's bench model: 12 layers, 4 KV heads of 64
	geo16M   = geometry{"16MiB", 16, 2048}
	geoLlama = geometry{"32MiB-llama3-8b", 32, 2048} // 32 layers, 8 KV heads of 128
	geo64M   = geometry{"64MiB-qwen2.5-32b", 64, 2048}
	// geoTiny moves almost no bytes, for benchmarks that time everything
	// but the copies.
	geoTiny = geometry{"tiny", 1, 2}
)

func blockGeometries() []geometry {
	if quick() {
		return []geometry{geo64K, geo1M}
	}
	return []geometry{geo64K, geo256K, geo1M, geoBench, geo16M, geoLlama, geo64M}
}

// restoreBytes is about what one restore moves: enough to amortise a
// batch's setup, small enough for three copies in memory.
func restoreBytes() int64 {
	if quick() {
		return 4 << 20
	}
	return 64 << 20
}

var dirs atomic.Int64

// link is how a restore reaches the blocks: from the reader's own pool,
// from a peer's shared pool mapped in place (docs/design.md §8.2), or
// from a peer's over a Loopback link of GBps (0: unshaped).
type link struct {
	name   string
	local  bool
	shared bool
	GBps   float64
	// timeoutMS is the bridges' transfer_timeout_ms; 0 is a minute, which
	// no restore of a benchmark reaches.
	timeoutMS int
}

var (
	linkLocal    = link{name: "local", local: true}
	linkShared   = link{name: "shared", shared: true}
	linkUnshaped = link{name: "unshaped"}
)

func shaped(gbps float64) link { return link{name: fmt.Sprintf("%gGBps", gbps), GBps: gbps} }

func links() []link {
	if quick() {
		return []link{linkLocal, linkShared, linkUnshaped, shaped(10)}
	}
	return []link{linkLocal, linkShared, linkUnshaped, shaped(1), shaped(10), shaped(25), shaped(50)}
}

// openBridge opens a bridge in directory dir whose pool holds poolBlocks
// blocks of g, over link l's Loopback link, its pool shared where l is.
func openBridge(tb testing.TB, dir, owner string, g geometry, poolBlocks int64, l link) *bridge.Bridge {
	tb.Helper()
	cfg := config.Default()
	cfg.Owner = fmt.Sprintf("%s-%s", dir, owner)
	cfg.Directory.Name = dir
	cfg.BlockTokens = blockTokens
	// Headers and alignment add under 1% to a block of 64 KiB and more.
	cfg.PoolBytes = max(poolBlocks*(g.blockBytes()+g.blockBytes()/64+4096), 1<<20)
	cfg.Transport.BandwidthGBps = l.GBps
	cfg.SharedPool = config.SharedPool{Enabled: l.shared, Dir: os.TempDir() + "/mcb-bench-pools"}
	cfg.TransferTimeoutMS = 60_000
	if l.timeoutMS > 0 {
		// A rig with a deadline of its own times its peer out on
		// purpose and restores from it again right after.
		cfg.TransferTimeoutMS, cfg.PeerDownMS = l.timeoutMS, 0
	}
	b, err := bridge.Open(cfg, bridge.Deps{})
	require.NoError(tb, err)
	tb.Cleanup(func() {
		assert.NoError(tb, b.Close(), "closing %s", cfg.Owner)
	})
	return b
}

func newDir(tb testing.TB) string {
	return fmt.Sprintf("bench-%s-%d", tb.Name(), dirs.Add(1))
}

func newHost(tb testing.TB, g geometry, cells int) *kvhost.Host {
	tb.Helper()
	h, err := kvhost.New(g.layers, cells, g.row, g.row)
	require.NoError(tb, err)
	tb.Cleanup(func() { _ = h.Close() })
	return h
}

func register(tb testing.TB, b *bridge.Bridge, h *kvhost.Host, name string) *bridge.Model {
	tb.Helper()
	m, err := b.RegisterModel(h.Spec(name, blockTokens))
	require.NoError(tb, err)
	return m
}

// promptTokens returns n distinct-looking tokens drawn from seed.
func promptTokens(n int, seed uint64) []int32 {
	t := make([]int32, n)
	x := seed
	for i := range t {
		x = x*6364136223846793005 + 1442695040888963407
		t[i] = int32(x >> 47)
	}
	return t
}

// save stores tokens from h through m in one layer-wise save.
func save(m *bridge.Model, h *kvhost.Host, scope key.Scope, tokens []int32) (bridge.SaveResult, error) {
	sv, err := m.SaveBegin(scope, h.Layout(), tokens, kvhost.Positions(len(tokens)))
	if err != nil {
		return bridge.SaveResult{}, err
	}
	for l := range h.Layers() {
		if err := sv.SaveLayer(l); err != nil {
			_, _ = sv.End()
			return bridge.SaveResult{}, err
		}
	}
	return sv.End()
}

// saveAndPublish saves tokens and waits until the publisher has put the
// blocks into the directory, where other bridges' lookups find them.
func saveAndPublish(tb testing.TB, m *bridge.Model, h *kvhost.Host, scope key.Scope, tokens []int32) {
	tb.Helper()
	before := m.Bridge().Stats()
	res, err := save(m, h, scope, tokens)
	require.NoError(tb, err, "saving %d tokens", len(tokens))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(tb, m.Bridge().Flush(ctx), "publishing")
	require.Equal(tb, int64(res.Queued), m.Bridge().Stats().SavedBlocks-before.SavedBlocks, "published blocks: %+v", res)
}

// restoreRig holds a prefix of blocks saved by one bridge, for another
// bridge (or the same one, for a local restore) to restore.
type restoreRig struct {
	src, dst *kvhost.Host
	writer   *bridge.Bridge
	reader   *bridge.Model
	tokens   []int32
	cells    []uint32
	blocks   int
	payload  int64 // KV bytes one restore places
}

func newRestoreRig(tb testing.TB, g geometry, blocks int, l link) *restoreRig {
	tb.Helper()
	dir := newDir(tb)
	n := blocks * blockTokens
	r := &restoreRig{src: newHost(tb, g, n), dst: newHost(tb, g, n), tokens: promptTokens(n, uint64(blocks)),
		cells: kvhost.Positions(n), blocks: blocks, payload: int64(n) * g.bytesPerToken()}
	// Room for the blocks and, on the reader, their staging.
	writer := openBridge(tb, dir, "writer", g, int64(blocks)+2, l)
	wm := register(tb, writer, r.src, g.name)
	r.reader, r.writer = wm, writer
	if !l.local {
		reader := openBridge(tb, dir, "reader", g, int64(blocks)+2, l)
		r.reader = register(tb, reader, r.dst, g.name)
	}
	r.src.Compute(r.tokens, 0, n)
	saveAndPublish(tb, wm, r.src, key.Scope{}, r.tokens)
	return r
}

// restore restores every block, layer by layer, and fails unless all
// arrive verified.
func (r *restoreRig) restore() error {
	ld, err := r.reader.LoadBegin(key.Scope{}, r.dst.Layout(), r.tokens, r.cells)
	if err != nil {
		return err
	}
	for l := range r.dst.Layers() {
		if _, err := ld.WaitLayer(l); err != nil {
			_, _ = ld.End()
			return err
		}
	}
	res, err := ld.End()
	if err == nil && res.OKBlocks != r.blocks {
		err = status.Errorf(status.Internal, "restored %d of %d blocks", res.OKBlocks, r.blocks)
	}
	return err
}

// memcpy copies the bytes a restore places, from the writer's tensors to
// the reader's.
func (r *restoreRig) memcpy() { r.dst.CopyFrom(r.src, len(r.tokens)) }

// check verifies that the reader's tensors hold the restored rows.
func (r *restoreRig) check() error { return r.dst.Check(r.tokens, len(r.tokens)) }

// pairTimer times an operation against a memcpy of the same bytes run
// right after each iteration, so that both see the machine in the same
// state. The ratio is taken between the fastest of each: on a machine
// shared with other work, the fastest iteration is the least disturbed.
type pairTimer struct {
	op, memcpy       time.Duration // totals
	minOp, minMemcpy time.Duration
}

func (p *pairTimer) run(b *testing.B, op func() error, memcpy func()) {
	b.Helper()
	start := time.Now()
	require.NoError(b, op())
	d := time.Since(start)
	p.op += d
	p.minOp = minPositive(p.minOp, d)
	b.StopTimer()
	start = time.Now()
	memcpy()
	d = time.Since(start)
	p.memcpy += d
	p.minMemcpy = minPositive(p.minMemcpy, d)
	b.StartTimer()
}

func minPositive(have, d time.Duration) time.Duration {
	if have == 0 || d < have {
		return d
	}
	return have
}

// xMemcpy is the operation's throughput as a multiple of memcpy's.
func (p *pairTimer) xMemcpy() float64 { return float64(p.minMemcpy) / float64(p.minOp) }
