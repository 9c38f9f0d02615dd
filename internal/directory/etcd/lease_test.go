package etcd

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/status"
)

const ownerEndpointEnv = "MCB_ETCD_TEST_OWNER_ENDPOINT"

// TestOwnerProcess is the process that TestDeadOwnerEntriesExpire kills:
// it publishes, says so, and waits to die.
func TestOwnerProcess(t *testing.T) {
	ep := os.Getenv(ownerEndpointEnv)
	if ep == "" {
		t.Skip("helper process of TestDeadOwnerEntriesExpire")
	}
	d, err := New(Config{Endpoints: []string{ep}, LeaseTTL: 2 * time.Second, OpTimeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.Publish(context.Background(), testEntries(modelA, 0, 5, "child")); err != nil {
		t.Fatal(err)
	}
	fmt.Println("published")
	time.Sleep(time.Hour)
}

// A process killed without closing its directory loses its entries when
// its lease expires, and subscribers see them deleted.
func TestDeadOwnerEntriesExpire(t *testing.T) {
	srv := etcdtest.Start(t)
	watcher := openDir(t, srv, nil)
	c := subscribe(t, watcher, modelA)

	child := exec.Command(os.Args[0], "-test.run=^TestOwnerProcess$")
	child.Env = append(os.Environ(), ownerEndpointEnv+"="+srv.Endpoint())
	out, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	child.Stderr = os.Stderr
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || strings.TrimSpace(line) != "published" {
		_ = child.Process.Kill()
		t.Fatalf("owner process said %q, %v", line, err)
	}
	c.waitFor(t, 5)
	if err := child.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = child.Wait()

	deleted := map[directory.Entry]bool{}
	for _, ev := range c.waitFor(t, 10)[5:] {
		if ev.Kind != directory.Delete {
			t.Fatalf("after the owner died got %s", eventString(ev))
		}
		deleted[ev.Entry] = true
	}
	for i, e := range testEntries(modelA, 0, 5, "child") {
		if !deleted[e] {
			t.Errorf("no Delete of the dead owner's block %d", i)
		}
	}
	if held := stored(t, srv, modelA); len(held) != 0 {
		t.Fatalf("etcd still holds %d of the dead owner's blocks", len(held))
	}
}

// Close revokes the lease: every entry this process published goes, and
// the directory refuses further use.
func TestCloseRevokesLease(t *testing.T) {
	srv := etcdtest.Start(t)
	a := openDir(t, srv, nil)
	b := openDir(t, srv, nil)
	publish(t, a, testEntries(modelA, 0, 3, "a"))
	publish(t, b, testEntries(modelA, 3, 4, "b"))
	c := subscribe(t, b, modelA)
	c.waitFor(t, 4)
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	got := c.waitFor(t, 7)[4:]
	for _, ev := range got {
		if ev.Kind != directory.Delete || ev.Entry.Loc.Owner != "a" {
			t.Fatalf("after close got %s", eventString(ev))
		}
	}
	if held := stored(t, srv, modelA); len(held) != 1 {
		t.Fatalf("etcd holds %d blocks, want b's one", len(held))
	}
	ctx := context.Background()
	if err := a.Close(); status.Of(err) != status.State {
		t.Errorf("second Close: %v", err)
	}
	if _, err := a.Publish(ctx, testEntries(modelA, 5, 6, "a")); status.Of(err) != status.State {
		t.Errorf("Publish after Close: %v", err)
	}
	if err := a.Unpublish(ctx, "a", modelA, nil); status.Of(err) != status.State {
		t.Errorf("Unpublish after Close: %v", err)
	}
	if _, err := a.Subscribe(modelA, func(directory.Event) {}); status.Of(err) != status.State {
		t.Errorf("Subscribe after Close: %v", err)
	}
}

// When etcd drops the lease (here: revoked by someone else, as when it
// expires), the directory grants a new one and publishes its entries again;
// what it unpublished stays gone.
func TestLeaseLossRepublishes(t *testing.T) {
	srv := etcdtest.Start(t)
	leases := make(leaseLog, 256)
	a := openDir(t, srv, leases.hook)
	publish(t, a, testEntries(modelA, 0, 6, "a"))
	if err := a.Unpublish(context.Background(), "a", modelA, keysOf(testEntries(modelA, 5, 6, ""))); err != nil {
		t.Fatal(err)
	}
	old := stored(t, srv, modelA)[testEntry(modelA, 0, "").Key].lease
	watcher := openDir(t, srv, nil)
	c := subscribe(t, watcher, modelA)
	c.waitFor(t, 5)

	if _, err := srv.Client().Revoke(context.Background(), old); err != nil {
		t.Fatal(err)
	}
	leases.waitState(t, LeaseLost)
	r := leases.waitState(t, LeaseRepublished)
	if r.Republished != 5 || r.Taken != 0 || r.Err != nil {
		t.Fatalf("report %+v, want 5 republished", r)
	}
	held := stored(t, srv, modelA)
	if len(held) != 5 {
		t.Fatalf("etcd holds %d blocks, want 5", len(held))
	}
	for i, e := range testEntries(modelA, 0, 5, "a") {
		if held[e.Key].Entry != e || held[e.Key].lease != clientv3.LeaseID(r.Lease) || r.Lease == int64(old) {
			t.Fatalf("block %d stored as %+v, want it under new lease %x", i, held[e.Key], r.Lease)
		}
	}
	// Subscribers saw the entries go and come back.
	got := c.waitFor(t, 15)[5:]
	for i, ev := range got {
		wantKind := directory.Delete
		if i >= 5 {
			wantKind = directory.Put
		}
		if ev.Kind != wantKind || ev.Entry.Loc.Owner != "a" {
			t.Fatalf("event %d: %s", i, eventString(ev))
		}
	}
	// Publishing goes on under the new lease.
	if got := publish(t, a, testEntries(modelA, 6, 7, "a")); !got[0] {
		t.Fatal("publish after re-grant refused")
	}
}

// Entries that another process published while ours were gone are no
// longer ours: counted as taken and left alone.
func TestLeaseLossTakenByOthers(t *testing.T) {
	srv := etcdtest.Start(t)
	leases := make(leaseLog, 256)
	proceed := make(chan struct{})
	a := openDir(t, srv, func(c *Config) {
		c.OnLease = func(r LeaseReport) {
			leases <- r
			if r.State == LeaseLost {
				// Hold the lease goroutine until the other process has
				// published: that is the race this test is about.
				<-proceed
			}
		}
	})
	var once sync.Once
	release := func() { once.Do(func() { close(proceed) }) }
	t.Cleanup(release) // before a's Close, should the test stop early
	b := openDir(t, srv, nil)
	publish(t, a, testEntries(modelA, 0, 4, "a"))
	old := stored(t, srv, modelA)[testEntry(modelA, 0, "").Key].lease
	ctx := context.Background()
	if _, err := srv.Client().Revoke(ctx, old); err != nil {
		t.Fatal(err)
	}
	leases.waitState(t, LeaseLost)
	if got := publish(t, b, testEntries(modelA, 0, 2, "b")); !got[0] || !got[1] {
		t.Fatalf("b's publish into the gap: %v", got)
	}
	release()
	r := leases.waitState(t, LeaseRepublished)
	if r.Republished != 2 || r.Taken != 2 {
		t.Fatalf("report %+v, want 2 republished and 2 taken", r)
	}
	held := stored(t, srv, modelA)
	for i, owner := range []string{"b", "b", "a", "a"} {
		if got := held[testEntry(modelA, i, "").Key].Loc.Owner; got != owner {
			t.Fatalf("block %d owned by %q, want %q", i, got, owner)
		}
	}
	// Taken entries are not a's to unpublish any more.
	if err := a.Unpublish(ctx, "a", modelA, keysOf(testEntries(modelA, 0, 4, ""))); err != nil {
		t.Fatal(err)
	}
	if held := stored(t, srv, modelA); len(held) != 2 {
		t.Fatalf("etcd holds %d blocks, want b's 2", len(held))
	}
}

// With etcd down, Publish and Unpublish fail with a clear status within
// their timeout and nothing panics; after etcd returns publishing resumes,
// and the process's entries are there: kept under the resumed lease when
// etcd kept its data, published again when it lost it.
func TestEtcdDownAndBack(t *testing.T) {
	cases := []struct {
		name      string
		wipe      bool
		ttl       time.Duration
		wantState LeaseState
	}{
		// etcd refreshes the leases it restores to one TTL: the client must
		// reconnect within it to resume, so leave room for a loaded machine.
		{"restart with data", false, 4 * time.Second, LeaseResumed},
		{"restart wiped", true, 2 * time.Second, LeaseRepublished},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			srv := etcdtest.Start(t)
			leases := make(leaseLog, 256)
			a := openDir(t, srv, func(c *Config) {
				leases.hook(c)
				c.LeaseTTL = tc.ttl
				c.OpTimeout = 300 * time.Millisecond
			})
			publish(t, a, testEntries(modelA, 0, 3, "a"))
			cancelSub, err := a.Subscribe(modelA, func(directory.Event) {})
			if err != nil {
				t.Fatal(err)
			}
			defer cancelSub()

			srv.Stop()
			ctx := context.Background()
			_, err = a.Publish(ctx, testEntries(modelA, 3, 4, "a"))
			if status.Of(err) != status.Directory || !strings.Contains(err.Error(), "unreachable") {
				t.Fatalf("Publish with etcd down: %v, want directory unavailable, unreachable", err)
			}
			t.Logf("Publish with etcd down: %v", err)
			err = a.Unpublish(ctx, "a", modelA, keysOf(testEntries(modelA, 0, 1, "")))
			if status.Of(err) != status.Directory {
				t.Fatalf("Unpublish with etcd down: %v", err)
			}
			// Past the TTL the lease is lost; publishing waits for a new one.
			leases.waitState(t, LeaseLost)
			_, err = a.Publish(ctx, testEntries(modelA, 3, 4, "a"))
			if status.Of(err) != status.Directory || !strings.Contains(err.Error(), "lease lost") {
				t.Fatalf("Publish with the lease lost: %v", err)
			}
			t.Logf("Publish with the lease lost: %v", err)

			if tc.wipe {
				srv.Wipe()
			}
			srv.Restart()
			r := leases.waitState(t, tc.wantState)
			if tc.wipe && r.Republished != 2 {
				// Block 0 was unpublished: forgotten even though etcd never heard.
				t.Fatalf("report %+v, want 2 republished", r)
			}
			deadline := time.Now().Add(patience)
			for {
				_, err = a.Publish(ctx, testEntries(modelA, 3, 4, "a"))
				if err == nil {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("Publish after restart still fails: %v", err)
				}
				t.Logf("Publish right after restart: %v", err)
			}
			held := stored(t, srv, modelA)
			for i := 1; i < 4; i++ {
				if _, ok := held[testEntry(modelA, i, "").Key]; !ok {
					t.Errorf("block %d missing after etcd came back", i)
				}
			}
		})
	}
}

