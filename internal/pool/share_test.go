package pool

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// The holder and reader processes of these tests are the test binary run
// again: TestMain turns into one when its variable is set.
const (
	holderEnv = "MCB_POOL_TEST_HOLDER" // the socket directory
	readerEnv = "MCB_POOL_TEST_READER" // a pool address to map
	groupEnv  = "MCB_POOL_TEST_GROUP"  // the holder's Access.GID
	nameEnv   = "MCB_POOL_TEST_NAME"   // the holder's socket, when not holder.sock
)

func TestMain(m *testing.M) {
	switch {
	case os.Getenv(holderEnv) != "":
		os.Exit(runHolder(os.Getenv(holderEnv)))
	case os.Getenv(readerEnv) != "":
		os.Exit(runReader(os.Getenv(readerEnv)))
	}
	os.Exit(m.Run())
}

// runHolder shares a pool with one block of smallGeometry in it, prints
// "<address> <block address> <generation>", and then rewrites the block
// at a fresh generation for each line read, printing it, until stdin ends.
func runHolder(dir string) int {
	gid := -1
	if g := os.Getenv(groupEnv); g != "" {
		_, _ = fmt.Sscan(g, &gid)
	}
	p, err := NewShared(1 << 20)
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	name := "holder.sock"
	if n := os.Getenv(nameEnv); n != "" {
		name = n
	}
	s, err := p.Share(dir, name, Access{GID: gid})
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	g := smallGeometry()
	blk := p.Bytes(0, int64(g.Size()))
	write := func(fill byte) uint64 {
		gen := p.NextGeneration()
		BeginWrite(blk, gen)
		h := sampleHeader(g)
		for l := range h.LayerSums {
			layer := blk[g.LayerOffset(l) : g.LayerOffset(l)+g.LayerSize(l)]
			for i := range layer {
				layer[i] = fill + byte(i)
			}
			h.LayerSums[l] = Sum(layer)
		}
		_ = EncodeHeader(blk, g, h)
		EndWrite(blk, gen)
		return gen
	}
	fmt.Println(s.Address(), p.Base(), write(1))
	in := bufio.NewScanner(os.Stdin)
	for fill := byte(2); in.Scan(); fill++ {
		fmt.Println(write(fill))
	}
	_ = s.Close()
	return 0
}

// runReader maps the pool at addr and says whether it could.
func runReader(addr string) int {
	a, err := ParseAddress(addr)
	if err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		var m *Mapped
		if m, err = Map(ctx, a); err == nil {
			_ = m.Close()
		}
	}
	fmt.Println("map:", err)
	return 0
}

type holder struct {
	cmd   *exec.Cmd
	in    io.WriteCloser
	out   *bufio.Scanner
	addr  Address
	block uint64
	gen   uint64
}

func startHolder(t *testing.T, dir string, env ...string) *holder {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(append(os.Environ(), holderEnv+"="+dir), env...)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	require.NoError(t, err)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	h := &holder{cmd: cmd, in: in, out: bufio.NewScanner(out)}
	t.Cleanup(func() {
		_ = h.cmd.Process.Signal(syscall.SIGCONT)
		_ = h.in.Close()
		_ = h.cmd.Wait()
	})
	require.True(t, h.out.Scan(), "the holder said nothing")
	var addr string
	_, err = fmt.Sscan(h.out.Text(), &addr, &h.block, &h.gen)
	require.NoError(t, err, "holder: %s", h.out.Text())
	h.addr, err = ParseAddress(addr)
	require.NoError(t, err)
	return h
}

// rewrite has the holder write its block again and returns the generation.
func (h *holder) rewrite(t *testing.T) uint64 {
	_, err := io.WriteString(h.in, "rewrite\n")
	require.NoError(t, err)
	require.True(t, h.out.Scan())
	var gen uint64
	_, err = fmt.Sscan(h.out.Text(), &gen)
	require.NoError(t, err)
	return gen
}

func (h *holder) expect() *Expect {
	s := sampleHeader(smallGeometry())
	return &Expect{Key: s.Key, Parent: s.Parent, Model: s.Model, Tokens: s.Tokens, Generation: h.gen}
}

func mapHolder(t *testing.T, h *holder) []byte {
	t.Helper()
	m, err := Map(context.Background(), h.addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close() })
	b, err := m.Block(h.block, uint64(smallGeometry().Size()))
	require.NoError(t, err)
	return b
}

