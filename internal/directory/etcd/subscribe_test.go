package etcd

import (
	"bytes"
	"context"
	"slices"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/key"
)

// A second client sees the snapshot, then every change in the order it
// happened; Deletes carry the entry as published.
func TestSubscribeSnapshotThenEventsInOrder(t *testing.T) {
	srv := etcdtest.Start(t)
	a := openDir(t, srv, nil)
	b := openDir(t, srv, nil)
	publish(t, a, testEntries(modelA, 0, 5, "a"))
	publish(t, a, testEntries(modelB, 0, 3, "a"))

	c := subscribe(t, b, modelA)
	snap := c.waitFor(t, 5)
	var want []directory.Event
	for _, e := range testEntries(modelA, 0, 5, "a") {
		want = append(want, directory.Event{Kind: directory.Put, Entry: e})
	}
	// The snapshot comes in key order.
	slices.SortFunc(want, func(x, y directory.Event) int { return bytes.Compare(x.Entry.Key[:], y.Entry.Key[:]) })
	if !slices.Equal(snap, want) {
		t.Fatalf("snapshot:\n%v\nwant\n%v", snap, want)
	}

	ctx := context.Background()
	publish(t, a, testEntries(modelA, 5, 8, "a"))
	if err := a.Unpublish(ctx, "a", modelA, keysOf(testEntries(modelA, 1, 3, ""))); err != nil {
		t.Fatal(err)
	}
	publish(t, b, testEntries(modelA, 1, 2, "b"))
	publish(t, a, testEntries(modelB, 3, 6, "a")) // another model: not delivered
	for _, e := range testEntries(modelA, 5, 8, "a") {
		want = append(want, directory.Event{Kind: directory.Put, Entry: e})
	}
	for _, e := range testEntries(modelA, 1, 3, "a") {
		want = append(want, directory.Event{Kind: directory.Delete, Entry: e})
	}
	want = append(want, directory.Event{Kind: directory.Put, Entry: testEntry(modelA, 1, "b")})
	got := c.waitFor(t, len(want))
	if !slices.Equal(got, want) {
		for i := range got {
			t.Logf("%d: %s", i, eventString(got[i]))
		}
		t.Fatalf("got %d events, want %d as listed in the test", len(got), len(want))
	}
	// A publish that changes nothing delivers nothing: the next event seen
	// is the one after it.
	publish(t, b, testEntries(modelA, 0, 1, "b"))
	publish(t, b, testEntries(modelA, 9, 10, "b"))
	got = c.waitFor(t, len(want)+1)
	if len(got) != len(want)+1 || got[len(want)].Entry != testEntry(modelA, 9, "b") {
		t.Fatalf("after a refused publish got %s", eventString(got[len(got)-1]))
	}
}

// A snapshot larger than a page arrives whole and consistent.
func TestSubscribeLargeSnapshot(t *testing.T) {
	const n = 20000
	srv := etcdtest.Start(t)
	a := openDir(t, srv, nil)
	b := openDir(t, srv, nil)
	publishAll(t, a, testEntries(modelA, 0, n, "a"))
	c := subscribe(t, b, modelA)
	got := c.waitFor(t, n)
	seen := make(map[key.BlockKey]bool, n)
	for _, ev := range got {
		if ev.Kind != directory.Put || seen[ev.Entry.Key] {
			t.Fatalf("unexpected %s", eventString(ev))
		}
		seen[ev.Entry.Key] = true
	}
	for i, e := range testEntries(modelA, 0, n, "a") {
		if !seen[e.Key] {
			t.Fatalf("block %d missing from the snapshot", i)
		}
	}
	// Live events follow the snapshot.
	publish(t, a, testEntries(modelA, n, n+1, "a"))
	if got := c.waitFor(t, n+1); got[n].Entry != testEntry(modelA, n, "a") {
		t.Fatalf("after the snapshot got %s", eventString(got[n]))
	}
}

// A watch whose revision was compacted away re-reads the snapshot and
// delivers only the difference: Puts for keys that appeared, Deletes for
// keys that vanished.
func TestSubscribeResyncsAfterCompaction(t *testing.T) {
	srv := etcdtest.Start(t)
	a := openDir(t, srv, nil)
	b := openDir(t, srv, nil)
	publish(t, a, testEntries(modelA, 0, 10, "a"))

	c := newCollector()
	s := b.newSubscription(modelA, c.add)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := s.sync(ctx); err != nil {
		t.Fatal(err)
	}
	if c.len() != 10 {
		t.Fatalf("snapshot of %d events, want 10", c.len())
	}
	// While the subscription is not watching: changes, then compaction past
	// them, so that the watch cannot replay them.
	publish(t, a, testEntries(modelA, 10, 15, "a"))
	if err := a.Unpublish(ctx, "a", modelA, keysOf(testEntries(modelA, 0, 3, ""))); err != nil {
		t.Fatal(err)
	}
	resp, err := srv.Client().Get(ctx, "any")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := srv.Client().Compact(ctx, resp.Header.Revision); err != nil {
		t.Fatal(err)
	}
	go s.run(ctx)
	defer func() { cancel(); <-s.done }()

	got := c.waitFor(t, 18)[10:]
	puts, deletes := map[key.BlockKey]directory.Entry{}, map[key.BlockKey]bool{}
	for _, ev := range got {
		if ev.Kind == directory.Put {
			puts[ev.Entry.Key] = ev.Entry
		} else {
			deletes[ev.Entry.Key] = true
		}
	}
	for _, e := range testEntries(modelA, 10, 15, "a") {
		if puts[e.Key] != e {
			t.Errorf("resync: no Put of %s", e.Key)
		}
	}
	for _, e := range testEntries(modelA, 0, 3, "a") {
		if !deletes[e.Key] {
			t.Errorf("resync: no Delete of %s", e.Key)
		}
	}
	if len(puts) != 5 || len(deletes) != 3 {
		t.Fatalf("resync delivered %d Puts and %d Deletes, want 5 and 3", len(puts), len(deletes))
	}
	// The watch resumes after the resync.
	publish(t, a, testEntries(modelA, 20, 21, "a"))
	if got := c.waitFor(t, 19); got[18].Entry != testEntry(modelA, 20, "a") {
		t.Fatalf("after resync got %s", eventString(got[18]))
	}
}

