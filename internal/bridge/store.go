package bridge

import (
	"context"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
	mcstore "github.com/mcbridge/mcbridge/internal/store/mooncake"
)

// A bridge configured with a store (config store.kind "mooncake",
// docs/store.md) writes every sealed block into Mooncake Store from its
// publisher goroutine, with batch_put_from straight from the registered
// pool, and publishes directory entries that name the store instead of its
// pool. Loads read such blocks with batch_get_into into pool staging and
// verify them as blocks read from a peer (storefetch.go). The pool stays
// this process's cache: a block it still holds is restored from it.
// Mooncake Store has no prefix index, so the etcd directory still feeds the
// local mirror; a keeper goroutine (storekeep.go) keeps the directory's
// store entries true to the store, off the request path.

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
	c         *mcstore.Client
	master    string
	own       string // the Segment of entries this bridge writes
	segment   string // this client's segment name, "" when it contributes none
	opts      mcstore.PutOptions
	opTimeout time.Duration
	keeper    *keeper

	mu       sync.Mutex
	inflight int           // calls that may still touch the pool
	landed   chan struct{} // signalled when inflight drops
	shut     bool
	unwatch  func() // ends WatchStore's subscription
	// down is why the master is unreachable, as the last call that needed
	// it found; nil once one succeeds. The library's own health check
	// comes from its heartbeat, which a client without a segment does not
	// run.
	down error
}

// openStore connects to the master, contributes the configured segment and
// registers the pool, so puts read from it and gets write into it without
// a copy.
func openStore(b *Bridge) (*storeBackend, error) {
	sc := b.cfg.Store
	s := &storeBackend{b: b, master: sc.Master, opTimeout: time.Duration(sc.OpTimeoutMS) * time.Millisecond,
		landed: make(chan struct{}, 1), opts: mcstore.PutOptions{Replicas: sc.Replicas}}
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(sc.SetupTimeoutMS)*time.Millisecond)
	defer cancel()
	c, err := mcstore.Open(ctx, mcstore.Config{
		Library: sc.Lib, Master: sc.Master, LocalHostname: sc.LocalHostname, Metadata: sc.Metadata,
		Protocol: sc.Protocol, Device: sc.Device, SegmentBytes: uint64(sc.SegmentBytes),
	})
	if err != nil {
		return nil, err
	}
	if err := c.Register(ctx, b.pool.Base(), uint64(b.pool.Size())); err != nil {
		_ = c.Close()
		return nil, status.Wrap(status.Of(err), err, "registering the pool with Mooncake Store")
	}
	s.c = c
	if c.Contributes() {
		s.segment = c.Segment()
		s.opts.Preferred = []string{s.segment}
	}
	s.own = storeSegment(s.master, s.segment)
	s.keeper = newKeeper(s, time.Duration(sc.AuditIntervalMS)*time.Millisecond)
	go s.keeper.run()
	return s, nil
}

// shutdown stops the keeper, waits for calls that may still move bytes
// into or out of the pool, and destroys the client: its segment, and the
// replicas in it, leave the store. A call still in flight after two
// transfer deadlines keeps the pool registered and mapped.
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
	s.keeper.stop()
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
	if err := s.c.Unregister(ctx, s.b.pool.Base()); err != nil {
		s.b.poolBusy = true
		return err
	}
	return s.c.Close()
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

