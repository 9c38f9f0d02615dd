package proxy

import (
	"context"
	"slices"

	"github.com/mcbridge/mcbridge/internal/llamastate"
	"github.com/mcbridge/mcbridge/internal/status"
)

// publishJob is a saved slot file on its way into the bridge.
type publishJob struct {
	lm     *learned
	data   []byte
	st     *llamastate.State
	tokens []int32
}

// after runs once the client has its answer, still holding the slot: it
// saves the slot when that can publish a block the directory lacks, and
// hands the file to the publisher. The slot is released as soon as the
// file is written, with what the file says the slot holds.
func (p *Proxy) after(lm *learned, tab *slotTable, slot int, prompt []int32, dirty bool, x *exchange, matched int) {
	defer p.workers.Done()
	queued := false
	defer func() {
		if !queued {
			p.pending.Add(-1)
		}
	}()
	holds := prompt // what the slot is known to start with
	defer func() { tab.release(slot, holds, dirty) }()
	if dirty || prompt == nil || !p.publishingFor(lm) {
		return
	}
	predicted := 0
	if x.haveAns && x.ans.Timings != nil {
		predicted = x.ans.Timings.PredictedN
	}
	// The slot holds the prompt and all but the last generated token: when
	// the directory had every full block of that before the request,
	// there is nothing to publish.
	B := lm.m.BlockTokens()
	if (len(prompt)+predicted)/B <= matched {
		p.stats.savesSkipped.Add(1)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), controlTimeout)
	defer cancel()
	st, data, err := p.save(ctx, slot)
	if err != nil {
		p.stats.saveFailures.Add(1)
		p.log.Info("mcbridge proxy: slot save failed", "slot", slot, "err", err)
		holds = nil
		return
	}
	p.stats.saves.Add(1)
	toks, err := st.PromptTokens()
	if err != nil {
		holds = nil
		return
	}
	holds = toks
	// The file must be this request's work: the prompt, then what it
	// generated. Fewer tokens mean the server dropped some (a context
	// shift), others that someone else used the slot.
	if !slices.Equal(toks[:min(len(toks), len(prompt))], prompt) || len(toks) < len(prompt)+predicted-1 {
		dirty = true
		p.stats.saveMismatch.Add(1)
		if len(toks) < len(prompt)+predicted-1 {
			p.stopPublishing("the upstream dropped tokens from a slot (context shift)")
		}
		return
	}
	if queued = p.enqueue(publishJob{lm: lm, data: data, st: st, tokens: toks}); !queued {
		p.stats.publishDropped.Add(1)
	}
}

// publisher publishes queued files one at a time until Close.
func (p *Proxy) publisher() {
	defer p.workers.Done()
	for job := range p.queue {
		if err := p.publish(job); err != nil {
			p.stats.publishFailures.Add(1)
			p.log.Info("mcbridge proxy: publish failed", "err", err)
		}
		p.pending.Add(-1)
	}
}

// publish hands the full blocks of a saved slot file to the bridge, as
// every state host does.
func (p *Proxy) publish(job publishJob) error {
	res, err := job.lm.m.SaveState(p.opts.Scope, job.data, job.tokens)
	if status.Of(err) == status.ModelMismatch {
		p.forget(job.lm, "a slot file in another KV format")
	}
	if err != nil {
		return err
	}
	p.stats.publishedBlocks.Add(int64(res.Queued))
	return nil
}
