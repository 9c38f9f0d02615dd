package e2e

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/testenv"
)

// What llama-server's own API promises stays as stock has it with the bridge on:
// "timings" holds numbers only (the bridge reports in "mcbridge"), KV llama.cpp loads
// into a slot itself keeps the scope it was saved under, and /metrics does not change
// while the server sleeps. llama.cpp's own suite checks the same against stock
// (tests/llamasuite); these check what it cannot see: another tenant never reuses
// the loaded KV, and the bridge's state outlives sleep.

func TestSlotFileKeepsItsScope(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	dir := t.TempDir()
	s := testenv.StartLlama(t, "patched", testenv.PatchedServer(t),
		append(testenv.ServerArgs(model, 4096, 2, "on"), "--mcb-config", bridgeConfig(""), "--slot-save-path", dir))
	require.Equal(t, "on", s.BridgeState())
	ref := testenv.StartLlama(t, "stock", testenv.StockServer(t), testenv.ServerArgs(model, 4096, 2, "on"))
	prefix := testenv.Tokens(300, 7, 5)
	prompt := testenv.Cat(prefix, testenv.Tokens(20, 3, 1))

	s.Complete(t, testenv.Request{Prompt: prefix, Slot: 0, NPredict: 1})
	testenv.Post(t, s.URL+"/slots/0?action=save", map[string]string{"filename": "p.bin"}, nil)
	restore := func() { testenv.Post(t, s.URL+"/slots/1?action=restore", map[string]string{"filename": "p.bin"}, nil) }

	restore()
	got := s.Complete(t, testenv.Request{Prompt: prompt, Slot: 1, NPredict: nPredict})
	assert.GreaterOrEqual(t, got.Timings.CacheN, len(prefix), "the restored file's KV is the slot's own: %+v %+v", got.Timings, got.MCB)
	assert.Equal(t, "local", got.MCB.Decision, "%+v", got.MCB)
	assertStock(t, ref.URL, prompt, got, "the answer is stock's")

	restore()
	got = s.Complete(t, testenv.Request{Prompt: prompt, Slot: 1, NPredict: nPredict, Extra: map[string]any{"mcb_tenant": "other"}})
	assert.Zero(t, got.Timings.CacheN, "another tenant does not reuse the restored KV: %+v %+v", got.Timings, got.MCB)
	assert.Equal(t, "the slot's cells were computed under another scope", got.MCB.Reason, "%+v", got.MCB)
	assertStock(t, ref.URL, prompt, got, "the answer is stock's")
}

func TestSleepKeepsBridgeAndMetrics(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	s := testenv.StartLlama(t, "patched", testenv.PatchedServer(t),
		append(testenv.ServerArgs(model, 4096, 2, "on"), "--mcb-config", bridgeConfig(""), "--sleep-idle-seconds", "1"))
	require.Equal(t, "on", s.BridgeState())
	prefix := testenv.Tokens(300, 7, 5)
	first := s.Complete(t, testenv.Request{Prompt: testenv.Cat(prefix, testenv.Tokens(4, 1, 1)), Slot: 0, NPredict: 1})
	require.Positive(t, first.MCB.SavedBlocks, "the prefix is saved: %+v", first.MCB)

	sleeping := func() bool {
		var props struct {
			Sleeping bool `json:"is_sleeping"`
		}
		require.NoError(t, json.Unmarshal(testenv.Get(t, s.URL+"/props"), &props))
		return props.Sleeping
	}
	testenv.Get(t, s.URL+"/metrics") // the first scrape resets llama-server's throughput window
	awake := string(testenv.Get(t, s.URL+"/metrics"))
	require.Contains(t, awake, "mcbridge_up 1")
	testenv.Eventually(t, defaultWait, sleeping, "the server sleeps")
	assert.Equal(t, awake, string(testenv.Get(t, s.URL+"/metrics")), "/metrics while asleep")

	got := s.Complete(t, testenv.Request{Prompt: testenv.Cat(prefix, testenv.Tokens(4, 3, 9)), Slot: 1, NPredict: 1})
	assert.False(t, sleeping(), "a completion wakes the server")
	assert.Equal(t, []any{"restore", len(prefix) / 64 * 64}, []any{got.MCB.Decision, got.MCB.RestoredN},
		"after waking, the bridge still holds the blocks saved before sleep: %+v", got.MCB)
	assert.Equal(t, 1.0, testenv.Metrics(t, s.URL+"/metrics")["mcbridge_up"], "the bridge serves the woken server")
}