// Another process's pool maps read-only with the block it wrote, whole;
// the reader cannot write into it.
func TestShareMapsAnotherProcesssPool(t *testing.T) {
	h := startHolder(t, t.TempDir())
	b := mapHolder(t, h)
	_, _, err := VerifyBlock(b, h.expect())
	require.NoError(t, err)
	old := debug.SetPanicOnFault(true)
	defer debug.SetPanicOnFault(old)
	require.Panics(t, func() { b[200]++ }, "a reader wrote into the holder's pool")
}

// A stopped holder delays no read of its pool once mapped, and a killed
// one leaves the mapping valid; only a new mapping waits for a holder,
// and no longer than its deadline.
func TestShareHolderStoppedOrKilled(t *testing.T) {
	h := startHolder(t, t.TempDir())
	b := mapHolder(t, h)
	testenv.Freeze(t, h.cmd.Process.Pid)
	_, _, err := VerifyBlock(b, h.expect())
	require.NoError(t, err, "reading a stopped holder's block")
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err = Map(ctx, h.addr)
	require.Equal(t, status.Timeout, status.Of(err), "a new mapping of a stopped holder: %v", err)

	require.NoError(t, h.cmd.Process.Kill())
	_ = h.cmd.Wait()
	_, _, err = VerifyBlock(b, h.expect())
	require.NoError(t, err, "reading a killed holder's block")
	_, err = Map(context.Background(), h.addr)
	require.Equal(t, status.Transfer, status.Of(err), "a killed holder's socket answered: %v", err)
}

// A block the holder rewrites fails the generation the directory named,
// read before or after the copy.
func TestShareRewrittenBlockFailsItsGeneration(t *testing.T) {
	h := startHolder(t, t.TempDir())
	b := mapHolder(t, h)
	copied := append([]byte(nil), b...)
	gen := h.rewrite(t)
	require.NotEqual(t, h.gen, gen)
	require.Equal(t, gen, Generation(b), "the mapping shows the holder's rewrite")
	_, _, err := VerifyBlock(b, h.expect())
	require.Equal(t, status.Corrupt, status.Of(err))
	_, _, err = VerifyBlock(copied, h.expect())
	require.NoError(t, err, "the copy taken before the rewrite is the block")
}

// A holder restarted at the same path is another pool: an address of the
// old one is refused, not mapped onto the new one.
func TestShareRestartedHolderIsAnotherPool(t *testing.T) {
	dir := t.TempDir()
	first := startHolder(t, dir)
	require.NoError(t, first.in.Close())
	require.NoError(t, first.cmd.Wait())
	second := startHolder(t, dir)
	require.Equal(t, first.addr.Path, second.addr.Path)
	_, err := Map(context.Background(), first.addr)
	require.Equal(t, status.NotFound, status.Of(err), "%v", err)
	_, err = Map(context.Background(), second.addr)
	require.NoError(t, err)
}

// Another user maps nothing; a member of the configured group does.
func TestShareOtherUsers(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run a reader as another user")
	}
	const nobody, nogroup = 65534, 65534
	// The reader runs this binary as nobody: a copy where nobody can
	// reach it.
	bin := filepath.Join(worldDir(t), "pool.test")
	exe, err := os.ReadFile(os.Args[0])
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(bin, exe, 0o755))
	read := func(addr Address, gid uint32) string {
		cmd := exec.Command(bin, "-test.run=^$")
		cmd.Env = append(os.Environ(), readerEnv+"="+addr.String())
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: gid}}
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "%s", out)
		return strings.TrimSpace(string(out))
	}
	private := startHolder(t, filepath.Join(worldDir(t), "private"))
	require.Contains(t, read(private.addr, nogroup), "permission denied")
	shared := startHolder(t, filepath.Join(worldDir(t), "shared"), fmt.Sprintf("%s=%d", groupEnv, nogroup))
	require.Equal(t, "map: <nil>", read(shared.addr, nogroup))
	require.Contains(t, read(shared.addr, 1), "permission denied", "nobody outside the group")
	st, err := os.Stat(shared.addr.Path)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o660), st.Mode().Perm())
}

