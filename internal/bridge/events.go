package bridge

import (
	"github.com/mcbridge/mcbridge/internal/holdings"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvevents"
	"github.com/mcbridge/mcbridge/internal/pool"
)

// EventSink hears which blocks this process answers for: those the
// directory names it for, saved here and published, or taken over by a
// store node (docs/kvevents.md). It is called from the publisher's
// goroutine, the store node's replication and eviction, never from a
// host's thread, and must not block.
type EventSink interface {
	// Model: a model's events start; what a process before this one left
	// under the same name is gone.
	Model(model string, blockTokens int)
	// Stored: blocks of model, and the chains above them, are held here.
	Stored(model string, blockTokens int, blocks []kvevents.Block)
	// Removed: blocks left this process; keys never stored are ignored.
	Removed(keys []key.BlockKey)
	// Clear: this process holds nothing any more (it closes).
	Clear()
}

// openEvents sets up the sink: the one deps gives, or a KV events
// publisher when the configuration names an endpoint. Either hears Clear
// when the bridge closes; only a publisher built here is closed.
func (b *Bridge) openEvents(deps Deps) error {
	if b.events = deps.Events; b.events == nil && b.cfg.KVEvents.Enabled() {
		p, err := kvevents.Open(b.cfg.KVEvents, b.log, b.now)
		if err != nil {
			return err
		}
		b.events, b.publisher = p, p
	}
	if b.events == nil {
		return nil
	}
	b.closers = append(b.closers, func() error {
		if b.publisher != nil {
			return b.publisher.Close() // announces the clear itself
		}
		b.events.Clear()
		return nil
	})
	return nil
}

// EventStats counts the KV events publisher's work; zero without one.
func (b *Bridge) EventStats() kvevents.Stats {
	if b.publisher == nil {
		return kvevents.Stats{}
	}
	return b.publisher.Stats()
}

// eventChain hashes a save's tokens as routers do, when events are on and
// the save runs in the base scope: blocks under a tenant salt or adapters
// are never announced, since a router hashing a prompt's tokens cannot
// tell them from the base prompt's and a request it sends for them would
// find nothing to restore.
func (m *Model) eventChain(scope key.Scope, tokens []int32) *kvevents.Chain {
	if m.b.events == nil || len(scope.TenantSalt) > 0 || scope.Adapters != "" {
		return nil
	}
	return kvevents.NewChain(tokens, m.geo.BlockTokens, m.b.cfg.KVEvents.HashSeed)
}

// modelEventsLocked starts a newly registered model's events. b.mu is held.
func (b *Bridge) modelEventsLocked(m *Model) {
	if b.events != nil {
		b.events.Model(b.eventNameLocked(m.fp), m.geo.BlockTokens)
	}
}

// eventNameLocked names a model in event topics: the configured name, the
// name its host registered it under, or, on a store node that registers
// none, its fingerprint. b.mu is held.
func (b *Bridge) eventNameLocked(fp key.Fingerprint) string {
	if b.cfg.KVEvents.Model != "" {
		return b.cfg.KVEvents.Model
	}
	if m := b.models[fp]; m != nil && m.spec.Name != "" {
		return m.spec.Name
	}
	return fp.String()
}

// announce tells the sink that s, held under k, is this process's to
// answer for now: a block it saved whose publish won, or a store node's
// copy that it took over. It runs under the holdings' lock (Settle), so
// that an eviction of the block is heard after it.
func (b *Bridge) announce(k key.BlockKey, s *holdings.Block, r holdings.Reader) {
	if b.events == nil {
		return
	}
	c, i := s.Chain, s.Index
	s.Chain = nil
	if isSnapshot(s.Entry) {
		return // no block of tokens: routers hash blocks only
	}
	if c == nil {
		if s.State.Ours() && !s.State.Takeover() {
			return // saved outside the base scope
		}
		// A store node's copy, or one it took over: its chain is read
		// back from the copies above it.
		if c, i = b.heldChain(k, s, r); c == nil {
			return
		}
	}
	B := len(c.Tokens) / len(c.Hashes)
	b.mu.Lock()
	name := b.eventNameLocked(s.Model)
	b.mu.Unlock()
	b.events.Stored(name, B, []kvevents.Block{{Key: k, Chain: c, Index: i}})
}

// heldChain rebuilds the chain of a block from the headers of the blocks
// this pool holds above it, up to the base scope's root of its model.
// Chains of other scopes, or with a block missing here, give nil.
func (b *Bridge) heldChain(k key.BlockKey, s *holdings.Block, r holdings.Reader) (*kvevents.Chain, int) {
	root := key.Root(s.Model, key.Scope{})
	var rev [][]int32
	for cur, cs := k, *s; ; {
		mem := b.hold.Bytes(cs.Off, cs.Size)
		g, err := pool.ParseGeometry(mem)
		if err != nil {
			return nil, 0
		}
		h, err := pool.DecodeHeader(mem, &g)
		if err != nil || h.Key != cur {
			return nil, 0
		}
		rev = append(rev, h.Tokens)
		if h.Parent == root {
			break
		}
		next, ok := r.Get(h.Parent)
		if !ok || next.Model != s.Model {
			return nil, 0
		}
		cur, cs = h.Parent, next
	}
	var tokens []int32
	for i := len(rev) - 1; i >= 0; i-- {
		tokens = append(tokens, rev[i]...)
	}
	return kvevents.NewChain(tokens, len(rev[0]), b.cfg.KVEvents.HashSeed), len(rev) - 1
}

// removedEvents tells the sink which of this process's blocks an eviction
// took.
func (b *Bridge) removedEvents(byModel map[key.Fingerprint][]key.BlockKey) {
	if b.events == nil {
		return
	}
	for _, keys := range byModel {
		b.events.Removed(keys)
	}
}
