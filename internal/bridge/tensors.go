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

// tensorSpans are the memory of lo's K and V tensors.
func (m *Model) tensorSpans(lo *kvlayout.Layout) []tensorSpan {
	g := &m.geo
	out := make([]tensorSpan, 0, 2*len(lo.Layers))
	for l, ly := range lo.Layers {
		out = append(out, tensorSpan{ly.K, uintptr(ly.KStride)*uintptr(lo.Cells-1) + uintptr(g.KRow[l])})
		if g.VRow[l] > 0 { // a K-only model's layers have no V tensor
			out = append(out, tensorSpan{ly.V, uintptr(ly.VStride)*uintptr(lo.Cells-1) + uintptr(g.VRow[l])})
		}
	}
	return out
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
	for _, t := range m.tensorSpans(lo) {
		if r.registered(t) {
			continue
		}
		if err := m.dropOverlapsLocked(t); err != nil {
			return err
		}
		if err := m.b.tr.RegisterMemory(t.addr, uint64(t.n), loc, false); err != nil {
			return err
		}
		r.spans = append(r.spans, t)
	}
	return nil
}

// UnregisterTensors drops the registrations of lo's tensors, memory the
// host is about to free: a state blob's rows live for one restore, and a
// registration outliving them would hold the engine to memory that the
// process reuses (an RDMA engine pins it).
func (m *Model) UnregisterTensors(lo *kvlayout.Layout) {
	r := &m.tensors
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, t := range m.tensorSpans(lo) {
		_ = m.dropOverlapsLocked(t)
	}
}

// dropOverlapsLocked unregisters every span that overlaps t.
func (m *Model) dropOverlapsLocked(t tensorSpan) error {
	r := &m.tensors
	kept := r.spans[:0]
	var err error
	for _, s := range r.spans {
		if err == nil && s.overlaps(t) {
			if err = m.b.tr.UnregisterMemory(s.addr); err == nil {
				continue
			}
		}
		kept = append(kept, s)
	}
	r.spans = kept
	return err
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
