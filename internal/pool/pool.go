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
	off, ok := p.take(n)
	p.mu.Unlock()
	if !ok {
		return 0, status.Errorf(status.PoolFull, "no %d contiguous bytes free in a pool of %d", n, p.Size())
	}
	return off, nil
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
		return e.off, true
	}
	return 0, false
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
