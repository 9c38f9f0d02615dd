package bridge

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout"
	"github.com/mcbridge/mcbridge/internal/mem"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/transport"
)

// Load restores a prompt's leading blocks into a host's KV tensors, layer
// by layer. Goroutines of its own reach the peers (the worker opens their
// segments and submits the transfers), wait for each layer's transfers (the
// poller) and verify and place it (the worker, see run), so the host's
// thread waits on no peer: only for layers it needs while later layers
// arrive, or not at all (Poll). One goroutine drives a Load at a time.
type Load struct {
	m        *Model
	layout   kvlayout.Layout
	blocks   []loadBlock
	start    time.Time
	deadline time.Duration
	ctx      context.Context
	cancel   context.CancelCauseFunc
	done     chan struct{} // closed by the worker once the load is over (Poll)
	finished time.Time     // when it was over, written before done closes

	batch   transport.Batch
	store   *storeFetch    // blocks read from the store (storefetch.go)
	snap    *snapshotFetch // the partial state the blocks end at (snapshot.go), or nil
	waves   []taskSpan     // per layer, the transport tasks of every remote block
	staging []extent       // pool memory the transport writes into
	// landed: remote blocks' layers land in place in the host's tensors,
	// with only their headers staged (see submitRemote).
	landed  bool
	scratch [][]byte // per placing goroutine (GOMAXPROCS) and the host, for SumPieces
	// pass is the placement in progress, which the host joins while it
	// would wait (help); nil between passes.
	pass atomic.Pointer[placing]
	gens genCheck // the seqlock's second read of the remote blocks

	// The worker (its placing helpers too) owns blocks and writes ok, err
	// and layers under mu until layers reaches the layer count; the host
	// reads them under mu.
	mu     sync.Mutex
	placed sync.Cond // signalled as layers reaches each layer
	layers int       // layers below it are placed for blocks [0, ok)
	ok     int       // leading blocks still good
	err    error     // why block ok failed
	ended  bool
}

type loadBlock struct {
	entry  directory.Entry
	expect pool.Expect
	runs   []kvlayout.Run
	src    []byte              // the block as verified: pool memory, a same-host pool's, or staging (its header alone when landed)
	seg    transport.SegmentID // a remote block's holder
	local  bool
	stored bool // read from the store into staging
	// mapped: read in place from a same-host process's shared pool
	// (samehost.go), whose mapping unmap releases.
	mapped bool
	unmap  func()
	// A remote block's transport tasks, per layer, and, when its layers
	// land in place, where each layer's payload lands.
	tasks  []taskSpan
	pieces [][]kvlayout.Piece
	header pool.Header
}

// taskSpan is tasks [first, first+n) of a load's batch.
type taskSpan struct{ first, n int }

// genCheck reads the generation of every remote block again once all of
// its payload has arrived: one batch of 64-byte reads, one per remote
// block, into an extent of its own (the header staging may still be
// under verification when it is issued).
type genCheck struct {
	at    extent          // genSlot bytes a remote block, in remote order
	task  []int           // per block, its task in batch, -1 for blocks not remote
	batch transport.Batch // nil until submitted
	err   error           // why it was not submitted
}

// genSlot is the bytes each generation read brings: the pool's alignment,
// which holds the generation word.
const genSlot = 64

// LoadResult says how much of a load arrived intact.
type LoadResult struct {
	Blocks   int   // blocks asked for
	OKBlocks int   // leading blocks restored and verified
	OKTokens int   // OKBlocks * block size
	Bytes    int64 // payload bytes placed
	Err      error // the first block's failure, nil when all arrived
}

// LoadBegin starts restoring tokens (whole blocks from position 0) into
// layout, position i going to cells[i]. Everything is checked before any
// transfer starts, so a refused load leaves the host's memory untouched.
// Blocks missing from the directory shorten the load; none found is
// status.NotFound.
func (m *Model) LoadBegin(scope key.Scope, layout kvlayout.Layout, tokens []int32, cells []uint32) (*Load, error) {
	B := m.geo.BlockTokens
	if len(tokens) == 0 || len(tokens)%B != 0 {
		return nil, status.Errorf(status.InvalidArg, "load of %d tokens: a positive multiple of the block size %d", len(tokens), B)
	}
	root := key.Root(m.fp, scope)
	chain := key.Chain(root, tokens, B)
	var snap *directory.Entry
	if m.spec.Params.Partial != "" {
		e, ok := m.snapshotAfter(chain[len(chain)-1], m.b.downSegments())
		if !ok {
			return nil, status.Errorf(status.NotFound, "no snapshot of the partial state after %d tokens", len(tokens))
		}
		snap = &e
	}
	return m.loadBegin(root, chain, tokens, snap, layout, cells, 0)
}

