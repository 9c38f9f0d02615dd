package bridge

import (
	"sync"

	"github.com/mcbridge/mcbridge/internal/kvlayout"
)

// tensorRegs are the host tensors a model's loads land in, registered with
// the transport as local buffers (an RDMA NIC writes only registered
// memory): once, at the first load into them, until the model goes. A host
// that frees its tensors and allocates others where they were gets the new
// ranges registered in place of the old.
type tensorRegs struct {
	mu    sync.Mutex
	spans []tensorSpan
}

type tensorSpan struct{ addr, n uintptr }

func (s tensorSpan) covers(o tensorSpan) bool {
	return s.addr <= o.addr && o.addr+o.n <= s.addr+s.n
}

func (s tensorSpan) overlaps(o tensorSpan) bool {
	return s.addr < o.addr+o.n && o.addr < s.addr+s.n
}

// registerTensors registers every K and V tensor of lo not yet registered.
// An error leaves the load to stage what it reads.
func (m *Model) registerTensors(lo *kvlayout.Layout) error {
	r := &m.tensors
	r.mu.Lock()
	defer r.mu.Unlock()
	loc := lo.Location
	if loc == "" {
		loc = "cpu:0"
	}
	g := &m.geo
	for l, ly := range lo.Layers {
		for _, t := range []tensorSpan{
			{ly.K, uintptr(ly.KStride)*uintptr(lo.Cells-1) + uintptr(g.KRow[l])},
			{ly.V, uintptr(ly.VStride)*uintptr(lo.Cells-1) + uintptr(g.VRow[l])},
		} {
			if r.registered(t) {
				continue
			}
			kept := r.spans[:0]
			for _, s := range r.spans {
				if s.overlaps(t) {
					if err := m.b.tr.UnregisterMemory(s.addr); err != nil {
						return err
					}
					continue
				}
				kept = append(kept, s)
			}
			r.spans = kept
			if err := m.b.tr.RegisterMemory(t.addr, uint64(t.n), loc, false); err != nil {
				return err
			}
			r.spans = append(r.spans, t)
		}
	}
	return nil
}

func (r *tensorRegs) registered(t tensorSpan) bool {
	for _, s := range r.spans {
		if s.covers(t) {
			return true
		}
	}
	return false
}

// unregisterTensors drops the model's registrations, when it goes.
func (m *Model) unregisterTensors() {
	r := &m.tensors
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range r.spans {
		_ = m.b.tr.UnregisterMemory(s.addr)
	}
	r.spans = nil
}
