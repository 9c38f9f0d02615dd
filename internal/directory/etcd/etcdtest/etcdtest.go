// Package etcdtest runs a throwaway single-member etcd for tests: the etcd
// binary ($MCB_ETCD_BIN, else /usr/bin/etcd, else etcd on PATH; Debian's
// package is etcd-server) on free loopback ports with a temporary data
// directory. Where no binary exists the test fails, naming the package: a
// suite that cannot run must not print ok.
package etcdtest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// Server is one etcd process that can be stopped, wiped and started again
// on the same ports.
type Server struct {
	tb      testing.TB
	bin     string
	args    []string
	dataDir string
	logPath string
	client  string // client URL
	peer    string // peer URL
	cmd     *exec.Cmd
	exited  chan struct{}
	raw     *clientv3.Client
}

// startTimeout bounds how long a start may take before the test fails; a
// cold etcd on a loaded machine needs a few seconds.
const startTimeout = 60 * time.Second

// Binary returns the etcd server binary to run, or "" when there is none.
func Binary() string {
	if b := os.Getenv("MCB_ETCD_BIN"); b != "" {
		return b
	}
	if _, err := os.Stat("/usr/bin/etcd"); err == nil {
		return "/usr/bin/etcd"
	}
	if b, err := exec.LookPath("etcd"); err == nil {
		return b
	}
	return ""
}

// Start runs etcd with extra flags (for example "--max-txn-ops=16") and
// stops it when the test ends.
func Start(tb testing.TB, extraArgs ...string) *Server {
	tb.Helper()
	bin := Binary()
	if bin == "" {
		tb.Fatal("no etcd server binary: install Debian's etcd-server package (apt-get install etcd-server; make test does) or set MCB_ETCD_BIN")
	}
	dir := tb.TempDir()
	s := &Server{
		tb:      tb,
		bin:     bin,
		args:    extraArgs,
		dataDir: filepath.Join(dir, "data"),
		logPath: filepath.Join(dir, "etcd.log"),
	}
	tb.Cleanup(func() {
		if s.raw != nil {
			s.raw.Close()
		}
		s.Stop()
	})
	// A port found free can be taken before etcd binds it: try others.
	for attempt := 1; ; attempt++ {
		addrs := freeAddrs(tb, 2)
		s.client, s.peer = "http://"+addrs[0], "http://"+addrs[1]
		err := s.start()
		if err == nil {
			return s
		}
		if attempt == 3 || !strings.Contains(s.logTail(), "address already in use") {
			tb.Fatalf("etcd %s did not start: %v\n%s", s.bin, err, s.logTail())
		}
	}
}

// Endpoint is the client URL.
func (s *Server) Endpoint() string { return s.client }

// Client is a plain client for a test's own reads and writes, closed when
// the test ends.
func (s *Server) Client() *clientv3.Client {
	s.tb.Helper()
	if s.raw == nil {
		c, err := clientv3.New(clientv3.Config{Endpoints: []string{s.client}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
		if err != nil {
			s.tb.Fatalf("etcd client: %v", err)
		}
		s.raw = c
	}
	return s.raw
}

// Stop ends etcd gracefully (SIGTERM, then SIGKILL after ten seconds).
// Stopping a stopped server does nothing.
func (s *Server) Stop() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Signal(syscall.SIGCONT) // a paused etcd handles no TERM
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.exited:
	case <-time.After(10 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.exited
	}
	s.cmd = nil
}

// Pause stops the server with SIGSTOP: alive, its sockets open, answering
// nothing, as a hung etcd looks to its clients.
func (s *Server) Pause() {
	if s.cmd != nil {
		_ = s.cmd.Process.Signal(syscall.SIGSTOP)
	}
}

// Resume continues a paused server.
func (s *Server) Resume() {
	if s.cmd != nil {
		_ = s.cmd.Process.Signal(syscall.SIGCONT)
	}
}

// Wipe deletes the data directory of a stopped server, so the next start
// is a new cluster that knows no key, lease or revision.
func (s *Server) Wipe() {
	s.tb.Helper()
	if s.cmd != nil {
		s.tb.Fatal("etcdtest: Wipe on a running server")
	}
	if err := os.RemoveAll(s.dataDir); err != nil {
		s.tb.Fatal(err)
	}
}

// Restart starts a stopped server on the same ports and data directory and
// waits until it serves.
func (s *Server) Restart() {
	s.tb.Helper()
	if s.cmd != nil {
		s.tb.Fatal("etcdtest: Restart on a running server")
	}
	if err := s.start(); err != nil {
		s.tb.Fatalf("etcd %s did not start: %v\n%s", s.bin, err, s.logTail())
	}
}

func (s *Server) start() error {
	logf, err := os.OpenFile(s.logPath, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	args := append([]string{
		"--name=t",
		"--data-dir=" + s.dataDir,
		"--listen-client-urls=" + s.client,
		"--advertise-client-urls=" + s.client,
		"--listen-peer-urls=" + s.peer,
		"--initial-advertise-peer-urls=" + s.peer,
		"--initial-cluster=t=" + s.peer,
		// A single member elects itself after one election timeout: keep
		// it short so tests start fast. etcd's minimum lease TTL is 1.5
		// election timeouts, far below what tests ask for.
		"--heartbeat-interval=25",
		"--election-timeout=250",
		"--logger=zap",
		"--log-level=warn",
	}, s.args...)
	cmd := exec.Command(s.bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		return err
	}
	s.cmd, s.exited = cmd, make(chan struct{})
	exited := s.exited
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	if err := s.waitServing(); err != nil {
		s.Stop()
		return err
	}
	return nil
}

func (s *Server) waitServing() error {
	deadline := time.Now().Add(startTimeout)
	// Wait for the port before dialing: a client that finds it closed backs
	// off for a second before trying again.
	addr := strings.TrimPrefix(s.client, "http://")
	for {
		conn, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			conn.Close()
			break
		}
		if err := s.pause(deadline, err); err != nil {
			return err
		}
	}
	c, err := clientv3.New(clientv3.Config{Endpoints: []string{s.client}, DialTimeout: time.Second, Logger: zap.NewNop()})
	if err != nil {
		return err
	}
	defer c.Close()
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		_, err := c.Get(ctx, "etcdtest-health")
		cancel()
		if err == nil {
			return nil
		}
		if err := s.pause(deadline, err); err != nil {
			return err
		}
	}
}

// pause waits a moment between probes, or says why probing is over.
func (s *Server) pause(deadline time.Time, last error) error {
	select {
	case <-s.exited:
		return errors.New("the process exited")
	case <-time.After(20 * time.Millisecond):
	}
	if time.Now().After(deadline) {
		return fmt.Errorf("not serving after %v: %w", startTimeout, last)
	}
	return nil
}

func (s *Server) logTail() string {
	b, _ := os.ReadFile(s.logPath)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > 20 {
		lines = lines[len(lines)-20:]
	}
	return strings.Join(lines, "\n")
}

// freeAddrs returns n distinct loopback addresses whose ports were free a
// moment ago. The listeners stay open until all are found, or the kernel
// could hand out one port twice.
func freeAddrs(tb testing.TB, n int) []string {
	tb.Helper()
	var addrs []string
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			tb.Fatal(err)
		}
		defer l.Close()
		addrs = append(addrs, l.Addr().String())
	}
	return addrs
}