// Load starts restoring what a plan of this model decided, as
// LoadBegin, without hashing the prompt again, within the deadline the
// arbiter gave the restore.
func (p *Plan) Load(layout kvlayout.Layout, cells []uint32) (*Load, error) {
	if p.RestoreTokens == 0 {
		return nil, status.Errorf(status.NotFound, "the plan restores nothing (%s)", p.Decision.Reason)
	}
	return p.m.loadBegin(p.root, p.chain, p.tokens, p.snapshot, layout, cells, p.Decision.Deadline)
}

// errAbandoned is the cause with which Cancel stops a load the host gave up
// on before it was over: its transfers stop, and no peer is to blame.
var errAbandoned = status.Errorf(status.State, "the host ended the load before it was over")

// abandoned says whether ctx is a load's that its host gave up on.
func abandoned(ctx context.Context) bool { return context.Cause(ctx) == errAbandoned }

// loadBegin starts a load whose transfers must be in within deadline (the
// arbiter's, see arbiter.Config.DeadlineFactor), or transfer_timeout_ms
// when that is shorter or deadline is 0. snap is the snapshot the blocks
// end at, for a model that keeps a partial state.
func (m *Model) loadBegin(root key.Hash, chain []key.BlockKey, tokens []int32, snap *directory.Entry, layout kvlayout.Layout, cells []uint32, deadline time.Duration) (*Load, error) {
	b := m.b
	B := m.geo.BlockTokens
	var found []directory.Entry
	if m.SnapshotOnly() {
		// Nothing goes into cells: the snapshot is the whole state.
		switch {
		case snap == nil:
			return nil, status.Errorf(status.NotFound, "no snapshot of the state after %d tokens", len(tokens))
		case len(layout.Layers) != 0 || len(cells) != 0:
			return nil, status.Errorf(status.Layout, "a load of a model without KV layers into %d layers and %d cells", len(layout.Layers), len(cells))
		}
	} else {
		if len(cells) != len(tokens) {
			return nil, status.Errorf(status.InvalidArg, "load of %d tokens into %d cells", len(tokens), len(cells))
		}
		if err := layout.Validate(&m.shape); err != nil {
			return nil, err
		}
		if err := layout.CheckCells(cells); err != nil {
			return nil, err
		}
		found = m.match(root, chain)
		if len(found) == 0 {
			return nil, status.Errorf(status.NotFound, "no block of these tokens is published")
		}
		if snap != nil && len(found) < len(chain) {
			return nil, status.Errorf(status.NotFound, "%d of the %d blocks before the snapshot are published", len(found), len(chain))
		}
	}
	if err := b.begin(); err != nil {
		return nil, err
	}
	ld := &Load{m: m, layout: layout, start: b.now(), done: make(chan struct{})}
	ld.layout.Layers = append([]kvlayout.Layer(nil), layout.Layers...)
	ld.deadline = time.Duration(b.cfg.TransferTimeoutMS) * time.Millisecond
	if deadline > 0 {
		ld.deadline = min(ld.deadline, deadline)
	}
	timed, stop := context.WithTimeout(context.Background(), ld.deadline)
	ctx, cancel := context.WithCancelCause(timed)
	ld.ctx, ld.cancel = ctx, func(cause error) { cancel(cause); stop() }
	parent := root
	for i, e := range found {
		toks := tokens[i*B : (i+1)*B]
		ld.blocks = append(ld.blocks, loadBlock{
			entry:  e,
			expect: pool.Expect{Key: e.Key, Parent: parent, Model: m.fp, Tokens: toks, Generation: e.Loc.Generation},
			runs:   kvlayout.Runs(cells[i*B : (i+1)*B]),
		})
		parent = e.Key
	}
	ld.ok = len(ld.blocks)
	ld.placed.L = &ld.mu
	if m.SnapshotOnly() {
		parent = chain[len(chain)-1]
	}
	if snap != nil {
		ld.snap = &snapshotFetch{entry: *snap, tokens: len(tokens), done: make(chan struct{}),
			expect: pool.Expect{Key: snap.Key, Parent: parent, Model: m.fp, Tokens: tokens[len(tokens)-B:], Generation: snap.Loc.Generation}}
		go ld.fetchSnapshot()
	}
	ld.pinLocal()
	ld.mapSameHost()
	ld.submitStore()
	go ld.run()
	return ld, nil
}

