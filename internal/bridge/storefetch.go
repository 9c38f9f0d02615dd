package bridge

import (
	"fmt"
	"sync"

	"github.com/mcbridge/mcbridge/internal/status"
	mcstore "github.com/mcbridge/mcbridge/internal/store/mooncake"
)

// storeFetch is one load's read of its blocks that only the store holds:
// a single batch_get_into of all of them into pool staging, started with
// the load and waited for at its first layer (the store moves whole
// objects). The staging is freed by whichever comes last, the load's
// release or the call's landing: a call given up at the deadline may still
// write into it.
type storeFetch struct {
	op      *mcstore.Op[[]mcstore.Got]
	blocks  []int // indexes into the load's blocks, in key order
	staging []extent
	got     []mcstore.Got
	err     error
	waited  bool

	mu       sync.Mutex
	landed   bool
	released bool
}

// submitStore starts reading the leading blocks whose entries name a store
// and that this pool does not hold. It runs before submitRemote, which
// skips them (loadBlock.stored).
func (ld *Load) submitStore() {
	b := ld.m.b
	size := int64(ld.m.geo.Size())
	f := &storeFetch{}
	var cn *storeConn
	var keys []string
	var bufs []mcstore.Buffer
	for i := 0; i < ld.ok; i++ {
		lb := &ld.blocks[i]
		if _, _, ok := parseStoreSegment(lb.entry.Loc.Segment); !ok || lb.local {
			continue
		}
		var err error
		switch {
		case !b.readable(lb.entry):
			err = status.Errorf(status.Unsupported, "block %s is in a store this bridge is not configured for (%s)", lb.entry.Key, lb.entry.Loc.Segment)
		case lb.entry.Loc.Length != uint64(size):
			err = status.Errorf(status.Corrupt, "block %s published with %d bytes, model blocks are %d", lb.entry.Key, lb.entry.Loc.Length, size)
		case len(keys) == 0:
			cn, err = b.store.ready()
		}
		var off int64
		if err == nil {
			off, err = b.alloc(size)
		}
		if err != nil {
			ld.fail(i, err)
			break
		}
		f.staging = append(f.staging, extent{off, size})
		f.blocks = append(f.blocks, i)
		keys = append(keys, storeKey(lb.entry.Key))
		bufs = append(bufs, mcstore.Buffer{Addr: b.hold.Base() + uintptr(off), Len: uint64(size)})
		lb.stored = true
		lb.src = b.hold.Bytes(off, size)
	}
	if len(keys) == 0 {
		return
	}
	ld.store = f
	op, err := cn.c.StartGetInto(keys, bufs)
	if err != nil {
		f.err, f.waited, f.landed = err, true, true
		return
	}
	f.op = op
	b.store.track(op.Done(), func() { f.land(ld.freeStaging) })
}

// storeArrived is nil once block i, read from the store, has landed in its
// staging whole; the layers' checks follow as for any remote block.
func (ld *Load) storeArrived(i, l int) error {
	f := ld.store
	if l > 0 {
		return nil
	}
	if !f.waited {
		f.waited = true
		f.got, f.err = f.op.Wait(ld.ctx)
		ld.m.b.store.observe(firstErr(f.err, f.got, func(g mcstore.Got) error { return g.Err }))
	}
	lb := &ld.blocks[i]
	if f.err != nil {
		return status.Wrap(status.Of(f.err), f.err, fmt.Sprintf("block %s from Mooncake Store", lb.entry.Key))
	}
	for j, bi := range f.blocks {
		if bi != i {
			continue
		}
		g := f.got[j]
		switch {
		case g.Err != nil:
			return status.Wrap(status.Of(g.Err), g.Err, fmt.Sprintf("block %s from Mooncake Store", lb.entry.Key))
		case g.Len != lb.entry.Loc.Length:
			return status.Errorf(status.Corrupt, "block %s: the store holds %d bytes, published as %d", lb.entry.Key, g.Len, lb.entry.Loc.Length)
		}
		ld.m.b.stats.add(&ld.m.b.stats.storeGets, 1)
		return nil
	}
	return status.Errorf(status.Internal, "block %d was not read from the store", i)
}

// releaseStore gives up the load's staging: at once when the call landed,
// else when it does.
func (ld *Load) releaseStore() {
	f := ld.store
	if f == nil {
		return
	}
	ld.store = nil
	f.mu.Lock()
	f.released = true
	landed := f.landed
	f.mu.Unlock()
	if landed {
		ld.freeStaging(f.staging)
	} else {
		ld.m.b.stats.add(&ld.m.b.stats.parkedBatches, 1)
	}
}

func (f *storeFetch) land(free func([]extent)) {
	f.mu.Lock()
	f.landed = true
	released := f.released
	f.mu.Unlock()
	if released {
		free(f.staging)
	}
}
