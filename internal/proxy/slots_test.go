package proxy

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestAcquirePrefersTheLongestCachedPrefix(t *testing.T) {
	tab := newSlotTable(3)
	ctx := context.Background()
	// Fill the slots with known contents, oldest first.
	for i, toks := range [][]int32{{1, 2, 3}, {1, 2, 9}, {7}} {
		id, _, err := tab.acquire(ctx, i, nil)
		require.NoError(t, err)
		require.Equal(t, i, id)
		tab.release(id, contents{tokens: toks})
	}
	tests := []struct {
		prompt []int32
		slot   int
		lcp    int
	}{
		{[]int32{1, 2, 3, 4}, 0, 3},
		{[]int32{1, 2, 9, 9}, 1, 3},
		{[]int32{7, 7}, 2, 1},
		{[]int32{1, 2}, 0, 2}, // a tie goes to the least recently used
		{[]int32{5}, 1, 0},    // no match: the least recently used (slot 0 just was)
	}
	for _, tc := range tests {
		id, l, err := tab.acquire(ctx, -1, tc.prompt)
		require.NoError(t, err, "prompt %v", tc.prompt)
		require.Equal(t, tc.slot, id, "prompt %v: slot", tc.prompt)
		require.Equal(t, tc.lcp, l, "prompt %v: lcp", tc.prompt)
		tab.release(id, tab.view(id).contents)
	}
}

func TestAcquireWaitsForARelease(t *testing.T) {
	tab := newSlotTable(1)
	ctx := context.Background()
	_, _, err := tab.acquire(ctx, -1, nil)
	require.NoError(t, err)
	got := make(chan int)
	go func() {
		id, _, err := tab.acquire(ctx, 0, nil)
		if err != nil {
			id = -1
		}
		got <- id
	}()
	select {
	case id := <-got:
		require.Fail(t, "acquired a held slot", "slot %d", id)
	case <-time.After(10 * time.Millisecond):
	}
	tab.release(0, contents{tokens: []int32{4}, dirty: true})
	require.Equal(t, 0, <-got, "acquired")
	v := tab.view(0)
	require.True(t, v.held, "view %+v", v)
	require.True(t, v.dirty, "view %+v", v)
	require.Len(t, v.tokens, 1, "view %+v", v)
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	_, _, err = tab.acquire(cctx, 0, nil)
	require.Error(t, err, "acquired with a cancelled context")
	_, _, err = tab.acquire(ctx, 5, nil)
	require.Error(t, err, "acquired a slot that does not exist")
}

func TestHoldAll(t *testing.T) {
	tab := newSlotTable(3)
	ctx := context.Background()
	_, _, err := tab.acquire(ctx, 1, nil)
	require.NoError(t, err)
	done := make(chan error)
	go func() { done <- tab.holdAll(ctx) }()
	select {
	case err := <-done:
		require.Fail(t, "held every slot while one was taken", "%v", err)
	case <-time.After(10 * time.Millisecond):
	}
	tab.release(1, contents{})
	require.NoError(t, <-done)
	for i := 0; i < 3; i++ {
		require.True(t, tab.view(i).held, "slot %d not held", i)
	}
	cctx, cancel := context.WithTimeout(ctx, time.Millisecond)
	defer cancel()
	require.Error(t, tab.holdAll(cctx), "held slots held by another")
}

func TestNextDirty(t *testing.T) {
	with := func(c int) *exchange {
		return &exchange{haveAns: true, ans: answer{Timings: &timings{CacheN: c}}}
	}
	known := contents{tokens: []int32{1, 2, 3, 4}}
	dirtyKnown := contents{tokens: []int32{1, 2, 3, 4}, dirty: true}
	prompt := []int32{1, 2, 3, 9, 9}
	answeredKnown := contents{tokens: []int32{1, 2, 3, 4}, sig: &slotSig{task: 7, n: 4}, answered: 2}
	turn := []int32{1, 2, 3, 4, 5, 6, 8}
	tests := []struct {
		name     string
		before   contents
		prompt   []int32
		reqDirty bool
		x        *exchange
		want     bool
	}{
		{"computed from zero", dirtyKnown, prompt, false, with(0), false},
		{"reused known clean cells", known, prompt, false, with(3), false},
		{"reused known dirty cells", dirtyKnown, prompt, false, with(2), true},
		{"reused more than known", known, prompt, false, with(4), true},
		{"reused unknown cells", contents{}, prompt, false, with(1), true},
		{"no prompt tokens", known, nil, false, with(1), true},
		{"dirty request", known, prompt, true, with(0), true},
		{"no timings", known, prompt, false, &exchange{}, true},
		// The next turn sends the last answer back: the server reuses it.
		{"reused its own confirmed answer", answeredKnown, turn, false, with(6), false},
		{"reused past its own answer", answeredKnown, turn, false, with(7), true},
		{"reused an unconfirmed answer", contents{tokens: known.tokens, answered: 2}, turn, false, with(6), true},
		{"another prompt after the answer", answeredKnown, prompt, false, with(4), true},
	}
	for _, tc := range tests {
		assert.Equal(t, tc.want, nextDirty(tc.before, tc.prompt, tc.reqDirty, tc.x), "%s: dirty", tc.name)
	}
}

// A slot finishing its save frees in moments: a prompt sharing more with
// it than with any free slot waits for it instead of restoring elsewhere.
func TestAcquireWaitsForASavingSlotWithMore(t *testing.T) {
	tab := newSlotTable(2)
	ctx := context.Background()
	id, _, err := tab.acquire(ctx, 0, nil)
	require.NoError(t, err)
	tab.markSaving(id, contents{tokens: []int32{1, 2, 3}})
	assert.Equal(t, 3, tab.peek([]int32{1, 2, 3, 4}), "the router counts on the saving slot's prefix")

	got := make(chan int)
	go func() {
		id, _, _ := tab.acquire(ctx, -1, []int32{1, 2, 3, 4})
		got <- id
	}()
	select {
	case id := <-got:
		require.FailNow(t, "took a slot while the one sharing more was saving", "slot %d", id)
	case <-time.After(10 * time.Millisecond):
	}
	tab.release(0, contents{tokens: []int32{1, 2, 3, 9}})
	assert.Equal(t, 0, <-got)

	// A prompt sharing nothing more with the saving slot takes a free one.
	tab.markSaving(0, contents{tokens: []int32{1, 2, 3}})
	id, l, err := tab.acquire(ctx, -1, []int32{7})
	require.NoError(t, err)
	assert.Equal(t, []int{1, 0}, []int{id, l})
}
