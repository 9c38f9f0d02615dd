// Package residency is the local radix index over chained block keys.
//
// A block key already commits to every token before its block (key.Chain), so
// the radix tree over token prefixes collapses into a tree of blocks: a node's
// parent is the previous block of its chain, and a chain's first block hangs
// under a scope root (key.Root) that is not itself a node. A longest-prefix
// match walks the chain until the first block that is absent or that hangs
// under another parent.
//
// Nodes live in an arena addressed by int32 and are found by key through a map
// of int32, so neither the map nor (for pointer-free payloads) the arena holds
// pointers for the garbage collector to scan at 1e6 blocks; freed slots are
// reused, and the arena keeps its high-water size. The tree keeps the
// unpinned leaves in a heap ordered by the eviction policy, so each eviction
// costs O(log n).
//
// A Tree is not safe for concurrent use; its owner serialises calls. It reads
// no wall clock: recency is a logical clock that ticks once per block inserted
// or used, so the same calls always give the same evictions.
package residency

import (
	"fmt"
	"math"

	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Policy chooses which unpinned leaf Evict frees first.
type Policy uint8

const (
	// LRU evicts the leaf whose last insert or use is oldest.
	LRU Policy = iota
	// CostAware evicts by GreedyDual-Size: when a block is inserted or used
	// its priority becomes H = L + Cost/Bytes, and Evict frees the leaf with the
	// lowest H (the least recently used among equals), then raises L to that H
	// if it is higher. Blocks that are expensive to recompute per byte stay
	// longer, while L's growth lets blocks that are no longer used go in the
	// end however expensive they were.
	CostAware
	// Frequency is GreedyDual-Size-Frequency: CostAware with the priority
	// H = L + Uses*Cost/Bytes, Uses counting the block's insert and every
	// use since. A prefix that many readers restore outranks a stream of
	// blocks used once, however deep (and so expensive) those are, and L's
	// growth still retires it once its uses stop.
	Frequency
)

// PolicyNamed is the policy a configuration names: "lru", "cost" or
// "frequency".
func PolicyNamed(name string) (Policy, bool) {
	p, ok := map[string]Policy{"lru": LRU, "cost": CostAware, "frequency": Frequency}[name]
	return p, ok
}

func (p Policy) String() string {
	switch p {
	case LRU:
		return "lru"
	case CostAware:
		return "cost-aware"
	case Frequency:
		return "frequency"
	}
	return fmt.Sprintf("policy(%d)", uint8(p))
}

// Config sets a Tree's budget and eviction policy.
type Config struct {
	// BudgetBytes bounds Bytes(): inserts that would pass it fail, and Evict
	// makes room under it. Zero means unbounded, as for a mirror of blocks
	// that other processes hold.
	BudgetBytes int64
	Policy      Policy
}

// Block is one block to insert.
type Block[V any] struct {
	Key   key.BlockKey
	Value V
	// Bytes is what the block occupies; it must be positive.
	Bytes int64
	// Cost is what recomputing the block would cost, in any unit the owner
	// uses consistently (deeper blocks cost more: attention grows with
	// position). It must be finite and not negative; only CostAware and
	// Frequency read it.
	Cost float64
	// Uses is how often the block was used before this insert (a block
	// read back from a disk tier, say); 0 counts as 1. Only Frequency
	// reads it.
	Uses uint32
}

// Entry is an indexed block as reported by Remove, Evict and Walk.
type Entry[V any] struct {
	Key key.BlockKey
	// Parent is the previous block's key, or the scope root for a first block.
	Parent key.Hash
	Value  V
	Bytes  int64
	Cost   float64
	Uses   uint32 // the insert and every use since
}

// maxBlocks keeps every arena index, the sentinel included, within int32.
const maxBlocks = math.MaxInt32 - 1

// node links are arena indices; 0 is the sentinel, whose children are the
// first blocks of every scope, so 0 also reads as "none".
type node[V any] struct {
	key key.BlockKey
	up  key.Hash // parent's key, or the scope root when parent is 0
	// parent, first child, and siblings; next also threads the free list.
	parent, child, prev, next int32
	heapPos                   int32 // position in Tree.heap, -1 when absent
	pins                      int32
	lockedKids                int32 // children that are pinned or have a pinned descendant
	bytes                     int64
	cost                      float64
	prio                      float64 // CostAware's and Frequency's H
	uses                      uint32  // Frequency's count: the insert and every use
	tick                      uint64  // logical time of the last insert or use
	value                     V
}

// Tree is a radix index of chained blocks with pinning and leaf eviction.
type Tree[V any] struct {
	cfg   Config
	ids   map[key.BlockKey]int32
	nodes []node[V]
	free  int32   // head of the free-slot list, 0 when empty
	heap  []int32 // unpinned leaves, least worth keeping first
	bytes int64
	// lockedBytes sums the nodes that are pinned or have a pinned
	// descendant: exactly what Evict can never free.
	lockedBytes int64
	clock       uint64
	inflation   float64 // CostAware's and Frequency's L
}

// New returns an empty tree.
func New[V any](cfg Config) (*Tree[V], error) {
	if cfg.BudgetBytes < 0 {
		return nil, status.Errorf(status.Config, "index: negative budget %d bytes", cfg.BudgetBytes)
	}
	if cfg.Policy != LRU && cfg.Policy != CostAware && cfg.Policy != Frequency {
		return nil, status.Errorf(status.Config, "index: unknown eviction %s", cfg.Policy)
	}
	t := &Tree[V]{cfg: cfg, ids: make(map[key.BlockKey]int32), nodes: make([]node[V], 1)}
	t.nodes[0].heapPos = -1
	return t, nil
}

// Len returns the number of blocks indexed.
func (t *Tree[V]) Len() int { return len(t.ids) }

// Bytes returns the total size of the blocks indexed.
func (t *Tree[V]) Bytes() int64 { return t.bytes }

// InsertChain inserts a chain whose first block hangs under root and returns
// how many blocks were new. Blocks already present keep their value, size and
// cost and only count as used. It changes nothing and returns an error when a
// block is malformed (status.InvalidArg), when a key is already indexed under
// another parent or repeats within the chain (status.InvalidArg), or when the
// new blocks do not fit the budget (status.PoolFull: Evict first, with the
// matched prefix pinned so that the chain being extended survives).
func (t *Tree[V]) InsertChain(root key.Hash, blocks []Block[V]) (int, error) {
	return t.extend(0, root, blocks)
}

// Insert inserts one block under parent, which must be indexed
// (status.NotFound otherwise; a first block goes in through InsertChain).
// It reports whether the block was new, with InsertChain's other rules.
func (t *Tree[V]) Insert(parent key.BlockKey, b Block[V]) (bool, error) {
	pid, ok := t.ids[parent]
	if !ok {
		return false, status.Errorf(status.NotFound, "index: insert %s: parent %s is not indexed", b.Key, parent)
	}
	one := [1]Block[V]{b}
	n, err := t.extend(pid, parent, one[:])
	return n == 1, err
}

// extend inserts blocks below the node at, whose key (or root) is atKey.
func (t *Tree[V]) extend(at int32, atKey key.Hash, blocks []Block[V]) (int, error) {
	i := 0
	for ; i < len(blocks); i++ {
		id, ok := t.ids[blocks[i].Key]
		if !ok {
			break
		}
		if n := &t.nodes[id]; n.parent != at || n.up != atKey {
			return 0, conflict(blocks[i].Key, n.up, atKey)
		}
		at, atKey = id, blocks[i].Key
	}
	fresh := blocks[i:]
	if len(fresh) > maxBlocks-len(t.ids) {
		return 0, status.Errorf(status.PoolFull, "index: %d blocks exceed the index's %d", len(t.ids)+len(fresh), maxBlocks)
	}
	var need int64
	for j := range fresh {
		b := &fresh[j]
		switch {
		case b.Bytes <= 0:
			return 0, status.Errorf(status.InvalidArg, "index: block %s has size %d, want > 0", b.Key, b.Bytes)
		case !(b.Cost >= 0) || math.IsInf(b.Cost, 1):
			return 0, status.Errorf(status.InvalidArg, "index: block %s has recompute cost %v, want finite and >= 0", b.Key, b.Cost)
		case b.Bytes > math.MaxInt64-t.bytes-need:
			return 0, status.Errorf(status.InvalidArg, "index: block %s overflows the total size", b.Key)
		}
		need += b.Bytes
	}
	if t.cfg.BudgetBytes > 0 && t.bytes+need > t.cfg.BudgetBytes {
		return 0, status.Errorf(status.PoolFull, "index: %d new bytes do not fit: %d of %d in use", need, t.bytes, t.cfg.BudgetBytes)
	}

	attach := at
	for j := range fresh {
		b := &fresh[j]
		// Checked here rather than above: a key may repeat inside the chain,
		// which only shows once the earlier copy is in the map.
		if old, dup := t.ids[b.Key]; dup {
			err := conflict(b.Key, t.nodes[old].up, atKey)
			t.unwind(at, attach)
			return 0, err
		}
		at, atKey = t.alloc(b, at, atKey), b.Key
	}
	t.bytes += need
	t.refresh(attach)

	// Ticks rise along the chain, so the deepest block is the most recent.
	base := t.clock
	t.clock += uint64(len(blocks))
	for id, j := at, len(blocks); j > 0; id, j = t.nodes[id].parent, j-1 {
		t.stamp(id, base+uint64(j), j-1 < i)
	}
	t.refresh(at)
	return len(fresh), nil
}

func conflict(k key.BlockKey, have, want key.Hash) error {
	return status.Errorf(status.InvalidArg, "index: block %s is indexed under %s, not %s", k, have, want)
}

// unwind frees the nodes from leaf up to, not including, stop: a path that
// extend attached and has not accounted yet.
func (t *Tree[V]) unwind(leaf, stop int32) {
	for id := leaf; id != stop; {
		p := t.nodes[id].parent
		t.unlink(id)
		delete(t.ids, t.nodes[id].key)
		t.release(id)
		id = p
	}
}

// Match returns how many leading blocks of chain are indexed, the first one
// under root. It changes nothing, recency included.
func (t *Tree[V]) Match(root key.Hash, chain []key.BlockKey) int {
	at, atKey := int32(0), root
	for i, k := range chain {
		id, ok := t.ids[k]
		if !ok {
			return i
		}
		if n := &t.nodes[id]; n.parent != at || n.up != atKey {
			return i
		}
		at, atKey = id, k
	}
	return len(chain)
}

// Get returns a block's value without counting it as used.
func (t *Tree[V]) Get(k key.BlockKey) (V, bool) {
	id, ok := t.ids[k]
	if !ok {
		var zero V
		return zero, false
	}
	return t.nodes[id].value, true
}

// Entry returns a block as Walk reports it, uses included, without
// counting it as used.
func (t *Tree[V]) Entry(k key.BlockKey) (Entry[V], bool) {
	id, ok := t.ids[k]
	if !ok {
		return Entry[V]{}, false
	}
	return t.entry(id), true
}

// Leaf reports whether k is indexed and has no block below it.
func (t *Tree[V]) Leaf(k key.BlockKey) bool {
	id, ok := t.ids[k]
	return ok && t.nodes[id].child == 0
}

// Set replaces an indexed block's value, leaving its place, size, cost and
// recency alone, and reports whether the block was indexed.
func (t *Tree[V]) Set(k key.BlockKey, v V) bool {
	id, ok := t.ids[k]
	if ok {
		t.nodes[id].value = v
	}
	return ok
}

// Touch counts the blocks as used now, in order, so a chain touched from its
// first block ends with its deepest block the most recent. Keys not indexed
// are skipped; it returns how many were found.
func (t *Tree[V]) Touch(keys ...key.BlockKey) int {
	found := 0
	for _, k := range keys {
		if id, ok := t.ids[k]; ok {
			t.clock++
			t.stamp(id, t.clock, true)
			found++
		}
	}
	return found
}

// Pin keeps a block, and so its whole prefix, from eviction and removal until
// a matching Unpin. Pins count.
func (t *Tree[V]) Pin(k key.BlockKey) error {
	id, ok := t.ids[k]
	if !ok {
		return status.Errorf(status.NotFound, "index: pin %s: not indexed", k)
	}
	n := &t.nodes[id]
	if n.pins == math.MaxInt32 {
		return status.Errorf(status.State, "index: pin %s: pinned %d times already", k, n.pins)
	}
	n.pins++
	if n.pins > 1 {
		return nil
	}
	if n.heapPos >= 0 {
		t.heapRemove(id)
	}
	if n.lockedKids == 0 {
		t.lockUp(id)
	}
	return nil
}

// Unpin releases one Pin. Unpinning a block that is not pinned is an error
// (status.State), and changes nothing.
func (t *Tree[V]) Unpin(k key.BlockKey) error {
	id, ok := t.ids[k]
	if !ok {
		return status.Errorf(status.NotFound, "index: unpin %s: not indexed", k)
	}
	n := &t.nodes[id]
	if n.pins == 0 {
		return status.Errorf(status.State, "index: unpin %s: not pinned", k)
	}
	n.pins--
	if n.pins > 0 {
		return nil
	}
	if n.lockedKids == 0 {
		t.unlockUp(id)
	}
	t.refresh(id)
	return nil
}

// lockUp accounts for id having just become locked (pinned, or holding a
// pinned descendant), and for every ancestor that becomes locked with it.
// The walk stops at the first ancestor that was locked already, so pinning a
// chain from its first block costs O(1) per block.
func (t *Tree[V]) lockUp(id int32) {
	for {
		n := &t.nodes[id]
		t.lockedBytes += n.bytes
		if n.parent == 0 {
			return
		}
		p := &t.nodes[n.parent]
		p.lockedKids++
		if p.lockedKids > 1 || p.pins > 0 {
			return
		}
		id = n.parent
	}
}

// unlockUp is lockUp's inverse.
func (t *Tree[V]) unlockUp(id int32) {
	for {
		n := &t.nodes[id]
		t.lockedBytes -= n.bytes
		if n.parent == 0 {
			return
		}
		p := &t.nodes[n.parent]
		p.lockedKids--
		if p.lockedKids > 0 || p.pins > 0 {
			return
		}
		id = n.parent
	}
}

// Remove removes a block and every block below it, which no chain can reach
// once their prefix is gone, and returns them children first, so the owner
// can free them in that order. When the block or any block below it is
// pinned, Remove removes nothing and returns a status.State error that names
// a pinned block.
func (t *Tree[V]) Remove(k key.BlockKey) ([]Entry[V], error) {
	id, ok := t.ids[k]
	if !ok {
		return nil, status.Errorf(status.NotFound, "index: remove %s: not indexed", k)
	}
	if n := &t.nodes[id]; n.pins > 0 || n.lockedKids > 0 {
		return nil, status.Errorf(status.State, "index: remove %s: block %s is pinned", k, t.nodes[t.pinnedUnder(id)].key)
	}
	parent := t.nodes[id].parent
	var out []Entry[V]
	// Post-order without a stack: descend to a leaf, drop it, resume from its
	// parent, which is a leaf once its last child is gone.
	for cur := id; ; {
		for t.nodes[cur].child != 0 {
			cur = t.nodes[cur].child
		}
		up := t.nodes[cur].parent
		out = append(out, t.drop(cur))
		if cur == id {
			break
		}
		cur = up
	}
	t.refresh(parent)
	return out, nil
}

// pinnedUnder returns a pinned node in the subtree of a locked node.
func (t *Tree[V]) pinnedUnder(id int32) int32 {
	for t.nodes[id].pins == 0 {
		c := t.nodes[id].child
		for t.nodes[c].pins == 0 && t.nodes[c].lockedKids == 0 {
			c = t.nodes[c].next
		}
		id = c
	}
	return id
}

// Evict frees unpinned leaves, in policy order, until Bytes()+need fits the
// budget, and returns them in the order freed; freeing a leaf may make its
// parent a leaf in turn. When that much cannot be freed, because need passes
// the budget or the rest is pinned, it frees nothing and returns a
// status.PoolFull error. An unbounded tree never evicts.
func (t *Tree[V]) Evict(need int64) ([]Entry[V], error) {
	if need < 0 {
		return nil, status.Errorf(status.InvalidArg, "index: evict: negative need %d", need)
	}
	budget := t.cfg.BudgetBytes
	if budget == 0 {
		return nil, nil
	}
	if need > budget {
		return nil, status.Errorf(status.PoolFull, "index: evict: need %d bytes, budget is %d", need, budget)
	}
	target := budget - need
	if t.bytes <= target {
		return nil, nil
	}
	if t.lockedBytes > target {
		return nil, status.Errorf(status.PoolFull,
			"index: evict: need %d bytes, %d of %d in use are pinned or hold pinned blocks", need, t.lockedBytes, budget)
	}
	// Every unlocked node heads an unlocked subtree, whose leaves are in the
	// heap, so the heap cannot run dry while bytes above lockedBytes remain.
	var out []Entry[V]
	for t.bytes > target {
		id := t.heap[0]
		if t.cfg.Policy != LRU {
			t.inflation = max(t.inflation, t.nodes[id].prio)
		}
		parent := t.nodes[id].parent
		out = append(out, t.drop(id))
		t.refresh(parent)
	}
	return out, nil
}

// Walk calls fn for every block, each parent before its children, until fn
// returns false. fn must not modify the tree.
func (t *Tree[V]) Walk(fn func(Entry[V]) bool) {
	id := t.nodes[0].child
	for id != 0 {
		if !fn(t.entry(id)) {
			return
		}
		if c := t.nodes[id].child; c != 0 {
			id = c
			continue
		}
		for id != 0 && t.nodes[id].next == 0 {
			id = t.nodes[id].parent
		}
		if id != 0 {
			id = t.nodes[id].next
		}
	}
}

func (t *Tree[V]) entry(id int32) Entry[V] {
	n := &t.nodes[id]
	return Entry[V]{Key: n.key, Parent: n.up, Value: n.value, Bytes: n.bytes, Cost: n.cost, Uses: n.uses}
}

// stamp records an insert, or a use when used, at tick.
func (t *Tree[V]) stamp(id int32, tick uint64, used bool) {
	n := &t.nodes[id]
	n.tick = tick
	if used && n.uses < math.MaxUint32 {
		n.uses++
	}
	weight := 1.0
	if t.cfg.Policy == Frequency {
		weight = float64(n.uses)
	}
	n.prio = t.inflation + weight*n.cost/float64(n.bytes)
	if n.heapPos >= 0 {
		t.heapFix(id)
	}
}

// refresh puts id in the heap exactly when it is an unpinned leaf.
func (t *Tree[V]) refresh(id int32) {
	if id == 0 {
		return
	}
	n := &t.nodes[id]
	candidate := n.child == 0 && n.pins == 0
	switch {
	case candidate && n.heapPos < 0:
		t.heapPush(id)
	case !candidate && n.heapPos >= 0:
		t.heapRemove(id)
	}
}

// alloc adds b as the newest child of parent; the caller accounts its bytes
// and stamps it.
func (t *Tree[V]) alloc(b *Block[V], parent int32, up key.Hash) int32 {
	id := t.free
	if id != 0 {
		t.free = t.nodes[id].next
	} else {
		id = int32(len(t.nodes))
		t.nodes = append(t.nodes, node[V]{})
	}
	t.nodes[id] = node[V]{key: b.Key, up: up, parent: parent, heapPos: -1, bytes: b.Bytes, cost: b.Cost, uses: max(b.Uses, 1), value: b.Value}
	t.ids[b.Key] = id
	p := &t.nodes[parent]
	if p.child != 0 {
		t.nodes[p.child].prev = id
	}
	t.nodes[id].next = p.child
	p.child = id
	return id
}

// drop removes a leaf and returns it.
func (t *Tree[V]) drop(id int32) Entry[V] {
	e := t.entry(id)
	if t.nodes[id].heapPos >= 0 {
		t.heapRemove(id)
	}
	t.unlink(id)
	t.bytes -= e.Bytes
	delete(t.ids, e.Key)
	t.release(id)
	return e
}

func (t *Tree[V]) unlink(id int32) {
	n := &t.nodes[id]
	if n.prev != 0 {
		t.nodes[n.prev].next = n.next
	} else {
		t.nodes[n.parent].child = n.next
	}
	if n.next != 0 {
		t.nodes[n.next].prev = n.prev
	}
}

// release zeroes the slot, dropping the value's references, and frees it.
func (t *Tree[V]) release(id int32) {
	t.nodes[id] = node[V]{next: t.free, heapPos: -1}
	t.free = id
}
