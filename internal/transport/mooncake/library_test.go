//go:build linux && (amd64 || arm64)

package mooncake

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/ebitengine/purego"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/transport"
)

// cc compiles C source into a shared library in dir.
func cc(t *testing.T, dir, name, src string, flags ...string) string {
	t.Helper()
	c := filepath.Join(dir, name+".c")
	require.NoError(t, os.WriteFile(c, []byte(src), 0o644))
	out := filepath.Join(dir, name+".so")
	args := append([]string{"-shared", "-fPIC", "-o", out, c}, flags...)
	msg, err := exec.Command("cc", args...).CombinedOutput()
	require.NoError(t, err, "cc %s\n%s", name, msg)
	return out
}

func TestLoadRefusesSecondGoRuntime(t *testing.T) {
	dir := t.TempDir()
	cc(t, dir, "libetcd_wrapper", "int EtcdStoreWrapper(void) { return 0; }\n")
	byName := cc(t, dir, "libte_etcd", "int createTransferEngine(void) { return 0; }\n", "-L"+dir, "-Wl,--no-as-needed", "-l:libetcd_wrapper.so", "-Wl,-rpath,"+dir)
	bySymbol := cc(t, dir, "libgo_symbol", "void crosscall2(void) {}\n")
	bySection := cc(t, dir, "libgo_section", `__attribute__((section(".go.buildinfo"), used)) static const char info[32] = "\xff Go buildinf:";`+"\n")
	// The Go library is found the way the loader finds it: through $ORIGIN.
	transitive := cc(t, dir, "libte_indirect", "int createTransferEngine(void) { return 0; }\n",
		"-L"+dir, "-Wl,--no-as-needed", "-l:libgo_symbol.so", "-Wl,--enable-new-dtags,-rpath,$ORIGIN")
	for _, c := range []struct {
		name, path, says string
	}{
		{"needs libetcd_wrapper", byName, "libetcd_wrapper"},
		{"exports cgo entry points", bySymbol, "crosscall2"},
		{"has a Go section", bySection, ".go.buildinfo"},
		{"needs a Go library", transitive, "needed by"},
	} {
		_, err := Load(c.path)
		why := []any{"%s: %v; want an Unsupported error naming %q", c.name, err, c.says}
		assert.Equal(t, status.Unsupported, status.Of(err), why...)
		assert.ErrorContains(t, err, c.says, why...)
		assert.ErrorContains(t, err, "Go", why...)
	}
}

