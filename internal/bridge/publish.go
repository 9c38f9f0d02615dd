package bridge

import (
	"context"
	"sync"
	"time"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

// The directory is reached from one goroutine of the bridge's own, never
// from the host's thread: a save returns once its blocks are sealed in the
// pool (a load of this process finds them at once), and an eviction once
// the block is invalidated; both leave the directory's side to the
// publisher, so a slow or stopped etcd delays only what other processes
// see.

// Bounds on the publisher's queues. A full put queue leaves the new blocks
// sealed and pending in the pool (this process still restores them, and
// the next save of their tokens offers them again); a full delete queue
// leaves the entries to name blocks whose generation has moved on, which
// every reader refuses, until the owner's lease takes them.
const (
	maxQueuedPuts    = 1 << 14
	maxQueuedDeletes = 1 << 14
	retryMin         = 50 * time.Millisecond
	retryMax         = 5 * time.Second
)

type publisher struct {
	mu       sync.Mutex
	wake     chan struct{}
	puts     []directory.Entry
	dels     map[key.Fingerprint][]key.BlockKey
	nDels    int
	inFlight bool
	idle     *sync.Cond // signalled when the queues are empty and nothing is in flight, and when a batch settles
	taken    uint64     // batches handed to the loop so far
	settled  uint64     // of them, those whose directory calls have ended
	closing  bool
	done     chan struct{}
	lastErr  error // of the last publish; nil once one succeeds
}

func newPublisher() *publisher {
	p := &publisher{wake: make(chan struct{}, 1), dels: map[key.Fingerprint][]key.BlockKey{}, done: make(chan struct{})}
	p.idle = sync.NewCond(&p.mu)
	return p
}

func (p *publisher) kick() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// offer queues entries for publishing and returns how many of the first
// ones it took.
func (p *publisher) offer(entries []directory.Entry) int {
	p.mu.Lock()
	n := min(len(entries), maxQueuedPuts-len(p.puts))
	if p.closing {
		n = 0
	}
	p.puts = append(p.puts, entries[:n]...)
	p.mu.Unlock()
	if n > 0 {
		p.kick()
	}
	return n
}

// withdraw queues the unpublishing of keys and drops any of them still
// waiting to be published. It returns how many deletes it could not queue.
func (p *publisher) withdraw(fp key.Fingerprint, keys []key.BlockKey) int {
	gone := make(map[key.BlockKey]bool, len(keys))
	for _, k := range keys {
		gone[k] = true
	}
	p.mu.Lock()
	kept := p.puts[:0]
	for _, e := range p.puts {
		if !(e.Model == fp && gone[e.Key]) {
			kept = append(kept, e)
		}
	}
	clear(p.puts[len(kept):])
	p.puts = kept
	n := min(len(keys), maxQueuedDeletes-p.nDels)
	p.dels[fp] = append(p.dels[fp], keys[:n]...)
	p.nDels += n
	p.mu.Unlock()
	p.kick()
	return len(keys) - n
}

// take waits for work and hands over everything queued.
func (p *publisher) take() (puts []directory.Entry, dels map[key.Fingerprint][]key.BlockKey, ok bool) {
	for {
		p.mu.Lock()
		if len(p.puts) > 0 || p.nDels > 0 {
			puts, dels = p.puts, p.dels
			p.puts, p.dels, p.nDels = nil, map[key.Fingerprint][]key.BlockKey{}, 0
			p.inFlight = true
			p.taken++
			p.mu.Unlock()
			return puts, dels, true
		}
		p.inFlight = false
		p.idle.Broadcast()
		closing := p.closing
		p.mu.Unlock()
		if closing {
			return nil, nil, false
		}
		<-p.wake
	}
}

// requeue puts entries whose publish failed back at the queue's head.
func (p *publisher) requeue(entries []directory.Entry) {
	p.mu.Lock()
	p.puts = append(entries, p.puts...)
	if len(p.puts) > maxQueuedPuts {
		p.puts = p.puts[:maxQueuedPuts]
	}
	p.mu.Unlock()
}

// wakeWhenDone wakes the waiters on idle when ctx ends, so that a wait
// there sees its deadline; the returned func stops it.
func (p *publisher) wakeWhenDone(ctx context.Context) (stop func() bool) {
	return context.AfterFunc(ctx, func() {
		p.mu.Lock()
		p.idle.Broadcast()
		p.mu.Unlock()
	})
}

// Flush waits until everything queued so far has been offered to the
// directory (published, found published by another process, or retried
// until ctx ends).
func (b *Bridge) Flush(ctx context.Context) error {
	p := b.pub
	defer p.wakeWhenDone(ctx)()
	p.mu.Lock()
	defer p.mu.Unlock()
	for len(p.puts) > 0 || p.nDels > 0 || p.inFlight {
		if err := ctx.Err(); err != nil {
			return status.Wrap(status.Timeout, err, "waiting for the directory to take queued blocks")
		}
		p.idle.Wait()
	}
	return nil
}

// Published waits until the blocks queued for the directory before the
// call are named by it (or found named by another process), until ctx
// ends: a host that may be killed as soon as its answer is out holds the
// answer here, so that a store node hears of the blocks first (Ollama
// with keep_alive 0, docs/design.md §8.2). It does not wait on a
// directory that is failing now: the blocks stay queued and restorable
// here, and it returns a status.Directory error at once.
func (b *Bridge) Published(ctx context.Context) error {
	p := b.pub
	defer p.wakeWhenDone(ctx)()
	p.mu.Lock()
	defer p.mu.Unlock()
	// The next batch takes everything queued now; without a queue, the
	// batch in flight holds what was.
	want := p.taken
	if len(p.puts) > 0 {
		want++
	}
	for {
		if p.lastErr != nil {
			return status.Wrap(status.Directory, p.lastErr, "the directory has not taken this process's blocks")
		}
		if p.settled >= want {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return status.Wrap(status.Timeout, err, "waiting for the directory to take saved blocks")
		}
		p.idle.Wait()
	}
}

// Queued is how many publishes and unpublishes wait for the directory.
func (b *Bridge) Queued() (puts, deletes int) {
	b.pub.mu.Lock()
	defer b.pub.mu.Unlock()
	return len(b.pub.puts), b.pub.nDels
}

// publishLoop is the publisher's goroutine. Failed publishes are retried
// with backoff until they succeed or the bridge closes; the blocks stay
// resident and restorable here meanwhile.
func (b *Bridge) publishLoop() {
	p := b.pub
	defer close(p.done)
	wait := retryMin
	for {
		puts, dels, ok := p.take()
		if !ok {
			return
		}
		// Deletes go first: a put queued after a delete of the same key
		// (a block evicted, then saved or read back again) must not meet
		// the old entry, nor be removed with it. A put queued before its
		// delete was taken out of the queue by withdraw.
		for fp, keys := range dels {
			ctx, cancel := b.opContext()
			err := b.dir.Unpublish(ctx, b.owner, fp, keys)
			cancel()
			if err != nil {
				// Readers sent here by a stale entry fail on the generation.
				b.stats.add(&b.stats.directoryErrors, 1)
				b.log.Warn("mcbridge: unpublishing evicted blocks failed", "blocks", len(keys), "err", err)
			}
		}
		failed := false
		if b.store != nil && len(puts) > 0 {
			puts = b.store.put(puts)
		}
		if len(puts) > 0 {
			err := b.publishNow(puts)
			p.mu.Lock()
			p.lastErr = err
			p.mu.Unlock()
			if err != nil {
				failed = true
				p.requeue(puts)
				b.stats.add(&b.stats.directoryErrors, 1)
				b.log.Warn("mcbridge: publishing blocks failed; retrying", "blocks", len(puts), "err", err)
			}
			b.reach.Met("publish", b.Health())
		}
		p.mu.Lock()
		p.settled = p.taken
		p.idle.Broadcast()
		p.mu.Unlock()
		if !failed {
			wait = retryMin
			continue
		}
		p.mu.Lock()
		closing := p.closing
		p.mu.Unlock()
		select {
		case <-b.closeCh:
			// Close's flush waits on this queue, and with closeCh closed
			// the backoff below no longer waits: a directory that refuses
			// (full, say) would be asked again in a tight loop until the
			// flush's deadline, which then fails the close.
			closing = true
		default:
		}
		if closing {
			// Close gives up on what is left: the lease takes what was
			// published, and nothing else names these blocks.
			p.mu.Lock()
			p.puts = nil
			p.mu.Unlock()
			continue
		}
		select {
		case <-time.After(wait):
		case <-b.closeCh:
		}
		wait = min(2*wait, retryMax)
	}
}

// publishNow offers entries to the directory and settles each block: won,
// it is the directory's to name and joins the local mirror; lost, another
// process published it first and this copy goes.
func (b *Bridge) publishNow(entries []directory.Entry) error {
	ctx, cancel := b.opContext()
	won, err := b.dir.Publish(ctx, entries)
	cancel()
	if err != nil {
		code := status.Of(err)
		if code != status.Timeout {
			code = status.Directory
		}
		return status.Wrap(code, err, "publishing saved blocks")
	}
	var lost []directory.Entry
	published, deduped := 0, 0
	for i, w := range won {
		e := entries[i]
		if !w {
			deduped++
			lost = append(lost, e)
			continue
		}
		published++
		// The mirror takes the block before its publishing flag clears, so
		// the walk through this process's own blocks never loses sight of
		// it. One evicted meanwhile leaves the mirror again.
		m := b.model(e.Model)
		if m == nil {
			b.settle(e.Key, e.Loc.Generation)
			continue
		}
		m.apply(directoryPut(e))
		if !b.settle(e.Key, e.Loc.Generation) {
			m.forget(e.Key, e.Loc.Segment)
		}
	}
	b.dropLost(lost)
	b.stats.add(&b.stats.savedBlocks, int64(published))
	b.stats.add(&b.stats.dedupedBlocks, int64(deduped))
	return nil
}

// settle marks a held block as answered for by the directory and reports
// whether it is still the block published (not evicted since). The sink
// hears of it under the holdings' lock, so that an eviction of the block
// is heard after it.
func (b *Bridge) settle(k key.BlockKey, gen uint64) bool {
	held, tookOver := b.hold.Settle(k, gen, b.announce)
	if tookOver {
		b.stats.add(&b.stats.takenOver, 1)
	}
	return held
}

// dropLost records the blocks another process published first.
func (b *Bridge) dropLost(lost []directory.Entry) {
	for i := len(lost) - 1; i >= 0; i-- {
		b.hold.Lose(lost[i].Key, lost[i].Loc.Generation)
	}
}
