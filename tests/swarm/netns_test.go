package swarm

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
)

// hosts are two network namespaces joined by a veth pair on a private
// test subnet that exists only inside them: host A computes and saves,
// host B runs etcd and a reader. Nothing leaves the namespaces.
type hosts struct {
	a, b       string // namespace names
	ipA, ipB   string
	vethA      string
	etcdClient string
}

func run(t *testing.T, args ...string) {
	t.Helper()
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	require.NoError(t, err, "%s\n%s", strings.Join(args, " "), out)
}

func makeHosts(t *testing.T) *hosts {
	if os.Geteuid() != 0 {
		require.FailNow(t, "multi-host test: needs root to create network namespaces (make test runs as root in CI)")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		require.FailNow(t, "multi-host test: no ip command (Debian package iproute2; scripts/bootstrap.sh installs it)")
	}
	tag := strconv.Itoa(os.Getpid() % 100000)
	h := &hosts{a: "mcb" + tag + "a", b: "mcb" + tag + "b", ipA: "10.213.7.1", ipB: "10.213.7.2", vethA: "mcb" + tag + "va"}
	if out, err := exec.Command("ip", "netns", "add", h.a).CombinedOutput(); err != nil {
		require.FailNowf(t, "multi-host test: this machine does not allow network namespaces", "%v %s", err, out)
	}
	t.Cleanup(func() {
		_ = exec.Command("ip", "netns", "del", h.a).Run()
		_ = exec.Command("ip", "netns", "del", h.b).Run()
	})
	vethB := "mcb" + tag + "vb"
	run(t, "ip", "netns", "add", h.b)
	run(t, "ip", "link", "add", h.vethA, "type", "veth", "peer", "name", vethB)
	run(t, "ip", "link", "set", h.vethA, "netns", h.a)
	run(t, "ip", "link", "set", vethB, "netns", h.b)
	for _, c := range [][]string{
		{h.a, "ip", "addr", "add", h.ipA + "/24", "dev", h.vethA},
		{h.b, "ip", "addr", "add", h.ipB + "/24", "dev", vethB},
		{h.a, "ip", "link", "set", h.vethA, "up"},
		{h.b, "ip", "link", "set", vethB, "up"},
		{h.a, "ip", "link", "set", "lo", "up"},
		{h.b, "ip", "link", "set", "lo", "up"},
	} {
		run(t, append([]string{"ip", "netns", "exec", c[0]}, c[1:]...)...)
	}
	h.startEtcd(t)
	return h
}

// startEtcd runs etcd inside host B and waits until host A can reach it.
func (h *hosts) startEtcd(t *testing.T) {
	bin := etcdtest.Binary()
	if bin == "" {
		require.FailNow(t, "multi-host test: no etcd server binary (Debian package etcd-server; scripts/bootstrap.sh installs it)")
	}
	dir := t.TempDir()
	h.etcdClient = "http://" + h.ipB + ":2379"
	peer := "http://" + h.ipB + ":2380"
	cmd := exec.Command("ip", "netns", "exec", h.b, bin, "--name", "hostb", "--data-dir", filepath.Join(dir, "data"),
		"--listen-client-urls", h.etcdClient, "--advertise-client-urls", h.etcdClient,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", "hostb="+peer)
	logf, err := os.Create(filepath.Join(dir, "etcd.log"))
	require.NoError(t, err)
	cmd.Stdout, cmd.Stderr = logf, logf
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		logf.Close()
	})
	deadline := time.Now().Add(30 * time.Second)
	for {
		out, err := exec.Command("ip", "netns", "exec", h.a, "curl", "-fsS", "-m", "1", h.etcdClient+"/health").CombinedOutput()
		if err == nil && strings.Contains(string(out), "true") {
			return
		}
		require.False(t, time.Now().After(deadline), "etcd in host B never became reachable from host A: %v %s", err, out)
		time.Sleep(100 * time.Millisecond)
	}
}

// startIn runs a child in a namespace.
func startIn(t *testing.T, ns, role string, j job, env ...string) *proc {
	t.Helper()
	return startCmd(t, exec.Command("ip", "netns", "exec", ns, os.Args[0], "-test.run=^$"), role, j, env...)
}

