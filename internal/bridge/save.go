package bridge

import (
	"sync"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/holdings"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvevents"
	"github.com/mcbridge/mcbridge/internal/kvlayout"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Save copies a prompt's new full blocks out of a host's KV tensors into
// the pool, layer by layer, and publishes them at End. Blocks the directory
// already knows are skipped: the swarm stores each block once.
type Save struct {
	m      *Model
	layout kvlayout.Layout

	total int // full blocks in the tokens
	known int // leading blocks the directory already had

	mu        sync.Mutex
	blocks    []saveBlock
	republish []key.BlockKey // held here, sealed, publish unanswered before
	saved     []bool         // per layer
	ended     bool
	err       error // why the save stopped short (pool full)
}

type saveBlock struct {
	index  int // block number in the prompt
	key    key.BlockKey
	parent key.Hash
	tokens []int32
	runs   []kvlayout.Run
	off    int64
	gen    uint64
	sums   []uint64
	chain  *kvevents.Chain // what routers call it (events.go), or nil
}

// SaveResult says what a save stored.
type SaveResult struct {
	Blocks  int // full blocks in the tokens
	Known   int // already in the directory, skipped
	Written int // copied into the pool and sealed
	// Queued is how many blocks wait for the directory: the new ones and
	// any held here whose earlier publish never got through. The
	// publisher's outcome shows in Stats (SavedBlocks, DedupedBlocks).
	Queued int
}

// SaveBegin prepares to save the full blocks of tokens, position i living
// in cells[i]; a trailing partial block is ignored. The host's rows must
// stay unchanged from each SaveLayer call until it returns.
func (m *Model) SaveBegin(scope key.Scope, layout kvlayout.Layout, tokens []int32, cells []uint32) (*Save, error) {
	b := m.b
	B := m.geo.BlockTokens
	if m.SnapshotOnly() {
		return nil, status.Errorf(status.Unsupported, "model %s has no KV layers: it saves snapshots only", m.fp)
	}
	if len(cells) != len(tokens) {
		return nil, status.Errorf(status.InvalidArg, "save of %d tokens from %d cells", len(tokens), len(cells))
	}
	n := len(tokens) / B
	if n == 0 {
		return nil, status.Errorf(status.InvalidArg, "save of %d tokens: no full block of %d", len(tokens), B)
	}
	tokens, cells = tokens[:n*B], cells[:n*B]
	if err := layout.Validate(&m.shape); err != nil {
		return nil, err
	}
	if err := layout.CheckCells(cells); err != nil {
		return nil, err
	}
	if err := b.begin(); err != nil {
		return nil, err
	}
	sv := &Save{m: m, layout: layout, saved: make([]bool, m.geo.Layers()), total: n}
	sv.layout.Layers = append([]kvlayout.Layer(nil), layout.Layers...)
	root := key.Root(m.fp, scope)
	chain := key.Chain(root, tokens, B)
	// Known means known to the directory: blocks of ours it has not
	// answered for are offered again below.
	known, _ := m.walkMirror(root, chain, nil, func(directory.Entry) {})
	evChain := m.eventChain(scope, tokens)
	sv.known = known
	size := int64(m.geo.Size())
	parent := root
	if known > 0 {
		parent = chain[known-1]
	}
	for i := known; i < n; i++ {
		// A block this pool already holds is not written twice: a sealed
		// block whose publish went unanswered is offered to the directory
		// again as it is, and any other one is already shared.
		held, ok := b.hold.Get(chain[i])
		if ok {
			// A block whose own publish is still out is left to it.
			if held.State.Waiting() {
				sv.republish = append(sv.republish, chain[i])
			}
			parent = chain[i]
			continue
		}
		off, err := b.alloc(size)
		if err != nil {
			sv.err = err
			break
		}
		gen := b.hold.NextGeneration()
		pool.BeginWrite(b.hold.Bytes(off, size), gen)
		sv.blocks = append(sv.blocks, saveBlock{
			index: i, key: chain[i], parent: parent, tokens: tokens[i*B : (i+1)*B],
			runs: kvlayout.Runs(cells[i*B : (i+1)*B]), off: off, gen: gen, sums: make([]uint64, m.geo.Layers()),
			chain: evChain,
		})
		parent = chain[i]
	}
	if len(sv.blocks) == 0 && len(sv.republish) == 0 && sv.err != nil {
		b.end()
		return nil, sv.err
	}
	return sv, nil
}

// Blocks is the number of blocks this save will write.
func (sv *Save) Blocks() int { return len(sv.blocks) }

// SaveLayer copies layer il's rows of every new block into the pool and
// sums them.
func (sv *Save) SaveLayer(il int) error {
	sv.mu.Lock()
	defer sv.mu.Unlock()
	g := &sv.m.geo
	switch {
	case sv.ended:
		return status.Errorf(status.State, "save layer on an ended save")
	case il < 0 || il >= g.Layers():
		return status.Errorf(status.InvalidArg, "layer %d of %d", il, g.Layers())
	case sv.saved[il]:
		return status.Errorf(status.State, "layer %d saved twice", il)
	}
	off, n := g.LayerOffset(il), g.LayerSize(il)
	for i := range sv.blocks {
		blk := &sv.blocks[i]
		payload := sv.m.b.hold.Bytes(blk.off+int64(off), int64(n))
		blk.sums[il] = sv.layout.GatherSum(&sv.m.shape, il, payload, blk.runs)
	}
	sv.saved[il] = true
	return nil
}

// End seals the written blocks and queues them for the directory; it
// returns without waiting on it. When a layer was never saved, nothing is
// sealed and the blocks are freed.
func (sv *Save) End() (SaveResult, error) {
	sv.mu.Lock()
	defer sv.mu.Unlock()
	m := sv.m
	b := m.b
	if sv.ended {
		return SaveResult{}, status.Errorf(status.State, "save ended twice")
	}
	sv.ended = true
	defer b.end()
	res := SaveResult{Blocks: sv.total, Known: sv.known, Written: len(sv.blocks)}
	for l, ok := range sv.saved {
		if !ok && len(sv.blocks) > 0 {
			sv.free(sv.blocks)
			b.stats.add(&b.stats.saveFailures, 1)
			return SaveResult{Blocks: res.Blocks, Known: res.Known}, status.Errorf(status.State, "save ended before layer %d was saved", l)
		}
	}
	g := &m.geo
	size := int64(g.Size())
	entries := make([]directory.Entry, len(sv.blocks))
	for i := range sv.blocks {
		blk := &sv.blocks[i]
		mem := b.hold.Bytes(blk.off, size)
		h := pool.Header{Key: blk.key, Parent: blk.parent, Model: m.fp, Depth: uint32(blk.index), Tokens: blk.tokens, LayerSums: blk.sums}
		if err := pool.EncodeHeader(mem, g, &h); err != nil {
			sv.free(sv.blocks)
			return res, err
		}
		pool.EndWrite(mem, blk.gen)
		entries[i] = directory.Entry{Model: m.fp, Key: blk.key, Parent: blk.parent, Loc: b.location(blk.off, size, pool.HeaderSum(mem), blk.gen)}
	}
	// Hold the blocks before any entry can name them: a load of this
	// process that finds a block in the mirror finds it held, and one that
	// does not finds it through the walk of its own blocks. Blocks another
	// save of this process sealed first are duplicates.
	in, err := sv.seal(entries)
	var offer []key.BlockKey
	var dups []saveBlock
	for i, next := 0, 0; i < len(sv.blocks); i++ {
		if next < len(in) && in[next] == i {
			offer = append(offer, sv.blocks[i].key)
			next++
		} else {
			dups = append(dups, sv.blocks[i])
		}
	}
	sv.free(dups)
	res.Written -= len(dups)
	if err != nil {
		return res, err
	}
	// What the publisher cannot queue stays restorable here, pending: the
	// next save of these tokens offers it again.
	queued, refused := b.hold.OfferPending(append(offer, sv.republish...), b.pub.offer)
	res.Queued = queued
	b.stats.add(&b.stats.publishDropped, int64(refused))
	b.stats.add(&b.stats.saves, 1)
	return res, sv.err
}

func directoryPut(e directory.Entry) directory.Event {
	return directory.Event{Kind: directory.Put, Entry: e}
}

// seal holds the sealed blocks, pending, so that eviction and loads find
// them; entries are what the directory is offered for each. It returns
// the positions in sv.blocks of those it holds. A block whose key is held
// already (another save of this process sealed it first) is left out for
// the caller to free; so is everything after an error.
func (sv *Save) seal(entries []directory.Entry) ([]int, error) {
	b := sv.m.b
	size := int64(sv.m.geo.Size())
	B := sv.m.geo.BlockTokens
	var in []int
	for i, blk := range sv.blocks {
		held, err := b.hold.Seal(blk.parent, holdings.Block{Model: sv.m.fp, Off: blk.off, Size: size, Gen: blk.gen,
			Depth: uint32(blk.index), Entry: entries[i], Chain: blk.chain, Index: blk.index},
			b.arb.PrefillTime(blk.index*B, (blk.index+1)*B).Seconds())
		if err != nil {
			return in, err
		}
		if held {
			in = append(in, i)
		}
	}
	return in, nil
}

// free invalidates and frees blocks that no reader was ever sent to.
func (sv *Save) free(blocks []saveBlock) {
	size := int64(sv.m.geo.Size())
	for _, blk := range blocks {
		sv.m.b.hold.Invalidate(blk.off, size)
	}
}
