// Package swarm runs bridges in several processes that share KV through
// etcd and the Transfer Engine, loaded through purego: one saves, others
// restore and check every byte; peers die mid-transfer; a store node keeps
// blocks after their owners exit; etcd goes away. Every test runs on the
// mock TE and on the real libtransfer_engine.so ($MCB_TE_REAL_LIB), as
// subtests /mock and /real; a real variant fails when the library is
// missing.
//
// The test binary re-executes itself for each child process, with
// MCB_SWARM_ROLE naming what the child does.
package swarm

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/storenode"
	"github.com/mcbridge/mcbridge/internal/testenv"
	"github.com/mcbridge/mcbridge/internal/transport/mooncake"
)

var mockLib string

// envRealLibrary names the real libtransfer_engine.so (make test sets it
// from scripts/mooncake/build.sh te).
const envRealLibrary = "MCB_TE_REAL_LIB"

// impl is a Transfer Engine library a test runs on.
type impl struct {
	name string
	lib  string
}

func (i impl) mock() bool { return i.name == "mock" }

// forImpls runs f as subtest /mock and /real. A real variant without the
// real library fails: it must not pass without having run.
func forImpls(t *testing.T, f func(t *testing.T, im impl)) {
	t.Run("mock", func(t *testing.T) { f(t, impl{"mock", mockLib}) })
	t.Run("real", func(t *testing.T) {
		p := os.Getenv(envRealLibrary)
		require.NotEmpty(t, p, "%s is unset: it must name the real libtransfer_engine.so (make test sets it from scripts/mooncake/build.sh te)", envRealLibrary)
		lib, err := mooncake.Load(p)
		require.NoError(t, err, "%s=%s does not load", envRealLibrary, p)
		require.False(t, lib.Has("mock_te_set_fault"), "%s=%s is the mock", envRealLibrary, p)
		f(t, impl{"real", p})
	})
}

func TestMain(m *testing.M) {
	if role := os.Getenv("MCB_SWARM_ROLE"); role != "" {
		os.Exit(child(role))
	}
	testenv.MainMockTE(m, &mockLib)
}

// job is what a child process is told: its bridge config, the host shape
// and the prompt, all derived from a seed so every process agrees.
type job struct {
	Config      config.Config
	Layers      int
	Cells       int
	KRow, VRow  int
	BlockTokens int
	Tokens      int
	Seed        int64
	Blocks      int // blocks a restorer must find before it loads
}

func (j job) host(tb kvtest.TB) *kvtest.Host {
	return kvtest.New(tb, j.Layers, j.Cells, j.KRow, j.VRow, false)
}

func (j job) tokens() []int32 {
	return kvtest.Tokens(rand.New(rand.NewSource(j.Seed)), j.Tokens)
}

func (j job) register(tb helperTB, b *bridge.Bridge, h *kvtest.Host) *bridge.Model {
	p, krow, vrow, velem := h.Model(j.BlockTokens)
	m, err := b.RegisterModel(bridge.ModelSpec{Params: p, KRow: krow, VRow: vrow, VElem: velem})
	require.NoError(tb, err)
	return m
}

// helperTB is what the helpers that run both in the test process (with a
// *testing.T) and in a child (with childTB) need: kvtest's and testify's.
type helperTB interface {
	kvtest.TB
	require.TestingT
}

// childTB lets a child process use kvtest and testify: a failure ends the
// process with its message on stderr, and memory lives until exit.
type childTB struct{}

func (childTB) Fatal(args ...any) {
	fmt.Fprintln(os.Stderr, args...)
	os.Exit(1)
}

func (childTB) Errorf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, format+"\n", args...)
}

func (childTB) FailNow() { os.Exit(1) }

func (childTB) Cleanup(func()) {}

