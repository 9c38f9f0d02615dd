package proxy

import (
	"context"
	"errors"
	"net/http"
	"strings"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/proxy/route"
)

// run is one request in a slot the proxy holds, from the restore to the
// save.
type run struct {
	be     *backend
	lm     *learned
	req    *request
	tokens []int32 // the prompt as the server computes it; nil: unknown
	slot   int
	before contents // what the slot held before the request, as confirmed
	plan   *bridge.Plan
	x      *exchange
	infos  []slotInfo // GET /slots just before the request, when asked
}

// pinned runs one request in a slot the proxy holds, restoring its prefix
// first when the bridge has it.
func (be *backend) pinned(w http.ResponseWriter, r *http.Request, req *request, body []byte, tk *tokenized, look *lookup, ch route.Choice) served {
	return be.pinnedOnce(w, r, req, body, tk, look, ch, true)
}

// pinnedOnce is pinned; a server found restarted is relearned and the
// request starts over once.
func (be *backend) pinnedOnce(w http.ResponseWriter, r *http.Request, req *request, body []byte, tk *tokenized, look *lookup, ch route.Choice, again bool) served {
	p := be.p
	ctx := r.Context()
	lm := be.current()
	tab := be.table()
	if tab == nil {
		p.stats.plain.Add(1)
		return be.forward(w, r, body, nil, true)
	}
	var tokens []int32
	if tk != nil && sameModel(lm, tk.lm) {
		tokens = tk.tokens
	}
	keyed := tokens != nil && lm != nil && tk.lm != nil && req.cachePrompt && be.spec.SlotDir != ""
	want := -1
	if req.idSlot >= 0 {
		want = req.idSlot % tab.len() // llama-server wraps slot ids the same way
	}
	slot, local, err := tab.acquire(ctx, want, tokens)
	if err != nil {
		return served{} // the client went away while waiting
	}
	ru := &run{be: be, lm: lm, req: req, tokens: tokens, slot: slot, before: tab.view(slot).contents,
		x: &exchange{ep: req.ep, upstream: be.i, retryable: true}}
	if keyed {
		plan := be.planFor(lm, tokens, local, look)
		if local > 0 || (plan != nil && plan.RestoreTokens > 0) {
			// About to rely on what the slot holds or to restore into
			// it: the server's word first.
			held := local
			var restartedNow bool
			local, restartedNow = ru.confirm(ctx, local)
			switch {
			case restartedNow && again:
				tab.release(ru.slot, contents{})
				return be.pinnedOnce(w, r, req, body, tk, look, ch, false)
			case restartedNow:
				keyed = false // restarted twice in a row: no restore this time
			case local != held:
				plan = be.planFor(lm, tokens, local, look)
			}
		}
		if keyed {
			ru.plan = plan
		}
	}
	return ru.serve(w, r, body)
}

// confirm checks the slot against the server's GET /slots: a restarted
// server (slots that forgot their tasks) is forgotten whole, and a slot
// whose last task or token count is not what the proxy saw after its own
// request holds something unknown. It returns how much of the prompt the
// slot may be counted on for, and whether the server restarted (then the
// caller releases the slot and starts over against the relearned server).
func (ru *run) confirm(ctx context.Context, local int) (int, bool) {
	be := ru.be
	infos, err := be.up.slots(ctx)
	if err != nil {
		if local > 0 {
			be.p.stats.unconfirmed("unreachable")
		}
		ru.before = contents{}
		return 0, false
	}
	if err := be.table().checkTasks(infos); err != nil {
		be.restarted(err.Error())
		return 0, true
	}
	ru.infos = infos
	if local == 0 {
		return 0, false
	}
	if why := confirmed(ru.before.sig, infos, ru.slot); why != "" {
		be.p.stats.unconfirmed(why)
		be.p.log.Debug("mcbridge proxy: slot not confirmed, its contents are unknown", "upstream", be.name, "slot", ru.slot, "why", why)
		ru.before = contents{}
		return 0, false
	}
	return local, false
}

