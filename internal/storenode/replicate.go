package storenode

import (
	"errors"
	"sync"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/holdings"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Replicate has the node copy every block that another owner publishes
// into its own pool, verified, and keep the copy unpublished while the
// owner holds the block. When the owner's entry goes (the owner evicted
// it, exited, or its lease expired), the store publishes its copy, so KV
// outlives the processes that computed it. Readers always see one entry
// per block. The pool's budget evicts copies like any block: a published
// copy is unpublished first.
//
// Replication runs in one goroutine until the bridge closes.
func (n *Node) Replicate() error {
	r := &replicator{n: n, owner: n.host.Owner(), wake: make(chan struct{}, 1), done: make(chan struct{})}
	cancel, err := n.host.SubscribeAll(r.enqueue)
	if err != nil {
		return err
	}
	n.mu.Lock()
	if n.stopped || n.stopReplication != nil {
		n.mu.Unlock()
		cancel()
		return status.Errorf(status.State, "replication on a closed or replicating bridge")
	}
	stop := make(chan struct{})
	n.stopReplication = func() {
		cancel()
		close(stop)
		<-r.done
	}
	n.mu.Unlock()
	go r.run(stop)
	return nil
}

// replicator queues directory events so that the directory's delivery
// never waits on a transfer.
type replicator struct {
	n     *Node
	owner string
	mu    sync.Mutex
	q     []directory.Event
	wake  chan struct{}
	done  chan struct{}
}

func (r *replicator) enqueue(ev directory.Event) {
	if ev.Entry.Loc.Owner == r.owner {
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
					r.n.copyBlock(ev.Entry)
				} else {
					r.n.takeOver(ev.Entry)
				}
			}
		}
	}
}

// copyBlock reads another owner's block into the pool and verifies it.
func (n *Node) copyBlock(e directory.Entry) {
	// Another owner publishing a block again is a sign of demand too: it
	// computed what it could not find.
	have := n.hold.Touch(e.Key) == 1
	if have || e.Loc.Length == 0 || int64(e.Loc.Length) > n.hold.Size()/2 {
		return
	}
	size := int64(e.Loc.Length)
	off, err := n.hold.Alloc(size)
	if err != nil {
		n.stats.replicationFailures.Add(1)
		return
	}
	g, h, err := n.readVerified(e, off)
	if err != nil {
		if !errors.Is(err, ErrParked) {
			n.hold.Invalidate(off, size)
		}
		n.stats.replicationFailures.Add(1)
		return
	}
	err = n.hold.Admit(e.Parent, holdings.Block{Model: e.Model, Off: off, Size: size, Gen: e.Loc.Generation, Depth: h.Depth, Entry: e},
		n.blockCost(g.BlockTokens, h.Depth), 0)
	if err != nil {
		_ = n.hold.Free(off, size)
		return
	}
	n.stats.replicated.Add(1)
	if n.tier != nil && !n.tier.disk.Has(e.Key) {
		n.tier.persistLater(e.Key)
	}
}

// readVerified reads a whole block into the pool at off and checks that it
// is exactly the block the entry names, every layer included.
func (n *Node) readVerified(e directory.Entry, off int64) (pool.Geometry, pool.Header, error) {
	if err := n.host.ReadBlock(e, off); err != nil {
		return pool.Geometry{}, pool.Header{}, err
	}
	dst := n.hold.Bytes(off, int64(e.Loc.Length))
	g, h, err := pool.VerifyBlock(dst, &pool.Expect{Key: e.Key, Parent: e.Parent, Model: e.Model, Generation: e.Loc.Generation})
	if err == nil && pool.HeaderSum(dst) != e.Loc.Checksum {
		err = status.Errorf(status.Corrupt, "block %s header sum differs from the directory's", e.Key)
	}
	return g, h, err
}

// takeOver publishes the store's copy of a block whose owner let it go.
// The publisher batches it with the rest and settles it: won, it is the
// store's to serve; lost (another process published it first), it stays
// a replica.
func (n *Node) takeOver(gone directory.Entry) {
	n.host.PublishHeld([]key.BlockKey{gone.Key})
}