// child runs one role and returns the process's exit code.
func child(role string) int {
	var j job
	if err := json.Unmarshal([]byte(os.Getenv("MCB_SWARM_JOB")), &j); err != nil {
		fmt.Fprintln(os.Stderr, "bad job:", err)
		return 2
	}
	tb := childTB{}
	b, err := bridge.Open(j.Config, bridge.Deps{})
	if err != nil {
		fmt.Fprintln(os.Stderr, "open:", err)
		return 1
	}
	h := j.host(tb)
	m := j.register(tb, b, h)
	tokens := j.tokens()
	cells := kvtest.SeqCells(len(tokens))
	switch role {
	case "saver":
		h.Fill(tokens, cells)
		fmt.Printf("saved %d\n", save(tb, m, h, tokens, cells))
		// Stay alive, holding the blocks, until the parent closes stdin.
		_, _ = io.Copy(io.Discard, os.Stdin)
	case "restorer":
		n := waitMatched(m, tokens, j.Blocks, 20*time.Second)
		if n < j.Blocks {
			fmt.Fprintf(os.Stderr, "found %d of %d blocks\n", n, j.Blocks)
			return 1
		}
		h.Scribble()
		restore := tokens[:j.Blocks*j.BlockTokens]
		res, err := load(m, h, restore, cells[:len(restore)])
		if err != nil || res.OKTokens != len(restore) {
			fmt.Fprintf(os.Stderr, "load: %+v, %v\n", res, err)
			return 1
		}
		if err := h.Check(restore, cells[:len(restore)], len(restore)); err != nil {
			fmt.Fprintln(os.Stderr, "restored bytes:", err)
			return 1
		}
		fmt.Printf("restored %d\n", res.OKTokens)
	case "cutreader":
		if code := cutReader(j, m, h); code != 0 {
			return code
		}
	default:
		fmt.Fprintln(os.Stderr, "unknown role", role)
		return 2
	}
	if err := b.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "close:", err)
		return 1
	}
	return 0
}

// save seals the blocks of tokens, waits until the publisher has offered
// them to the directory and returns how many this process published.
func save(tb helperTB, m *bridge.Model, h *kvtest.Host, tokens []int32, cells []uint32) int {
	b := m.Bridge()
	before := b.Stats().SavedBlocks
	sv, err := m.SaveBegin(key.Scope{}, h.Layout(), tokens, cells)
	require.NoError(tb, err, "save begin")
	for l := range h.K {
		require.NoError(tb, sv.SaveLayer(l), "save layer")
	}
	_, err = sv.End()
	require.NoError(tb, err, "save end")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(tb, b.Flush(ctx), "publishing")
	return int(b.Stats().SavedBlocks - before)
}

func load(m *bridge.Model, h *kvtest.Host, tokens []int32, cells []uint32) (bridge.LoadResult, error) {
	ld, err := m.LoadBegin(key.Scope{}, h.Layout(), tokens, cells)
	if err != nil {
		return bridge.LoadResult{}, err
	}
	for l := range h.K {
		if _, err := ld.WaitLayer(l); err != nil {
			_, _ = ld.End()
			return bridge.LoadResult{}, err
		}
	}
	return ld.End()
}

// waitMatched polls Lookup until it matches want blocks: the mirror fills
// through the directory's watch, asynchronously.
func waitMatched(m *bridge.Model, tokens []int32, want int, limit time.Duration) int {
	deadline := time.Now().Add(limit)
	for {
		r, err := m.Lookup(key.Scope{}, tokens, 0)
		if err == nil && r.MatchedBlocks >= want || time.Now().After(deadline) {
			return r.MatchedBlocks
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// proc is a running child.
type proc struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *bufio.Reader
}

func start(t *testing.T, role string, j job) *proc {
	t.Helper()
	return startCmd(t, exec.Command(os.Args[0], "-test.run=^$"), role, j)
}

// startCmd runs cmd, which executes this test binary (perhaps through
// another program such as ip netns exec), as a child with a role and a job.
func startCmd(t *testing.T, cmd *exec.Cmd, role string, j job, env ...string) *proc {
	t.Helper()
	doc, err := json.Marshal(j)
	require.NoError(t, err)
	c := testenv.StartChild(t, cmd, append([]string{"MCB_SWARM_ROLE=" + role, "MCB_SWARM_JOB=" + string(doc)}, env...)...)
	p := &proc{cmd: c.Cmd, stdin: c.Stdin, out: c.Out}
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		_ = p.cmd.Wait()
	})
	return p
}

// expect reads the child's next line and checks its word and number.
func (p *proc) expect(t *testing.T, word string, n int) {
	t.Helper()
	line, err := p.out.ReadString('\n')
	require.NoError(t, err, "child said nothing")
	require.Equal(t, []string{word, strconv.Itoa(n)}, strings.Fields(line), "child said %q, want %q %d", line, word, n)
}

