package proxy

import (
	"context"
	"sync"

	"github.com/mcbridge/mcbridge/internal/status"
)

// slotTable hands out an upstream's slots one request at a time: a slot
// the proxy holds is one it may restore into, compute in and save from
// without another of its requests touching it. It remembers what each slot
// holds (a prefix of it, from the last answer or slot file seen) to send a
// prompt where llama-server's own prompt cache already has the longest
// prefix, and what GET /slots said of the slot then, so that the memory
// counts only while the server confirms it.
type slotTable struct {
	mu      sync.Mutex
	slots   []slotState
	tick    uint64
	changed chan struct{} // closed and replaced whenever a slot is released
	// tasks is, per slot, the last id_task GET /slots showed: task ids only
	// grow while a server runs, so one that shrinks or vanishes is a new
	// process.
	tasks map[int]int
}

type slotState struct {
	held bool
	// saving: held only while the answer's save and publish finish; it
	// frees in moments, so a prompt that shares more with it waits for it.
	saving bool
	contents
	lastUsed uint64
}

// contents is what the proxy knows a slot holds.
type contents struct {
	tokens []int32 // a prefix of what the slot holds; nil when unknown
	// dirty: cells of the slot may hold KV that no key describes (see the
	// package comment); its saves are not published.
	dirty bool
	// sig is what GET /slots said of the slot when tokens were learned;
	// nil when the server never confirmed them.
	sig *slotSig
	// answered is how many tokens the request that left tokens generated
	// after them and left in the cells (all but its last): the server's
	// own decode, as clean as tokens, their ids unknown to the proxy.
	answered int
}

// slotSig is a slot as GET /slots shows it: the last task run in it and
// how many tokens it holds. Any task in the slot, a restore or an erase
// changes one of them.
type slotSig struct {
	task int
	n    int
}

func newSlotTable(n int) *slotTable {
	return &slotTable{slots: make([]slotState, n), changed: make(chan struct{}), tasks: map[int]int{}}
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

// best is the slot acquire would take for tokens (want < 0) and its common
// prefix with them: the free slot sharing the longest prefix, the least
// recently used among equals, or a saving slot sharing more than any free
// one (wait: the caller waits for it); -1 when none is free.
func (t *slotTable) best(want int, tokens []int32) (slot, prefix int, wait bool) {
	best, bestLCP := -1, -1
	for i := range t.slots {
		s := &t.slots[i]
		if (s.held && !s.saving) || (want >= 0 && i != want) {
			continue
		}
		l := lcp(s.tokens, tokens)
		switch {
		case l > bestLCP,
			l == bestLCP && t.slots[best].held && !s.held,
			l == bestLCP && t.slots[best].held == s.held && s.lastUsed < t.slots[best].lastUsed:
			best, bestLCP = i, l
		}
	}
	if best >= 0 && t.slots[best].held {
		return best, bestLCP, true
	}
	return best, bestLCP, false
}

// acquire waits until a slot is free and holds it: the given slot when
// want >= 0, else the free slot sharing the longest prefix with tokens
// (the least recently used among equals), or the saving slot sharing more
// once its save is done. It returns the slot and that prefix length.
func (t *slotTable) acquire(ctx context.Context, want int, tokens []int32) (int, int, error) {
	if want >= len(t.slots) {
		return 0, 0, status.Errorf(status.InvalidArg, "slot %d of %d", want, len(t.slots))
	}
	for {
		t.mu.Lock()
		best, bestLCP, saving := t.best(want, tokens)
		if best >= 0 && !saving {
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

// peek is how much of tokens the slot a request would get holds: the slot
// acquire would take now, or with every slot held the longest prefix any
// holds (the request waits for a slot; which one frees is not known).
func (t *slotTable) peek(tokens []int32) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	if i, l, _ := t.best(-1, tokens); i >= 0 {
		return l
	}
	n := 0
	for i := range t.slots {
		n = max(n, lcp(t.slots[i].tokens, tokens))
	}
	return n
}

// markSaving says that held slot id only finishes its save now, with c
// what it holds meanwhile.
func (t *slotTable) markSaving(id int, c contents) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.slots[id].saving, t.slots[id].contents = true, c
}

// release frees a held slot, recording what it now holds.
func (t *slotTable) release(id int, c contents) {
	t.mu.Lock()
	s := &t.slots[id]
	s.held, s.saving, s.contents = false, false, c
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
				t.release(h, t.view(h).contents)
			}
			return err
		}
		held = append(held, i)
	}
	return nil
}

// releaseAll frees every slot held by holdAll; what they hold is unknown.
func (t *slotTable) releaseAll() {
	for i := 0; i < t.len(); i++ {
		t.release(i, contents{})
	}
}

// forgetAll drops what the table knows of every slot and of the server's
// tasks: the server is a new process.
func (t *slotTable) forgetAll() {
	t.mu.Lock()
	defer t.mu.Unlock()
	for i := range t.slots {
		t.slots[i].contents = contents{}
	}
	t.tasks = map[int]int{}
}

// view is what the table knows about a slot.
func (t *slotTable) view(id int) slotState {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.slots[id]
}

// checkTasks spots a restarted server: its slots forget their last task,
// or number tasks from zero again. It records the tasks it saw.
func (t *slotTable) checkTasks(infos []slotInfo) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, in := range infos {
		prev, seen := t.tasks[in.ID]
		if seen && (in.IDTask == nil || *in.IDTask < prev) {
			return status.Errorf(status.ModelMismatch, "slot %d forgot its last task: the upstream restarted", in.ID)
		}
	}
	for _, in := range infos {
		if in.IDTask != nil {
			t.tasks[in.ID] = *in.IDTask
		}
	}
	return nil
}

// sigOf is what infos say of slot id; nil when they do not say.
func sigOf(infos []slotInfo, id int) *slotSig {
	for _, in := range infos {
		if in.ID == id && in.IDTask != nil {
			return &slotSig{task: *in.IDTask, n: in.NPromptTokens}
		}
	}
	return nil
}
