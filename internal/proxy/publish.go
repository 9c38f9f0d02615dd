package proxy

import (
	"context"
	"errors"
	"slices"

	"github.com/mcbridge/mcbridge/internal/host"
	"github.com/mcbridge/mcbridge/internal/llamastate"
	"github.com/mcbridge/mcbridge/internal/status"
)

// publishJob is a saved slot file on its way into the bridge.
type publishJob struct {
	be     *backend
	lm     *learned
	data   []byte
	st     *llamastate.State
	tokens []int32
}

// after runs once the client has its answer, still holding the slot: it
// asks the server what the slot holds now (GET /slots, which also shows a
// restart), saves the slot when that can publish a block the directory
// lacks, and hands the file to the publisher. The slot is released as soon
// as that is done, with what the answer and the file say it holds.
func (ru *run) after() {
	be, p, x := ru.be, ru.be.p, ru.x
	defer p.workers.Done()
	queued := false
	defer func() {
		if !queued {
			p.pending.Add(-1)
		}
	}()
	tab := be.table()
	ctx, cancel := context.WithTimeout(context.Background(), controlTimeout)
	defer cancel()
	infos, err := be.up.slots(ctx)
	if err != nil {
		infos = nil
	}
	if infos != nil {
		if err := tab.checkTasks(infos); err != nil {
			be.restarted(err.Error())
			infos = nil
		}
	}
	predicted := 0
	if x.haveAns && x.ans.Timings != nil {
		predicted = x.ans.Timings.PredictedN
	}
	final := contents{tokens: ru.holds(), dirty: nextDirty(ru.before, ru.tokens, ru.req.dirty, x), sig: sigOf(infos, ru.slot),
		answered: max(predicted-1, 0)}
	if final.sig == nil || final.sig.n < len(final.tokens) {
		final.tokens, final.sig, final.answered = nil, nil, 0
	}
	defer func() { tab.release(ru.slot, final) }()
	prompt := final.tokens
	if final.dirty || prompt == nil || !be.publishingFor(ru.lm) {
		p.log.Debug("mcbridge proxy: nothing to publish", "upstream", be.name, "slot", ru.slot,
			"dirty", final.dirty, "known", prompt != nil, "publishing", be.publishingFor(ru.lm))
		return
	}
	matched := 0
	if ru.plan != nil {
		matched = ru.plan.MatchedBlocks
	}
	// The slot holds the prompt and all but the last generated token: when
	// the directory had every full block of that before the request,
	// there is nothing to publish.
	B := ru.lm.m.BlockTokens()
	if (len(prompt)+predicted)/B <= matched || ru.lm.m.SnapshotOnly() {
		// A recurrent memory's states have no blocks to publish: its
		// snapshots were taken before the request (snapshots).
		p.stats.savesSkipped.Add(1)
		return
	}
	data, err := be.save(ctx, ru.slot)
	defer func() {
		if !queued {
			p.bufs.put(data)
		}
	}()
	var st *llamastate.State
	if err == nil {
		st, err = ru.lm.m.ParseState(data)
	}
	if err != nil {
		p.stats.saveFailures.Add(1)
		p.log.Info("mcbridge proxy: slot save failed", "upstream", be.name, "slot", ru.slot, "err", err)
		final.tokens, final.sig, final.answered = nil, nil, 0
		return
	}
	p.stats.saves.Add(1)
	p.stats.savedBytes.Add(int64(len(data)))
	toks, err := st.PromptTokens()
	if err != nil {
		final.tokens, final.sig, final.answered = nil, nil, 0
		return
	}
	// The file is the server's word for what the slot holds.
	final.tokens, final.answered = toks, 0
	// It must be this request's work: the prompt, then what it generated.
	// Fewer tokens mean the server dropped some (a context shift), others
	// that someone else used the slot.
	if !slices.Equal(toks[:min(len(toks), len(prompt))], prompt) || len(toks) < len(prompt)+predicted-1 {
		final.dirty = true
		p.stats.saveMismatch.Add(1)
		if len(toks) < len(prompt)+predicted-1 {
			be.stopPublishing("the upstream dropped tokens from a slot (context shift)")
		}
		return
	}
	if queued = p.enqueue(publishJob{be: be, lm: ru.lm, data: data, st: st, tokens: toks}); !queued {
		p.stats.publishDropped.Add(1)
	}
}

// publisher publishes queued files one at a time until Close.
func (p *Proxy) publisher() {
	defer p.workers.Done()
	for job := range p.queue {
		if err := p.publish(job); err != nil {
			p.stats.publishFailures.Add(1)
			p.log.Info("mcbridge proxy: publish failed", "upstream", job.be.name, "err", err)
		}
		p.bufs.put(job.data)
		p.pending.Add(-1)
	}
}

// publish hands the full blocks of a saved slot file to the bridge, as
// every state host does.
func (p *Proxy) publish(job publishJob) error {
	res, err := job.lm.m.SaveState(p.opts.Scope, job.data, job.tokens)
	if status.Of(err) == status.ModelMismatch {
		job.be.forget(job.lm, "a slot file in another KV format")
	}
	if errors.Is(err, host.ErrSecondCacheLacks) {
		// Every longer prompt would lose its first blocks' window rows too.
		job.be.stopPublishing("the upstream's slot files hold only part of a prompt in its second KV cache (a sliding window)")
	}
	if err != nil {
		return err
	}
	p.stats.publishedBlocks.Add(int64(res.Queued))
	return nil
}
