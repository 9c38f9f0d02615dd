package bridge

import (
	"sync"
	"time"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

// The keeper holds the directory's store entries to what the store holds,
// from its own goroutine, never on a request's path:
//
//   - A store entry outlives its owner's lease in the store (its replicas
//     sit in other segments), not in the directory. When one leaves the
//     directory (its owner exited, was killed, or lost its lease), the
//     keeper asks the store whether it still holds the block
//     (batch_is_exist) and, if so, publishes the entry again under this
//     process's name. Every store-backed bridge does; the directory's
//     put-if-absent keeps one.
//   - Every audit interval it asks the store about every store entry it
//     knows. One the store lost (evicted, its only replica's segment gone,
//     the master restarted) leaves the local mirror at once, and, when
//     this process owns it, the directory; a copy still in this pool is
//     marked pending, so the next save of its tokens writes it again.
//
// It learns the entries from the directory's events: those of the models
// this bridge registered (mirrorFeed), or of every model for a store node
// (WatchStore).
type keeper struct {
	s        *storeBackend
	interval time.Duration

	mu    sync.Mutex
	known map[key.BlockKey]directory.Entry // store entries the directory shows
	gone  []directory.Entry                // left the directory; adopt what the store holds

	wake chan struct{}
	quit chan struct{}
	done chan struct{}
}

// maxExistKeys bounds one batch_is_exist.
const maxExistKeys = 512

// probeKey is asked about when there is nothing else to ask, so that an
// audit always learns whether the master answers.
const probeKey = "mcbridge-probe"

func newKeeper(s *storeBackend, interval time.Duration) *keeper {
	return &keeper{s: s, interval: interval, known: map[key.BlockKey]directory.Entry{},
		wake: make(chan struct{}, 1), quit: make(chan struct{}), done: make(chan struct{})}
}

// observe takes one directory event. It runs on the directory's delivery
// goroutine: it only records.
func (k *keeper) observe(ev directory.Event) {
	k.mu.Lock()
	defer k.mu.Unlock()
	e := ev.Entry
	switch ev.Kind {
	case directory.Put:
		if k.s.names(e.Loc) {
			k.known[e.Key] = e
		} else {
			delete(k.known, e.Key)
		}
		return
	case directory.Delete:
		have, ok := k.known[e.Key]
		// A delete names the entry it removed when the directory still
		// knew it; one of another owner leaves ours in place.
		if !ok || (e.Loc.Owner != "" && e.Loc.Owner != have.Loc.Owner) {
			return
		}
		delete(k.known, e.Key)
		k.gone = append(k.gone, have)
	}
	select {
	case k.wake <- struct{}{}:
	default:
	}
}

func (k *keeper) stop() {
	close(k.quit)
	<-k.done
}

func (k *keeper) run() {
	defer close(k.done)
	tick := time.NewTicker(k.interval)
	defer tick.Stop()
	for {
		select {
		case <-k.quit:
			return
		case <-k.wake:
			k.adopt()
		case <-tick.C:
			k.audit()
			k.reoffer()
		}
	}
}

// exist splits entries into those the store holds and those it does not;
// a batch whose check failed (the master unreachable) is in neither.
func (k *keeper) exist(entries []directory.Entry) (held, lost []directory.Entry) {
	for start := 0; start < len(entries); start += maxExistKeys {
		chunk := entries[start:min(start+maxExistKeys, len(entries))]
		keys := make([]string, len(chunk))
		for i, e := range chunk {
			keys[i] = storeKey(e.Key)
		}
		have, err := k.ask(keys)
		if err != nil {
			k.s.b.log.Warn("mcbridge: checking the directory against Mooncake Store failed", "blocks", len(chunk), "err", err)
			continue
		}
		for i, e := range chunk {
			if have[i] {
				held = append(held, e)
			} else {
				lost = append(lost, e)
			}
		}
	}
	return held, lost
}

// ask is one batch_is_exist, whose outcome says whether the master answers.
func (k *keeper) ask(keys []string) ([]bool, error) {
	cn := k.s.conn.Load()
	ctx, cancel := k.s.context()
	defer cancel()
	have, err := cn.c.Exist(ctx, keys)
	k.s.observe(err)
	return have, err
}

// adopt publishes, under this process's name, the entries that left the
// directory while the store still holds their blocks.
func (k *keeper) adopt() {
	k.mu.Lock()
	gone := k.gone
	k.gone = nil
	k.mu.Unlock()
	held, _ := k.exist(gone)
	if len(held) == 0 {
		return
	}
	b := k.s.b
	for i := range held {
		held[i].Loc.Owner = b.owner
	}
	ctx, cancel := b.opContext()
	won, err := b.dir.Publish(ctx, held)
	cancel()
	if err != nil {
		b.stats.add(&b.stats.directoryErrors, 1)
		b.log.Warn("mcbridge: publishing blocks the store still holds failed", "blocks", len(held), "err", err)
		return
	}
	n := 0
	for i, w := range won {
		if !w {
			continue
		}
		n++
		if m := b.model(held[i].Model); m != nil {
			m.apply(directoryPut(held[i]))
		}
	}
	b.stats.add(&b.stats.storeAdopted, int64(n))
}

// audit drops the store entries whose blocks the store no longer holds.
func (k *keeper) audit() {
	k.mu.Lock()
	entries := make([]directory.Entry, 0, len(k.known))
	for _, e := range k.known {
		entries = append(entries, e)
	}
	k.mu.Unlock()
	if len(entries) == 0 {
		_, _ = k.ask([]string{probeKey})
		return
	}
	_, lost := k.exist(entries)
	if len(lost) == 0 {
		return
	}
	b := k.s.b
	mine := map[key.Fingerprint][]key.BlockKey{}
	k.mu.Lock()
	for _, e := range lost {
		if have, ok := k.known[e.Key]; ok && have == e {
			delete(k.known, e.Key)
		}
	}
	k.mu.Unlock()
	for _, e := range lost {
		if m := b.model(e.Model); m != nil {
			m.forget(e.Key, e.Loc.Segment)
		}
		if e.Loc.Owner == b.owner {
			mine[e.Model] = append(mine[e.Model], e.Key)
		}
		b.repend(e)
	}
	for fp, keys := range mine {
		ctx, cancel := b.opContext()
		if err := b.dir.Unpublish(ctx, b.owner, fp, keys); err != nil {
			b.stats.add(&b.stats.directoryErrors, 1)
		}
		cancel()
	}
	b.stats.add(&b.stats.storeAuditDropped, int64(len(lost)))
}

// reoffer hands the blocks puts left pending back to the publisher once the
// store answers again.
func (k *keeper) reoffer() {
	s := k.s
	if s.healthy() != nil {
		return
	}
	s.mu.Lock()
	again := s.pending
	s.pending = false
	s.mu.Unlock()
	if again {
		s.b.reofferPending()
	}
}

// reofferPending offers every block of this pool that waits, pending, for
// the directory (its publish went unanswered or was refused) to the
// publisher again.
func (b *Bridge) reofferPending() {
	_, refused := b.hold.OfferPending(nil, b.pub.offer)
	b.stats.add(&b.stats.publishDropped, int64(refused))
}

// repend marks this pool's copy of a block the store lost as pending, its
// entry naming the pool again, so the next save of its tokens offers it to
// the store once more.
func (b *Bridge) repend(e directory.Entry) {
	if !b.hold.Repend(e.Key, e.Loc.Generation, b.tr.LocalSegment()) {
		return
	}
	b.store.mu.Lock()
	b.store.pending = true
	b.store.mu.Unlock()
}

// model is the registered model of fp, or nil.
func (b *Bridge) model(fp key.Fingerprint) *Model {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.models[fp]
}

// mirrorFeed is what a model's directory subscription delivers to: its
// mirror, and the keeper when there is a store.
func (b *Bridge) mirrorFeed(m *Model) func(directory.Event) {
	if b.store == nil {
		return m.apply
	}
	return func(ev directory.Event) {
		b.store.keeper.observe(ev)
		m.apply(ev)
	}
}

// WatchStore feeds the keeper with every model's events, for a store node
// that registers no model but keeps the directory true to the store.
func (b *Bridge) WatchStore() error {
	if b.store == nil {
		return status.Errorf(status.Config, "WatchStore: the bridge has no store configured")
	}
	all, ok := b.dir.(directory.Watcher)
	if !ok {
		return status.Errorf(status.Unsupported, "WatchStore: the directory cannot be watched across models")
	}
	cancel, err := all.SubscribeAll(b.store.keeper.observe)
	if err != nil {
		return status.Wrap(status.Directory, err, "watching the directory")
	}
	s := b.store
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.shut || s.unwatch != nil {
		cancel()
		return status.Errorf(status.State, "WatchStore on a closed or watching bridge")
	}
	s.unwatch = cancel
	return nil
}
