// Package reliability injects faults into bridges that share KV across
// processes (etcd + the mock Transfer Engine) and checks that every restore
// either returns exactly the bytes a recompute would give or falls back with
// a clear status, leaking nothing; it runs a multi-process load with a store
// node, and checks tenant isolation, etcd TLS and authentication, and where
// engines listen.
//
// The test binary re-executes itself for child processes, with
// MCB_REL_ROLE naming what the child does: "owner" obeys commands read
// from stdin (save, scribble, quit), "load" runs the load generator.
package reliability

import (
	"bufio"
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
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

var mockLib string

func TestMain(m *testing.M) {
	if role := os.Getenv("MCB_REL_ROLE"); role != "" {
		os.Exit(child(role))
	}
	testenv.MainMockTE(m, &mockLib)
}

// Host and block shape shared by every process of a test: 4 layers of f16
// rows, blocks of 16 tokens, prompts of 8 blocks and 5 tokens.
const (
	layers      = 4
	rowBytes    = 256
	blockTokens = 16
	promptLen   = 8*blockTokens + 5
	fullBlocks  = 8
)

// job is what a child process is told.
type job struct {
	Config config.Config
	Cells  int
	Load   *loadJob // for role "load"
}

// newJob is a job over etcd at endpoint and the mock TE, keyed under a
// prefix of its own.
func newJob(prefix string, endpoints ...string) job {
	c := config.Default()
	c.PoolBytes = 2 << 20
	c.BlockTokens = blockTokens
	c.Arbiter.Policy = "always-restore"
	c.Transport = config.Transport{Kind: "mooncake", Lib: mockLib, Metadata: "P2PHANDSHAKE", Protocol: "tcp", LocalHostname: "127.0.0.1"}
	c.Directory.Kind = "etcd"
	c.Directory.Endpoints = endpoints
	c.Directory.Prefix = prefix
	c.Directory.LeaseTTLS = 2
	return job{Config: c, Cells: 1024}
}

func newHost(tb kvtest.TB, cells int) *kvtest.Host {
	return kvtest.New(tb, layers, cells, rowBytes, rowBytes, false)
}

// spec is the model a host of newHost registers; edit changes its
// fingerprint inputs (another llama.cpp version, other weights).
func spec(h *kvtest.Host, edit func(*key.Model)) bridge.ModelSpec {
	p, krow, vrow, velem := h.Model(blockTokens)
	if edit != nil {
		edit(&p)
	}
	return bridge.ModelSpec{Params: p, KRow: krow, VRow: vrow, VElem: velem}
}

// prompt is the token sequence every process derives from seed.
func prompt(seed int64, n int) []int32 {
	return kvtest.Tokens(rand.New(rand.NewSource(seed)), n)
}

func scope(salt string) key.Scope {
	if salt == "" || salt == "-" {
		return key.Scope{}
	}
	return key.Scope{TenantSalt: []byte(salt)}
}

// childTB lets a child use kvtest: a failure ends the process with its
// message on stderr; memory lives until exit.
type childTB struct{}

func (childTB) Fatal(args ...any) {
	fmt.Fprintln(os.Stderr, args...)
	os.Exit(1)
}

func (childTB) Cleanup(func()) {}

func child(role string) int {
	var j job
	if err := json.Unmarshal([]byte(os.Getenv("MCB_REL_JOB")), &j); err != nil {
		fmt.Fprintln(os.Stderr, "bad job:", err)
		return 2
	}
	switch role {
	case "owner":
		return runOwner(j)
	case "load":
		return runLoad(j)
	}
	fmt.Fprintln(os.Stderr, "unknown role", role)
	return 2
}

// proc is a running child.
type proc struct {
	t     *testing.T
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *bufio.Reader
	done  bool
}

func startChild(t *testing.T, role string, j job) *proc {
	t.Helper()
	doc, err := json.Marshal(j)
	require.NoError(t, err)
	c := testenv.StartChild(t, nil, "MCB_REL_ROLE="+role, "MCB_REL_JOB="+string(doc))
	p := &proc{t: t, cmd: c.Cmd, stdin: c.Stdin, out: c.Out}
	t.Cleanup(p.kill)
	return p
}

// do sends one command and returns the child's answer, which must start
// with word.
func (p *proc) do(word string, args ...any) []string {
	p.t.Helper()
	parts := []string{word}
	for _, a := range args {
		parts = append(parts, fmt.Sprint(a))
	}
	_, err := fmt.Fprintln(p.stdin, strings.Join(parts, " "))
	require.NoError(p.t, err, "child: sending %q", word)
	line, err := p.out.ReadString('\n')
	require.NoError(p.t, err, "child: no answer to %q", word)
	f := strings.Fields(line)
	require.NotEmpty(p.t, f, "child answered %q to %q", line, word)
	require.Equal(p.t, word, f[0], "child answered %q to %q", line, word)
	return f[1:]
}

// number is the first field of an answer as an int.
func (p *proc) number(f []string) int {
	p.t.Helper()
	require.NotEmpty(p.t, f, "child answered no number")
	n, err := strconv.Atoi(f[0])
	require.NoError(p.t, err)
	return n
}

// save makes the owner compute and save prompt(seed) under salt.
func (p *proc) save(seed int64, salt string) int {
	p.t.Helper()
	return p.number(p.do("save", seed, promptLen, saltArg(salt)))
}

func saltArg(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// quit closes the owner's bridge and waits for a clean exit.
func (p *proc) quit() {
	p.t.Helper()
	p.do("quit")
	_ = p.stdin.Close()
	require.NoError(p.t, p.cmd.Wait(), "child")
	p.done = true
}

// kill ends the child with SIGKILL: no unpublish, no lease revoke.
func (p *proc) kill() {
	if p.done {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	_ = p.cmd.Wait()
	p.done = true
}

// waitMatched polls Lookup until it matches want blocks: a mirror fills
// through the directory's watch, asynchronously.
func waitMatched(t *testing.T, m *bridge.Model, sc key.Scope, tokens []int32, want int) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		r, err := m.Lookup(sc, tokens, 0)
		require.NoError(t, err)
		if r.MatchedBlocks >= want {
			return
		}
		if time.Now().After(deadline) {
			require.FailNowf(t, "timed out", "the mirror found %d of %d blocks", r.MatchedBlocks, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
