package storenode

import (
	"errors"
	"sort"
	"sync"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/disk"
	"github.com/mcbridge/mcbridge/internal/holdings"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/status"
)

// A store node's disk tier keeps every block of its pool in a file too:
//
//   - Write-behind: a block copied into the pool is written to its file by
//     the tier's goroutine soon after, so a store killed without warning
//     loses only the last few; a stopped one writes everything first.
//   - Spill: a block evicted before it was written is written on the way
//     out, so eviction moves blocks to the disk instead of losing them.
//   - Read back on demand: a reader whose lookup found a prefix here asks
//     for the blocks after it (a want report); those on disk come back
//     into the pool, verified, and are published.
//   - Restart: the tier's index is rebuilt from the files
//     (internal/disk verifies each), and the pool is refilled from it,
//     shallow blocks and the most used first, and published.
//
// Nothing is ever read from a file by a peer: a block is verified in full
// on its way back into the pool, and only the pool is published.
type diskTier struct {
	n    *Node
	disk *disk.Tier

	mu      sync.Mutex
	persist []key.BlockKey // blocks to write behind
	wants   []key.BlockKey // blocks readers asked for, chains in order
	wake    chan struct{}
	stop    chan struct{}
	done    chan struct{}
	once    sync.Once

	readMu  sync.Mutex
	scratch []byte // a block read back is checked here before it enters the pool
}

