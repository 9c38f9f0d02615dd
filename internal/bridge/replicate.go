package bridge

import (
	"context"
	"sync"
	"time"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/mem"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/residency"
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
	// Peers read copies through the engine, unseen, so the store's only
	// sign that a block is in demand is another owner publishing it again:
	// count that as a use, so eviction keeps hot prefixes.
	b.mu.Lock()
	have := b.resident.Touch(e.Key) == 1
	b.mu.Unlock()
	if have || e.Loc.Length == 0 || int64(e.Loc.Length) > b.pool.Size()/2 {
		return
	}
	size := int64(e.Loc.Length)
	off, err := b.pool.Alloc(size)
	if err != nil {
		b.stats.add(&b.stats.replicationFailures, 1)
		return
	}
	block := b.pool.Bytes(off, size)
	g, err := b.readVerified(e, block)
	if err != nil {
		pool.BeginWrite(block, b.pool.NextGeneration())
		_ = b.pool.Free(off, size)
		b.stats.add(&b.stats.replicationFailures, 1)
		return
	}
	b.mu.Lock()
	if _, held := b.resident.Get(e.Key); held {
		err = status.Errorf(status.State, "block %s became resident meanwhile", e.Key)
	} else {
		err = b.insertResidentLocked(e.Parent, residency.Block[slot]{
			Key: e.Key, Bytes: size, Cost: b.arb.PrefillTime(0, g.BlockTokens).Seconds(),
			Value: slot{fp: e.Model, off: off, size: size, gen: e.Loc.Generation, replica: true, entry: e},
		})
	}
	b.mu.Unlock()
	if err != nil {
		_ = b.pool.Free(off, size)
		return
	}
	b.stats.add(&b.stats.replicated, 1)
}

// readVerified reads a whole block into dst and checks that it is exactly
// the block the entry names, every layer included.
func (b *Bridge) readVerified(e directory.Entry, dst []byte) (pool.Geometry, error) {
	g, err := b.readBlock(e, dst)
	if err != nil {
		return g, err
	}
	h, err := pool.VerifyHeader(dst, &g, &pool.Expect{Key: e.Key, Parent: e.Parent, Model: e.Model, Generation: e.Loc.Generation})
	if err != nil {
		return g, err
	}
	if pool.HeaderSum(dst) != e.Loc.Checksum {
		return g, status.Errorf(status.Corrupt, "block %s header sum differs from the directory's", e.Key)
	}
	for l := 0; l < g.Layers(); l++ {
		off := g.LayerOffset(l)
		if pool.Sum(dst[off:off+g.LayerSize(l)]) != h.LayerSums[l] {
			return g, status.Errorf(status.Corrupt, "block %s layer %d: checksum mismatch", e.Key, l)
		}
	}
	return g, nil
}

// readBlock reads the whole block an entry names into dst and parses the
// geometry its header describes.
func (b *Bridge) readBlock(e directory.Entry, dst []byte) (pool.Geometry, error) {
	seg, err := b.segment(e.Loc.Segment)
	if err != nil {
		return pool.Geometry{}, err
	}
	batch, err := b.tr.AllocateBatch(1)
	if err != nil {
		return pool.Geometry{}, err
	}
	err = batch.Submit([]transport.Request{{Op: transport.Read, Local: mem.Addr(dst), Segment: seg, Remote: e.Loc.Addr, Length: e.Loc.Length}})
	if err != nil {
		_ = batch.Free()
		return pool.Geometry{}, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(b.cfg.TransferTimeoutMS)*time.Millisecond)
	st, err := transport.Wait(ctx, batch, 0, 1, transport.DefaultBackoff)
	cancel()
	if err != nil {
		// The copy target is pool memory: wait until nothing writes into
		// it before the caller frees it.
		transport.WaitIdle(batch, transport.DefaultBackoff)
		_ = batch.Free()
		return pool.Geometry{}, err
	}
	_ = batch.Free()
	if st[0].State != transport.Completed {
		return pool.Geometry{}, status.Errorf(status.Transfer, "copy of %s: %s", e.Key, st[0].State)
	}
	g, err := pool.ParseGeometry(dst)
	if err != nil {
		return g, err
	}
	if uint64(g.Size()) != e.Loc.Length {
		return g, status.Errorf(status.Corrupt, "block %s is %d bytes, published as %d", e.Key, g.Size(), e.Loc.Length)
	}
	return g, nil
}

// takeOver publishes the store's copy of a block whose owner let it go.
func (b *Bridge) takeOver(gone directory.Entry) {
	b.mu.Lock()
	s, ok := b.resident.Get(gone.Key)
	b.mu.Unlock()
	if !ok || !s.replica {
		return
	}
	e := s.entry
	e.Loc = directory.Location{Segment: b.tr.LocalSegment(), Addr: uint64(b.pool.Base()) + uint64(s.off),
		Length: uint64(s.size), Checksum: s.entry.Loc.Checksum, Generation: s.gen, Owner: b.owner}
	ctx, cancel := b.opContext()
	won, err := b.dir.Publish(ctx, []directory.Entry{e})
	cancel()
	if err != nil {
		b.stats.add(&b.stats.directoryErrors, 1)
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if cur, ok := b.resident.Get(gone.Key); ok && cur.off == s.off && len(won) == 1 && won[0] {
		b.announceLocked(gone.Key, &cur)
		cur.replica = false
		b.resident.Set(gone.Key, cur)
		b.stats.add(&b.stats.takenOver, 1)
	}
}
