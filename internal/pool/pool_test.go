package pool

import (
	"errors"
	"math"
	"math/rand"
	"reflect"
	"sync"
	"testing"

	"github.com/mcbridge/mcbridge/internal/status"
)

func newPool(t *testing.T, size int64, evict Evictor) *Pool {
	t.Helper()
	p, err := New(size, evict)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func mustAlloc(t *testing.T, p *Pool, n int64) int64 {
	t.Helper()
	off, err := p.Alloc(n)
	if err != nil {
		t.Fatalf("Alloc(%d): %v", n, err)
	}
	return off
}

func mustFree(t *testing.T, p *Pool, off, n int64) {
	t.Helper()
	if err := p.Free(off, n); err != nil {
		t.Fatalf("Free(%d, %d): %v", off, n, err)
	}
}

func (p *Pool) freeList() []extent {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]extent{}, p.free...)
}

func TestNew(t *testing.T) {
	for _, size := range []int64{0, -64, math.MaxInt64} {
		if _, err := New(size, nil); status.Of(err) != status.Config {
			t.Errorf("New(%d): %v, want Config", size, err)
		}
	}
	p := newPool(t, 100, nil)
	if p.Size() != 128 {
		t.Fatalf("a 100-byte pool has %d bytes, want 128 (aligned)", p.Size())
	}
	if p.Base() == 0 || p.Base()%4096 != 0 {
		t.Fatalf("base %#x is not a mapped page", p.Base())
	}
	b := p.Bytes(64, 64)
	if len(b) != 64 || cap(b) != 64 {
		t.Fatalf("Bytes(64, 64): len %d cap %d", len(b), cap(b))
	}
	b[0] = 1
	if p.Bytes(0, 128)[64] != 1 {
		t.Fatalf("Bytes does not view the region")
	}
}

func TestAllocFirstFitAndCoalesce(t *testing.T) {
	p := newPool(t, 1024, nil)
	a := mustAlloc(t, p, 1) // rounded to 64
	b := mustAlloc(t, p, 100)
	c := mustAlloc(t, p, 64)
	if a != 0 || b != 64 || c != 192 || p.Used() != 256 {
		t.Fatalf("offsets %d %d %d, used %d; want 0 64 192, 256", a, b, c, p.Used())
	}
	mustFree(t, p, b, 100)
	// First fit: a small block goes into the hole, a large one past it.
	if d := mustAlloc(t, p, 200); d != 256 {
		t.Fatalf("200 bytes at %d, want 256 past the 128-byte hole", d)
	}
	if e := mustAlloc(t, p, 64); e != 64 {
		t.Fatalf("64 bytes at %d, want the first hole at 64", e)
	}
	if f := mustAlloc(t, p, 64); f != 128 {
		t.Fatalf("64 bytes at %d, want the rest of the hole at 128", f)
	}
	mustFree(t, p, 0, 64)
	mustFree(t, p, 128, 64)
	mustFree(t, p, 256, 200)
	mustFree(t, p, 64, 64) // joins the extents on both sides
	mustFree(t, p, 192, 64)
	if got := p.freeList(); !reflect.DeepEqual(got, []extent{{0, 1024}}) || p.Used() != 0 {
		t.Fatalf("after freeing everything: free list %v, used %d", got, p.Used())
	}
	if off := mustAlloc(t, p, 1024); off != 0 {
		t.Fatalf("whole pool at %d", off)
	}
}

func TestFreeRefusesBadExtents(t *testing.T) {
	p := newPool(t, 1024, nil)
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
		if err := p.Free(tc.off, tc.n); status.Of(err) != status.Internal {
			t.Errorf("%s: Free(%d, %d) = %v, want Internal", tc.name, tc.off, tc.n, err)
		}
		if got := p.freeList(); !reflect.DeepEqual(got, before) {
			t.Errorf("%s: a refused free changed the free list %v -> %v", tc.name, before, got)
		}
	}
	if p.Used() != 128 {
		t.Fatalf("used %d after refused frees", p.Used())
	}
}

func TestAllocFullWithoutEvictor(t *testing.T) {
	p := newPool(t, 256, nil)
	for _, n := range []int64{0, -1, 257} {
		if _, err := p.Alloc(n); status.Of(err) != status.PoolFull {
			t.Errorf("Alloc(%d): %v, want PoolFull", n, err)
		}
	}
	mustAlloc(t, p, 64)
	mustAlloc(t, p, 128)
	if _, err := p.Alloc(65); status.Of(err) != status.PoolFull {
		t.Fatalf("Alloc past the free space: %v", err)
	}
	mustAlloc(t, p, 64)
}

func TestAllocEvicts(t *testing.T) {
	type blk struct{ off, n int64 }
	var p *Pool
	var live []blk
	var asked []int64
	p = newPool(t, 512, func(need int64) error {
		asked = append(asked, need)
		// Oldest first, until a block of need bytes is free.
		for freed := int64(0); freed < need; {
			if len(live) == 0 {
				return status.Errorf(status.PoolFull, "nothing to evict")
			}
			v := live[0]
			live = live[1:]
			if err := p.Free(v.off, v.n); err != nil {
				return err
			}
			freed += v.n
		}
		return nil
	})
	for i := 0; i < 4; i++ {
		live = append(live, blk{mustAlloc(t, p, 128), 128})
	}
	off := mustAlloc(t, p, 200)
	if !reflect.DeepEqual(asked, []int64{256}) || off != 0 || len(live) != 2 {
		t.Fatalf("evictor asked for %v, block at %d, %d left; want [256], 0, 2", asked, off, len(live))
	}
	if _, err := p.Alloc(512); status.Of(err) != status.PoolFull {
		t.Fatalf("allocating more than eviction can free: %v", err)
	}
}

func TestAllocReturnsEvictorError(t *testing.T) {
	boom := errors.New("index unavailable")
	calls := 0
	p := newPool(t, 128, func(int64) error { calls++; return boom })
	mustAlloc(t, p, 128)
	if _, err := p.Alloc(64); !errors.Is(err, boom) || calls != 1 {
		t.Fatalf("Alloc = %v after %d evictions, want the evictor's error after 1", err, calls)
	}

	// An evictor that frees nothing cannot loop forever.
	calls = 0
	p.SetEvictor(func(int64) error { calls++; return nil })
	if _, err := p.Alloc(64); status.Of(err) != status.PoolFull || calls == 0 || calls > 16 {
		t.Fatalf("Alloc = %v after %d evictions", err, calls)
	}
	p.SetEvictor(nil)
	calls = 0
	if _, err := p.Alloc(64); status.Of(err) != status.PoolFull || calls != 0 {
		t.Fatalf("without an evictor: %v, %d calls", err, calls)
	}
}

// Concurrent owners write their own pattern into their extents; an extent
// handed out twice shows up as another owner's byte.
func TestAllocConcurrent(t *testing.T) {
	p := newPool(t, 1<<20, nil)
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
		t.Error(err)
	}
	if got := p.freeList(); p.Used() != 0 || !reflect.DeepEqual(got, []extent{{0, p.Size()}}) {
		t.Fatalf("after all frees: used %d, free list %v", p.Used(), got)
	}
}

func TestNextGeneration(t *testing.T) {
	p := newPool(t, 64, nil)
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
				if g == 0 || g%2 != 0 || seen[g] {
					t.Errorf("generation %d: zero, odd or repeated", g)
				}
				seen[g] = true
			}
		}()
	}
	wg.Wait()
	if len(seen) != workers*each {
		t.Fatalf("%d distinct generations of %d", len(seen), workers*each)
	}
}

func TestClose(t *testing.T) {
	p, err := New(4096, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}
