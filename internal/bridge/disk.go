package bridge

import (
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
	b    *Bridge
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

// UseDisk gives a store node a disk tier. It must be called before
// Replicate; the bridge uses the tier until Close, which writes every
// block of the pool to it first. The caller keeps ownership of t.
func (b *Bridge) UseDisk(t *disk.Tier) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed || b.tier != nil || b.stopReplication != nil {
		return status.Errorf(status.State, "a disk tier is given once, before replication starts")
	}
	d := &diskTier{b: b, disk: t, wake: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	b.tier = d
	go d.run()
	return nil
}

// stopDisk writes what the pool holds and ends the tier's goroutine.
func (b *Bridge) stopDisk() {
	d := b.tier
	if d == nil {
		return
	}
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
			d.b.bringBack(wants)
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
	d.b.hold.View(func(r holdings.Reader) {
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
	b := d.b
	if d.disk.Has(k) {
		return
	}
	e, ok := b.hold.Pin(k, holdings.AnyGeneration)
	if !ok {
		return
	}
	s := e.Value
	err := d.disk.Put(b.hold.Bytes(s.Off, s.Size), metaOf(&s, e.Uses))
	b.hold.Unpin(k)
	if err != nil {
		b.log.Warn("mcbridge: disk tier: a block stays in memory only", "block", k, "err", err)
		return
	}
	b.stats.add(&b.stats.persisted, 1)
}

// spill writes evicted blocks that have no file yet, before their memory
// is reused: eviction moves them to the disk instead of losing them.
func (d *diskTier) spill(gone []holdings.Entry) {
	b := d.b
	for i := range gone {
		s := &gone[i].Value
		if d.disk.Has(gone[i].Key) {
			continue
		}
		if err := d.disk.Put(b.hold.Bytes(s.Off, s.Size), metaOf(s, gone[i].Uses)); err != nil {
			b.log.Warn("mcbridge: disk tier: an evicted block is lost", "block", gone[i].Key, "err", err)
			continue
		}
		b.stats.add(&b.stats.spilled, 1)
	}
}

// blockCost is what recomputing a block at depth costs, by the arbiter's
// prefill model: a block further down a chain attends to more positions.
func (b *Bridge) blockCost(blockTokens int, depth uint32) float64 {
	start := int(depth) * blockTokens
	return b.arb.PrefillTime(start, start+blockTokens).Seconds()
}

// bringBack reads blocks of the disk tier back into the pool, in the order
// given (a chain: parents first), and publishes them with any that the
// pool holds unpublished. It stops at the first block it cannot bring,
// which no later one of a chain could do without.
func (b *Bridge) bringBack(keys []key.BlockKey) int {
	d := b.tier
	var held []key.BlockKey
	brought := 0
	for _, k := range keys {
		if s, ok := b.hold.Get(k); ok {
			if s.State == holdings.Replica {
				held = append(held, k)
			}
			continue
		}
		m, ok := d.disk.Meta(k)
		if !ok {
			continue
		}
		if err := b.readBack(m); err != nil {
			b.log.Warn("mcbridge: disk tier: a block cannot come back", "block", k, "err", err)
			break
		}
		held = append(held, k)
		brought++
	}
	b.publishHeld(held)
	return brought
}

// readBack brings one block from its file into the pool: decoded and
// verified in scratch memory first, then copied in under the seqlock with
// a generation of this pool's own.
func (b *Bridge) readBack(m disk.Meta) error {
	d := b.tier
	if m.RawLen > b.hold.Size()/2 {
		return status.Errorf(status.PoolFull, "a block of %d bytes in a pool of %d", m.RawLen, b.hold.Size())
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
	off, err := b.hold.Alloc(m.RawLen)
	if err != nil {
		return err
	}
	block := b.hold.Bytes(off, m.RawLen)
	gen := b.hold.NextGeneration()
	pool.BeginWrite(block, gen)
	copy(block[:8], buf[:8])
	copy(block[16:], buf[16:])
	pool.EndWrite(block, gen)
	s := holdings.Block{Model: m.Model, Off: off, Size: m.RawLen, Gen: gen, Depth: m.Depth,
		Entry: directory.Entry{Model: m.Model, Key: m.Key, Parent: m.Parent, Loc: directory.Location{Checksum: m.HeaderSum}}}
	if err := b.hold.Admit(m.Parent, s, b.blockCost(g.BlockTokens, m.Depth), m.Uses); err != nil {
		b.hold.Invalidate(off, m.RawLen)
		return err
	}
	b.stats.add(&b.stats.pagedIn, 1)
	return nil
}

// publishHeld offers the directory blocks of the pool that it does not
// name as this store's: copies whose owner let go, blocks read back from
// the disk. One another process publishes first stays a replica.
func (b *Bridge) publishHeld(keys []key.BlockKey) {
	_, refused := b.hold.TakeOver(keys, func(s holdings.Block) directory.Location {
		return b.location(s.Off, s.Size, s.Entry.Loc.Checksum, s.Gen)
	}, b.pub.offer)
	b.stats.add(&b.stats.publishDropped, int64(refused))
}

// RefillFromDisk reads the disk tier back into the pool after a restart,
// up to seven eighths of it (the rest stays free for copies): blocks in
// order of depth, the most used first at each depth, each only after its
// parent (or as a chain's first), so that every block brought back
// continues a prefix a reader can restore. They are published as this
// store's. It returns how many came back.
func (b *Bridge) RefillFromDisk() int {
	d := b.tier
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
	limit := b.hold.Size() / 8 * 7
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
	n := 0
	for _, k := range order {
		m, ok := d.disk.Meta(k)
		if !ok {
			continue
		}
		if err := b.readBack(m); err != nil {
			b.log.Warn("mcbridge: disk tier: a block cannot come back", "block", k, "err", err)
			continue
		}
		n++
	}
	b.publishHeld(order)
	return n
}

// DiskStats is the disk tier's counters; zero without one.
func (b *Bridge) DiskStats() disk.Stats {
	if b.tier == nil {
		return disk.Stats{}
	}
	return b.tier.disk.Stats()
}
