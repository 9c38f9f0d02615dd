package bridge

import (
	"context"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
	mcstore "github.com/mcbridge/mcbridge/internal/store/mooncake"
	"github.com/mcbridge/mcbridge/internal/storenode"
)

// A bridge configured with a store (config store.kind "mooncake",
// docs/store.md) writes every sealed block into Mooncake Store from its
// publisher goroutine, with batch_put_from straight from the registered
// pool, and publishes directory entries that name the store instead of its
// pool. Loads read such blocks with batch_get_into into pool staging and
// verify them as blocks read from a peer (storefetch.go). The pool stays
// this process's cache: a block it still holds is restored from it.
// Mooncake Store has no prefix index, so the etcd directory still feeds the
// local mirror; a keeper goroutine (storenode.Keeper, with this backend as
// its storenode.Store in storekeep.go) keeps the directory's store entries
// true to the store, off the request path.

// storeScheme starts the Segment of an entry whose block is in a store:
// mooncake-store://<master>/<writer>, writer being the segment the block's
// writer contributes (where the first replica goes), "" for a pure client.
const storeScheme = "mooncake-store://"

func storeSegment(master, writer string) string { return storeScheme + master + "/" + writer }

// parseStoreSegment splits a store entry's Segment; ok is false for any
// other segment.
func parseStoreSegment(seg string) (master, writer string, ok bool) {
	rest, found := strings.CutPrefix(seg, storeScheme)
	if !found {
		return "", "", false
	}
	master, writer, found = strings.Cut(rest, "/")
	if !found || master == "" {
		return "", "", false
	}
	return master, writer, true
}

// Link names the arbiter calibrates store reads under, nearest first after
// the own pool ("local"): a block whose first replica is in this process's
// segment (Mooncake reads a local replica by memcpy), in another segment
// of this host, or elsewhere.
const (
	linkStoreOwn    = "store-own"
	linkStoreHost   = "store-host"
	linkStoreRemote = "store-remote"
)

type storeBackend struct {
	b         *Bridge
	cfg       mcstore.Config
	master    string
	replicas  int
	opTimeout time.Duration
	keeper    *storenode.Keeper
	conn      atomic.Pointer[storeConn] // nil until the client is set up
	ctx       context.Context           // ends at shutdown
	cancel    context.CancelFunc
	connected chan struct{} // closed when connect returns

	mu       sync.Mutex
	inflight int           // calls that may still touch the pool
	landed   chan struct{} // signalled when inflight drops
	shut     bool
	unwatch  func() // ends WatchStore's subscription
	// down is why the store cannot be used, as connecting or the last call
	// that needed the master found; nil once one succeeds. The library's
	// own health check comes from its heartbeat, which a client without a
	// segment does not run.
	down error
	// pending is set when a put left blocks pending: the keeper offers
	// them again once the store answers.
	pending bool
	// usable mirrors conn != nil && down == nil for lookups, which read it
	// once per mirrored block.
	usable atomic.Bool
}

// storeConn is the set-up client and what follows from it.
type storeConn struct {
	c       *mcstore.Client
	segment string // this client's segment, "" when it contributes none
	own     string // the Segment of entries this bridge writes
	opts    mcstore.PutOptions
}

// openStore loads the library (a wrong path fails the bridge's open) and
// connects in the background: the master is a network peer, and the
// bridge is opened on a host's thread. Until the client is set up, saves
// leave their blocks pending and store blocks are not read; both resume
// once it is.
func openStore(b *Bridge) (*storeBackend, error) {
	sc := b.cfg.Store
	if _, err := mcstore.Load(sc.Lib); err != nil {
		return nil, err
	}
	s := &storeBackend{b: b, master: sc.Master, replicas: sc.Replicas, opTimeout: time.Duration(sc.OpTimeoutMS) * time.Millisecond,
		landed: make(chan struct{}, 1), connected: make(chan struct{}),
		cfg: mcstore.Config{Library: sc.Lib, Master: sc.Master, LocalHostname: sc.LocalHostname, Metadata: sc.Metadata,
			Protocol: sc.Protocol, Device: sc.Device, SegmentBytes: uint64(sc.SegmentBytes)},
		down: status.Errorf(status.Transfer, "connecting to the Mooncake Store master %s", sc.Master)}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.keeper = storenode.NewKeeper(s, time.Duration(sc.AuditIntervalMS)*time.Millisecond, b.log)
	go s.connect(time.Duration(sc.SetupTimeoutMS) * time.Millisecond)
	return s, nil
}

