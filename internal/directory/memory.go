package directory

import (
	"context"
	"sync"

	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

// memoryStore is the shared state behind every Memory of one name.
type memoryStore struct {
	name string

	mu      sync.Mutex
	entries map[key.Fingerprint]map[key.BlockKey]Entry
	subs    map[key.Fingerprint]map[int]*subscriber
	all     map[int]*subscriber // subscribers of every model
	nextSub int
	refs    int
}

// subscriber delivers events in order without holding the store's lock, so
// a callback may take its own locks, even ones held around Publish.
type subscriber struct {
	mu sync.Mutex
	fn func(Event)
}

var memoryStores = struct {
	sync.Mutex
	byName map[string]*memoryStore
}{byName: map[string]*memoryStore{}}

// Memory is a directory inside one process: every bridge of the process
// that opens the same name shares it, as processes share an etcd prefix.
type Memory struct {
	s      *memoryStore
	mu     sync.Mutex
	closed bool
}

// OpenMemory returns a handle on the process's memory directory called
// name, creating it on first use; its entries live until the last handle
// is closed.
func OpenMemory(name string) *Memory {
	memoryStores.Lock()
	defer memoryStores.Unlock()
	s := memoryStores.byName[name]
	if s == nil {
		s = &memoryStore{
			name:    name,
			entries: map[key.Fingerprint]map[key.BlockKey]Entry{},
			subs:    map[key.Fingerprint]map[int]*subscriber{},
			all:     map[int]*subscriber{},
		}
		memoryStores.byName[name] = s
	}
	s.refs++
	return &Memory{s: s}
}

func (m *Memory) check() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return status.Errorf(status.State, "memory directory %q: closed", m.s.name)
	}
	return nil
}

func (m *Memory) Publish(ctx context.Context, entries []Entry) ([]bool, error) {
	if err := m.check(); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, status.Wrap(status.Timeout, err, "publish")
	}
	s := m.s
	out := make([]bool, len(entries))
	var events []Event
	models := map[key.Fingerprint]bool{}
	s.mu.Lock()
	for i, e := range entries {
		models[e.Model] = true
		byKey := s.entries[e.Model]
		if byKey == nil {
			byKey = map[key.BlockKey]Entry{}
			s.entries[e.Model] = byKey
		}
		if have, held := byKey[e.Key]; held {
			out[i] = have == e
			continue
		}
		byKey[e.Key] = e
		out[i] = true
		events = append(events, Event{Kind: Put, Entry: e})
	}
	// Also with nothing new: a publisher that lost a block to another
	// returns only once the winner's events reached every subscriber, so
	// its own mirror already shows who holds the block.
	s.deliverLocked(models, events)
	return out, nil
}

func (m *Memory) Unpublish(ctx context.Context, owner string, model key.Fingerprint, keys []key.BlockKey) error {
	if err := m.check(); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return status.Wrap(status.Timeout, err, "unpublish")
	}
	s := m.s
	var events []Event
	s.mu.Lock()
	byKey := s.entries[model]
	for _, k := range keys {
		e, ok := byKey[k]
		if !ok || e.Loc.Owner != owner {
			continue
		}
		delete(byKey, k)
		events = append(events, Event{Kind: Delete, Entry: e})
	}
	s.deliverLocked(map[key.Fingerprint]bool{model: true}, events)
	return nil
}

// deliverLocked hands events to the subscribers of their models and to
// those of every model. It is called with s.mu held and releases it; each
// subscriber's lock is taken before s.mu is let go, so a later change can
// neither overtake these events nor return before they are delivered.
func (s *memoryStore) deliverLocked(models map[key.Fingerprint]bool, events []Event) {
	var targets []*subscriber
	byModel := map[key.Fingerprint][]*subscriber{}
	for model := range models {
		for _, sub := range s.subs[model] {
			targets = append(targets, sub)
			byModel[model] = append(byModel[model], sub)
		}
	}
	for _, sub := range s.all {
		targets = append(targets, sub)
	}
	all := make([]*subscriber, 0, len(s.all))
	for _, sub := range s.all {
		all = append(all, sub)
	}
	for _, sub := range targets {
		sub.mu.Lock()
	}
	s.mu.Unlock()
	for _, ev := range events {
		for _, sub := range byModel[ev.Entry.Model] {
			sub.fn(ev)
		}
		for _, sub := range all {
			sub.fn(ev)
		}
	}
	for _, sub := range targets {
		sub.mu.Unlock()
	}
}

func (m *Memory) Subscribe(model key.Fingerprint, fn func(Event)) (func(), error) {
	return m.subscribe(fn, func(s *memoryStore, id int, sub *subscriber) ([]Entry, func()) {
		if s.subs[model] == nil {
			s.subs[model] = map[int]*subscriber{}
		}
		s.subs[model][id] = sub
		snapshot := make([]Entry, 0, len(s.entries[model]))
		for _, e := range s.entries[model] {
			snapshot = append(snapshot, e)
		}
		return snapshot, func() { delete(s.subs[model], id) }
	})
}

// SubscribeAll is Subscribe for every model at once.
func (m *Memory) SubscribeAll(fn func(Event)) (func(), error) {
	return m.subscribe(fn, func(s *memoryStore, id int, sub *subscriber) ([]Entry, func()) {
		s.all[id] = sub
		var snapshot []Entry
		for _, byKey := range s.entries {
			for _, e := range byKey {
				snapshot = append(snapshot, e)
			}
		}
		return snapshot, func() { delete(s.all, id) }
	})
}

// subscribe registers a subscriber under the store's lock (add returns its
// snapshot and how to unregister it), then delivers the snapshot before any
// event that follows it, holding the subscriber's lock.
func (m *Memory) subscribe(fn func(Event), add func(s *memoryStore, id int, sub *subscriber) ([]Entry, func())) (func(), error) {
	if err := m.check(); err != nil {
		return nil, err
	}
	s := m.s
	sub := &subscriber{fn: fn}
	s.mu.Lock()
	s.nextSub++
	snapshot, remove := add(s, s.nextSub, sub)
	sub.mu.Lock()
	s.mu.Unlock()
	for _, e := range snapshot {
		fn(Event{Kind: Put, Entry: e})
	}
	sub.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			s.mu.Lock()
			remove()
			s.mu.Unlock()
		})
	}, nil
}

// Close drops this handle. The last handle's close forgets every entry, as
// a directory whose owners are all gone holds nothing.
func (m *Memory) Close() error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return status.Errorf(status.State, "memory directory %q: closed twice", m.s.name)
	}
	m.closed = true
	m.mu.Unlock()
	memoryStores.Lock()
	defer memoryStores.Unlock()
	m.s.refs--
	if m.s.refs == 0 {
		delete(memoryStores.byName, m.s.name)
	}
	return nil
}
