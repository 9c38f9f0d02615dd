package bridge

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/holdings"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/storenode"
)

// Snapshots (docs/design.md §5.9). A model whose host keeps a partial
// state beside its KV rows (a sliding-window cache, a recurrent state:
// key.Model.Partial) restores only where a snapshot of that state was
// taken, at a block boundary P: the blocks give positions [0, P), the
// snapshot the rest. A snapshot is an opaque byte string that travels as
// a block: its own key (key.Snapshot of P's last block, which it hangs
// under), the last block's tokens, and a payload of K-only "layers" that
// hold the string's length and then the string. So the pool, the
// directory, the holders' eviction, store nodes and every transport path
// carry it unchanged, and a reader verifies it as any block.

// snapshotRow bounds the row of a snapshot's layers: a block holds at most
// pool.MaxLayers of them, so a snapshot of 256-token blocks holds up to
// 1 TiB.
const snapshotRow = 1 << 20

// snapshotLen is the payload's length prefix.
const snapshotLen = 8

// snapshotGeometry frames n bytes of state in blocks of B tokens.
func snapshotGeometry(B, n int) pool.Geometry {
	need := snapshotLen + n
	layers := (need + B*snapshotRow - 1) / (B * snapshotRow)
	row := (need + layers*B - 1) / (layers * B)
	g := pool.Geometry{BlockTokens: B, KRow: make([]int, layers), VRow: make([]int, layers)}
	for l := range g.KRow {
		g.KRow[l] = row
	}
	return g
}

// SnapshotTokens is how many tokens apart the host snapshots the model's
// partial state (config snapshot_blocks blocks), 0 when it keeps none.
func (m *Model) SnapshotTokens() int {
	if m.spec.Params.Partial == "" {
		return 0
	}
	return m.b.cfg.SnapshotBlocks * m.geo.BlockTokens
}

// SaveSnapshot stores state, the host's partial state once positions
// [0, len(tokens)) were computed from position 0 over tokens under scope,
// and queues it for the directory; it returns without waiting on it. A
// snapshot held here or known to the directory already is not stored
// again. len(tokens) is a positive multiple of the block size.
func (m *Model) SaveSnapshot(scope key.Scope, tokens []int32, state []byte) error {
	b := m.b
	B := m.geo.BlockTokens
	switch {
	case m.spec.Params.Partial == "":
		return status.Errorf(status.Unsupported, "model %s keeps no partial state", m.fp)
	case len(tokens) == 0 || len(tokens)%B != 0:
		return status.Errorf(status.InvalidArg, "snapshot after %d tokens: a positive multiple of the block size %d", len(tokens), B)
	case len(state) == 0:
		return status.Errorf(status.InvalidArg, "empty snapshot")
	}
	root := key.Root(m.fp, scope)
	chain := key.Chain(root, tokens, B)
	index := len(chain) - 1
	last := chain[index]
	sk := key.Snapshot(last)
	if m.snapshotKnown(last) {
		return nil
	}
	g := snapshotGeometry(B, len(state))
	if err := g.Validate(); err != nil {
		return status.Wrap(status.InvalidArg, err, fmt.Sprintf("snapshot of %d bytes", len(state)))
	}
	if err := b.begin(); err != nil {
		return err
	}
	defer b.end()
	size := int64(g.Size())
	off, err := b.alloc(size)
	if err != nil {
		return err
	}
	gen := b.hold.NextGeneration()
	blk := b.hold.Bytes(off, size)
	pool.BeginWrite(blk, gen)
	payload := blk[g.HeaderSize() : g.HeaderSize()+g.PayloadSize()]
	binary.LittleEndian.PutUint64(payload, uint64(len(state)))
	copy(payload[snapshotLen:], state)
	clear(payload[snapshotLen+len(state):])
	sums := make([]uint64, g.Layers())
	for l := range sums {
		o := g.LayerOffset(l)
		sums[l] = pool.Sum(blk[o : o+g.LayerSize(l)])
	}
	h := pool.Header{Key: sk, Parent: last, Model: m.fp, Depth: uint32(index), Tokens: tokens[index*B:], LayerSums: sums}
	if err := pool.EncodeHeader(blk, &g, &h); err != nil {
		b.hold.Invalidate(off, size)
		return err
	}
	pool.EndWrite(blk, gen)
	e := directory.Entry{Model: m.fp, Key: sk, Parent: last, Loc: b.location(off, size, pool.HeaderSum(blk), gen)}
	held, err := b.hold.Seal(last, holdings.Block{Model: m.fp, Off: off, Size: size, Gen: gen, Depth: uint32(index), Entry: e, Index: index},
		b.arb.PrefillTime(0, len(tokens)).Seconds())
	if err != nil || !held {
		b.hold.Invalidate(off, size)
		return err
	}
	_, refused := b.hold.OfferPending([]key.BlockKey{sk}, b.pub.offer)
	b.stats.add(&b.stats.publishDropped, int64(refused))
	b.stats.add(&b.stats.snapshotsSaved, 1)
	return nil
}

