package e2e

import (
	"fmt"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/gguf"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// specModel is the model of the comparisons with a draft: llama-dense,
// drafting for itself (one vocabulary; the draft's greedy guesses are then
// mostly the target's, so every answer is drafted).
func specModel(tb testing.TB) string {
	return filepath.Join(testenv.ArchModels(tb), "llama-dense.gguf")
}

// specArgs are a comparison's llama-server arguments with the draft model:
// v0.5.0 loads no draft for a plain model unless draft-simple is named.
func specArgs(tb testing.TB) archSetup {
	return setupArch(tb, specModel(tb), []string{"-md", specModel(tb), "--spec-type", "draft-simple"})
}

func specConfig(etcd, prefix string) string {
	return fmt.Sprintf(`{"block_tokens": %d, "arbiter": {"policy": "always-restore"}, "directory": {"kind": "etcd", "endpoints": [%q], "prefix": %q}, "transport": {"kind": "mooncake", "lib": %q}}`,
		block, etcd, prefix, mockTE)
}

// Speculative decoding with a draft model: llama-server decodes each
// prompt batch into the draft's own context as well
// (common_speculative_process), so a restore into the target must bring
// the draft the restored prefix too. The patched server shares the
// draft's KV under its own model: a second patched process restores what
// a holder computed into both contexts, once into a fresh slot and once
// into a slot holding another prompt's cells past 100 shared tokens; a
// third, whose draft keeps its KV in another type (no holder has its
// blocks), restores the target and has its draft compute the prefix while
// the target's load runs. Each answers as a stock server with the same
// draft in the same cache state: the same tokens, and as many tokens
// drafted and accepted (a draft missing the prefix, or holding the other
// prompt's cells, guesses otherwise).
func TestSpeculativeDraft(t *testing.T) {
	su := specArgs(t)
	ref := testenv.StartLlama(t, "stock", testenv.StockServer(t), su.args)
	etcd := etcdtest.Start(t)
	args := append(slices.Clone(su.args), "--mcb-config", specConfig(etcd.Endpoint(), "/spec"))
	x := testenv.StartLlama(t, "x", testenv.PatchedServer(t), args)
	require.Equal(t, "on", x.BridgeState())
	assert.Contains(t, x.LogLine("mcbridge: on: "), "restores its own blocks beside the target's, or computes them")
	y := testenv.StartLlama(t, "y", testenv.PatchedServer(t), args)
	x.Complete(t, testenv.Request{Prompt: su.promptA, Slot: 0, NPredict: nPredict})
	waitMirrored(t, y.URL, su.shared/block)

	other := testenv.Cat(su.promptB[:100], archTokens(60, 5, 1))
	require.NotEqual(t, su.promptB[100], other[100])
	// The draft's KV in q8_0: another model for the bridge, whose blocks
	// nobody published.
	otherDraft := append(slices.Clone(su.args), "-ctkd", "q8_0", "-ctvd", "q8_0")
	refOther := testenv.StartLlama(t, "stock-q8-draft", testenv.StockServer(t), otherDraft)
	z := testenv.StartLlama(t, "z", testenv.PatchedServer(t), append(slices.Clone(otherDraft), "--mcb-config", specConfig(etcd.Endpoint(), "/spec")))
	cases := []struct {
		name  string
		srv   *testenv.Llama
		ref   *testenv.Llama
		slot  int
		first []int32 // what the slot computes before prefix+B
		own   int     // the tokens of prefix+B its cells hold then
		// what the draft's context restored and computed of the prefix
		draftRestored, draftComputed int
	}{
		{"fresh slot", y, ref, 1, nil, 0, su.shared, 0},
		{"slot of another prompt", y, ref, 0, other, 100, su.shared, 0},
		{"draft without blocks", z, refOther, 0, other, 100, 0, su.shared - 100},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if c.first != nil {
				c.srv.Complete(t, testenv.Request{Prompt: c.first, Slot: c.slot, NPredict: 1})
			}
			req := testenv.Request{Prompt: su.promptB, Slot: c.slot, NPredict: nPredict}
			got := c.srv.Complete(t, req)
			assert.Equal(t, []any{"restore", su.shared, c.draftRestored, c.draftComputed},
				[]any{got.MCB.Decision, got.MCB.RestoredN, got.MCB.DraftRestoredN, got.MCB.DraftPrefilledN},
				"the target restores the shared blocks, the draft restores or computes them: %+v", got.MCB)
			want := testenv.StockFrom(t, c.ref.URL, req, got.Timings.CacheN)
			require.Positive(t, want.Timings.DraftN, "stock drafts, or this test proves nothing")
			assert.Equal(t, want.Tokens, got.Tokens, "the tokens of stock with the same draft (cache_n %d)", got.Timings.CacheN)
			assert.Equal(t, []int{want.Timings.DraftN, want.Timings.DraftAccepted}, []int{got.Timings.DraftN, got.Timings.DraftAccepted},
				"drafted and accepted as stock's")
			t.Logf("cache_n %d, drafted %d, accepted %d; restore %.1f ms, the draft restoring %d tokens and computing %d in %.1f ms",
				got.Timings.CacheN, got.Timings.DraftN, got.Timings.DraftAccepted, got.MCB.RestoreMS, got.MCB.DraftRestoredN,
				got.MCB.DraftPrefilledN, got.MCB.DraftPrefillMS)
		})
	}
}

