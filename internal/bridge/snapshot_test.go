package bridge_test

import (
	"bytes"
	"math/rand"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/bridge/bridgetest"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/transport"
)

// registerPartial registers h's model as one whose host keeps a partial
// state beside its KV rows.
func registerPartial(t *testing.T, b *bridge.Bridge, h *kvtest.Host) *bridge.Model {
	spec := bridgetest.Spec(h, 4)
	spec.Params.Partial = "window 8 of 3 layers"
	m, err := b.RegisterModel(spec)
	require.NoError(t, err)
	return m
}

// partialState is a stand-in for what llama.cpp's PARTIAL_ONLY state
// holds after n tokens: bytes that depend on the tokens and the size.
func partialState(tokens []int32, size int) []byte {
	out := make([]byte, size)
	r := rand.New(rand.NewSource(int64(tokens[len(tokens)-1]) + int64(len(tokens))))
	r.Read(out)
	return out
}

// restorePartial looks tokens up on m and, when the plan restores, loads
// it into h layer by layer and takes its snapshot before ending it.
func restorePartial(t *testing.T, m *bridge.Model, h *kvtest.Host, tokens []int32) (*bridge.Plan, bridge.LoadResult, []byte, error) {
	t.Helper()
	p, err := m.Lookup(key.Scope{}, tokens, 0)
	require.NoError(t, err)
	if p.RestoreTokens == 0 {
		return p, bridge.LoadResult{}, nil, nil
	}
	ld, err := p.Load(h.Layout(), kvtest.SeqCells(p.RestoreTokens))
	require.NoError(t, err)
	for l := range h.K {
		_, err := ld.WaitLayer(l)
		require.NoError(t, err)
	}
	snap, snapErr := ld.Snapshot()
	snap = bytes.Clone(snap) // valid until End
	res, err := ld.End()
	if err == nil {
		err = snapErr
	}
	return p, res, snap, err
}

// A model that keeps a partial state restores to the last block boundary
// where a snapshot was taken, hands the snapshot back with the blocks,
// and restores nothing where none was.
func TestSnapshotRestore(t *testing.T) {
	for _, tc := range []struct {
		name     string
		twoProcs bool
		size     int
	}{
		{"local", false, 1000},
		{"remote", true, 1000},
		// Larger than one 1 MiB row a token: a snapshot of several layers.
		{"remote-large", true, 9 << 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := bridgetest.Config(t)
			cfg.PoolBytes = 64 << 20
			// Where the restore ends is under test, not whether it pays.
			cfg.Arbiter.Policy = "always-restore"
			a := bridgetest.Open(t, cfg, "a")
			b := a
			if tc.twoProcs {
				b = bridgetest.Open(t, cfg, "b")
			}
			src := kvtest.New(t, 3, 64, 32, 48, false)
			dst := kvtest.New(t, 3, 64, 32, 48, false)
			ma, mb := registerPartial(t, a, src), registerPartial(t, b, dst)
			require.Equal(t, 4*cfg.SnapshotBlocks, ma.SnapshotTokens())
			tokens := kvtest.Tokens(rand.New(rand.NewSource(3)), 22) // five blocks and two tokens
			cells := kvtest.SeqCells(len(tokens))
			src.Fill(tokens, cells)

			// Blocks alone restore nothing.
			res := bridgetest.SaveAll(t, ma, src, key.Scope{}, tokens, cells)
			require.Equal(t, 5, res.Published, "save: %+v", res)
			p, _, _, err := restorePartial(t, mb, dst, tokens)
			require.NoError(t, err)
			require.Equal(t, 5, p.MatchedBlocks)
			require.Zero(t, p.RestoreTokens, "a restore with no snapshot: %+v", p.Decision)

			before := a.Stats()
			for _, n := range []int{8, 16} {
				require.NoError(t, ma.SaveSnapshot(key.Scope{}, tokens[:n], partialState(tokens[:n], tc.size)))
			}
			// Stored once: the second save of the same snapshot is a no-op.
			require.NoError(t, ma.SaveSnapshot(key.Scope{}, tokens[:16], partialState(tokens[:16], tc.size)))
			require.Equal(t, int64(2), a.Stats().SnapshotsSaved-before.SnapshotsSaved)
			bridgetest.Published(t, a, before)
			bridgetest.WaitFor(t, "the snapshots in b's mirror", func() bool { return mb.Mirrored() == 7 })

			dst.Scribble()
			p, got, snap, err := restorePartial(t, mb, dst, tokens)
			require.NoError(t, err)
			require.Equal(t, 16, p.RestoreTokens, "the last snapshot within the matched blocks: %+v", p.Decision)
			require.Equal(t, 16, got.OKTokens, "load: %+v", got)
			require.NoError(t, dst.Check(tokens[:16], kvtest.SeqCells(16), 16))
			require.Equal(t, partialState(tokens[:16], tc.size), snap, "the snapshot after 16 tokens")

			// A prompt that leaves the chain before 16 tokens ends at 8.
			other := append(append([]int32(nil), tokens[:12]...), 7, 7, 7, 7, 7, 7)
			p, got, snap, err = restorePartial(t, mb, dst, other)
			require.NoError(t, err)
			require.Equal(t, 8, got.OKTokens, "%+v", p.Decision)
			require.Equal(t, partialState(tokens[:8], tc.size), snap, "the snapshot after 8 tokens")
		})
	}
}

