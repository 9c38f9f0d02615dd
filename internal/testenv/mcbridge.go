package testenv

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

// Proxy is an `mcbridge proxy` process.
type Proxy struct{ *Server }

// StartProxy runs `mcbridge proxy` in front of upstream (a llama-server
// started with --slot-save-path slotDir) with the bridge configuration cfg.
func StartProxy(tb testing.TB, name, upstream, slotDir, cfg string, extra ...string) *Proxy {
	tb.Helper()
	args := append([]string{"proxy", "--upstream", upstream, "--slot-dir", slotDir, "--config", cfg}, extra...)
	s := StartServer(tb, name, Mcbridge(tb), args, nil, func(port int) []string {
		return []string{"--listen", "127.0.0.1:" + strconv.Itoa(port)}
	}, "/healthz")
	return &Proxy{s}
}

// State is the proxy's /healthz state.
func (p *Proxy) State(tb testing.TB) map[string]any {
	tb.Helper()
	var st map[string]any
	require.NoError(tb, json.Unmarshal(Get(tb, p.URL+"/healthz"), &st))
	return st
}

// SlotDir makes a slot directory for a stock llama-server.
func SlotDir(tb testing.TB, name string) string {
	tb.Helper()
	d := filepath.Join(tb.TempDir(), "slots-"+name)
	require.NoError(tb, os.MkdirAll(d, 0o755))
	return d
}

// Store is an `mcbridge serve` store node.
type Store struct{ *Server }

// StartStore runs `mcbridge serve` with the bridge configuration cfg and
// extra flags.
func StartStore(tb testing.TB, name, cfg string, extra ...string) *Store {
	tb.Helper()
	args := append([]string{"serve", "--config", cfg}, extra...)
	s := StartServer(tb, name, Mcbridge(tb), args, nil, func(port int) []string {
		return []string{"--listen", "127.0.0.1:" + strconv.Itoa(port)}
	}, "/healthz")
	return &Store{s}
}

// ShmSlotDir is a slot directory on tmpfs where there is one, as
// docs/proxy.md recommends for benchmarks (a disk writes the slot files'
// pages back), removed after the test.
func ShmSlotDir(tb testing.TB, name string) string {
	tb.Helper()
	base := "/dev/shm"
	if st, err := os.Stat(base); err != nil || !st.IsDir() {
		base = tb.TempDir()
	}
	d, err := os.MkdirTemp(base, "mcb-"+name+"-")
	require.NoError(tb, err)
	tb.Cleanup(func() { os.RemoveAll(d) })
	return d
}
