package pool

import (
	"math"
	"math/rand"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mcbridge/mcbridge/internal/mem"
	"github.com/mcbridge/mcbridge/internal/status"
)

func newPool(t *testing.T, size int64) *Pool {
	t.Helper()
	p, err := New(size)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func mustAlloc(t *testing.T, p *Pool, n int64) int64 {
	t.Helper()
	off, err := p.Alloc(n)
	require.NoError(t, err, "Alloc(%d)", n)
	return off
}

func mustFree(t *testing.T, p *Pool, off, n int64) {
	t.Helper()
	require.NoError(t, p.Free(off, n), "Free(%d, %d)", off, n)
}

func (p *Pool) freeList() []extent {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]extent{}, p.free...)
}

func TestNew(t *testing.T) {
	for _, size := range []int64{0, -64, math.MaxInt64} {
		_, err := New(size)
		assert.Equal(t, status.Config, status.Of(err), "New(%d): %v", size, err)
	}
	p := newPool(t, 100)
	require.Equal(t, int64(128), p.Size(), "a 100-byte pool must be aligned up")
	require.NotZero(t, p.Base(), "base is not a mapped page")
	require.Zero(t, p.Base()%4096, "base %#x is not a mapped page", p.Base())
	b := p.Bytes(64, 64)
	require.Len(t, b, 64, "Bytes(64, 64)")
	require.Equal(t, 64, cap(b), "Bytes(64, 64) cap")
	b[0] = 1
	require.Equal(t, byte(1), p.Bytes(0, 128)[64], "Bytes does not view the region")
}

func TestAllocFirstFitAndCoalesce(t *testing.T) {
	p := newPool(t, 1024)
	a := mustAlloc(t, p, 1) // rounded to 64
	b := mustAlloc(t, p, 100)
	c := mustAlloc(t, p, 64)
	require.Equal(t, []int64{0, 64, 192}, []int64{a, b, c}, "offsets")
	require.Equal(t, int64(256), p.Used(), "used")
	mustFree(t, p, b, 100)
	// First fit: a small block goes into the hole, a large one past it.
	require.Equal(t, int64(256), mustAlloc(t, p, 200), "200 bytes must go past the 128-byte hole")
	require.Equal(t, int64(64), mustAlloc(t, p, 64), "64 bytes must go into the first hole")
	require.Equal(t, int64(128), mustAlloc(t, p, 64), "64 bytes must go into the rest of the hole")
	mustFree(t, p, 0, 64)
	mustFree(t, p, 128, 64)
	mustFree(t, p, 256, 200)
	mustFree(t, p, 64, 64) // joins the extents on both sides
	mustFree(t, p, 192, 64)
	require.Equal(t, []extent{{0, 1024}}, p.freeList(), "free list after freeing everything")
	require.Zero(t, p.Used(), "used after freeing everything")
	require.Zero(t, mustAlloc(t, p, 1024), "whole pool's offset")
}

func TestFreeRefusesBadExtents(t *testing.T) {
	p := newPool(t, 1024)
	a := mustAlloc(t, p, 128)
	b := mustAlloc(t, p, 128)
	mustFree(t, p, a, 128)
	for _, tc := range []struct {
		name   string
		off, n int64
	}{
		{"double free", a, 128},
		{"overlaps a free extent's end", a + 64, 128},
		{"overlaps the free tail", b + 64, 128},
		{"overlaps the next free extent", b, 256},
		{"negative offset", -64, 64},
		{"empty", b, 0},
		{"past the end", 1024, 64},
		{"straddles the end", 960, 128},
		{"wraps int64", math.MaxInt64 - 63, 128},
		{"unaligned", b + 1, 64},
	} {
		before := p.freeList()
		err := p.Free(tc.off, tc.n)
		assert.Equal(t, status.Internal, status.Of(err), "%s: Free(%d, %d) = %v", tc.name, tc.off, tc.n, err)
		assert.Equal(t, before, p.freeList(), "%s: a refused free changed the free list", tc.name)
	}
	require.Equal(t, int64(128), p.Used(), "used after refused frees")
}

func TestAllocFull(t *testing.T) {
	p := newPool(t, 256)
	for _, n := range []int64{0, -1, 257} {
		_, err := p.Alloc(n)
		assert.Equal(t, status.PoolFull, status.Of(err), "Alloc(%d): %v", n, err)
	}
	mustAlloc(t, p, 64)
	mustAlloc(t, p, 128)
	_, err := p.Alloc(65)
	require.Equal(t, status.PoolFull, status.Of(err), "Alloc past the free space: %v", err)
	mustAlloc(t, p, 64)
}

