package residency

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// refTree is the reference that the property and fuzz tests hold Tree to:
// a map of blocks and O(n) scans, written from the documented semantics
// rather than from Tree's code.
type refTree struct {
	cfg       Config
	blocks    map[key.BlockKey]*refBlock
	clock     uint64
	inflation float64
}

type refBlock struct {
	first  bool     // hangs under a scope root
	parent key.Hash // the root when first, else the previous block
	value  int
	bytes  int64
	cost   float64
	pins   int
	tick   uint64
	prio   float64
	uses   uint32
}

func newRef(cfg Config) *refTree {
	return &refTree{cfg: cfg, blocks: map[key.BlockKey]*refBlock{}}
}

func (r *refTree) total() int64 {
	var s int64
	for _, b := range r.blocks {
		s += b.bytes
	}
	return s
}

// use records an insert (used false) or a use.
func (r *refTree) use(b *refBlock, used bool) {
	r.clock++
	b.tick = r.clock
	if used {
		b.uses++
	}
	w := 1.0
	if r.cfg.Policy == Frequency {
		w = float64(b.uses)
	}
	b.prio = r.inflation + w*b.cost/float64(b.bytes)
}

func (r *refTree) extend(first bool, up key.Hash, blocks []Block[int]) (int, status.Code) {
	i := 0
	for ; i < len(blocks); i++ {
		b, ok := r.blocks[blocks[i].Key]
		if !ok {
			break
		}
		if b.first != first || b.parent != up {
			return 0, status.InvalidArg
		}
		first, up = false, blocks[i].Key
	}
	fresh := blocks[i:]
	var need int64
	for _, b := range fresh {
		if b.Bytes <= 0 || b.Cost < 0 || math.IsNaN(b.Cost) || math.IsInf(b.Cost, 0) {
			return 0, status.InvalidArg
		}
		if b.Bytes > math.MaxInt64-r.total()-need {
			return 0, status.InvalidArg
		}
		need += b.Bytes
	}
	if r.cfg.BudgetBytes > 0 && r.total()+need > r.cfg.BudgetBytes {
		return 0, status.PoolFull
	}
	seen := map[key.BlockKey]bool{}
	for _, b := range fresh {
		if _, ok := r.blocks[b.Key]; ok || seen[b.Key] {
			return 0, status.InvalidArg
		}
		seen[b.Key] = true
	}
	for _, b := range fresh {
		r.blocks[b.Key] = &refBlock{first: first, parent: up, value: b.Value, bytes: b.Bytes, cost: b.Cost, uses: max(b.Uses, 1)}
		first, up = false, b.Key
	}
	for j, b := range blocks {
		r.use(r.blocks[b.Key], j < i)
	}
	return len(fresh), status.OK
}

func (r *refTree) insert(parent key.BlockKey, b Block[int]) (bool, status.Code) {
	if _, ok := r.blocks[parent]; !ok {
		return false, status.NotFound
	}
	n, code := r.extend(false, parent, []Block[int]{b})
	return n == 1, code
}

func (r *refTree) match(root key.Hash, chain []key.BlockKey) int {
	first, up := true, root
	for i, k := range chain {
		b, ok := r.blocks[k]
		if !ok || b.first != first || b.parent != up {
			return i
		}
		first, up = false, k
	}
	return len(chain)
}

func (r *refTree) touch(keys []key.BlockKey) int {
	n := 0
	for _, k := range keys {
		if b, ok := r.blocks[k]; ok {
			r.use(b, true)
			n++
		}
	}
	return n
}

func (r *refTree) pin(k key.BlockKey) status.Code {
	b, ok := r.blocks[k]
	if !ok {
		return status.NotFound
	}
	b.pins++
	return status.OK
}

func (r *refTree) unpin(k key.BlockKey) status.Code {
	b, ok := r.blocks[k]
	switch {
	case !ok:
		return status.NotFound
	case b.pins == 0:
		return status.State
	}
	b.pins--
	return status.OK
}

func (r *refTree) isLeaf(k key.BlockKey) bool {
	for _, b := range r.blocks {
		if !b.first && b.parent == k {
			return false
		}
	}
	return true
}

