package embedded

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/directory/etcd"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

// An embedded server serves the etcd directory, and what was published
// survives a stop and a start on the same data directory.
func TestEmbeddedServesDirectoryAcrossRestart(t *testing.T) {
	dir := t.TempDir()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	clientURL := "http://" + l.Addr().String()
	l.Close()

	stop, err := Start(dir, clientURL, Options{MaxTxnOps: 256})
	if err != nil {
		t.Fatal(err)
	}
	d, err := etcd.New(etcd.Config{Endpoints: []string{clientURL}, MaxTxnOps: 256, LeaseTTL: 30 * time.Second})
	if err != nil {
		stop()
		t.Fatal(err)
	}
	model := key.Fingerprint{1}
	entries := make([]directory.Entry, 300) // over etcd's default 128 ops: the raised limit is in force
	for i := range entries {
		entries[i] = directory.Entry{Model: model, Key: key.BlockKey{0: byte(i >> 8), 1: byte(i), 2: 1}, Loc: directory.Location{Segment: "s", Owner: "o"}}
	}
	ctx := context.Background()
	if got, err := d.Publish(ctx, entries); err != nil || !got[0] || !got[299] {
		stop()
		t.Fatalf("Publish: %v", err)
	}
	stop()

	stop, err = Start(dir, clientURL, Options{MaxTxnOps: 256})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	// The entries are still held: publishing them again stores none.
	deadline := time.Now().Add(time.Minute)
	for {
		got, err := d.Publish(ctx, entries)
		if err == nil {
			for i, stored := range got {
				if stored {
					t.Fatalf("entry %d was lost in the restart", i)
				}
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Publish after restart: %v", err)
		}
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
}

// The quota applies to publishes (puts inside nested transactions, which
// etcd 3.7 counts) and a full store refuses them with NOSPACE.
func TestEmbeddedQuota(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	clientURL := "http://" + l.Addr().String()
	l.Close()
	stop, err := Start(t.TempDir(), clientURL, Options{QuotaBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	d, err := etcd.New(etcd.Config{Endpoints: []string{clientURL}})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	segment := strings.Repeat("s", directory.MaxNameLen)
	const batch, limit = 100, 10000
	for i := 0; i < limit; i += batch {
		entries := make([]directory.Entry, batch)
		for j := range entries {
			entries[j] = directory.Entry{Key: key.BlockKey{0: byte((i + j) >> 8), 1: byte(i + j), 2: 1}, Loc: directory.Location{Segment: segment, Owner: "o"}}
		}
		_, err := d.Publish(context.Background(), entries)
		if err == nil {
			continue
		}
		if status.Of(err) != status.Directory || !strings.Contains(err.Error(), "NOSPACE") {
			t.Fatalf("publish into a full etcd: %v", err)
		}
		return
	}
	t.Fatalf("a 1 MiB quota took %d blocks of 1 KiB", limit)
}

func TestEmbeddedRejectsBadURLs(t *testing.T) {
	for _, tc := range []struct{ client, peer string }{
		{"127.0.0.1:2379", ""},
		{"http://127.0.0.1:1", "::bad"},
	} {
		if _, err := Start(t.TempDir(), tc.client, Options{PeerURL: tc.peer}); status.Of(err) != status.Config {
			t.Errorf("Start(%q, peer %q): %v, want a config error", tc.client, tc.peer, err)
		}
	}
}
