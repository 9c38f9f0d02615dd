package bridge

import (
	"sync"

	"github.com/mcbridge/mcbridge/internal/arbiter"
	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/holdings"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/status"
)

// ModelSpec is what a host registers: the fingerprint inputs and the byte
// sizes of one token's K and V rows per layer.
type ModelSpec struct {
	Params key.Model
	// Name is what routers call the model (the GGUF file's base name);
	// it names the model in KV event topics.
	Name  string
	KRow  []int // bytes of one token's K row, per layer
	VRow  []int // bytes of one token's V row, per layer
	VElem []int // bytes of one V element, per layer (to transpose)
}

// Model is a registered model: its key space, block geometry, and the
// mirror of the directory's blocks for it.
type Model struct {
	b     *Bridge
	fp    key.Fingerprint
	spec  ModelSpec
	geo   pool.Geometry
	shape kvlayout.Shape
	// kvBytesPerToken is what the arbiter weighs a restore by.
	kvBytesPerToken int64
	refs            int // guarded by b.mu

	mu     sync.RWMutex
	mirror mirror
	cancel func()

	tensors tensorRegs
}

// Bridge is the bridge the model is registered with.
func (m *Model) Bridge() *Bridge { return m.b }

// Fingerprint names the model's KV format.
func (m *Model) Fingerprint() key.Fingerprint { return m.fp }

// BlockTokens is the model's block size.
func (m *Model) BlockTokens() int { return m.geo.BlockTokens }

// BlockBytes is the pool size of one block.
func (m *Model) BlockBytes() int { return m.geo.Size() }

// SnapshotOnly says that the model's KV has no layers: all of its state is
// the partial state (a recurrent memory: Mamba), one per sequence, so its
// restores are a snapshot alone and its saves snapshots only. Its lookups
// search the prompt's block boundaries for snapshots directly: no block of
// it is ever published for a walk to find.
func (m *Model) SnapshotOnly() bool { return m.geo.Layers() == 0 }

// RegisterModel registers spec, or returns the model already registered
// under the same fingerprint. Block size 0 takes the configured default.
func (b *Bridge) RegisterModel(spec ModelSpec) (*Model, error) {
	if spec.Params.BlockTokens == 0 {
		spec.Params.BlockTokens = uint32(b.cfg.BlockTokens)
	}
	n := int(spec.Params.NLayer)
	switch {
	case n == 0 && spec.Params.Partial == "":
		return nil, status.Errorf(status.InvalidArg, "model of 0 layers without a partial state: nothing to restore")
	case n > pool.MaxLayers:
		return nil, status.Errorf(status.InvalidArg, "model of %d layers (0..%d)", n, pool.MaxLayers)
	case len(spec.KRow) != n || len(spec.VRow) != n || len(spec.VElem) != n:
		return nil, status.Errorf(status.InvalidArg, "model of %d layers with %d/%d/%d row sizes", n, len(spec.KRow), len(spec.VRow), len(spec.VElem))
	case len(spec.Params.NEmbdKGQA) != n || len(spec.Params.NEmbdVGQA) != n:
		return nil, status.Errorf(status.InvalidArg, "model of %d layers with %d/%d embedding sizes", n, len(spec.Params.NEmbdKGQA), len(spec.Params.NEmbdVGQA))
	}
	geo := pool.Geometry{BlockTokens: int(spec.Params.BlockTokens), KRow: spec.KRow, VRow: spec.VRow}
	if n == 0 {
		// A memory that is all partial state (a recurrent one) has blocks
		// of no layers: it saves and restores snapshots only.
		if err := (&pool.Geometry{BlockTokens: geo.BlockTokens, KRow: []int{1}, VRow: []int{1}}).Validate(); err != nil {
			return nil, err
		}
	} else if err := geo.Validate(); err != nil {
		return nil, err
	}
	if int64(geo.Size()) > b.hold.Size()/2 {
		return nil, status.Errorf(status.Config, "a block of %d bytes does not fit twice in a pool of %d", geo.Size(), b.hold.Size())
	}
	var perToken int64
	for l := 0; l < n; l++ {
		if spec.VElem[l] <= 0 || spec.VRow[l]%spec.VElem[l] != 0 {
			return nil, status.Errorf(status.InvalidArg, "layer %d: V row of %d bytes in elements of %d", l, spec.VRow[l], spec.VElem[l])
		}
		perToken += int64(spec.KRow[l] + spec.VRow[l])
	}
	fp := spec.Params.Fingerprint()

	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil, status.Errorf(status.State, "bridge is closed")
	}
	if m, ok := b.models[fp]; ok {
		// Row sizes follow from the types and widths in the fingerprint;
		// a host that reports others for the same model has a bug, and
		// its layouts would be checked against rows it never declared.
		if m.geo.Digest() != geo.Digest() {
			b.mu.Unlock()
			return nil, status.Errorf(status.ModelMismatch, "model %s registered with other row sizes", fp)
		}
		m.refs++
		b.mu.Unlock()
		return m, nil
	}
	m := &Model{b: b, fp: fp, spec: spec, geo: geo, kvBytesPerToken: perToken, refs: 1,
		mirror: newMirror()}
	m.shape = kvlayout.Shape{Geometry: &m.geo, VElem: spec.VElem}
	b.models[fp] = m
	b.modelEventsLocked(m)
	b.mu.Unlock()

	cancel, err := b.dir.Subscribe(fp, b.mirrorFeed(m))
	if err != nil {
		b.mu.Lock()
		delete(b.models, fp)
		b.mu.Unlock()
		return nil, status.Wrap(status.Directory, err, "subscribing to the directory")
	}
	m.mu.Lock()
	m.cancel = cancel
	m.mu.Unlock()
	return m, nil
}