// ancestry returns k and its ancestors.
func (r *refTree) ancestry(k key.BlockKey) []key.BlockKey {
	out := []key.BlockKey{k}
	for b := r.blocks[k]; !b.first; b = r.blocks[b.parent] {
		out = append(out, b.parent)
	}
	return out
}

func (r *refTree) remove(k key.BlockKey) ([]key.BlockKey, status.Code) {
	if _, ok := r.blocks[k]; !ok {
		return nil, status.NotFound
	}
	var sub []key.BlockKey
	for bk, b := range r.blocks {
		if slices.Contains(r.ancestry(bk), k) {
			if b.pins > 0 {
				return nil, status.State
			}
			sub = append(sub, bk)
		}
	}
	for _, bk := range sub {
		delete(r.blocks, bk)
	}
	return sub, status.OK
}

func (r *refTree) evict(need int64) ([]key.BlockKey, status.Code) {
	if need < 0 {
		return nil, status.InvalidArg
	}
	budget := r.cfg.BudgetBytes
	if budget == 0 {
		return nil, status.OK
	}
	if need > budget {
		return nil, status.PoolFull
	}
	target := budget - need
	locked := map[key.BlockKey]bool{}
	for k, b := range r.blocks {
		if b.pins > 0 {
			for _, a := range r.ancestry(k) {
				locked[a] = true
			}
		}
	}
	var lockedBytes int64
	for k := range locked {
		lockedBytes += r.blocks[k].bytes
	}
	if r.total() > target && lockedBytes > target {
		return nil, status.PoolFull
	}
	var out []key.BlockKey
	for r.total() > target {
		var best key.BlockKey
		var bb *refBlock
		for k, b := range r.blocks {
			if b.pins > 0 || !r.isLeaf(k) {
				continue
			}
			if bb == nil || r.before(b, bb) {
				best, bb = k, b
			}
		}
		if r.cfg.Policy != LRU {
			r.inflation = max(r.inflation, bb.prio)
		}
		delete(r.blocks, best)
		out = append(out, best)
	}
	return out, status.OK
}

func (r *refTree) before(a, b *refBlock) bool {
	if r.cfg.Policy != LRU && a.prio != b.prio {
		return a.prio < b.prio
	}
	return a.tick < b.tick
}

func testKey(tag byte, n uint32) key.Hash {
	var h key.Hash
	h[0] = tag
	binary.LittleEndian.PutUint32(h[1:], n)
	return h
}

type knownChain struct {
	root key.Hash
	keys []key.BlockKey
}

// harness applies one op sequence to a Tree and to the reference and fails
// the test at the first difference.
type harness struct {
	t      testing.TB
	src    testenv.Choices
	tree   *Tree[int]
	ref    *refTree
	roots  []key.Hash
	chains []knownChain
	keys   uint32
	values int
	step   int
}

const maxKnownChains = 48

func newHarness(t testing.TB, cfg Config, src testenv.Choices) *harness {
	tr, err := New[int](cfg)
	require.NoError(t, err)
	h := &harness{t: t, src: src, tree: tr, ref: newRef(cfg)}
	for i := range 3 {
		h.roots = append(h.roots, testKey('r', uint32(i)))
	}
	return h
}

func (h *harness) fail(format string, args ...any) {
	h.t.Helper()
	require.FailNowf(h.t, "tree differs from the reference", "step %d (%s, budget %d): %s", h.step, h.ref.cfg.Policy, h.ref.cfg.BudgetBytes, fmt.Sprintf(format, args...))
}

func (h *harness) freshKey() key.BlockKey {
	h.keys++
	return testKey('b', h.keys)
}

// knownKey returns a key from a known chain, indexed or not, or a fresh one.
func (h *harness) knownKey() key.BlockKey {
	if len(h.chains) == 0 || h.src.Intn(8) == 0 {
		return h.freshKey()
	}
	c := h.chains[h.src.Intn(len(h.chains))]
	return c.keys[h.src.Intn(len(c.keys))]
}

func (h *harness) remember(c knownChain) {
	if len(c.keys) == 0 {
		return
	}
	if len(h.chains) < maxKnownChains {
		h.chains = append(h.chains, c)
		return
	}
	h.chains[h.src.Intn(len(h.chains))] = c
}