// run is the load's worker: it reaches the peers (opening a segment waits
// on the peer, so it never runs on the host's thread), then places every
// layer in order, then waits for the generation check, then closes done. A
// poller goroutine waits for each layer's transfers and hands the layer
// on, so that the engine is polled for layer i+1 (with the Loopback
// engine, which copies when polled, the copy itself) while layer i is
// verified and placed. All of it is bounded by the load's deadline, which
// every wait for a peer honours.
func (ld *Load) run() {
	ld.submitRemote()
	arrivals := make(chan arrival, ld.m.geo.Layers())
	go ld.poll(arrivals)
	for a := range arrivals {
		// Every layer that has arrived is placed in one pass: a layer at
		// a time, the helpers went idle between layers and woke too late
		// to share the next one (two 1 MiB blocks a layer placed no
		// faster on two processors than on one).
		first, n := a.layer, []int{ld.checkLayer(a)}
	more:
		for {
			select {
			case b, open := <-arrivals:
				if !open {
					break more
				}
				n = append(n, ld.checkLayer(b))
			default:
				break more
			}
		}
		ld.placeLayers(first, n)
		// The host waiting for these layers was readied onto this
		// processor, behind the worker, which would go on to the next
		// layer first: with the poller holding the other processor, the
		// host woke 1-5 ms late. Yielding lets it run now.
		runtime.Gosched()
	}
	if g := ld.gens.batch; g != nil {
		// recheck polls it again and finds it done.
		_, _ = transport.Wait(ld.ctx, g, 0, g.Tasks(), transport.DefaultBackoff)
	}
	if ld.snap != nil {
		<-ld.snap.done
	}
	ld.finished = ld.m.b.now()
	close(ld.done)
}

// Cancel abandons a load the host no longer wants (its request went away,
// its context is closing): the transfers still running stop, no peer is
// blamed for them, and End, which returns at once then, counts only blocks
// already whole and verified: none unless every layer was in.
func (ld *Load) Cancel() {
	ld.cancel(errAbandoned)
}

// Poll waits at most d (0: not at all) for the load to be over: every
// layer verified and placed or failed, its deadline included. It reports
// whether it is; End then returns without waiting on any peer.
func (ld *Load) Poll(d time.Duration) bool {
	select {
	case <-ld.done:
		return true
	default:
	}
	if d <= 0 {
		return false
	}
	t := time.NewTimer(d)
	defer t.Stop()
	ld.help(time.Now().Add(d))
	select {
	case <-ld.done:
		return true
	case <-t.C:
		return false
	}
}

// arrival is what the poller found for one layer's transfers.
type arrival struct {
	layer int
	tasks []transport.TaskStatus // the layer's wave, from waves[layer].first
	err   error
}

// poll waits for each layer's transfers in order. One wait covers the
// layer's requests of every remote block: they are consecutive tasks, and
// polling them together costs one backoff.
func (ld *Load) poll(arrivals chan<- arrival) {
	defer close(arrivals)
	last := ld.m.geo.Layers() - 1
	for l := 0; l <= last; l++ {
		a := arrival{layer: l}
		if ld.waves != nil {
			w := ld.waves[l]
			a.tasks, a.err = transport.Wait(ld.ctx, ld.batch, w.first, w.n, transport.DefaultBackoff)
			if l == last {
				// Every payload read is done: the second reads of the
				// generations go out now, while the worker still places
				// the last layer, not one round trip a block in End.
				ld.submitGenerations()
			}
		}
		arrivals <- a
	}
}

// submitGenerations issues the generation reads of every remote block.
// Blocks that failed meanwhile are read too: the poller does not know,
// and a read costs one small request.
func (ld *Load) submitGenerations() {
	g := &ld.gens
	if err := ld.ctx.Err(); err != nil {
		g.err = status.Wrap(status.Timeout, err, "the generation check")
		return
	}
	var reqs []transport.Request
	for i := range ld.blocks {
		if t := g.task[i]; t >= 0 {
			lb := &ld.blocks[i]
			local := ld.m.b.hold.Bytes(g.at.off+int64(t)*genSlot, genSlot)
			reqs = append(reqs, transport.Request{Op: transport.Read, Local: mem.Addr(local), Segment: lb.seg, Remote: lb.entry.Loc.Addr, Length: genSlot})
		}
	}
	batch, err := ld.m.b.tr.AllocateBatch(len(reqs))
	if err != nil {
		g.err = status.Wrap(status.Transfer, err, "allocating the generation check")
		return
	}
	if err := batch.Submit(reqs); err != nil {
		_ = batch.Free()
		g.err = status.Wrap(status.Transfer, err, "submitting the generation check")
		return
	}
	g.batch = batch
}

// failPlacing is fail for the worker, which shares ok and err with the host.
func (ld *Load) failPlacing(i int, err error) {
	ld.mu.Lock()
	ld.fail(i, err)
	ld.mu.Unlock()
}