// TestMultiHost restores across two hosts over the TE's TCP transport,
// then cuts host A off in the middle of a second restore: the reader on
// host B gets per-block failures, restores nothing wrong, and drops host
// A's blocks once its lease expires. Host A's link is throttled for the
// second restore, so that it takes seconds and the cut lands while bytes
// are on the wire; after the checks the link comes back, which lets the
// real engine's transfers (it has no timeout of its own on a silent link)
// end before the reader closes.
func TestMultiHost(t *testing.T) {
	forImpls(t, func(t *testing.T, im impl) {
		h := makeHosts(t)
		j := baseJob(t, h.etcdClient, "host-a", im.lib)
		j.KRow, j.VRow = 8192, 8192 // 1 MiB blocks: 8 MiB take 2 s on the throttled link
		j.Config.PoolBytes = 512 << 20
		j.Config.Transport.LocalHostname = h.ipA
		saver := startIn(t, h.a, "saver", j)
		saver.expect(t, "saved", 8)

		rj := j
		rj.Config.Owner = "host-b"
		rj.Config.Transport.LocalHostname = h.ipB
		// The mock's same-host path would read across the namespaces (they
		// share the kernel and the pid namespace), past any cut link: the
		// mock goes over TCP, whose status frames give up on a silent link
		// after 2 s (a payload already streaming waits, as the real one's).
		var env []string
		if im.mock() {
			env = []string{"MOCK_TE_PATH=tcp", "MOCK_TE_IO_TIMEOUT_MS=2000"}
		}
		whole := startIn(t, h.b, "restorer", rj, env...)
		whole.expect(t, "restored", 128)
		whole.finish(t)
		rj.Config.Owner = "host-b-cut"
		cut := startIn(t, h.b, "cutreader", rj, env...)
		cut.expect(t, "ready", 0)
		run(t, "ip", "netns", "exec", h.a, "tc", "qdisc", "add", "dev", h.vethA, "root", "tbf", "rate", "32mbit", "burst", "32kb", "latency", "2s")
		fmt.Fprintln(cut.stdin, "load")
		cut.expect(t, "loading", 0)
		time.Sleep(500 * time.Millisecond)
		run(t, "ip", "netns", "exec", h.a, "ip", "link", "set", h.vethA, "down")
		line, err := cut.out.ReadString('\n')
		require.NoError(t, err, "cut reader said %q", line)
		require.True(t, strings.HasPrefix(line, "failed "), "cut reader said %q", line)
		t.Logf("host A cut off mid-transfer: %s", strings.TrimSpace(line))
		cut.expect(t, "dropped", 0)
		run(t, "ip", "netns", "exec", h.a, "ip", "link", "set", h.vethA, "up")
		run(t, "ip", "netns", "exec", h.a, "tc", "qdisc", "del", "dev", h.vethA, "root")
		// The payload that was streaming resumes at the sockets' next
		// retransmission, which backs off while the link is down: after the
		// seconds above it can come later than the close's wait for
		// in-flight batches (twice the transfer timeout), which then leaves
		// the pool mapped and fails. So the reader closes once nothing is
		// left unsent on either side.
		waitSent(t, h.a, h.b)
		cut.finish(t)
		saver.kill()
	})
}

// cutReader is the reader of TestMultiHost's cut: once its mirror is full
// it says "ready", starts a load when told, says "loading", and reports
// what arrived once the load ends, then when the mirror let go of host A.
func cutReader(j job, m *bridge.Model, h *kvtest.Host) int {
	tokens := j.tokens()
	if n := waitMatched(m, tokens, j.Blocks, 20*time.Second); n < j.Blocks {
		fmt.Fprintf(os.Stderr, "found %d of %d blocks\n", n, j.Blocks)
		return 1
	}
	fmt.Println("ready 0")
	in := bufio.NewReader(os.Stdin)
	if _, err := in.ReadString('\n'); err != nil {
		return 1
	}
	h.Scribble()
	n := j.Blocks * j.BlockTokens
	cells := kvtest.SeqCells(n)
	ld, err := m.LoadBegin(key.Scope{}, h.Layout(), tokens[:n], cells)
	if err != nil {
		fmt.Fprintln(os.Stderr, "load begin:", err)
		return 1
	}
	fmt.Println("loading 0")
	res, err := ld.End()
	if err == nil || res.OKTokens == n {
		fmt.Fprintf(os.Stderr, "load across a cut link succeeded: %+v\n", res)
		return 1
	}
	if err := h.CheckRestored(tokens[:n], cells, res.OKTokens); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Printf("failed %d\n", res.OKTokens)
	deadline := time.Now().Add(30 * time.Second)
	for m.Mirrored() > 0 {
		if time.Now().After(deadline) {
			fmt.Fprintf(os.Stderr, "host A's %d blocks never left the mirror; the directory holds:\n%s",
				m.Mirrored(), directoryDump(j))
			return 1
		}
		time.Sleep(20 * time.Millisecond)
	}
	fmt.Println("dropped 0")
	// The parent restores the link, then closes stdin: the bridge closes.
	_, _ = io.Copy(io.Discard, in)
	return 0
}

// waitSent waits until no TCP socket in the namespaces has bytes queued
// that the peer has not acknowledged (ss's Send-Q).
func waitSent(t *testing.T, namespaces ...string) {
	t.Helper()
	require.Eventually(t, func() bool {
		for _, ns := range namespaces {
			out, err := exec.Command("ip", "netns", "exec", ns, "ss", "-tnH").Output()
			if err != nil {
				return false
			}
			for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
				if f := strings.Fields(line); len(f) >= 3 && f[2] != "0" {
					return false
				}
			}
		}
		return true
	}, time.Minute, 50*time.Millisecond, "bytes stayed unsent on the restored link")
}

// directoryDump lists what etcd holds under the job's prefix, with each
// key's lease and its remaining TTL: it tells a mirror that missed a
// deletion from a lease that did not expire.
func directoryDump(j job) string {
	cli, err := clientv3.New(clientv3.Config{Endpoints: j.Config.Directory.Endpoints, DialTimeout: 2 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		return fmt.Sprintf("etcd client: %v\n", err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := cli.Get(ctx, j.Config.Directory.Prefix, clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		return fmt.Sprintf("etcd get: %v\n", err)
	}
	var b strings.Builder
	for _, kv := range resp.Kvs {
		ttl := int64(-1)
		if kv.Lease != 0 {
			if l, err := cli.TimeToLive(ctx, clientv3.LeaseID(kv.Lease)); err == nil {
				ttl = l.TTL
			}
		}
		fmt.Fprintf(&b, "  %s lease %x ttl %d\n", kv.Key, kv.Lease, ttl)
	}
	fmt.Fprintf(&b, "  (%d keys at revision %d)\n", len(resp.Kvs), resp.Header.Revision)
	return b.String()
}