// finish closes the child's stdin and waits for a clean exit.
func (p *proc) finish(t *testing.T) {
	t.Helper()
	_ = p.stdin.Close()
	require.NoError(t, p.cmd.Wait(), "child")
}

// halt stops the child (SIGSTOP) and waits until every thread of it is
// stopped: kill returns before that, and a thread still running for a few
// milliseconds can serve a transfer.
func (p *proc) halt(t *testing.T) {
	t.Helper()
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGSTOP))
	require.Eventually(t, func() bool {
		tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", p.cmd.Process.Pid))
		if err != nil || len(tasks) == 0 {
			return false
		}
		for _, task := range tasks {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", p.cmd.Process.Pid, task.Name()))
			// The state follows the parenthesised command name.
			i := bytes.LastIndexByte(b, ')')
			if err != nil || i < 0 || i+2 >= len(b) || b[i+2] != 'T' {
				return false
			}
		}
		return true
	}, 5*time.Second, 100*time.Microsecond, "the child never stopped")
}

func (p *proc) kill() {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	_ = p.cmd.Wait()
}

// baseJob is a job over etcd at endpoint and the TE library lib.
func baseJob(t *testing.T, endpoint, owner, lib string) job {
	c := config.Default()
	c.Owner = owner
	c.PoolBytes = 64 << 20
	c.BlockTokens = 16
	c.TransferTimeoutMS = 5000
	c.Transport = config.Transport{Kind: "mooncake", Lib: lib, Metadata: "P2PHANDSHAKE", Protocol: "tcp", LocalHostname: "127.0.0.1"}
	c.Directory.Kind = "etcd"
	c.Directory.Endpoints = []string{endpoint}
	c.Directory.Prefix = "/" + strings.ReplaceAll(t.Name(), "/", "_")
	c.Directory.LeaseTTLS = 2
	return job{Config: c, Layers: 4, Cells: 256, KRow: 256, VRow: 256, BlockTokens: 16, Tokens: 8*16 + 5, Seed: 42, Blocks: 8}
}

// openParent opens a bridge in the test process, on an engine the test
// holds so it can steer the mock's path and faults.
func openParent(t *testing.T, j job) (*bridge.Bridge, *mooncake.Engine) {
	t.Helper()
	eng, err := mooncake.Open(mooncake.Config{Library: j.Config.Transport.Lib, LocalServerName: "127.0.0.1",
		PeerTimeout: time.Duration(j.Config.TransferTimeoutMS) * time.Millisecond})
	require.NoError(t, err)
	b, err := bridge.Open(j.Config, bridge.Deps{Transport: eng})
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = b.Close()
		_ = eng.Close()
	})
	return b, eng
}

func TestTwoProcesses(t *testing.T) {
	forImpls(t, func(t *testing.T, im impl) {
		srv := etcdtest.Start(t)
		j := baseJob(t, srv.Endpoint(), "saver", im.lib)
		saver := start(t, "saver", j)
		saver.expect(t, "saved", 8)
		paths := []struct {
			name string
			p    mooncake.Path
		}{{"default", mooncake.PathAuto}}
		if im.mock() {
			paths = []struct {
				name string
				p    mooncake.Path
			}{{"same-host", mooncake.PathVM}, {"tcp", mooncake.PathTCP}}
		}
		for _, path := range paths {
			t.Run(path.name, func(t *testing.T) {
				pj := j
				pj.Config.Owner = "reader-" + path.name
				b, eng := openParent(t, pj)
				if im.mock() {
					require.NoError(t, eng.SetPath(path.p))
				}
				h := pj.host(t)
				m := pj.register(t, b, h)
				tokens := pj.tokens()
				require.Equal(t, 8, waitMatched(m, tokens, 8, 20*time.Second), "blocks the mirror found")
				h.Scribble()
				cells := kvtest.ScatteredCells(rand.New(rand.NewSource(3)), 128, pj.Cells)
				res, err := load(m, h, tokens[:128], cells)
				require.NoError(t, err)
				require.Equal(t, 128, res.OKTokens)
				require.NoError(t, h.Check(tokens[:128], cells, 128))
				if im.mock() {
					st, err := eng.MockStats()
					require.NoError(t, err)
					moved := st.TCPBytes
					if path.p == mooncake.PathVM {
						moved = st.VMBytes
					}
					require.NotZero(t, moved, "the %s path moved nothing: %+v", path.name, st)
				}
			})
		}
		saver.finish(t)
	})
}

