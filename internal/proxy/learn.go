package proxy

import (
	"context"
	"os"
	"path/filepath"

	"github.com/mcbridge/mcbridge/internal/host"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

// learn finds out what the upstream serves: its slots, its model file's
// digest, and, from a slot file of a fixed probe prompt, its KV format and
// the digest of the probe's KV. Together they are the model's fingerprint:
// another model, K/V type, flash-attention setting, rope override or
// server-wide adapter gives other keys, so it restores nothing.
//
// Without a slot directory it learns only the slots (nil, nil): the proxy
// schedules them and routes to the server, but keys nothing there.
func (be *backend) learn(ctx context.Context) (*learned, error) {
	infos, err := be.up.slots(ctx)
	if err != nil {
		return nil, status.Wrap(status.Unsupported, err, "GET /slots (do not start the server with --no-slots)")
	}
	if len(infos) == 0 {
		return nil, status.Errorf(status.Unsupported, "the upstream has no slots")
	}
	tab := be.tableFor(len(infos))
	if err := tab.checkTasks(infos); err != nil {
		tab.forgetAll()
		_ = tab.checkTasks(infos)
	}
	if be.spec.SlotDir == "" {
		return nil, nil
	}
	pr, err := be.up.props(ctx)
	if err != nil {
		return nil, err
	}
	for kind, on := range pr.Modalities {
		if on {
			return nil, status.Errorf(status.Unsupported, "the upstream takes %s input: multimodal prompts are not keyed", kind)
		}
	}
	path, digest, err := be.p.modelDigest(pr)
	if err != nil {
		return nil, err
	}
	slot, _, err := tab.acquire(ctx, -1, nil)
	if err != nil {
		return nil, err
	}
	data, err := be.probe(ctx, slot)
	// The probe's slot holds the probe now, which no prompt is worth
	// counting on; its task is the server's newest.
	tab.release(slot, contents{})
	if infos, err := be.up.slots(ctx); err == nil {
		_ = tab.checkTasks(infos)
	}
	if err != nil {
		return nil, err
	}
	// The same registration as every other host's: the library reads the
	// KV format and the probe's KV from the slot file.
	// A memory with a partial state is snapshotted by the proxy (snapshots).
	m, nStream, err := host.RegisterState(be.p.b, host.Identity{GGUFPath: path, StateSnapshots: true}, data)
	if err != nil {
		return nil, err
	}
	if nStream != 1 && nStream != len(infos) {
		return nil, status.Errorf(status.Unsupported, "%d KV streams for %d slots", nStream, len(infos))
	}
	return &learned{m: m, nStream: nStream, props: pr, path: path, digest: digest}, nil
}

// modelDigest digests the model file: the path /props gives when it is
// absolute and readable here, else the configured one. A relative path is
// the server's working directory's, which the proxy does not know.
func (p *Proxy) modelDigest(pr props) (string, key.Hash, error) {
	path := p.opts.ModelPath
	if path == "" {
		if !filepath.IsAbs(pr.ModelPath) {
			return "", key.Hash{}, status.Errorf(status.Config, "the upstream's model path %q is not absolute: give the model's path", pr.ModelPath)
		}
		path = pr.ModelPath
	}
	d, err := key.FileDigest(path)
	if err != nil {
		return "", key.Hash{}, status.Wrap(status.Config, err, "digesting the model file (give the model's path when the server's is not readable here)")
	}
	return path, d, nil
}

// tableFor returns the slot table, new when the slot count changed.
func (be *backend) tableFor(n int) *slotTable {
	be.mu.Lock()
	defer be.mu.Unlock()
	if be.slots == nil || be.slots.len() != n {
		be.slots = newSlotTable(n)
	}
	return be.slots
}

// probe computes the probe prompt from scratch in a held slot and returns
// the slot's file.
func (be *backend) probe(ctx context.Context, slot int) ([]byte, error) {
	req := map[string]any{"prompt": host.ProbeTokens(), "n_predict": 1, "temperature": 0, "cache_prompt": false, "id_slot": slot}
	if err := be.up.complete(ctx, req); err != nil {
		return nil, status.Wrap(status.Unsupported, err, "probe completion")
	}
	// Not given back: the registration may keep parts of the probe's file.
	return be.save(ctx, slot)
}

// save has the server write slot into a file, reads it into one of the
// proxy's read buffers and removes it. The caller gives the buffer back to
// p.bufs once nothing refers to its bytes, or leaves it to the collector.
func (be *backend) save(ctx context.Context, slot int) ([]byte, error) {
	name := be.p.fileName("s", slot)
	path := be.slotPath(name)
	_, err := be.up.slotAction(ctx, slot, "save", name)
	defer os.Remove(path)
	if err != nil {
		return nil, status.Wrap(status.Unsupported, err, "slot save")
	}
	data, err := be.p.bufs.read(path)
	if err != nil {
		return nil, status.Wrap(status.Unsupported, err, "reading the saved slot (is the slot directory the server's --slot-save-path?)")
	}
	return data, nil
}

// checkUpstream confirms, before a restore, that the upstream is still the
// server the model was learned from and that slot is idle; infos is its
// GET /slots when the caller has just asked (nil: ask now). A changed
// server drops the model.
func (be *backend) checkUpstream(ctx context.Context, lm *learned, slot int, infos []slotInfo) error {
	pr, err := be.up.props(ctx)
	if err != nil {
		return err
	}
	_, digest, err := be.p.modelDigest(pr)
	if err != nil || digest != lm.digest || pr.ModelPath != lm.props.ModelPath || pr.BuildInfo != lm.props.BuildInfo ||
		pr.TotalSlots != lm.props.TotalSlots || pr.Settings.NCtx != lm.props.Settings.NCtx {
		be.forget(lm, "the upstream's model, build or slots changed")
		return &fallback{"upstream_changed", status.Errorf(status.ModelMismatch, "the upstream changed since it was learned")}
	}
	if infos == nil {
		if infos, err = be.up.slots(ctx); err != nil {
			return err
		}
		if err := be.table().checkTasks(infos); err != nil {
			be.restarted(err.Error())
			return &fallback{"upstream_changed", err}
		}
	}
	for _, in := range infos {
		if in.ID == slot && in.IsProcessing {
			return &fallback{"slot_busy", status.Errorf(status.State, "slot %d is busy outside the proxy", slot)}
		}
	}
	return nil
}
