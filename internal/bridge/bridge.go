// Package bridge is a process's cache endpoint: it registers models,
// answers lookups from the local mirror of the directory, restores blocks
// layer by layer into a host's KV tensors, and saves a host's new blocks
// into the pool and publishes them.
//
// Lookup is side-effect free and never waits on the network. A load moves
// every block through verification before any of its rows reach the host:
// local blocks are checked in place while pinned, remote blocks land in
// staging memory first. Rows of a block that fails hold either their
// previous bytes or verified bytes of that block, never unverified ones.
package bridge

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mcbridge/mcbridge/internal/arbiter"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/holdings"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvevents"
	"github.com/mcbridge/mcbridge/internal/logs"
	"github.com/mcbridge/mcbridge/internal/reach"
	"github.com/mcbridge/mcbridge/internal/residency"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/storenode"
	"github.com/mcbridge/mcbridge/internal/transport"
)

// Deps lets a caller supply parts instead of building them from the config:
// tests inject faulty transports and shared directories this way. Parts
// given here stay owned by the caller.
type Deps struct {
	Transport transport.Transport
	Directory directory.Directory
	Now       func() time.Time
	// Log hears what no caller can: failed publishes and unpublishes.
	// Nil is the process's rate-limited stderr log.
	Log *slog.Logger
	// Events hears which blocks this process answers for; nil builds a
	// KV events publisher when the configuration has kv_events.
	Events EventSink
}

// Bridge is one process's cache endpoint. Safe for concurrent use.
type Bridge struct {
	cfg     config.Config
	owner   string
	tr      transport.Transport
	dir     directory.Directory
	hold    *holdings.Holdings // the pool and the blocks in it
	arb     *arbiter.Arbiter
	now     func() time.Time
	log     *slog.Logger
	stats   counters
	closers []func() error // what Open built, in build order
	pub     *publisher
	// prefault keeps the pool's pages ahead of its allocations resident
	// (prefault.go).
	prefault *prefaulter
	store    *storeBackend // nil without a store (store.go)
	closeCh  chan struct{} // closed when Close starts
	// events hears what this process answers for (events.go); publisher
	// is it when the bridge built it from the configuration.
	events    EventSink
	publisher *kvevents.Publisher

	mu       sync.Mutex
	segments map[string]transport.SegmentID
	down     map[string]time.Time  // peers planned around until then (peers.go)
	retired  []transport.SegmentID // segments forgotten after a failure, closed at Close
	models   map[key.Fingerprint]*Model
	parked   []parked // batches still in flight after a timeout
	active   int      // loads and saves begun and not ended
	closed   bool
	poolBusy bool // a transfer outlived Close: keep the pool mapped

	shared *sameHost                      // shared pools of this host (samehost.go); nil when the pool is not shared
	rep    *reporter                      // reports to blocks' holders; nil without a Notifier
	inbox  *storenode.Inbox               // reports from readers (storenode's reports.go)
	node   atomic.Pointer[storenode.Node] // a store node's roles (storenode.go); nil without them

	reach *reach.Watch // says in the log when the swarm is out of reach (reach.go)
}

// parked holds a timed-out batch and the staging it may still write into;
// both are released once the batch is idle.
type parked struct {
	batch   transport.Batch
	staging []extent
}

type extent struct{ off, n int64 }

// Open builds a bridge from cfg, with the parts deps supplies.
func Open(cfg config.Config, deps Deps) (*Bridge, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	b := &Bridge{cfg: cfg, owner: cfg.Owner, now: deps.Now, log: deps.Log, pub: newPublisher(), closeCh: make(chan struct{}),
		segments: map[string]transport.SegmentID{}, down: map[string]time.Time{}, models: map[key.Fingerprint]*Model{}}
	if b.now == nil {
		b.now = time.Now
	}
	if b.log == nil {
		b.log = logs.Default()
	}
	if b.owner == "" {
		host, _ := os.Hostname()
		b.owner = fmt.Sprintf("%s-%d-%x", host, os.Getpid(), uint32(time.Now().UnixNano()))
	}
	if err := b.build(deps); err != nil {
		b.release()
		return nil, err
	}
	return b, nil
}

