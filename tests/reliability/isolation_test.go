package reliability

import (
	"context"
	"encoding/json"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/testenv"
	"github.com/mcbridge/mcbridge/internal/transport/mooncake"
)

// Two tenants sending the same prompt to processes that share etcd and
// the Transfer Engine never restore each other's blocks, and a lookup
// without a salt (or with another adapter set) hits no salted block.
func TestTenantSalt(t *testing.T) {
	srv := etcdtest.Start(t)
	j := newJob("/tenants", srv.Endpoint())
	o := startChild(t, "owner", j)
	r := openNode(t, j.Config, 1024, nil)
	a := prompt(seedA, promptLen)
	require.Equal(t, fullBlocks, o.save(seedA, "tenant-a"), "blocks tenant-a published")
	// The reader's mirror holds tenant-a's blocks before the others look.
	waitMatched(t, r.m, scope("tenant-a"), a, fullBlocks)
	others := []struct {
		name string
		sc   key.Scope
	}{
		{"tenant-b", scope("tenant-b")},
		{"no salt", key.Scope{}},
		{"tenant-a with an adapter", key.Scope{TenantSalt: []byte("tenant-a"), Adapters: "lora-x@1"}},
	}
	for _, o := range others {
		lk, err := r.m.Lookup(o.sc, a, 0)
		assert.NoError(t, err, "%s: lookup", o.name)
		assert.Zero(t, lk.MatchedBlocks, "%s: blocks of tenant-a the lookup matched", o.name)
		out := r.restore(r.h, o.sc, a)
		assert.Equal(t, status.NotFound, out.Code(), "%s: restore %+v", o.name, out)
		assert.Zero(t, out.Restored, "%s: restore %+v", o.name, out)
	}
	outA := r.restore(r.h, scope("tenant-a"), a)
	require.NoError(t, outA.Err, "tenant-a")
	require.Equal(t, outA.Asked, outA.Restored, "tenant-a: %+v", outA)
	// Each scope stores its own copy: nothing deduplicates across them.
	assert.Equal(t, fullBlocks, o.save(seedA, "tenant-b"), "tenant-b must publish its own blocks")
	assert.Equal(t, fullBlocks, o.save(seedA, ""), "the unsalted save must publish its own blocks")
	waitMatched(t, r.m, scope("tenant-b"), a, fullBlocks)
	outB := r.restore(r.h, scope("tenant-b"), a)
	require.NoError(t, outB.Err, "tenant-b")
	require.Equal(t, outB.Asked, outB.Restored, "tenant-b: %+v", outB)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := srv.Client().Get(ctx, "/tenants/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	require.NoError(t, err)
	assert.Equal(t, int64(3*fullBlocks), resp.Count, "keys etcd holds for three scopes of one prompt")
	o.quit()
}

// dialRefused checks that nothing answers at addr.
func dialRefused(t *testing.T, addr string) {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err == nil {
		c.Close()
	}
	if !assert.Error(t, err, "%s accepted a connection", addr) {
		return
	}
	assert.ErrorContains(t, err, "refused", "dialing %s: want connection refused", addr)
}

// Each Transfer Engine listens on the address it is configured with and
// nowhere else: the mock's one port, and the real engine's two (its P2P
// handshake port, which is its segment's, and its TCP transport's data
// port), with scripts/mooncake/patches/te/0001-listen-on-local-address.patch.
// Once closed, it listens nowhere.
func TestEngineListensWhereConfigured(t *testing.T) {
	for name, lib := range map[string]string{"mock": mockLib, "real": testenv.RealTE(t)} {
		t.Run(name, func(t *testing.T) {
			for _, host := range []string{"127.0.0.1", "127.0.0.2"} {
				before := addrSet(testenv.Listeners(t, os.Getpid()))
				eng, err := mooncake.Open(mooncake.Config{Library: lib, LocalServerName: host})
				require.NoError(t, err)
				var on []string
				for _, a := range testenv.Listeners(t, os.Getpid()) {
					if !before[a.String()] {
						on = append(on, a.String())
					}
				}
				_, segPort, err := net.SplitHostPort(eng.LocalSegment())
				require.NoError(t, err)
				assert.Contains(t, on, net.JoinHostPort(host, segPort), "the engine's segment %s", eng.LocalSegment())
				ports := map[string]int{"mock": 1, "real": 2}[name]
				assert.Len(t, on, ports, "the engine configured for %s listens on %v", host, on)
				for _, a := range on {
					h, port, err := net.SplitHostPort(a)
					require.NoError(t, err)
					assert.Equal(t, host, h, "the engine configured for %s listens on %s", host, a)
					dialRefused(t, net.JoinHostPort("127.0.0.3", port))
				}
				require.NoError(t, eng.Close())
				after := addrSet(testenv.Listeners(t, os.Getpid()))
				for _, a := range on {
					assert.False(t, after[a], "%s: still listening after the engine closed", a)
				}
			}
		})
	}
}

func addrSet(as []testenv.Addr) map[string]bool {
	m := map[string]bool{}
	for _, a := range as {
		m[a.String()] = true
	}
	return m
}

// mcbridge serve (built from this tree, or $MCB_MCBRIDGE_BIN) listens for
// HTTP on --listen, its engine on the configured local_hostname (the real
// engine on a second port there, its data port) and its embedded etcd on
// --etcd-client-url; the one listener nobody configures is the embedded
// etcd's peer port, which takes a free loopback port. On one host, with a
// shared pool and the loopback transport, it opens no transport port.
func TestServeListensWhereConfigured(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("reads /proc")
	}
	bin := os.Getenv("MCB_MCBRIDGE_BIN")
	if bin == "" {
		goBin, err := exec.LookPath("go")
		require.NoError(t, err, "no go command to build mcbridge with; set MCB_MCBRIDGE_BIN")
		bin = filepath.Join(t.TempDir(), "mcbridge")
		build := exec.Command(goBin, "build", "-o", bin, "github.com/mcbridge/mcbridge/cmd/mcbridge")
		out, err := build.CombinedOutput()
		require.NoError(t, err, "building mcbridge:\n%s", out)
	}
	const host = "127.0.0.3"
	for _, tc := range []struct {
		name      string
		cfg       map[string]any
		segment   bool // the printed segment is an address the engine listens on
		dataPorts int  // the engine's further ports on host
	}{
		{"mock", map[string]any{"transport": map[string]any{"kind": "mooncake", "lib": mockLib, "local_hostname": host}}, true, 0},
		{"real", map[string]any{"transport": map[string]any{"kind": "mooncake", "lib": testenv.RealTE(t), "local_hostname": host}}, true, 1},
		{"one host", map[string]any{"shared_pool": map[string]any{"enabled": true, "dir": filepath.Join(t.TempDir(), "pools")}}, false, 0},
	} {
		t.Run(strings.ReplaceAll(tc.name, " ", "_"), func(t *testing.T) {
			l, err := net.Listen("tcp", host+":0")
			require.NoError(t, err)
			etcdURL := "http://" + l.Addr().String()
			l.Close()
			tc.cfg["pool_bytes"], tc.cfg["block_tokens"] = 4<<20, blockTokens
			cfg, err := json.Marshal(tc.cfg)
			require.NoError(t, err)
			cmd := exec.Command(bin, "serve", "--listen", host+":0", "--config", string(cfg),
				"--embed-etcd", "--etcd-dir", t.TempDir(), "--etcd-client-url", etcdURL)
			cmd.Stderr = os.Stderr
			stdout, err := cmd.StdoutPipe()
			require.NoError(t, err)
			require.NoError(t, cmd.Start())
			exited := false
			t.Cleanup(func() {
				if !exited {
					_ = cmd.Process.Kill()
					_ = cmd.Wait()
				}
			})
			var addrs struct{ Segment, HTTP string }
			require.NoError(t, json.NewDecoder(stdout).Decode(&addrs), "serve printed no addresses")
			want := map[string]bool{addrs.HTTP: true, strings.TrimPrefix(etcdURL, "http://"): true}
			if tc.segment {
				want[addrs.Segment] = true
			}
			var peer, data []testenv.Addr
			for _, a := range testenv.Listeners(t, cmd.Process.Pid) {
				switch {
				case want[a.String()]:
					delete(want, a.String())
				case a.IP.Equal(net.IPv4(127, 0, 0, 1)) && len(peer) == 0:
					peer = append(peer, a) // the embedded etcd's peer port
				case a.IP.Equal(net.ParseIP(host)) && len(data) < tc.dataPorts:
					data = append(data, a) // the real engine's data port
				default:
					assert.Failf(t, "unconfigured listener", "serve listens on %s, which nothing configured", a)
				}
			}
			assert.Empty(t, want, "addresses serve does not listen on")
			assert.Len(t, data, tc.dataPorts, "the engine's data ports on %s", host)
			resp, err := http.Get("http://" + addrs.HTTP + "/healthz")
			require.NoError(t, err)
			resp.Body.Close()
			assert.Equal(t, http.StatusOK, resp.StatusCode, "/healthz: %s", resp.Status)
			_, httpPort, _ := net.SplitHostPort(addrs.HTTP)
			dialRefused(t, "127.0.0.1:"+httpPort)
			t.Logf("serve listens on http %s, engine %s and %v, etcd %s, etcd peer %v", addrs.HTTP, addrs.Segment, data, etcdURL, peer)
			require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
			exited = true
			assert.NoError(t, cmd.Wait(), "serve after SIGTERM")
		})
	}
}