// pinLocal points local blocks at their pool memory and pins them so that
// eviction cannot reuse it during the load. A block evicted since the
// lookup shortens the load.
func (ld *Load) pinLocal() {
	b := ld.m.b
	seg := b.tr.LocalSegment()
	for i := range ld.blocks {
		lb := &ld.blocks[i]
		// A store block this pool still holds, the very block (same
		// generation), is read here, as the nearest copy.
		inStore := lb.entry.Loc.Segment != seg
		if inStore && (b.store == nil || !b.store.names(lb.entry.Loc)) {
			continue
		}
		e, ok := b.hold.Pin(lb.entry.Key, lb.entry.Loc.Generation)
		if !ok && inStore {
			continue
		}
		if !ok {
			ld.fail(i, status.Errorf(status.Corrupt, "block %s left the pool since the lookup", lb.entry.Key))
			return
		}
		lb.local = true
		lb.src = b.hold.Bytes(e.Value.Off, e.Value.Size)
	}
}

// submitRemote reads remote blocks, one wave of requests per layer, all
// blocks' layer 0 (with the header) first, so layer i can be verified while
// later layers are still on the wire. Where the engine can abort a batch
// and the host's rows sit back to back, each layer lands in place, in the
// cells it fills: those belong to no sequence until the load ends, the
// layer is verified where it landed before WaitLayer reports it, and an
// abort at the deadline keeps a late transfer from writing into cells the
// host has been given back. Elsewhere a block lands in staging and is
// placed from there. It runs on the worker: what fails here fails its
// blocks, which End reports.
func (ld *Load) submitRemote() {
	b := ld.m.b
	g := &ld.m.geo
	size := int64(g.Size())
	var remote []int
	for i := 0; i < ld.ok; i++ {
		if !ld.blocks[i].local && !ld.blocks[i].stored && !ld.blocks[i].mapped {
			remote = append(remote, i)
		}
	}
	if len(remote) == 0 {
		return
	}
	segs := make([]transport.SegmentID, len(remote))
	for j, i := range remote {
		lb := &ld.blocks[i]
		if lb.entry.Loc.Length != uint64(size) {
			ld.failPlacing(i, status.Errorf(status.Corrupt, "block %s published with %d bytes, model blocks are %d", lb.entry.Key, lb.entry.Loc.Length, size))
			remote = remote[:j]
			break
		}
		seg, err := b.segment(ld.ctx, lb.entry.Loc.Segment)
		if err != nil {
			ld.failPlacing(i, err)
			remote = remote[:j]
			break
		}
		segs[j] = seg
	}
	if len(remote) == 0 {
		return
	}
	layers := g.Layers()
	// Landing in place needs the engine's fence (transport.Aborter), rows
	// that pieces can name, and tensors the engine can write.
	var pieces [][][]kvlayout.Piece
	if transport.CanAbort(b.tr) {
		if p := ld.pieces(remote); p != nil && ld.m.registerTensors(&ld.layout) == nil {
			pieces = p
		}
	}
	ld.landed = pieces != nil
	capacity := len(remote) * layers
	if ld.landed {
		capacity = len(remote) // the headers
		for _, p := range pieces {
			for _, lp := range p {
				capacity += len(lp)
			}
		}
	}
	genOff, err := b.alloc(int64(len(remote)) * genSlot)
	if err != nil {
		ld.failPlacing(remote[0], err)
		return
	}
	ld.gens.at = extent{genOff, int64(len(remote)) * genSlot}
	batch, err := b.tr.AllocateBatch(capacity)
	if err != nil {
		ld.failPlacing(remote[0], status.Wrap(status.Transfer, err, "allocating a transfer batch"))
		return
	}
	ld.batch = batch
	stage := size
	if ld.landed {
		stage = int64(g.HeaderSize())
		ld.scratch = make([][]byte, runtime.GOMAXPROCS(0)+1) // the last is the host's (help)
		for w := range ld.scratch {
			ld.scratch[w] = make([]byte, pool.SumChunk)
		}
	}
	for j, i := range remote {
		off, err := b.alloc(stage)
		if err != nil {
			ld.failPlacing(i, err)
			remote = remote[:j]
			break
		}
		ld.staging = append(ld.staging, extent{off, stage})
		lb := &ld.blocks[i]
		lb.src = b.hold.Bytes(off, stage)
		lb.seg = segs[j]
		lb.tasks = make([]taskSpan, layers)
		if ld.landed {
			lb.pieces = pieces[j]
		}
	}
	if len(remote) == 0 {
		return
	}
	ld.gens.task = make([]int, len(ld.blocks))
	for i := range ld.gens.task {
		ld.gens.task[i] = -1
	}
	for j, i := range remote {
		ld.gens.task[i] = j
	}
	reqs := make([]transport.Request, 0, capacity)
	ld.waves = make([]taskSpan, layers)
	for l := 0; l < layers; l++ {
		ld.waves[l].first = len(reqs)
		for j, i := range remote {
			lb := &ld.blocks[i]
			first := len(reqs)
			read := func(local uintptr, from, n int) {
				reqs = append(reqs, transport.Request{Op: transport.Read, Local: local, Segment: segs[j], Remote: lb.entry.Loc.Addr + uint64(from), Length: uint64(n)})
			}
			switch {
			case !ld.landed:
				from, to := g.LayerOffset(l), g.LayerOffset(l)+g.LayerSize(l)
				if l == 0 {
					from = 0
				}
				read(mem.Addr(lb.src[from:to]), from, to-from)
			default:
				if l == 0 {
					read(mem.Addr(lb.src), 0, g.HeaderSize())
				}
				for _, p := range lb.pieces[l] {
					read(p.Addr, g.LayerOffset(l)+p.Off, p.Len)
				}
			}
			lb.tasks[l] = taskSpan{first, len(reqs) - first}
		}
		ld.waves[l].n = len(reqs) - ld.waves[l].first
	}
	if err := batch.Submit(reqs); err != nil {
		ld.waves = nil // nothing to wait for
		ld.failPlacing(remote[0], status.Wrap(status.Transfer, err, "submitting transfers"))
	}
}

