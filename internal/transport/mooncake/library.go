//go:build linux && (amd64 || arm64)

package mooncake

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/ebitengine/purego"

	"github.com/mcbridge/mcbridge/internal/status"
)

// EnvLibrary names the environment variable that gives the Transfer Engine
// library's path when none is passed.
const EnvLibrary = "MCB_MOONCAKE_LIB"

// Library is a loaded Transfer Engine shared library (libtransfer_engine.so
// or the mock). Load returns the same *Library for every path that names the
// same file. A library is never unloaded: its threads and exit handlers would
// outlive the unmapped code.
type Library struct {
	path   string
	handle uintptr
	needed []string // sonames of the DT_NEEDED closure
	sym    symbols
}

// symbols holds the C functions the binding calls; 0 marks an optional one
// that the library does not export.
type symbols struct {
	createTransferEngine       uintptr
	destroyTransferEngine      uintptr
	installTransport           uintptr
	openSegment                uintptr
	closeSegment               uintptr
	syncSegmentCache           uintptr
	registerLocalMemory        uintptr
	unregisterLocalMemory      uintptr
	registerLocalMemoryBatch   uintptr
	unregisterLocalMemoryBatch uintptr
	allocateBatchID            uintptr
	submitTransfer             uintptr
	getTransferStatus          uintptr
	freeBatchID                uintptr

	getLocalIPAndPort        uintptr
	submitTransferWithNotify uintptr
	getNotifsFromEngine      uintptr
	freeNotifsMsgBuf         uintptr
	genNotifyInEngine        uintptr

	mockSetFault uintptr
	mockSetPath  uintptr
	mockGetStats uintptr
	mockAbort    uintptr
}

// symbolTable lists every symbol with whether the binding needs it. The
// required set is what releases since early 2025 export; the rest appeared
// later (notifications, getLocalIpAndPort, diagnostics) or only in the mock.
var symbolTable = []Symbol[symbols]{
	{"createTransferEngine", true, func(s *symbols) *uintptr { return &s.createTransferEngine }},
	{"destroyTransferEngine", true, func(s *symbols) *uintptr { return &s.destroyTransferEngine }},
	{"installTransport", true, func(s *symbols) *uintptr { return &s.installTransport }},
	{"openSegment", true, func(s *symbols) *uintptr { return &s.openSegment }},
	{"closeSegment", true, func(s *symbols) *uintptr { return &s.closeSegment }},
	{"syncSegmentCache", true, func(s *symbols) *uintptr { return &s.syncSegmentCache }},
	{"registerLocalMemory", true, func(s *symbols) *uintptr { return &s.registerLocalMemory }},
	{"unregisterLocalMemory", true, func(s *symbols) *uintptr { return &s.unregisterLocalMemory }},
	{"registerLocalMemoryBatch", true, func(s *symbols) *uintptr { return &s.registerLocalMemoryBatch }},
	{"unregisterLocalMemoryBatch", true, func(s *symbols) *uintptr { return &s.unregisterLocalMemoryBatch }},
	{"allocateBatchID", true, func(s *symbols) *uintptr { return &s.allocateBatchID }},
	{"submitTransfer", true, func(s *symbols) *uintptr { return &s.submitTransfer }},
	{"getTransferStatus", true, func(s *symbols) *uintptr { return &s.getTransferStatus }},
	{"freeBatchID", true, func(s *symbols) *uintptr { return &s.freeBatchID }},
	{"getLocalIpAndPort", false, func(s *symbols) *uintptr { return &s.getLocalIPAndPort }},
	{"submitTransferWithNotify", false, func(s *symbols) *uintptr { return &s.submitTransferWithNotify }},
	{"getNotifsFromEngine", false, func(s *symbols) *uintptr { return &s.getNotifsFromEngine }},
	{"freeNotifsMsgBuf", false, func(s *symbols) *uintptr { return &s.freeNotifsMsgBuf }},
	{"genNotifyInEngine", false, func(s *symbols) *uintptr { return &s.genNotifyInEngine }},
	{"mock_te_set_fault", false, func(s *symbols) *uintptr { return &s.mockSetFault }},
	{"mock_te_set_path", false, func(s *symbols) *uintptr { return &s.mockSetPath }},
	{"mock_te_get_stats", false, func(s *symbols) *uintptr { return &s.mockGetStats }},
	{"mock_te_abort_batch", false, func(s *symbols) *uintptr { return &s.mockAbort }},
}

var libraries struct {
	sync.Mutex
	byPath map[string]*Library
}