func (h *harness) block(k key.BlockKey, depth int) Block[int] {
	h.values++
	b := Block[int]{Key: k, Value: h.values, Bytes: int64(1 + h.src.Intn(4)), Cost: float64(h.src.Intn(4) * (depth + 1)), Uses: uint32(h.src.Intn(3))}
	switch h.src.Intn(32) {
	case 0:
		b.Bytes = int64(-h.src.Intn(2))
	case 1:
		b.Cost = []float64{-1, math.NaN(), math.Inf(1)}[h.src.Intn(3)]
	}
	return b
}

func (h *harness) run(maxSteps int) {
	for h.step = 0; h.step < maxSteps && !h.src.Done(); h.step++ {
		switch h.src.Intn(12) {
		case 0, 1, 2:
			h.insertChain()
		case 3:
			h.insertOne()
		case 4:
			h.touch()
		case 5, 6:
			h.pin()
		case 7, 8:
			h.unpin()
		case 9:
			h.remove()
		case 10, 11:
			h.evict()
		}
		h.compare()
	}
}

func (h *harness) insertChain() {
	var c knownChain
	if len(h.chains) == 0 || h.src.Intn(4) == 0 {
		c.root = h.roots[h.src.Intn(len(h.roots))]
	} else {
		base := h.chains[h.src.Intn(len(h.chains))]
		c.root = base.root
		c.keys = slices.Clone(base.keys[:h.src.Intn(len(base.keys)+1)])
	}
	for n := h.src.Intn(5); n > 0; n-- {
		c.keys = append(c.keys, h.freshKey())
	}
	switch h.src.Intn(16) {
	case 0: // a key repeated inside the chain
		if len(c.keys) > 0 {
			c.keys = append(c.keys, c.keys[h.src.Intn(len(c.keys))])
		}
	case 1: // a key that may be indexed under another parent
		c.keys = append(c.keys, h.knownKey())
	}
	blocks := make([]Block[int], len(c.keys))
	for i, k := range c.keys {
		blocks[i] = h.block(k, i)
	}
	got, err := h.tree.InsertChain(c.root, blocks)
	want, code := h.ref.extend(true, c.root, blocks)
	if got != want || status.Of(err) != code {
		h.fail("InsertChain = %d, %v; reference %d, %s", got, err, want, code)
	}
	if err == nil {
		h.remember(c)
	}
}

func (h *harness) insertOne() {
	if len(h.chains) == 0 {
		return
	}
	c := h.chains[h.src.Intn(len(h.chains))]
	i := h.src.Intn(len(c.keys))
	parent := c.keys[i]
	if h.src.Intn(8) == 0 {
		parent = h.freshKey()
	}
	k := h.freshKey()
	if i+1 < len(c.keys) && h.src.Intn(2) == 0 {
		k = c.keys[i+1]
	}
	b := h.block(k, i+1)
	got, err := h.tree.Insert(parent, b)
	want, code := h.ref.insert(parent, b)
	if got != want || status.Of(err) != code {
		h.fail("Insert = %v, %v; reference %v, %s", got, err, want, code)
	}
	if err == nil && parent == c.keys[i] {
		h.remember(knownChain{root: c.root, keys: append(slices.Clone(c.keys[:i+1]), k)})
	}
}

func (h *harness) touch() {
	if len(h.chains) == 0 {
		return
	}
	c := h.chains[h.src.Intn(len(h.chains))]
	keys := append(slices.Clone(c.keys[:h.src.Intn(len(c.keys)+1)]), h.knownKey())
	if got, want := h.tree.Touch(keys...), h.ref.touch(keys); got != want {
		h.fail("Touch = %d, reference %d", got, want)
	}
}

func (h *harness) pin() {
	k := h.knownKey()
	if err, code := h.tree.Pin(k), h.ref.pin(k); status.Of(err) != code {
		h.fail("Pin(%s) = %v, reference %s", k, err, code)
	}
}

