package bridge

import (
	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

// A store-backed bridge's keeper (storenode.Keeper) holds the directory's
// store entries to what the store holds; the store backend is its
// storenode.Store: it asks the store, and adopts and drops entries in the
// directory and the mirrors. The keeper learns the entries from the
// directory's events: those of the models this bridge registered
// (mirrorFeed), or of every model for a store node (WatchStore).

// probeKey is asked about when there is nothing else to ask, so that an
// audit always learns whether the master answers.
const probeKey = "mcbridge-probe"

// Names says whether a location is the store's.
func (s *storeBackend) Names(loc directory.Location) bool { return s.names(loc) }

// Exist is one batch_is_exist, whose outcome says whether the master
// answers; of no keys, it asks about probeKey.
func (s *storeBackend) Exist(keys []key.BlockKey) ([]bool, error) {
	names := []string{probeKey}
	if len(keys) > 0 {
		names = make([]string, len(keys))
		for i, k := range keys {
			names[i] = storeKey(k)
		}
	}
	cn := s.conn.Load()
	ctx, cancel := s.context()
	defer cancel()
	have, err := cn.c.Exist(ctx, names)
	s.observe(err)
	return have, err
}

// Adopt publishes, under this process's name, the entries that left the
// directory while the store still holds their blocks.
func (s *storeBackend) Adopt(held []directory.Entry) {
	b := s.b
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

// Lost drops store entries whose blocks the store lost: they leave the
// local mirror at once, and, when this process owns them, the directory;
// a copy still in this pool is marked pending, so the next save of its
// tokens writes it again.
func (s *storeBackend) Lost(lost []directory.Entry) {
	b := s.b
	mine := map[key.Fingerprint][]key.BlockKey{}
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

// Audited hands the blocks puts left pending back to the publisher once
// the store answers again.
func (s *storeBackend) Audited() {
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
		b.store.keeper.Observe(ev)
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
	cancel, err := all.SubscribeAll(b.store.keeper.Observe)
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
