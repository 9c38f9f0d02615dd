package bridge

import (
	"context"
	"fmt"
	"time"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/disk"
	"github.com/mcbridge/mcbridge/internal/holdings"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/mem"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/storenode"
	"github.com/mcbridge/mcbridge/internal/transport"
)

// Attach has the bridge tell n, a store node's roles on it, what only the
// endpoint sees (evictions, readers' used and want reports) until Close,
// which stops n once the reports have stopped, before this process's
// blocks are unpublished. A bridge takes one store node.
func (b *Bridge) Attach(n *storenode.Node) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed || b.node.Load() != nil {
		return status.Errorf(status.State, "a store node is attached once, to an open bridge")
	}
	if err := b.followSameHost(); err != nil {
		return err
	}
	b.node.Store(n)
	return nil
}

// storeNode is the attached store node, or nil.
func (b *Bridge) storeNode() *storenode.Node { return b.node.Load() }

// Holdings is the pool and the blocks in it.
func (b *Bridge) Holdings() *holdings.Holdings { return b.hold }

// SubscribeAll delivers every model's directory events to fn until cancel.
func (b *Bridge) SubscribeAll(fn func(directory.Event)) (cancel func(), err error) {
	all, ok := b.dir.(directory.Watcher)
	if !ok {
		return nil, status.Errorf(status.Unsupported, "the directory cannot be watched across models")
	}
	if cancel, err = all.SubscribeAll(fn); err != nil {
		return nil, status.Wrap(status.Directory, err, "watching the directory")
	}
	return cancel, nil
}

// ReadBlock reads the whole block an entry names, from its holder, into
// the pool at off (allocated by the caller, e.Loc.Length bytes). A read
// that timed out in flight wraps storenode.ErrParked.
func (b *Bridge) ReadBlock(e directory.Entry, off int64) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(b.cfg.TransferTimeoutMS)*time.Millisecond)
	defer cancel()
	return b.readBlock(ctx, e, off)
}

// readBlock is ReadBlock within ctx.
func (b *Bridge) readBlock(ctx context.Context, e directory.Entry, off int64) error {
	ext := extent{off, int64(e.Loc.Length)}
	dst := b.hold.Bytes(ext.off, ext.n)
	if ok, err := b.copySameHost(ctx, &e, dst); ok {
		return err
	}
	seg, err := b.segment(ctx, e.Loc.Segment)
	if err != nil {
		return err
	}
	batch, err := b.tr.AllocateBatch(1)
	if err != nil {
		return err
	}
	err = batch.Submit([]transport.Request{{Op: transport.Read, Local: mem.Addr(dst), Segment: seg, Remote: e.Loc.Addr, Length: e.Loc.Length}})
	if err != nil {
		_ = batch.Free()
		return err
	}
	st, err := transport.Wait(ctx, batch, 0, 1, transport.DefaultBackoff)
	if err != nil {
		b.peerFailed(e.Loc.Segment, err)
		// The copy target is pool memory: it stays allocated, parked with
		// the batch, until nothing writes into it.
		if batch.Free() != nil {
			b.parkBatch(batch, []extent{ext})
			return fmt.Errorf("copy of %s: %w: %w", e.Key, storenode.ErrParked, err)
		}
		return err
	}
	_ = batch.Free()
	if st[0].State != transport.Completed {
		return status.Errorf(status.Transfer, "copy of %s: %s", e.Key, st[0].State)
	}
	return nil
}

// PublishHeld offers the directory blocks of the pool that it does not
// name as this process's: copies whose owner let go, blocks read back from
// a disk tier. One another process publishes first stays a replica.
func (b *Bridge) PublishHeld(keys []key.BlockKey) {
	_, refused := b.hold.TakeOver(keys, func(s holdings.Block) directory.Location {
		return b.location(s.Off, s.Size, s.Entry.Loc.Checksum, s.Gen)
	}, b.pub.offer)
	b.stats.add(&b.stats.publishDropped, int64(refused))
}

// DiskStats is the attached store node's disk tier's counters; zero
// without one.
func (b *Bridge) DiskStats() disk.Stats {
	if n := b.storeNode(); n != nil {
		return n.DiskStats()
	}
	return disk.Stats{}
}
