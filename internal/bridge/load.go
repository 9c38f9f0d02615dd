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
// by layer. Goroutines of its own wait for each layer's transfers (the
// poller) and verify and place it (the worker, see run), so the host's
// thread only waits for layers it needs while later layers arrive. One
// goroutine drives a Load at a time.
type Load struct {
	m      *Model
	layout kvlayout.Layout
	blocks []loadBlock
	start  time.Time
	ctx    context.Context
	cancel context.CancelFunc

	batch   transport.Batch
	store   *storeFetch // blocks read from the store (storefetch.go)
	remote  int         // blocks read through the transport
	staging []extent    // pool memory the transport writes into

	// The worker owns blocks and writes ok and err under mu until placed
	// reaches the layer count; the host reads them under mu.
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
	src    []byte // the block as verified: pool memory or staging
	local  bool
	stored bool // read from the store into staging
	task   int  // first transport task (layer 0) of a remote block
	header pool.Header
}

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
	return m.loadBegin(root, key.Chain(root, tokens, B), tokens, layout, cells)
}

// Load starts restoring what a plan of this model decided, as
// LoadBegin, without hashing the prompt again.
func (p *Plan) Load(layout kvlayout.Layout, cells []uint32) (*Load, error) {
	if p.RestoreTokens == 0 {
		return nil, status.Errorf(status.NotFound, "the plan restores nothing (%s)", p.Decision.Reason)
	}
	return p.m.loadBegin(p.root, p.chain, p.tokens, layout, cells)
}

func (m *Model) loadBegin(root key.Hash, chain []key.BlockKey, tokens []int32, layout kvlayout.Layout, cells []uint32) (*Load, error) {
	b := m.b
	B := m.geo.BlockTokens
	if len(cells) != len(tokens) {
		return nil, status.Errorf(status.InvalidArg, "load of %d tokens into %d cells", len(tokens), len(cells))
	}
	if err := layout.Validate(&m.shape); err != nil {
		return nil, err
	}
	if err := layout.CheckCells(cells); err != nil {
		return nil, err
	}
	found := m.match(root, chain)
	if len(found) == 0 {
		return nil, status.Errorf(status.NotFound, "no block of these tokens is published")
	}
	if err := b.begin(); err != nil {
		return nil, err
	}
	ld := &Load{m: m, layout: layout, start: b.now()}
	ld.layout.Layers = append([]kvlayout.Layer(nil), layout.Layers...)
	ld.ctx, ld.cancel = context.WithTimeout(context.Background(), time.Duration(b.cfg.TransferTimeoutMS)*time.Millisecond)
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
	ld.pinLocal()
	ld.submitStore()
	if err := ld.submitRemote(); err != nil {
		ld.release()
		b.end()
		return nil, err
	}
	go ld.run()
	return ld, nil
}

// run is the load's worker: every layer in order, then done. A poller
// goroutine waits for each layer's transfers and hands the layer on, so
// that the engine is polled for layer i+1 (with the Loopback engine,
// which copies when polled, the copy itself) while layer i is verified and
// placed. Both are bounded by the load's deadline, which every wait for a
// transfer honours.
func (ld *Load) run() {
	arrivals := make(chan arrival, ld.m.geo.Layers())
	go ld.poll(arrivals)
	for a := range arrivals {
		ld.layer(a)
		ld.mu.Lock()
		ld.layers = a.layer + 1
		ld.placed.Broadcast()
		ld.mu.Unlock()
	}
}

// arrival is what the poller found for one layer's transfers.
type arrival struct {
	layer int
	tasks []transport.TaskStatus // one per remote block, by lb.task
	err   error
}

// poll waits for each layer's transfers in order. One wait covers the
// layer's requests of every remote block: they are consecutive tasks, and
// polling them together costs one backoff.
func (ld *Load) poll(arrivals chan<- arrival) {
	defer close(arrivals)
	for l := 0; l < ld.m.geo.Layers(); l++ {
		a := arrival{layer: l}
		if ld.remote > 0 {
			a.tasks, a.err = transport.Wait(ld.ctx, ld.batch, l*ld.remote, ld.remote, transport.DefaultBackoff)
		}
		arrivals <- a
	}
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
	b.mu.Lock()
	defer b.mu.Unlock()
	for i := range ld.blocks {
		lb := &ld.blocks[i]
		if lb.entry.Loc.Segment != seg && !b.ownCopyLocked(lb.entry) {
			continue
		}
		s, ok := b.resident.Get(lb.entry.Key)
		if !ok || s.gen != lb.entry.Loc.Generation || b.resident.Pin(lb.entry.Key) != nil {
			ld.fail(i, status.Errorf(status.Corrupt, "block %s left the pool since the lookup", lb.entry.Key))
			return
		}
		lb.local = true
		lb.src = b.pool.Bytes(s.off, s.size)
	}
}

