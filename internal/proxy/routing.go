package proxy

import (
	"context"
	"errors"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/proxy/route"
)

// defaultPredict is what the router assumes a request generates when it
// sets no limit: enough that a long answer counts as load.
const defaultPredict = 256

// tokenized is a prompt's tokens as an upstream of model lm computes
// them; lm is nil when that upstream runs without the bridge (the tokens
// then only guide routing).
type tokenized struct {
	tokens []int32
	lm     *learned
}

// tokenize finds the prompt's tokens through the first askable upstream
// that has learned its model (else any askable one). An
// upstream that does not answer leaves the rotation and the next one is
// asked; nil when none could tokenize the prompt.
func (p *Proxy) tokenize(ctx context.Context, req *request, body []byte) *tokenized {
	ask := p.askable()
	var order []*backend
	for _, learned := range []bool{true, false} {
		for i, be := range p.ups {
			if ask[i] && (be.current() != nil) == learned {
				order = append(order, be)
			}
		}
	}
	for _, be := range order {
		lm := be.current()
		tokens, err := be.promptTokens(ctx, req, body)
		if err == nil {
			return &tokenized{tokens: tokens, lm: lm}
		}
		p.log.Debug("mcbridge proxy: no tokens for the prompt", "upstream", be.name, "err", err)
		if !isUpstreamAnswer(err) && ctx.Err() == nil {
			// It did not answer: out of the rotation, ask the next.
			p.router.Health(be.i, false)
			continue
		}
		break
	}
	p.stats.noTokens.Add(1)
	return nil
}

// askable says which upstreams a call that computes nothing may go to:
// those in the rotation, or every one when none is, as the router's last
// resort (a server just restarted answers before it is readmitted).
func (p *Proxy) askable() []bool {
	states := p.router.States()
	ask := make([]bool, len(states))
	some := false
	for i, st := range states {
		ask[i] = st.Up
		some = some || st.Up
	}
	if !some {
		for i := range ask {
			ask[i] = true
		}
	}
	return ask
}

// isUpstreamAnswer: the server answered the call, with an error or with
// something the proxy could not use; not a transport failure.
func isUpstreamAnswer(err error) bool {
	var ue *upstreamError
	return errors.As(err, &ue) || !isTransport(err)
}

// lookup is the one bridge lookup of a request, against the prefix the
// best holder among the upstreams already has.
type lookup struct {
	plan   *bridge.Plan
	cached int
}

// fits says whether the plan's decision holds for a slot that holds local
// tokens: it was taken against cached, and a restore that beat computing
// from cached beats computing from less.
func (l *lookup) fits(local int) bool {
	if l == nil || l.plan == nil {
		return false
	}
	return l.cached == local || (local < l.cached && l.plan.RestoreTokens > local)
}

// routeRequest is the router's view of a request: per upstream what its
// best slot holds and whether a restore can go there; the lookup is made
// on the first call and kept for retries.
func (p *Proxy) routeRequest(req *request, tk *tokenized, look *lookup, skip []bool) (route.Request, *lookup) {
	rq := route.Request{Candidates: make([]route.Candidate, len(p.ups)), Predict: defaultPredict}
	if req != nil && req.predict > 0 {
		rq.Predict = req.predict
	}
	maxLocal := 0
	for i, be := range p.ups {
		c := &rq.Candidates[i]
		c.Skip = skip[i]
		tab := be.table()
		if tab == nil {
			continue
		}
		c.Slots = tab.len()
		if tk == nil || !req.cachePrompt {
			continue
		}
		lm := be.learnedModel()
		if !sameModel(lm, tk.lm) {
			continue
		}
		c.Cached = tab.peek(tk.tokens)
		c.CanRestore = be.spec.Patched || (be.spec.SlotDir != "" && lm != nil && tk.lm != nil)
		if !c.Skip && c.CanRestore && c.Cached > maxLocal {
			maxLocal = c.Cached
		}
	}
	if tk == nil {
		return rq, look
	}
	rq.Prompt = len(tk.tokens)
	rq.Prefill = p.b.Arbiter().Prefill()
	if look == nil && tk.lm != nil && req.cachePrompt {
		look = &lookup{cached: maxLocal}
		if plan, err := tk.lm.m.Lookup(p.opts.Scope, tk.tokens, maxLocal); err == nil {
			look.plan = plan
		}
	}
	if look != nil && look.plan != nil {
		B := tk.lm.m.BlockTokens()
		rq.Restorable = min(look.plan.MatchedBlocks, (len(tk.tokens)-1)/B) * B
		rq.RestoreTTFT = look.plan.Decision.EstRestore
	}
	return rq, look
}

// sameModel says whether tokens computed under model b are a's: equal
// fingerprints, or one side without the bridge (the tokens then only
// guide routing, they key nothing).
func sameModel(a, b *learned) bool {
	return a == nil || b == nil || a.m.Fingerprint() == b.m.Fingerprint()
}
