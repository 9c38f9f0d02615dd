package etcd

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Two processes saving the same blocks: each block is stored once, and each
// publisher learns which entries it won.
func TestPublishDedupesAcrossClients(t *testing.T) {
	srv := etcdtest.Start(t)
	a := openDir(t, srv, nil)
	b := openDir(t, srv, nil)

	require.NotContains(t, publish(t, a, testEntries(modelA, 0, 6, "a")), false, "first publisher: want all stored")
	got := publish(t, b, testEntries(modelA, 0, 10, "b"))
	want := []bool{false, false, false, false, false, false, true, true, true, true}
	require.Equal(t, want, got, "second publisher")
	held := stored(t, srv, modelA)
	require.Len(t, held, 10, "blocks etcd holds")
	for i, e := range testEntries(modelA, 0, 10, "") {
		wantOwner := "a"
		if i >= 6 {
			wantOwner = "b"
		}
		assert.Equal(t, wantOwner, held[e.Key].Loc.Owner, "block %d owner", i)
		assert.Equal(t, testEntry(modelA, i, wantOwner), held[e.Key].Entry, "block %d stored", i)
	}
	// Another model's key space is separate.
	require.Equal(t, []bool{true, true}, publish(t, b, testEntries(modelB, 0, 2, "b")), "other model")
}

// A publish whose answer was lost (a timeout after etcd committed) is
// retried: the entries etcd holds are exactly the retry's, so the retry
// reports them held, and another owner's copy of the same blocks not.
func TestPublishRetryOfCommittedEntries(t *testing.T) {
	srv := etcdtest.Start(t)
	a := openDir(t, srv, nil)
	b := openDir(t, srv, nil)
	es := testEntries(modelA, 0, 4, "a")
	require.NotContains(t, publish(t, a, es), false, "first publish")
	require.NotContains(t, publish(t, a, es), false, "the same entries again: held exactly as offered")
	require.NotContains(t, publish(t, b, es), false, "the same values from another client: held exactly as offered")
	require.NotContains(t, publish(t, b, testEntries(modelA, 0, 4, "b")), true, "another owner's copy: held by a")
}

func TestPublishConcurrentSameBlocksStoresEachOnce(t *testing.T) {
	srv := etcdtest.Start(t)
	const n = 300
	dirs := []*Directory{openDir(t, srv, nil), openDir(t, srv, nil), openDir(t, srv, nil)}
	results := make([][]bool, len(dirs))
	errs := make(chan error, len(dirs))
	for i, d := range dirs {
		go func() {
			var err error
			results[i], err = d.Publish(context.Background(), testEntries(modelA, 0, n, fmt.Sprint("p", i)))
			errs <- err
		}()
	}
	for range dirs {
		require.NoError(t, <-errs)
	}
	held := stored(t, srv, modelA)
	for j, e := range testEntries(modelA, 0, n, "") {
		winners := 0
		for i := range dirs {
			if results[i][j] {
				winners++
				assert.Equal(t, fmt.Sprint("p", i), held[e.Key].Loc.Owner, "block %d: the publisher that won is not the one etcd names", j)
			}
		}
		assert.Equal(t, 1, winners, "block %d: publishers that stored it", j)
	}
}

func TestPublishDuplicateInOneCall(t *testing.T) {
	srv := etcdtest.Start(t)
	d := openDir(t, srv, nil)
	e0, e1 := testEntry(modelA, 0, "a"), testEntry(modelA, 1, "a")
	other := e0
	other.Loc.Addr = 1 << 40
	got := publish(t, d, []directory.Entry{e0, e1, other})
	require.Equal(t, []bool{true, true, false}, got, "want the first copy stored")
	held := stored(t, srv, modelA)
	require.Equal(t, e0.Loc.Addr, held[e0.Key].Loc.Addr, "stored %+v, want the first copy", held[e0.Key])
}

func TestPublishRejectsLongNames(t *testing.T) {
	srv := etcdtest.Start(t)
	d := openDir(t, srv, nil)
	e := testEntry(modelA, 0, strings.Repeat("o", directory.MaxNameLen+1))
	_, err := d.Publish(context.Background(), []directory.Entry{e})
	require.Equal(t, status.InvalidArg, status.Of(err), "got %v", err)
}

