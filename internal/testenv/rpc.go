package testenv

import (
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// RPC is a ggml RPC server: a device whose memory lives in another
// process, reached only through ggml's backend API. llama-server uses it
// with --rpc Endpoint.
type RPC struct {
	*Proc
	Endpoint string // 127.0.0.1:port
}

// StartRPC runs an RPC server on a free loopback port, computing with one
// thread, and waits until it accepts connections.
func StartRPC(tb testing.TB, name string) *RPC {
	tb.Helper()
	bin := Binary(tb, EnvRPCServer, "ggml-rpc-server (scripts/llama/build.sh stock)")
	var last error
	for attempt := 0; attempt < 3; attempt++ {
		port := FreePort(tb)
		p := Spawn(tb, name, bin, []string{"-H", "127.0.0.1", "-p", strconv.Itoa(port), "-t", "1"}, nil)
		ep := "127.0.0.1:" + strconv.Itoa(port)
		if last = waitListening(p, ep, time.Minute); last == nil {
			return &RPC{Proc: p, Endpoint: ep}
		}
		p.Stop()
		if !strings.Contains(p.Tail(50), "bind") && !strings.Contains(p.Tail(50), "in use") {
			break
		}
	}
	require.NoError(tb, last, "starting %s", name)
	return nil
}

// waitListening polls addr until it accepts a TCP connection, the process
// exits, or the timeout passes.
func waitListening(p *Proc, addr string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
			c.Close()
			return nil
		}
		if p.Exited() {
			return fmt.Errorf("%s exited: %v\n%s", p.Name, p.err, p.Tail(30))
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("%s did not listen on %s within %v\n%s", p.Name, addr, timeout, p.Tail(30))
}
