package reliability

import (
	"testing"

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

	rc := j.Config
	rc.Owner = "reader"
	b, err := bridge.Open(rc, bridge.Deps{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Close() })
	h := newHost(t, 1024)
	m, err := b.RegisterModel(spec(h, nil))
	require.NoError(t, err)
	r := &node{t: t, b: b, h: h, m: m}
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