func (h *harness) unpin() {
	k := h.knownKey()
	if h.src.Intn(4) != 0 {
		if pinned := h.pinnedKeys(); len(pinned) > 0 {
			k = pinned[h.src.Intn(len(pinned))]
		}
	}
	if err, code := h.tree.Unpin(k), h.ref.unpin(k); status.Of(err) != code {
		h.fail("Unpin(%s) = %v, reference %s", k, err, code)
	}
}

func (h *harness) pinnedKeys() []key.BlockKey {
	var out []key.BlockKey
	for k, b := range h.ref.blocks {
		if b.pins > 0 {
			out = append(out, k)
		}
	}
	slices.SortFunc(out, compareKeys)
	return out
}

func compareKeys(a, b key.BlockKey) int {
	return slices.Compare(a[:], b[:])
}

func (h *harness) remove() {
	k := h.knownKey()
	got, err := h.tree.Remove(k)
	want, code := h.ref.remove(k)
	if status.Of(err) != code {
		h.fail("Remove(%s) = %v, reference %s", k, err, code)
	}
	pos := map[key.BlockKey]int{}
	for i, e := range got {
		pos[e.Key] = i
	}
	for i, e := range got {
		if j, ok := pos[e.Parent]; ok && j < i {
			h.fail("Remove returned %s after its child %s", e.Parent, e.Key)
		}
	}
	gotKeys := entryKeys(got)
	slices.SortFunc(gotKeys, compareKeys)
	slices.SortFunc(want, compareKeys)
	if !slices.Equal(gotKeys, want) {
		h.fail("Remove(%s) removed %v, reference %v", k, gotKeys, want)
	}
}

func (h *harness) evict() {
	limit := 8
	if h.ref.cfg.BudgetBytes > 0 {
		limit = int(h.ref.cfg.BudgetBytes) + 3
	}
	need := int64(h.src.Intn(limit)) - 1
	got, err := h.tree.Evict(need)
	want, code := h.ref.evict(need)
	if status.Of(err) != code || !slices.Equal(entryKeys(got), want) {
		h.fail("Evict(%d) = %v, %v; reference %v, %s", need, entryKeys(got), err, want, code)
	}
}

func entryKeys(es []Entry[int]) []key.BlockKey {
	var out []key.BlockKey
	for _, e := range es {
		out = append(out, e.Key)
	}
	return out
}

func (h *harness) compare() {
	h.t.Helper()
	if err := h.tree.check(); err != nil {
		h.fail("broken invariant: %v", err)
	}
	if got, want := h.tree.Len(), len(h.ref.blocks); got != want {
		h.fail("Len = %d, reference %d", got, want)
	}
	if got, want := h.tree.Bytes(), h.ref.total(); got != want {
		h.fail("Bytes = %d, reference %d", got, want)
	}
	seen := map[key.BlockKey]bool{}
	h.tree.Walk(func(e Entry[int]) bool {
		b, ok := h.ref.blocks[e.Key]
		switch {
		case !ok:
			h.fail("Walk visits %s, absent from the reference", e.Key)
		case b.parent != e.Parent || b.value != e.Value || b.bytes != e.Bytes || b.cost != e.Cost || b.uses != e.Uses:
			h.fail("Walk: %+v, reference %+v", e, *b)
		case !b.first && !seen[e.Parent]:
			h.fail("Walk visits %s before its parent", e.Key)
		}
		if v, ok := h.tree.Get(e.Key); !ok || v != b.value {
			h.fail("Get(%s) = %d, %v; want %d", e.Key, v, ok, b.value)
		}
		seen[e.Key] = true
		return true
	})
	if len(seen) != len(h.ref.blocks) {
		h.fail("Walk visits %d blocks, reference holds %d", len(seen), len(h.ref.blocks))
	}
	for i, c := range h.chains {
		other := h.roots[(i+1)%len(h.roots)]
		for _, root := range []key.Hash{c.root, other} {
			if got, want := h.tree.Match(root, c.keys), h.ref.match(root, c.keys); got != want {
				h.fail("Match(%s, chain %d) = %d, reference %d", root, i, got, want)
			}
		}
	}
}

