// Package holdings owns the blocks a process holds in its pool: the pool's
// memory, the residency tree over the blocks (eviction order, pins), their
// generations, and where each block stands with the directory. It has its
// own lock, and every change of a block's state is one of its named
// transitions; callers get copies.
//
// A block's life, as State:
//
//	        Seal                 OfferPending              Settle
//	(ours) ------> Pending  ----------------> Publishing ---------> Settled
//	                  ^   <-------------------  |  (rollback, Refuse)
//	                  +-------------------------+--- Repend (the store lost it)
//
//	         Admit                TakeOver                 Settle
//	(copy) ------> Replica  -----------------> TakingOver ---------> Settled
//	                  ^  <-- rollback, Lose ---  |  Refuse, Repend
//	                  |                          v
//	                  +------ Lose --------- TakeoverPending (offered again
//	                                          like Pending, as TakingOver)
//
// Evict and Drop end any of them: the memory gets a fresh odd generation,
// so a reader that a stale directory entry sends there fails verification,
// and goes back to the pool.
package holdings

import (
	"log/slog"
	"sync"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvevents"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/residency"
	"github.com/mcbridge/mcbridge/internal/status"
)

// State is where a held block stands with the directory.
type State uint8

const (
	// Replica: another owner's block, copied here and held unpublished
	// while that owner answers for it, or a block read back from a disk
	// tier until it is published.
	Replica State = iota
	// Pending: sealed here, not offered to the directory yet, or offered
	// and refused or unanswered: the next offer takes it.
	Pending
	// Publishing: sealed here, its entry queued for or out to the directory.
	Publishing
	// Settled: the directory's answer for the block is in: this process
	// answers for it (or, for a block another process won, whatever hangs
	// under it keeps it).
	Settled
	// TakingOver: a replica being published in its owner's place.
	TakingOver
	// TakeoverPending: a takeover the store or the publisher refused,
	// offered again as Pending is.
	TakeoverPending
)

var stateNames = [...]string{"replica", "pending", "publishing", "settled", "taking-over", "takeover-pending"}

func (s State) String() string {
	if int(s) < len(stateNames) {
		return stateNames[s]
	}
	return "state?"
}

// Ours: the block is, or is to be, this process's in the directory.
func (s State) Ours() bool { return s != Replica }

// Waiting: the block waits for an offer to the directory.
func (s State) Waiting() bool { return s == Pending || s == TakeoverPending }

// Offered: the block's entry is with the publisher or the directory.
func (s State) Offered() bool { return s == Publishing || s == TakingOver }

// Takeover: the block is a replica on its way to be published as ours.
func (s State) Takeover() bool { return s == TakingOver || s == TakeoverPending }

// offered is the state an offer moves a waiting block to; waiting is the
// state a refused or lost offer of a block of ours moves it back to.
func (s State) offered() State {
	if s == TakeoverPending {
		return TakingOver
	}
	return Publishing
}

func (s State) waiting() State {
	if s.Takeover() {
		return TakeoverPending
	}
	return Pending
}

// Block is a held block: where it sits in the pool and what the directory
// was, or will be, offered for it.
type Block struct {
	Model key.Fingerprint
	Off   int64
	Size  int64
	Gen   uint64
	Depth uint32 // its index in its chain
	State State
	Entry directory.Entry
	// Chain names the block to routers until it is announced: block Index
	// of Chain. Nil when events are off or the block is not in their scope.
	Chain *kvevents.Chain
	Index int
}

// Entry is a held block as the tree reports it (with its uses).
type Entry = residency.Entry[Block]

// Config builds Holdings.
type Config struct {
	PoolBytes int64
	// Shared puts the pool in shared memory that Share hands to readers of
	// this host (pool.NewShared).
	Shared bool
	Policy residency.Policy
	// Gone hears the blocks that leave: evicted to make room (evicted
	// true) or dropped. It runs without the holdings' lock, before their
	// memory is invalidated: a disk tier can still write them out.
	Gone func(gone []Entry, evicted bool)
	Log  *slog.Logger
}

// Holdings owns a pool and the blocks in it. Safe for concurrent use.
type Holdings struct {
	pool *pool.Pool
	gone func([]Entry, bool)
	log  *slog.Logger

	mu   sync.Mutex
	tree *residency.Tree[Block]
}

