// Package testenv runs the processes of the end-to-end tests and
// benchmarks: llama-servers (stock and patched), mcbridge commands, etcd,
// generated models. Binaries that take minutes to build come from the
// environment, set by `make test` (scripts/llama/build.sh,
// scripts/mooncake/build.sh); a test that cannot find one fails and says
// how to get it, it never skips.
package testenv

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/gguf"
)

// The environment `make test` sets for the end-to-end suites.
const (
	EnvStockServer     = "MCB_LLAMA_SERVER_STOCK"   // scripts/llama/build.sh stock
	EnvPatchedServer   = "MCB_LLAMA_SERVER_PATCHED" // scripts/llama/build.sh patched
	EnvRealTE          = "MCB_TE_REAL_LIB"          // scripts/mooncake/build.sh te: <dir>/install/lib/libtransfer_engine.so
	EnvStoreDir        = "MCB_MOONCAKE_STORE_DIR"   // scripts/mooncake/build.sh store: <dir>/out
	EnvBin             = "MCB_BIN"                  // mcbridge, else built from this tree
	EnvLibllama        = "MCB_LIBLLAMA_BUILD"       // the build of csrc/embed: libllama_test, libllama_test_asan
	EnvRPCServer       = "MCB_GGML_RPC_SERVER"      // scripts/llama/build.sh stock: ggml-rpc-server, next to llama-server
	EnvOllama          = "MCB_OLLAMA"               // scripts/ollama/build.sh: the pinned Ollama
	EnvArchModels      = "MCB_LLAMA_ARCHS"          // scripts/llama/archs.sh: test-llama-archs' models
	EnvArchBenchModels = "MCB_LLAMA_ARCHS_BENCH"    // scripts/llama/archs.sh bench: the memory kinds' benchmark models
)

// Binary returns the file an environment variable names, failing the test
// when it is unset or not there.
func Binary(tb testing.TB, env, what string) string {
	tb.Helper()
	p := os.Getenv(env)
	require.NotEmpty(tb, p, "%s is not set: it names %s (make test sets it)", env, what)
	st, err := os.Stat(p)
	require.NoError(tb, err, "%s=%s (%s)", env, p, what)
	require.False(tb, st.IsDir(), "%s=%s is a directory, want %s", env, p, what)
	return p
}

// ArchModels is the folder of the random-weight model of every
// architecture that the pinned tree's test-llama-archs writes
// (<arch>-dense.gguf, <arch>-moe.gguf).
func ArchModels(tb testing.TB) string {
	tb.Helper()
	return modelsDir(tb, EnvArchModels, "test-llama-archs' models (scripts/llama/archs.sh)")
}

// ArchBenchModels is the folder of test-llama-archs' models of the
// benchmarks of memory kinds: Llama, Gemma 3 and Qwen3.5 at the bench
// model's size (scripts/llama/archs.sh bench).
func ArchBenchModels(tb testing.TB) string {
	tb.Helper()
	return modelsDir(tb, EnvArchBenchModels, "test-llama-archs' bench-sized models (scripts/llama/archs.sh bench)")
}

func modelsDir(tb testing.TB, env, what string) string {
	tb.Helper()
	p := os.Getenv(env)
	require.NotEmpty(tb, p, "%s is not set: it names %s; make test sets it", env, what)
	st, err := os.Stat(p)
	require.NoError(tb, err, "%s=%s", env, p)
	require.True(tb, st.IsDir(), "%s=%s is not a directory", env, p)
	return p
}

// StockServer and PatchedServer are the llama-server binaries.
func StockServer(tb testing.TB) string {
	return Binary(tb, EnvStockServer, "a stock llama-server v0.5.0 (scripts/llama/build.sh stock)")
}

func PatchedServer(tb testing.TB) string {
	return Binary(tb, EnvPatchedServer, "the patched llama-server (scripts/llama/build.sh patched)")
}

// Ollama is the pinned Ollama, built from its module source.
func Ollama(tb testing.TB) string {
	return Binary(tb, EnvOllama, "the pinned Ollama (scripts/ollama/build.sh)")
}

// RealTE is the real Mooncake Transfer Engine library.
func RealTE(tb testing.TB) string {
	return Binary(tb, EnvRealTE, "libtransfer_engine.so (scripts/mooncake/build.sh te)")
}

var built struct {
	sync.Mutex
	mcbridge string
	models   map[string]string
	dir      string
}

