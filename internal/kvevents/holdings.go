package kvevents

import (
	"cmp"
	"slices"
	"strings"

	"github.com/mcbridge/mcbridge/internal/key"
)

// Chain is a prompt's full blocks from position 0 as routers name them:
// Hashes[i] is the sequence hash of blocks 0..i, Tokens holds
// len(Hashes)*BlockSize token ids.
type Chain struct {
	Hashes []uint64
	Tokens []int32
}

// NewChain hashes the full blocks of tokens with key.MooncakeHashes (XXH3-64
// over each block's tokens as u32 little-endian, rolled over the previous
// block's hash, with seed): Mooncake's standard sequence hash, which is
// Dynamo's with its seed 1337. tokens is copied.
func NewChain(tokens []int32, blockSize int, seed uint64) *Chain {
	hs := key.MooncakeHashes(tokens, blockSize, seed)
	return &Chain{Hashes: hs, Tokens: slices.Clone(tokens[:len(hs)*blockSize])}
}

// Block is a block of this process's pool: the one at depth Index of
// Chain, which the bridge names Key.
type Block struct {
	Key   key.BlockKey
	Chain *Chain
	Index int
}

// held is one announced block of a topic. refs counts what keeps it
// announced: the bridge's block of this hash, if it holds one, and each
// announced block that hangs under it.
type held struct {
	parent    uint64
	hasParent bool
	depth     int
	tokens    []int32
	refs      int
}

// topic is what one topic's consumers have been told.
type topic struct {
	name      string
	blockSize int
	held      map[uint64]*held
}

// pinned is what one of the bridge's blocks holds announced.
type pinned struct {
	t    *topic
	hash uint64
}

// holdings is the publisher's exact view of what it has announced, and the
// events that turn the consumers' view into it. Not safe for concurrent
// use; the publisher guards it.
type holdings struct {
	medium string
	topics map[string]*topic
	keys   map[key.BlockKey]pinned
	out    []queued // events not yet handed to the socket, in order
	blocks int      // blocks (and clears) in out
}

// queued is an event for one topic.
type queued struct {
	t  *topic
	ev Event
}

func newHoldings(medium string) *holdings {
	return &holdings{medium: medium, topics: map[string]*topic{}, keys: map[key.BlockKey]pinned{}}
}

// topic returns the named topic, announcing AllBlocksCleared first when it
// is new: a publisher that starts holds nothing, whatever a process that
// published under the same topic before it (killed, say) left behind.
func (h *holdings) topic(name string, blockSize int) *topic {
	t := h.topics[name]
	if t == nil {
		t = &topic{name: name, blockSize: blockSize, held: map[uint64]*held{}}
		h.topics[name] = t
		h.push(t, Event{Tag: TagCleared})
	}
	return t
}

// stored announces blocks of this process and every block above them in
// their chains: a block restores only with its whole prefix, and routers
// index a chain from position 0. A block already announced is pinned again.
func (h *holdings) stored(t *topic, blocks []Block) {
	for _, b := range blocks {
		if _, ok := h.keys[b.Key]; ok || b.Index < 0 || b.Index >= len(b.Chain.Hashes) {
			continue
		}
		c := b.Chain
		// Announce the chain below its deepest block already announced,
		// parents first.
		j := b.Index
		for j >= 0 && t.held[c.Hashes[j]] == nil {
			j--
		}
		for i := j + 1; i <= b.Index; i++ {
			hh := &held{depth: i, tokens: slices.Clone(c.Tokens[i*t.blockSize : (i+1)*t.blockSize])}
			if i > 0 {
				hh.parent, hh.hasParent = c.Hashes[i-1], true
				t.held[hh.parent].refs++
			}
			t.held[c.Hashes[i]] = hh
			h.pushStored(t, c.Hashes[i], hh)
		}
		t.held[c.Hashes[b.Index]].refs++
		h.keys[b.Key] = pinned{t: t, hash: c.Hashes[b.Index]}
	}
}

// removed unpins keys and announces the removal of every block no longer
// pinned, leaves first; keys never announced are ignored.
func (h *holdings) removed(keys []key.BlockKey) {
	for _, k := range keys {
		p, ok := h.keys[k]
		if !ok {
			continue
		}
		delete(h.keys, k)
		hash := p.hash
		for hh := p.t.held[hash]; hh != nil; hh = p.t.held[hash] {
			if hh.refs--; hh.refs > 0 {
				break
			}
			delete(p.t.held, hash)
			h.pushRemoved(p.t, hash)
			if !hh.hasParent {
				break
			}
			hash = hh.parent
		}
	}
}

// clear announces that every topic holds nothing and forgets it all.
func (h *holdings) clear() {
	for _, t := range h.sorted() {
		clear(t.held)
		h.push(t, Event{Tag: TagCleared})
	}
	clear(h.keys)
}

// snapshot replaces the queued events with the whole state: for each
// topic AllBlocksCleared, then every announced block, parents first. It is
// how consumers catch up after events were dropped.
func (h *holdings) snapshot() {
	h.out, h.blocks = nil, 0
	for _, t := range h.sorted() {
		h.push(t, Event{Tag: TagCleared})
		hashes := make([]uint64, 0, len(t.held))
		for hash := range t.held {
			hashes = append(hashes, hash)
		}
		slices.SortFunc(hashes, func(a, b uint64) int {
			if d := t.held[a].depth - t.held[b].depth; d != 0 {
				return d
			}
			return cmp.Compare(a, b)
		})
		for _, hash := range hashes {
			h.pushStored(t, hash, t.held[hash])
		}
	}
}

func (h *holdings) sorted() []*topic {
	ts := make([]*topic, 0, len(h.topics))
	for _, t := range h.topics {
		ts = append(ts, t)
	}
	slices.SortFunc(ts, func(a, b *topic) int { return strings.Compare(a.name, b.name) })
	return ts
}

// take hands over the queued events.
func (h *holdings) take() []queued {
	out := h.out
	h.out, h.blocks = nil, 0
	return out
}

func (h *holdings) push(t *topic, ev Event) {
	h.out = append(h.out, queued{t: t, ev: ev})
	h.blocks++
}

// pushStored extends the last queued BlockStored when the block continues
// its chain, as vLLM sends a request's new blocks in one event.
func (h *holdings) pushStored(t *topic, hash uint64, hh *held) {
	if n := len(h.out); n > 0 && hh.hasParent {
		last := &h.out[n-1]
		if last.t == t && last.ev.Tag == TagStored && last.ev.Hashes[len(last.ev.Hashes)-1] == hh.parent {
			last.ev.Hashes = append(last.ev.Hashes, hash)
			last.ev.Tokens = append(last.ev.Tokens, hh.tokens...)
			h.blocks++
			return
		}
	}
	ev := Event{Tag: TagStored, Hashes: []uint64{hash}, Tokens: slices.Clone(hh.tokens), BlockSize: t.blockSize, Medium: h.medium}
	if hh.hasParent {
		p := hh.parent
		ev.Parent = &p
	}
	h.push(t, ev)
}

func (h *holdings) pushRemoved(t *topic, hash uint64) {
	if n := len(h.out); n > 0 {
		last := &h.out[n-1]
		if last.t == t && last.ev.Tag == TagRemoved {
			last.ev.Hashes = append(last.ev.Hashes, hash)
			h.blocks++
			return
		}
	}
	h.push(t, Event{Tag: TagRemoved, Hashes: []uint64{hash}, Medium: h.medium})
}