// TTFT with a draft model (client wall clock of a 1-token completion of
// 2048 shared tokens and 48 of its own, each server alone): the patched
// server restoring both contexts (the holder published the draft's blocks
// beside the target's), the patched server restoring the target while the
// same draft computes the prefix (from a holder that ran without the draft,
// whose target blocks are the same model's), the floor of both (the patched server without a draft
// restoring the same prefix), stock computing the prompt into both
// contexts, stock without the draft (the draft's prefill is the
// difference), and the patched server finding nothing (its overhead). The
// target is the bench preset, the draft a 2-layer, n_embd 256 model of the
// same vocabulary, the size ratio of a real pair. Run with
// `go test -run '^$' -bench SpeculativeTTFT -benchtime 4x ./tests/e2e/`.
func BenchmarkSpeculativeTTFT(b *testing.B) {
	model := testenv.Model(b, "bench", 0)
	dcfg := gguf.Presets["bench"]
	dcfg.Name, dcfg.EmbeddingLength, dcfg.BlockCount, dcfg.FeedForwardLength, dcfg.HeadCount, dcfg.HeadCountKV =
		"mcbridge-bench-draft", 256, 2, 512, 4, 2
	draft := filepath.Join(b.TempDir(), "draft.gguf")
	require.NoError(b, gguf.WriteFile(draft, dcfg))
	noDraft := testenv.ServerArgs(model, 8192, 2, "on")
	withDraft := append(slices.Clone(noDraft), "-md", draft, "--spec-type", "draft-simple")
	prefix := testenv.Tokens(2048, 7, 3)
	promptA := testenv.Cat(prefix, testenv.Tokens(40, 11, 5))
	promptB := testenv.Cat(prefix, testenv.Tokens(48, 13, 9))
	etcd := etcdtest.Start(b)
	stock := testenv.StartLlama(b, "stock", testenv.StockServer(b), withDraft)
	stockNoDraft := testenv.StartLlama(b, "stock-nodraft", testenv.StockServer(b), noDraft)
	holder := testenv.StartLlama(b, "x", testenv.PatchedServer(b), append(slices.Clone(withDraft), "--mcb-config", specConfig(etcd.Endpoint(), "/bench")))
	miss := testenv.StartLlama(b, "miss", testenv.PatchedServer(b), append(slices.Clone(withDraft), "--mcb-config", specConfig(etcd.Endpoint(), "/empty")))
	holder.Complete(b, testenv.Request{Prompt: promptA, Slot: 0, NPredict: 1})
	targetOnly := testenv.StartLlama(b, "x-nodraft", testenv.PatchedServer(b), append(slices.Clone(noDraft), "--mcb-config", specConfig(etcd.Endpoint(), "/bench-target")))
	targetOnly.Complete(b, testenv.Request{Prompt: promptA, Slot: 0, NPredict: 1})
	fresh := map[string]any{"cache_prompt": false}
	ttft := func(url string, r testenv.Request) float64 {
		t0 := time.Now()
		testenv.Complete(b, url, r)
		return float64(time.Since(t0).Microseconds()) / 1000
	}
	var sums [6]float64
	var restoreMS, draftMS float64
	for i := 0; i < b.N; i++ {
		// New patched processes each time, with each draft and without one:
		// their first prefix+B restores.
		y := testenv.StartLlama(b, "y", testenv.PatchedServer(b), append(slices.Clone(withDraft), "--mcb-config", specConfig(etcd.Endpoint(), "/bench")))
		w := testenv.StartLlama(b, "w", testenv.PatchedServer(b), append(slices.Clone(withDraft), "--mcb-config", specConfig(etcd.Endpoint(), "/bench-target")))
		z := testenv.StartLlama(b, "z", testenv.PatchedServer(b), append(slices.Clone(noDraft), "--mcb-config", specConfig(etcd.Endpoint(), "/bench")))
		for _, s := range []*testenv.Llama{y, w, z} {
			waitMirrored(b, s.URL, len(prefix)/block)
			// Its first decode (the model's pages, the graphs) on another slot
			// and prompt: the others have long been warm.
			s.Complete(b, testenv.Request{Prompt: testenv.Tokens(16, 5, 200), Slot: 1, NPredict: 1})
		}
		// In turn first: the machine's load drifts.
		runs := []func(){
			func() {
				t0 := time.Now()
				got := y.Complete(b, testenv.Request{Prompt: promptB, Slot: 0, NPredict: 1})
				sums[0] += float64(time.Since(t0).Microseconds()) / 1000
				require.Equal(b, []int{len(prefix), len(prefix)}, []int{got.MCB.RestoredN, got.MCB.DraftRestoredN}, "%+v", got.MCB)
			},
			func() {
				t0 := time.Now()
				got := w.Complete(b, testenv.Request{Prompt: promptB, Slot: 0, NPredict: 1})
				sums[5] += float64(time.Since(t0).Microseconds()) / 1000
				require.Equal(b, []int{len(prefix), len(prefix)}, []int{got.MCB.RestoredN, got.MCB.DraftPrefilledN}, "%+v", got.MCB)
				restoreMS += got.MCB.RestoreMS
				draftMS += got.MCB.DraftPrefillMS
			},
			func() {
				sums[1] += ttft(stock.URL, testenv.Request{Prompt: promptB, Slot: 0, NPredict: 1, Extra: fresh})
			},
			func() {
				sums[2] += ttft(stockNoDraft.URL, testenv.Request{Prompt: promptB, Slot: 0, NPredict: 1, Extra: fresh})
			},
			func() {
				sums[3] += ttft(miss.URL, testenv.Request{Prompt: promptB, Slot: 0, NPredict: 1, Extra: fresh})
			},
			func() {
				t0 := time.Now()
				got := z.Complete(b, testenv.Request{Prompt: promptB, Slot: 0, NPredict: 1})
				sums[4] += float64(time.Since(t0).Microseconds()) / 1000
				require.Equal(b, len(prefix), got.MCB.RestoredN, "%+v", got.MCB)
			},
		}
		for j := range runs {
			runs[(i+j)%len(runs)]()
		}
		y.Stop()
		w.Stop()
		z.Stop()
	}
	n := float64(b.N)
	b.ReportMetric(sums[0]/n, "ttft-restore-both-ms")
	b.ReportMetric(sums[5]/n, "ttft-draft-computes-ms")
	b.ReportMetric(restoreMS/n, "draft-computes-restore-ms")
	b.ReportMetric(draftMS/n, "draft-prefill-ms")
	b.ReportMetric(sums[1]/n, "ttft-stock-ms")
	b.ReportMetric(sums[2]/n, "ttft-stock-nodraft-ms")
	b.ReportMetric(sums[3]/n, "ttft-miss-ms")
	b.ReportMetric(sums[4]/n, "ttft-restore-nodraft-ms")
	b.Logf("restoring both contexts: TTFT %.1f ms; the draft computing: %.1f ms; the floor (the target's restore without a draft) %.1f ms; stock with the draft %.1f ms",
		sums[0]/n, sums[5]/n, sums[4]/n, sums[1]/n)
}
