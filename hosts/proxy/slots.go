package proxy

import (
	"context"
	"sync"

	"github.com/mcbridge/mcbridge/internal/status"
)

// slotTable hands out the upstream's slots one request at a time: a slot
// the proxy holds is one it may restore into, compute in and save from
// without another of its requests touching it. It remembers what each slot
// holds (a prefix of it, from the last slot file seen) to send a prompt
// where llama-server's own prompt cache already has the longest prefix.
type slotTable struct {
	mu      sync.Mutex
	slots   []slotState
	tick    uint64
	changed chan struct{} // closed and replaced whenever a slot is released
}

type slotState struct {
	held   bool
	tokens []int32 // a prefix of what the slot holds; nil when unknown
	// dirty: cells of the slot may hold KV that no key describes (see the
	// package comment); its saves are not published.
	dirty    bool
	lastUsed uint64
}

func newSlotTable(n int) *slotTable {
	return &slotTable{slots: make([]slotState, n), changed: make(chan struct{})}
}

func (t *slotTable) len() int { return len(t.slots) }

// lcp is the length of the common prefix of a and b.
func lcp(a, b []int32) int {
	n := min(len(a), len(b))
	for i := 0; i < n; i++ {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// acquire waits until a slot is free and holds it: the given slot when
// want >= 0, else the free slot sharing the longest prefix with tokens
// (the least recently used among equals). It returns the slot and that
// prefix length.
func (t *slotTable) acquire(ctx context.Context, want int, tokens []int32) (int, int, error) {
	if want >= len(t.slots) {
		return 0, 0, status.Errorf(status.InvalidArg, "slot %d of %d", want, len(t.slots))
	}
	for {
		t.mu.Lock()
		best, bestLCP := -1, -1
		for i := range t.slots {
			s := &t.slots[i]
			if s.held || (want >= 0 && i != want) {
				continue
			}
			l := lcp(s.tokens, tokens)
			if l > bestLCP || (l == bestLCP && s.lastUsed < t.slots[best].lastUsed) {
				best, bestLCP = i, l
			}
		}
		if best >= 0 {
			t.tick++
			t.slots[best].held = true
			t.slots[best].lastUsed = t.tick
			t.mu.Unlock()
			return best, bestLCP, nil
		}
		wait := t.changed
		t.mu.Unlock()
		select {
		case <-wait:
		case <-ctx.Done():
			return 0, 0, ctx.Err()
		}
	}
}

// release frees a held slot, recording what it now holds (nil: unknown)
// and whether that may be unclean.
func (t *slotTable) release(id int, tokens []int32, dirty bool) {
	t.mu.Lock()
	s := &t.slots[id]
	s.held, s.tokens, s.dirty = false, tokens, dirty
	close(t.changed)
	t.changed = make(chan struct{})
	t.mu.Unlock()
}

// holdAll waits until every slot is free and holds them all, for requests
// that may use several slots at once.
func (t *slotTable) holdAll(ctx context.Context) error {
	var held []int
	for i := range t.slots {
		if _, _, err := t.acquire(ctx, i, nil); err != nil {
			for _, h := range held {
				v := t.view(h)
				t.release(h, v.tokens, v.dirty)
			}
			return err
		}
		held = append(held, i)
	}
	return nil
}

// view is what the table knows about a slot.
func (t *slotTable) view(id int) slotState {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.slots[id]
}