// New maps a pool of cfg.PoolBytes.
func New(cfg Config) (*Holdings, error) {
	newPool := pool.New
	if cfg.Shared {
		newPool = pool.NewShared
	}
	p, err := newPool(cfg.PoolBytes)
	if err != nil {
		return nil, err
	}
	t, err := residency.New[Block](residency.Config{BudgetBytes: p.Size(), Policy: cfg.Policy})
	if err != nil {
		_ = p.Close()
		return nil, err
	}
	h := &Holdings{pool: p, gone: cfg.Gone, log: cfg.Log, tree: t}
	if h.gone == nil {
		h.gone = func([]Entry, bool) {}
	}
	if h.log == nil {
		h.log = slog.Default()
	}
	return h, nil
}

// Close unmaps the pool: nothing may use its memory afterwards.
func (h *Holdings) Close() error { return h.pool.Close() }

// Share hands a shared pool to same-host readers (pool.Pool.Share).
func (h *Holdings) Share(dir, name string, a pool.Access) (*pool.Server, error) {
	return h.pool.Share(dir, name, a)
}

// Base is the pool's address, Size its length.
func (h *Holdings) Base() uintptr { return h.pool.Base() }
func (h *Holdings) Size() int64   { return h.pool.Size() }

// Used is the pool's bytes allocated: held blocks and staging.
func (h *Holdings) Used() int64 { return h.pool.Used() }

// Bytes is the n bytes of the pool at off.
func (h *Holdings) Bytes(off, n int64) []byte { return h.pool.Bytes(off, n) }

// NextGeneration is a fresh even generation for a block written here.
func (h *Holdings) NextGeneration() uint64 { return h.pool.NextGeneration() }

// maxEvictRounds bounds Alloc: fragmentation can leave room in pieces, so
// eviction gets a few rounds before the pool is declared full.
const maxEvictRounds = 8

// Alloc returns the offset of n free bytes of the pool, evicting held
// blocks when it is full.
func (h *Holdings) Alloc(n int64) (int64, error) {
	for round := 0; ; round++ {
		off, err := h.pool.Alloc(n)
		if err == nil || round == maxEvictRounds || n <= 0 || n > h.pool.Size() {
			return off, err
		}
		if err := h.Evict(n); err != nil {
			return 0, err
		}
	}
}

// Prefault makes pages past the pool's highest allocation resident, at
// most limit bytes (pool.Prefault).
func (h *Holdings) Prefault(limit int64) { h.pool.Prefault(limit) }

// Free returns memory from Alloc that never held a block a reader could
// be sent to (staging).
func (h *Holdings) Free(off, n int64) error { return h.pool.Free(off, n) }

// Invalidate stamps a fresh odd generation on memory from Alloc and frees
// it, so a reader that still holds an entry naming it fails verification.
func (h *Holdings) Invalidate(off, n int64) {
	pool.BeginWrite(h.pool.Bytes(off, n), h.pool.NextGeneration())
	if err := h.pool.Free(off, n); err != nil {
		h.log.Error("mcbridge: freeing a pool block", "err", err)
	}
}

// Evict frees at least need bytes of unpinned blocks, in the tree's policy
// order, for the pool. Gone hears them before their memory is reused.
func (h *Holdings) Evict(need int64) error {
	h.mu.Lock()
	have := h.tree.Bytes()
	if have == 0 {
		h.mu.Unlock()
		return status.Errorf(status.PoolFull, "pool full and nothing evictable")
	}
	gone, err := h.tree.Evict(h.pool.Size() - have + min(need, have))
	h.mu.Unlock()
	if err != nil {
		return err
	}
	if len(gone) == 0 {
		return status.Errorf(status.PoolFull, "pool full: the rest is pinned or staging")
	}
	h.release(gone, true)
	return nil
}

// release tells Gone of blocks out of the tree, then invalidates and frees
// their memory.
func (h *Holdings) release(gone []Entry, evicted bool) {
	h.gone(gone, evicted)
	for _, e := range gone {
		h.Invalidate(e.Value.Off, e.Value.Size)
	}
}

// insertLocked indexes one block under parent. A block whose parent is
// held elsewhere hangs under that parent's key as under a root: the tree
// only needs the shape of the chains held here.
func (h *Holdings) insertLocked(parent key.Hash, rb residency.Block[Block]) error {
	if _, ok := h.tree.Get(parent); ok {
		_, err := h.tree.Insert(parent, rb)
		return err
	}
	_, err := h.tree.InsertChain(parent, []residency.Block[Block]{rb})
	return err
}

// Seal holds a block this process wrote and sealed, Pending until an offer
// takes it. It reports false, holding nothing, when the key is held
// already (another save sealed it first).
func (h *Holdings) Seal(parent key.Hash, b Block, cost float64) (bool, error) {
	b.State = Pending
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, held := h.tree.Get(b.Entry.Key); held {
		return false, nil
	}
	if err := h.insertLocked(parent, residency.Block[Block]{Key: b.Entry.Key, Value: b, Bytes: b.Size, Cost: cost}); err != nil {
		return false, err
	}
	return true, nil
}

