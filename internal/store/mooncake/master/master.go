//go:build unix

// Package master runs Mooncake Store's master (mooncake_master) as a child
// process and reads its admin server.
package master

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/mcbridge/mcbridge/internal/status"
)

// Config runs a mooncake_master.
type Config struct {
	// Binary is mooncake_master; the libasio.so it needs is looked for
	// beside it (scripts/mooncake/build.sh store puts it there).
	Binary string
	// Addr is where clients reach it, host:port.
	Addr string
	// AdminAddr is its HTTP admin and metrics server, host:port
	// (/health, /metrics, /query_key, /get_segments_detail).
	AdminAddr string
	// MetadataAddr, when set, makes it also serve Transfer Engine metadata
	// at http://MetadataAddr/metadata; clients then use that instead of
	// P2PHANDSHAKE.
	MetadataAddr string
	// ClientTTL is how long a client that stopped sending heartbeats keeps
	// its segment, and the replicas in it, in the store; 0 means the
	// master's default (10 s).
	ClientTTL time.Duration
	// Args are more flags, after these.
	Args []string
	// Log takes its stdout and stderr; nil discards them.
	Log io.Writer
}

// Process is a running mooncake_master.
type Process struct {
	cfg  Config
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// Args are the flags Start gives the master: HA off (it needs
// etcd), every address from the config.
func Args(cfg Config) ([]string, error) {
	rpcHost, rpcPort, err := net.SplitHostPort(cfg.Addr)
	if err != nil {
		return nil, status.Wrap(status.Config, err, "master address "+cfg.Addr)
	}
	adminHost, adminPort, err := net.SplitHostPort(cfg.AdminAddr)
	if err != nil {
		return nil, status.Wrap(status.Config, err, "master admin address "+cfg.AdminAddr)
	}
	args := []string{
		"--rpc_address=" + rpcHost, "--rpc_port=" + rpcPort,
		"--metrics_host=" + adminHost, "--metrics_port=" + adminPort,
		"--enable_ha=false",
	}
	if cfg.MetadataAddr != "" {
		host, port, err := net.SplitHostPort(cfg.MetadataAddr)
		if err != nil {
			return nil, status.Wrap(status.Config, err, "master metadata address "+cfg.MetadataAddr)
		}
		args = append(args, "--enable_http_metadata_server=true",
			"--http_metadata_server_host="+host, "--http_metadata_server_port="+port)
	}
	if cfg.ClientTTL > 0 {
		args = append(args, "--client_ttl="+strconv.Itoa(max(1, int(cfg.ClientTTL/time.Second))))
	}
	return append(args, cfg.Args...), nil
}

// Start starts the master and waits, until ctx ends, for its admin
// server to report it serving and its RPC port to accept connections.
func Start(ctx context.Context, cfg Config) (*Process, error) {
	if cfg.Binary == "" {
		return nil, status.Errorf(status.Config, "no mooncake_master binary given")
	}
	args, err := Args(cfg)
	if err != nil {
		return nil, err
	}
	bin, err := filepath.Abs(cfg.Binary)
	if err != nil {
		return nil, status.Wrap(status.Config, err, "mooncake_master")
	}
	if _, err := os.Stat(bin); err != nil {
		return nil, status.Wrap(status.Config, err, "mooncake_master")
	}
	m := &Process{cfg: cfg, cmd: exec.Command(bin, args...), done: make(chan struct{})}
	env := os.Environ()
	ld := filepath.Dir(bin)
	if v := os.Getenv("LD_LIBRARY_PATH"); v != "" {
		ld += ":" + v
	}
	m.cmd.Env = append(env, "LD_LIBRARY_PATH="+ld)
	out := cfg.Log
	if out == nil {
		out = io.Discard
	}
	m.cmd.Stdout, m.cmd.Stderr = out, out
	// Its own process group, so that a signal to the group reaches only it.
	m.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := m.cmd.Start(); err != nil {
		return nil, status.Wrap(status.Config, err, "starting mooncake_master")
	}
	go func() {
		m.err = m.cmd.Wait()
		close(m.done)
	}()
	if err := m.waitReady(ctx); err != nil {
		_ = m.Stop(time.Second)
		return nil, err
	}
	return m, nil
}

func (m *Process) waitReady(ctx context.Context) error {
	client := &http.Client{Timeout: time.Second}
	for {
		select {
		case <-m.done:
			return status.Errorf(status.Config, "mooncake_master exited at start: %v (its log says why)", m.err)
		case <-ctx.Done():
			return status.Wrap(status.Timeout, ctx.Err(), "mooncake_master did not start serving")
		case <-time.After(50 * time.Millisecond):
		}
		resp, err := client.Get(m.AdminURL() + "/health")
		if err != nil {
			continue
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			continue
		}
		if c, err := net.DialTimeout("tcp", m.cfg.Addr, time.Second); err == nil {
			c.Close()
			return nil
		}
	}
}

// Addr is the RPC address clients are given.
func (m *Process) Addr() string { return m.cfg.Addr }

// AdminURL is the admin server's base URL.
func (m *Process) AdminURL() string { return "http://" + m.cfg.AdminAddr }

// MetadataURL is the Transfer Engine metadata URL clients are given, or
// P2PHANDSHAKE when the master serves none.
func (m *Process) MetadataURL() string {
	if m.cfg.MetadataAddr == "" {
		return "P2PHANDSHAKE"
	}
	return "http://" + m.cfg.MetadataAddr + "/metadata"
}

// Pid is the master's process id.
func (m *Process) Pid() int { return m.cmd.Process.Pid }

// Done is closed when the master has exited; Err says how.
func (m *Process) Done() <-chan struct{} { return m.done }

// Err is the master's exit status once Done is closed.
func (m *Process) Err() error {
	select {
	case <-m.done:
		return m.err
	default:
		return nil
	}
}

// Signal sends sig to the master.
func (m *Process) Signal(sig syscall.Signal) {
	select {
	case <-m.done:
	default:
		_ = syscall.Kill(-m.cmd.Process.Pid, sig)
	}
}

// Stop sends SIGTERM (and SIGCONT, should it be stopped), then SIGKILL
// after timeout, and waits for the exit.
func (m *Process) Stop(timeout time.Duration) error {
	m.Signal(syscall.SIGTERM)
	m.Signal(syscall.SIGCONT)
	select {
	case <-m.done:
		return nil
	case <-time.After(timeout):
	}
	m.Signal(syscall.SIGKILL)
	<-m.done
	return status.Errorf(status.Timeout, "mooncake_master ignored SIGTERM for %v and was killed", timeout)
}

// Placement is where one replica of an object sits.
type Placement struct {
	Segment string // the segment's name (the client's host:port)
	Bytes   uint64
}

// Replicas asks the master's admin server where the memory replicas of key
// sit; a key the master does not hold is status.NotFound.
func Replicas(ctx context.Context, adminURL, key string) ([]Placement, error) {
	var q struct {
		Success   bool   `json:"success"`
		ErrorCode int64  `json:"error_code"`
		Message   string `json:"error_message"`
		Data      []struct {
			Size     uint64 `json:"size_"`
			Endpoint string `json:"transport_endpoint_"`
		} `json:"data"`
	}
	if err := adminGet(ctx, adminURL+"/query_key?key="+url.QueryEscape(key), &q); err != nil {
		return nil, err
	}
	if !q.Success {
		code := status.Transfer
		if q.ErrorCode == -704 {
			code = status.NotFound
		}
		return nil, status.Errorf(code, "query_key %s: %s (Mooncake Store code %d)", key, q.Message, q.ErrorCode)
	}
	var segs struct {
		Segments []struct {
			Name     string `json:"segment_name"`
			Endpoint string `json:"te_endpoint"`
		} `json:"segments"`
	}
	if err := adminGet(ctx, adminURL+"/get_segments_detail", &segs); err != nil {
		return nil, err
	}
	byEndpoint := map[string]string{}
	for _, s := range segs.Segments {
		byEndpoint[s.Endpoint] = s.Name
	}
	out := make([]Placement, len(q.Data))
	for i, d := range q.Data {
		name := byEndpoint[d.Endpoint]
		if name == "" {
			name = d.Endpoint
		}
		out[i] = Placement{Segment: name, Bytes: d.Size}
	}
	return out, nil
}

// adminGet decodes a JSON answer of the admin server (which answers errors
// with JSON too, under a non-200 status).
func adminGet(ctx context.Context, u string, out any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return status.Wrap(status.InvalidArg, err, u)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return status.Wrap(status.Transfer, err, "Mooncake master admin")
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return status.Wrap(status.Transfer, err, "Mooncake master admin")
	}
	if err := json.Unmarshal(b, out); err != nil {
		return status.Wrap(status.Transfer, fmt.Errorf("%w: %.200q", err, b), "Mooncake master admin: "+u)
	}
	return nil
}