// maxLandedPieces bounds the requests of one block's layer landed in place
// (two per run of cells): cells scattered wider cost more in requests than
// the copy from staging they would save, and engines cap a batch's size.
const maxLandedPieces = 8

// pieces says where each remote block's layers would land in place (per
// block, per layer), or nil where some layer's rows do not sit back to back
// or a block's cells are scattered into too many runs.
func (ld *Load) pieces(remote []int) [][][]kvlayout.Piece {
	out := make([][][]kvlayout.Piece, len(remote))
	for j, i := range remote {
		out[j] = make([][]kvlayout.Piece, ld.m.geo.Layers())
		for l := range out[j] {
			out[j][l] = ld.layout.Pieces(&ld.m.shape, l, ld.blocks[i].runs)
			if out[j][l] == nil || len(out[j][l]) > maxLandedPieces {
				return nil
			}
		}
	}
	return out
}

// fail records that block i failed: it and every later block are dropped,
// as a restore must be a prefix.
func (ld *Load) fail(i int, err error) {
	if i < ld.ok {
		ld.ok = i
		ld.err = err
		ld.m.b.suspect(&ld.blocks[i].entry, err)
	}
}

// WaitLayer returns once layer il (and every layer below it) of every block
// still good is verified and placed, and reports how many leading tokens
// are good so far. Blocks that fail shorten the prefix; the error is
// returned only for misuse.
func (ld *Load) WaitLayer(il int) (int, error) {
	ld.mu.Lock()
	defer ld.mu.Unlock()
	if ld.ended {
		return 0, status.Errorf(status.State, "wait on an ended load")
	}
	if il < 0 || il >= ld.m.geo.Layers() {
		return 0, status.Errorf(status.InvalidArg, "layer %d of %d", il, ld.m.geo.Layers())
	}
	for ld.layers <= il {
		ld.placed.Wait()
	}
	return ld.ok * ld.m.geo.BlockTokens, nil
}

// Progress reports, without waiting, how many leading layers of every block
// still good are verified and placed, and how many leading tokens are good
// so far: a host that moves each layer on (a device upload) as soon as it
// is in place asks between its other work.
func (ld *Load) Progress() (layers, tokensOK int, err error) {
	ld.mu.Lock()
	defer ld.mu.Unlock()
	if ld.ended {
		return 0, 0, status.Errorf(status.State, "progress of an ended load")
	}
	return ld.layers, ld.ok * ld.m.geo.BlockTokens, nil
}

// checkLayer fails the first block whose layer did not arrive (or, at
// layer 0, whose header is not the one expected) and returns how many
// leading blocks are left to place. The worker runs it between passes of
// placeLayers, when no helper of its writes ok, so it reads ok unlocked.
func (ld *Load) checkLayer(a arrival) int {
	g := &ld.m.geo
	l := a.layer
	for i := 0; i < ld.ok; i++ {
		lb := &ld.blocks[i]
		if lb.stored {
			if err := ld.storeArrived(i, l); err != nil {
				ld.failPlacing(i, err)
				break
			}
		} else if !lb.local && !lb.mapped {
			if err := ld.arrived(lb, a); err != nil {
				ld.failPlacing(i, ld.blame(i, l, err))
				break
			}
		}
		if l == 0 {
			h, err := pool.VerifyHeader(lb.src[:g.HeaderSize()], g, &lb.expect)
			if err != nil {
				ld.failPlacing(i, err)
				break
			}
			lb.header = h
		}
	}
	return ld.ok
}

