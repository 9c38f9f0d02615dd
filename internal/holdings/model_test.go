package holdings

import (
	"encoding/binary"
	"fmt"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvevents"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/residency"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// refBlock is the reference the model tests hold Holdings to: each block's
// state and pins, written from the documented transitions rather than from
// Holdings' code. Eviction's order is the residency tree's (tested there);
// here a block's leaving is checked against what may leave.
type refBlock struct {
	parent key.Hash
	state  State
	gen    uint64
	off    int64
	size   int64
	pins   int
	entry  directory.Entry
	chain  bool // announce has not cleared its Chain yet
}

func testKey(tag byte, n uint32) key.Hash {
	var h key.Hash
	h[0] = tag
	binary.LittleEndian.PutUint32(h[1:], n)
	return h
}

const ownSegment = "self"

// harness applies one op sequence to Holdings and to the reference and
// fails the test at the first difference.
type harness struct {
	t     testing.TB
	src   testenv.Choices
	h     *Holdings
	ref   map[key.BlockKey]*refBlock
	roots []key.Hash
	keys  uint32
	step  int
	// what Gone heard during the current op
	heard   []Entry
	evicted []bool
}

func newHarness(t testing.TB, policy residency.Policy, poolBytes int64, src testenv.Choices) *harness {
	hs := &harness{t: t, src: src, ref: map[key.BlockKey]*refBlock{}}
	h, err := New(Config{PoolBytes: poolBytes, Policy: policy, Gone: func(gone []Entry, evicted bool) {
		hs.heard = append(hs.heard, gone...)
		for range gone {
			hs.evicted = append(hs.evicted, evicted)
		}
	}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = h.Close() })
	hs.h = h
	for i := range 3 {
		hs.roots = append(hs.roots, testKey('r', uint32(i)))
	}
	return hs
}

func (hs *harness) fail(format string, args ...any) {
	hs.t.Helper()
	require.FailNowf(hs.t, "holdings differ from the reference", "step %d: %s", hs.step, fmt.Sprintf(format, args...))
}

// someKey is a held key, now and then one not held.
func (hs *harness) someKey() key.BlockKey {
	if len(hs.ref) == 0 || hs.src.Intn(8) == 0 {
		hs.keys++
		return testKey('b', hs.keys)
	}
	n := hs.src.Intn(len(hs.ref))
	for k := range sortedKeys(hs.ref) {
		if n == 0 {
			return k
		}
		n--
	}
	panic("unreachable")
}

// someKeys is a few keys, or nil (every held block) now and then.
func (hs *harness) someKeys(allowNil bool) []key.BlockKey {
	if allowNil && hs.src.Intn(4) == 0 {
		return nil
	}
	keys := make([]key.BlockKey, hs.src.Intn(5))
	for i := range keys {
		keys[i] = hs.someKey()
	}
	return keys
}

// someGen is k's generation, now and then another.
func (hs *harness) someGen(k key.BlockKey) uint64 {
	if b, ok := hs.ref[k]; ok && hs.src.Intn(6) != 0 {
		return b.gen
	}
	return uint64(2 * (1 + hs.src.Intn(1000)))
}

func (hs *harness) run(maxSteps int) {
	for hs.step = 0; hs.step < maxSteps && !hs.src.Done(); hs.step++ {
		hs.heard, hs.evicted = nil, nil
		switch hs.src.Intn(16) {
		case 0, 1, 2:
			hs.hold(true)
		case 3:
			hs.hold(false)
		case 4, 5:
			hs.offerPending()
		case 6:
			hs.takeOver()
		case 7:
			hs.refuse()
		case 8:
			hs.repend()
		case 9, 10:
			hs.settle()
		case 11:
			hs.lose()
		case 12:
			hs.pin()
		case 13:
			hs.unpin()
		case 14:
			hs.drop()
		case 15:
			hs.evict()
		}
		hs.compare()
	}
}

// hold allocates a block, evicting when the pool is full, and seals it
// (ours) or admits it (a copy).
func (hs *harness) hold(ours bool) {
	size := int64(64 * (1 + hs.src.Intn(4)))
	off, err := hs.h.Alloc(size)
	hs.left(true, off, size)
	if err != nil {
		if status.Of(err) != status.PoolFull {
			hs.fail("Alloc(%d) = %v", size, err)
		}
		return
	}
	k := hs.someKey()
	parent := hs.roots[hs.src.Intn(len(hs.roots))]
	if len(hs.ref) > 0 && hs.src.Intn(3) != 0 {
		parent = hs.someKey()
		if _, ok := hs.ref[parent]; !ok {
			parent = hs.roots[0]
		}
	}
	gen := hs.h.NextGeneration()
	mem := hs.h.Bytes(off, size)
	pool.BeginWrite(mem, gen)
	pool.EndWrite(mem, gen)
	e := directory.Entry{Key: k, Parent: parent, Loc: directory.Location{Segment: "elsewhere", Generation: gen}}
	b := Block{Off: off, Size: size, Gen: gen, Entry: e}
	_, held := hs.ref[k]
	if ours {
		b.Chain = &kvevents.Chain{}
		ok, err := hs.h.Seal(parent, b, 1)
		if err != nil || ok == held {
			hs.fail("Seal(%s) = %v, %v with the key held: %v", k, ok, err, held)
		}
	} else if err := hs.h.Admit(parent, b, 1, 0); (err != nil) != held {
		hs.fail("Admit(%s) = %v with the key held: %v", k, err, held)
	}
	if held {
		hs.h.Invalidate(off, size)
		return
	}
	st := Replica
	if ours {
		st = Pending
	}
	hs.ref[k] = &refBlock{parent: parent, state: st, gen: gen, off: off, size: size, entry: e, chain: ours}
}

// left checks what Gone heard during an op against what may leave, and
// takes it out of the reference: only unpinned blocks, never one whose
// child stays, each once, its memory invalidated afterwards (but for the
// extent at off that the op has just allocated again).
func (hs *harness) left(evicted bool, off, size int64) {
	gone := map[key.BlockKey]bool{}
	for i, e := range hs.heard {
		r, ok := hs.ref[e.Key]
		switch {
		case !ok || gone[e.Key]:
			hs.fail("Gone heard %s, not held", e.Key)
		case hs.evicted[i] != evicted:
			hs.fail("Gone heard %s evicted=%v, want %v", e.Key, hs.evicted[i], evicted)
		case r.pins > 0:
			hs.fail("%s left pinned", e.Key)
		case e.Value.Gen != r.gen || e.Value.State != r.state:
			hs.fail("%s left as %s at %d, held as %s at %d", e.Key, e.Value.State, e.Value.Gen, r.state, r.gen)
		}
		gone[e.Key] = true
	}
	for k := range gone {
		r := hs.ref[k]
		if r.off+r.size <= off || off+size <= r.off {
			if g := pool.Generation(hs.h.Bytes(r.off, r.size)); g%2 == 0 {
				hs.fail("%s left with its memory at generation %d", k, g)
			}
		}
		delete(hs.ref, k)
	}
	for k, r := range hs.ref {
		if gone[r.parent] {
			hs.fail("%s stays under %s, which left", k, r.parent)
		}
	}
}

// take is the publisher: it accepts the first few entries.
func (hs *harness) take(got *[]directory.Entry, n *int) Take {
	return func(es []directory.Entry) int {
		*got = append(*got, es...)
		*n = min(len(es), hs.src.Intn(len(es)+2))
		return *n
	}
}

// offered runs an offer on the reference: step moves a block, and those
// past the first n taken move back.
func (hs *harness) offered(keys []key.BlockKey, step func(*refBlock) bool, got []directory.Entry, n, queued, refused int) {
	var moved []key.BlockKey
	var was []State
	for _, k := range keys {
		r, ok := hs.ref[k]
		if !ok {
			continue
		}
		prev := r.state
		if step(r) {
			moved, was = append(moved, k), append(was, prev)
		}
	}
	if len(got) != len(moved) {
		hs.fail("offered %d entries, want %d", len(got), len(moved))
	}
	for i, k := range moved {
		if got[i].Key != k || got[i] != hs.ref[k].entry {
			hs.fail("entry %d offered %+v, want %+v", i, got[i], hs.ref[k].entry)
		}
		if i >= n {
			hs.ref[k].state = was[i]
		}
	}
	if queued != n || refused != len(moved)-n {
		hs.fail("offer = %d queued, %d refused; want %d, %d", queued, refused, n, len(moved)-n)
	}
}

func (hs *harness) offerPending() {
	keys := hs.someKeys(true)
	var got []directory.Entry
	n := 0
	queued, refused := hs.h.OfferPending(keys, hs.take(&got, &n))
	if keys == nil {
		for k := range sortedKeys(hs.ref) {
			keys = append(keys, k)
		}
		// OfferPending(nil) walks the tree, in its order: compare as sets.
		order := map[key.BlockKey]int{}
		for i, e := range got {
			order[e.Key] = i
		}
		var sorted []key.BlockKey
		for _, k := range keys {
			if r := hs.ref[k]; r.state.Waiting() {
				sorted = append(sorted, k)
			}
		}
		for i := range sorted {
			for j := i + 1; j < len(sorted); j++ {
				if order[sorted[j]] < order[sorted[i]] {
					sorted[i], sorted[j] = sorted[j], sorted[i]
				}
			}
		}
		keys = sorted
	}
	hs.offered(keys, func(r *refBlock) bool {
		switch r.state {
		case Pending:
			r.state = Publishing
		case TakeoverPending:
			r.state = TakingOver
		default:
			return false
		}
		return true
	}, got, n, queued, refused)
}

func (hs *harness) takeOver() {
	keys := hs.someKeys(false)
	var got []directory.Entry
	n := 0
	loc := func(b Block) directory.Location {
		return directory.Location{Segment: ownSegment, Addr: uint64(b.Off), Generation: b.Gen}
	}
	queued, refused := hs.h.TakeOver(keys, loc, hs.take(&got, &n))
	hs.offered(keys, func(r *refBlock) bool {
		if r.state != Replica {
			return false
		}
		r.state = TakingOver
		r.entry.Loc = directory.Location{Segment: ownSegment, Addr: uint64(r.off), Generation: r.gen}
		return true
	}, got, n, queued, refused)
}

func (hs *harness) refuse() {
	k := hs.someKey()
	gen := hs.someGen(k)
	hs.h.Refuse(k, gen)
	if r, ok := hs.ref[k]; ok && r.gen == gen {
		switch r.state {
		case Publishing:
			r.state = Pending
		case TakingOver:
			r.state = TakeoverPending
		}
	}
}

func (hs *harness) repend() {
	k := hs.someKey()
	gen := hs.someGen(k)
	got := hs.h.Repend(k, gen, ownSegment)
	r, ok := hs.ref[k]
	want := ok && r.gen == gen && r.state != Replica
	if got != want {
		hs.fail("Repend(%s) = %v, want %v", k, got, want)
	}
	if !want {
		return
	}
	r.entry.Loc.Segment, r.entry.Loc.Addr = ownSegment, uint64(hs.h.Base())+uint64(r.off)
	if r.state == TakingOver || r.state == TakeoverPending {
		r.state = TakeoverPending
	} else {
		r.state = Pending
	}
}

func (hs *harness) settle() {
	k := hs.someKey()
	gen := hs.someGen(k)
	calls := 0
	held, tookOver := hs.h.Settle(k, gen, func(ak key.BlockKey, b *Block, r Reader) {
		calls++
		if ak != k {
			hs.fail("announced %s, settling %s", ak, k)
		}
		if _, ok := r.Get(b.Entry.Parent); ok != (hs.ref[b.Entry.Parent] != nil) {
			hs.fail("announce reads the parent of %s: held %v", k, ok)
		}
		b.Chain = nil
	})
	r, ok := hs.ref[k]
	want := ok && r.gen == gen
	if held != want || calls != map[bool]int{true: 1}[want] {
		hs.fail("Settle(%s) = %v after %d announces, want %v", k, held, calls, want)
	}
	if !want {
		return
	}
	if tookOver != (r.state == TakingOver || r.state == TakeoverPending) {
		hs.fail("Settle(%s) of a %s: took over %v", k, r.state, tookOver)
	}
	r.chain = false
	if r.state != Replica {
		r.state = Settled
	}
}

// leaf: no held block hangs under k.
func (hs *harness) leaf(k key.BlockKey) bool {
	for _, r := range hs.ref {
		if r.parent == k {
			return false
		}
	}
	return true
}

func (hs *harness) lose() {
	k := hs.someKey()
	gen := hs.someGen(k)
	hs.h.Lose(k, gen)
	r, ok := hs.ref[k]
	if !ok || r.gen != gen {
		return
	}
	if r.state == TakingOver || r.state == TakeoverPending {
		r.state = Replica
		return
	}
	r.state = Settled
	if hs.leaf(k) && r.pins == 0 {
		delete(hs.ref, k)
		if g := pool.Generation(hs.h.Bytes(r.off, r.size)); g%2 == 0 {
			hs.fail("lost %s left its memory at generation %d", k, g)
		}
	}
}

func (hs *harness) pin() {
	k := hs.someKey()
	gen := hs.someGen(k)
	if hs.src.Intn(4) == 0 {
		gen = AnyGeneration
	}
	e, ok := hs.h.Pin(k, gen)
	r, held := hs.ref[k]
	want := held && (gen == AnyGeneration || r.gen == gen)
	if ok != want {
		hs.fail("Pin(%s, %d) = %v, want %v", k, gen, ok, want)
	}
	if want {
		r.pins++
		if e.Value.Off != r.off || e.Value.Gen != r.gen {
			hs.fail("Pin(%s) gave the block at %d, %d; held at %d, %d", k, e.Value.Off, e.Value.Gen, r.off, r.gen)
		}
	}
}

func (hs *harness) unpin() {
	for k := range sortedKeys(hs.ref) {
		if r := hs.ref[k]; r.pins > 0 && hs.src.Intn(2) == 0 {
			hs.h.Unpin(k)
			r.pins--
			return
		}
	}
}

// subtree is k and every held block under it.
func (hs *harness) subtree(k key.BlockKey) []key.BlockKey {
	out := []key.BlockKey{k}
	for i := 0; i < len(out); i++ {
		for c, r := range hs.ref {
			if r.parent == out[i] {
				out = append(out, c)
			}
		}
	}
	return out
}

func (hs *harness) drop() {
	k := hs.someKey()
	gen := hs.someGen(k)
	bad := hs.src.Intn(2) == 0
	checked := false
	outcome, why, n := hs.h.Drop(k, gen, func(b Block, mem []byte) error {
		checked = true
		if pool.Generation(mem) != b.Gen {
			hs.fail("Drop checks %s at generation %d, held at %d", k, pool.Generation(mem), b.Gen)
		}
		if bad {
			return status.Errorf(status.Corrupt, "bad")
		}
		return nil
	})
	r, ok := hs.ref[k]
	want := Gone
	var sub []key.BlockKey
	switch {
	case !ok || r.gen != gen:
	case !bad:
		want = Intact
	default:
		want = Dropped
		sub = hs.subtree(k)
		for _, s := range sub {
			if hs.ref[s].pins > 0 {
				want = Busy
			}
		}
	}
	if outcome != want || checked != (want != Gone) || (why != nil) != (want == Dropped || want == Busy) {
		hs.fail("Drop(%s) = %d (%v, checked %v), want %d", k, outcome, why, checked, want)
	}
	if want != Dropped {
		if len(hs.heard) > 0 {
			hs.fail("Drop(%s) gave %d blocks to Gone", k, len(hs.heard))
		}
		return
	}
	if n != len(sub) || len(hs.heard) != len(sub) {
		hs.fail("Drop(%s) took %d blocks (%d heard), want %d", k, n, len(hs.heard), len(sub))
	}
	hs.left(false, 0, 0)
}

func (hs *harness) evict() {
	need := int64(64 * hs.src.Intn(8))
	var held int64
	for _, r := range hs.ref {
		held += r.size
	}
	err := hs.h.Evict(need)
	if err != nil {
		if status.Of(err) != status.PoolFull || len(hs.heard) > 0 {
			hs.fail("Evict(%d) = %v after %d blocks left", need, err, len(hs.heard))
		}
		return
	}
	if len(hs.heard) == 0 {
		hs.fail("Evict(%d) succeeded and nothing left", need)
	}
	var freed int64
	for _, e := range hs.heard {
		freed += e.Value.Size
	}
	if freed < min(need, held) {
		hs.fail("Evict(%d) freed %d bytes", need, freed)
	}
	hs.left(true, 0, 0)
}

// compare holds every block of the reference against Holdings.
func (hs *harness) compare() {
	n, bytes := hs.h.Len()
	var want int64
	for _, r := range hs.ref {
		want += r.size
	}
	if n != len(hs.ref) || bytes != want {
		hs.fail("%d blocks of %d bytes held, want %d of %d", n, bytes, len(hs.ref), want)
	}
	for k, r := range hs.ref {
		b, ok := hs.h.Get(k)
		switch {
		case !ok:
			hs.fail("%s not held", k)
		case b.State != r.state || b.Gen != r.gen || b.Off != r.off || b.Size != r.size:
			hs.fail("%s is %s at %d (%d+%d), want %s at %d (%d+%d)", k, b.State, b.Gen, b.Off, b.Size, r.state, r.gen, r.off, r.size)
		case b.Entry != r.entry:
			hs.fail("%s entry %+v, want %+v", k, b.Entry, r.entry)
		case (b.Chain != nil) != r.chain:
			hs.fail("%s chain kept %v, want %v", k, b.Chain != nil, r.chain)
		}
	}
}

// sortedKeys ranges over the reference's keys in a fixed order, so that a
// seed or a fuzz input always picks the same keys.
func sortedKeys(m map[key.BlockKey]*refBlock) func(func(key.BlockKey) bool) {
	keys := make([]key.BlockKey, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	for i := 1; i < len(keys); i++ {
		for j := i; j > 0 && string(keys[j][:]) < string(keys[j-1][:]); j-- {
			keys[j], keys[j-1] = keys[j-1], keys[j]
		}
	}
	return func(yield func(key.BlockKey) bool) {
		for _, k := range keys {
			if !yield(k) {
				return
			}
		}
	}
}

func TestHoldingsMatchReference(t *testing.T) {
	for _, policy := range []residency.Policy{residency.LRU, residency.CostAware, residency.Frequency} {
		for _, poolBytes := range []int64{1024, 4096} {
			t.Run(fmt.Sprintf("%s/pool=%d", policy, poolBytes), func(t *testing.T) {
				for seed := int64(1); seed <= 12; seed++ {
					newHarness(t, policy, poolBytes, testenv.Seeded(seed)).run(400)
				}
			})
		}
	}
}

func FuzzHoldings(f *testing.F) {
	f.Add([]byte{0})
	f.Add([]byte{0, 0, 1, 0, 4, 1, 9, 0, 6, 2, 11, 3, 15, 5})
	seed := make([]byte, 512)
	rand.New(rand.NewSource(7)).Read(seed)
	f.Add(seed)
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		hs := newHarness(t, residency.Policy(data[0]%3), []int64{1024, 4096}[int(data[0]/3)%2], testenv.FuzzBytes(data[1:]))
		hs.run(1000)
	})
}
