package bridge_test

import (
	"math/rand"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge/bridgetest"
	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/transport"
)

// A plan's load gives up at the deadline the arbiter gave it, not at
// transfer_timeout_ms; the miss marks the peer down and teaches the
// arbiter that the peer is slower than it believed.
func TestPlanLoadKeepsTheArbitersDeadline(t *testing.T) {
	cfg := bridgetest.Config(t)
	cfg.TransferTimeoutMS = 2000
	cfg.Arbiter.DeadlineMarginMS = 20
	p := savedPeers(t, cfg, 32, 4, 16, 21)
	a, b, dst, mb, tokens := p.a, p.b, p.dst, p.mb, p.tokens
	cells := kvtest.SeqCells(12)

	plan, err := mb.Lookup(key.Scope{}, tokens, 0)
	require.NoError(t, err)
	require.Equal(t, 12, plan.RestoreTokens, "%v", plan.Decision)
	deadline := plan.Decision.Deadline
	require.Greater(t, deadline, 20*time.Millisecond, "the margin and some restores")
	require.Less(t, deadline, time.Duration(cfg.TransferTimeoutMS)*time.Millisecond, "the case needs a deadline below the cap")

	// Without a plan there is no estimate: transfer_timeout_ms applies.
	ld, err := mb.LoadBegin(key.Scope{}, dst.Layout(), tokens[:12], cells)
	require.NoError(t, err)
	require.Equal(t, time.Duration(cfg.TransferTimeoutMS)*time.Millisecond, ld.Deadline())
	_, err = ld.End()
	require.NoError(t, err)
	link := b.LinkFor(plan.Entries()[0])
	believed := b.Arbiter().TransferTime(link, 12*int64(mb.Geometry().PayloadSize()/mb.Geometry().BlockTokens))

	a.Transport().(*transport.Loopback).SetFault(transport.Fault{Kind: transport.Delay, Arg: int64(time.Second)})
	defer a.Transport().(*transport.Loopback).SetFault(transport.Fault{})
	dst.Scribble()
	ld, err = plan.Load(dst.Layout(), cells)
	require.NoError(t, err)
	require.Equal(t, deadline, ld.Deadline(), "the load runs under the plan's deadline")
	res, err := ld.End()
	require.Equal(t, status.Timeout, status.Of(err), "%v", err)
	require.Zero(t, res.OKTokens)
	require.NoError(t, dst.CheckRestored(tokens[:12], cells, 0))
	require.Equal(t, int64(1), b.Stats().PeersDown, "the miss marks the holder down")
	require.Greater(t, b.Arbiter().TransferTime(link, 12*int64(mb.Geometry().PayloadSize()/mb.Geometry().BlockTokens)), believed,
		"the miss, a transfer of at least the deadline, slows the arbiter's estimate of the link")

}

// A load never waits on a peer on the host's thread: LoadBegin returns with
// the transfers in flight, Poll reports without waiting, and Cancel stops
// a load whose holder does not answer, blaming no peer.
func TestLoadPollAndCancel(t *testing.T) {
	cfg := bridgetest.Config(t)
	p := savedPeers(t, cfg, 32, 4, 16, 22)
	a, b, dst, mb, tokens := p.a, p.b, p.dst, p.mb, p.tokens
	cells := kvtest.SeqCells(16)

	dst.Scribble()
	ld, err := mb.LoadBegin(key.Scope{}, dst.Layout(), tokens, cells)
	require.NoError(t, err)
	require.True(t, ld.Poll(time.Minute), "a load from an answering holder is over long before a minute")
	layers, ok, err := ld.Progress()
	require.NoError(t, err)
	require.Equal(t, []int{len(dst.Layout().Layers), 16}, []int{layers, ok}, "an intact load that is over has every layer placed")
	res, err := ld.End()
	require.NoError(t, err)
	require.Equal(t, 16, res.OKTokens)
	require.NoError(t, dst.Check(tokens, cells, 16))

	a.Transport().(*transport.Loopback).SetFault(transport.Fault{Kind: transport.Delay, Arg: int64(time.Hour)})
	defer a.Transport().(*transport.Loopback).SetFault(transport.Fault{})
	dst.Scribble()
	ld, err = mb.LoadBegin(key.Scope{}, dst.Layout(), tokens, cells)
	require.NoError(t, err)
	require.False(t, ld.Poll(0), "the holder's transfers are an hour late")
	layers, _, err = ld.Progress()
	require.NoError(t, err)
	require.Zero(t, layers, "no layer is in place while every transfer is late")
	ld.Cancel()
	require.True(t, ld.Poll(time.Minute), "a cancelled load is over once its transfers are stopped")
	res, err = ld.End()
	require.Equal(t, status.State, status.Of(err), "%v", err)
	require.Zero(t, res.OKTokens)
	require.NoError(t, dst.CheckRestored(tokens, cells, 0))
	require.Zero(t, b.Stats().PeersDown, "the host gave up: no peer is to blame")
	require.True(t, ld.Poll(0), "an ended load stays over")
	_, _, err = ld.Progress()
	require.Equal(t, status.State, status.Of(err), "an ended load has no progress: %v", err)
}

// A first contact over a link slower than its prior, delivering layers when
// the deadline passes, is not a hung peer: the miss calibrates the link and
// leaves the peer in the plans. The next miss, judged against the
// measurement, marks it down.
func TestSlowFirstContactIsNotDown(t *testing.T) {
	cfg := bridgetest.Config(t)
	cfg.TransferTimeoutMS = 40
	cfg.PeerDownMS = 10000
	a := bridgetest.Open(t, cfg, "a")
	// About 20 ms a layer for 16 tokens of 8 layers: a layer or two
	// arrive within the deadline, not all, and the rest are still due
	// when a poller that woke 100 ms late looks (at 10 ms a layer, one
	// under CI's load found every layer in and the load whole).
	slow := cfg
	slow.Transport.BandwidthGBps = 0.0001
	b := bridgetest.Open(t, slow, "b")
	src, dst := kvtest.New(t, 8, 32, 32, 32, false), kvtest.New(t, 8, 32, 32, 32, false)
	ma, mb := bridgetest.Register(t, a, src, 4), bridgetest.Register(t, b, dst, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(23)), 16)
	cells := kvtest.SeqCells(16)
	src.Fill(tokens, cells)
	bridgetest.SaveAll(t, ma, src, key.Scope{}, tokens, cells)

	miss := func() {
		t.Helper()
		dst.Scribble()
		ld, err := mb.LoadBegin(key.Scope{}, dst.Layout(), tokens, cells)
		require.NoError(t, err)
		res, err := ld.End()
		require.Equal(t, status.Timeout, status.Of(err), "%v", err)
		require.Less(t, res.OKTokens, 16)
		require.NoError(t, dst.CheckRestored(tokens, cells, res.OKTokens))
	}
	link := b.LinkFor(directory.Entry{Loc: directory.Location{Segment: a.Transport().LocalSegment()}})
	require.False(t, b.Arbiter().Calibrated(link))
	miss()
	require.Zero(t, b.Stats().PeersDown, "a slow first contact is no hung peer")
	require.True(t, b.Arbiter().Calibrated(link), "the miss calibrated the link")
	p, err := mb.Lookup(key.Scope{}, tokens, 0)
	require.NoError(t, err)
	require.Equal(t, 3, p.MatchedBlocks, "the peer stays in the plans (the last token is computed): %+v", p.Decision)
	miss()
	require.Equal(t, int64(1), b.Stats().PeersDown, "a calibrated link's miss marks the peer down")
}