// check verifies the tree's internal invariants from scratch.
func (t *Tree[V]) check() error {
	s := &t.nodes[0]
	if s.parent != 0 || s.heapPos != -1 || s.pins != 0 {
		return fmt.Errorf("sentinel modified: %+v", *s)
	}
	locked := map[int32]bool{}
	var bytes int64
	for k, id := range t.ids {
		n := &t.nodes[id]
		if n.key != k {
			return fmt.Errorf("ids[%s] = %d holds %s", k, id, n.key)
		}
		if n.parent != 0 && n.up != t.nodes[n.parent].key {
			return fmt.Errorf("%s: up %s, parent %s", k, n.up, t.nodes[n.parent].key)
		}
		bytes += n.bytes
		if n.pins > 0 {
			for a := id; a != 0 && !locked[a]; a = t.nodes[a].parent {
				locked[a] = true
			}
		}
	}
	if bytes != t.bytes {
		return fmt.Errorf("bytes %d, nodes sum to %d", t.bytes, bytes)
	}
	var lockedBytes int64
	for id := range locked {
		lockedBytes += t.nodes[id].bytes
	}
	if lockedBytes != t.lockedBytes {
		return fmt.Errorf("lockedBytes %d, want %d", t.lockedBytes, lockedBytes)
	}
	reached := 0
	stack := []int32{0}
	for len(stack) > 0 {
		id := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		var lockedKids int32
		prev := int32(0)
		for c := t.nodes[id].child; c != 0; c = t.nodes[c].next {
			cn := &t.nodes[c]
			if cn.parent != id || cn.prev != prev {
				return fmt.Errorf("child list of %d broken at %d", id, c)
			}
			if locked[c] {
				lockedKids++
			}
			prev = c
			reached++
			stack = append(stack, c)
		}
		n := &t.nodes[id]
		if id != 0 && n.lockedKids != lockedKids {
			return fmt.Errorf("%s: lockedKids %d, want %d", n.key, n.lockedKids, lockedKids)
		}
		if inHeap, candidate := n.heapPos >= 0, id != 0 && n.child == 0 && n.pins == 0; inHeap != candidate {
			return fmt.Errorf("%s: in heap %v, unpinned leaf %v", n.key, inHeap, candidate)
		}
	}
	if reached != len(t.ids) {
		return fmt.Errorf("%d nodes reachable, %d indexed", reached, len(t.ids))
	}
	free := 0
	for id := t.free; id != 0; id = t.nodes[id].next {
		free++
	}
	if 1+len(t.ids)+free != len(t.nodes) {
		return fmt.Errorf("arena of %d holds %d nodes and %d free slots", len(t.nodes), len(t.ids), free)
	}
	for i, id := range t.heap {
		if int(t.nodes[id].heapPos) != i {
			return fmt.Errorf("heap[%d] = %d says position %d", i, id, t.nodes[id].heapPos)
		}
		if i > 0 && t.less(id, t.heap[(i-1)/2]) {
			return fmt.Errorf("heap order broken at %d", i)
		}
	}
	return nil
}

func TestTreeMatchesReference(t *testing.T) {
	for _, policy := range []Policy{LRU, CostAware, Frequency} {
		for _, budget := range []int64{0, 16, 64} {
			t.Run(fmt.Sprintf("%s/budget=%d", policy, budget), func(t *testing.T) {
				for seed := int64(1); seed <= 12; seed++ {
					h := newHarness(t, Config{BudgetBytes: budget, Policy: policy}, testenv.Seeded(seed))
					h.run(400)
				}
			})
		}
	}
}

func FuzzTree(f *testing.F) {
	f.Add([]byte{0})
	f.Add([]byte{1, 0, 0, 3, 2, 0, 0, 10, 5, 0, 0, 9, 0, 11, 20})
	f.Add([]byte{3, 1, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9})
	seed := make([]byte, 512)
	rand.New(rand.NewSource(7)).Read(seed)
	f.Add(seed)
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		cfg := Config{Policy: Policy(data[0] % 3), BudgetBytes: []int64{0, 8, 24}[int(data[0]/3)%3]}
		h := newHarness(t, cfg, testenv.FuzzBytes(data[1:]))
		h.run(1000)
	})
}