func TestConfigValidation(t *testing.T) {
	ok := Config{Endpoints: []string{"http://127.0.0.1:1"}}
	cases := []struct {
		name string
		mod  func(*Config)
		want status.Code
	}{
		{"defaults", func(*Config) {}, status.OK},
		{"no endpoints", func(c *Config) { c.Endpoints = nil }, status.Config},
		{"slash prefix", func(c *Config) { c.Prefix = "//" }, status.Config},
		{"short TTL", func(c *Config) { c.LeaseTTL = time.Millisecond }, status.Config},
		{"negative timeout", func(c *Config) { c.OpTimeout = -1 }, status.Config},
		{"one txn op", func(c *Config) { c.MaxTxnOps = 1 }, status.Config},
		{"tiny requests", func(c *Config) { c.MaxRequestBytes = 1000 }, status.Config},
		{"cert without key", func(c *Config) { c.TLS.CertFile = "c.pem" }, status.Config},
		{"missing CA file", func(c *Config) { c.TLS.CAFile = "/nonexistent/ca.pem" }, status.Config},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := ok
			tc.mod(&cfg)
			d, err := New(cfg)
			if got := status.Of(err); got != tc.want {
				t.Fatalf("New: %v, want %v", err, tc.want)
			}
			if err == nil {
				if d.cfg.Prefix != DefaultPrefix || d.cfg.LeaseTTL != DefaultLeaseTTL || d.cfg.MaxTxnOps != DefaultMaxTxnOps {
					t.Errorf("defaults not applied: %+v", d.cfg)
				}
				if err := d.Close(); err != nil && status.Of(err) != status.Directory {
					t.Errorf("Close: %v", err)
				}
			}
		})
	}
}
