package reliability

import (
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// A one-host swarm with shared pools (docs/design.md §8.2): the owner, a
// process of its own with the in-process engine, listens on no TCP port;
// a reader restores its blocks from the mapped pool, with no transfer, and
// neither the owner stopped (SIGSTOP) nor killed (SIGKILL) keeps the
// reader from restoring every block, byte for byte.
func TestSharedPoolHolder(t *testing.T) {
	srv := etcdtest.Start(t)
	j := newJob("/shared-pool", srv.Endpoint())
	j.Config.Transport = config.Default().Transport // loopback: no port
	j.Config.SharedPool = config.SharedPool{Enabled: true, Dir: t.TempDir()}
	// The killed owner's entries stay listed for the whole test: a lease
	// that expired would leave nothing to restore, whatever the pool.
	j.Config.Directory.LeaseTTLS = 60
	o := startChild(t, "owner", j)
	require.Equal(t, fullBlocks, o.save(seedA, ""), "blocks the owner published")
	require.Empty(t, testenv.Listeners(t, o.cmd.Process.Pid), "TCP ports the owner listens on")

	r := openReader(t, j.Config)
	b, h, m := r.b, r.h, r.m
	a := prompt(seedA, promptLen)
	waitMatched(t, m, key.Scope{}, a, fullBlocks)

	restoreAll := func(when string) {
		t.Helper()
		before := b.Stats().SharedPoolBlocks
		out := r.restore(h, key.Scope{}, a)
		require.NoError(t, out.Err, when)
		require.Equal(t, fullBlocks*blockTokens, out.Restored, when)
		require.Equal(t, int64(fullBlocks), b.Stats().SharedPoolBlocks-before, "%s: blocks read from the mapped pool", when)
	}
	restoreAll("owner running")
	testenv.Freeze(t, o.cmd.Process.Pid)
	restoreAll("owner stopped")
	o.kill()
	restoreAll("owner killed")
	require.Zero(t, b.Stats().PeersDown, "the owner was never waited on")
}

// storeStats is what a child made a store node ("replicate") says of
// itself.
type storeStats struct{ mapped, replicated, takenOver int }

func (p *proc) storeStats() storeStats {
	p.t.Helper()
	f := p.do("stats")
	require.Len(p.t, f, 3)
	return storeStats{p.number(f[0:]), p.number(f[1:]), p.number(f[2:])}
}

// A store node maps every shared pool of its host as its socket appears,
// so it keeps the blocks of a holder killed right after publishing them,
// before the store heard of any (Ollama kills a runner as soon as its
// answer is out when keep_alive is 0). Here the store is stopped from the
// owner's save to its kill, and the engine is the in-process one: the
// mapping taken at the owner's start is the only way to its blocks. Once
// the owner's lease is gone, a reader restores every block, byte for
// byte, from the store.
func TestStoreKeepsKilledHoldersBlocks(t *testing.T) {
	srv := etcdtest.Start(t)
	j := newJob("/store-killed-holder", srv.Endpoint())
	j.Config.Transport = config.Default().Transport // loopback: no port
	j.Config.SharedPool = config.SharedPool{Enabled: true, Dir: t.TempDir()}
	sj := j
	sj.Config.Owner = "store"
	store := startChild(t, "owner", sj)
	store.do("replicate")
	j.Config.Owner = "runner"
	o := startChild(t, "owner", j)
	require.Eventually(t, func() bool { return store.storeStats().mapped == 1 }, 10*time.Second, time.Millisecond,
		"the store maps the new process's pool")

	testenv.Freeze(t, store.cmd.Process.Pid)
	require.Equal(t, fullBlocks, o.save(seedA, ""), "blocks the owner published")
	o.kill()
	require.NoError(t, syscall.Kill(store.cmd.Process.Pid, syscall.SIGCONT))

	require.Eventually(t, func() bool { return store.storeStats().takenOver == fullBlocks }, time.Minute, 10*time.Millisecond,
		"the store publishes its copies once the killed owner's lease is gone")
	require.Equal(t, fullBlocks, store.storeStats().replicated, "blocks the store copied")

	r := openReader(t, j.Config)
	b, h, m := r.b, r.h, r.m
	a := prompt(seedA, promptLen)
	waitMatched(t, m, key.Scope{}, a, fullBlocks)
	out := r.restore(h, key.Scope{}, a)
	require.NoError(t, out.Err)
	require.Equal(t, fullBlocks*blockTokens, out.Restored)
	r.verify(h, a, out.Restored)
	require.Equal(t, int64(fullBlocks), b.Stats().SharedPoolBlocks, "blocks read from the store's mapped pool")
}

// openReader is a bridge of the swarm c configures in the test process,
// with no engine of the test's: on the loopback transport it reaches
// other processes only through their shared pools.
func openReader(t *testing.T, c config.Config) *node {
	c.Owner = "reader"
	b, err := bridge.Open(c, bridge.Deps{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Close() })
	h := newHost(t, 1024)
	m, err := b.RegisterModel(spec(h, nil))
	require.NoError(t, err)
	return &node{t: t, b: b, h: h, m: m}
}
