package pool

import (
	"sort"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/mcbridge/mcbridge/internal/mem"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Pool is a fixed region of anonymous memory, carved into 64-byte-aligned
// extents by a first-fit allocator with coalescing. The region never moves,
// so transfer engines can register it once. A full pool refuses an
// allocation: what to evict is its owner's choice (internal/holdings).
// Safe for concurrent use.
type Pool struct {
	region []byte
	gen    atomic.Uint64
	fd     int    // the memfd of a shared pool (NewShared), else -1
	id     uint64 // a shared pool's identity, random

	mu   sync.Mutex
	free []extent // sorted by offset, never adjacent
	used int64
	high int64 // the end of the highest extent ever allocated
	// prefaulted is where Prefault stopped: pages from high to it are
	// resident.
	prefaulted int64
}

type extent struct{ off, n int64 }

// New maps size bytes (rounded up to the alignment) for a pool.
func New(size int64) (*Pool, error) {
	size = int64(alignUp(int(size)))
	if size <= 0 {
		return nil, status.Errorf(status.Config, "pool of %d bytes", size)
	}
	region, err := mem.Map(int(size))
	if err != nil {
		return nil, status.Wrap(status.PoolFull, err, "mapping the pool")
	}
	return &Pool{region: region, free: []extent{{0, size}}, fd: -1}, nil
}

// Base is the region's address, Size its length.
func (p *Pool) Base() uintptr { return mem.Addr(p.region) }
func (p *Pool) Size() int64   { return int64(len(p.region)) }

// Used is the bytes currently allocated.
func (p *Pool) Used() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.used
}

// Bytes returns the n bytes at off.
func (p *Pool) Bytes(off, n int64) []byte { return p.region[off : off+n : off+n] }

// NextGeneration returns a fresh even generation for a block write. Any two
// writes in a pool get different generations, so a reused location never
// passes a check against the generation it had before.
func (p *Pool) NextGeneration() uint64 { return p.gen.Add(2) }

// Alloc returns the offset of n free bytes.
func (p *Pool) Alloc(n int64) (int64, error) {
	if n <= 0 || n > p.Size() {
		return 0, status.Errorf(status.PoolFull, "block of %d bytes in a pool of %d", n, p.Size())
	}
	n = int64(alignUp(int(n)))
	p.mu.Lock()
	resident := max(p.prefaulted, alignPage(p.high))
	off, ok := p.take(n)
	p.mu.Unlock()
	if !ok {
		return 0, status.Errorf(status.PoolFull, "no %d contiguous bytes free in a pool of %d", n, p.Size())
	}
	p.populate(max(resident, off), off+n)
	return off, nil
}

// populate faults in the pages of [from, to) that nothing wrote yet, the
// extent's part past what was resident when it was taken, in one madvise
// rather than a fault at each page its writer would take (see Prefault).
// A kernel before 5.14 refuses the advice, and the writes fault alone.
func (p *Pool) populate(from, to int64) {
	page := int64(unix.Getpagesize())
	if from = from / page * page; from < to {
		_ = unix.Madvise(p.region[from:min(alignPage(to), p.Size())], unix.MADV_POPULATE_WRITE)
	}
}

func (p *Pool) take(n int64) (int64, bool) {
	for i, e := range p.free {
		if e.n < n {
			continue
		}
		if e.n == n {
			p.free = append(p.free[:i], p.free[i+1:]...)
		} else {
			p.free[i] = extent{e.off + n, e.n - n}
		}
		p.used += n
		p.high = max(p.high, e.off+n)
		return e.off, true
	}
	return 0, false
}

// Prefault makes the pages past the pool's highest allocation resident,
// as many as lie below it (so a pool that stores more prefaults more; one
// that stores nothing, nothing), at most limit bytes of them. It writes a
// zero to each, a piece at a time under the pool's lock, where no extent
// is, nor ever was: a reader only ever reads allocated extents, and the
// region is zeroed already. The first-fit allocator takes the lowest free
// extent, so those pages are the next ones written, and a pool's memory
// is mapped, not touched: a save's first copy into it otherwise takes a
// fault at every page on the host's thread, before llama-server's first
// token. Measured here, 96 MiB copied into fresh memory: 287 ms; after
// MADV_POPULATE_WRITE, 136 ms (this machine is a virtual machine whose
// host backs a page when it is first written); after a write to each
// page, 6 ms. So each piece is populated by one madvise, which spares
// the guest's fault at each page, and then written a page at a time,
// which has the host back each. 256 MiB took 370 ms of processor time,
// against 720 ms for the writes alone: time a prefaulter running beside
// a prompt takes from it. Pages below the highest allocation are left to
// whoever allocated them.
func (p *Pool) Prefault(limit int64) {
	page := int64(unix.Getpagesize())
	for {
		p.mu.Lock()
		from := max(p.prefaulted, alignPage(p.high))
		to := min(p.Size(), alignPage(p.high+min(p.high, limit)))
		if from >= to {
			p.mu.Unlock()
			return
		}
		// A piece bounds how long an allocation waits for the lock.
		end := min(to, from+prefaultPiece)
		p.populate(from, end)
		for at := from; at < end; at += page {
			p.region[at] = 0
		}
		p.prefaulted = end
		p.mu.Unlock()
	}
}

// prefaultPiece is what Prefault writes under the lock at once: 64 pages,
// under a millisecond where a page's first write costs 11 µs.
const prefaultPiece = 256 << 10

// alignPage rounds n up to the page size.
func alignPage(n int64) int64 {
	page := int64(unix.Getpagesize())
	return (n + page - 1) / page * page
}

// Free returns an extent from Alloc. Freeing what was not allocated is a
// bug and is refused rather than corrupting the free list.
func (p *Pool) Free(off, n int64) error {
	n = int64(alignUp(int(n)))
	p.mu.Lock()
	defer p.mu.Unlock()
	// Written without off+n, which can wrap; an unaligned offset was never
	// allocated and would break the alignment of every later extent.
	if off < 0 || n <= 0 || off%align != 0 || off > p.Size() || n > p.Size()-off {
		return status.Errorf(status.Internal, "free of [%d, +%d) outside the pool", off, n)
	}
	i := sort.Search(len(p.free), func(i int) bool { return p.free[i].off >= off })
	if i < len(p.free) && p.free[i].off < off+n || i > 0 && p.free[i-1].off+p.free[i-1].n > off {
		return status.Errorf(status.Internal, "double free of [%d, +%d)", off, n)
	}
	p.used -= n
	merged := extent{off, n}
	if i < len(p.free) && p.free[i].off == off+n {
		merged.n += p.free[i].n
		p.free = append(p.free[:i], p.free[i+1:]...)
	}
	if i > 0 && p.free[i-1].off+p.free[i-1].n == off {
		p.free[i-1].n += merged.n
		return nil
	}
	p.free = append(p.free, extent{})
	copy(p.free[i+1:], p.free[i:])
	p.free[i] = merged
	return nil
}

// Close unmaps the region and closes a shared pool's memfd (its Server
// must be closed first; readers' mappings stay valid). Nothing may use the
// pool's memory afterwards, and the transfer engine must have unregistered
// it.
func (p *Pool) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.region
	p.region = nil
	err := mem.Unmap(r)
	if p.fd >= 0 {
		_ = unix.Close(p.fd)
		p.fd = -1
	}
	return err
}