// The proxy stops a prompt where a snapshot is missing: by default at the
// prompt's last block boundary and where it leaves the blocks its lookup
// matched (a branch), with proxy_snapshots "every" at every
// snapshot_blocks blocks as well; never at or before from, never where a
// snapshot is known.
func TestMissingSnapshots(t *testing.T) {
	for _, tc := range []struct {
		mode                       string
		noBranch, branch, fromHeld []int
	}{
		{"ends", []int{20}, []int{12, 20}, []int{12, 20}},
		{"every", []int{8, 16, 20}, []int{8, 12, 16, 20}, []int{12, 20}},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			cfg := bridgetest.Config(t)
			cfg.ProxySnapshots, cfg.SnapshotBlocks = tc.mode, 2
			a := bridgetest.Open(t, cfg, "a")
			m := registerPartial(t, a, kvtest.New(t, 3, 64, 32, 48, false))
			require.Equal(t, 8, m.SnapshotTokens(), "blocks of 4 tokens, a snapshot every 2 blocks")
			tokens := kvtest.Tokens(rand.New(rand.NewSource(3)), 22) // five blocks and two tokens
			require.Equal(t, tc.noBranch, m.MissingSnapshots(key.Scope{}, tokens, 0, 0))
			require.Equal(t, tc.branch, m.MissingSnapshots(key.Scope{}, tokens, 0, 12), "a branch after 3 blocks")
			require.Equal(t, tc.noBranch, m.MissingSnapshots(key.Scope{}, tokens, 0, 14), "a match that ends inside a block is no boundary")
			require.NoError(t, m.SaveSnapshot(key.Scope{}, tokens[:8], partialState(tokens[:8], 100)))
			require.NoError(t, m.SaveSnapshot(key.Scope{}, tokens[:16], partialState(tokens[:16], 100)))
			require.Equal(t, tc.fromHeld, m.MissingSnapshots(key.Scope{}, tokens, 0, 12), "snapshots held")
			require.Equal(t, []int{20}, m.MissingSnapshots(key.Scope{}, tokens, 12, 12), "from 12")
			require.Empty(t, m.MissingSnapshots(key.Scope{}, tokens[:4], 0, 0), "one block: nothing before the last token")
			require.Equal(t, []int{4}, m.MissingSnapshots(key.Scope{}, tokens[:5], 0, 0), "a block and a token")
		})
	}
}