func (b *Bridge) build(deps Deps) error {
	var err error
	policy, _ := residency.PolicyNamed(b.cfg.Eviction) // the config validated it
	if b.hold, err = holdings.New(holdings.Config{PoolBytes: b.cfg.PoolBytes, Shared: b.cfg.SharedPool.Enabled, Policy: policy, Gone: b.gone, Log: b.log}); err != nil {
		return err
	}
	b.closers = append(b.closers, b.closePool, b.closeShared)
	b.startPrefault()
	b.closers = append(b.closers, b.prefault.close)
	if err = b.openShared(); err != nil {
		return err
	}
	ap, err := arbiter.ParsePolicy(b.cfg.Arbiter.Policy)
	if err != nil {
		return status.Wrap(status.Config, err, "arbiter policy")
	}
	if b.arb, err = arbiter.New(arbiter.Config{Policy: ap, Now: b.now, DeadlineFactor: b.cfg.Arbiter.DeadlineFactor,
		DeadlineMargin: time.Duration(b.cfg.Arbiter.DeadlineMarginMS) * time.Millisecond}); err != nil {
		return err
	}
	if b.tr = deps.Transport; b.tr == nil {
		if b.tr, err = openTransport(b.cfg, b.owner, b.now); err != nil {
			return err
		}
		b.closers = append(b.closers, b.tr.Close)
	}
	if err = b.tr.RegisterMemory(b.hold.Base(), uint64(b.hold.Size()), "cpu:0", true); err != nil {
		return status.Wrap(status.Transfer, err, "registering the pool")
	}
	base := b.hold.Base()
	b.closers = append(b.closers, func() error { return b.tr.UnregisterMemory(base) })
	if b.dir = deps.Directory; b.dir == nil {
		if b.dir, err = openDirectory(b.cfg); err != nil {
			return err
		}
		b.closers = append(b.closers, b.dir.Close)
	}
	// The sink outlives the publisher, which may still settle blocks.
	if err = b.openEvents(deps); err != nil {
		return err
	}
	if b.cfg.Store.Kind == "mooncake" {
		if b.store, err = openStore(b); err != nil {
			return err
		}
		b.closers = append(b.closers, b.store.shutdown)
	}
	go b.publishLoop()
	b.closers = append(b.closers, b.stopPublisher)
	b.startReports()
	b.closers = append(b.closers, func() error { b.stopReports(); return nil })
	b.startReach()
	return nil
}

// stopPublisher lets the publisher finish what it holds, within about two
// directory deadlines, then ends it.
func (b *Bridge) stopPublisher() error {
	p := b.pub
	p.mu.Lock()
	p.closing = true
	p.mu.Unlock()
	p.kick()
	select {
	case <-p.done:
		return nil
	case <-time.After(2*time.Duration(b.cfg.Directory.OpTimeoutMS)*time.Millisecond + time.Second):
		return status.Errorf(status.Timeout, "the directory did not take the queued blocks in time; their entries expire with this process's lease")
	}
}

// release undoes build in reverse order.
func (b *Bridge) release() error {
	var first error
	for i := len(b.closers) - 1; i >= 0; i-- {
		if err := b.closers[i](); err != nil && first == nil {
			first = err
		}
	}
	b.closers = nil
	return first
}

// Owner names this bridge in the directory.
func (b *Bridge) Owner() string { return b.owner }

// Segment is the transport segment peers read this bridge's pool through.
func (b *Bridge) Segment() string { return b.tr.LocalSegment() }

// Transport is the engine the bridge moves blocks with; tests and tools
// reach engine-specific controls through it.
func (b *Bridge) Transport() transport.Transport { return b.tr }

// Arbiter exposes the cost model, for hosts that report prefill timings.
func (b *Bridge) Arbiter() *arbiter.Arbiter { return b.arb }

