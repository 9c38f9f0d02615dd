//go:build linux && (amd64 || arm64)

package mooncake

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
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
	require.NoError(t, err, "cc %s:\n%s", name, msg)
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
		assert.Equal(t, status.Unsupported, status.Of(err), "%s: %v", c.name, err)
		assert.ErrorContains(t, err, c.says, c.name)
		assert.ErrorContains(t, err, "Go", c.name)
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
	require.NoError(t, err, "go build:\n%s", msg)
	paths := []string{lib}
	if strip, err := exec.LookPath("strip"); err == nil {
		stripped := filepath.Join(dir, "libgo_stripped.so")
		msg, err := exec.Command(strip, "--strip-all", "-o", stripped, lib).CombinedOutput()
		require.NoError(t, err, "strip:\n%s", msg)
		paths = append(paths, stripped)
	}
	for _, p := range paths {
		_, err := Load(p)
		assert.Equal(t, status.Unsupported, status.Of(err), "%s: %v", filepath.Base(p), err)
		assert.ErrorContains(t, err, "second Go runtime", filepath.Base(p))
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
		assert.Equal(t, c.code, status.Of(err), "%s: %v", c.name, err)
		assert.ErrorContains(t, err, c.says, c.name)
	}
	assert.NotContains(t, func() string { _, err := Load(partial); return err.Error() }(), "openSegment", "a symbol the library has is reported missing")
}

func TestLoadOncePerFile(t *testing.T) {
	lib, err := Load(mockLib)
	require.NoError(t, err)
	link := filepath.Join(t.TempDir(), "libte_link.so")
	require.NoError(t, os.Symlink(mockLib, link))
	t.Setenv(EnvLibrary, link)
	for _, p := range []string{link, ""} {
		again, err := Load(p)
		require.NoError(t, err, "Load(%q)", p)
		require.Same(t, lib, again, "Load(%q): want the library already loaded", p)
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
	require.GreaterOrEqual(t, len(names), 20, "declarations found in the header")
	for _, m := range names {
		sym, err := purego.Dlsym(lib.handle, string(m[1]))
		assert.NoError(t, err, "the mock does not export %s", m[1])
		assert.NotZero(t, sym, "the mock does not export %s", m[1])
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
		assert.Equal(t, status.Config, status.Of(err), "metadata %q: %v", c.meta, err)
		assert.ErrorContains(t, err, c.says, "metadata %q", c.meta)
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
		if h != 0 {
			_, _ = lib.call("destroyTransferEngine", lib.sym.destroyTransferEngine, plain, h)
		}
		assert.Zero(t, h, "metadata %q: the mock created an engine", meta)
	}
}

func TestOpenListensWhereConfigured(t *testing.T) {
	e, err := Open(Config{Library: mockLib, LocalServerName: "127.0.0.2:1234"})
	if err != nil {
		t.Skipf("127.0.0.2 is not usable here: %v", err)
	}
	defer e.Close()
	require.True(t, strings.HasPrefix(e.LocalSegment(), "127.0.0.2:"), "segment %q, want it on 127.0.0.2", e.LocalSegment())
	other := openEngine(t, mockLib)
	require.True(t, strings.HasPrefix(other.LocalSegment(), "127.0.0.1:"), "default segment %q, want loopback", other.LocalSegment())
	_, err = other.OpenSegment(e.LocalSegment())
	require.NoError(t, err, "open a segment on 127.0.0.2")
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
		assert.Equal(t, c.want, status.Of(err), "code %d: %v", c.raw, err)
		assert.ErrorContains(t, err, c.says, "code %d", c.raw)
		assert.True(t, strings.HasPrefix(err.Error(), c.want.String()+": op"), "code %d: %v", c.raw, err)
	}
}

// TestMockEnvironment checks that the mock reads its faults from the
// environment at engine creation, and refuses malformed values.
func TestMockEnvironment(t *testing.T) {
	for _, bad := range [][2]string{{"MOCK_TE_PATH", "carrier"}, {"MOCK_TE_WORKERS", "0"}, {"MOCK_TE_DELAY_US", "12x"}} {
		t.Run(bad[0], func(t *testing.T) {
			t.Setenv(bad[0], bad[1])
			e, err := Open(Config{Library: mockLib})
			if err == nil {
				e.Close()
			}
			require.Error(t, err, "%s=%s accepted", bad[0], bad[1])
		})
	}
	t.Setenv("MOCK_TE_PATH", "tcp")
	t.Setenv("MOCK_TE_CORRUPT", "1")
	p := newPair(t, mockLib, 4096)
	st := transfer(t, p.a, read(p.seg, p.local, p.peer))
	stats, err := p.a.MockStats()
	require.NoError(t, err)
	require.Equal(t, transport.Completed, st[0].State, "with MOCK_TE_PATH=tcp MOCK_TE_CORRUPT=1: %+v", st[0])
	require.Equal(t, 1, countMismatches(p.local, 1), "with MOCK_TE_PATH=tcp MOCK_TE_CORRUPT=1: bytes that differ")
	require.Equal(t, uint64(4096), stats.TCPBytes, "with MOCK_TE_PATH=tcp MOCK_TE_CORRUPT=1: stats %+v", stats)
	require.Zero(t, stats.VMBytes, "with MOCK_TE_PATH=tcp MOCK_TE_CORRUPT=1: stats %+v", stats)
}

func TestOpenProtocols(t *testing.T) {
	for _, cfg := range []Config{
		{Library: mockLib, Protocol: "rdma", ProtocolArgs: []string{`{"cpu:0": [["mlx5_0"], []]}`}},
		{Library: mockLib, AutoDiscover: true},
	} {
		e, err := Open(cfg)
		require.NoError(t, err, "%+v", cfg)
		local := newBuffer(t, 4096)
		require.NoError(t, e.RegisterMemory(local.addr(), 4096, "cpu:0", true))
		st := transfer(t, e, transport.Request{Op: transport.Write, Local: local.addr(), Segment: 0, Remote: uint64(local.addr()) + 2048, Length: 1024})
		require.Equal(t, transport.Completed, st[0].State, "%+v: loopback write %+v", cfg, st[0])
		require.NoError(t, e.UnregisterMemory(local.addr()))
		require.NoError(t, e.Close())
	}
}