// libraryEnvironment is what the real library reads from the environment
// and the binding sets, before a library is loaded, where the host has not
// set it. The library reads MC_LOG_LEVEL once per process and the pool
// setting at each installTransport.
var libraryEnvironment = []struct{ name, value string }{
	// glog's INFO lines (about 100 per test run, several per engine) go;
	// warnings and errors stay on stderr. MC_LOG_LEVEL=INFO brings them
	// back, MC_LOG_DIR=<dir> sends every level to files there (errors still
	// reach stderr too). GLOG_minloglevel does not work: the library
	// overwrites glog's level with MC_LOG_LEVEL's.
	{"MC_LOG_LEVEL", "WARNING"},
	// Without the pool, submitTransfer connects to each request's peer
	// before it returns, which an unreachable peer holds for the kernel's
	// SYN retries (minutes). With it the TCP transport queues requests to a
	// few reused connections per peer and returns at once, and restores run
	// faster (bench_test.go).
	{envTCPPool, "1"},
}

const envTCPPool = "MC_TCP_ENABLE_CONNECTION_POOL"

// setLibraryEnvironment applies libraryEnvironment, and refuses a pool the
// host switched off, which would let a hung peer block submitTransfer past
// any deadline. setenv races getenv in threads already running, so it is
// called only where a variable is unset, which after the first Load it is
// not.
func setLibraryEnvironment() error {
	if v, ok := os.LookupEnv(envTCPPool); ok {
		switch strings.ToLower(v) {
		case "0", "false", "no":
			return status.Errorf(status.Config, "%s=%s: without the connection pool the Transfer Engine's submitTransfer connects to the peer before it returns, which a hung peer blocks for minutes; unset it", envTCPPool, v)
		}
	}
	for _, kv := range libraryEnvironment {
		if _, ok := os.LookupEnv(kv.name); !ok {
			if err := os.Setenv(kv.name, kv.value); err != nil {
				return status.Wrap(status.Config, err, "setting "+kv.name)
			}
		}
	}
	return nil
}

// Load opens the Transfer Engine library at path, or at $MCB_MOONCAKE_LIB
// when path is empty, once per file. A failed load is not remembered, so a
// fixed file can be loaded by a later call.
func Load(path string) (*Library, error) {
	if path == "" {
		path = os.Getenv(EnvLibrary)
	}
	if path == "" {
		return nil, status.Errorf(status.Config, "no Transfer Engine library: pass its path or set %s", EnvLibrary)
	}
	canon, err := canonicalPath(path)
	if err != nil {
		return nil, status.Wrap(status.Config, err, "Transfer Engine library "+path)
	}
	libraries.Lock()
	defer libraries.Unlock()
	if err := setLibraryEnvironment(); err != nil {
		return nil, err
	}
	if lib := libraries.byPath[canon]; lib != nil {
		return lib, nil
	}
	lib, err := open(canon)
	if err != nil {
		return nil, err
	}
	if libraries.byPath == nil {
		libraries.byPath = make(map[string]*Library)
	}
	libraries.byPath[canon] = lib
	return lib, nil
}

// canonicalPath names a file by its resolved absolute path, so that links
// and relative spellings share one Library. A bare file name is looked up
// where the dynamic loader would look.
func canonicalPath(path string) (string, error) {
	if !strings.Contains(path, "/") {
		found := resolveNeeded(path, "", elfInfo{})
		if found == "" {
			return "", fmt.Errorf("%s not found in the library search path", path)
		}
		path = found
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", err
	}
	return filepath.EvalSymlinks(abs)
}

func open(path string) (*Library, error) {
	needed, err := checkSingleGoRuntime(path)
	if err != nil {
		return nil, err
	}
	lib := &Library{path: path, needed: needed}
	if lib.handle, err = OpenSymbols(path, "Transfer Engine", symbolTable, &lib.sym); err != nil {
		return nil, err
	}
	return lib, nil
}

// Path is the resolved file the library was loaded from.
func (l *Library) Path() string { return l.path }

// Has reports whether the library exports the named C function.
func (l *Library) Has(name string) bool { return HasSymbol(symbolTable, &l.sym, name) }

// needs reports whether a library whose soname starts with prefix is in the
// DT_NEEDED closure.
func (l *Library) needs(prefix string) bool {
	for _, n := range l.needed {
		if strings.HasPrefix(filepath.Base(n), prefix) {
			return true
		}
	}
	return false
}

// call is the single gate through which every C function is called. It
// refuses a symbol the library lacks instead of jumping to address 0, and
// turns a failed result into a bridge error by the function's convention.
// The result is returned in full; callers narrow it to the C return type.
//
// go:uintptrescapes keeps the objects behind pointer arguments converted to
// uintptr at the call site alive, and on the heap, until call returns.
//
//go:uintptrescapes
func (l *Library) call(name string, fn uintptr, conv convention, args ...uintptr) (uintptr, error) {
	if fn == 0 {
		return 0, status.Errorf(status.Unsupported, "%s is not exported by %s", name, l.path)
	}
	r1, _, _ := purego.SyscallN(fn, args...)
	switch code := int32(r1); {
	case conv == statusCode && code != 0, conv == negativeCode && code < 0:
		return r1, codeError(name, conv, code)
	}
	return r1, nil
}
