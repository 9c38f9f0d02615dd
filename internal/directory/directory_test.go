package directory_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

var (
	modelA = key.Fingerprint{0xa}
	modelB = key.Fingerprint{0xb}
)

func entry(model key.Fingerprint, i byte, owner string) directory.Entry {
	return directory.Entry{
		Model:  model,
		Key:    key.BlockKey{15: i + 1},
		Parent: key.Hash{15: i},
		Loc:    directory.Location{Segment: "seg-" + owner, Addr: uint64(i) << 12, Length: 4096, Checksum: uint64(i) * 31, Generation: 1, Owner: owner},
	}
}

func entries(model key.Fingerprint, from, to byte, owner string) []directory.Entry {
	var out []directory.Entry
	for i := from; i < to; i++ {
		out = append(out, entry(model, i, owner))
	}
	return out
}

// open returns a handle on a memory directory private to the test.
func open(t *testing.T) *directory.Memory {
	t.Helper()
	m := directory.OpenMemory(t.Name())
	t.Cleanup(func() { _ = m.Close() })
	return m
}

func TestMemoryPublishDedupes(t *testing.T) {
	a, b := open(t), open(t)
	ctx := context.Background()
	got, err := a.Publish(ctx, entries(modelA, 0, 3, "a"))
	require.NoError(t, err, "first publisher")
	require.Equal(t, []bool{true, true, true}, got, "first publisher")
	both := append(entries(modelA, 1, 5, "b"), entry(modelA, 4, "b2"), entry(modelB, 1, "b"))
	got, err = b.Publish(ctx, both)
	require.NoError(t, err, "second publisher")
	require.Equal(t, []bool{false, false, true, true, false, true}, got, "second publisher")
}

// A retried publish of entries the directory already holds exactly as
// offered reports them held; another owner's copy does not.
func TestMemoryPublishRetryOfHeldEntries(t *testing.T) {
	a := open(t)
	ctx := context.Background()
	es := entries(modelA, 0, 3, "a")
	_, err := a.Publish(ctx, es)
	require.NoError(t, err)
	got, err := a.Publish(ctx, es)
	require.NoError(t, err)
	require.Equal(t, []bool{true, true, true}, got, "the same entries again")
	got, err = a.Publish(ctx, entries(modelA, 0, 3, "b"))
	require.NoError(t, err)
	require.Equal(t, []bool{false, false, false}, got, "another owner's copy")
}

func TestMemoryPublishConcurrentStoresOnce(t *testing.T) {
	const publishers, n = 4, 64
	m := open(t)
	var puts sync.Map
	cancel, err := m.Subscribe(modelA, func(ev directory.Event) {
		_, dup := puts.LoadOrStore(ev.Entry.Key, ev.Entry.Loc.Owner)
		assert.False(t, dup, "second Put of %s", ev.Entry.Key)
	})
	require.NoError(t, err)
	defer cancel()
	results := make([][]bool, publishers)
	var wg sync.WaitGroup
	for p := range publishers {
		wg.Go(func() {
			h := open(t)
			results[p], _ = h.Publish(context.Background(), entries(modelA, 0, n, fmt.Sprint("p", p)))
		})
	}
	wg.Wait()
	for i := range n {
		winners := 0
		for p := range publishers {
			if results[p][i] {
				winners++
				owner, _ := puts.Load(key.BlockKey{15: byte(i) + 1})
				assert.Equal(t, fmt.Sprint("p", p), owner, "block %d: publisher p%d won, subscriber saw another", i, p)
			}
		}
		assert.Equal(t, 1, winners, "block %d stored more or less than once", i)
	}
}

func TestMemoryUnpublishOnlyOwnEntries(t *testing.T) {
	m := open(t)
	ctx := context.Background()
	_, err := m.Publish(ctx, append(entries(modelA, 0, 3, "a"), entries(modelA, 3, 5, "b")...))
	require.NoError(t, err)
	all := []key.BlockKey{}
	for _, e := range entries(modelA, 0, 5, "") {
		all = append(all, e.Key)
	}
	steps := []struct {
		owner string
		model key.Fingerprint
		keys  []key.BlockKey
		left  []bool // whether block i is still held, found by publishing it again
	}{
		{"b", modelB, all, []bool{true, true, true, true, true}},
		{"c", modelA, all, []bool{true, true, true, true, true}},
		{"a", modelA, all[:2], []bool{false, false, true, true, true}},
		{"b", modelA, all, []bool{false, false, true, false, false}},
	}
	for si, s := range steps {
		require.NoError(t, m.Unpublish(ctx, s.owner, s.model, s.keys))
		// A publish succeeds exactly where the block is gone; undo it.
		got, err := m.Publish(ctx, entries(modelA, 0, 5, "probe"))
		require.NoError(t, err)
		var left []bool
		var probes []key.BlockKey
		for i, stored := range got {
			left = append(left, !stored)
			if stored {
				probes = append(probes, all[i])
			}
		}
		require.Equal(t, s.left, left, "step %d: blocks held", si)
		require.NoError(t, m.Unpublish(ctx, "probe", modelA, probes))
	}
}