// A snapshot that fails verification makes its load restore nothing, its
// blocks verified or not; a holder that hangs costs the load its deadline.
func TestSnapshotFaults(t *testing.T) {
	for _, tc := range []struct {
		name  string
		fault func(a *bridge.Bridge, snap key.BlockKey)
		code  status.Code
	}{
		{"corrupt-in-pool", func(a *bridge.Bridge, snap key.BlockKey) {
			held, ok := a.Holdings().Get(snap)
			if !ok {
				panic("snapshot not held")
			}
			a.Holdings().Bytes(held.Off, held.Size)[held.Size-100] ^= 0x5a
		}, status.Corrupt},
		{"hung-holder", func(a *bridge.Bridge, _ key.BlockKey) {
			a.Transport().(*transport.Loopback).SetFault(transport.Fault{Kind: transport.Delay, Arg: int64(time.Hour)})
		}, status.Timeout},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := bridgetest.Config(t)
			cfg.TransferTimeoutMS = 200
			a, b := bridgetest.Open(t, cfg, "a"), bridgetest.Open(t, cfg, "b")
			src := kvtest.New(t, 3, 32, 32, 32, false)
			dst := kvtest.New(t, 3, 32, 32, 32, false)
			ma, mb := registerPartial(t, a, src), registerPartial(t, b, dst)
			tokens := kvtest.Tokens(rand.New(rand.NewSource(5)), 17)
			cells := kvtest.SeqCells(len(tokens))
			src.Fill(tokens, cells)
			before := a.Stats()
			bridgetest.SaveAll(t, ma, src, key.Scope{}, tokens, cells)
			require.NoError(t, ma.SaveSnapshot(key.Scope{}, tokens[:16], partialState(tokens[:16], 3000)))
			bridgetest.Published(t, a, before)
			bridgetest.WaitFor(t, "the snapshot in b's mirror", func() bool { return mb.Mirrored() == 5 })

			chain := key.Chain(key.Root(ma.Fingerprint(), key.Scope{}), tokens, 4)
			tc.fault(a, key.Snapshot(chain[3]))
			dst.Scribble()
			_, res, snap, err := restorePartial(t, mb, dst, tokens)
			require.Equal(t, tc.code, status.Of(err), "load error %v", err)
			require.Zero(t, res.OKTokens, "a load whose snapshot failed restored tokens: %+v", res)
			require.Nil(t, snap)
		})
	}
}

func TestSnapshotMisuse(t *testing.T) {
	cfg := bridgetest.Config(t)
	a := bridgetest.Open(t, cfg, "a")
	h := kvtest.New(t, 2, 16, 8, 8, false)
	plain := bridgetest.Register(t, a, h, 4)
	partial := registerPartial(t, a, h)
	require.NotEqual(t, plain.Fingerprint(), partial.Fingerprint(), "the partial state is in the fingerprint")
	require.Zero(t, plain.SnapshotTokens())
	tokens := kvtest.Tokens(rand.New(rand.NewSource(1)), 8)
	require.Equal(t, status.Unsupported, status.Of(plain.SaveSnapshot(key.Scope{}, tokens, []byte{1})))
	require.Equal(t, status.InvalidArg, status.Of(partial.SaveSnapshot(key.Scope{}, tokens[:6], []byte{1})))
	require.Equal(t, status.InvalidArg, status.Of(partial.SaveSnapshot(key.Scope{}, nil, []byte{1})))
	require.Equal(t, status.InvalidArg, status.Of(partial.SaveSnapshot(key.Scope{}, tokens, nil)))
	// LoadBegin of tokens with no snapshot after them is refused.
	h.Fill(tokens, kvtest.SeqCells(8))
	bridgetest.SaveAll(t, partial, h, key.Scope{}, tokens, kvtest.SeqCells(8))
	_, err := partial.LoadBegin(key.Scope{}, h.Layout(), tokens, kvtest.SeqCells(8))
	require.Equal(t, status.NotFound, status.Of(err), "%v", err)
}

// registerSnapshotOnly registers a model whose state is all partial (a
// recurrent memory): no KV layers.
func registerSnapshotOnly(t *testing.T, b *bridge.Bridge) *bridge.Model {
	t.Helper()
	m, err := b.RegisterModel(bridge.ModelSpec{Params: key.Model{BlockTokens: 4, Partial: "state recurrent mamba bytes 1000"}})
	require.NoError(t, err)
	require.True(t, m.SnapshotOnly())
	return m
}