// Admit holds a copy of another owner's block, or one read back from a
// disk tier, as a Replica. A key held already is refused (status.State).
func (h *Holdings) Admit(parent key.Hash, b Block, cost float64, uses uint32) error {
	b.State = Replica
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, held := h.tree.Get(b.Entry.Key); held {
		return status.Errorf(status.State, "block %s is held already", b.Entry.Key)
	}
	return h.insertLocked(parent, residency.Block[Block]{Key: b.Entry.Key, Value: b, Bytes: b.Size, Cost: cost, Uses: uses})
}

// AnyGeneration pins a block whatever generation it is held at.
const AnyGeneration = 0

// Pin keeps a block held at gen (AnyGeneration: at any) in place, and its
// prefix with it, until Unpin; ok is false when it is not held so.
func (h *Holdings) Pin(k key.BlockKey, gen uint64) (e Entry, ok bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	e, ok = h.tree.Entry(k)
	if !ok || (gen != AnyGeneration && e.Value.Gen != gen) || h.tree.Pin(k) != nil {
		return Entry{}, false
	}
	return e, true
}

// Unpin releases one Pin of each key.
func (h *Holdings) Unpin(keys ...key.BlockKey) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, k := range keys {
		_ = h.tree.Unpin(k)
	}
}

// Take accepts entries for the directory, in order, and says how many of
// the first ones it took (the publisher's queue is bounded).
type Take func([]directory.Entry) int

// offer moves each held block of keys that step moves (step changes the
// block and says whether it did), hands their entries to take, and moves
// those take refused back to the state they had: a block is only ever
// marked offered while the publisher holds its entry. It returns how many
// take accepted and refused.
func (h *Holdings) offer(keys []key.BlockKey, step func(*Block) bool, take Take) (queued, refused int) {
	var moved []key.BlockKey
	var was []State
	var entries []directory.Entry
	h.mu.Lock()
	for _, k := range keys {
		b, ok := h.tree.Get(k)
		if !ok {
			continue
		}
		prev := b.State
		if !step(&b) {
			continue
		}
		h.tree.Set(k, b)
		moved, was, entries = append(moved, k), append(was, prev), append(entries, b.Entry)
	}
	h.mu.Unlock()
	if len(entries) == 0 {
		return 0, 0
	}
	queued = take(entries)
	if queued == len(entries) {
		return queued, 0
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for i := queued; i < len(entries); i++ {
		if b, ok := h.tree.Get(moved[i]); ok && b.Gen == entries[i].Loc.Generation && b.State.Offered() {
			b.State = was[i]
			h.tree.Set(moved[i], b)
		}
	}
	return queued, len(entries) - queued
}

// OfferPending offers the waiting blocks among keys (all held ones when
// keys is nil) to take: Pending ones as Publishing, TakeoverPending ones
// as TakingOver. Those take refuses wait again.
func (h *Holdings) OfferPending(keys []key.BlockKey, take Take) (queued, refused int) {
	if keys == nil {
		h.mu.Lock()
		h.tree.Walk(func(e Entry) bool {
			if e.Value.State.Waiting() {
				keys = append(keys, e.Key)
			}
			return true
		})
		h.mu.Unlock()
	}
	return h.offer(keys, func(b *Block) bool {
		if !b.State.Waiting() {
			return false
		}
		b.State = b.State.offered()
		return true
	}, take)
}

// TakeOver offers the replicas among keys to take as this process's, each
// entry's location rewritten by loc: their owner let go, or they were read
// back from a disk tier. Those take refuses stay replicas.
func (h *Holdings) TakeOver(keys []key.BlockKey, loc func(Block) directory.Location, take Take) (queued, refused int) {
	return h.offer(keys, func(b *Block) bool {
		if b.State != Replica {
			return false
		}
		b.State = TakingOver
		b.Entry.Loc = loc(*b)
		return true
	}, take)
}

// Refuse moves an offered block held at gen back to waiting: the store
// refused it on its way to the directory.
func (h *Holdings) Refuse(k key.BlockKey, gen uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if b, ok := h.tree.Get(k); ok && b.Gen == gen && b.State.Offered() {
		b.State = b.State.waiting()
		h.tree.Set(k, b)
	}
}

// Rename records the entry a block held at gen is published under now
// (one that names the store it was written into).
func (h *Holdings) Rename(e directory.Entry) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if b, ok := h.tree.Get(e.Key); ok && b.Gen == e.Loc.Generation {
		b.Entry = e
		h.tree.Set(e.Key, b)
	}
}