// connect sets the client up, contributing the configured segment and
// registering the pool (puts read from it, gets write into it, without a
// copy), retrying with backoff until it succeeds or the bridge closes.
func (s *storeBackend) connect(timeout time.Duration) {
	defer close(s.connected)
	for backoff := time.Second; ; backoff = min(2*backoff, 30*time.Second) {
		ctx, cancel := context.WithTimeout(s.ctx, timeout)
		c, err := mcstore.Open(ctx, s.cfg)
		if err == nil {
			if err = c.Register(ctx, s.b.hold.Base(), uint64(s.b.hold.Size())); err != nil {
				_ = c.Close()
				err = status.Wrap(status.Of(err), err, "registering the pool with Mooncake Store")
			}
		}
		cancel()
		if err == nil {
			cn := &storeConn{c: c, opts: mcstore.PutOptions{Replicas: s.replicas}}
			if c.Contributes() {
				cn.segment = c.Segment()
				cn.opts.Preferred = []string{cn.segment}
			}
			cn.own = storeSegment(s.master, cn.segment)
			s.conn.Store(cn)
			s.setDown(nil)
			go s.keeper.Run()
			return
		}
		s.setDown(status.Wrap(status.Of(err), err, "connecting to the Mooncake Store master "+s.master))
		s.b.log.Warn("mcbridge: connecting to Mooncake Store failed; retrying", "master", s.master, "err", err, "retry_in", backoff)
		select {
		case <-s.ctx.Done():
			return
		case <-time.After(backoff):
		}
	}
}

// shutdown stops connecting and the keeper, waits for calls that may still
// move bytes into or out of the pool, and destroys the client: its
// segment, and the replicas in it, leave the store. A call still in flight
// after two transfer deadlines keeps the pool registered and mapped.
func (s *storeBackend) shutdown() error {
	s.mu.Lock()
	if s.shut {
		s.mu.Unlock()
		return nil
	}
	s.shut = true
	unwatch := s.unwatch
	s.mu.Unlock()
	if unwatch != nil {
		unwatch()
	}
	s.cancel()
	<-s.connected
	cn := s.conn.Load()
	if cn == nil {
		return nil
	}
	s.keeper.Stop()
	deadline := time.After(2 * time.Duration(s.b.cfg.TransferTimeoutMS) * time.Millisecond)
	for {
		s.mu.Lock()
		n := s.inflight
		s.mu.Unlock()
		if n == 0 {
			break
		}
		select {
		case <-s.landed:
		case <-deadline:
			s.b.poolBusy = true
			return status.Errorf(status.Timeout, "%d Mooncake Store calls still in flight at close; the pool stays mapped", n)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.opTimeout)
	defer cancel()
	if err := cn.c.Unregister(ctx, s.b.hold.Base()); err != nil {
		s.b.poolBusy = true
		return err
	}
	return cn.c.Close()
}

// track counts a call that may touch the pool until it lands, and runs
// after (when not nil) once it has.
func (s *storeBackend) track(done <-chan struct{}, after func()) {
	s.mu.Lock()
	s.inflight++
	s.mu.Unlock()
	go func() {
		<-done
		if after != nil {
			after()
		}
		s.mu.Lock()
		s.inflight--
		s.mu.Unlock()
		select {
		case s.landed <- struct{}{}:
		default:
		}
	}()
}

// ready is the set-up client, or why the store cannot be used.
func (s *storeBackend) ready() (*storeConn, error) {
	s.mu.Lock()
	down := s.down
	s.mu.Unlock()
	cn := s.conn.Load()
	if cn == nil {
		return nil, down
	}
	if err := cn.c.Healthy(); err != nil {
		return nil, err
	}
	return cn, down
}

// healthy is nil unless the store cannot be used now.
func (s *storeBackend) healthy() error {
	_, err := s.ready()
	return err
}

// observe records what a call that needed the master says of it.
func (s *storeBackend) observe(err error) {
	switch {
	case err == nil:
		s.setDown(nil)
	case status.Of(err) == status.Timeout || mcstore.Code(err) == mcstore.CodeRPCFailed || mcstore.Code(err) == mcstore.CodeRPCTimeout:
		s.setDown(status.Wrap(status.Transfer, err, "Mooncake Store master "+s.master+" unreachable"))
	}
}

func (s *storeBackend) setDown(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.down = err
	s.usable.Store(err == nil && s.conn.Load() != nil)
}

// firstErr is err, or the first per-key error.
func firstErr[T any](err error, per []T, of func(T) error) error {
	if err != nil {
		return err
	}
	for _, p := range per {
		if e := of(p); e != nil {
			return e
		}
	}
	return nil
}

// names reports whether loc names a block in this bridge's store.
func (s *storeBackend) names(loc directory.Location) bool {
	master, _, ok := parseStoreSegment(loc.Segment)
	return ok && master == s.master
}

func (s *storeBackend) context() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), s.opTimeout)
}

// storeKey is the store's key for a block: the block key, as hex.
func storeKey(k key.BlockKey) string { return k.String() }