// Close unpublishes every block this bridge stores, waits for parked
// transfers, and releases the pool, transport and directory it built.
// Loads and saves still open are refused: the host must end them first.
func (b *Bridge) Close() error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return status.Errorf(status.State, "bridge closed twice")
	}
	if b.active > 0 {
		n := b.active
		b.mu.Unlock()
		return status.Errorf(status.State, "bridge close with %d loads or saves not ended", n)
	}
	b.closed = true
	close(b.closeCh)
	models := make([]*Model, 0, len(b.models))
	for _, m := range b.models {
		models = append(models, m)
	}
	parkedBatches := b.parked
	b.parked = nil
	b.mu.Unlock()

	var first error
	keep := func(err error) {
		if err != nil && first == nil {
			first = err
		}
	}
	// What publishes or moves blocks in the background stops first; a
	// store node's disk tier then writes what the pool holds.
	b.stopReports()
	if n := b.storeNode(); n != nil {
		n.Stop()
	}
	byModel := map[key.Fingerprint][]key.BlockKey{}
	b.hold.View(func(r holdings.Reader) {
		r.Walk(func(e holdings.Entry) bool {
			if e.Value.State.Ours() {
				byModel[e.Value.Model] = append(byModel[e.Value.Model], e.Key)
			}
			return true
		})
	})
	// What the publisher holds goes out first, so the unpublishing below
	// finds every entry it must remove.
	flushCtx, cancelFlush := b.opContext()
	keep(b.Flush(flushCtx))
	cancelFlush()
	// The store's client goes before the directory hears of this close, so
	// that the keepers of other processes, asking the store about the
	// blocks this process unpublishes, see the replicas its segment took
	// along.
	if b.store != nil {
		keep(b.store.shutdown())
	}
	for fp, keys := range byModel {
		ctx, cancel := b.opContext()
		keep(b.dir.Unpublish(ctx, b.owner, fp, keys))
		cancel()
	}
	for _, m := range models {
		m.stop()
	}
	// A batch still moving bytes may write into the pool: if one stays busy
	// past the transfer timeout, the pool is left mapped rather than freed
	// under it.
	// This waits in real time, whatever clock the bridge decides with.
	deadline := time.Now().Add(2 * time.Duration(b.cfg.TransferTimeoutMS) * time.Millisecond)
	busy := 0
	for _, p := range parkedBatches {
		freed := p.batch.Free() == nil
		for !freed && time.Now().Before(deadline) {
			pollAll(p.batch)
			time.Sleep(time.Millisecond)
			freed = p.batch.Free() == nil
		}
		if !freed {
			busy++
		}
	}
	if busy > 0 {
		keep(status.Errorf(status.Timeout, "%d transfer batches still in flight at close; the pool stays mapped", busy))
		b.poolBusy = true
	}
	b.mu.Lock()
	for _, s := range b.segments {
		keep(b.tr.CloseSegment(s))
	}
	for _, s := range b.retired {
		keep(b.tr.CloseSegment(s))
	}
	b.segments, b.retired = nil, nil
	b.mu.Unlock()
	keep(b.release())
	return first
}

func (b *Bridge) opContext() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), time.Duration(b.cfg.Directory.OpTimeoutMS)*time.Millisecond)
}

// begin counts an operation in; it fails once the bridge is closed.
func (b *Bridge) begin() error {
	b.reap()
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return status.Errorf(status.State, "bridge is closed")
	}
	b.active++
	return nil
}

// reap frees parked batches that have gone idle, and their staging.
func (b *Bridge) reap() {
	b.mu.Lock()
	ps := b.parked
	b.parked = nil
	b.mu.Unlock()
	var still []parked
	for _, p := range ps {
		pollAll(p.batch)
		if p.batch.Free() != nil {
			still = append(still, p)
			continue
		}
		for _, e := range p.staging {
			_ = b.hold.Free(e.off, e.n)
		}
	}
	if len(still) > 0 {
		b.mu.Lock()
		b.parked = append(b.parked, still...)
		b.mu.Unlock()
	}
}

// pollAll asks every task of a batch for its status once, which is how an
// engine learns that a task finished.
func pollAll(batch transport.Batch) {
	for i := 0; i < batch.Tasks(); i++ {
		_, _ = batch.Status(i)
	}
}