// Repend moves a block of ours held at gen back to waiting, its entry
// naming this pool (segment, at base) again: the store lost the copy the
// directory named. It reports whether it did.
func (h *Holdings) Repend(k key.BlockKey, gen uint64, segment string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	b, ok := h.tree.Get(k)
	if !ok || b.Gen != gen || !b.State.Ours() {
		return false
	}
	b.Entry.Loc.Segment, b.Entry.Loc.Addr = segment, uint64(h.pool.Base())+uint64(b.Off)
	b.State = b.State.waiting()
	h.tree.Set(k, b)
	return true
}

// Announce is told, under the holdings' lock, of a block that becomes this
// process's to answer for; it may read other held blocks through r, and
// clears b.Chain once the block is announced.
type Announce func(k key.BlockKey, b *Block, r Reader)

// Settle records the directory's acceptance of a block offered at gen. It
// reports whether the block is still held at gen, and whether it was a
// takeover.
func (h *Holdings) Settle(k key.BlockKey, gen uint64, announce Announce) (held, tookOver bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	b, ok := h.tree.Get(k)
	if !ok || b.Gen != gen {
		return false, false
	}
	if announce != nil {
		announce(k, &b, Reader{h})
	}
	tookOver = b.State.Takeover()
	if b.State != Replica {
		b.State = Settled
	}
	h.tree.Set(k, b)
	return true, tookOver
}

// Lose records that another process published a block offered at gen
// first. A takeover becomes a replica again, to wait for that process to
// let go; a block of ours goes, unless a block hangs under it: then it
// stays, settled, its key held elsewhere, for eviction to take.
func (h *Holdings) Lose(k key.BlockKey, gen uint64) {
	h.mu.Lock()
	b, ok := h.tree.Get(k)
	if !ok || b.Gen != gen {
		h.mu.Unlock()
		return
	}
	if b.State.Takeover() {
		b.State = Replica
		h.tree.Set(k, b)
		h.mu.Unlock()
		return
	}
	b.State = Settled
	h.tree.Set(k, b)
	free := h.tree.Leaf(k)
	if free {
		_, err := h.tree.Remove(k)
		free = err == nil
	}
	h.mu.Unlock()
	if free {
		h.Invalidate(b.Off, b.Size)
	}
}

// Outcomes of Drop.
const (
	Dropped = iota // the check failed: dropped, with what hangs under it
	Intact         // the check passed
	Gone           // not held at that generation: nothing to do
	Busy           // a load holds it or a block under it: try again later
	Outcomes
)

// Drop checks the block held at gen with check, pinned meanwhile, and
// drops it, with the blocks under it (no prefix reaches them without it),
// when the check fails. Gone hears what was dropped. It returns the
// outcome, the check's error, and how many blocks went.
func (h *Holdings) Drop(k key.BlockKey, gen uint64, check func(Block, []byte) error) (outcome int, why error, n int) {
	e, ok := h.Pin(k, gen)
	if !ok {
		return Gone, nil, 0
	}
	b := e.Value
	why = check(b, h.pool.Bytes(b.Off, b.Size))
	h.mu.Lock()
	_ = h.tree.Unpin(k)
	if why == nil {
		h.mu.Unlock()
		return Intact, nil, 0
	}
	gone, err := h.tree.Remove(k)
	h.mu.Unlock()
	if err != nil {
		return Busy, why, 0
	}
	h.release(gone, false)
	return Dropped, why, len(gone)
}

// Touch counts the held blocks among keys as used now, in order, and
// returns how many were held.
func (h *Holdings) Touch(keys ...key.BlockKey) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.tree.Touch(keys...)
}

// Get is a copy of a held block.
func (h *Holdings) Get(k key.BlockKey) (Block, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.tree.Get(k)
}

// Holds reports whether k is held at gen.
func (h *Holdings) Holds(k key.BlockKey, gen uint64) bool {
	b, ok := h.Get(k)
	return ok && b.Gen == gen
}

// Len is how many blocks are held, Bytes what they take.
func (h *Holdings) Len() (blocks int, bytes int64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.tree.Len(), h.tree.Bytes()
}

// Reader reads held blocks while the holdings' lock is held.
type Reader struct{ h *Holdings }

// Get is a copy of a held block.
func (r Reader) Get(k key.BlockKey) (Block, bool) { return r.h.tree.Get(k) }

// Walk visits the held blocks until visit returns false.
func (r Reader) Walk(visit func(Entry) bool) { r.h.tree.Walk(visit) }

// View runs read with the holdings' lock held, for reads that must see
// several blocks at one moment (a chain).
func (h *Holdings) View(read func(Reader)) {
	h.mu.Lock()
	defer h.mu.Unlock()
	read(Reader{h})
}