func TestSeveralProcesses(t *testing.T) {
	forImpls(t, func(t *testing.T, im impl) {
		srv := etcdtest.Start(t)
		j := baseJob(t, srv.Endpoint(), "saver", im.lib)
		saver := start(t, "saver", j)
		saver.expect(t, "saved", 8)
		var readers []*proc
		for i := 0; i < 3; i++ {
			rj := j
			rj.Config.Owner = fmt.Sprintf("reader-%d", i)
			readers = append(readers, start(t, "restorer", rj))
		}
		for _, r := range readers {
			r.expect(t, "restored", 128)
			r.finish(t)
		}
		saver.finish(t)
	})
}

// killedPeer is the setting of a peer killed while a reader pulls its
// blocks (blocks of several MiB each), with the reader's mirror full.
type killedPeer struct {
	victim *proc
	b      *bridge.Bridge
	eng    *mooncake.Engine
	h      *kvtest.Host
	m      *bridge.Model
	tokens []int32
	cells  []uint32
}

func newKilledPeer(t *testing.T, lib string) *killedPeer {
	srv := etcdtest.Start(t)
	j := baseJob(t, srv.Endpoint(), "victim", lib)
	j.KRow, j.VRow = 8192, 8192 // ~0.5 MiB per token row set: blocks of several MiB
	j.Config.PoolBytes = 512 << 20
	k := &killedPeer{victim: start(t, "saver", j)}
	k.victim.expect(t, "saved", 8)
	pj := j
	pj.Config.Owner = "reader"
	k.b, k.eng = openParent(t, pj)
	k.h = pj.host(t)
	k.m = pj.register(t, k.b, k.h)
	k.tokens = pj.tokens()
	require.Equal(t, 8, waitMatched(k.m, k.tokens, 8, 20*time.Second), "blocks the mirror found")
	k.cells = kvtest.SeqCells(128)
	return k
}

// afterKill checks the end of a load through the killed peer: it fails,
// restores nothing wrong, the dead peer's blocks leave the mirror once its
// lease expires, and the reader carries on with its own blocks.
func (k *killedPeer) afterKill(t *testing.T, ld *bridge.Load) {
	res, err := ld.End()
	require.Error(t, err, "load through a dead peer")
	require.Less(t, res.OKTokens, 128, "load through a dead peer")
	require.NoError(t, k.h.CheckRestored(k.tokens[:128], k.cells, res.OKTokens))
	t.Logf("dead peer: %d of 128 tokens restored, error: %v", res.OKTokens, err)
	require.Eventually(t, func() bool { return k.m.Mirrored() == 0 }, 20*time.Second, 20*time.Millisecond, "the dead peer's blocks are still mirrored")
	k.h.Fill(k.tokens, kvtest.SeqCells(len(k.tokens)))
	require.Equal(t, 8, save(t, k.m, k.h, k.tokens, kvtest.SeqCells(len(k.tokens))), "save after the failure")
}

// A peer killed while a reader pulls its blocks: the reader reports the
// blocks as failed, restores nothing wrong, carries on, and its mirror
// drops the dead peer's blocks once the lease expires. The transfers are
// held in flight by stopping the peer before the load (after a first load
// that opens its segment), then it is killed.
func TestPeerKilledMidTransfer(t *testing.T) {
	forImpls(t, func(t *testing.T, im impl) {
		k := newKilledPeer(t, im.lib)
		if im.mock() {
			// The mock's same-host path reads a stopped process; its TCP
			// path, like the real engine, waits for the peer to answer.
			require.NoError(t, k.eng.SetPath(mooncake.PathTCP))
		}
		res, err := load(k.m, k.h, k.tokens[:128], k.cells)
		require.NoError(t, err)
		require.Equal(t, 128, res.OKTokens, "the load before the kill")
		k.h.Scribble()
		k.victim.halt(t)
		ld, err := k.m.LoadBegin(key.Scope{}, k.h.Layout(), k.tokens[:128], k.cells)
		require.NoError(t, err)
		time.Sleep(200 * time.Millisecond)
		k.victim.kill()
		k.afterKill(t, ld)
	})
}

