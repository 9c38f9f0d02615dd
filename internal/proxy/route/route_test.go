package route

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/arbiter"
)

type clock struct{ t time.Time }

func (c *clock) now() time.Time          { return c.t }
func (c *clock) advance(d time.Duration) { c.t = c.t.Add(d) }
func newClock() *clock                   { return &clock{t: time.Unix(1_700_000_000, 0)} }
func newRouter(t *testing.T, n int, cfg Config, c *clock) *Router {
	t.Helper()
	cfg.Now = c.now
	r, err := New(cfg, n)
	require.NoError(t, err)
	return r
}

// prefill is a cost model where a token costs 1 ms, whatever its position.
var prefill = arbiter.PrefillCost{PerToken: 1e-3}

// request is a 700-token prompt whose first 640 tokens the swarm can
// restore in 40 ms (plus 60 ms computing the rest), on three upstreams of
// two slots each that all restore.
func request(cached ...int) Request {
	req := Request{Prompt: 700, Predict: 16, Restorable: 640, RestoreTTFT: 100 * time.Millisecond, Prefill: prefill}
	for i := 0; i < 3; i++ {
		c := Candidate{Slots: 2, CanRestore: true}
		if i < len(cached) {
			c.Cached = cached[i]
		}
		req.Candidates = append(req.Candidates, c)
	}
	return req
}

func TestIdleHolderWinsWithNothingToMove(t *testing.T) {
	r := newRouter(t, 3, Config{}, newClock())
	ch, err := r.Choose(request(0, 650, 0))
	require.NoError(t, err)
	assert.Equal(t, []any{1, Prefix, 650, false}, []any{ch.Upstream, ch.Reason, ch.Start, ch.Restore})
	assert.Equal(t, 50*time.Millisecond, ch.Est, "computing the last 50 tokens")
	assert.Contains(t, ch.String(), "upstream 1 (prefix)")
	assert.Contains(t, ch.String(), "0: 100ms = wait 0s + busy 0s + own 100ms (start 640, restore, 0 in flight)")
}

func TestRestoreBeatsAShortCachedPrefix(t *testing.T) {
	r := newRouter(t, 3, Config{}, newClock())
	// Upstream 2 holds 100 tokens (600 ms to compute the rest); restoring
	// 640 anywhere takes 100 ms: the lowest index restores.
	ch, err := r.Choose(request(0, 0, 100))
	require.NoError(t, err)
	assert.Equal(t, []any{0, Restore, 640, true}, []any{ch.Upstream, ch.Reason, ch.Start, ch.Restore})

	// Only upstream 2 restores: its own cache and the restore both count.
	req := request(0, 0, 100)
	req.Candidates[0].CanRestore, req.Candidates[1].CanRestore = false, false
	ch, err = r.Choose(req)
	require.NoError(t, err)
	assert.Equal(t, []any{2, Restore, 640}, []any{ch.Upstream, ch.Reason, ch.Start})
}

func TestColdRequestsSpreadByLoad(t *testing.T) {
	c := newClock()
	r := newRouter(t, 3, Config{}, c)
	cold := request()
	cold.Restorable, cold.RestoreTTFT = 0, 0
	var got []int
	for range 3 {
		ch, err := r.Choose(cold)
		require.NoError(t, err)
		assert.Equal(t, Load, ch.Reason)
		got = append(got, ch.Upstream)
	}
	assert.Equal(t, []int{0, 1, 2}, got, "each cold prefill goes where nothing else is being computed")
}

func TestBusyHolderSpreads(t *testing.T) {
	c := newClock()
	r := newRouter(t, 3, Config{}, c)
	// A long answer on the holder takes its one slot.
	holder := func(predict int) Request {
		req := request(0, 650, 0)
		req.Predict, req.Candidates[1].Slots = predict, 1
		return req
	}
	ch, err := r.Choose(holder(2000))
	require.NoError(t, err)
	require.Equal(t, []any{1, Prefix}, []any{ch.Upstream, ch.Reason})
	ch, err = r.Choose(holder(16))
	require.NoError(t, err)
	assert.Equal(t, []any{0, Spread, true}, []any{ch.Upstream, ch.Reason, ch.Restore}, "%s", ch)
	assert.Greater(t, ch.Costs[1].Wait, 10*time.Second, "the holder's wait is its one slot: 2000 tokens at 10 ms")
}