// Root is the repository's top directory.
func Root() string {
	_, self, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(self), "..", "..")
}

// scratch is a directory that lives as long as the test binary: models and
// builds are shared by every test of the process.
func scratch(tb testing.TB) string {
	tb.Helper()
	built.Lock()
	defer built.Unlock()
	if built.dir == "" {
		d, err := os.MkdirTemp("", "mcb-e2e-")
		require.NoError(tb, err)
		built.dir = d
	}
	return built.dir
}

// Cleanup removes what the process built; TestMain calls it after m.Run.
func Cleanup() {
	built.Lock()
	defer built.Unlock()
	if built.dir != "" {
		os.RemoveAll(built.dir)
		built.dir = ""
	}
}

// Mcbridge returns the mcbridge command: $MCB_BIN, else built from this
// tree once per process.
func Mcbridge(tb testing.TB) string {
	tb.Helper()
	if p := os.Getenv(EnvBin); p != "" {
		return p
	}
	dir := scratch(tb)
	built.Lock()
	defer built.Unlock()
	if built.mcbridge == "" {
		out := filepath.Join(dir, "mcbridge")
		cmd := exec.Command("go", "build", "-o", out, "./cmd/mcbridge")
		cmd.Dir = Root()
		msg, err := cmd.CombinedOutput()
		require.NoError(tb, err, "go build ./cmd/mcbridge: %s", msg)
		built.mcbridge = out
	}
	return built.mcbridge
}

// Model writes (once per process) a generated model of a preset with
// another seed when seed is not 0, and returns its path.
func Model(tb testing.TB, preset string, seed uint64) string {
	tb.Helper()
	cfg, ok := gguf.Presets[preset]
	require.True(tb, ok, "no preset %q", preset)
	if seed != 0 {
		cfg.Seed = seed
	}
	return generated(tb, fmt.Sprintf("%s-%d.gguf", preset, cfg.Seed), func(p string) error { return gguf.WriteFile(p, cfg) })
}

// LoRA writes (once per process) a LoRA adapter for a preset's model.
func LoRA(tb testing.TB, preset string, rank int, seed uint64) string {
	tb.Helper()
	cfg, ok := gguf.Presets[preset]
	require.True(tb, ok, "no preset %q", preset)
	a := gguf.LoRA{Base: cfg, Rank: rank, Alpha: 16 * float32(rank), Seed: seed}
	return generated(tb, fmt.Sprintf("%s-lora-%d-%d.gguf", preset, rank, seed), func(p string) error { return gguf.WriteLoRAFile(p, a) })
}

func generated(tb testing.TB, name string, write func(string) error) string {
	dir := scratch(tb)
	built.Lock()
	defer built.Unlock()
	if built.models == nil {
		built.models = map[string]string{}
	}
	if p, ok := built.models[name]; ok {
		return p
	}
	p := filepath.Join(dir, name)
	require.NoError(tb, write(p), "writing %s", name)
	built.models[name] = p
	return p
}

