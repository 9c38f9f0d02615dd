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

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
	require.NoError(t, err)
	_, err = d.Publish(context.Background(), testEntries(modelA, 0, 5, "child"))
	require.NoError(t, err)
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
	require.NoError(t, err)
	child.Stderr = os.Stderr
	require.NoError(t, child.Start())
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || strings.TrimSpace(line) != "published" {
		_ = child.Process.Kill()
		require.FailNowf(t, "owner process did not publish", "owner process said %q, %v", line, err)
	}
	c.waitFor(t, 5)
	require.NoError(t, child.Process.Kill())
	_ = child.Wait()

	deleted := map[directory.Entry]bool{}
	for _, ev := range c.waitFor(t, 10)[5:] {
		require.Equal(t, directory.Delete, ev.Kind, "after the owner died got %s", eventString(ev))
		deleted[ev.Entry] = true
	}
	for i, e := range testEntries(modelA, 0, 5, "child") {
		assert.True(t, deleted[e], "no Delete of the dead owner's block %d", i)
	}
	require.Empty(t, stored(t, srv, modelA), "etcd still holds the dead owner's blocks")
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
	require.NoError(t, a.Close())
	got := c.waitFor(t, 7)[4:]
	for _, ev := range got {
		require.Equal(t, directory.Delete, ev.Kind, "after close got %s", eventString(ev))
		require.Equal(t, "a", ev.Entry.Loc.Owner, "after close got %s", eventString(ev))
	}
	require.Len(t, stored(t, srv, modelA), 1, "etcd must hold b's block only")
	ctx := context.Background()
	err := a.Close()
	assert.Equal(t, status.State, status.Of(err), "second Close: %v", err)
	_, err = a.Publish(ctx, testEntries(modelA, 5, 6, "a"))
	assert.Equal(t, status.State, status.Of(err), "Publish after Close: %v", err)
	err = a.Unpublish(ctx, "a", modelA, nil)
	assert.Equal(t, status.State, status.Of(err), "Unpublish after Close: %v", err)
	_, err = a.Subscribe(modelA, func(directory.Event) {})
	assert.Equal(t, status.State, status.Of(err), "Subscribe after Close: %v", err)
}