// A prefix everyone shares lands on its holder until the holder's queue
// costs more than a restore elsewhere: never all of them on one server.
func TestQueueCostCapsTheHotServer(t *testing.T) {
	c := newClock()
	r := newRouter(t, 3, Config{}, c)
	counts := map[int]int{}
	reasons := map[Reason]int{}
	for range 12 {
		ch, err := r.Choose(request(650, 0, 0))
		require.NoError(t, err)
		counts[ch.Upstream]++
		reasons[ch.Reason]++
	}
	assert.Less(t, counts[0], 12, "the holder does not take everything: %v", counts)
	assert.Positive(t, counts[0], "the holder takes its share: %v", counts)
	assert.Positive(t, counts[1]+counts[2], "the others take the rest: %v", counts)
	assert.Positive(t, reasons[Spread], "spread choices are named: %v", reasons)
}

func TestEqualInputsGiveEqualChoices(t *testing.T) {
	run := func() []Choice {
		c := newClock()
		r := newRouter(t, 3, Config{}, c)
		var out []Choice
		for i := range 20 {
			ch, err := r.Choose(request(i*37%700, i*53%700, 0))
			require.NoError(t, err)
			out = append(out, ch)
			c.advance(7 * time.Millisecond)
			if i%3 == 0 {
				r.Done(ch.Ticket, Outcome{Predicted: 16, Decode: time.Duration(i+1) * time.Millisecond * 16})
			}
		}
		return out
	}
	assert.Equal(t, run(), run())
}

func TestWorkAheadFadesWithTime(t *testing.T) {
	c := newClock()
	r := newRouter(t, 2, Config{}, c)
	cold := Request{Prompt: 500, Predict: 1, Prefill: prefill, Candidates: []Candidate{{Slots: 4}, {Slots: 4}}}
	first, err := r.Choose(cold)
	require.NoError(t, err)
	require.Equal(t, 0, first.Upstream)
	second, err := r.Choose(cold)
	require.NoError(t, err)
	assert.Equal(t, 1, second.Upstream, "upstream 0 is still computing 500 tokens")
	assert.Equal(t, 500*time.Millisecond, second.Costs[0].Busy)
	c.advance(400 * time.Millisecond)
	third, err := r.Choose(cold)
	require.NoError(t, err)
	assert.Equal(t, 100*time.Millisecond, third.Costs[0].Busy, "100 ms of its prefill are left")
	assert.Equal(t, 0, third.Upstream, "less work is left on 0 than on 1")
}

func TestHealthTakesUpstreamsOutAndBack(t *testing.T) {
	r := newRouter(t, 2, Config{FailAfter: 2, RecoverAfter: 2}, newClock())
	up, changed := r.Health(0, false)
	assert.Equal(t, []bool{true, false}, []bool{up, changed}, "one failed check is not enough")
	up, changed = r.Health(0, false)
	assert.Equal(t, []bool{false, true}, []bool{up, changed})
	ch, err := r.Choose(request(650, 0))
	require.Error(t, err, "candidate count")
	req := request(650, 0)
	req.Candidates = req.Candidates[:2]
	ch, err = r.Choose(req)
	require.NoError(t, err)
	assert.Equal(t, []any{1, Only}, []any{ch.Upstream, ch.Reason}, "the holder is out: %s", ch)
	r.Done(ch.Ticket, Outcome{})
	up, _ = r.Health(0, true)
	assert.False(t, up, "one good check is not enough")
	up, changed = r.Health(0, true)
	assert.Equal(t, []bool{true, true}, []bool{up, changed})
	ch, err = r.Choose(req)
	require.NoError(t, err)
	assert.Equal(t, []any{0, Prefix}, []any{ch.Upstream, ch.Reason})

	// A failed request takes its upstream out at once.
	r.Done(ch.Ticket, Outcome{Failed: true})
	assert.False(t, r.States()[0].Up)
	assert.Zero(t, r.States()[0].InFlight)
	r.Health(1, false)
	r.Health(1, false)
	ch, err = r.Choose(req)
	require.NoError(t, err, "every upstream is out: they are tried anyway")
	assert.Equal(t, []any{0, LastResort}, []any{ch.Upstream, ch.Reason}, "the holder, by the usual estimate: %s", ch)
	r.Done(ch.Ticket, Outcome{})
	req.Candidates[0].Skip = true
	ch, err = r.Choose(req)
	require.NoError(t, err)
	assert.Equal(t, []any{1, LastResort}, []any{ch.Upstream, ch.Reason})
	r.Done(ch.Ticket, Outcome{})
	req.Candidates[1].Skip = true
	ch, err = r.Choose(req)
	require.Error(t, err, "every upstream was tried")
	assert.Equal(t, []any{-1, None}, []any{ch.Upstream, ch.Reason})
}