// TestPeerKilledMidTransferSameHost is the same over the mock's same-host
// path, which reads a stopped process: the mock's stall fault holds the
// transfers once 3 MiB have moved instead. Mock only.
func TestPeerKilledMidTransferSameHost(t *testing.T) {
	k := newKilledPeer(t, mockLib)
	require.NoError(t, k.eng.SetFault(mooncake.FaultStallAfter, 3<<20))
	k.h.Scribble()
	ld, err := k.m.LoadBegin(key.Scope{}, k.h.Layout(), k.tokens[:128], k.cells)
	require.NoError(t, err)
	time.Sleep(100 * time.Millisecond)
	k.victim.kill()
	require.NoError(t, k.eng.SetFault(mooncake.FaultStallAfter, -1))
	k.afterKill(t, ld)
}

// A store node holds the blocks after every process that computed them
// has gone, whether it exited or was killed, and a new process restores
// from it.
func TestStoreOutlivesProcesses(t *testing.T) {
	forImpls(t, func(t *testing.T, im impl) {
		srv := etcdtest.Start(t)
		j := baseJob(t, srv.Endpoint(), "saver", im.lib)
		sj := j
		sj.Config.Owner = "store"
		sj.Config.PoolBytes = 128 << 20
		store, _ := openParent(t, sj)
		node, err := storenode.New(store, storenode.Config{})
		require.NoError(t, err)
		require.NoError(t, node.Replicate())
		waitStat := func(what string, f func(bridge.Stats) bool) {
			t.Helper()
			require.Eventually(t, func() bool { return f(store.Stats()) }, 30*time.Second, 10*time.Millisecond, "store: %s never happened", what)
		}
		saver := start(t, "saver", j)
		saver.expect(t, "saved", 8)
		waitStat("8 copies", func(s bridge.Stats) bool { return s.Replicated == 8 })
		saver.finish(t) // a clean exit unpublishes; the store takes over
		waitStat("8 take-overs", func(s bridge.Stats) bool { return s.TakenOver == 8 })

		// Another prompt from a process that is killed: its lease expires.
		kj := j
		kj.Config.Owner, kj.Seed = "crasher", 7
		crasher := start(t, "saver", kj)
		crasher.expect(t, "saved", 8)
		waitStat("16 copies", func(s bridge.Stats) bool { return s.Replicated == 16 })
		crasher.kill()
		waitStat("16 take-overs", func(s bridge.Stats) bool { return s.TakenOver == 16 })

		for _, rj := range []job{j, kj} {
			rj.Config.Owner = "late-reader"
			r := start(t, "restorer", rj)
			r.expect(t, "restored", 128)
			r.finish(t)
		}
	})
}

// etcd down: saves still seal (the publisher holds them), lookups keep
// working from the local mirror, and publishing resumes when etcd is back.
func TestEtcdDown(t *testing.T) {
	forImpls(t, func(t *testing.T, im impl) {
		srv := etcdtest.Start(t)
		j := baseJob(t, srv.Endpoint(), "writer", im.lib)
		j.Config.Directory.OpTimeoutMS = 500
		b, _ := openParent(t, j)
		h := j.host(t)
		m := j.register(t, b, h)
		tokens := j.tokens()
		cells := kvtest.SeqCells(len(tokens))
		h.Fill(tokens, cells)
		require.Equal(t, 8, save(t, m, h, tokens, cells), "save")
		srv.Stop()
		before := b.Stats().SavedBlocks
		other := kvtest.Tokens(rand.New(rand.NewSource(9)), 64)
		h.Fill(other, kvtest.SeqCells(64))
		sv, err := m.SaveBegin(key.Scope{}, h.Layout(), other, kvtest.SeqCells(64))
		require.NoError(t, err)
		for l := range h.K {
			require.NoError(t, sv.SaveLayer(l))
		}
		res, err := sv.End()
		require.NoError(t, err, "a save with etcd down")
		require.Equal(t, 4, res.Queued, "blocks queued for the directory")
		r, err := m.Lookup(key.Scope{}, tokens, 0)
		require.NoError(t, err, "lookup with etcd down")
		require.Equal(t, 8, r.MatchedBlocks, "lookup with etcd down")
		require.Eventually(t, func() bool { return b.Health() != nil }, 20*time.Second, 50*time.Millisecond, "healthy with etcd down")
		require.Equal(t, before, b.Stats().SavedBlocks, "published with etcd down")
		srv.Restart()
		require.Eventually(t, func() bool { return b.Stats().SavedBlocks-before == 4 }, 30*time.Second, 100*time.Millisecond,
			"publishing never resumed")
	})
}