// UnregisterModel drops one registration; the last stops the mirror.
func (b *Bridge) UnregisterModel(m *Model) error {
	b.mu.Lock()
	if b.models[m.fp] != m || m.refs == 0 {
		b.mu.Unlock()
		return status.Errorf(status.BadHandle, "model %s is not registered", m.fp)
	}
	m.refs--
	last := m.refs == 0
	if last {
		delete(b.models, m.fp)
	}
	b.mu.Unlock()
	if last {
		m.stop()
	}
	return nil
}

func (m *Model) stop() {
	m.mu.Lock()
	cancel := m.cancel
	m.cancel = nil
	m.mu.Unlock()
	if cancel != nil {
		cancel()
	}
	m.unregisterTensors()
}

// apply mirrors one directory event.
func (m *Model) apply(ev directory.Event) {
	m.mu.Lock()
	defer m.mu.Unlock()
	switch ev.Kind {
	case directory.Put:
		m.mirror.put(ev.Entry)
		m.b.warmSameHost(&ev.Entry)
	case directory.Delete:
		// A delete for an entry that was since republished elsewhere must
		// not drop the new one.
		if have, ok := m.mirror.get(ev.Entry.Key); ok && (ev.Entry.Loc.Owner == "" || have.Loc.Owner == ev.Entry.Loc.Owner) {
			m.mirror.delete(ev.Entry.Key)
		}
	}
}

// forget drops a block from the mirror when segment holds it: the local
// view changes at once, before the directory's event comes back.
func (m *Model) forget(k key.BlockKey, segment string) {
	m.mu.Lock()
	if e, ok := m.mirror.get(k); ok && e.Loc.Segment == segment {
		m.mirror.delete(k)
	}
	m.mu.Unlock()
}

// match returns the leading entries of chain present in the mirror, each
// hanging under the previous one.
func (m *Model) match(root key.Hash, chain []key.BlockKey) []directory.Entry {
	var out []directory.Entry
	m.walk(root, chain, func(e directory.Entry) { out = append(out, e) })
	return out
}

// walk visits the leading entries of chain present in the mirror, each
// hanging under the previous one, and returns how many there were. Where
// the mirror ends it goes on through the blocks this process sealed: they
// are valid here whatever the directory shows of them (a publish still out
// or unanswered, or one the publisher is settling into the mirror while
// this walk runs).
func (m *Model) walk(root key.Hash, chain []key.BlockKey, visit func(directory.Entry)) int {
	n, parent := m.walkMirror(root, chain, m.b.downSegments(), visit)
	m.b.hold.View(func(r holdings.Reader) {
		for ; n < len(chain); n++ {
			s, ok := r.Get(chain[n])
			if !ok || !s.State.Ours() || s.Model != m.fp || s.Entry.Parent != parent {
				break
			}
			visit(s.Entry)
			parent = chain[n]
		}
	})
	return n
}

// walkMirror is walk's first part; entries held by a down peer end it.
func (m *Model) walkMirror(root key.Hash, chain []key.BlockKey, down map[string]bool, visit func(directory.Entry)) (int, key.Hash) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	parent, prev := root, int32(-1)
	for i, k := range chain {
		e, slot, ok := m.mirror.next(prev, k)
		if !ok || e.Parent != parent || down[e.Loc.Segment] || !m.b.readable(*e) {
			return i, parent
		}
		visit(*e)
		parent, prev = k, slot
	}
	return len(chain), parent
}

// Mirrored is the number of blocks of this model the local mirror knows.
func (m *Model) Mirrored() int {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return m.mirror.len()
}

// Plan is a lookup's answer: how many leading tokens to restore, and the
// keys of their blocks, so that a load of it hashes nothing again.
type Plan struct {
	MatchedBlocks int
	Decision      arbiter.Decision
	// RestoreTokens is how many leading tokens to restore: whole blocks,
	// always leaving at least one token to compute, and more than the host
	// holds already. 0 means the host computes from what it holds.
	RestoreTokens int

	m        *Model
	root     key.Hash
	chain    []key.BlockKey   // the restore's blocks
	tokens   []int32          // the restore's tokens, the caller's
	snapshot *directory.Entry // the partial state they end at, for a model that keeps one
}

