// Package mastertest runs a real mooncake_master for tests, from the build
// that MCB_MOONCAKE_STORE_DIR names (make test sets it from
// scripts/mooncake/build.sh store). A test that cannot find it fails and
// says how to get it; it never skips.
package mastertest

import (
	"bytes"
	"context"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/store/mooncake/master"
)

// EnvDir names the directory holding mooncake_master, libasio.so,
// libmooncake_store.so and store_c.h.
const EnvDir = "MCB_MOONCAKE_STORE_DIR"

// Dir is the Mooncake Store build, checked.
func Dir(tb testing.TB) string {
	tb.Helper()
	d := os.Getenv(EnvDir)
	require.NotEmpty(tb, d, "%s is not set: it names the Mooncake Store build (scripts/mooncake/build.sh store prints <dir>, the files are in <dir>/out; make test sets it)", EnvDir)
	for _, f := range []string{"mooncake_master", "libasio.so", "libmooncake_store.so", "store_c.h"} {
		_, err := os.Stat(filepath.Join(d, f))
		require.NoError(tb, err, "%s=%s lacks %s", EnvDir, d, f)
	}
	return d
}

// Lib is libmooncake_store.so of the build.
func Lib(tb testing.TB) string { return filepath.Join(Dir(tb), "libmooncake_store.so") }

// Binary is mooncake_master of the build.
func Binary(tb testing.TB) string { return filepath.Join(Dir(tb), "mooncake_master") }

// Options tune the master.
type Options struct {
	ClientTTL    time.Duration // 0: the master's default (10 s)
	HTTPMetadata bool          // serve Transfer Engine metadata over HTTP
	Args         []string
}

// Master is a mooncake_master the test stops when it ends.
type Master struct {
	*master.Process
	tb   testing.TB
	opts Options
	cfg  master.Config
	log  *syncBuffer
}

// Start runs a master on free loopback ports and waits until it serves.
func Start(tb testing.TB, opts Options) *Master {
	tb.Helper()
	m := &Master{tb: tb, opts: opts, log: &syncBuffer{}}
	// The master logs its metrics every 10 s in one line of several KiB.
	m.cfg = master.Config{Binary: Binary(tb), ClientTTL: opts.ClientTTL, Args: append([]string{"--enable_metric_reporting=false"}, opts.Args...), Log: m.log}
	var err error
	for attempt := 0; attempt < 3; attempt++ {
		m.cfg.Addr, m.cfg.AdminAddr = freeAddr(tb), freeAddr(tb)
		if opts.HTTPMetadata {
			m.cfg.MetadataAddr = freeAddr(tb)
		}
		if err = m.start(); err == nil {
			break
		}
	}
	require.NoError(tb, err, "starting mooncake_master; its log:\n%s", m.log.String())
	tb.Cleanup(func() {
		if m.Process != nil {
			_ = m.Process.Stop(5 * time.Second)
		}
		if tb.Failed() {
			tb.Logf("mooncake_master log (last 4 KiB):\n%s", m.log.Tail(4096))
		}
	})
	return m
}

func (m *Master) start() error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	mm, err := master.Start(ctx, m.cfg)
	if err != nil {
		return err
	}
	m.Process = mm
	return nil
}

// Restart starts the master again on the same ports, after Kill or Stop.
// It holds nothing of what the old one held.
func (m *Master) Restart() {
	m.tb.Helper()
	require.NoError(m.tb, m.start(), "restarting mooncake_master; its log:\n%s", m.log.Tail(4096))
}

// Kill sends SIGKILL and waits for the exit.
func (m *Master) Kill() {
	m.Signal(syscall.SIGKILL)
	<-m.Done()
}

// Freeze stops the master (SIGSTOP) and returns once every thread of it
// is stopped: the signal only asks, and a thread already running finishes
// its time slice first, long enough to answer a request sent right after
// kill returned (TestMasterStopped saw a get served that way).
func (m *Master) Freeze() {
	m.tb.Helper()
	m.Signal(syscall.SIGSTOP)
	tasks := filepath.Join("/proc", strconv.Itoa(m.Pid()), "task")
	require.Eventually(m.tb, func() bool {
		ids, err := os.ReadDir(tasks)
		if err != nil {
			return false
		}
		for _, id := range ids {
			st, err := os.ReadFile(filepath.Join(tasks, id.Name(), "stat"))
			if err != nil {
				return false
			}
			// The state is the first field after the command's closing
			// parenthesis: T (stopped) or t (traced).
			f := bytes.Fields(st[bytes.LastIndexByte(st, ')')+1:])
			if len(f) == 0 || (f[0][0] != 'T' && f[0][0] != 't') {
				return false
			}
		}
		return len(ids) > 0
	}, 10*time.Second, time.Millisecond, "mooncake_master never stopped")
}

// Log is what the master has written so far.
func (m *Master) Log() string { return m.log.String() }

// Segments lists where the replicas of key sit, by segment name.
func (m *Master) Segments(key string) ([]string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ps, err := master.Replicas(ctx, m.AdminURL(), key)
	if err != nil {
		return nil, err
	}
	out := make([]string, len(ps))
	for i, p := range ps {
		out[i] = p.Segment
	}
	return out, nil
}

func freeAddr(tb testing.TB) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(tb, err)
	defer l.Close()
	return "127.0.0.1:" + strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func (s *syncBuffer) Tail(n int) string {
	str := s.String()
	if len(str) > n {
		str = str[len(str)-n:]
	}
	return str
}
