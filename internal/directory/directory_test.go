package directory_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"

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
	if err != nil || !slices.Equal(got, []bool{true, true, true}) {
		t.Fatalf("first publisher: %v, %v", got, err)
	}
	both := append(entries(modelA, 1, 5, "b"), entry(modelA, 4, "b2"), entry(modelB, 1, "b"))
	got, err = b.Publish(ctx, both)
	if want := []bool{false, false, true, true, false, true}; err != nil || !slices.Equal(got, want) {
		t.Fatalf("second publisher: %v, %v; want %v", got, err, want)
	}
}

func TestMemoryPublishConcurrentStoresOnce(t *testing.T) {
	const publishers, n = 4, 64
	m := open(t)
	var puts sync.Map
	cancel, err := m.Subscribe(modelA, func(ev directory.Event) {
		if _, dup := puts.LoadOrStore(ev.Entry.Key, ev.Entry.Loc.Owner); dup {
			t.Errorf("second Put of %s", ev.Entry.Key)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
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
				if owner, _ := puts.Load(key.BlockKey{15: byte(i) + 1}); owner != fmt.Sprint("p", p) {
					t.Errorf("block %d: publisher p%d won, subscriber saw %v", i, p, owner)
				}
			}
		}
		if winners != 1 {
			t.Errorf("block %d stored %d times", i, winners)
		}
	}
}

func TestMemoryUnpublishOnlyOwnEntries(t *testing.T) {
	m := open(t)
	ctx := context.Background()
	if _, err := m.Publish(ctx, append(entries(modelA, 0, 3, "a"), entries(modelA, 3, 5, "b")...)); err != nil {
		t.Fatal(err)
	}
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
		if err := m.Unpublish(ctx, s.owner, s.model, s.keys); err != nil {
			t.Fatal(err)
		}
		// A publish succeeds exactly where the block is gone; undo it.
		got, err := m.Publish(ctx, entries(modelA, 0, 5, "probe"))
		if err != nil {
			t.Fatal(err)
		}
		var left []bool
		var probes []key.BlockKey
		for i, stored := range got {
			left = append(left, !stored)
			if stored {
				probes = append(probes, all[i])
			}
		}
		if !slices.Equal(left, s.left) {
			t.Fatalf("step %d: held %v, want %v", si, left, s.left)
		}
		if err := m.Unpublish(ctx, "probe", modelA, probes); err != nil {
			t.Fatal(err)
		}
	}
}

func TestMemorySubscribeSnapshotThenEvents(t *testing.T) {
	a, b := open(t), open(t)
	ctx := context.Background()
	if _, err := a.Publish(ctx, entries(modelA, 0, 2, "a")); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var got []directory.Event
	cancel, err := b.Subscribe(modelA, func(ev directory.Event) {
		mu.Lock()
		got = append(got, ev)
		mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	// The snapshot is delivered before Subscribe returns, in no set order.
	mu.Lock()
	snap := slices.Clone(got)
	mu.Unlock()
	slices.SortFunc(snap, func(x, y directory.Event) int { return int(x.Entry.Key[15]) - int(y.Entry.Key[15]) })
	want := []directory.Event{{Kind: directory.Put, Entry: entry(modelA, 0, "a")}, {Kind: directory.Put, Entry: entry(modelA, 1, "a")}}
	if !slices.Equal(snap, want) {
		t.Fatalf("snapshot %v, want %v", snap, want)
	}
	steps := []func() error{
		func() error { _, err := a.Publish(ctx, entries(modelA, 2, 4, "a")); return err },
		func() error { _, err := a.Publish(ctx, entries(modelB, 0, 1, "a")); return err },
		func() error { return a.Unpublish(ctx, "a", modelA, []key.BlockKey{entry(modelA, 0, "").Key}) },
		func() error { _, err := b.Publish(ctx, entries(modelA, 0, 1, "b")); return err },
	}
	for _, step := range steps {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	want = append(want,
		directory.Event{Kind: directory.Put, Entry: entry(modelA, 2, "a")},
		directory.Event{Kind: directory.Put, Entry: entry(modelA, 3, "a")},
		directory.Event{Kind: directory.Delete, Entry: entry(modelA, 0, "a")},
		directory.Event{Kind: directory.Put, Entry: entry(modelA, 0, "b")},
	)
	cancel()
	cancel()
	if _, err := a.Publish(ctx, entries(modelA, 9, 10, "a")); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(got[2:], want[2:]) {
		t.Fatalf("events %v, want %v", got[2:], want[2:])
	}
}

func TestMemoryLifecycle(t *testing.T) {
	ctx := context.Background()
	a := directory.OpenMemory(t.Name())
	b := directory.OpenMemory(t.Name())
	other := directory.OpenMemory(t.Name() + "/other")
	defer other.Close()
	if _, err := a.Publish(ctx, entries(modelA, 0, 1, "a")); err != nil {
		t.Fatal(err)
	}
	if got, _ := other.Publish(ctx, entries(modelA, 0, 1, "o")); !got[0] {
		t.Fatal("directories of different names share entries")
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	for _, err := range []error{
		a.Close(),
		a.Unpublish(ctx, "a", modelA, nil),
		func() error { _, err := a.Publish(ctx, nil); return err }(),
		func() error { _, err := a.Subscribe(modelA, func(directory.Event) {}); return err }(),
	} {
		if status.Of(err) != status.State {
			t.Errorf("after Close: %v, want %v", err, status.State)
		}
	}
	// b still holds the name: the entry lives.
	if got, _ := b.Publish(ctx, entries(modelA, 0, 1, "b")); got[0] {
		t.Fatal("entry gone while a handle remains")
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	// The last close forgot everything.
	c := open(t)
	if got, _ := c.Publish(ctx, entries(modelA, 0, 1, "c")); !got[0] {
		t.Fatal("entry outlived every handle")
	}
	done, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := c.Publish(done, entries(modelA, 1, 2, "c")); status.Of(err) != status.Timeout {
		t.Errorf("Publish with a done context: %v", err)
	}
	if err := c.Unpublish(done, "c", modelA, nil); status.Of(err) != status.Timeout {
		t.Errorf("Unpublish with a done context: %v", err)
	}
}
