package proxy

import (
	"context"
	"os"
	"runtime"

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

// restore fetches the blocks of tokens (whole blocks, positions 0..n-1)
// into a slot file and has the server load it into slot, which the caller
// holds. It returns how many leading tokens the slot now holds.
func (p *Proxy) restore(ctx context.Context, lm *learned, slot int, tokens []int32) (int, error) {
	t0 := p.opts.Now()
	if err := p.checkUpstream(ctx, lm, slot); err != nil {
		if _, ok := err.(*fallback); ok {
			return 0, err
		}
		return 0, &fallback{"check_failed", err}
	}
	t1 := p.opts.Now()
	rf, err := lm.format.newRestoreFile(slot, tokens)
	if err != nil {
		return 0, &fallback{"file_error", err}
	}
	t2 := p.opts.Now()
	ld, err := lm.m.LoadBegin(p.opts.Scope, rf.layout, tokens, rf.cells)
	if err != nil {
		if status.Of(err) == status.NotFound {
			return 0, &fallback{"evicted", err}
		}
		return 0, &fallback{"load_failed", err}
	}
	for l := range lm.format.Layers {
		if _, err := ld.WaitLayer(l); err != nil {
			break
		}
	}
	res, loadErr := ld.End()
	// The load wrote into rf.bytes through the layout's addresses.
	runtime.KeepAlive(rf.bytes)
	t3 := p.opts.Now()
	good := res.OKTokens
	if good == 0 {
		if loadErr == nil {
			loadErr = status.Errorf(status.Internal, "load verified no block")
		}
		return 0, &fallback{"load_failed", loadErr}
	}
	data := rf.bytes
	if good < len(tokens) {
		// Keep the verified leading blocks.
		sl, err := rf.state.Slice(good)
		if err != nil {
			return 0, &fallback{"file_error", err}
		}
		if data, err = sl.Build(); err != nil {
			return 0, &fallback{"file_error", err}
		}
	}
	name := p.fileName("r", slot)
	path := p.slotPath(name)
	if err := os.WriteFile(path, data, 0o644); err != nil {
		_ = os.Remove(path)
		return 0, &fallback{"file_error", err}
	}
	defer os.Remove(path)
	t4 := p.opts.Now()
	r, err := p.up.slotAction(ctx, slot, "restore", name)
	if err != nil {
		return 0, &slotTouched{&fallback{"restore_refused", err}}
	}
	if r.Restored != good {
		return 0, &slotTouched{&fallback{"restore_refused", status.Errorf(status.Internal, "the server restored %d of %d tokens", r.Restored, good)}}
	}
	p.log.Debug("mcbridge proxy: restored", "slot", slot, "tokens", good, "bytes", len(data),
		"check", t1.Sub(t0), "frame", t2.Sub(t1), "load", t3.Sub(t2), "write", t4.Sub(t3), "server_restore", p.opts.Now().Sub(t4))
	return good, nil
}
