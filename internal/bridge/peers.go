package bridge

import (
	"time"

	"github.com/mcbridge/mcbridge/internal/status"
)

// A peer whose transfers time out is hung (stopped, partitioned, swamped):
// every load that goes to it would wait out the whole deadline. It is
// marked down for peer_down_ms, and lookups meanwhile treat its blocks as
// absent, so only the request that found it out pays.

// peerFailed marks segment down when err is a timeout; it logs and counts
// each time a peer goes down, not each failure.
func (b *Bridge) peerFailed(segment string, err error) {
	if status.Of(err) != status.Timeout || segment == b.tr.LocalSegment() || b.cfg.PeerDownMS == 0 {
		return
	}
	d := time.Duration(b.cfg.PeerDownMS) * time.Millisecond
	now := b.now()
	b.mu.Lock()
	until, known := b.down[segment]
	fresh := !known || !now.Before(until)
	b.down[segment] = now.Add(d)
	b.mu.Unlock()
	if fresh {
		b.stats.add(&b.stats.peersDown, 1)
		b.log.Warn("mcbridge: peer marked down, lookups plan around its blocks", "segment", segment, "for", d, "err", err)
	}
}

// downSegments returns the segments marked down now, nil when there are
// none (the common case costs one map length check).
func (b *Bridge) downSegments() map[string]bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.down) == 0 {
		return nil
	}
	now := b.now()
	var out map[string]bool
	for s, until := range b.down {
		if !now.Before(until) {
			delete(b.down, s)
			continue
		}
		if out == nil {
			out = map[string]bool{}
		}
		out[s] = true
	}
	return out
}