// worldDir is a temporary directory every user can enter.
func worldDir(t *testing.T) string {
	d, err := os.MkdirTemp("", "mcb-pool-")
	require.NoError(t, err)
	require.NoError(t, os.Chmod(d, 0o755))
	t.Cleanup(func() { _ = os.RemoveAll(d) })
	return d
}

// The socket directory is refused where another user could plant a socket
// in it or it is not a directory of this user's.
func TestSocketDir(t *testing.T) {
	base := t.TempDir()
	d := filepath.Join(base, "s")
	require.NoError(t, SocketDir(d, Access{GID: -1}))
	st, err := os.Lstat(d)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), st.Mode().Perm())
	require.NoError(t, os.Chmod(d, 0o777))
	require.NoError(t, SocketDir(d, Access{GID: -1}))
	st, err = os.Lstat(d)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), st.Mode().Perm(), "a directory others could write is narrowed")

	link := filepath.Join(base, "link")
	require.NoError(t, os.Symlink(d, link))
	require.Equal(t, status.Config, status.Of(SocketDir(link, Access{GID: -1})), "a link")
	file := filepath.Join(base, "file")
	require.NoError(t, os.WriteFile(file, nil, 0o600))
	require.Equal(t, status.Config, status.Of(SocketDir(file, Access{GID: -1})), "a file")
	if os.Geteuid() == 0 {
		other := filepath.Join(base, "other")
		require.NoError(t, os.Mkdir(other, 0o700))
		require.NoError(t, os.Chown(other, 65534, 65534))
		require.Equal(t, status.Config, status.Of(SocketDir(other, Access{GID: -1})), "another user's directory")
	}
}

func TestParseAddress(t *testing.T) {
	a := Address{ID: 0xfedcba9876543210, Path: "/run/user/1000/mcbridge/pool-1.sock"}
	got, err := ParseAddress(a.String())
	require.NoError(t, err)
	require.Equal(t, a, got)
	for _, bad := range []string{"", "/x", "0123:/x", "0123456789ABCDEF:/x", "0123456789abcdef:rel", "0123456789abcdef:/" + strings.Repeat("x", MaxSocketPath)} {
		_, err := ParseAddress(bad)
		require.Equal(t, status.InvalidArg, status.Of(err), "%q", bad)
	}
}

// The mapped pool refuses addresses outside it, or not where a block can
// start.
func TestMappedBlockBounds(t *testing.T) {
	m := &Mapped{base: 0x10000, region: make([]byte, 4096)}
	for _, c := range []struct{ addr, n uint64 }{{0x0, 64}, {0xffc0, 64}, {0x10000, 0}, {0x10000, 4097}, {0x10fc0, 128}, {0x10001, 64}, {^uint64(0) - 63, 64}} {
		_, err := m.Block(c.addr, c.n)
		require.Equal(t, status.Corrupt, status.Of(err), "%#x +%d", c.addr, c.n)
	}
	b, err := m.Block(0x10fc0, 64)
	require.NoError(t, err)
	require.Len(t, b, 64)
}

// Peers maps a pool once, ahead of reads (Warm); a holder stopped after
// that delays no read, one stopped before costs a read its deadline, and
// mappings nobody uses for the idle period, or whose holder restarted,
// are dropped.
func TestPeers(t *testing.T) {
	now := time.Unix(1000, 0)
	ps := NewPeers(func() time.Time { return now }, 5*time.Second, time.Minute)
	defer ps.Close()
	dir := t.TempDir()
	h := startHolder(t, dir)
	ps.Warm(h.addr)
	m, release, err := ps.Get(context.Background(), h.addr)
	require.NoError(t, err)
	require.Equal(t, 1, ps.Mapped())

	testenv.Freeze(t, h.cmd.Process.Pid)
	again, release2, err := ps.Get(context.Background(), h.addr)
	require.NoError(t, err, "a mapped pool of a stopped holder")
	require.Same(t, m, again)
	release2()
	b, err := m.Block(h.block, uint64(smallGeometry().Size()))
	require.NoError(t, err)
	_, _, err = VerifyBlock(b, h.expect())
	require.NoError(t, err)

	other := startHolder(t, t.TempDir())
	testenv.Freeze(t, other.cmd.Process.Pid)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, _, err = ps.Get(ctx, other.addr)
	require.Equal(t, status.Timeout, status.Of(err), "%v", err)
	require.NoError(t, other.cmd.Process.Signal(syscall.SIGCONT))

	// Held by a read, the mapping stays past the idle period; released,
	// the next sweep drops it.
	now = now.Add(2 * time.Minute)
	_, rel, err := ps.Get(context.Background(), other.addr)
	require.NoError(t, err)
	rel()
	require.Equal(t, 2, ps.Mapped(), "the first mapping is still held")
	release()
	now = now.Add(2 * time.Minute)
	ps.Warm(other.addr)
	_, rel, err = ps.Get(context.Background(), other.addr)
	require.NoError(t, err)
	rel()
	require.Equal(t, 1, ps.Mapped(), "the idle mapping was dropped")
}