// blame is the failure of remote block i, whose transfer failed with err
// after delivered layers had arrived: a peer that timed out is marked down,
// unless the host abandoned the load, which is then the failure, or the
// load was a first contact that was delivering layers when its deadline
// passed. Such a deadline came from the link's configured prior, not a
// measurement: a link slower than the prior says (or a first handshake
// longer than the margin) is not a hung peer, and marking it down would
// plan around it for peer_down_ms after one slow first read. The load's
// observation calibrates the link, so its next miss is judged as any other.
func (ld *Load) blame(i, delivered int, err error) error {
	if abandoned(ld.ctx) {
		return errAbandoned
	}
	b, e := ld.m.b, ld.blocks[i].entry
	if status.Of(err) == status.Timeout && delivered > 0 && !b.arb.Calibrated(b.linkFor(e)) {
		return err
	}
	b.peerFailed(e.Loc.Segment, err)
	return err
}

// arrived reports whether every task of a remote block's layer completed.
func (ld *Load) arrived(lb *loadBlock, a arrival) error {
	w := lb.tasks[a.layer]
	for _, st := range a.tasks[w.first-ld.waves[a.layer].first:][:w.n] {
		if st.State == transport.Completed {
			continue
		}
		if a.err != nil {
			return status.Wrap(status.Of(a.err), a.err, fmt.Sprintf("block %s layer %d", lb.entry.Key, a.layer))
		}
		code := status.Transfer
		if st.State == transport.TimedOut {
			code = status.Timeout
		}
		return status.Errorf(code, "block %s layer %d: transfer %s", lb.entry.Key, a.layer, st.State)
	}
	return nil
}

// placeLayers places layers first, first+1, ... of blocks [0, n[j]) for
// layer first+j, and verifies each: a staged block with PlaceSum (one
// pass, each chunk summed right after it is copied), one landed in place
// by summing it where it landed. It runs on as many goroutines as the
// process has CPUs, which take the (layer, block) pieces in layer order:
// the blocks' cells are disjoint, and a copy with streaming stores is bound
// by one core well below the memory's bandwidth. Each layer is published
// to the host as soon as it and every layer below it are in (publish), so
// the host computes layer l while later ones are placed.
func (ld *Load) placeLayers(first int, n []int) {
	ps := &placing{first: first, n: n, left: make([]atomic.Int32, len(n)), done: make(chan struct{})}
	for j, k := range n {
		ps.width = max(ps.width, k)
		ps.left[j].Store(int32(k))
	}
	ps.bad = make([]bool, len(n)*ps.width)
	if ps.width == 0 {
		ld.publish(ps)
		return
	}
	ps.unplaced.Store(int64(len(ps.bad)))
	workers := min(runtime.GOMAXPROCS(0), len(ps.bad))
	if ld.landed {
		workers = min(workers, len(ld.scratch)-1) // GOMAXPROCS may have grown since
	}
	ld.pass.Store(ps)
	for w := 1; w < workers; w++ {
		go ld.place(ps, ld.workerScratch(w), time.Time{})
	}
	ld.place(ps, ld.workerScratch(0), time.Time{})
	// A piece another goroutine (or the host, help) took may still be in
	// flight: the next pass publishes after this one's layers.
	<-ps.done
	ld.pass.Store(nil)
}

// place takes pieces of pass ps and places them until none is left to
// take or, with a non-zero until, until then. The goroutine that places
// the pass's last piece closes its done.
func (ld *Load) place(ps *placing, scratch []byte, until time.Time) {
	g := &ld.m.geo
	for until.IsZero() || time.Now().Before(until) {
		p := int(ps.next.Add(1) - 1)
		if p >= len(ps.bad) {
			return
		}
		if j, i := p/ps.width, p%ps.width; i < ps.n[j] {
			l := ps.first + j
			lb := &ld.blocks[i]
			var sum uint64
			if lb.pieces != nil {
				sum = kvlayout.SumPieces(lb.pieces[l], g.LayerSize(l), scratch)
			} else {
				off := g.LayerOffset(l)
				sum = ld.layout.PlaceSum(&ld.m.shape, l, lb.src[off:off+g.LayerSize(l)], lb.runs)
			}
			ps.bad[p] = sum != lb.header.LayerSums[l]
			if ps.left[j].Add(-1) == 0 {
				ld.publish(ps)
			}
		}
		if ps.unplaced.Add(-1) == 0 {
			close(ps.done)
		}
	}
}

// workerScratch is placing goroutine w's buffer for summing pieces that
// landed in place (nil when none did); the host's, help's, is the last.
func (ld *Load) workerScratch(w int) []byte {
	if !ld.landed {
		return nil
	}
	return ld.scratch[w]
}

