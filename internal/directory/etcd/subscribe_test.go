package etcd

import (
	"bytes"
	"context"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
	require.Equal(t, want, snap, "snapshot")

	ctx := context.Background()
	publish(t, a, testEntries(modelA, 5, 8, "a"))
	require.NoError(t, a.Unpublish(ctx, "a", modelA, keysOf(testEntries(modelA, 1, 3, ""))))
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
	}
	require.Equal(t, want, got, "events as listed in the test")
	// A publish that changes nothing delivers nothing: the next event seen
	// is the one after it.
	publish(t, b, testEntries(modelA, 0, 1, "b"))
	publish(t, b, testEntries(modelA, 9, 10, "b"))
	got = c.waitFor(t, len(want)+1)
	require.Len(t, got, len(want)+1, "after a refused publish got %s", eventString(got[len(got)-1]))
	require.Equal(t, testEntry(modelA, 9, "b"), got[len(want)].Entry, "after a refused publish")
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
		require.Equal(t, directory.Put, ev.Kind, "unexpected %s", eventString(ev))
		require.False(t, seen[ev.Entry.Key], "unexpected %s", eventString(ev))
		seen[ev.Entry.Key] = true
	}
	for i, e := range testEntries(modelA, 0, n, "a") {
		require.True(t, seen[e.Key], "block %d missing from the snapshot", i)
	}
	// Live events follow the snapshot.
	publish(t, a, testEntries(modelA, n, n+1, "a"))
	got = c.waitFor(t, n+1)
	require.Equal(t, testEntry(modelA, n, "a"), got[n].Entry, "after the snapshot got %s", eventString(got[n]))
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
	require.NoError(t, s.sync(ctx))
	require.Equal(t, 10, c.len(), "snapshot events")
	// While the subscription is not watching: changes, then compaction past
	// them, so that the watch cannot replay them.
	publish(t, a, testEntries(modelA, 10, 15, "a"))
	require.NoError(t, a.Unpublish(ctx, "a", modelA, keysOf(testEntries(modelA, 0, 3, ""))))
	resp, err := srv.Client().Get(ctx, "any")
	require.NoError(t, err)
	_, err = srv.Client().Compact(ctx, resp.Header.Revision)
	require.NoError(t, err)
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
		assert.Equal(t, e, puts[e.Key], "resync: no Put of %s", e.Key)
	}
	for _, e := range testEntries(modelA, 0, 3, "a") {
		assert.True(t, deletes[e.Key], "resync: no Delete of %s", e.Key)
	}
	require.Len(t, puts, 5, "Puts the resync delivered")
	require.Len(t, deletes, 3, "Deletes the resync delivered")
	// The watch resumes after the resync.
	publish(t, a, testEntries(modelA, 20, 21, "a"))
	got = c.waitFor(t, 19)
	require.Equal(t, testEntry(modelA, 20, "a"), got[18].Entry, "after resync got %s", eventString(got[18]))
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
	got := c.waitFor(t, 3)
	require.Equal(t, testEntry(modelA, 2, "a"), got[2].Entry, "after restart got %s", eventString(got[2]))
}

func TestSubscribeCancelStopsDelivery(t *testing.T) {
	srv := etcdtest.Start(t)
	a := openDir(t, srv, nil)
	b := openDir(t, srv, nil)
	c := newCollector()
	cancel, err := b.Subscribe(modelA, c.add)
	require.NoError(t, err)
	publish(t, a, testEntries(modelA, 0, 1, "a"))
	c.waitFor(t, 1)
	cancel()
	cancel() // a second cancel is harmless
	// Events after cancel are not delivered; a fresh subscription, which
	// does see them, bounds the wait.
	publish(t, a, testEntries(modelA, 1, 2, "a"))
	subscribe(t, b, modelA).waitFor(t, 2)
	require.Equal(t, 1, c.len(), "events after cancel")
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
			require.Len(t, got, tc.buckets, "ranges")
			require.Equal(t, tc.from, got[0][0], "start of the ranges' span")
			require.Equal(t, end, got[len(got)-1][1], "end of the ranges' span")
			for i, r := range got {
				require.Less(t, r[0], r[1], "range %d is empty", i)
				if i > 0 {
					require.Equal(t, got[i-1][1], r[0], "range %d does not follow the one before", i)
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
	require.NoError(t, err)
	defer cancel()
	snap := c.waitFor(t, 2)
	seen := map[key.Fingerprint]key.BlockKey{}
	for _, ev := range snap {
		require.Equal(t, directory.Put, ev.Kind, "snapshot event %s", eventString(ev))
		seen[ev.Entry.Model] = ev.Entry.Key
	}
	require.Equal(t, e1.Key, seen[m1], "snapshot named the wrong models: %v", seen)
	require.Equal(t, e2.Key, seen[m2], "snapshot named the wrong models: %v", seen)
	require.NoError(t, pub.Unpublish(context.Background(), "a", m2, []key.BlockKey{e2.Key}))
	ev := c.waitFor(t, 3)[2]
	require.Equal(t, directory.Delete, ev.Kind, "delete event %s", eventString(ev))
	require.Equal(t, m2, ev.Entry.Model, "delete event %s", eventString(ev))
	require.Equal(t, e2.Key, ev.Entry.Key, "delete event %s", eventString(ev))
}
