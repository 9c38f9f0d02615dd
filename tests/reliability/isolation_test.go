package reliability

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
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

// socket is a listening TCP socket.
type socket struct {
	IP   net.IP
	Port int
}

func (s socket) String() string { return net.JoinHostPort(s.IP.String(), strconv.Itoa(s.Port)) }

// listeners returns the TCP sockets that process pid listens on, matched
// by inode between its file descriptors and /proc/PID/net/tcp{,6}.
func listeners(t *testing.T, pid int) []socket {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	fds, err := os.ReadDir(dir)
	require.NoError(t, err)
	inodes := map[string]bool{}
	for _, fd := range fds {
		link, err := os.Readlink(filepath.Join(dir, fd.Name()))
		if err == nil && strings.HasPrefix(link, "socket:[") {
			inodes[strings.TrimSuffix(strings.TrimPrefix(link, "socket:["), "]")] = true
		}
	}
	var out []socket
	for _, table := range []string{"tcp", "tcp6"} {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/%s", pid, table))
		require.NoError(t, err)
		for _, line := range strings.Split(string(b), "\n")[1:] {
			s, inode, listening, err := parseNetTCP(line)
			if err == nil && listening && inodes[inode] {
				out = append(out, s)
			}
		}
	}
	return out
}

// parseNetTCP reads one line of /proc/net/tcp or tcp6: the local address
// (hex words in host byte order, port in hex), whether the socket is in
// state LISTEN (0A), and its inode.
func parseNetTCP(line string) (s socket, inode string, listening bool, err error) {
	f := strings.Fields(line)
	if len(f) < 10 {
		return s, "", false, fmt.Errorf("%d fields", len(f))
	}
	host, port, ok := strings.Cut(f[1], ":")
	if !ok || (len(host) != 8 && len(host) != 32) {
		return s, "", false, fmt.Errorf("local address %q", f[1])
	}
	raw, err := hex.DecodeString(host)
	if err != nil {
		return s, "", false, err
	}
	p, err := strconv.ParseUint(port, 16, 16)
	if err != nil {
		return s, "", false, err
	}
	// Each 32-bit word is printed as the kernel holds it: little-endian
	// on the machines this runs on.
	ip := make(net.IP, len(raw))
	for i := 0; i < len(raw); i += 4 {
		binary.BigEndian.PutUint32(ip[i:], binary.LittleEndian.Uint32(raw[i:]))
	}
	return socket{IP: ip, Port: int(p)}, f[9], f[3] == "0A", nil
}

func FuzzParseNetTCP(f *testing.F) {
	f.Add("   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 12345 1 0000000000000000 100 0 0 10 0")
	f.Add("   1: 00000000000000000000000001000000:0016 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 999 1")
	f.Add("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode")
	f.Add("0: 0100007F: 0 0 0 0 0 0 0 0")
	f.Fuzz(func(t *testing.T, line string) {
		s, _, _, err := parseNetTCP(line)
		if err == nil {
			require.True(t, len(s.IP) == 4 || len(s.IP) == 16, "parsed %q into %v", line, s)
			require.GreaterOrEqual(t, s.Port, 0, "parsed %q into %v", line, s)
			require.LessOrEqual(t, s.Port, 65535, "parsed %q into %v", line, s)
		}
	})
}

func TestParseNetTCP(t *testing.T) {
	for _, tc := range []struct {
		line   string
		want   string
		listen bool
		inode  string
	}{
		{"   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 12345 1", "127.0.0.1:8080", true, "12345"},
		{"   3: 0200007F:9C40 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 77 1", "127.0.0.2:40000", false, "77"},
		{"   1: 00000000000000000000000001000000:0016 00000000000000000000000000000000:0000 0A 0:0 00:0 0 0 0 9 1", "[::1]:22", true, "9"},
	} {
		s, inode, listen, err := parseNetTCP(tc.line)
		assert.NoError(t, err, "%q", tc.line)
		assert.Equal(t, tc.want, s.String(), "%q", tc.line)
		assert.Equal(t, tc.listen, listen, "%q: listening", tc.line)
		assert.Equal(t, tc.inode, inode, "%q: inode", tc.line)
	}
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

// The mock Transfer Engine listens on the address it is configured with
// and nowhere else.
func TestEngineListensWhereConfigured(t *testing.T) {
	for _, host := range []string{"127.0.0.1", "127.0.0.2"} {
		eng, err := mooncake.Open(mooncake.Config{Library: mockLib, LocalServerName: host})
		require.NoError(t, err)
		_, portText, err := net.SplitHostPort(eng.LocalSegment())
		require.NoError(t, err)
		port, _ := strconv.Atoi(portText)
		var on []string
		for _, s := range listeners(t, os.Getpid()) {
			if s.Port == port {
				on = append(on, s.String())
			}
		}
		assert.Equal(t, []string{net.JoinHostPort(host, portText)}, on, "engine configured for %s (segment %s) listens on", host, eng.LocalSegment())
		dialRefused(t, net.JoinHostPort("127.0.0.3", portText))
		require.NoError(t, eng.Close())
	}
}

// mcbridge serve (built from this tree, or $MCB_MCBRIDGE_BIN) listens for
// HTTP on --listen, its engine on the configured local_hostname and its
// embedded etcd on --etcd-client-url; the one listener nobody configures
// is the embedded etcd's peer port, which takes a free loopback port.
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
	l, err := net.Listen("tcp", host+":0")
	require.NoError(t, err)
	etcdURL := "http://" + l.Addr().String()
	l.Close()
	cfg, err := json.Marshal(map[string]any{
		"pool_bytes":   4 << 20,
		"block_tokens": blockTokens,
		"transport":    map[string]any{"kind": "mooncake", "lib": mockLib, "local_hostname": host},
	})
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
	want := map[string]bool{addrs.HTTP: true, addrs.Segment: true, strings.TrimPrefix(etcdURL, "http://"): true}
	var peer []socket
	for _, s := range listeners(t, cmd.Process.Pid) {
		switch {
		case want[s.String()]:
			delete(want, s.String())
		case s.IP.Equal(net.IPv4(127, 0, 0, 1)) && len(peer) == 0:
			peer = append(peer, s) // the embedded etcd's peer port
		default:
			assert.Failf(t, "unconfigured listener", "serve listens on %s, which nothing configured", s)
		}
	}
	assert.Empty(t, want, "addresses serve does not listen on")
	resp, err := http.Get("http://" + addrs.HTTP + "/healthz")
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode, "/healthz: %s", resp.Status)
	_, httpPort, _ := net.SplitHostPort(addrs.HTTP)
	dialRefused(t, "127.0.0.1:"+httpPort)
	t.Logf("serve listens on http %s, engine %s, etcd %s, etcd peer %v", addrs.HTTP, addrs.Segment, etcdURL, peer)
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	exited = true
	assert.NoError(t, cmd.Wait(), "serve after SIGTERM")
}