// help is the host's share of placement while it would wait for the whole
// load (Poll, End; not WaitLayer, whose host wants one layer back as soon
// as it is in): it takes pieces of the pass in progress, if any, until
// none is left or until (when non-zero). The host's processor is otherwise
// idle then, and the worker's helpers may not get one at once: a host
// thread that called into the library leaves the Go scheduler short of the
// processor it held until the runtime takes that back, which on two cores
// started the second helper up to 2.5 ms late in a 3 ms restore (the
// patched server, 48 MiB from its own pool).
func (ld *Load) help(until time.Time) {
	if ps := ld.pass.Load(); ps != nil {
		ld.place(ps, ld.workerScratch(len(ld.scratch)-1), until)
	}
}

// placing is one pass of placeLayers: layers first+j, j < len(n), each of
// blocks [0, n[j]), as pieces p = j*width + i, taken in order (next). A
// piece's bad is written by the goroutine that placed it before it counts
// the piece off left[j], so whoever finds left[j] at 0 reads the layer's
// bad flags whole; unplaced counts every piece off, those past a layer's
// blocks too, and done closes when it reaches 0.
type placing struct {
	first    int
	n        []int
	width    int
	bad      []bool
	left     []atomic.Int32
	next     atomic.Int64
	unplaced atomic.Int64
	done     chan struct{}
}

// publish moves layers past every layer of the pass that is whole, in
// order, failing in each the first block whose sum did not match (its
// cells and those of every later block hold unverified bytes, which the
// host drops, as they are past the good prefix), and wakes the host.
func (ld *Load) publish(ps *placing) {
	ld.mu.Lock()
	defer ld.mu.Unlock()
	moved := false
	for j := ld.layers - ps.first; j < len(ps.n) && ps.left[j].Load() == 0; j++ {
		for i := range ps.n[j] {
			if ps.bad[j*ps.width+i] {
				ld.fail(i, status.Errorf(status.Corrupt, "block %s layer %d: checksum mismatch", ld.blocks[i].entry.Key, ps.first+j))
				break
			}
		}
		ld.layers = ps.first + j + 1
		moved = true
	}
	if moved {
		ld.placed.Broadcast()
	}
}

// End finishes the load: it verifies what is left, checks that no block
// changed while it was read (the seqlock's second read), releases pins and
// staging, and reports the good prefix. Its error is the first failure.
func (ld *Load) End() (LoadResult, error) {
	ld.help(time.Time{})
	<-ld.done
	ld.mu.Lock()
	defer ld.mu.Unlock()
	if ld.ended {
		return LoadResult{}, status.Errorf(status.State, "load ended twice")
	}
	ld.recheck()
	ld.settleSnapshot()
	mapped := 0
	for i := 0; i < ld.ok; i++ {
		if ld.blocks[i].mapped {
			mapped++
		}
	}
	ld.release()
	ld.ended = true
	b := ld.m.b
	res := LoadResult{
		Blocks:   len(ld.blocks),
		OKBlocks: ld.ok,
		OKTokens: ld.ok * ld.m.geo.BlockTokens,
		Bytes:    int64(ld.ok) * int64(ld.m.geo.PayloadSize()),
		Err:      ld.err,
	}
	if ld.m.SnapshotOnly() && ld.err == nil {
		res.OKTokens = ld.snap.tokens
	}
	ld.observe()
	ld.touchLocal()
	b.noteRestored(ld.blocks[:ld.ok])
	b.stats.load(res)
	b.stats.add(&b.stats.sharedPoolBlocks, int64(mapped))
	b.end()
	if ld.err != nil && (len(ld.blocks) > 0 || ld.m.SnapshotOnly()) {
		return res, ld.err
	}
	return res, nil
}

// observe calibrates the link a load came over: a peer's, or this pool's
// own ("local"), whose cost is verification and placement. A complete load
// took its time until the worker was done, however late the host ended it.
// A load whose transfers missed the deadline took at least the deadline: a
// lower bound, fed as a measurement, so that a peer slower than believed
// gets longer deadlines (up to what recomputing costs) or none, instead of
// missing them forever.
func (ld *Load) observe() {
	b := ld.m.b
	took := ld.finished.Sub(ld.start)
	var snap int64
	if ld.snap != nil {
		snap = int64(ld.snap.entry.Loc.Length)
	}
	switch {
	case ld.m.SnapshotOnly() && ld.err == nil:
		b.arb.ObserveTransfer(b.linkFor(ld.snap.entry), snap, took)
	case ld.m.SnapshotOnly():
		if status.Of(ld.err) == status.Timeout {
			b.arb.ObserveTransfer(b.linkFor(ld.snap.entry), snap, max(took, ld.deadline))
		}
	case ld.ok == len(ld.blocks) && ld.ok > 0:
		b.arb.ObserveTransfer(b.linkFor(ld.blocks[0].entry), int64(ld.ok)*int64(ld.m.geo.PayloadSize())+snap, took)
	case status.Of(ld.err) == status.Timeout:
		missed := len(ld.blocks) - ld.ok
		b.arb.ObserveTransfer(b.linkFor(ld.blocks[ld.ok].entry), int64(missed)*int64(ld.m.geo.PayloadSize())+snap, max(took, ld.deadline))
	}
}