func TestSkippedCandidatesAreNotChosen(t *testing.T) {
	r := newRouter(t, 3, Config{}, newClock())
	req := request(0, 650, 0)
	req.Candidates[1].Skip = true
	ch, err := r.Choose(req)
	require.NoError(t, err)
	assert.Equal(t, []any{0, Restore}, []any{ch.Upstream, ch.Reason})
	assert.True(t, ch.Costs[1].Skip)
	assert.Contains(t, ch.String(), "1: out")
}

func TestRoundRobinAndLeastLoaded(t *testing.T) {
	r := newRouter(t, 3, Config{Policy: RoundRobin}, newClock())
	r.Health(1, false)
	var got []int
	for range 4 {
		ch, err := r.Choose(request(0, 650, 0))
		require.NoError(t, err)
		assert.Equal(t, RoundRobinTurn, ch.Reason)
		got = append(got, ch.Upstream)
	}
	assert.Equal(t, []int{0, 2, 0, 2}, got, "in turn, skipping the one that is down")

	r = newRouter(t, 3, Config{Policy: LeastLoaded}, newClock())
	a, err := r.Choose(request(0, 650, 0))
	require.NoError(t, err)
	b, err := r.Choose(request(0, 650, 0))
	require.NoError(t, err)
	r.Done(a.Ticket, Outcome{})
	c, err := r.Choose(request(0, 650, 0))
	require.NoError(t, err)
	assert.Equal(t, []int{0, 1, 0}, []int{a.Upstream, b.Upstream, c.Upstream}, "fewest in flight, prefixes ignored")
	assert.Equal(t, LeastLoadedPick, c.Reason)
}

func TestCalibrations(t *testing.T) {
	c := newClock()
	r := newRouter(t, 2, Config{Window: 1}, c)
	req := Request{Prompt: 700, Predict: 100, Restorable: 640, RestoreTTFT: 100 * time.Millisecond, Prefill: prefill,
		Candidates: []Candidate{{Slots: 1, CanRestore: true}, {Slots: 1, CanRestore: true}}}
	ch, err := r.Choose(req)
	require.NoError(t, err)
	require.Equal(t, 0, ch.Upstream)
	// Upstream 0 restored 640 tokens in 400 ms where 40 were estimated,
	// and decodes at 50 ms a token.
	r.Done(ch.Ticket, Outcome{Restored: 640, RestoreTook: 400 * time.Millisecond, Predicted: 10, Decode: 500 * time.Millisecond})
	st := r.States()[0]
	assert.Equal(t, 50*time.Millisecond, st.DecodePerToken)
	assert.InDelta(t, 10, st.RestoreFix, 1e-9)
	ch, err = r.Choose(req)
	require.NoError(t, err)
	assert.Equal(t, 1, ch.Upstream, "restores into 0 are slow: %s", ch)
	assert.Equal(t, 460*time.Millisecond, ch.Costs[0].Own, "400 ms restoring, 60 computing")

	// The correction is bounded: one absurd restore does not rule it out.
	r.Done(ch.Ticket, Outcome{})
	ch, err = r.Choose(req)
	require.NoError(t, err)
	r.Done(ch.Ticket, Outcome{Restored: 640, RestoreTook: time.Hour})
	assert.LessOrEqual(t, r.States()[ch.Upstream].RestoreFix, float64(maxRestoreFix))
}

func TestUnknownPromptGoesByLoad(t *testing.T) {
	r := newRouter(t, 2, Config{}, newClock())
	req := Request{Candidates: []Candidate{{Slots: 1, Cached: 50}, {Slots: 1}}}
	a, err := r.Choose(req)
	require.NoError(t, err)
	b, err := r.Choose(req)
	require.NoError(t, err)
	assert.Equal(t, []any{0, Load, 1, Load}, []any{a.Upstream, a.Reason, b.Upstream, b.Reason})
	r.Done(a.Ticket, Outcome{})
	r.Done(a.Ticket, Outcome{}) // twice: ignored
	assert.Equal(t, 0, r.States()[0].InFlight)
}

func TestRefusedInputs(t *testing.T) {
	_, err := New(Config{}, 0)
	assert.Error(t, err)
	_, err = New(Config{Policy: 7}, 1)
	assert.Error(t, err)
	_, err = New(Config{Window: -1}, 1)
	assert.Error(t, err)
	r := newRouter(t, 1, Config{}, newClock())
	_, err = r.Choose(Request{Prompt: -1, Candidates: []Candidate{{}}})
	assert.Error(t, err)
	for _, name := range []string{"cache-aware", "round-robin", "least-loaded"} {
		p, err := ParsePolicy(name)
		require.NoError(t, err)
		assert.Equal(t, name, p.String())
	}
	_, err = ParsePolicy("random")
	assert.Error(t, err)
}