// MissingSnapshots lists, in order, the snapshot boundaries n with
// from < n < len(tokens) after which no snapshot of tokens under scope is
// held here or known to the directory: where a host that snapshots from
// outside the server (the proxy) has to stop a prompt. The candidates are
// the prompt's last block boundary and its branch: the end of the first
// branch tokens, those whose blocks the directory knows (the lookup's
// match), when that is a block boundary. With config proxy_snapshots
// "every", or for a model that keeps no KV blocks (whose branches nothing
// shows), every SnapshotTokens is one as well.
func (m *Model) MissingSnapshots(scope key.Scope, tokens []int32, from, branch int) []int {
	every, B := m.SnapshotTokens(), m.geo.BlockTokens
	if every == 0 || len(tokens) <= B {
		return nil
	}
	last := (len(tokens) - 1) / B * B
	var at []int
	if m.b.cfg.ProxySnapshots == "every" || m.SnapshotOnly() {
		for n := every; n < last; n += every {
			at = append(at, n)
		}
	}
	if branch%B == 0 && branch < last {
		at = append(at, branch)
	}
	at = append(at, last)
	slices.Sort(at)
	at = slices.Compact(at)
	chain := key.Chain(key.Root(m.fp, scope), tokens[:last], B)
	var missing []int
	for _, n := range at {
		if n > from && !m.snapshotKnown(chain[n/B-1]) {
			missing = append(missing, n)
		}
	}
	return missing
}