// healthy is nil unless the master is known unreachable.
func (s *storeBackend) healthy() error {
	if err := s.c.Healthy(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.down
}

// observe records what a call that needed the master says of it.
func (s *storeBackend) observe(err error) {
	unreachable := err != nil && (status.Of(err) == status.Timeout ||
		mcstore.Code(err) == mcstore.CodeRPCFailed || mcstore.Code(err) == mcstore.CodeRPCTimeout)
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case unreachable:
		s.down = status.Wrap(status.Transfer, err, "Mooncake Store master "+s.master+" unreachable")
	case err == nil:
		s.down = nil
	}
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
	var out, todo []directory.Entry
	var keys []string
	var bufs []mcstore.Buffer
	b.mu.Lock()
	for _, e := range entries {
		if s.names(e.Loc) {
			out = append(out, e)
			continue
		}
		sl, ok := b.resident.Get(e.Key)
		if !ok || sl.gen != e.Loc.Generation || b.resident.Pin(e.Key) != nil {
			continue
		}
		todo = append(todo, e)
		keys = append(keys, storeKey(e.Key))
		bufs = append(bufs, mcstore.Buffer{Addr: b.pool.Base() + uintptr(sl.off), Len: uint64(sl.size)})
	}
	b.mu.Unlock()
	if len(todo) == 0 {
		return out
	}
	unpin := func() {
		b.mu.Lock()
		for _, e := range todo {
			_ = b.resident.Unpin(e.Key)
		}
		b.mu.Unlock()
	}
	errs, err := s.putFrom(keys, bufs, unpin)
	why := firstErr(err, errs, func(e error) error { return e })
	s.observe(why)
	stored := 0
	b.mu.Lock()
	for i, e := range todo {
		sl, ok := b.resident.Get(e.Key)
		held := ok && sl.gen == e.Loc.Generation
		if err != nil || errs[i] != nil {
			if held {
				sl.publishing, sl.pending = false, true
				b.resident.Set(e.Key, sl)
			}
			continue
		}
		stored++
		e.Loc.Segment, e.Loc.Addr = s.own, 0
		if held {
			sl.entry = e
			b.resident.Set(e.Key, sl)
		}
		out = append(out, e)
	}
	b.mu.Unlock()
	b.stats.add(&b.stats.storePuts, int64(stored))
	if failed := len(todo) - stored; failed > 0 {
		b.stats.add(&b.stats.storePutFailures, int64(failed))
		b.log.Warn("mcbridge: Mooncake Store refused blocks; they stay in this pool, pending", "blocks", failed, "err", why)
	}
	return out
}

// putFrom runs one batch_put_from from the pool, within the store's op
// timeout; unpin runs once the library has read the buffers, which after a
// timeout is when the call lands.
func (s *storeBackend) putFrom(keys []string, bufs []mcstore.Buffer, unpin func()) ([]error, error) {
	if err := s.healthy(); err != nil {
		unpin()
		return nil, err
	}
	op, err := s.c.StartPutFrom(keys, bufs, s.opts)
	if err != nil {
		unpin()
		return nil, err
	}
	s.track(op.Done(), unpin)
	ctx, cancel := s.context()
	defer cancel()
	return op.Wait(ctx)
}

// link is the arbiter's name for reading the block e names from the store.
func (s *storeBackend) link(writer string) string {
	switch {
	case writer != "" && writer == s.segment:
		return linkStoreOwn
	case writer != "" && s.segment != "" && hostPart(writer) == hostPart(s.segment):
		return linkStoreHost
	case writer != "" && s.segment == "" && hostPart(writer) == s.b.cfg.Store.LocalHostname:
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

// ownCopyLocked reports whether e names a store block that this pool
// still holds, the very block (same generation): it is read here, as the
// nearest copy. b.mu is held.
func (b *Bridge) ownCopyLocked(e directory.Entry) bool {
	if b.store == nil || !b.store.names(e.Loc) {
		return false
	}
	s, ok := b.resident.Get(e.Key)
	return ok && s.gen == e.Loc.Generation
}

// readable reports whether this bridge can read the block e names: a
// block in a store needs this bridge's store.
func (b *Bridge) readable(e directory.Entry) bool {
	if _, _, ok := parseStoreSegment(e.Loc.Segment); !ok {
		return true
	}
	return b.store != nil && b.store.names(e.Loc)
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
// none, or without a store).
func (b *Bridge) StoreSegment() string {
	if b.store == nil {
		return ""
	}
	return b.store.segment
}
