package embedded

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

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
	require.NoError(t, err)
	clientURL := "http://" + l.Addr().String()
	l.Close()

	stop, err := Start(dir, clientURL, Options{MaxTxnOps: 256})
	require.NoError(t, err)
	d, err := etcd.New(etcd.Config{Endpoints: []string{clientURL}, MaxTxnOps: 256, LeaseTTL: 30 * time.Second})
	if err != nil {
		stop()
	}
	require.NoError(t, err)
	model := key.Fingerprint{1}
	entries := make([]directory.Entry, 300) // over etcd's default 128 ops: the raised limit is in force
	for i := range entries {
		entries[i] = directory.Entry{Model: model, Key: key.BlockKey{0: byte(i >> 8), 1: byte(i), 2: 1}, Loc: directory.Location{Segment: "s", Owner: "o"}}
	}
	ctx := context.Background()
	got, err := d.Publish(ctx, entries)
	if err != nil || !got[0] || !got[299] {
		stop()
	}
	require.NoError(t, err, "Publish")
	require.True(t, got[0], "Publish")
	require.True(t, got[299], "Publish")
	stop()

	stop, err = Start(dir, clientURL, Options{MaxTxnOps: 256})
	require.NoError(t, err)
	defer stop()
	// The entries are still held: another owner publishing the same blocks
	// stores none.
	others := make([]directory.Entry, len(entries))
	for i, e := range entries {
		e.Loc.Owner = "other"
		others[i] = e
	}
	deadline := time.Now().Add(time.Minute)
	for {
		got, err := d.Publish(ctx, others)
		if err == nil {
			for i, stored := range got {
				require.False(t, stored, "entry %d was lost in the restart", i)
			}
			break
		}
		if time.Now().After(deadline) {
			require.NoError(t, err, "Publish after restart")
		}
	}
	require.NoError(t, d.Close())
}

// The quota applies to publishes (puts inside nested transactions, which
// etcd 3.7 counts) and a full store refuses them with NOSPACE.
func TestEmbeddedQuota(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	clientURL := "http://" + l.Addr().String()
	l.Close()
	stop, err := Start(t.TempDir(), clientURL, Options{QuotaBytes: 1 << 20})
	require.NoError(t, err)
	defer stop()
	d, err := etcd.New(etcd.Config{Endpoints: []string{clientURL}})
	require.NoError(t, err)
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
		require.Equal(t, status.Directory, status.Of(err), "publish into a full etcd: %v", err)
		require.ErrorContains(t, err, "NOSPACE", "publish into a full etcd")
		return
	}
	require.FailNowf(t, "quota not enforced", "a 1 MiB quota took %d blocks of 1 KiB", limit)
}

func TestEmbeddedRejectsBadURLs(t *testing.T) {
	for _, tc := range []struct{ client, peer string }{
		{"127.0.0.1:2379", ""},
		{"http://127.0.0.1:1", "::bad"},
	} {
		_, err := Start(t.TempDir(), tc.client, Options{PeerURL: tc.peer})
		assert.Equal(t, status.Config, status.Of(err), "Start(%q, peer %q): %v", tc.client, tc.peer, err)
	}
}
