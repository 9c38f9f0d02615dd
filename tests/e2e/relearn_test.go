package e2e

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/testenv"
)

// The proxy verifies before it relies on what a slot holds. Between two
// requests on slot 0 the stock server behind it changes: it is restarted
// on the same port, slot 0 is erased through the server's own API, or
// another client runs a prompt in slot 0 directly. Each time the second
// request is restored from the bridge, and its greedy answer is a stock
// server's. With nothing in between, the slot's own prefix serves and
// nothing is restored.
func TestProxyRelearns(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	ref := testenv.StartLlama(t, "ref", testenv.StockServer(t), testenv.ServerArgs(model, 4096, 2, "on"))
	first := testenv.Request{Prompt: promptA, Slot: 0, NPredict: nPredict}
	second := testenv.Request{Prompt: promptB, Slot: 0, NPredict: nPredict}
	for _, tc := range []struct {
		name     string
		between  func(t *testing.T, s *testenv.Llama, dir string) *testenv.Llama
		restored int
		metric   string // the series that counts what the proxy noticed (%s: the server's URL)
	}{
		{"nothing", func(_ *testing.T, s *testenv.Llama, _ string) *testenv.Llama { return s }, 0, ""},
		{"restart", func(t *testing.T, s *testenv.Llama, dir string) *testenv.Llama {
			s.Stop()
			return stockUpstream(t, "stock-again", model, 2, dir, s.Port)
		}, shared, `mcproxy_upstream_restarts_total{upstream="%s"}`},
		{"erase", func(t *testing.T, s *testenv.Llama, _ string) *testenv.Llama {
			testenv.Post(t, s.URL+"/slots/0?action=erase", map[string]any{}, nil)
			return s
		}, shared, `mcproxy_slots_unconfirmed_total{why="tokens"}`},
		{"direct client", func(t *testing.T, s *testenv.Llama, _ string) *testenv.Llama {
			s.Complete(t, testenv.Request{Prompt: testenv.Tokens(300, 9, 50), Slot: 0, NPredict: nPredict})
			return s
		}, shared, `mcproxy_slots_unconfirmed_total{why="task"}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := testenv.SlotDir(t, "stock")
			s := stockUpstream(t, "stock", model, 2, dir, 0)
			p := testenv.StartProxy(t, "proxy", s.URL, dir, routeConfig)
			a := postThrough(t, p.URL, "/completion", completionBody(first))
			require.Equal(t, 200, a.code, "%s", a.body)
			waitMirrored(t, p.URL, shared/block)

			s = tc.between(t, s, dir)
			a = postThrough(t, p.URL, "/completion", completionBody(second))
			require.Equal(t, 200, a.code, "%s", a.body)
			assert.Equal(t, tc.restored, a.MCB.RestoredN, "restored: %+v", a.MCB)
			if tc.restored == 0 {
				assert.GreaterOrEqual(t, a.Timings.CacheN, len(prefix), "the slot's own prefix serves: %+v", a.Timings)
			} else {
				assert.Equal(t, shared, a.Timings.CacheN, "the server computes only the rest: %+v", a.Timings)
			}
			assertStock(t, ref.URL, promptB, a.Completion, "the answer is a stock server's")
			if tc.metric != "" {
				name := strings.ReplaceAll(tc.metric, "%s", s.URL)
				assert.Equal(t, float64(1), testenv.Metrics(t, p.URL+"/metrics")[name], "%s", name)
			}
		})
	}
}
