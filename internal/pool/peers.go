package pool

import (
	"context"
	"sync"
	"time"

	"github.com/mcbridge/mcbridge/internal/status"
)

// Peers keeps the shared pools of a host's other processes mapped, each
// once, for every read after the first. A pool is mapped ahead of any
// read where possible (Warm, when its first entry is seen), so that a
// holder stopped later delays nothing: reads of a mapped pool never ask
// the holder again. Safe for concurrent use.
type Peers struct {
	now     func() time.Time
	timeout time.Duration // of a Warm's handshake
	idle    time.Duration // a mapping unused this long is dropped

	mu        sync.Mutex
	pools     map[Address]*peer
	latest    map[string]uint64 // per socket path, the newest identity seen
	following map[string]bool   // socket paths Follow is mapping now
	swept     time.Time
	closed    bool
}

// A peer is unpinned (Warm, Get) or pinned (Follow): a pinned mapping is
// not dropped for being idle, only once Unfollow unpins it.
type peer struct {
	ready  chan struct{} // closed once m or err is set
	m      *Mapped
	err    error
	refs   int       // reads holding m
	used   time.Time // last Warm or Get
	pinned bool
}

// NewPeers returns an empty set. timeout bounds a background mapping;
// idle is how long a mapping nobody reads stays: a holder that exits
// leaves its pool's pages alive while readers map them, so an unused
// mapping must go.
func NewPeers(now func() time.Time, timeout, idle time.Duration) *Peers {
	return &Peers{now: now, timeout: timeout, idle: idle, pools: map[Address]*peer{}, latest: map[string]uint64{}, following: map[string]bool{}}
}

// Warm starts mapping the pool at addr in the background unless it is
// mapped or being mapped; a failure is forgotten, so the next Warm or Get
// tries again.
func (ps *Peers) Warm(addr Address) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.closed {
		return
	}
	if p, ok := ps.pools[addr]; ok {
		p.used = ps.now()
		return
	}
	ps.startLocked(addr)
}

func (ps *Peers) startLocked(addr Address) *peer {
	p := &peer{ready: make(chan struct{}), used: ps.now()}
	ps.pools[addr] = p
	// A new pool at a known path: the holder restarted, and the old
	// pool goes once no read holds it (sweepLocked).
	ps.latest[addr.Path] = addr.ID
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), ps.timeout)
		defer cancel()
		m, err := Map(ctx, addr)
		ps.mu.Lock()
		defer ps.mu.Unlock()
		if err == nil && ps.closed {
			_ = m.Close()
			m, err = nil, status.Errorf(status.State, "shared pools closed")
		}
		if err != nil && ps.pools[addr] == p {
			delete(ps.pools, addr)
		}
		p.m, p.err = m, err
		close(p.ready)
	}()
	return p
}

// Follow maps, in the background, the pool whatever socket at path hands
// out, and pins the mapping until Unfollow: a store node maps each pool
// of its host as it appears, before any of its blocks is published, so
// that it can copy them even after their holder is killed (the pages live
// while mapped). A failure is forgotten; the next Follow tries again.
func (ps *Peers) Follow(path string) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.closed || ps.following[path] {
		return
	}
	ps.following[path] = true
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), ps.timeout)
		defer cancel()
		m, err := mapAt(ctx, path)
		ps.mu.Lock()
		defer ps.mu.Unlock()
		delete(ps.following, path)
		switch {
		case err != nil:
			return
		case ps.closed:
			_ = m.Close()
			return
		}
		if p, ok := ps.pools[m.addr]; ok {
			_ = m.Close()
			p.pinned, p.used = true, ps.now()
			return
		}
		ready := make(chan struct{})
		close(ready)
		ps.pools[m.addr] = &peer{ready: ready, m: m, used: ps.now(), pinned: true}
		ps.latest[path] = m.addr.ID
	}()
}

// Unfollow unpins the mappings of pools at path: they go, as any, once
// idle.
func (ps *Peers) Unfollow(path string) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	for a, p := range ps.pools {
		if a.Path == path && p.pinned {
			p.pinned, p.used = false, ps.now()
		}
	}
}

// Followed returns the socket paths of the pinned mappings.
func (ps *Peers) Followed() []string {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	var out []string
	for a, p := range ps.pools {
		if p.pinned {
			out = append(out, a.Path)
		}
	}
	return out
}

// Get returns the mapped pool at addr, mapping it first if needed (waiting
// until ctx ends), and a release to call when the read is done: the
// mapping stays while any read holds it.
func (ps *Peers) Get(ctx context.Context, addr Address) (*Mapped, func(), error) {
	ps.mu.Lock()
	if ps.closed {
		ps.mu.Unlock()
		return nil, nil, status.Errorf(status.State, "shared pools closed")
	}
	ps.sweepLocked()
	p, ok := ps.pools[addr]
	if !ok {
		p = ps.startLocked(addr)
	}
	p.used = ps.now()
	p.refs++
	ps.mu.Unlock()
	release := func() {
		ps.mu.Lock()
		p.refs--
		ps.mu.Unlock()
	}
	select {
	case <-p.ready:
	case <-ctx.Done():
		release()
		return nil, nil, status.Wrap(status.Timeout, ctx.Err(), "waiting for the shared pool "+addr.Path)
	}
	if p.err != nil {
		release()
		return nil, nil, p.err
	}
	return p.m, release, nil
}

// sweepLocked drops, at most once per idle period, the mappings no read
// holds that are unused for idle or superseded by a newer pool at their
// path.
func (ps *Peers) sweepLocked() {
	now := ps.now()
	if now.Sub(ps.swept) < ps.idle {
		return
	}
	ps.swept = now
	for a, p := range ps.pools {
		select {
		case <-p.ready:
		default:
			continue
		}
		if p.refs == 0 && (now.Sub(p.used) >= ps.idle && !p.pinned || ps.latest[a.Path] != a.ID) {
			delete(ps.pools, a)
			_ = p.m.Close()
		}
	}
}

// Mapped counts the pools mapped now, for metrics and tests.
func (ps *Peers) Mapped() int {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	n := 0
	for _, p := range ps.pools {
		if p.m != nil {
			n++
		}
	}
	return n
}

// Close unmaps every pool; no read may be in progress.
func (ps *Peers) Close() error {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	ps.closed = true
	var first error
	for a, p := range ps.pools {
		if p.m != nil {
			if err := p.m.Close(); err != nil && first == nil {
				first = err
			}
			p.m = nil
		}
		delete(ps.pools, a)
	}
	return first
}
