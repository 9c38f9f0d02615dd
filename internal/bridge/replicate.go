package bridge

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/holdings"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/mem"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/transport"
)

// Replicate turns this bridge into a store node: it copies every block
// that another owner publishes into its own pool, verified, and keeps the
// copy unpublished while the owner holds the block. When the owner's entry
// goes (the owner evicted it, exited, or its lease expired), the store
// publishes its copy, so KV outlives the processes that computed it.
// Readers always see one entry per block. The pool's budget evicts copies
// like any block: a published copy is unpublished first.
//
// Replication runs in one goroutine until Close.
func (b *Bridge) Replicate() error {
	all, ok := b.dir.(directory.Watcher)
	if !ok {
		return status.Errorf(status.Unsupported, "the directory cannot be watched across models")
	}
	r := &replicator{b: b, wake: make(chan struct{}, 1), done: make(chan struct{})}
	cancel, err := all.SubscribeAll(r.enqueue)
	if err != nil {
		return status.Wrap(status.Directory, err, "watching the directory")
	}
	b.mu.Lock()
	if b.closed || b.stopReplication != nil {
		b.mu.Unlock()
		cancel()
		return status.Errorf(status.State, "replication on a closed or replicating bridge")
	}
	stop := make(chan struct{})
	b.stopReplication = func() {
		cancel()
		close(stop)
		<-r.done
	}
	b.mu.Unlock()
	go r.run(stop)
	return nil
}

// replicator queues directory events so that the directory's delivery
// never waits on a transfer.
type replicator struct {
	b    *Bridge
	mu   sync.Mutex
	q    []directory.Event
	wake chan struct{}
	done chan struct{}
}

func (r *replicator) enqueue(ev directory.Event) {
	if ev.Entry.Loc.Owner == r.b.owner {
		return
	}
	r.mu.Lock()
	r.q = append(r.q, ev)
	r.mu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

func (r *replicator) run(stop chan struct{}) {
	defer close(r.done)
	for {
		select {
		case <-stop:
			return
		case <-r.wake:
		}
		for {
			r.mu.Lock()
			q := r.q
			r.q = nil
			r.mu.Unlock()
			if len(q) == 0 {
				break
			}
			for _, ev := range q {
				select {
				case <-stop:
					return
				default:
				}
				if ev.Kind == directory.Put {
					r.b.copyBlock(ev.Entry)
				} else {
					r.b.takeOver(ev.Entry)
				}
			}
		}
	}
}

// copyBlock reads another owner's block into the pool and verifies it.
func (b *Bridge) copyBlock(e directory.Entry) {
	// Another owner publishing a block again is a sign of demand too: it
	// computed what it could not find.
	have := b.hold.Touch(e.Key) == 1
	if have || e.Loc.Length == 0 || int64(e.Loc.Length) > b.hold.Size()/2 {
		return
	}
	size := int64(e.Loc.Length)
	off, err := b.hold.Alloc(size)
	if err != nil {
		b.stats.add(&b.stats.replicationFailures, 1)
		return
	}
	g, h, err := b.readVerified(e, extent{off, size})
	if err != nil {
		if !errors.Is(err, errParked) {
			b.hold.Invalidate(off, size)
		}
		b.stats.add(&b.stats.replicationFailures, 1)
		return
	}
	err = b.hold.Admit(e.Parent, holdings.Block{Model: e.Model, Off: off, Size: size, Gen: e.Loc.Generation, Depth: h.Depth, Entry: e},
		b.blockCost(g.BlockTokens, h.Depth), 0)
	if err != nil {
		_ = b.hold.Free(off, size)
		return
	}
	b.stats.add(&b.stats.replicated, 1)
	if b.tier != nil && !b.tier.disk.Has(e.Key) {
		b.tier.persistLater(e.Key)
	}
}

// readVerified reads a whole block into the pool extent ext and checks
// that it is exactly the block the entry names, every layer included.
func (b *Bridge) readVerified(e directory.Entry, ext extent) (pool.Geometry, pool.Header, error) {
	if err := b.readBlock(e, ext); err != nil {
		return pool.Geometry{}, pool.Header{}, err
	}
	dst := b.hold.Bytes(ext.off, ext.n)
	g, h, err := pool.VerifyBlock(dst, &pool.Expect{Key: e.Key, Parent: e.Parent, Model: e.Model, Generation: e.Loc.Generation})
	if err == nil && pool.HeaderSum(dst) != e.Loc.Checksum {
		err = status.Errorf(status.Corrupt, "block %s header sum differs from the directory's", e.Key)
	}
	return g, h, err
}

// errParked says that a copy timed out with its transfer still in flight:
// the batch was parked with the extent it may write into, which the caller
// must leave to the reaper.
var errParked = errors.New("transfer parked in flight")

// readBlock reads the whole block an entry names into the pool extent ext.
func (b *Bridge) readBlock(e directory.Entry, ext extent) error {
	dst := b.hold.Bytes(ext.off, ext.n)
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(b.cfg.TransferTimeoutMS)*time.Millisecond)
	defer cancel()
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
			return fmt.Errorf("copy of %s: %w: %w", e.Key, errParked, err)
		}
		return err
	}
	_ = batch.Free()
	if st[0].State != transport.Completed {
		return status.Errorf(status.Transfer, "copy of %s: %s", e.Key, st[0].State)
	}
	return nil
}

// takeOver publishes the store's copy of a block whose owner let it go.
// The publisher batches it with the rest and settles it: won, it is the
// store's to serve; lost (another process published it first), it stays
// a replica.
func (b *Bridge) takeOver(gone directory.Entry) {
	b.publishHeld([]key.BlockKey{gone.Key})
}