// Unpublish removes only the entries that name the given owner, whoever
// published them, and leaves every other owner's.
func TestUnpublishOnlyOwnEntries(t *testing.T) {
	srv := etcdtest.Start(t)
	a := openDir(t, srv, nil)
	b := openDir(t, srv, nil)
	publish(t, a, testEntries(modelA, 0, 4, "a"))
	publish(t, b, testEntries(modelA, 4, 6, "b"))
	all := keysOf(testEntries(modelA, 0, 6, ""))
	ctx := context.Background()

	steps := []struct {
		name  string
		d     *Directory
		owner string
		model key.Fingerprint
		keys  []key.BlockKey
		left  []int // blocks etcd still holds after the step
	}{
		{"b removes its own among all", b, "b", modelA, all, []int{0, 1, 2, 3}},
		{"wrong model removes nothing", a, "a", modelB, all, []int{0, 1, 2, 3}},
		{"a names an owner that holds none", a, "b", modelA, all, []int{0, 1, 2, 3}},
		{"a removes two of its own", a, "a", modelA, all[:2], []int{2, 3}},
		{"b removes a's block by owner name", b, "a", modelA, all[2:3], []int{3}},
		{"removing again is a no-op", a, "a", modelA, all[:3], []int{3}},
	}
	for _, s := range steps {
		require.NoError(t, s.d.Unpublish(ctx, s.owner, s.model, s.keys), "%s", s.name)
		held := stored(t, srv, modelA)
		var left []int
		for i, k := range all {
			if _, ok := held[k]; ok {
				left = append(left, i)
			}
		}
		require.Equal(t, s.left, left, "%s: blocks etcd holds", s.name)
	}
	// A block a unpublished can be published again, by anyone.
	require.True(t, publish(t, b, testEntries(modelA, 0, 1, "b"))[0], "republishing an unpublished block was refused")
}

// Batches over etcd's per-transaction limits are split; a server whose
// limits are lower than the configured ones refuses with a clear status.
func TestPublishLargeBatches(t *testing.T) {
	longName := strings.Repeat("s", directory.MaxNameLen)
	cases := []struct {
		name       string
		serverArgs []string
		cfg        func(*Config)
		n          int
		segment    string
		wantErr    string
	}{
		{name: "default limits", n: 1000},
		{name: "16 ops", serverArgs: []string{"--max-txn-ops=16"}, cfg: func(c *Config) { c.MaxTxnOps = 16 }, n: 100},
		{
			name:       "100 KB requests, long names",
			serverArgs: []string{"--max-request-bytes=100000"},
			cfg:        func(c *Config) { c.MaxRequestBytes = 100000 },
			n:          300,
			segment:    longName,
		},
		{
			name:       "server limit below config",
			serverArgs: []string{"--max-txn-ops=16"},
			n:          100,
			wantErr:    "--max-txn-ops",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			srv := etcdtest.Start(t, tc.serverArgs...)
			d := openDir(t, srv, tc.cfg)
			entries := testEntries(modelA, 0, tc.n, "a")
			for i := range entries {
				if tc.segment != "" {
					entries[i].Loc.Segment = tc.segment
				}
			}
			got, err := d.Publish(context.Background(), entries)
			if tc.wantErr != "" {
				require.Equal(t, status.Directory, status.Of(err), "got %v", err)
				require.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			require.NotContains(t, got, false, "%d of %d not stored", len(got)-count(got), len(got))
			require.Len(t, stored(t, srv, modelA), tc.n, "blocks etcd holds")
			// Unpublish splits the same way.
			require.NoError(t, d.Unpublish(context.Background(), "a", modelA, keysOf(entries)))
			require.Empty(t, stored(t, srv, modelA), "etcd holds blocks after unpublishing all")
		})
	}
}

func count(b []bool) int {
	n := 0
	for _, v := range b {
		if v {
			n++
		}
	}
	return n
}

func TestBatchesRespectLimits(t *testing.T) {
	d := &Directory{cfg: Config{MaxTxnOps: 8, MaxRequestBytes: minRequestBytes + 4000}}
	var ops []op
	for i := range 50 {
		ops = append(ops, op{key: fmt.Sprint("k", i), value: make([]byte, 100*(i%7))})
	}
	batches := d.batches(ops)
	var joined []op
	for _, b := range batches {
		require.NotEmpty(t, b, "empty batch")
		require.LessOrEqual(t, len(b), d.cfg.MaxTxnOps-1, "ops in a batch")
		bytes := 0
		for _, o := range b {
			bytes += 3*len(o.key) + len(o.value) + opOverhead
		}
		if len(b) > 1 {
			require.LessOrEqual(t, bytes, d.cfg.MaxRequestBytes-minRequestBytes/2, "bytes in a batch")
		}
		joined = append(joined, b...)
	}
	require.Len(t, joined, len(ops), "ops the batches hold")
	for i := range ops {
		require.Equal(t, ops[i].key, joined[i].key, "op %d reordered", i)
	}
	require.Empty(t, d.batches(nil), "batches of no ops")
}