// snapshotKnown says whether the snapshot after block k is held here or
// known to the directory.
func (m *Model) snapshotKnown(k key.BlockKey) bool {
	sk := key.Snapshot(k)
	if _, ok := m.b.hold.Get(sk); ok {
		return true
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	_, ok := m.mirror.get(sk)
	return ok
}

// isSnapshot says whether an entry names a snapshot, not a block: its key
// is the snapshot key of its parent's.
func isSnapshot(e directory.Entry) bool { return e.Key == key.Snapshot(e.Parent) }

// snapshotAfter finds a readable snapshot taken where block k ends: one
// this process holds, else one the mirror names on a peer that is not
// down. Snapshots are read whole, by the transport or from a same-host
// pool, so copies on Mooncake Store segments are not taken.
func (m *Model) snapshotAfter(k key.BlockKey, down map[string]bool) (directory.Entry, bool) {
	b := m.b
	sk := key.Snapshot(k)
	if s, ok := b.hold.Get(sk); ok && s.State.Ours() && s.Model == m.fp && s.Entry.Parent == k {
		return s.Entry, true
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	e, ok := m.mirror.get(sk)
	if !ok || e.Parent != k || down[e.Loc.Segment] {
		return directory.Entry{}, false
	}
	if _, _, store := parseStoreSegment(e.Loc.Segment); store {
		return directory.Entry{}, false
	}
	return *e, true
}

// snapshotBoundaries lists, in order, the block counts k <= len(chain)
// where a snapshot was taken after chain[k-1], with their entries.
func (m *Model) snapshotBoundaries(chain []key.BlockKey) ([]int, []directory.Entry) {
	down := m.b.downSegments()
	var at []int
	var entries []directory.Entry
	for i, k := range chain {
		if e, ok := m.snapshotAfter(k, down); ok {
			at = append(at, i+1)
			entries = append(entries, e)
		}
	}
	return at, entries
}

// snapshotFetch is a load's read of its snapshot, run beside its layers
// by a goroutine of the load: the host's thread waits on no peer for it.
type snapshotFetch struct {
	entry  directory.Entry
	expect pool.Expect
	tokens int           // the tokens the state is after
	done   chan struct{} // closed once state or err is set

	state   []byte // the verified state: pinned pool memory or staging, valid until release
	err     error
	pinned  bool   // held in this pool and pinned
	staging extent // where a peer's copy landed
}

// fetchSnapshot reads and verifies the load's snapshot within the load's
// deadline.
func (ld *Load) fetchSnapshot() {
	f := ld.snap
	defer close(f.done)
	b := ld.m.b
	e := f.entry
	var blk []byte
	if e.Loc.Segment == b.tr.LocalSegment() {
		held, ok := b.hold.Pin(e.Key, e.Loc.Generation)
		if !ok {
			f.err = status.Errorf(status.NotFound, "snapshot %s left the pool", e.Key)
			return
		}
		f.pinned = true
		blk = b.hold.Bytes(held.Value.Off, held.Value.Size)
	} else {
		n := int64(e.Loc.Length)
		off, err := b.alloc(n)
		if err != nil {
			f.err = err
			return
		}
		f.staging = extent{off, n}
		if err := b.readBlock(ld.ctx, e, off); err != nil {
			if errors.Is(err, storenode.ErrParked) {
				// A transfer still in flight owns the extent now.
				f.staging = extent{}
			}
			f.err = err
			return
		}
		blk = b.hold.Bytes(off, n)
	}
	g, _, err := pool.VerifyBlock(blk, &f.expect)
	if err != nil {
		f.err = err
		return
	}
	payload := blk[g.HeaderSize() : g.HeaderSize()+g.PayloadSize()]
	n := binary.LittleEndian.Uint64(payload)
	if n == 0 || n > uint64(len(payload)-snapshotLen) {
		f.err = status.Errorf(status.Corrupt, "snapshot %s says %d bytes in a payload of %d", e.Key, n, len(payload))
		return
	}
	f.state = payload[snapshotLen : snapshotLen+int(n)]
}

// Snapshot waits until the load is over and returns the partial state its
// tokens end at, verified; nil for a model that keeps none. The bytes are
// valid until End, which reports a load whose snapshot failed as one that
// restored nothing.
func (ld *Load) Snapshot() ([]byte, error) {
	<-ld.done
	ld.mu.Lock()
	defer ld.mu.Unlock()
	switch {
	case ld.ended:
		return nil, status.Errorf(status.State, "snapshot of an ended load")
	case ld.snap == nil:
		return nil, nil
	case ld.snap.err != nil:
		return nil, ld.snap.err
	}
	return ld.snap.state, nil
}

// settleSnapshot makes a load whose snapshot failed, or whose blocks did
// not all arrive, restore nothing: without the state at its end the
// blocks alone are no state the host can go on from.
func (ld *Load) settleSnapshot() {
	f := ld.snap
	if f == nil || (ld.ok == 0 && !ld.m.SnapshotOnly()) {
		return
	}
	switch {
	case f.err != nil:
		ld.ok, ld.err = 0, f.err
		ld.m.b.suspect(&f.entry, f.err)
	case ld.ok < len(ld.blocks):
		ld.ok = 0
	}
}

// releaseSnapshot unpins or frees what the snapshot was read into.
func (ld *Load) releaseSnapshot() {
	f := ld.snap
	if f == nil {
		return
	}
	if f.pinned {
		ld.m.b.hold.Unpin(f.entry.Key)
		f.pinned = false
	}
	if f.staging.n > 0 {
		ld.freeStaging([]extent{f.staging})
		f.staging = extent{}
	}
	f.state = nil
}