// closePool unmaps the pool unless a transfer may still write into it:
// then the mapping is kept, as unmapping would let that write land in
// whatever reuses the addresses.
func (b *Bridge) closePool() error {
	if b.poolBusy {
		return nil
	}
	return b.hold.Close()
}

func (b *Bridge) end() {
	b.mu.Lock()
	b.active--
	b.mu.Unlock()
}

// segment opens a peer's segment once and caches its id. An open that
// outlives ctx fails with status.Timeout and marks the peer down.
func (b *Bridge) segment(ctx context.Context, name string) (transport.SegmentID, error) {
	b.mu.Lock()
	id, ok := b.segments[name]
	b.mu.Unlock()
	if ok {
		return id, nil
	}
	var err error
	if o, ok := b.tr.(transport.ContextOpener); ok {
		id, err = o.OpenSegmentContext(ctx, name)
	} else {
		id, err = b.tr.OpenSegment(name)
	}
	if err != nil {
		if abandoned(ctx) {
			return 0, errAbandoned
		}
		code := status.Transfer
		if status.Of(err) == status.Timeout || ctx.Err() != nil {
			code = status.Timeout
		}
		err = status.Wrap(code, err, "opening segment "+name)
		b.peerFailed(name, err)
		return 0, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if have, ok := b.segments[name]; ok {
		_ = b.tr.CloseSegment(id)
		return have, nil
	}
	b.segments[name] = id
	return id, nil
}

// retireSegment forgets a peer's cached segment after a transfer from it
// failed: a holder restarted under the same name (a store node on a fixed
// port) is opened afresh by the next load instead of failing every one.
// The old id stays open until Close, as a batch in flight may still use it.
func (b *Bridge) retireSegment(name string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if id, ok := b.segments[name]; ok {
		delete(b.segments, name)
		b.retired = append(b.retired, id)
	}
}

// gone hears the blocks that leave the pool: an evicted one goes to the
// disk tier first, when there is one. Neither waits on the directory: the
// blocks leave the local mirror at once, their odd generation (holdings
// stamps it next) makes any reader that a stale entry sends here fail
// verification, and the unpublishing is queued for the publisher.
func (b *Bridge) gone(gone []holdings.Entry, evicted bool) {
	if evicted {
		if n := b.storeNode(); n != nil {
			n.Evicted(gone)
		}
		b.stats.add(&b.stats.evictions, int64(len(gone)))
	}
	b.discard(gone)
}

// discard forgets blocks that left the pool and withdraws those the
// directory names as this process's; holdings frees their memory after.
func (b *Bridge) discard(gone []holdings.Entry) {
	byModel := map[key.Fingerprint][]key.BlockKey{}
	for _, e := range gone {
		// A block in the store stays published: the store still holds it.
		if b.store != nil && b.store.names(e.Value.Entry.Loc) {
			continue
		}
		if e.Value.State.Ours() {
			byModel[e.Value.Model] = append(byModel[e.Value.Model], e.Key)
		}
		if m := b.model(e.Value.Model); m != nil {
			m.forget(e.Key, b.tr.LocalSegment())
		}
	}
	b.removedEvents(byModel)
	for fp, keys := range byModel {
		if dropped := b.pub.withdraw(fp, keys); dropped > 0 {
			b.stats.add(&b.stats.unpublishDropped, int64(dropped))
		}
	}
}

// Health says whether the bridge serves the swarm: nil, or why not (the
// directory unreachable, this process holding no lease, the last publish
// refused).
func (b *Bridge) Health() error {
	if c, ok := b.dir.(directory.Checker); ok {
		if err := c.Healthy(); err != nil {
			return err
		}
	}
	if err := b.storeHealth(); err != nil {
		return err
	}
	b.pub.mu.Lock()
	defer b.pub.mu.Unlock()
	if b.pub.lastErr != nil {
		return status.Wrap(status.Of(b.pub.lastErr), b.pub.lastErr, "the directory refuses this process's blocks")
	}
	return nil
}

// DirectoryErrors counts the directory's failures that no caller saw.
func (b *Bridge) DirectoryErrors() directory.ErrorCounts {
	if c, ok := b.dir.(directory.Checker); ok {
		return c.Errors()
	}
	return directory.ErrorCounts{}
}