func newDiskTier(n *Node, t *disk.Tier) *diskTier {
	return &diskTier{n: n, disk: t, wake: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
}

// stopOnce writes what the pool holds and ends the tier's goroutine.
func (d *diskTier) stopOnce() {
	d.once.Do(func() {
		close(d.stop)
		<-d.done
	})
}

func (d *diskTier) kick() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// persistLater queues a block of the pool for its file.
func (d *diskTier) persistLater(k key.BlockKey) {
	d.mu.Lock()
	d.persist = append(d.persist, k)
	d.mu.Unlock()
	d.kick()
}

// want queues blocks a reader asked for.
func (d *diskTier) want(keys []key.BlockKey) {
	d.mu.Lock()
	d.wants = append(d.wants, keys...)
	d.mu.Unlock()
	d.kick()
}

func (d *diskTier) run() {
	defer close(d.done)
	for {
		select {
		case <-d.stop:
			d.persistAll()
			return
		case <-d.wake:
		}
		d.mu.Lock()
		persist, wants := d.persist, d.wants
		d.persist, d.wants = nil, nil
		d.mu.Unlock()
		if len(wants) > 0 {
			d.n.bringBack(wants)
		}
		for _, k := range persist {
			select {
			case <-d.stop:
				d.persistAll()
				return
			default:
			}
			d.write(k)
		}
	}
}

// persistAll writes every block of the pool that has no file yet.
func (d *diskTier) persistAll() {
	var keys []key.BlockKey
	d.n.hold.View(func(r holdings.Reader) {
		r.Walk(func(e holdings.Entry) bool {
			if !d.disk.Has(e.Key) {
				keys = append(keys, e.Key)
			}
			return true
		})
	})
	for _, k := range keys {
		d.write(k)
	}
}

func metaOf(s *holdings.Block, uses uint32) disk.Meta {
	return disk.Meta{Key: s.Entry.Key, Parent: s.Entry.Parent, Model: s.Model, Depth: s.Depth, Uses: uses}
}

// write writes one block of the pool to its file, pinned meanwhile.
func (d *diskTier) write(k key.BlockKey) {
	n := d.n
	if d.disk.Has(k) {
		return
	}
	e, ok := n.hold.Pin(k, holdings.AnyGeneration)
	if !ok {
		return
	}
	s := e.Value
	err := d.disk.Put(n.hold.Bytes(s.Off, s.Size), metaOf(&s, e.Uses))
	n.hold.Unpin(k)
	if err != nil {
		n.log.Warn("mcbridge: disk tier: a block stays in memory only", "block", k, "err", err)
		return
	}
	n.stats.persisted.Add(1)
}

// spill writes evicted blocks that have no file yet, before their memory
// is reused: eviction moves them to the disk instead of losing them.
func (d *diskTier) spill(gone []holdings.Entry) {
	n := d.n
	for i := range gone {
		s := &gone[i].Value
		if d.disk.Has(gone[i].Key) {
			continue
		}
		if err := d.disk.Put(n.hold.Bytes(s.Off, s.Size), metaOf(s, gone[i].Uses)); err != nil {
			n.log.Warn("mcbridge: disk tier: an evicted block is lost", "block", gone[i].Key, "err", err)
			continue
		}
		n.stats.spilled.Add(1)
	}
}

// bringBack reads blocks of the disk tier back into the pool, in the order
// given (a chain: parents first), and publishes them with any that the
// pool holds unpublished. It stops at the first block it cannot bring,
// which no later one of a chain could do without.
func (n *Node) bringBack(keys []key.BlockKey) int {
	d := n.tier
	var held []key.BlockKey
	brought := 0
	for _, k := range keys {
		if s, ok := n.hold.Get(k); ok {
			if s.State == holdings.Replica {
				held = append(held, k)
			}
			continue
		}
		m, ok := d.disk.Meta(k)
		if !ok {
			continue
		}
		err := n.readBack(m)
		if errors.Is(err, errHeldAlready) {
			held = append(held, k) // a copy came in meanwhile: the chain goes on from it
			continue
		}
		if err != nil {
			n.log.Warn("mcbridge: disk tier: a block cannot come back", "block", k, "err", err)
			break
		}
		held = append(held, k)
		brought++
	}
	n.host.PublishHeld(held)
	return brought
}

// errHeldAlready is readBack's answer for a block the pool came to hold
// while its file was read (a copy replication made): it is in the pool.
var errHeldAlready = errors.New("the pool holds the block already")

// readBack brings one block from its file into the pool: decoded and
// verified in scratch memory first, then copied in under the seqlock with
// a generation of this pool's own.
func (n *Node) readBack(m disk.Meta) error {
	d := n.tier
	if m.RawLen > n.hold.Size()/2 {
		return status.Errorf(status.PoolFull, "a block of %d bytes in a pool of %d", m.RawLen, n.hold.Size())
	}
	d.readMu.Lock()
	defer d.readMu.Unlock()
	if int64(cap(d.scratch)) < m.RawLen {
		d.scratch = make([]byte, m.RawLen)
	}
	buf := d.scratch[:m.RawLen]
	if _, err := d.disk.Get(m.Key, buf); err != nil {
		return err
	}
	g, err := pool.ParseGeometry(buf)
	if err != nil {
		return err
	}
	off, err := n.hold.Alloc(m.RawLen)
	if err != nil {
		return err
	}
	block := n.hold.Bytes(off, m.RawLen)
	gen := n.hold.NextGeneration()
	pool.BeginWrite(block, gen)
	copy(block[:8], buf[:8])
	copy(block[16:], buf[16:])
	pool.EndWrite(block, gen)
	s := holdings.Block{Model: m.Model, Off: off, Size: m.RawLen, Gen: gen, Depth: m.Depth,
		Entry: directory.Entry{Model: m.Model, Key: m.Key, Parent: m.Parent, Loc: directory.Location{Checksum: m.HeaderSum}}}
	if err := n.hold.Admit(m.Parent, s, n.blockCost(g.BlockTokens, m.Depth), m.Uses); err != nil {
		n.hold.Invalidate(off, m.RawLen)
		if _, held := n.hold.Get(m.Key); held {
			return errHeldAlready
		}
		return err
	}
	n.stats.pagedIn.Add(1)
	return nil
}

// RefillFromDisk reads the disk tier back into the pool after a restart,
// up to seven eighths of it (the rest stays free for copies): blocks in
// order of depth, the most used first at each depth, each only after its
// parent (or as a chain's first), so that every block brought back
// continues a prefix a reader can restore. They are published as this
// store's. It returns how many came back.
func (n *Node) RefillFromDisk() int {
	d := n.tier
	if d == nil {
		return 0
	}
	blocks := d.disk.Blocks()
	sort.SliceStable(blocks, func(i, j int) bool {
		if blocks[i].Depth != blocks[j].Depth {
			return blocks[i].Depth < blocks[j].Depth
		}
		return blocks[i].Uses > blocks[j].Uses
	})
	onDisk := map[key.BlockKey]bool{}
	for _, m := range blocks {
		onDisk[m.Key] = true
	}
	in := map[key.BlockKey]bool{}
	limit := n.hold.Size() / 8 * 7
	var order []key.BlockKey
	var used int64
	for _, m := range blocks {
		if onDisk[m.Parent] && !in[m.Parent] {
			continue
		}
		if used+m.RawLen > limit {
			break
		}
		used += m.RawLen
		in[m.Key] = true
		order = append(order, m.Key)
	}
	back := 0
	for _, k := range order {
		m, ok := d.disk.Meta(k)
		if !ok {
			continue
		}
		if _, held := n.hold.Get(k); held {
			continue // replication, which runs from the node's start, copied it first
		}
		switch err := n.readBack(m); {
		case errors.Is(err, errHeldAlready):
		case err != nil:
			n.log.Warn("mcbridge: disk tier: a block cannot come back", "block", k, "err", err)
		default:
			back++
		}
	}
	n.host.PublishHeld(order)
	return back
}