// submitRemote reads remote blocks into staging, one request per block and
// layer, all blocks' layer 0 (with the header) first, so layer i can be
// verified while later layers are still on the wire.
func (ld *Load) submitRemote() error {
	b := ld.m.b
	g := &ld.m.geo
	size := int64(g.Size())
	var remote []int
	for i := 0; i < ld.ok; i++ {
		if !ld.blocks[i].local && !ld.blocks[i].stored {
			remote = append(remote, i)
		}
	}
	if len(remote) == 0 {
		return nil
	}
	segs := make([]transport.SegmentID, len(remote))
	for j, i := range remote {
		lb := &ld.blocks[i]
		if lb.entry.Loc.Length != uint64(size) {
			ld.fail(i, status.Errorf(status.Corrupt, "block %s published with %d bytes, model blocks are %d", lb.entry.Key, lb.entry.Loc.Length, size))
			remote = remote[:j]
			break
		}
		seg, err := b.segment(ld.ctx, lb.entry.Loc.Segment)
		if err != nil {
			ld.fail(i, err)
			remote = remote[:j]
			break
		}
		segs[j] = seg
	}
	if len(remote) == 0 {
		return nil
	}
	layers := g.Layers()
	batch, err := b.tr.AllocateBatch(len(remote) * layers)
	if err != nil {
		return status.Wrap(status.Transfer, err, "allocating a transfer batch")
	}
	ld.batch = batch
	for j, i := range remote {
		off, err := b.pool.Alloc(size)
		if err != nil {
			ld.fail(i, err)
			remote = remote[:j]
			break
		}
		ld.staging = append(ld.staging, extent{off, size})
		lb := &ld.blocks[i]
		lb.src = b.pool.Bytes(off, size)
		lb.task = j
	}
	ld.remote = len(remote)
	reqs := make([]transport.Request, 0, len(remote)*layers)
	for l := 0; l < layers; l++ {
		from, to := g.LayerOffset(l), g.LayerOffset(l)+g.LayerSize(l)
		if l == 0 {
			from = 0
		}
		for j, i := range remote {
			lb := &ld.blocks[i]
			reqs = append(reqs, transport.Request{
				Op:      transport.Read,
				Local:   b.pool.Base() + uintptr(ld.staging[j].off) + uintptr(from),
				Segment: segs[j],
				Remote:  lb.entry.Loc.Addr + uint64(from),
				Length:  uint64(to - from),
			})
		}
	}
	if len(reqs) > 0 {
		if err := batch.Submit(reqs); err != nil {
			return status.Wrap(status.Transfer, err, "submitting transfers")
		}
	}
	return nil
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

// layer verifies and places one layer of every block still good; the
// worker runs it, reading ok without the lock as only it writes ok.
func (ld *Load) layer(a arrival) {
	ld.placeLayer(a.layer, ld.checkLayer(a))
}

// checkLayer fails the first block whose layer did not arrive (or, at
// layer 0, whose header is not the one expected) and returns how many
// leading blocks are left to place.
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
		} else if !lb.local {
			if st := a.tasks[lb.task]; st.State != transport.Completed {
				code := status.Transfer
				if st.State == transport.TimedOut {
					code = status.Timeout
				}
				err := status.Errorf(code, "block %s layer %d: transfer %s", lb.entry.Key, l, st.State)
				if a.err != nil {
					err = status.Wrap(status.Of(a.err), a.err, fmt.Sprintf("block %s layer %d", lb.entry.Key, l))
				}
				ld.failPlacing(i, err)
				ld.m.b.peerFailed(lb.entry.Loc.Segment, err)
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

// placeLayer places layer l of blocks [0, n), verifying each as it lands
// (PlaceSum: one pass, each chunk summed right after it is copied), on as
// many goroutines as the process has CPUs: the blocks' cells are
// disjoint, and a copy with streaming stores is bound by one core well
// below the memory's bandwidth. The first block whose sum does not match
// fails; its cells and those of every later block hold unverified bytes,
// which the host drops, as they are past the good prefix.
func (ld *Load) placeLayer(l, n int) {
	g := &ld.m.geo
	off, size := g.LayerOffset(l), g.LayerSize(l)
	bad := make([]bool, n)
	var next atomic.Int64
	place := func() {
		for {
			i := int(next.Add(1) - 1)
			if i >= n {
				return
			}
			lb := &ld.blocks[i]
			bad[i] = ld.layout.PlaceSum(&ld.m.shape, l, lb.src[off:off+size], lb.runs) != lb.header.LayerSums[l]
		}
	}
	var wg sync.WaitGroup
	for range min(runtime.GOMAXPROCS(0), n) - 1 {
		wg.Go(place)
	}
	place()
	wg.Wait()
	for i, b := range bad {
		if b {
			ld.failPlacing(i, status.Errorf(status.Corrupt, "block %s layer %d: checksum mismatch", ld.blocks[i].entry.Key, l))
			return
		}
	}
}

// End finishes the load: it verifies what is left, checks that no block
// changed while it was read (the seqlock's second read), releases pins and
// staging, and reports the good prefix. Its error is the first failure.
func (ld *Load) End() (LoadResult, error) {
	ld.mu.Lock()
	defer ld.mu.Unlock()
	if ld.ended {
		return LoadResult{}, status.Errorf(status.State, "load ended twice")
	}
	for ld.layers < ld.m.geo.Layers() {
		ld.placed.Wait()
	}
	ld.recheck()
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
	// A complete load calibrates the link it came over: a peer's, or this
	// pool's own ("local"), whose cost is verification and placement.
	if ld.ok == len(ld.blocks) && res.Bytes > 0 {
		b.arb.ObserveTransfer(b.linkFor(ld.blocks[0].entry), res.Bytes, b.now().Sub(ld.start))
	}
	ld.touchLocal()
	b.noteRestored(ld.blocks[:ld.ok])
	b.stats.load(res)
	b.end()
	if ld.err != nil && len(ld.blocks) > 0 {
		return res, ld.err
	}
	return res, nil
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
		b.mu.Lock()
		b.resident.Touch(keys...)
		b.mu.Unlock()
	}
}

// recheck reads each good block's generation again after its payload: a
// writer that reused the location meanwhile changed it.
func (ld *Load) recheck() {
	b := ld.m.b
	for i := 0; i < ld.ok; i++ {
		lb := &ld.blocks[i]
		var gen uint64
		if lb.local || lb.stored {
			gen = pool.Generation(lb.src)
		} else {
			g, err := ld.remoteGeneration(lb)
			if err != nil {
				ld.fail(i, err)
				return
			}
			gen = g
		}
		if gen != lb.expect.Generation {
			ld.fail(i, status.Errorf(status.Corrupt, "block %s changed while read (generation %d, read at %d)", lb.entry.Key, gen, lb.expect.Generation))
			b.stats.add(&b.stats.tornReads, 1)
			return
		}
	}
}

// remoteGeneration reads a remote block's first 64 bytes again into its
// staging, which holds the verified header copy no longer needed.
func (ld *Load) remoteGeneration(lb *loadBlock) (uint64, error) {
	b := ld.m.b
	seg, err := b.segment(ld.ctx, lb.entry.Loc.Segment)
	if err != nil {
		return 0, err
	}
	batch, err := b.tr.AllocateBatch(1)
	if err != nil {
		return 0, status.Wrap(status.Transfer, err, "allocating a transfer batch")
	}
	req := transport.Request{Op: transport.Read, Local: mem.Addr(lb.src), Segment: seg, Remote: lb.entry.Loc.Addr, Length: 64}
	if err := batch.Submit([]transport.Request{req}); err != nil {
		_ = batch.Free()
		return 0, status.Wrap(status.Transfer, err, "submitting the generation check")
	}
	st, err := transport.Wait(ld.ctx, batch, 0, 1, transport.DefaultBackoff)
	if err != nil {
		ld.m.b.parkBatch(batch, nil)
		b.peerFailed(lb.entry.Loc.Segment, err)
		return 0, err
	}
	_ = batch.Free()
	if st[0].State != transport.Completed {
		return 0, status.Errorf(status.Transfer, "block %s generation check: %s", lb.entry.Key, st[0].State)
	}
	return pool.Generation(lb.src), nil
}

// release unpins local blocks and frees staging and the batch; a batch
// still in flight is parked with its staging until it is idle.
func (ld *Load) release() {
	b := ld.m.b
	ld.cancel()
	ld.releaseStore()
	b.mu.Lock()
	for i := range ld.blocks {
		if ld.blocks[i].local {
			_ = b.resident.Unpin(ld.blocks[i].entry.Key)
			ld.blocks[i].local = false
		}
	}
	b.mu.Unlock()
	if ld.batch == nil {
		ld.freeStaging(ld.staging)
		return
	}
	if err := ld.batch.Free(); err != nil {
		ld.m.b.parkBatch(ld.batch, ld.staging)
	} else {
		ld.freeStaging(ld.staging)
	}
	ld.batch, ld.staging = nil, nil
}

func (ld *Load) freeStaging(ex []extent) {
	for _, e := range ex {
		_ = ld.m.b.pool.Free(e.off, e.n)
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