// serve restores the plan (if any), forwards the request pinned to the
// slot, and hands the slot to after once the answer is complete.
func (ru *run) serve(w http.ResponseWriter, r *http.Request, body []byte) served {
	be, p, x := ru.be, ru.be.p, ru.x
	ctx := r.Context()
	tab := be.table()
	// Counted from here, so that Flush after an answer waits for its save.
	p.pending.Add(1)
	handedOff := false
	defer func() {
		if !handedOff {
			// What the server did with the slot is not known; it computed
			// over at most what it held.
			tab.release(ru.slot, contents{dirty: ru.before.dirty || ru.req.dirty})
			p.pending.Add(-1)
		}
	}()
	ru.restore(ctx)
	ru.snapshots(ctx)
	out, err := ru.req.pinned(ru.slot)
	switch {
	case err != nil:
		out = body
	case ru.req.asChat:
		// The chat the server would convert the request into, pinned:
		// its answer is written back as the server writes Anthropic's.
		x.ep, x.path, x.toMessages = chat, messagesChatPath, true
	}
	p.stats.pinned.Add(1)
	be.send(w, r, out, nil, x)
	res := served{unreachable: x.unreachable, outcome: x.outcome()}
	if !x.complete || x.status/100 != 2 {
		return res
	}
	ru.learnFromAnswer()
	handedOff = true
	// The next turn of this conversation waits for the save rather than
	// restoring into another slot.
	tab.markSaving(ru.slot, contents{tokens: ru.holds(), dirty: true})
	p.workers.Add(1)
	go ru.after()
	return res
}

// restore restores the run's plan into its slot when it goes past what the
// slot holds.
func (ru *run) restore(ctx context.Context) {
	be, p, x := ru.be, ru.be.p, ru.x
	if ru.plan == nil || ru.plan.RestoreTokens == 0 {
		return
	}
	t0 := p.opts.Now()
	n, err := be.restore(ctx, ru.lm, ru.slot, ru.plan, ru.infos)
	x.restoreMS = float64(p.opts.Now().Sub(t0).Microseconds()) / 1000
	switch {
	case err == nil:
		x.restored = n
		ru.before = contents{tokens: ru.tokens[:n]}
		p.stats.restores.Add(1)
		p.stats.restoredTokens.Add(int64(n))
	case errors.As(err, new(*slotTouched)):
		x.fallback = fallbackHeader(err)
		// The server may have cleared the slot or restored part of it:
		// what it holds is unknown, but no dirtier than before.
		ru.before.tokens, ru.before.sig = nil, nil
		p.stats.fallback(err)
		p.log.Info("mcbridge proxy: restore fell back", "upstream", be.name, "slot", ru.slot, "err", err)
	default:
		x.fallback = fallbackHeader(err)
		p.stats.fallback(err)
		p.log.Debug("mcbridge proxy: restore fell back", "upstream", be.name, "slot", ru.slot, "err", err)
	}
}

// fallbackHeader is a fallback's reason and error as the Mcb-Fallback
// header carries it: one line, at most 512 bytes.
func fallbackHeader(err error) string {
	s := strings.Join(strings.Fields(err.Error()), " ")
	if len(s) > 512 {
		s = s[:512]
	}
	return s
}

// snapshots takes the snapshots a model with a partial state (a window
// cache, a recurrent state: docs/design.md §5.9) restores from, which a
// stock server's slot files hold at their end only: before the request, it
// has the server compute the prompt up to each snapshot boundary the
// directory lacks (config proxy_snapshots: the prompt's last block
// boundary and where it leaves the blocks the lookup matched), as a
// request of its own in the run's slot (one token generated, the slot
// kept), saves the slot after each, and stores the partial state the file
// ends with. The request then computes only the rest. Only clean KV is snapshotted: a request that adapts its cells, or a
// slot whose start is unknown, takes none.
func (ru *run) snapshots(ctx context.Context) {
	be, p, lm := ru.be, ru.be.p, ru.lm
	if lm == nil || ru.tokens == nil || ru.req.dirty || !ru.req.cachePrompt || be.spec.SlotDir == "" ||
		ru.before.dirty || !be.publishingFor(lm) || lm.m.SnapshotTokens() == 0 {
		return
	}
	from := max(lcp(ru.before.tokens, ru.tokens), lm.m.SnapshotsRestoreAfter())
	branch := 0
	if ru.plan != nil {
		branch = ru.plan.MatchedBlocks * lm.m.BlockTokens()
	}
	for _, n := range lm.m.MissingSnapshots(p.opts.Scope, ru.tokens, from, branch) {
		prefix := ru.tokens[:n]
		req := map[string]any{"prompt": prefix, "n_predict": 1, "temperature": 0, "cache_prompt": true, "id_slot": ru.slot}
		var ans answer
		if err := be.up.call(ctx, http.MethodPost, "/completion", nil, req, &ans); err != nil || ans.Timings == nil {
			// The slot holds some of the prompt's computed KV now, how much
			// is not known.
			ru.before = contents{}
			p.stats.snapshotFailures.Add(1)
			p.log.Info("mcbridge proxy: a snapshot's prompt failed", "upstream", be.name, "slot", ru.slot, "tokens", n, "err", err)
			return
		}
		if known := lcp(ru.before.tokens, prefix); ans.Timings.CacheN > known || ans.Timings.CacheN+ans.Timings.PromptN != n {
			// The server reused cells the proxy does not know the origin
			// of, or computed another prompt: no clean state to snapshot.
			// What the slot started with stays as it was, so that the
			// request's own answer is judged by it too (nextDirty).
			p.stats.snapshotFailures.Add(1)
			p.log.Debug("mcbridge proxy: no snapshot: the slot's start is not known clean", "upstream", be.name, "slot", ru.slot,
				"cache_n", ans.Timings.CacheN, "known", known)
			return
		}
		ru.before = contents{tokens: prefix}
		p.stats.snapshotPrompts.Add(1)
		data, err := be.save(ctx, ru.slot)
		if err == nil {
			err = lm.m.SaveStateSnapshot(p.opts.Scope, data, prefix)
			p.bufs.put(data)
		}
		if err != nil {
			p.stats.snapshotFailures.Add(1)
			p.log.Info("mcbridge proxy: snapshot failed", "upstream", be.name, "slot", ru.slot, "tokens", n, "err", err)
			return
		}
	}
}