func TestMemorySubscribeSnapshotThenEvents(t *testing.T) {
	a, b := open(t), open(t)
	ctx := context.Background()
	_, err := a.Publish(ctx, entries(modelA, 0, 2, "a"))
	require.NoError(t, err)
	var mu sync.Mutex
	var got []directory.Event
	cancel, err := b.Subscribe(modelA, func(ev directory.Event) {
		mu.Lock()
		got = append(got, ev)
		mu.Unlock()
	})
	require.NoError(t, err)
	// The snapshot is delivered before Subscribe returns, in no set order.
	mu.Lock()
	snap := slices.Clone(got)
	mu.Unlock()
	slices.SortFunc(snap, func(x, y directory.Event) int { return int(x.Entry.Key[15]) - int(y.Entry.Key[15]) })
	want := []directory.Event{{Kind: directory.Put, Entry: entry(modelA, 0, "a")}, {Kind: directory.Put, Entry: entry(modelA, 1, "a")}}
	require.Equal(t, want, snap, "snapshot")
	steps := []func() error{
		func() error { _, err := a.Publish(ctx, entries(modelA, 2, 4, "a")); return err },
		func() error { _, err := a.Publish(ctx, entries(modelB, 0, 1, "a")); return err },
		func() error { return a.Unpublish(ctx, "a", modelA, []key.BlockKey{entry(modelA, 0, "").Key}) },
		func() error { _, err := b.Publish(ctx, entries(modelA, 0, 1, "b")); return err },
	}
	for _, step := range steps {
		require.NoError(t, step())
	}
	want = append(want,
		directory.Event{Kind: directory.Put, Entry: entry(modelA, 2, "a")},
		directory.Event{Kind: directory.Put, Entry: entry(modelA, 3, "a")},
		directory.Event{Kind: directory.Delete, Entry: entry(modelA, 0, "a")},
		directory.Event{Kind: directory.Put, Entry: entry(modelA, 0, "b")},
	)
	cancel()
	cancel()
	_, err = a.Publish(ctx, entries(modelA, 9, 10, "a"))
	require.NoError(t, err)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, want[2:], got[2:], "events")
}

func TestMemoryLifecycle(t *testing.T) {
	ctx := context.Background()
	a := directory.OpenMemory(t.Name())
	b := directory.OpenMemory(t.Name())
	other := directory.OpenMemory(t.Name() + "/other")
	defer other.Close()
	_, err := a.Publish(ctx, entries(modelA, 0, 1, "a"))
	require.NoError(t, err)
	got, _ := other.Publish(ctx, entries(modelA, 0, 1, "o"))
	require.True(t, got[0], "directories of different names share entries")
	require.NoError(t, a.Close())
	for _, err := range []error{
		a.Close(),
		a.Unpublish(ctx, "a", modelA, nil),
		func() error { _, err := a.Publish(ctx, nil); return err }(),
		func() error { _, err := a.Subscribe(modelA, func(directory.Event) {}); return err }(),
	} {
		assert.Equal(t, status.State, status.Of(err), "after Close: %v", err)
	}
	// b still holds the name: the entry lives.
	got, _ = b.Publish(ctx, entries(modelA, 0, 1, "b"))
	require.False(t, got[0], "entry gone while a handle remains")
	require.NoError(t, b.Close())
	// The last close forgot everything.
	c := open(t)
	got, _ = c.Publish(ctx, entries(modelA, 0, 1, "c"))
	require.True(t, got[0], "entry outlived every handle")
	done, cancel := context.WithCancel(ctx)
	cancel()
	_, err = c.Publish(done, entries(modelA, 1, 2, "c"))
	assert.Equal(t, status.Timeout, status.Of(err), "Publish with a done context: %v", err)
	err = c.Unpublish(done, "c", modelA, nil)
	assert.Equal(t, status.Timeout, status.Of(err), "Unpublish with a done context: %v", err)
}