// Model is the model the plan belongs to.
func (p *Plan) Model() *Model { return p.m }

// Tokens are the leading tokens the plan restores.
func (p *Plan) Tokens() []int32 { return p.tokens }

// Lookup hashes the prompt's full blocks, matches them against the mirror
// and asks the arbiter how many to restore, given that the host already
// holds the first cached tokens under this scope. The decision is final:
// a plan that restores goes past what the host holds and beats computing
// the rest. It changes nothing and waits on nothing (a want for the blocks
// after the last one found is queued for that block's holder). The plan
// keeps tokens[:RestoreTokens], not a copy: a 128k-token prompt is 512 KiB,
// and copying it on every lookup cost more than hashing it. The caller
// leaves them unchanged while it uses the plan.
func (m *Model) Lookup(scope key.Scope, tokens []int32, cached int) (*Plan, error) {
	if len(tokens) == 0 {
		return nil, status.Errorf(status.InvalidArg, "lookup of an empty prompt")
	}
	if cached < 0 || cached > len(tokens) {
		return nil, status.Errorf(status.InvalidArg, "lookup of %d tokens with %d cached", len(tokens), cached)
	}
	b := m.b
	B := m.geo.BlockTokens
	// The last token is always computed, so a block ending at it is moot.
	root := key.Root(m.fp, scope)
	chain := key.Chain(root, tokens[:len(tokens)-1], B)
	// The link is named after the walk, which holds the mirror's and the
	// holdings' locks while it visits.
	// first is copied, not pointed to: a pointer to the callback's
	// argument would move every visited entry to the heap.
	var first directory.Entry
	seen, last := false, ""
	matched := len(chain)
	if !m.SnapshotOnly() {
		matched = m.walk(root, chain, func(e directory.Entry) {
			if !seen {
				first, seen = e, true
			}
			last = e.Loc.Segment
		})
	}
	if matched > 0 && matched < len(chain) {
		// The holder of the last block found may have the next ones on
		// its disk: ask (a notification, sent off this thread).
		b.wantAfter(last, chain[matched:])
	}
	// A model that keeps a partial state restores only to a snapshot.
	usable := matched
	var snapAt []int
	var snaps []directory.Entry
	var snapBytes int64
	if m.spec.Params.Partial != "" {
		snapAt, snaps = m.snapshotBoundaries(chain[:matched])
		usable = 0
		if len(snapAt) > 0 {
			usable = snapAt[len(snapAt)-1]
			snapBytes = int64(snaps[len(snaps)-1].Loc.Length)
		}
		if m.SnapshotOnly() {
			// Blocks of no layers are never published: what matched is
			// what the last snapshot covers, and it is the link.
			matched = usable
			if usable > 0 {
				first = snaps[len(snaps)-1]
			}
		}
	}
	link := "none"
	if usable > 0 {
		link = b.linkFor(first)
	}
	d := b.arb.Decide(arbiter.Input{
		PromptTokens:    len(tokens),
		BlockTokens:     B,
		MatchedBlocks:   usable,
		KVBytesPerToken: m.kvBytesPerToken,
		FixedBytes:      snapBytes,
		Link:            link,
		CachedTokens:    cached,
	})
	var snapshot *directory.Entry
	if snapAt != nil && d.RestoreBlocks > 0 {
		// The arbiter may stop short of the last snapshot: the restore
		// ends at the last one before where it stopped, or nowhere.
		i := len(snapAt) - 1
		for i >= 0 && snapAt[i] > d.RestoreBlocks {
			i--
		}
		if i >= 0 && snapAt[i]*B > cached {
			d.RestoreBlocks = snapAt[i]
			snapshot = &snaps[i]
		} else {
			d.RestoreBlocks, d.Reason = 0, arbiter.RecomputeCheaper
		}
	}
	b.stats.lookup(d, B)
	// Answered from a mirror the directory no longer updates, or without
	// the store's blocks: the log says so (rate-limited).
	b.reach.Met("lookup", b.Health())
	p := &Plan{MatchedBlocks: matched, Decision: d, RestoreTokens: d.RestoreBlocks * B, m: m, root: root, snapshot: snapshot}
	if p.RestoreTokens > 0 {
		p.chain = chain[:d.RestoreBlocks]
		p.tokens = tokens[:p.RestoreTokens:p.RestoreTokens]
	}
	return p, nil
}

// linkFor groups calibration by where the bytes of the block e names come
// from: this process's own pool ("local"), a peer segment, or a store class
// (store.go), nearest first.
func (b *Bridge) linkFor(e directory.Entry) string {
	if e.Loc.Segment == b.tr.LocalSegment() {
		return "local"
	}
	_, writer, ok := parseStoreSegment(e.Loc.Segment)
	if !ok || b.store == nil {
		return e.Loc.Segment
	}
	if b.ownCopy(e) {
		return "local"
	}
	return b.store.link(writer)
}
