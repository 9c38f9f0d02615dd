package bench

import (
	"fmt"
	"io"
	"os"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvhost"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// The holder of BenchmarkSharedHolderStopped is this test binary run
// again with holderEnv set to the etcd endpoint.
const (
	holderEnv    = "MCB_BENCH_HOLDER_ETCD"
	holderDirEnv = "MCB_BENCH_HOLDER_DIR"
)

func TestMain(m *testing.M) {
	if ep := os.Getenv(holderEnv); ep != "" {
		os.Exit(runHolder(ep, os.Getenv(holderDirEnv)))
	}
	os.Exit(m.Run())
}

// stoppedGeometry and stoppedBlocks are what the holder saves: the bench
// model's 3 MiB blocks, 16 of them (4096 tokens).
var stoppedGeometry = geoBench

const stoppedBlocks = 16

// sharedConfig is a one-host swarm's configuration: etcd at endpoint, shared
// pools in dir, the in-process engine.
func sharedConfig(owner, endpoint, dir string) config.Config {
	g := stoppedGeometry
	cfg := config.Default()
	cfg.Owner = owner
	cfg.BlockTokens = blockTokens
	cfg.PoolBytes = (stoppedBlocks + 2) * (g.blockBytes() + g.blockBytes()/64 + 4096)
	cfg.Directory = config.Directory{Kind: "etcd", Endpoints: []string{endpoint}, Prefix: "/bench-stopped", LeaseTTLS: 60, OpTimeoutMS: 5000}
	cfg.SharedPool = config.SharedPool{Enabled: true, Dir: dir}
	cfg.TransferTimeoutMS = 60_000
	return cfg
}

// runHolder saves the prompt, says "ready", and holds it until stdin ends.
func runHolder(endpoint, dir string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "holder:", err); return 1 }
	b, err := bridge.Open(sharedConfig("holder", endpoint, dir), bridge.Deps{})
	if err != nil {
		return fail(err)
	}
	defer b.Close()
	g := stoppedGeometry
	n := stoppedBlocks * blockTokens
	h, err := kvhost.New(g.layers, n, g.row, g.row)
	if err != nil {
		return fail(err)
	}
	defer h.Close()
	m, err := b.RegisterModel(h.Spec(g.name, blockTokens))
	if err != nil {
		return fail(err)
	}
	tokens := promptTokens(n, 7)
	h.Compute(tokens, 0, n)
	if _, err := save(m, h, key.Scope{}, tokens); err != nil {
		return fail(err)
	}
	fmt.Println("ready")
	_, _ = io.Copy(io.Discard, os.Stdin)
	return 0
}

// BenchmarkSharedHolderStopped restores a 4096-token prefix (48 MiB) that
// another process holds in its shared pool, in interleaved rounds with the
// holder running and stopped (SIGSTOP, every thread stopped). x_live is
// the stopped rounds' median restore time over the running rounds': a
// holder's state costs a restore from its mapped pool nothing, so it is
// 1 within the noise. x_memcpy is the running rounds' median against a
// memcpy of the same bytes on the restore's threads, same rounds.
func BenchmarkSharedHolderStopped(b *testing.B) {
	etcd := etcdtest.Start(b)
	dir := b.TempDir()
	holder := testenv.StartChild(b, nil, holderEnv+"="+etcd.Endpoint(), holderDirEnv+"="+dir)
	cmd := holder.Cmd
	b.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = holder.Stdin.Close()
		_ = cmd.Wait()
	})
	line, err := holder.Out.ReadString('\n')
	require.NoError(b, err)
	require.Equal(b, "ready\n", line)

	reader, err := bridge.Open(sharedConfig("reader", etcd.Endpoint(), dir), bridge.Deps{})
	require.NoError(b, err)
	b.Cleanup(func() { _ = reader.Close() })
	g := stoppedGeometry
	n := stoppedBlocks * blockTokens
	r := &restoreRig{src: newHost(b, g, n), dst: newHost(b, g, n), tokens: promptTokens(n, 7),
		cells: kvhost.Positions(n), blocks: stoppedBlocks, payload: int64(n) * g.bytesPerToken()}
	r.src.Compute(r.tokens, 0, n)
	r.reader = register(b, reader, r.dst, g.name)
	testenv.Eventually(b, time.Minute, func() bool {
		p, err := r.reader.Lookup(key.Scope{}, append(slices.Clone(r.tokens), 1), 0)
		return err == nil && p.MatchedBlocks == stoppedBlocks
	}, "the reader's mirror never held the holder's blocks")
	require.NoError(b, r.restore()) // pages in, maps the pool
	require.NoError(b, r.check())

	var live, stopped, memcpy []time.Duration
	timed := func(f func() error) time.Duration {
		start := time.Now()
		require.NoError(b, f())
		return time.Since(start)
	}
	b.SetBytes(r.payload)
	b.ResetTimer()
	for range b.N {
		live = append(live, timed(r.restore))
		memcpy = append(memcpy, timed(func() error { r.memcpy(); return nil }))
		b.StopTimer()
		testenv.Freeze(b, cmd.Process.Pid)
		b.StartTimer()
		stopped = append(stopped, timed(r.restore))
		require.NoError(b, r.check())
		b.StopTimer()
		require.NoError(b, cmd.Process.Signal(syscall.SIGCONT))
		b.StartTimer()
	}
	require.Equal(b, int64(stoppedBlocks)*int64(2*b.N+1), reader.Stats().SharedPoolBlocks, "blocks read from the holder's mapped pool")
	b.ReportMetric(float64(medianDuration(stopped))/float64(medianDuration(live)), "x_live")
	b.ReportMetric(float64(medianDuration(memcpy))/float64(medianDuration(live)), "x_memcpy")
}

func medianDuration(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2]
}