// put writes the sealed blocks of entries into the store and returns the
// entries to publish, rewritten to name the store. It runs on the
// publisher's goroutine. Entries that already name the store (a publish
// being retried) pass as they are; blocks evicted since their save are
// dropped; a block the store refuses (full, master unreachable) stays in
// the pool, pending, restorable here and offered again by the next save of
// its tokens. Each block is pinned until the put has read it.
func (s *storeBackend) put(entries []directory.Entry) []directory.Entry {
	b := s.b
	cn, notReady := s.ready()
	var out, todo []directory.Entry
	var keys []string
	var bufs []mcstore.Buffer
	for _, e := range entries {
		if s.names(e.Loc) {
			out = append(out, e)
			continue
		}
		held, ok := b.hold.Pin(e.Key, e.Loc.Generation)
		if !ok {
			continue
		}
		todo = append(todo, e)
		keys = append(keys, storeKey(e.Key))
		bufs = append(bufs, mcstore.Buffer{Addr: b.hold.Base() + uintptr(held.Value.Off), Len: uint64(held.Value.Size)})
	}
	if len(todo) == 0 {
		return out
	}
	unpin := func() {
		for _, e := range todo {
			b.hold.Unpin(e.Key)
		}
	}
	var errs []error
	err := notReady
	if err == nil {
		errs, err = s.putFrom(cn, keys, bufs, unpin)
		s.observe(firstErr(err, errs, func(e error) error { return e }))
	} else {
		unpin()
	}
	why := firstErr(err, errs, func(e error) error { return e })
	stored := 0
	for i, e := range todo {
		if err != nil || errs[i] != nil {
			b.hold.Refuse(e.Key, e.Loc.Generation)
			continue
		}
		stored++
		e.Loc.Segment, e.Loc.Addr = cn.own, 0
		b.hold.Rename(e)
		out = append(out, e)
	}
	b.stats.add(&b.stats.storePuts, int64(stored))
	if failed := len(todo) - stored; failed > 0 {
		s.mu.Lock()
		s.pending = true
		s.mu.Unlock()
		b.stats.add(&b.stats.storePutFailures, int64(failed))
		b.log.Warn("mcbridge: Mooncake Store refused blocks; they stay in this pool, pending", "blocks", failed, "err", why)
	}
	return out
}

// putFrom runs one batch_put_from from the pool, within the store's op
// timeout; unpin runs once the library has read the buffers, which after a
// timeout is when the call lands.
func (s *storeBackend) putFrom(cn *storeConn, keys []string, bufs []mcstore.Buffer, unpin func()) ([]error, error) {
	op, err := cn.c.StartPutFrom(keys, bufs, cn.opts)
	if err != nil {
		unpin()
		return nil, err
	}
	s.track(op.Done(), unpin)
	ctx, cancel := s.context()
	defer cancel()
	return op.Wait(ctx)
}

// link is the arbiter's name for reading a block whose writer holds the
// first replica in segment writer ("" for a writer without one).
func (s *storeBackend) link(writer string) string {
	own := ""
	if cn := s.conn.Load(); cn != nil {
		own = cn.segment
	}
	switch {
	case writer == "":
		return linkStoreRemote
	case writer == own:
		return linkStoreOwn
	case hostPart(writer) == hostPart(own) || (own == "" && hostPart(writer) == s.b.cfg.Store.LocalHostname):
		return linkStoreHost
	}
	return linkStoreRemote
}

func hostPart(hostPort string) string {
	if h, _, err := net.SplitHostPort(hostPort); err == nil {
		return h
	}
	return hostPort
}

// ownCopy reports whether e names a store block that this pool still
// holds, the very block (same generation): it is read here, as the
// nearest copy.
func (b *Bridge) ownCopy(e directory.Entry) bool {
	return b.store != nil && b.store.names(e.Loc) && b.hold.Holds(e.Key, e.Loc.Generation)
}

// readable reports whether this bridge can read the block e names now: a
// block in a store needs this bridge's store, set up and answering (a
// lookup that matched what it cannot read would only fail its load).
func (b *Bridge) readable(e directory.Entry) bool {
	if _, _, ok := parseStoreSegment(e.Loc.Segment); !ok {
		return true
	}
	return b.store != nil && b.store.usable.Load() && b.store.names(e.Loc)
}

// storeHealth is nil without a store or while its master answers.
func (b *Bridge) storeHealth() error {
	if b.store == nil {
		return nil
	}
	if err := b.store.healthy(); err != nil {
		return status.Wrap(status.Of(err), err, "Mooncake Store")
	}
	return nil
}

// StoreSegment is the segment this bridge contributes to its store ("" for
// none, without a store, or before it is set up).
func (b *Bridge) StoreSegment() string {
	if b.store == nil {
		return ""
	}
	if cn := b.store.conn.Load(); cn != nil {
		return cn.segment
	}
	return ""
}
