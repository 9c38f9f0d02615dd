//go:build linux && (amd64 || arm64)

package mooncake

import (
	"net"
	"os"
	"sync"

	"github.com/ebitengine/purego"

	"github.com/mcbridge/mcbridge/internal/status"
	temooncake "github.com/mcbridge/mcbridge/internal/transport/mooncake"
)

// Library is a loaded libmooncake_store.so. Load returns the same *Library
// for every path that names the same file. It is never unloaded: its
// threads and exit handlers would outlive the unmapped code.
type Library struct {
	path   string
	handle uintptr
	sym    symbols
}

// symbols holds the C functions the binding calls; 0 marks an optional one
// the library does not export.
type symbols struct {
	create, destroy, setup, healthCheck     uintptr
	registerBuffer, unregisterBuffer        uintptr
	batchPutFrom, batchGetInto, batchExist  uintptr
	getHostname, remove                     uintptr
	put, putFrom, getInto, isExist, getSize uintptr
	removeByRegex, removeAll                uintptr
}

// symbolTable lists every bound symbol and whether the binding needs it.
// The required set is what the bridge uses; the single-key calls and the
// bulk removes are conveniences whose absence only fails their own calls.
var symbolTable = []temooncake.Symbol[symbols]{
	{Name: "mooncake_store_create", Required: true, Slot: func(s *symbols) *uintptr { return &s.create }},
	{Name: "mooncake_store_destroy", Required: true, Slot: func(s *symbols) *uintptr { return &s.destroy }},
	{Name: "mooncake_store_setup", Required: true, Slot: func(s *symbols) *uintptr { return &s.setup }},
	{Name: "mooncake_store_health_check", Required: true, Slot: func(s *symbols) *uintptr { return &s.healthCheck }},
	{Name: "mooncake_store_register_buffer", Required: true, Slot: func(s *symbols) *uintptr { return &s.registerBuffer }},
	{Name: "mooncake_store_unregister_buffer", Required: true, Slot: func(s *symbols) *uintptr { return &s.unregisterBuffer }},
	{Name: "mooncake_store_batch_put_from", Required: true, Slot: func(s *symbols) *uintptr { return &s.batchPutFrom }},
	{Name: "mooncake_store_batch_get_into", Required: true, Slot: func(s *symbols) *uintptr { return &s.batchGetInto }},
	{Name: "mooncake_store_batch_is_exist", Required: true, Slot: func(s *symbols) *uintptr { return &s.batchExist }},
	{Name: "mooncake_store_get_hostname", Required: true, Slot: func(s *symbols) *uintptr { return &s.getHostname }},
	{Name: "mooncake_store_remove", Required: true, Slot: func(s *symbols) *uintptr { return &s.remove }},
	{Name: "mooncake_store_put", Required: false, Slot: func(s *symbols) *uintptr { return &s.put }},
	{Name: "mooncake_store_put_from", Required: false, Slot: func(s *symbols) *uintptr { return &s.putFrom }},
	{Name: "mooncake_store_get_into", Required: false, Slot: func(s *symbols) *uintptr { return &s.getInto }},
	{Name: "mooncake_store_is_exist", Required: false, Slot: func(s *symbols) *uintptr { return &s.isExist }},
	{Name: "mooncake_store_get_size", Required: false, Slot: func(s *symbols) *uintptr { return &s.getSize }},
	{Name: "mooncake_store_remove_by_regex", Required: false, Slot: func(s *symbols) *uintptr { return &s.removeByRegex }},
	{Name: "mooncake_store_remove_all", Required: false, Slot: func(s *symbols) *uintptr { return &s.removeAll }},
}

var libraries struct {
	sync.Mutex
	byPath map[string]*Library
}

// rpcTimeoutMS is the master RPC deadline the binding sets where the host
// has not: the library's own default (30 s) would keep a thread inside a
// call to a stopped master long after every caller gave up on it.
const rpcTimeoutMS = "3000"

// storeEnvironment is what the store client reads from the environment and
// the binding sets before loading, where unset. The embedded Transfer
// Engine's variables come from the Transfer Engine binding.
var storeEnvironment = []struct{ name, value string }{
	{"MC_RPC_TIMEOUT_MS", rpcTimeoutMS},
	{"MC_RPC_CONNECT_TIMEOUT_MS", rpcTimeoutMS},
}

