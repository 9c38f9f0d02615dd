package storenode

import (
	"log/slog"
	"sync"
	"time"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
)

// A Keeper holds the directory's store entries to what the store holds,
// from its own goroutine, never on a request's path:
//
//   - A store entry outlives its owner's lease in the store (its replicas
//     sit in other segments), not in the directory. When one leaves the
//     directory (its owner exited, was killed, or lost its lease), the
//     keeper asks the store whether it still holds the block and, if so,
//     has it published again under this process's name (Store.Adopt).
//     Every store-backed bridge runs one; the directory's put-if-absent
//     keeps one entry.
//   - Every audit interval it asks the store about every store entry it
//     knows, and hands those whose blocks the store lost (evicted, its
//     only replica's segment gone, the master restarted) to Store.Lost.
//
// It learns the entries from the directory's events (Observe): those of
// the models its bridge registered, or of every model for a store node.
type Keeper struct {
	store    Store
	interval time.Duration
	log      *slog.Logger

	mu    sync.Mutex
	known map[key.BlockKey]directory.Entry // store entries the directory shows
	gone  []directory.Entry                // left the directory; adopt what the store holds

	wake chan struct{}
	quit chan struct{}
	done chan struct{}
}

// Store is what a keeper needs of a store-backed bridge: its store
// backend (internal/bridge/storekeep.go).
type Store interface {
	// Names says whether a location is the store's, not a pool's.
	Names(loc directory.Location) bool
	// Exist says which of keys the store holds, or why it could not be
	// asked (the master unreachable). Asked of no keys, it only learns
	// whether the master answers.
	Exist(keys []key.BlockKey) ([]bool, error)
	// Adopt publishes, under this process's name, entries that left the
	// directory while the store still holds their blocks.
	Adopt(held []directory.Entry)
	// Lost drops entries whose blocks the store no longer holds.
	Lost(lost []directory.Entry)
	// Audited follows every audit.
	Audited()
}

// maxExistKeys bounds one Exist.
const maxExistKeys = 512

// NewKeeper is the keeper of store's entries, auditing every interval
// once Run starts.
func NewKeeper(store Store, interval time.Duration, log *slog.Logger) *Keeper {
	return &Keeper{store: store, interval: interval, log: log, known: map[key.BlockKey]directory.Entry{},
		wake: make(chan struct{}, 1), quit: make(chan struct{}), done: make(chan struct{})}
}

// Observe takes one directory event. It runs on the directory's delivery
// goroutine: it only records.
func (k *Keeper) Observe(ev directory.Event) {
	k.mu.Lock()
	defer k.mu.Unlock()
	e := ev.Entry
	switch ev.Kind {
	case directory.Put:
		if k.store.Names(e.Loc) {
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

// Stop ends Run, which must have started.
func (k *Keeper) Stop() {
	close(k.quit)
	<-k.done
}

// Run adopts what leaves the directory and audits every interval until
// Stop.
func (k *Keeper) Run() {
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
			k.store.Audited()
		}
	}
}

// exist splits entries into those the store holds and those it does not;
// a batch whose check failed (the master unreachable) is in neither.
func (k *Keeper) exist(entries []directory.Entry) (held, lost []directory.Entry) {
	for start := 0; start < len(entries); start += maxExistKeys {
		chunk := entries[start:min(start+maxExistKeys, len(entries))]
		keys := make([]key.BlockKey, len(chunk))
		for i, e := range chunk {
			keys[i] = e.Key
		}
		have, err := k.store.Exist(keys)
		if err != nil {
			k.log.Warn("mcbridge: checking the directory against Mooncake Store failed", "blocks", len(chunk), "err", err)
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

// adopt has the entries that left the directory while the store still
// holds their blocks published again.
func (k *Keeper) adopt() {
	k.mu.Lock()
	gone := k.gone
	k.gone = nil
	k.mu.Unlock()
	if held, _ := k.exist(gone); len(held) > 0 {
		k.store.Adopt(held)
	}
}

// audit drops the store entries whose blocks the store no longer holds.
func (k *Keeper) audit() {
	k.mu.Lock()
	entries := make([]directory.Entry, 0, len(k.known))
	for _, e := range k.known {
		entries = append(entries, e)
	}
	k.mu.Unlock()
	if len(entries) == 0 {
		_, _ = k.store.Exist(nil)
		return
	}
	_, lost := k.exist(entries)
	if len(lost) == 0 {
		return
	}
	k.mu.Lock()
	for _, e := range lost {
		if have, ok := k.known[e.Key]; ok && have == e {
			delete(k.known, e.Key)
		}
	}
	k.mu.Unlock()
	k.store.Lost(lost)
}
