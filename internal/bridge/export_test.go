package bridge

import (
	"context"
	"time"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/pool"
	mcstore "github.com/mcbridge/mcbridge/internal/store/mooncake"
	"github.com/mcbridge/mcbridge/internal/storenode"
	"github.com/mcbridge/mcbridge/internal/transport"
)

// What the package's own tests (package bridge_test, which shares its
// helpers with the packages built on the bridge through bridgetest) reach
// inside it.

// Apply feeds the model's mirror one directory event; Match is the
// leading entries of chain the mirror holds.
func (m *Model) Apply(ev directory.Event) { m.apply(ev) }
func (m *Model) Match(root key.Hash, chain []key.BlockKey) []directory.Entry {
	return m.match(root, chain)
}

// Geometry is the model's block layout.
func (m *Model) Geometry() *pool.Geometry { return &m.geo }

// TensorSpans is how many host tensors the model has registered.
func (m *Model) TensorSpans() int { return len(m.tensors.spans) }

// Landed: the load's transfers land in the host's tensors in place.
func (ld *Load) Landed() bool { return ld.landed }

// GenerationBatch is the batch of the load's generation reads.
func (ld *Load) GenerationBatch() transport.Batch { return ld.gens.batch }

// Deadline is how long the load may wait on its transfers.
func (ld *Load) Deadline() time.Duration { return ld.deadline }

// Entries are the mirror's entries of the plan's blocks.
func (p *Plan) Entries() []directory.Entry { return p.m.match(p.root, p.chain) }

// BlockKey is the key of the load's block i.
func (ld *Load) BlockKey(i int) key.BlockKey { return ld.blocks[i].entry.Key }

// MappedPools is how many same-host shared pools the bridge has mapped.
func (b *Bridge) MappedPools() int { return b.shared.peers.Mapped() }

// GenSlot is the staging one generation read takes.
const GenSlot = genSlot

// Reap frees the parked batches that have gone idle.
func (b *Bridge) Reap() { b.reap() }

// Segment opens a peer's segment, as a load does.
func (b *Bridge) OpenSegment(ctx context.Context, name string) (transport.SegmentID, error) {
	return b.segment(ctx, name)
}

// Store-backed bridges (store.go).
var (
	ParseStoreSegment = parseStoreSegment
	StoreKey          = storeKey
)

const LinkStoreHost = linkStoreHost

func (b *Bridge) StoreHealth() error                     { return b.storeHealth() }
func (b *Bridge) LinkFor(e directory.Entry) string       { return b.linkFor(e) }
func (b *Bridge) StoreNames(loc directory.Location) bool { return b.store.names(loc) }

// StoreClient is the bridge's Mooncake Store client; nil until connected.
func (b *Bridge) StoreClient() *mcstore.Client { return b.store.conn.Load().c }

// QueueUsed queues used reports for the holder behind segment
// (reports.go).
func (b *Bridge) QueueUsed(segment string, items ...storenode.ReportItem) {
	b.queue(segment, storenode.ReportUsed, items...)
}

// PoolMemory is the whole of the bridge's pool region.
func (b *Bridge) PoolMemory() []byte { return b.hold.Bytes(0, b.hold.Size()) }

// PoolUsed is the bytes the pool has allocated.
func (b *Bridge) PoolUsed() int64 { return b.hold.Used() }