// TestLoadRefusesGoCShared builds a real Go c-shared library, the kind a
// USE_ETCD build of Mooncake links, and a stripped copy of it.
func TestLoadRefusesGoCShared(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a Go c-shared library")
	}
	dir := t.TempDir()
	src := "package main\n\nimport \"C\"\n\n//export EtcdStoreWrapper\nfunc EtcdStoreWrapper() C.int { return 0 }\n\nfunc main() {}\n"
	require.NoError(t, os.WriteFile(filepath.Join(dir, "main.go"), []byte(src), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module wrapper\n\ngo 1.26\n"), 0o644))
	lib := filepath.Join(dir, "libgo_wrapper.so")
	build := exec.Command("go", "build", "-buildmode=c-shared", "-o", lib, ".")
	build.Dir = dir
	msg, err := build.CombinedOutput()
	require.NoError(t, err, "go build\n%s", msg)
	paths := []string{lib}
	if strip, err := exec.LookPath("strip"); err == nil {
		stripped := filepath.Join(dir, "libgo_stripped.so")
		msg, err := exec.Command(strip, "--strip-all", "-o", stripped, lib).CombinedOutput()
		require.NoError(t, err, "strip\n%s", msg)
		paths = append(paths, stripped)
	}
	for _, p := range paths {
		_, err := Load(p)
		why := []any{"%s: %v; want it refused", filepath.Base(p), err}
		assert.Equal(t, status.Unsupported, status.Of(err), why...)
		assert.ErrorContains(t, err, "second Go runtime", why...)
	}
}

func TestLoadErrors(t *testing.T) {
	dir := t.TempDir()
	notELF := filepath.Join(dir, "notelf.so")
	require.NoError(t, os.WriteFile(notELF, []byte("just text"), 0o644))
	partial := cc(t, dir, "libpartial", "int createTransferEngine(void) { return 0; }\nint openSegment(void) { return 0; }\n")
	t.Setenv(EnvLibrary, "")
	for _, c := range []struct {
		name, path string
		code       status.Code
		says       string
	}{
		{"no path", "", status.Config, EnvLibrary},
		{"missing file", filepath.Join(dir, "absent.so"), status.Config, "absent.so"},
		{"not ELF", notELF, status.Config, "notelf.so"},
		{"missing symbols", partial, status.Unsupported, "missing destroyTransferEngine"},
	} {
		_, err := Load(c.path)
		why := []any{"%s: %v; want code %v saying %q", c.name, err, c.code, c.says}
		assert.Equal(t, c.code, status.Of(err), why...)
		assert.ErrorContains(t, err, c.says, why...)
	}
	_, err := Load(partial)
	require.Error(t, err, "missing symbols")
	assert.NotContains(t, err.Error(), "openSegment", "a symbol the library has is reported missing")
}

func TestLoadOncePerFile(t *testing.T) {
	lib, err := Load(mockLib)
	require.NoError(t, err)
	link := filepath.Join(t.TempDir(), "libte_link.so")
	require.NoError(t, os.Symlink(mockLib, link))
	t.Setenv(EnvLibrary, link)
	for _, p := range []string{link, ""} {
		again, err := Load(p)
		why := []any{"Load(%q) = %p, %v; want the library already loaded (%p)", p, again, err, lib}
		require.NoError(t, err, why...)
		require.Same(t, lib, again, why...)
	}
	for _, name := range []string{"createTransferEngine", "getLocalIpAndPort", "mock_te_set_fault"} {
		assert.True(t, lib.Has(name), "the mock lacks %s", name)
	}
	assert.False(t, lib.Has("enableGracefulShutdown"), "the binding resolves enableGracefulShutdown, which it must never call")
}

// TestMockExportsHeader checks that the mock exports every function that
// mooncake-capi/include/transfer_engine_c.h declares.
func TestMockExportsHeader(t *testing.T) {
	header, err := os.ReadFile("../../../mooncake-capi/include/transfer_engine_c.h")
	require.NoError(t, err)
	lib, err := Load(mockLib)
	require.NoError(t, err)
	decl := regexp.MustCompile(`(?m)^[a-z_]+[ *]+([A-Za-z]+)\(`)
	names := decl.FindAllSubmatch(header, -1)
	require.GreaterOrEqual(t, len(names), 20, "found only %d declarations in the header", len(names))
	for _, m := range names {
		sym, err := purego.Dlsym(lib.handle, string(m[1]))
		why := []any{"the mock does not export %s", m[1]}
		if assert.NoError(t, err, why...) {
			assert.NotZero(t, sym, why...)
		}
	}
}

func TestOpenRefusesMetadata(t *testing.T) {
	for _, c := range []struct {
		meta, says string
	}{
		{"zookeeper://h:2181", "unknown scheme"},
		{"P2PHANDSHAKE ", "unknown scheme"},
		{"redis://h:6379", "libhiredis"},
		{"etcd://h:2379", "libetcd-cpp-api"},
		{"http://h:8080/metadata", "libcurl"},
	} {
		_, err := Open(Config{Library: mockLib, Metadata: c.meta})
		why := []any{"metadata %q: %v; want a Config error saying %q", c.meta, err, c.says}
		assert.Equal(t, status.Config, status.Of(err), why...)
		assert.ErrorContains(t, err, c.says, why...)
	}
	_, err := Open(Config{Library: mockLib, Protocol: "carrier-pigeon"})
	assert.Equal(t, status.Config, status.Of(err), "unknown protocol: %v", err)
}

// TestMockRefusesUnknownMetadata checks the mock's own answer below the
// binding: where the real engine aborts, the mock returns NULL.
func TestMockRefusesUnknownMetadata(t *testing.T) {
	lib, err := Load(mockLib)
	require.NoError(t, err)
	for _, meta := range []string{"zookeeper://h", "etcd://127.0.0.1:2379", ""} {
		m, _ := cString(meta)
		local, _ := cString("127.0.0.1")
		h, _ := lib.call("createTransferEngine", lib.sym.createTransferEngine, plain,
			uintptr(unsafe.Pointer(&m[0])), uintptr(unsafe.Pointer(&local[0])), uintptr(unsafe.Pointer(&local[0])), 0, 0)
		if !assert.Zero(t, h, "metadata %q: the mock created an engine", meta) {
			_, _ = lib.call("destroyTransferEngine", lib.sym.destroyTransferEngine, plain, h)
		}
	}
}

func TestOpenListensWhereConfigured(t *testing.T) {
	runScenarios(t, []scenario{{name: "127.0.0.2", run: func(t *testing.T, lib string) {
		e, err := Open(Config{Library: lib, LocalServerName: "127.0.0.2:1234"})
		require.NoError(t, err, "an engine on 127.0.0.2 (loopback, always there on Linux)")
		defer func() { assert.NoError(t, e.Close()) }()
		assert.Regexp(t, `^127\.0\.0\.2:\d+$`, e.LocalSegment(), "segment on the configured host")
		other := openEngine(t, lib)
		assert.Regexp(t, `^127\.0\.0\.1:\d+$`, other.LocalSegment(), "default segment on loopback")
		_, err = other.OpenSegment(e.LocalSegment())
		require.NoError(t, err, "open a segment on 127.0.0.2")
	}}})
}

func TestCodeError(t *testing.T) {
	for _, c := range []struct {
		conv convention
		raw  int32
		want status.Code
		says string
	}{
		{negativeCode, -7, status.InvalidArg, "overlaps"},
		{negativeCode, -1, status.InvalidArg, "invalid argument"},
		{negativeCode, -303, status.Unsupported, "not implemented"},
		{negativeCode, -200, status.Transfer, "metadata"},
		{negativeCode, -55, status.Transfer, "code -55"},
		{statusCode, 2, status.InvalidArg, "capacity"},
		{statusCode, 3, status.InvalidArg, "not registered"},
		{statusCode, 4, status.State, "busy"},
		{statusCode, 8, status.Unsupported, "transport"},
		{statusCode, 102, status.Transfer, "socket"},
		{statusCode, 999, status.Unsupported, "not implemented"},
	} {
		err := codeError("op", c.conv, c.raw)
		why := []any{"code %d: %v; want %v saying %q", c.raw, err, c.want, c.says}
		assert.Equal(t, c.want, status.Of(err), why...)
		assert.ErrorContains(t, err, c.says, why...)
		assert.True(t, err != nil && strings.HasPrefix(err.Error(), c.want.String()+": op"), why...)
	}
}

// TestMockEnvironment checks that the mock reads its faults from the
// environment at engine creation, and refuses malformed values.
func TestMockEnvironment(t *testing.T) {
	for _, bad := range [][2]string{{"MOCK_TE_PATH", "carrier"}, {"MOCK_TE_WORKERS", "0"}, {"MOCK_TE_DELAY_US", "12x"}, {"MOCK_TE_LINK_MBPS", "0"}} {
		t.Run(bad[0], func(t *testing.T) {
			t.Setenv(bad[0], bad[1])
			e, err := Open(Config{Library: mockLib})
			if !assert.Error(t, err, "%s=%s accepted", bad[0], bad[1]) {
				e.Close()
			}
		})
	}
	t.Setenv("MOCK_TE_PATH", "tcp")
	t.Setenv("MOCK_TE_CORRUPT", "1")
	p := newPair(t, mockLib, 4096)
	st := transfer(t, p.a, read(p.seg, p.local, p.peer))
	stats, err := p.a.MockStats()
	require.NoError(t, err)
	why := []any{"with MOCK_TE_PATH=tcp MOCK_TE_CORRUPT=1: %+v, %d bytes differ, stats %+v", st[0], countMismatches(p.local, 1), stats}
	assert.Equal(t, transport.Completed, st[0].State, why...)
	assert.Equal(t, 1, countMismatches(p.local, 1), why...)
	assert.EqualValues(t, 4096, stats.TCPBytes, why...)
	assert.Zero(t, stats.VMBytes, why...)
}

// TestMockLinkShaping: with MOCK_TE_LINK_MBPS the mock's transfers share
// one link of that rate, so two reads of 4 MiB in one batch at 100 MB/s
// cannot complete before the link has carried their 8 MiB: 83.9 ms. (A
// lower bound: the pacing sleeps, so only a missing or broken shaping
// fails it.)
func TestMockLinkShaping(t *testing.T) {
	t.Setenv("MOCK_TE_LINK_MBPS", "100")
	const half = 4 << 20
	p := newPair(t, mockLib, 2*half)
	first := transport.Request{Op: transport.Read, Local: p.local.addr(), Segment: p.seg, Remote: uint64(p.peer.addr()), Length: half}
	second := first
	second.Local += half
	second.Remote += half
	start := time.Now()
	st := transfer(t, p.a, first, second)
	took := time.Since(start)
	for _, s := range st {
		require.Equal(t, transport.Completed, s.State, "%+v", st)
	}
	assert.Zero(t, countMismatches(p.local, 1), "the shaped reads deliver the bytes")
	assert.GreaterOrEqual(t, took, time.Duration(2*half)*time.Second/100e6, "8 MiB over a 100 MB/s link")
}

// TestOpenProtocols: without an RDMA NIC installTransport("rdma") fails,
// as the real engine's does; auto-discovery installs TCP.
func TestOpenProtocols(t *testing.T) {
	runScenarios(t, []scenario{{name: "Protocols", run: func(t *testing.T, lib string) {
		_, err := Open(Config{Library: lib, Protocol: "rdma", ProtocolArgs: []string{`{"cpu:0": [["mlx5_0"], []]}`}})
		wantCode(t, err, status.Unsupported, "rdma without a NIC")
		e, err := Open(Config{Library: lib, AutoDiscover: true})
		require.NoError(t, err, "auto-discovery")
		local := newBuffer(t, 4096)
		require.NoError(t, e.RegisterMemory(local.addr(), 4096, "cpu:0", true))
		local.fill(9)
		st := transfer(t, e, transport.Request{Op: transport.Write, Local: local.addr(), Segment: 0, Remote: uint64(local.addr()) + 2048, Length: 1024})
		assert.Equal(t, transport.Completed, st[0].State, "loopback write")
		for i := 0; i < 1024; i++ {
			require.Equal(t, pattern(9, i), local[2048+i], "byte %d", i)
		}
		require.NoError(t, e.UnregisterMemory(local.addr()))
		require.NoError(t, e.Close())
	}}})
}

// TestLoadSetsEnvironment: the binding sets what the real library reads
// (quiet glog, the TCP connection pool) where the host did not, and refuses
// a pool the host switched off.
func TestLoadSetsEnvironment(t *testing.T) {
	_, err := Load(mockLib)
	require.NoError(t, err)
	for _, kv := range libraryEnvironment {
		_, ok := os.LookupEnv(kv.name)
		assert.True(t, ok, "%s is set after Load", kv.name)
	}
	for _, off := range []string{"0", "false", "NO"} {
		t.Setenv(envTCPPool, off)
		_, err := Load(mockLib)
		wantCode(t, err, status.Config, envTCPPool+"="+off)
		assert.Contains(t, err.Error(), envTCPPool)
	}
}

// TestLoadIsLocal: the libraries' symbols stay out of the global scope
// (RTLD_LOCAL), so that the real library's 1,600 exports cannot bind the
// host's own symbols.
func TestLoadIsLocal(t *testing.T) {
	runScenarios(t, []scenario{{name: "RTLD_LOCAL", run: func(t *testing.T, lib string) {
		l, err := Load(lib)
		require.NoError(t, err)
		for _, name := range []string{"createTransferEngine", "getTransferStatus"} {
			own, err := purego.Dlsym(l.handle, name)
			require.NoError(t, err)
			require.NotZero(t, own)
			global, err := purego.Dlsym(purego.RTLD_DEFAULT, name)
			assert.True(t, err != nil || global == 0, "%s is visible in the global scope", name)
		}
	}}})
}

// TestLibrarySideEffects pins what loading and opening do to a fresh
// process (a child): the real library ignores SIGPIPE from dlopen on,
// raises RLIMIT_NOFILE to its hard limit and starts threads when an engine
// is created, and, with the binding's default MC_LOG_LEVEL, writes no glog
// INFO lines; the mock does none of it.
func TestLibrarySideEffects(t *testing.T) {
	runScenarios(t, []scenario{{name: "Process", run: func(t *testing.T, lib string) {
		real := lib != mockLib
		fx := sideEffects(t, lib)
		assert.Equal(t, real, fx.SigpipeIgnoredAfterLoad, "SIGPIPE ignored after dlopen")
		assert.False(t, fx.SigpipeIgnoredBefore, "SIGPIPE ignored before dlopen")
		if real {
			assert.Equal(t, fx.NofileHard, fx.NofileAfterOpen, "RLIMIT_NOFILE after createTransferEngine")
			assert.GreaterOrEqual(t, fx.ThreadsAfterOpen-fx.ThreadsAfterLoad, 2, "threads per engine")
		} else {
			assert.Equal(t, fx.NofileBefore, fx.NofileAfterOpen, "RLIMIT_NOFILE after createTransferEngine")
		}
		assert.NotRegexp(t, `(?m)^I\d{8} `, fx.stderr, "glog INFO lines with the binding's default MC_LOG_LEVEL")
		if real {
			loud := sideEffects(t, lib, "MC_LOG_LEVEL=INFO")
			assert.Regexp(t, `(?m)^I\d{8} `, loud.stderr, "MC_LOG_LEVEL=INFO brings glog's INFO lines back")
		}
	}}})
}