// A model without KV layers restores a snapshot alone: from this process
// or a peer, the last one taken on the prompt's block boundaries, verified
// as any block; it saves no blocks, and a snapshot that fails verification
// or a hung holder restores nothing.
func TestSnapshotOnlyModel(t *testing.T) {
	cfg := bridgetest.Config(t)
	cfg.TransferTimeoutMS = 300
	cfg.Arbiter.Policy = "always-restore"
	a, b := bridgetest.Open(t, cfg, "a"), bridgetest.Open(t, cfg, "b")
	ma, mb := registerSnapshotOnly(t, a), registerSnapshotOnly(t, b)
	require.Equal(t, ma.Fingerprint(), mb.Fingerprint())
	tokens := kvtest.Tokens(rand.New(rand.NewSource(9)), 22)
	restore := func(m *bridge.Model, tokens []int32) (*bridge.Plan, bridge.LoadResult, []byte, error) {
		t.Helper()
		p, err := m.Lookup(key.Scope{}, tokens, 0)
		require.NoError(t, err)
		if p.RestoreTokens == 0 {
			return p, bridge.LoadResult{}, nil, nil
		}
		ld, err := p.Load(kvlayout.Layout{}, nil)
		require.NoError(t, err)
		snap, snapErr := ld.Snapshot()
		snap = bytes.Clone(snap)
		res, err := ld.End()
		if err == nil {
			err = snapErr
		}
		return p, res, snap, err
	}

	p, _, _, err := restore(mb, tokens)
	require.NoError(t, err)
	require.Zero(t, p.RestoreTokens, "nothing saved: %+v", p.Decision)
	_, err = ma.SaveBegin(key.Scope{}, kvlayout.Layout{}, tokens[:8], kvtest.SeqCells(8))
	require.Equal(t, status.Unsupported, status.Of(err), "a block save of a model without layers: %v", err)

	before := a.Stats()
	for _, n := range []int{8, 16} {
		require.NoError(t, ma.SaveSnapshot(key.Scope{}, tokens[:n], partialState(tokens[:n], 1000)))
	}
	bridgetest.Published(t, a, before)
	bridgetest.WaitFor(t, "the snapshots in b's mirror", func() bool { return mb.Mirrored() == 2 })

	for name, m := range map[string]*bridge.Model{"own pool": ma, "peer": mb} {
		p, got, snap, err := restore(m, tokens)
		require.NoError(t, err, name)
		require.Equal(t, 16, p.RestoreTokens, "%s: the last snapshot on the prompt: %+v", name, p.Decision)
		require.Equal(t, 4, p.MatchedBlocks, name)
		require.Equal(t, 16, got.OKTokens, "%s: %+v", name, got)
		require.Equal(t, partialState(tokens[:16], 1000), snap, name)
	}
	other := append(append([]int32(nil), tokens[:13]...), 7, 7, 7, 7, 7)
	_, got, snap, err := restore(mb, other)
	require.NoError(t, err)
	require.Equal(t, 8, got.OKTokens, "a prompt that leaves the chain before 16 tokens")
	require.Equal(t, partialState(tokens[:8], 1000), snap)

	p, err = mb.Lookup(key.Scope{}, tokens, 0)
	require.NoError(t, err)
	_, err = p.Load(kvlayout.Layout{}, kvtest.SeqCells(16))
	require.Equal(t, status.Layout, status.Of(err), "cells for a load with nothing to put in them: %v", err)

	chain := key.Chain(key.Root(ma.Fingerprint(), key.Scope{}), tokens, 4)
	held, ok := a.Holdings().Get(key.Snapshot(chain[3]))
	require.True(t, ok)
	a.Holdings().Bytes(held.Off, held.Size)[held.Size-100] ^= 0x5a
	_, got, snap, err = restore(mb, tokens)
	require.Equal(t, status.Corrupt, status.Of(err), "%v", err)
	require.Zero(t, got.OKTokens)
	require.Nil(t, snap)

	a.Transport().(*transport.Loopback).SetFault(transport.Fault{Kind: transport.Delay, Arg: int64(time.Hour)})
	_, got, _, err = restore(mb, other)
	require.Equal(t, status.Timeout, status.Of(err), "%v", err)
	require.Zero(t, got.OKTokens)
}
