package reliability

import (
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/transport/mooncake"
)

// node is a bridge in the test process on a mock engine the test holds,
// so that it can arm the engine's faults and read its counters.
type node struct {
	t      *testing.T
	b      *bridge.Bridge
	eng    *mooncake.Engine
	h      *kvtest.Host
	m      *bridge.Model
	closed bool
}

func openNode(t *testing.T, c config.Config, cells int, edit func(*key.Model)) *node {
	t.Helper()
	eng, err := mooncake.Open(mooncake.Config{Library: mockLib, LocalServerName: "127.0.0.1"})
	require.NoError(t, err)
	b, err := bridge.Open(c, bridge.Deps{Transport: eng})
	if err != nil {
		_ = eng.Close()
	}
	require.NoError(t, err)
	n := &node{t: t, b: b, eng: eng, h: newHost(t, cells)}
	if n.m, err = b.RegisterModel(spec(n.h, edit)); err != nil {
		_ = b.Close()
		_ = eng.Close()
	}
	require.NoError(t, err)
	t.Cleanup(func() {
		if !n.closed {
			n.closed = true
			_ = n.b.Close()
			_ = n.eng.Close()
		}
	})
	return n
}

func (n *node) geometry() pool.Geometry {
	return pool.Geometry{BlockTokens: blockTokens, KRow: n.h.KRow, VRow: n.h.VRow}
}

// save computes tokens on the node's host and saves them.
func (n *node) save(sc key.Scope, tokens []int32) (saved, error) {
	cells := kvtest.SeqCells(len(tokens))
	n.h.Fill(tokens, cells)
	return saveLayers(n.m, n.h, sc, tokens, cells, layers)
}

// outcome is what one restore gave the caller.
type outcome struct {
	Asked    int // tokens the load asked for: every full block before the last token
	Decided  int // tokens the lookup said to restore
	Restored int // leading tokens restored and verified
	Err      error
}

func (o outcome) Code() status.Code { return status.Of(o.Err) }

// begin looks tokens up and starts loading every full block before the
// last token into h, whatever the lookup decided, so that a fault that
// empties the directory still reaches the load.
func (n *node) begin(h *kvtest.Host, sc key.Scope, tokens []int32) (*bridge.Load, outcome) {
	n.t.Helper()
	lk, err := n.m.Lookup(sc, tokens, 0)
	require.NoError(n.t, err)
	o := outcome{Asked: (len(tokens) - 1) / blockTokens * blockTokens, Decided: lk.RestoreTokens}
	h.Scribble()
	ld, err := n.m.LoadBegin(sc, h.Layout(), tokens[:o.Asked], kvtest.SeqCells(o.Asked))
	o.Err = err
	return ld, o
}

// finish waits for every layer, ends the load and checks the host.
func (n *node) finish(h *kvtest.Host, ld *bridge.Load, tokens []int32, o outcome) outcome {
	n.t.Helper()
	if ld == nil {
		n.verify(h, tokens, 0)
		return o
	}
	for l := 0; l < layers; l++ {
		_, err := ld.WaitLayer(l)
		require.NoError(n.t, err, "wait layer %d", l)
	}
	res, err := ld.End()
	o.Restored, o.Err = res.OKTokens, err
	n.verify(h, tokens, o.Restored)
	return o
}

func (n *node) restore(h *kvtest.Host, sc key.Scope, tokens []int32) outcome {
	n.t.Helper()
	ld, o := n.begin(h, sc, tokens)
	return n.finish(h, ld, tokens, o)
}

// verify checks that the host ends as a full recompute would leave it.
func (n *node) verify(h *kvtest.Host, tokens []int32, restored int) {
	n.t.Helper()
	assert.NoError(n.t, verifyRecompute(h, tokens, restored))
}

// verifyRecompute checks a host after a restore of restored tokens of
// tokens (position i in cell i): the restored prefix is exact, no cell
// outside the load changed, and after the host computes the rest every
// byte equals a full recompute.
func verifyRecompute(h *kvtest.Host, tokens []int32, restored int) error {
	cells := kvtest.SeqCells(len(tokens))
	if err := h.CheckRestored(tokens, cells, restored); err != nil {
		return fmt.Errorf("restore of %d tokens: %w", restored, err)
	}
	computeFrom(h, tokens, restored)
	if err := h.Check(tokens, cells, len(tokens)); err != nil {
		return fmt.Errorf("after recomputing from %d: %w", restored, err)
	}
	return nil
}