// Sharing a pool removes the sockets of holders that are gone (killed,
// they could not unlink theirs) and leaves those of live holders.
func TestShareSweepsDeadSockets(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, SocketDir(dir, Access{GID: -1}))
	dead, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(dir, "dead.sock"), Net: "unix"})
	require.NoError(t, err)
	dead.SetUnlinkOnClose(false)
	require.NoError(t, dead.Close())
	live := startHolder(t, dir)
	p, err := NewShared(1 << 20)
	require.NoError(t, err)
	defer p.Close()
	s, err := p.Share(dir, "new.sock", Access{GID: -1})
	require.NoError(t, err)
	defer s.Close()
	_, err = os.Stat(filepath.Join(dir, "dead.sock"))
	require.True(t, os.IsNotExist(err), "the dead holder's socket is still there: %v", err)
	_, err = os.Stat(live.addr.Path)
	require.NoError(t, err, "the live holder's socket")
	m, err := Map(context.Background(), live.addr)
	require.NoError(t, err)
	require.NoError(t, m.Close())
}

// A follower maps every pool of its directory, those there before it and
// those that appear after, before anything asks for them, and keeps a
// killed holder's pool readable; a holder's clean exit and a killed
// holder's dead socket each unpin its mapping, which then goes once idle.
func TestFollowDir(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, SocketDir(dir, Access{GID: -1}))
	var mu sync.Mutex
	now := time.Unix(1000, 0)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	const idle = 50 * time.Millisecond
	ps := NewPeers(clock, 5*time.Second, idle)
	defer ps.Close()
	first := startHolder(t, dir, nameEnv+"=first.sock")
	own := filepath.Join(dir, "own.sock")
	require.NoError(t, os.WriteFile(own, nil, 0o600))
	stop, err := ps.FollowDir(dir, own, idle)
	require.NoError(t, err)
	defer stop()
	later := startHolder(t, dir, nameEnv+"=later.sock")
	followed := func() []string { p := ps.Followed(); sort.Strings(p); return p }
	require.Eventually(t, func() bool { return len(followed()) == 2 }, 10*time.Second, time.Millisecond)
	require.Equal(t, []string{first.addr.Path, later.addr.Path}, followed(), "the own socket is not followed")

	// Killed, the holder's pool stays mapped: the follower asked for it
	// before anything did, and a read needs nothing from the holder.
	require.NoError(t, later.cmd.Process.Kill())
	_ = later.cmd.Wait()
	m, release, err := ps.Get(context.Background(), later.addr)
	require.NoError(t, err, "a killed holder's pool, followed")
	b, err := m.Block(later.block, uint64(smallGeometry().Size()))
	require.NoError(t, err)
	_, _, err = VerifyBlock(b, later.expect())
	require.NoError(t, err, "a killed holder's block")
	release()

	// Its socket is left behind, refusing: the liveness check unpins it.
	require.Eventually(t, func() bool { return len(followed()) == 1 }, 10*time.Second, time.Millisecond)
	require.Equal(t, []string{first.addr.Path}, followed())
	// The other exits cleanly and unlinks its socket.
	require.NoError(t, first.in.Close())
	require.NoError(t, first.cmd.Wait())
	require.Eventually(t, func() bool { return len(followed()) == 0 }, 10*time.Second, time.Millisecond)
	require.Equal(t, 2, ps.Mapped(), "unpinned mappings stay until idle")
	mu.Lock()
	now = now.Add(time.Minute)
	mu.Unlock()
	_, _, err = ps.Get(context.Background(), later.addr)
	require.Error(t, err, "the killed holder's pool, unpinned and idle, was dropped and cannot be mapped again")
	require.Zero(t, ps.Mapped())
}