// Concurrent owners write their own pattern into their extents; an extent
// handed out twice shows up as another owner's byte.
func TestAllocConcurrent(t *testing.T) {
	p := newPool(t, 1<<20)
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			r := rand.New(rand.NewSource(int64(w)))
			type blk struct{ off, n int64 }
			var mine []blk
			for i := 0; i < 2000; i++ {
				if len(mine) > 0 && (r.Intn(2) == 0 || len(mine) > 20) {
					j := r.Intn(len(mine))
					v := mine[j]
					for _, c := range p.Bytes(v.off, v.n) {
						if c != byte(w+1) {
							errs <- status.Errorf(status.Internal, "worker %d: extent %d overwritten with %d", w, v.off, c)
							return
						}
					}
					if err := p.Free(v.off, v.n); err != nil {
						errs <- err
						return
					}
					mine = append(mine[:j], mine[j+1:]...)
					continue
				}
				n := int64(1 + r.Intn(8192))
				off, err := p.Alloc(n)
				if status.Of(err) == status.PoolFull {
					continue
				}
				if err != nil || off%align != 0 {
					errs <- status.Errorf(status.Internal, "Alloc(%d) = %d, %v", n, off, err)
					return
				}
				b := p.Bytes(off, n)
				for k := range b {
					b[k] = byte(w + 1)
				}
				mine = append(mine, blk{off, n})
			}
			for _, v := range mine {
				if err := p.Free(v.off, v.n); err != nil {
					errs <- err
					return
				}
			}
		}(w)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		assert.NoError(t, err)
	}
	require.Zero(t, p.Used(), "used after all frees")
	require.Equal(t, []extent{{0, p.Size()}}, p.freeList(), "free list after all frees")
}

func TestNextGeneration(t *testing.T) {
	p := newPool(t, 64)
	const workers, each = 4, 500
	var mu sync.Mutex
	seen := map[uint64]bool{}
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got := make([]uint64, each)
			for i := range got {
				got[i] = p.NextGeneration()
			}
			mu.Lock()
			defer mu.Unlock()
			for _, g := range got {
				assert.NotZero(t, g, "generation")
				assert.Zero(t, g%2, "generation %d is odd", g)
				assert.False(t, seen[g], "generation %d repeated", g)
				seen[g] = true
			}
		}()
	}
	wg.Wait()
	require.Len(t, seen, workers*each, "distinct generations")
}

func TestClose(t *testing.T) {
	p, err := New(4096)
	require.NoError(t, err)
	require.NoError(t, p.Close())
	require.NoError(t, p.Close(), "second Close")
}

// resident counts b's pages in memory.
func resident(t *testing.T, b []byte) int {
	t.Helper()
	n, err := mem.ResidentPages(b)
	require.NoError(t, err)
	return n
}

func TestPrefault(t *testing.T) {
	page := int64(unix.Getpagesize())
	p := newPool(t, 64*page)
	require.Zero(t, resident(t, p.region), "a new pool's memory is mapped, not touched")

	// A pool that stores nothing prefaults nothing.
	p.Prefault(64 * page)
	assert.Zero(t, resident(t, p.region))

	// An allocation faults its own pages in; Prefault as many pages past
	// the highest extent as lie below it, up to the limit.
	a := mustAlloc(t, p, 2*page)
	b := mustAlloc(t, p, 2*page)
	assert.Equal(t, 4, resident(t, p.region), "a's and b's pages, taken")
	copy(p.Bytes(b, 8), "written!")
	require.NoError(t, p.Free(a, 2*page))
	p.Prefault(64 * page)
	assert.Equal(t, 4+4, resident(t, p.region), "pages 4-7")
	assert.Equal(t, 4, resident(t, p.region[4*page:8*page]))
	assert.Equal(t, "written!", string(p.Bytes(b, 8)), "prefaulting writes no extent")

	// Ahead of the highest extent, not of the lowest free byte, and within
	// the limit.
	mustAlloc(t, p, 4*page) // pages 4-7: a's 2 are too few
	mustAlloc(t, p, 20*page)
	assert.Equal(t, 28, resident(t, p.region), "every page to the highest extent")
	p.Prefault(3 * page)
	assert.Equal(t, 28+3, resident(t, p.region))
	assert.Equal(t, 3, resident(t, p.region[28*page:31*page]))

	// As many as lie below (to page 56), nothing twice, never past the
	// region.
	p.Prefault(1000 * page)
	assert.Equal(t, 56, resident(t, p.region))
	p.Prefault(1000 * page)
	assert.Equal(t, 56, resident(t, p.region))
	mustAlloc(t, p, 8*page)
	p.Prefault(1000 * page)
	assert.Equal(t, 64, resident(t, p.region), "to the region's end")
}

// BenchmarkPrefault is the processor time of making 64 MiB of a fresh
// pool resident, what a prefaulter takes from a prompt beside it.
func BenchmarkPrefault(b *testing.B) {
	const size = 64 << 20
	b.SetBytes(size)
	for b.Loop() {
		p, err := New(2 * size)
		require.NoError(b, err)
		_, err = p.Alloc(size)
		require.NoError(b, err)
		p.Prefault(size)
		require.NoError(b, p.Close())
	}
}

// BenchmarkFirstWrite is a save's copy of 64 MiB into 1 MiB extents of a
// fresh pool, past anything prefaulted: what the host's thread pays while
// the pool fills.
func BenchmarkFirstWrite(b *testing.B) {
	const size, block = 64 << 20, 1 << 20
	src := make([]byte, block)
	b.SetBytes(size)
	for b.Loop() {
		p, err := New(size)
		require.NoError(b, err)
		for range size / block {
			off, err := p.Alloc(block)
			require.NoError(b, err)
			copy(p.Bytes(off, block), src)
		}
		require.NoError(b, p.Close())
	}
}
