//go:build linux && (amd64 || arm64)

package mooncake

import (
	"net"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/store/mooncake/mastertest"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// A client that mounts a segment listens on its local_hostname and nowhere
// else, with either kind of metadata: the Transfer Engine it runs is built
// from the store tree's own copy of the engine's sources, with the engine's
// build patch (scripts/mooncake/patches/te/0001-listen-on-local-address.patch).
// Upstream binds every interface, and those ports serve the segment, which
// holds the swarm's KV, without authentication. With metadata on a server
// the binding sets the process's MC_TCP_BIND_ADDRESS, so that case runs in
// a process of its own, and there a client on another address is refused.
func TestClientListensWhereConfigured(t *testing.T) {
	for _, http := range []bool{false, true} {
		t.Run(map[bool]string{false: "P2PHANDSHAKE", true: "http metadata"}[http], func(t *testing.T) {
			if http {
				if !isolated(t) {
					return
				}
				// The parent's clients with HTTP metadata on 127.0.0.1 set it,
				// and this process inherited the parent's environment.
				require.NoError(t, os.Unsetenv(envBindAddress))
			}
			m := mastertest.Start(t, mastertest.Options{HTTPMetadata: http})
			const host = "127.0.0.2"
			before := map[string]bool{}
			for _, a := range testenv.Listeners(t, os.Getpid()) {
				before[a.String()] = true
			}
			cfg := Config{Library: mastertest.Lib(t), Master: m.Addr(), LocalHostname: host, SegmentBytes: 16 << 20}
			if http {
				cfg.Metadata = m.MetadataURL()
			}
			c, err := Open(ctxT(t, 30*time.Second), cfg)
			require.NoError(t, err)
			var on []string
			for _, a := range testenv.Listeners(t, os.Getpid()) {
				if !before[a.String()] {
					on = append(on, a.String())
				}
			}
			t.Logf("the client listens on %v", on)
			assert.NotEmpty(t, on, "a client with a segment serves it")
			for _, a := range on {
				h, port, err := net.SplitHostPort(a)
				require.NoError(t, err)
				assert.Equal(t, host, h, "the client configured for %s listens on %s (all: %v)", host, a, on)
				conn, err := net.DialTimeout("tcp", net.JoinHostPort("127.0.0.3", port), 2*time.Second)
				if err == nil {
					conn.Close()
				}
				assert.ErrorContains(t, err, "refused", "%s: reachable on another address", a)
			}
			if http {
				_, err := Open(ctxT(t, 30*time.Second), Config{Library: cfg.Library, Master: m.Addr(), Metadata: cfg.Metadata, SegmentBytes: 16 << 20})
				assert.Equal(t, status.Config, status.Of(err), "a second client on 127.0.0.1: %v", err)
				assert.ErrorContains(t, err, "MC_TCP_BIND_ADDRESS=127.0.0.2")
			}
			require.NoError(t, c.Close())
		})
	}
}
