package etcd

import (
	"context"
	"encoding/binary"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/key"
)

// patience bounds waits for things that must happen (an event, a lease
// expiry); it is a hang guard, not a performance bar.
const patience = 60 * time.Second

var (
	modelA = key.Fingerprint{0xa}
	modelB = key.Fingerprint{0xb}
)

// openDir opens a directory on srv, closed when the test ends. The default
// TTL holds up on a loaded machine; tests of expiry shorten it.
func openDir(tb testing.TB, srv *etcdtest.Server, mod func(*Config)) *Directory {
	tb.Helper()
	cfg := Config{Endpoints: []string{srv.Endpoint()}, OpTimeout: 5 * time.Second}
	if mod != nil {
		mod(&cfg)
	}
	d, err := New(cfg)
	require.NoError(tb, err, "New")
	tb.Cleanup(func() { _ = d.Close() })
	return d
}

// testEntry is block i of model as owner would publish it. Its key is
// spread over the key space, as hashes are, and distinct for each i.
func testEntry(model key.Fingerprint, i int, owner string) directory.Entry {
	var e directory.Entry
	e.Model = model
	binary.BigEndian.PutUint64(e.Key[:8], mix(uint64(i)))
	binary.BigEndian.PutUint64(e.Key[8:], uint64(i)+1)
	binary.BigEndian.PutUint64(e.Parent[8:], uint64(i))
	e.Loc = directory.Location{
		Segment:    "seg-" + owner,
		Addr:       uint64(i) * 4096,
		Length:     4096,
		Checksum:   uint64(i) * 0x9e3779b97f4a7c15,
		Generation: 1,
		Owner:      owner,
	}
	return e
}

// mix is splitmix64's finalizer: a bijection that scatters consecutive
// numbers.
func mix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}

func testEntries(model key.Fingerprint, from, to int, owner string) []directory.Entry {
	out := make([]directory.Entry, 0, to-from)
	for i := from; i < to; i++ {
		out = append(out, testEntry(model, i, owner))
	}
	return out
}

func keysOf(entries []directory.Entry) []key.BlockKey {
	out := make([]key.BlockKey, len(entries))
	for i := range entries {
		out[i] = entries[i].Key
	}
	return out
}

func publish(tb testing.TB, d *Directory, entries []directory.Entry) []bool {
	tb.Helper()
	got, err := d.Publish(context.Background(), entries)
	require.NoError(tb, err, "Publish")
	return got
}

// publishAll publishes many new entries in calls small enough for the op
// timeout on a loaded machine, and checks that each was stored.
func publishAll(tb testing.TB, d *Directory, entries []directory.Entry) {
	tb.Helper()
	const chunk = 2000
	for i := 0; i < len(entries); i += chunk {
		got := publish(tb, d, entries[i:min(i+chunk, len(entries))])
		for j, ok := range got {
			require.True(tb, ok, "entry %d not stored", i+j)
		}
	}
}

// stored reads what etcd holds for model, by block key.
func stored(tb testing.TB, srv *etcdtest.Server, model key.Fingerprint) map[key.BlockKey]storedEntry {
	tb.Helper()
	prefix := modelPrefix(DefaultPrefix, model)
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	resp, err := srv.Client().Get(ctx, prefix, clientv3.WithPrefix())
	require.NoError(tb, err, "reading etcd")
	out := map[key.BlockKey]storedEntry{}
	for _, kv := range resp.Kvs {
		k, err := parseBlockKey(prefix, kv.Key)
		require.NoError(tb, err)
		e := directory.Entry{Model: model, Key: k}
		require.NoError(tb, directory.DecodeValue(kv.Value, &e))
		out[k] = storedEntry{Entry: e, lease: clientv3.LeaseID(kv.Lease)}
	}
	return out
}

type storedEntry struct {
	directory.Entry
	lease clientv3.LeaseID
}

// collector records a subscription's events.
type collector struct {
	mu      sync.Mutex
	events  []directory.Event
	changed chan struct{}
}

func newCollector() *collector { return &collector{changed: make(chan struct{}, 1)} }

func (c *collector) add(ev directory.Event) {
	c.mu.Lock()
	c.events = append(c.events, ev)
	c.mu.Unlock()
	select {
	case c.changed <- struct{}{}:
	default:
	}
}

// waitFor waits until the collector holds at least n events and returns
// them all.
func (c *collector) waitFor(tb testing.TB, n int) []directory.Event {
	tb.Helper()
	deadline := time.After(patience)
	for {
		c.mu.Lock()
		evs := append([]directory.Event(nil), c.events...)
		c.mu.Unlock()
		if len(evs) >= n {
			return evs
		}
		select {
		case <-c.changed:
		case <-deadline:
			require.FailNowf(tb, "timed out", "waited %v for %d events, have %d", patience, n, len(evs))
		}
	}
}

func (c *collector) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.events)
}

func subscribe(tb testing.TB, d *Directory, model key.Fingerprint) *collector {
	tb.Helper()
	c := newCollector()
	cancel, err := d.Subscribe(model, c.add)
	require.NoError(tb, err, "Subscribe")
	tb.Cleanup(cancel)
	return c
}

// leaseLog records lease reports; make it with room for every report a
// test causes, as a full one would block the lease goroutine.
type leaseLog chan LeaseReport

func (l leaseLog) hook(c *Config) { c.OnLease = func(r LeaseReport) { l <- r } }

// waitState waits for a report of state that carries no error (a failed
// republish is retried and reported again) and returns it.
func (l leaseLog) waitState(tb testing.TB, state LeaseState) LeaseReport {
	tb.Helper()
	deadline := time.After(patience)
	for {
		select {
		case r := <-l:
			if r.State == state && r.Err == nil {
				return r
			}
		case <-deadline:
			require.FailNowf(tb, "timed out", "waited %v for lease state %v", patience, state)
		}
	}
}

func eventString(ev directory.Event) string {
	kind := "put"
	if ev.Kind == directory.Delete {
		kind = "delete"
	}
	return fmt.Sprintf("%s %s owner=%q", kind, ev.Entry.Key, ev.Entry.Loc.Owner)
}
