package proxy

import (
	"context"
	"os"
	"slices"
	"sync"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/host"
	"github.com/mcbridge/mcbridge/internal/llamastate"
	"github.com/mcbridge/mcbridge/internal/status"
)

// fallback is why a restore did not happen, by a reason the metrics count.
type fallback struct {
	reason string
	err    error
}

func (f *fallback) Error() string { return f.reason + ": " + f.err.Error() }
func (f *fallback) Unwrap() error { return f.err }

// slotTouched is a restore that failed after the server was asked to load
// the file: it cleared the slot, or loaded the file and lost the answer.
type slotTouched struct{ f *fallback }

func (s *slotTouched) Error() string { return s.f.Error() }
func (s *slotTouched) Unwrap() error { return s.f }

// restore loads a plan's blocks into a slot file and has the server load
// it into slot, which the caller holds. It returns how many leading tokens
// the slot now holds.
func (be *backend) restore(ctx context.Context, lm *learned, slot int, plan *bridge.Plan, infos []slotInfo) (int, error) {
	p := be.p
	t0 := p.opts.Now()
	if err := be.checkUpstream(ctx, lm, slot, infos); err != nil {
		if _, ok := err.(*fallback); ok {
			return 0, err
		}
		return 0, &fallback{"check_failed", err}
	}
	t1 := p.opts.Now()
	frame := host.Frame{Kind: llamastate.SlotFile, NStream: lm.nStream, SeqID: int32(slot)}
	var lent [][]byte
	defer func() {
		for _, buf := range lent {
			be.states.put(buf, lm.props.TotalSlots)
		}
	}()
	data, res, err := lm.m.RestoreState(plan, frame, func(n int) []byte {
		buf := be.states.get(n)
		lent = append(lent, buf)
		return buf
	})
	if err != nil && res.OKTokens == 0 {
		if status.Of(err) == status.NotFound {
			return 0, &fallback{"evicted", err}
		}
		return 0, &fallback{"load_failed", err}
	}
	good := res.OKTokens
	t2 := p.opts.Now()
	name := p.fileName("r", slot)
	path := be.slotPath(name)
	if err := os.WriteFile(path, data, 0o644); err != nil {
		_ = os.Remove(path)
		return 0, &fallback{"file_error", err}
	}
	defer os.Remove(path)
	t3 := p.opts.Now()
	r, err := be.up.slotAction(ctx, slot, "restore", name)
	if err != nil {
		return 0, &slotTouched{&fallback{"restore_refused", err}}
	}
	if r.Restored != good {
		return 0, &slotTouched{&fallback{"restore_refused", status.Errorf(status.Internal, "the server restored %d of %d tokens", r.Restored, good)}}
	}
	p.log.Debug("mcbridge proxy: restored", "upstream", be.name, "slot", slot, "tokens", good, "bytes", len(data),
		"check", t1.Sub(t0), "load", t2.Sub(t1), "write", t3.Sub(t2), "server_restore", p.opts.Now().Sub(t3))
	return good, nil
}

// statePool keeps the slot-file buffers of finished restores for the next
// ones, at most one a slot: a 4096-token load (48 MiB) took 171-241 ms into
// a fresh buffer and 20-30 ms into one used before (proxy -v timings, mock
// engine).
type statePool struct {
	mu   sync.Mutex
	free [][]byte
}

// get returns a buffer of n bytes, one kept if one is large enough.
func (sp *statePool) get(n int) []byte {
	sp.mu.Lock()
	defer sp.mu.Unlock()
	for i, b := range sp.free {
		if cap(b) >= n {
			sp.free = slices.Delete(sp.free, i, i+1)
			return b[:n]
		}
	}
	return make([]byte, n)
}

// put keeps b for later, dropping the smallest buffer when keep are kept.
func (sp *statePool) put(b []byte, keep int) {
	sp.mu.Lock()
	defer sp.mu.Unlock()
	sp.free = append(sp.free, b)
	if len(sp.free) > max(keep, 1) {
		smallest := 0
		for i, f := range sp.free {
			if cap(f) < cap(sp.free[smallest]) {
				smallest = i
			}
		}
		sp.free = slices.Delete(sp.free, smallest, smallest+1)
	}
}