// touchLocal counts the restored blocks of this pool as used, so that
// eviction keeps what is restored often.
func (ld *Load) touchLocal() {
	b := ld.m.b
	var keys []key.BlockKey
	for i := 0; i < ld.ok; i++ {
		if loc := ld.blocks[i].entry.Loc; loc.Segment == b.tr.LocalSegment() || (b.store != nil && b.store.names(loc)) {
			keys = append(keys, ld.blocks[i].entry.Key)
		}
	}
	if len(keys) > 0 {
		b.hold.Touch(keys...)
	}
}

// recheck reads each good block's generation again after its payload: a
// writer that reused the location meanwhile changed it. Remote blocks'
// second reads were issued by the poller (submitGenerations).
func (ld *Load) recheck() {
	b := ld.m.b
	g := &ld.gens
	var remote []transport.TaskStatus
	if g.batch != nil {
		remote, _ = transport.Wait(ld.ctx, g.batch, 0, g.batch.Tasks(), transport.DefaultBackoff)
	}
	for i := 0; i < ld.ok; i++ {
		lb := &ld.blocks[i]
		var gen uint64
		if lb.local || lb.stored || lb.mapped {
			gen = pool.Generation(lb.src)
		} else {
			t := g.task[i]
			if g.batch == nil {
				ld.fail(i, ld.blame(i, ld.layers, g.err))
				return
			}
			if st := remote[t].State; st != transport.Completed {
				code := status.Transfer
				if st == transport.TimedOut {
					code = status.Timeout
				}
				ld.fail(i, ld.blame(i, ld.layers, status.Errorf(code, "block %s generation check: %s", lb.entry.Key, st)))
				return
			}
			gen = pool.Generation(b.hold.Bytes(g.at.off+int64(t)*genSlot, genSlot))
		}
		if gen != lb.expect.Generation {
			ld.fail(i, status.Errorf(status.Corrupt, "block %s changed while read (generation %d, read at %d)", lb.entry.Key, gen, lb.expect.Generation))
			b.stats.add(&b.stats.tornReads, 1)
			return
		}
	}
}

// release unpins local blocks and frees staging and the batch; a batch
// still in flight is parked with its staging until it is idle.
func (ld *Load) release() {
	b := ld.m.b
	ld.cancel(context.Canceled)
	ld.releaseStore()
	ld.releaseSnapshot()
	for i := range ld.blocks {
		if ld.blocks[i].local {
			b.hold.Unpin(ld.blocks[i].entry.Key)
			ld.blocks[i].local = false
		}
	}
	for i := range ld.blocks {
		if lb := &ld.blocks[i]; lb.mapped {
			lb.unmap()
			lb.mapped, lb.unmap = false, nil
		}
	}
	ld.releaseGenerations()
	if ld.batch == nil {
		ld.freeStaging(ld.staging)
		return
	}
	if err := ld.batch.Free(); err != nil {
		if ld.landed {
			ld.abort()
		}
		ld.m.b.parkBatch(ld.batch, ld.staging)
	} else {
		ld.freeStaging(ld.staging)
	}
	ld.batch, ld.staging = nil, nil
}

// releaseGenerations frees the generation check's batch and extent, or
// parks them while a read is still in flight.
func (ld *Load) releaseGenerations() {
	g := &ld.gens
	at := []extent{g.at}
	if g.at.n == 0 {
		at = nil
	}
	if g.batch != nil && g.batch.Free() != nil {
		ld.m.b.parkBatch(g.batch, at)
	} else {
		ld.freeStaging(at)
	}
	*g = genCheck{}
}

// abort stops the transfers still running into the host's tensors before
// the host gets its cells back. Abort fails only on an engine already
// closed, whose workers are gone, or a batch already freed: neither writes.
func (ld *Load) abort() {
	_ = ld.batch.(transport.Aborter).Abort()
}

func (ld *Load) freeStaging(ex []extent) {
	for _, e := range ex {
		_ = ld.m.b.hold.Free(e.off, e.n)
	}
}

// parkBatch keeps a batch that is still moving bytes, with the pool
// extents it moves them into, until Close or a reap finds it idle.
func (b *Bridge) parkBatch(batch transport.Batch, staging []extent) {
	b.mu.Lock()
	b.parked = append(b.parked, parked{batch: batch, staging: staging})
	b.mu.Unlock()
	b.stats.add(&b.stats.parkedBatches, 1)
}