// envBindAddress is where the embedded engine binds its handshake socket
// when its metadata is on a server: upstream reads it at each setup and,
// unset, binds the host's first non-loopback address, whatever the client's
// local_hostname says (with P2PHANDSHAKE it binds local_hostname's host,
// with the build patch).
const envBindAddress = "MC_TCP_BIND_ADDRESS"

// bindHandshake points envBindAddress at the host of localHostname where
// the host has not set it. The variable is the process's, so every client
// of a process with metadata on a server binds one address: a client
// configured for another is refused.
func bindHandshake(localHostname string) error {
	host := localHostname
	if h, _, err := net.SplitHostPort(localHostname); err == nil {
		host = h
	}
	libraries.Lock()
	defer libraries.Unlock()
	if v, ok := os.LookupEnv(envBindAddress); ok {
		if v != host {
			return status.Errorf(status.Config, "Mooncake Store client on %s: this process's clients with metadata on a server bind their handshake port to %s=%s; a client on another address needs a process of its own", host, envBindAddress, v)
		}
		return nil
	}
	if err := os.Setenv(envBindAddress, host); err != nil {
		return status.Wrap(status.Config, err, "setting "+envBindAddress)
	}
	return nil
}

// Load opens the store library at path, or at $MCB_MOONCAKE_STORE_LIB when
// path is empty, once per file. A failed load is not remembered.
func Load(path string) (*Library, error) {
	if path == "" {
		path = os.Getenv(EnvLibrary)
	}
	if path == "" {
		return nil, status.Errorf(status.Config, "no Mooncake Store library: pass its path (store.lib) or set %s", EnvLibrary)
	}
	canon, _, err := temooncake.CheckLibrary(path)
	if err != nil {
		return nil, status.Wrap(status.Of(err), err, "Mooncake Store library")
	}
	if err := temooncake.PrepareEnvironment(); err != nil {
		return nil, err
	}
	libraries.Lock()
	defer libraries.Unlock()
	if lib := libraries.byPath[canon]; lib != nil {
		return lib, nil
	}
	for _, kv := range storeEnvironment {
		if _, ok := os.LookupEnv(kv.name); !ok {
			if err := os.Setenv(kv.name, kv.value); err != nil {
				return nil, status.Wrap(status.Config, err, "setting "+kv.name)
			}
		}
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

func open(path string) (*Library, error) {
	lib := &Library{path: path}
	var err error
	if lib.handle, err = temooncake.OpenSymbols(path, "Mooncake Store", symbolTable, &lib.sym); err != nil {
		return nil, err
	}
	return lib, nil
}

// Path is the resolved file the library was loaded from.
func (l *Library) Path() string { return l.path }

// Has reports whether the library exports the named C function.
func (l *Library) Has(name string) bool { return temooncake.HasSymbol(symbolTable, &l.sym, name) }

// call is the single gate through which every C function is called: it
// refuses a symbol the library lacks instead of jumping to address 0, and
// turns a negative result into a bridge error (every store_c.h function
// that returns a code returns it negative; void and pointer results are
// not codes, plain says so). The raw result is returned in full; callers
// narrow it to the C type (int or int64_t).
//
// go:uintptrescapes keeps the objects behind pointer arguments converted
// to uintptr at the call site alive until call returns.
//
//go:uintptrescapes
func (l *Library) call(name string, fn uintptr, ret cType, args ...uintptr) (int64, error) {
	if fn == 0 {
		return 0, status.Errorf(status.Unsupported, "%s is not exported by %s", name, l.path)
	}
	r1, _, _ := purego.SyscallN(fn, args...)
	var v int64
	switch ret {
	case cInt:
		v = int64(int32(r1))
	case cInt64:
		v = int64(r1)
	default:
		return int64(r1), nil
	}
	if v < 0 {
		return v, codeError(name, v)
	}
	return v, nil
}

// cType is how a C function's result is read.
type cType int

const (
	plain  cType = iota // void or a pointer: not a code
	cInt                // int: >= 0, or a negative code
	cInt64              // int64_t: >= 0 (bytes), or a negative code
)
