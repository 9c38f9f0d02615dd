package proxy

import (
	"context"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/host"
	"github.com/mcbridge/mcbridge/internal/llamastate"
	"github.com/mcbridge/mcbridge/internal/mem"
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
	sf, err := be.restoreFile(slot)
	if err != nil {
		return 0, &fallback{"file_error", err}
	}
	defer sf.mu.Unlock()
	frame := host.Frame{Kind: llamastate.SlotFile, NStream: lm.nStream, SeqID: int32(slot)}
	// The load lands in the file itself. A partial load's verified blocks
	// are framed again in a buffer, copied into the file below.
	var fileErr error
	resize := sf.resize
	data, res, err := lm.m.RestoreState(plan, frame, func(n int) []byte {
		if resize == nil {
			return make([]byte, n)
		}
		b, err := resize(n)
		resize, fileErr = nil, err
		return b // nil on an error, which RestoreState refuses before any transfer
	})
	if fileErr != nil {
		return 0, &fallback{"file_error", fileErr}
	}
	if err != nil && res.OKTokens == 0 {
		if status.Of(err) == status.NotFound {
			return 0, &fallback{"evicted", err}
		}
		return 0, &fallback{"load_failed", err}
	}
	good := res.OKTokens
	t2 := p.opts.Now()
	if mem.Addr(data) != mem.Addr(sf.mem) {
		b, err := sf.resize(len(data))
		if err != nil {
			return 0, &fallback{"file_error", err}
		}
		copy(b, data)
	}
	name := sf.name
	t3 := p.opts.Now()
	r, err := be.up.slotAction(ctx, slot, "restore", name)
	if err != nil {
		return 0, &slotTouched{&fallback{"restore_refused", err}}
	}
	if r.Restored != good {
		return 0, &slotTouched{&fallback{"restore_refused", status.Errorf(status.Internal, "the server restored %d of %d tokens", r.Restored, good)}}
	}
	p.log.Debug("mcbridge proxy: restored", "upstream", be.name, "slot", slot, "tokens", good, "bytes", len(data),
		"check", t1.Sub(t0), "load", t2.Sub(t1), "copy", t3.Sub(t2), "server_restore", p.opts.Now().Sub(t3))
	return good, nil
}

// restoreFile returns the file restores into slot load into, created at
// the first, and locked. The caller holds the slot.
func (be *backend) restoreFile(slot int) (*slotFile, error) {
	be.mu.Lock()
	defer be.mu.Unlock()
	if be.filesClosed {
		return nil, status.Errorf(status.State, "the proxy is closing")
	}
	sf := be.files[slot]
	if sf == nil {
		var err error
		if sf, err = createSlotFile(be.spec.SlotDir, be.p.fileName("r", slot)); err != nil {
			return nil, err
		}
		if be.files == nil {
			be.files = map[int]*slotFile{}
		}
		be.files[slot] = sf
	}
	sf.mu.Lock()
	return sf, nil
}

// closeFiles removes the slot files, each once the restore using it is
// done, and refuses new ones.
func (be *backend) closeFiles() {
	be.mu.Lock()
	defer be.mu.Unlock()
	be.filesClosed = true
	for slot, sf := range be.files {
		sf.mu.Lock()
		if err := sf.close(); err != nil {
			be.p.log.Warn("mcbridge proxy: removing a slot file", "path", sf.path, "err", err)
		}
		sf.mu.Unlock()
		delete(be.files, slot)
	}
}