// A subscription outlives an etcd restart and sees what is published after.
func TestSubscribeSurvivesRestart(t *testing.T) {
	srv := etcdtest.Start(t)
	a := openDir(t, srv, nil)
	b := openDir(t, srv, nil)
	publish(t, a, testEntries(modelA, 0, 2, "a"))
	c := subscribe(t, b, modelA)
	c.waitFor(t, 2)
	srv.Stop()
	srv.Restart()
	publish(t, a, testEntries(modelA, 2, 3, "a"))
	if got := c.waitFor(t, 3); got[2].Entry != testEntry(modelA, 2, "a") {
		t.Fatalf("after restart got %s", eventString(got[2]))
	}
}

func TestSubscribeCancelStopsDelivery(t *testing.T) {
	srv := etcdtest.Start(t)
	a := openDir(t, srv, nil)
	b := openDir(t, srv, nil)
	c := newCollector()
	cancel, err := b.Subscribe(modelA, c.add)
	if err != nil {
		t.Fatal(err)
	}
	publish(t, a, testEntries(modelA, 0, 1, "a"))
	c.waitFor(t, 1)
	cancel()
	cancel() // a second cancel is harmless
	// Events after cancel are not delivered; a fresh subscription, which
	// does see them, bounds the wait.
	publish(t, a, testEntries(modelA, 1, 2, "a"))
	subscribe(t, b, modelA).waitFor(t, 2)
	if n := c.len(); n != 1 {
		t.Fatalf("%d events after cancel, want 1", n)
	}
}

func TestBucketRangesCoverInOrder(t *testing.T) {
	prefix := modelPrefix(DefaultPrefix, modelA)
	end := clientv3.GetPrefixRangeEnd(prefix)
	cases := []struct {
		name    string
		from    string
		n       int64
		buckets int
	}{
		{"small", prefix, 3 * snapshotPage, 16},
		{"20k from a first page", prefix + "0a3f", 20000, 16},
		{"1e6", prefix, 1000000, 256},
		{"1e6 from the middle", prefix + "80", 1000000, 128},
		{"capped at 4 digits", prefix, 1 << 40, 65536},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := bucketRanges(prefix, tc.from, end, tc.n)
			if len(got) != tc.buckets {
				t.Fatalf("%d ranges, want %d", len(got), tc.buckets)
			}
			if got[0][0] != tc.from || got[len(got)-1][1] != end {
				t.Fatalf("ranges span [%q, %q), want [%q, %q)", got[0][0], got[len(got)-1][1], tc.from, end)
			}
			for i, r := range got {
				if r[0] >= r[1] || (i > 0 && got[i-1][1] != r[0]) {
					t.Fatalf("range %d [%q, %q) does not follow [%q, %q)", i, r[0], r[1], got[max(i-1, 0)][0], got[max(i-1, 0)][1])
				}
			}
		})
	}
}

// A store node watches every model: it sees each model's snapshot and
// changes with the model named on every event.
func TestSubscribeAll(t *testing.T) {
	srv := etcdtest.Start(t)
	pub := openDir(t, srv, nil)
	m1, m2 := key.Fingerprint{1}, key.Fingerprint{2}
	e1, e2 := testEntry(m1, 1, "a"), testEntry(m2, 2, "a")
	publishAll(t, pub, []directory.Entry{e1, e2})
	c := newCollector()
	cancel, err := openDir(t, srv, nil).SubscribeAll(c.add)
	if err != nil {
		t.Fatal(err)
	}
	defer cancel()
	snap := c.waitFor(t, 2)
	seen := map[key.Fingerprint]key.BlockKey{}
	for _, ev := range snap {
		if ev.Kind != directory.Put {
			t.Fatalf("snapshot event %s", eventString(ev))
		}
		seen[ev.Entry.Model] = ev.Entry.Key
	}
	if seen[m1] != e1.Key || seen[m2] != e2.Key {
		t.Fatalf("snapshot named the wrong models: %v", seen)
	}
	if err := pub.Unpublish(context.Background(), "a", m2, []key.BlockKey{e2.Key}); err != nil {
		t.Fatal(err)
	}
	if ev := c.waitFor(t, 3)[2]; ev.Kind != directory.Delete || ev.Entry.Model != m2 || ev.Entry.Key != e2.Key {
		t.Fatalf("delete event %s", eventString(ev))
	}
}
