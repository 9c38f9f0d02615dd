package swarm

import (
	"bytes"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/testenv"
	"github.com/mcbridge/mcbridge/internal/transport/mooncake"
)

// received is what this process's TCP sockets connected to any of ports
// have received (the kernel's count, TCP_INFO), so that a test sees a
// payload move through an engine that reports no progress (the real one
// says 0 bytes until a transfer completes).
func received(t *testing.T, ports map[int]bool) uint64 {
	t.Helper()
	var n uint64
	for _, s := range testenv.TCPSockets(t, os.Getpid()) {
		if s.Listening || !ports[s.Remote.Port] {
			continue
		}
		// A socket closed since it was listed fails here and counts nothing.
		if info, err := unix.GetsockoptTCPInfo(s.FD, unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
			n += info.Bytes_received
		}
	}
	return n
}

// settled waits until received(ports) stops growing and returns it.
func settled(t *testing.T, ports map[int]bool) uint64 {
	last := received(t, ports)
	for {
		time.Sleep(100 * time.Millisecond)
		n := received(t, ports)
		if n == last {
			return n
		}
		last = n
	}
}

// A holder stopped (SIGSTOP) while its payload streams to a reader holds
// the reader's transfers past the load's deadline: the real TCP transport
// bounds a request's status frame (30 s) and not its payload, and neither
// engine reports the stall. The load fails at its deadline, the host takes
// its cells back and rewrites them, and when the holder resumes the rest
// of the payload streams in, none of it into the cells: on the real
// engine, which cannot abort a transfer, the load's transfers land in
// staging that stays reserved until the batch ends; on the mock (TCP, as a
// stopped process cannot be read otherwise) they land in place and the
// load aborts them at the deadline.
func TestPeerStoppedMidPayload(t *testing.T) {
	forImpls(t, func(t *testing.T, im impl) {
		srv := etcdtest.Start(t)
		j := baseJob(t, srv.Endpoint(), "holder", im.lib)
		// Two blocks of two layers, each layer one 16 MiB request: 64 MiB
		// on the wire, tens of milliseconds over loopback, several times
		// what the sockets' buffers hold, so that the stop can land
		// mid-payload.
		j.Layers, j.KRow, j.VRow = 2, 512<<10, 512<<10
		j.Cells, j.Tokens, j.Blocks = 40, 2*16+5, 2
		j.Config.PoolBytes = 256 << 20
		holder := start(t, "saver", j)
		holder.expect(t, "saved", 2)
		ports := map[int]bool{}
		for _, a := range testenv.Listeners(t, holder.cmd.Process.Pid) {
			ports[a.Port] = true
		}

		pj := j
		pj.Config.Owner = "reader"
		pj.Config.TransferTimeoutMS = 3000 // 64 MiB through the mock's bounce buffers on a loaded machine
		pj.Config.PeerDownMS = 0
		b, eng := openParent(t, pj)
		if im.mock() {
			require.NoError(t, eng.SetPath(mooncake.PathTCP))
		}
		h := pj.host(t)
		m := pj.register(t, b, h)
		tokens := pj.tokens()[:32]
		cells := kvtest.SeqCells(32)
		require.Equal(t, 2, waitMatched(m, pj.tokens(), 2, 20*time.Second), "blocks the mirror found")
		// A first load opens the holder's segment.
		h.Scribble()
		res, err := load(m, h, tokens, cells)
		require.NoError(t, err)
		require.Equal(t, 32, res.OKTokens)
		require.NoError(t, h.Check(tokens, cells, 32))
		// What the host computes for the tokens, written back after the
		// deadline with a copy: the resume must come well within the 30 s
		// that the real engine gives a request still waiting for its
		// status frame, else that request fails and the rest of the
		// payload never comes.
		var k, v [][]byte
		for l := range h.K {
			k, v = append(k, bytes.Clone(h.K[l])), append(v, bytes.Clone(h.V[l]))
		}
		// The rows of the tokens are what a load receives, besides headers.
		var payload uint64
		for l := range h.K {
			payload += uint64(len(tokens) * (h.KRow[l] + h.VRow[l]))
		}

		t.Cleanup(func() { _ = holder.cmd.Process.Signal(syscall.SIGCONT) })
		var ld *bridge.Load
		var base, got uint64
		// The stop is sent at the first byte, but this process may not
		// run again before the holder has sent everything: then the
		// attempt shows nothing and is made again (5 times was too few once
		// under -race beside the end-to-end suite).
		for attempt := 1; ; attempt++ {
			h.Scribble()
			base = received(t, ports)
			ld, err = m.LoadBegin(key.Scope{}, h.Layout(), tokens, cells)
			require.NoError(t, err)
			require.Eventually(t, func() bool { return received(t, ports)-base > 0 }, 20*time.Second, 50*time.Microsecond,
				"the load received nothing")
			holder.halt(t)
			if got = settled(t, ports) - base; got < payload {
				break
			}
			require.NoError(t, holder.cmd.Process.Signal(syscall.SIGCONT))
			_, err = ld.End()
			require.NoError(t, err, "a load the holder served in full")
			require.Less(t, attempt, 20, "the holder was stopped after the whole payload, 20 times")
		}
		t.Logf("%s: the holder stopped with %d of %d payload bytes of the load received", im.name, got, payload)

		res, err = ld.End()
		require.Equal(t, status.Timeout, status.Of(err), "a load from the stopped holder: %v", err)
		require.Zero(t, res.OKTokens)
		// The host computes the tokens itself in the cells it got back.
		for l := range h.K {
			copy(h.K[l], k[l])
			copy(h.V[l], v[l])
		}

		require.NoError(t, holder.cmd.Process.Signal(syscall.SIGCONT))
		after := settled(t, ports) - base
		t.Logf("%s: %d bytes of the load received once the holder resumed", im.name, after-got)
		if !im.mock() {
			// The mock's abort closed its connections; the real engine
			// receives the rest of the payload, past the deadline.
			require.GreaterOrEqual(t, after, payload, "the real engine's transfers did not go on after the resume")
		}
		// cells are the first 32 of each layer's rows.
		for l := range h.K {
			require.True(t, bytes.Equal(k[l][:32*h.KRow[l]], h.K[l][:32*h.KRow[l]]), "%s: layer %d's K changed after the load ended", im.name, l)
			require.True(t, bytes.Equal(v[l][:32*h.VRow[l]], h.V[l][:32*h.VRow[l]]), "%s: layer %d's V changed after the load ended", im.name, l)
		}
		// The next load reaps the parked batch (the real engine's, once
		// its transfers ended) and restores correct bytes.
		h.Scribble()
		res, err = load(m, h, tokens, cells)
		require.NoError(t, err, "the load after the resume")
		require.Equal(t, 32, res.OKTokens)
		require.NoError(t, h.Check(tokens, cells, 32))
		holder.finish(t)
	})
}