// When etcd drops the lease (here: revoked by someone else, as when it
// expires), the directory grants a new one and publishes its entries again;
// what it unpublished stays gone.
func TestLeaseLossRepublishes(t *testing.T) {
	srv := etcdtest.Start(t)
	leases := make(leaseLog, 256)
	a := openDir(t, srv, leases.hook)
	publish(t, a, testEntries(modelA, 0, 6, "a"))
	require.NoError(t, a.Unpublish(context.Background(), "a", modelA, keysOf(testEntries(modelA, 5, 6, ""))))
	old := stored(t, srv, modelA)[testEntry(modelA, 0, "").Key].lease
	watcher := openDir(t, srv, nil)
	c := subscribe(t, watcher, modelA)
	c.waitFor(t, 5)

	_, err := srv.Client().Revoke(context.Background(), old)
	require.NoError(t, err)
	leases.waitState(t, LeaseLost)
	r := leases.waitState(t, LeaseRepublished)
	require.Equal(t, 5, r.Republished, "report %+v", r)
	require.Zero(t, r.Taken, "report %+v", r)
	require.NoError(t, r.Err, "report %+v", r)
	held := stored(t, srv, modelA)
	require.Len(t, held, 5, "blocks etcd holds")
	for i, e := range testEntries(modelA, 0, 5, "a") {
		require.Equal(t, e, held[e.Key].Entry, "block %d stored as %+v", i, held[e.Key])
		require.Equal(t, clientv3.LeaseID(r.Lease), held[e.Key].lease, "block %d must be under the new lease", i)
		require.NotEqual(t, int64(old), r.Lease, "the new lease is the old one")
	}
	// Subscribers saw the entries go and come back.
	got := c.waitFor(t, 15)[5:]
	for i, ev := range got {
		wantKind := directory.Delete
		if i >= 5 {
			wantKind = directory.Put
		}
		require.Equal(t, wantKind, ev.Kind, "event %d: %s", i, eventString(ev))
		require.Equal(t, "a", ev.Entry.Loc.Owner, "event %d: %s", i, eventString(ev))
	}
	// Publishing goes on under the new lease.
	require.True(t, publish(t, a, testEntries(modelA, 6, 7, "a"))[0], "publish after re-grant refused")
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
	_, err := srv.Client().Revoke(ctx, old)
	require.NoError(t, err)
	leases.waitState(t, LeaseLost)
	got := publish(t, b, testEntries(modelA, 0, 2, "b"))
	require.True(t, got[0], "b's publish into the gap: %v", got)
	require.True(t, got[1], "b's publish into the gap: %v", got)
	release()
	r := leases.waitState(t, LeaseRepublished)
	require.Equal(t, 2, r.Republished, "report %+v", r)
	require.Equal(t, 2, r.Taken, "report %+v", r)
	held := stored(t, srv, modelA)
	for i, owner := range []string{"b", "b", "a", "a"} {
		require.Equal(t, owner, held[testEntry(modelA, i, "").Key].Loc.Owner, "block %d owner", i)
	}
	// Taken entries are not a's to unpublish any more.
	require.NoError(t, a.Unpublish(ctx, "a", modelA, keysOf(testEntries(modelA, 0, 4, ""))))
	require.Len(t, stored(t, srv, modelA), 2, "etcd must hold b's 2 blocks")
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
			require.NoError(t, err)
			defer cancelSub()

			srv.Stop()
			ctx := context.Background()
			_, err = a.Publish(ctx, testEntries(modelA, 3, 4, "a"))
			require.Equal(t, status.Directory, status.Of(err), "Publish with etcd down: %v", err)
			require.ErrorContains(t, err, "unreachable", "Publish with etcd down")
			t.Logf("Publish with etcd down: %v", err)
			err = a.Unpublish(ctx, "a", modelA, keysOf(testEntries(modelA, 0, 1, "")))
			require.Equal(t, status.Directory, status.Of(err), "Unpublish with etcd down: %v", err)
			// Past the TTL the lease is lost; publishing waits for a new one.
			leases.waitState(t, LeaseLost)
			_, err = a.Publish(ctx, testEntries(modelA, 3, 4, "a"))
			require.Equal(t, status.Directory, status.Of(err), "Publish with the lease lost: %v", err)
			require.ErrorContains(t, err, "lease lost", "Publish with the lease lost")
			t.Logf("Publish with the lease lost: %v", err)

			if tc.wipe {
				srv.Wipe()
			}
			srv.Restart()
			r := leases.waitState(t, tc.wantState)
			if tc.wipe {
				// Block 0 was unpublished: forgotten even though etcd never heard.
				require.Equal(t, 2, r.Republished, "report %+v", r)
			}
			deadline := time.Now().Add(patience)
			for {
				_, err = a.Publish(ctx, testEntries(modelA, 3, 4, "a"))
				if err == nil {
					break
				}
				if time.Now().After(deadline) {
					require.NoError(t, err, "Publish after restart still fails")
				}
				t.Logf("Publish right after restart: %v", err)
			}
			held := stored(t, srv, modelA)
			for i := 1; i < 4; i++ {
				assert.Contains(t, held, testEntry(modelA, i, "").Key, "block %d missing after etcd came back", i)
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
			require.Equal(t, tc.want, status.Of(err), "New: %v", err)
			if err == nil {
				assert.Equal(t, DefaultPrefix, d.cfg.Prefix, "defaults not applied: %+v", d.cfg)
				assert.Equal(t, DefaultLeaseTTL, d.cfg.LeaseTTL, "defaults not applied: %+v", d.cfg)
				assert.Equal(t, DefaultMaxTxnOps, d.cfg.MaxTxnOps, "defaults not applied: %+v", d.cfg)
				if err := d.Close(); err != nil {
					assert.Equal(t, status.Directory, status.Of(err), "Close: %v", err)
				}
			}
		})
	}
}