// learnFromAnswer reads what the answer says the server did: its timings
// feed the arbiter, a truncated prompt stops publishing, and counts that
// disagree with the proxy's tokens mean the proxy did not know the prompt.
func (ru *run) learnFromAnswer() {
	x := ru.x
	if !x.haveAns || x.ans.Timings == nil {
		return
	}
	ru.be.observe(x.ans.Timings)
	if x.ans.Truncated {
		ru.be.stopPublishing("the upstream truncated a prompt")
	}
	if ru.tokens != nil && x.ans.prompted() && x.ans.Timings.CacheN+x.ans.Timings.PromptN != len(ru.tokens) {
		ru.be.p.stats.answerMismatches.Add(1)
		ru.be.p.log.Debug("mcbridge proxy: the server counted another prompt", "upstream", ru.be.name,
			"server", x.ans.Timings.CacheN+x.ans.Timings.PromptN, "proxy", len(ru.tokens))
	}
}

// holds is what the slot is known to start with after the answer: the
// prompt, when the answer's own counts say the server computed exactly it.
func (ru *run) holds() []int32 {
	x := ru.x
	if ru.tokens == nil || !x.haveAns || !x.ans.prompted() || x.ans.Timings.CacheN+x.ans.Timings.PromptN != len(ru.tokens) {
		return nil
	}
	return ru.tokens
}

// nextDirty says whether a slot may hold unclean KV after a request that
// had before in it: the request's own cells are clean unless it shifts or
// adapts them, and reused cells are as clean as the slot was, as long as
// the server reused no more than the proxy knows the slot held: its known
// tokens and, where the server confirmed the slot untouched since (sig),
// the answer the last request left after them (a conversation's next turn
// sends it back).
func nextDirty(before contents, prompt []int32, reqDirty bool, x *exchange) bool {
	if reqDirty {
		return true
	}
	if !x.haveAns || !x.ans.prompted() {
		return true
	}
	c := x.ans.Timings.CacheN
	if c == 0 {
		return false
	}
	if prompt == nil {
		return true
	}
	known := lcp(before.tokens, prompt)
	ownAnswer := known == len(before.tokens) && before.sig != nil && c <= known+before.answered
	if c > known && !ownAnswer {
		return true
	}
	return before.dirty
}

// confirmed says why GET /slots does not confirm what the proxy saw of a
// slot after its own last use ("" when it does): the slot ran another task
// since, or holds another count of tokens (erased, restored, reused).
func confirmed(sig *slotSig, infos []slotInfo, id int) string {
	if sig == nil {
		return "unseen"
	}
	for _, in := range infos {
		if in.ID != id {
			continue
		}
		switch {
		case in.IDTask == nil || *in.IDTask != sig.task:
			return "task"
		case in.NPromptTokens != sig.n:
			return "tokens"
		}
		return ""
	}
	return "missing"
}