// computeFrom is the host's prefill of positions [from, len(tokens)),
// position i in cell i, V not transposed.
func computeFrom(h *kvtest.Host, tokens []int32, from int) {
	for p := from; p < len(tokens); p++ {
		for l := range h.K {
			k, v := h.K[l][p*h.KRow[l]:(p+1)*h.KRow[l]], h.V[l][p*h.VRow[l]:(p+1)*h.VRow[l]]
			for i := range k {
				k[i] = kvtest.Value(tokens[p], p, l, 0, i)
			}
			for i := range v {
				v[i] = kvtest.Value(tokens[p], p, l, 1, i)
			}
		}
	}
}

// moved is the bytes the node's engine has moved.
func (n *node) moved() uint64 {
	st, err := n.eng.MockStats()
	require.NoError(n.t, err)
	return st.VMBytes + st.TCPBytes
}

// waitMoved waits until the engine has moved want bytes since from.
func (n *node) waitMoved(from, want uint64) {
	n.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for n.moved()-from < want {
		if time.Now().After(deadline) {
			require.FailNowf(n.t, "timed out", "the engine moved %d of %d bytes", n.moved()-from, want)
		}
		time.Sleep(time.Millisecond)
	}
}

// waitTasksEnded waits until tasks more tasks than in from have ended.
func (n *node) waitTasksEnded(from mooncake.MockStats, tasks uint64) mooncake.MockStats {
	n.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		st, err := n.eng.MockStats()
		require.NoError(n.t, err)
		if st.TasksCompleted+st.TasksFailed-from.TasksCompleted-from.TasksFailed >= tasks {
			return st
		}
		if time.Now().After(deadline) {
			require.FailNowf(n.t, "timed out", "%d tasks never ended: %+v", tasks, st)
		}
		time.Sleep(time.Millisecond)
	}
}

var fillSeed atomic.Int64

// close checks that nothing leaked and closes the bridge and the engine.
// Every block the pool can hold must fit into it at once, which fails if
// a pin, a staging extent or a parked batch outlived its load; the engine
// closes only when every batch was freed and every region unregistered.
func (n *node) close() error {
	if n.closed {
		return nil
	}
	n.closed = true
	_, _, poolBytes := n.b.Resident()
	want := int(poolBytes / int64(n.m.BlockBytes()))
	h := newHost(n.t, want*blockTokens)
	tokens := prompt(1e6+fillSeed.Add(1), want*blockTokens)
	var errs []error
	sv, err := n.m.SaveBegin(key.Scope{}, h.Layout(), tokens, kvtest.SeqCells(len(tokens)))
	if err != nil {
		errs = append(errs, fmt.Errorf("%s: the pool cannot take %d new blocks: %w", n.b.Owner(), want, err))
	} else {
		if got := sv.Blocks(); got != want {
			errs = append(errs, fmt.Errorf("%s: %d of %d blocks fit in the pool: pins or staging leaked", n.b.Owner(), got, want))
		}
		// No layer was saved: End frees the blocks and publishes nothing.
		if _, err := sv.End(); status.Of(err) != status.State {
			errs = append(errs, fmt.Errorf("%s: ending the unfilled save: %v", n.b.Owner(), err))
		}
	}
	if err := n.b.Close(); err != nil {
		errs = append(errs, fmt.Errorf("%s: bridge close: %w", n.b.Owner(), err))
	}
	if err := n.eng.Close(); err != nil {
		errs = append(errs, fmt.Errorf("%s: engine close (batches or registrations left): %w", n.b.Owner(), err))
	}
	if len(errs) > 0 {
		return fmt.Errorf("%v", errs)
	}
	return nil
}

// teardown runs a test's closers in reverse order, once, before the test
// compares its goroutine count with the count it started with.
type teardown struct {
	fns  []func() error
	done bool
}

func (td *teardown) add(f func() error) { td.fns = append(td.fns, f) }

func (td *teardown) run() []error {
	if td.done {
		return nil
	}
	td.done = true
	var errs []error
	for i := len(td.fns) - 1; i >= 0; i-- {
		if err := td.fns[i](); err != nil {
			errs = append(errs, err)
		}
	}
	return errs
}

// settleGoroutines waits until no more goroutines run than base: clients
// end theirs asynchronously after Close.
func settleGoroutines(t *testing.T, base int) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for runtime.NumGoroutine() > base {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			assert.Failf(t, "goroutines leaked", "%d goroutines still run, %d before the test:\n%s", runtime.NumGoroutine(), base, buf[:runtime.Stack(buf, true)])
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}