// FreePort is a loopback port nothing listens on now. A caller that binds
// it later can lose it to another process: Start retries.
func FreePort(tb testing.TB) int {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(tb, err)
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// Proc is a child process whose output goes to a log file; the test stops
// it when it ends.
type Proc struct {
	Name string
	Log  string
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// Spawn starts bin with args, stdout and stderr into a log in the test's
// directory, env added to the test's own.
func Spawn(tb testing.TB, name, bin string, args, env []string) *Proc {
	tb.Helper()
	p := &Proc{Name: name, Log: filepath.Join(tb.TempDir(), name+".log"), done: make(chan struct{})}
	f, err := os.Create(p.Log)
	require.NoError(tb, err)
	p.cmd = exec.Command(bin, args...)
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.Stdout, p.cmd.Stderr = f, f
	// Its own process group, so that a stop reaches what it starts too.
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	require.NoError(tb, p.cmd.Start(), "starting %s", name)
	go func() {
		p.err = p.cmd.Wait()
		f.Close()
		close(p.done)
	}()
	tb.Cleanup(func() {
		p.Signal(syscall.SIGCONT) // a paused process cannot stop
		p.Stop()
		if tb.Failed() {
			tb.Logf("%s log (last lines):\n%s", name, p.Tail(40))
		}
	})
	return p
}

// Pid is the process id.
func (p *Proc) Pid() int { return p.cmd.Process.Pid }

// Exited reports whether the process has ended.
func (p *Proc) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Signal sends sig to the process's group.
func (p *Proc) Signal(sig syscall.Signal) {
	if !p.Exited() {
		_ = syscall.Kill(-p.cmd.Process.Pid, sig)
	}
}

// Stop sends SIGTERM and, after ten seconds, SIGKILL; it waits for the exit.
func (p *Proc) Stop() {
	p.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		p.Kill()
	}
}

// Kill sends SIGKILL and waits for the exit: no handler runs.
func (p *Proc) Kill() {
	p.Signal(syscall.SIGKILL)
	<-p.done
}

// Wait waits for the process to exit by itself and returns its error.
func (p *Proc) Wait(timeout time.Duration) error {
	select {
	case <-p.done:
		return p.err
	case <-time.After(timeout):
		return fmt.Errorf("%s still running after %v", p.Name, timeout)
	}
}

// Tail is the last n lines of the log.
func (p *Proc) Tail(n int) string {
	b, _ := os.ReadFile(p.Log)
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// LogContains reports whether the log has a line containing s.
func (p *Proc) LogContains(s string) bool {
	b, _ := os.ReadFile(p.Log)
	return bytes.Contains(b, []byte(s))
}

// LogLine is the first line of the log containing s, "" when none does.
func (p *Proc) LogLine(s string) string {
	f, err := os.Open(p.Log)
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if strings.Contains(sc.Text(), s) {
			return sc.Text()
		}
	}
	return ""
}

// Client is the HTTP client of the tests: prefill on the bench model takes
// tens of seconds on two cores. It reuses no connection, as the proxy does
// not (internal/proxy, upstreamTransport): llama-server closes one after every
// streamed answer, and a request sent on it right after failed with EOF.
var Client = &http.Client{Timeout: 15 * time.Minute, Transport: newConnTransport()}

func newConnTransport() http.RoundTripper {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.DisableKeepAlives = true
	return t
}

// WaitHTTP polls url until it answers 200, the process exits, or the
// timeout passes.
func WaitHTTP(p *Proc, url string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		resp, err := http.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if p.Exited() {
			return fmt.Errorf("%s exited: %v\n%s", p.Name, p.err, p.Tail(30))
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("%s did not answer %s within %v\n%s", p.Name, url, timeout, p.Tail(30))
}

// Server is a process serving HTTP on a loopback port.
type Server struct {
	*Proc
	URL  string
	Port int
}

// StartServer runs bin with args plus the port flag(s) portArgs(port) on a
// free loopback port, waits for health (a GET of healthPath answering
// 200), and retries on another port when the first was taken meanwhile.
func StartServer(tb testing.TB, name, bin string, args, env []string, portArgs func(int) []string, healthPath string) *Server {
	tb.Helper()
	var last error
	for attempt := 0; attempt < 3; attempt++ {
		port := FreePort(tb)
		p := Spawn(tb, name, bin, append(append([]string{}, args...), portArgs(port)...), env)
		url := "http://127.0.0.1:" + strconv.Itoa(port)
		if last = WaitHTTP(p, url+healthPath, 3*time.Minute); last == nil {
			return &Server{Proc: p, URL: url, Port: port}
		}
		p.Stop()
		if !strings.Contains(p.Tail(50), "address already in use") && !strings.Contains(p.Tail(50), "bind") {
			break
		}
	}
	require.NoError(tb, last, "starting %s", name)
	return nil
}

// Post sends body as JSON and decodes the JSON answer into out (when not
// nil); a status other than 200 fails the test with the answer's text.
func Post(tb testing.TB, url string, body, out any) {
	tb.Helper()
	PostHeaders(tb, url, body, out)
}

// PostHeaders is Post, and returns the answer's headers.
func PostHeaders(tb testing.TB, url string, body, out any) http.Header {
	tb.Helper()
	code, b, h := post(tb, url, body)
	require.Equal(tb, http.StatusOK, code, "POST %s: %s", url, b)
	if out != nil {
		require.NoError(tb, json.Unmarshal(b, out), "POST %s: %s", url, b)
	}
	return h
}

// PostRaw sends body as JSON and returns the status and the answer.
func PostRaw(tb testing.TB, url string, body any) (int, []byte) {
	tb.Helper()
	code, b, _ := post(tb, url, body)
	return code, b
}

func post(tb testing.TB, url string, body any) (int, []byte, http.Header) {
	tb.Helper()
	var rd io.Reader
	switch v := body.(type) {
	case []byte:
		rd = bytes.NewReader(v)
	default:
		b, err := json.Marshal(v)
		require.NoError(tb, err)
		rd = bytes.NewReader(b)
	}
	resp, err := Client.Post(url, "application/json", rd)
	require.NoError(tb, err, "POST %s", url)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(tb, err)
	return resp.StatusCode, b, resp.Header
}

// Get returns a GET's answer, failing the test unless it is 200.
func Get(tb testing.TB, url string) []byte {
	tb.Helper()
	resp, err := Client.Get(url)
	require.NoError(tb, err, "GET %s", url)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(tb, err)
	require.Equal(tb, http.StatusOK, resp.StatusCode, "GET %s: %s", url, b)
	return b
}

// Metrics reads a Prometheus text endpoint into series → value (labels
// kept in the name).
func Metrics(tb testing.TB, url string) map[string]float64 {
	tb.Helper()
	out := map[string]float64{}
	for _, line := range strings.Split(string(Get(tb, url)), "\n") {
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		require.NoError(tb, err, "metric line %q", line)
		out[line[:i]] = v
	}
	return out
}

// SeriesNames are the distinct series names (labels dropped) with a prefix.
func SeriesNames(m map[string]float64, prefix string) []string {
	seen := map[string]bool{}
	var out []string
	for k := range m {
		name, _, _ := strings.Cut(k, "{")
		if strings.HasPrefix(name, prefix) && !seen[name] {
			seen[name] = true
			out = append(out, name)
		}
	}
	return out
}

// Eventually polls cond every 20 ms until it holds or timeout passes.
func Eventually(tb testing.TB, timeout time.Duration, cond func() bool, format string, args ...any) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			require.FailNowf(tb, "timed out", format, args...)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// HelpNames are the names of the series a Prometheus endpoint describes
// (its # HELP lines) that start with prefix: the vocabulary, whether or not
// a series has samples yet.
func HelpNames(tb testing.TB, url, prefix string) []string {
	tb.Helper()
	var out []string
	for _, line := range strings.Split(string(Get(tb, url)), "\n") {
		rest, ok := strings.CutPrefix(line, "# HELP ")
		if !ok {
			continue
		}
		name, _, _ := strings.Cut(rest, " ")
		if strings.HasPrefix(name, prefix) {
			out = append(out, name)
		}
	}
	return out
}

// TmpFS mounts a tmpfs of size (mount's "size=" syntax, such as "64k") on
// a directory of the test's and unmounts it when the test ends: the real
// way to meet a full or a read-only filesystem. Mounting needs root; make
// test runs as root, and elsewhere the test fails and says so.
func TmpFS(tb testing.TB, size string) string {
	tb.Helper()
	require.Zero(tb, os.Geteuid(), "this test mounts a tmpfs to meet a real full or read-only filesystem: run it as root (make test does)")
	dir := tb.TempDir()
	require.NoError(tb, syscall.Mount("tmpfs", dir, "tmpfs", 0, "size="+size), "mounting a tmpfs at %s", dir)
	tb.Cleanup(func() { _ = syscall.Unmount(dir, syscall.MNT_DETACH) })
	return dir
}

// ReadOnly remounts a TmpFS read-only.
func ReadOnly(tb testing.TB, dir string) {
	tb.Helper()
	require.NoError(tb, syscall.Mount("", dir, "", syscall.MS_REMOUNT|syscall.MS_RDONLY, ""), "remounting %s read-only", dir)
}

// WriteBenchOut writes v as indented JSON to name in $MCB_BENCH_OUT
// (bench/out by default), where `make bench-report` reads the end-to-end
// benchmarks' results, and returns the path.
func WriteBenchOut(tb testing.TB, name string, v any) string {
	tb.Helper()
	dir := os.Getenv("MCB_BENCH_OUT")
	if dir == "" {
		dir = filepath.Join(Root(), "bench", "out")
	}
	require.NoError(tb, os.MkdirAll(dir, 0o755))
	out, err := json.MarshalIndent(v, "", "  ")
	require.NoError(tb, err)
	path := filepath.Join(dir, name)
	require.NoError(tb, os.WriteFile(path, append(out, '\n'), 0o644))
	return path
}
