package etcd

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

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

	if got := publish(t, a, testEntries(modelA, 0, 6, "a")); slices.Contains(got, false) {
		t.Fatalf("first publisher: %v, want all stored", got)
	}
	got := publish(t, b, testEntries(modelA, 0, 10, "b"))
	want := []bool{false, false, false, false, false, false, true, true, true, true}
	if !slices.Equal(got, want) {
		t.Fatalf("second publisher: %v, want %v", got, want)
	}
	held := stored(t, srv, modelA)
	if len(held) != 10 {
		t.Fatalf("etcd holds %d blocks, want 10", len(held))
	}
	for i, e := range testEntries(modelA, 0, 10, "") {
		wantOwner := "a"
		if i >= 6 {
			wantOwner = "b"
		}
		if got := held[e.Key].Loc.Owner; got != wantOwner {
			t.Errorf("block %d owned by %q, want %q", i, got, wantOwner)
		}
		if held[e.Key].Entry != testEntry(modelA, i, wantOwner) {
			t.Errorf("block %d stored as %+v", i, held[e.Key].Entry)
		}
	}
	// Another model's key space is separate.
	if got := publish(t, b, testEntries(modelB, 0, 2, "b")); !slices.Equal(got, []bool{true, true}) {
		t.Fatalf("other model: %v", got)
	}
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
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	held := stored(t, srv, modelA)
	for j, e := range testEntries(modelA, 0, n, "") {
		winners := 0
		for i := range dirs {
			if results[i][j] {
				winners++
				if owner := fmt.Sprint("p", i); held[e.Key].Loc.Owner != owner {
					t.Errorf("block %d: publisher %s won but etcd names %q", j, owner, held[e.Key].Loc.Owner)
				}
			}
		}
		if winners != 1 {
			t.Errorf("block %d stored by %d publishers", j, winners)
		}
	}
}

func TestPublishDuplicateInOneCall(t *testing.T) {
	srv := etcdtest.Start(t)
	d := openDir(t, srv, nil)
	e0, e1 := testEntry(modelA, 0, "a"), testEntry(modelA, 1, "a")
	other := e0
	other.Loc.Addr = 1 << 40
	got := publish(t, d, []directory.Entry{e0, e1, other})
	if !slices.Equal(got, []bool{true, true, false}) {
		t.Fatalf("got %v, want the first copy stored", got)
	}
	if held := stored(t, srv, modelA); held[e0.Key].Loc.Addr != e0.Loc.Addr {
		t.Fatalf("stored %+v, want the first copy", held[e0.Key])
	}
}

func TestPublishRejectsLongNames(t *testing.T) {
	srv := etcdtest.Start(t)
	d := openDir(t, srv, nil)
	e := testEntry(modelA, 0, strings.Repeat("o", directory.MaxNameLen+1))
	if _, err := d.Publish(context.Background(), []directory.Entry{e}); status.Of(err) != status.InvalidArg {
		t.Fatalf("got %v, want invalid argument", err)
	}
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
		if err := s.d.Unpublish(ctx, s.owner, s.model, s.keys); err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
		held := stored(t, srv, modelA)
		var left []int
		for i, k := range all {
			if _, ok := held[k]; ok {
				left = append(left, i)
			}
		}
		if !slices.Equal(left, s.left) {
			t.Fatalf("%s: etcd holds blocks %v, want %v", s.name, left, s.left)
		}
	}
	// A block a unpublished can be published again, by anyone.
	if got := publish(t, b, testEntries(modelA, 0, 1, "b")); !got[0] {
		t.Fatal("republishing an unpublished block was refused")
	}
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
				if status.Of(err) != status.Directory || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("got %v, want a directory error naming %s", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if slices.Contains(got, false) {
				t.Fatalf("%d of %d not stored", len(got)-count(got), len(got))
			}
			if held := stored(t, srv, modelA); len(held) != tc.n {
				t.Fatalf("etcd holds %d blocks, want %d", len(held), tc.n)
			}
			// Unpublish splits the same way.
			if err := d.Unpublish(context.Background(), "a", modelA, keysOf(entries)); err != nil {
				t.Fatal(err)
			}
			if held := stored(t, srv, modelA); len(held) != 0 {
				t.Fatalf("etcd holds %d blocks after unpublishing all", len(held))
			}
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
		if len(b) == 0 || len(b) > d.cfg.MaxTxnOps-1 {
			t.Fatalf("batch of %d ops", len(b))
		}
		bytes := 0
		for _, o := range b {
			bytes += 3*len(o.key) + len(o.value) + opOverhead
		}
		if len(b) > 1 && bytes > d.cfg.MaxRequestBytes-minRequestBytes/2 {
			t.Fatalf("batch of %d bytes", bytes)
		}
		joined = append(joined, b...)
	}
	if len(joined) != len(ops) {
		t.Fatalf("batches hold %d ops, want %d", len(joined), len(ops))
	}
	for i := range ops {
		if joined[i].key != ops[i].key {
			t.Fatalf("op %d reordered", i)
		}
	}
	if got := d.batches(nil); len(got) != 0 {
		t.Fatalf("no ops gave %d batches", len(got))
	}
}
