package e2e

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// loraServer runs a llama-server that loads adapter with scale 0 by
// default (--lora-init-without-apply only defers applying it in v0.5.0;
// POST /lora-adapters sets the server-wide scale), so that requests are
// the base model's unless they name the adapter.
func loraServer(t *testing.T, name, bin, model, adapter string, extra ...string) *testenv.Llama {
	args := append(testenv.ServerArgs(model, 4096, 1, "on"), "--lora", adapter, "--lora-init-without-apply")
	s := testenv.StartLlama(t, name, bin, append(args, extra...))
	testenv.Post(t, s.URL+"/lora-adapters", []map[string]any{{"id": 0, "scale": 0}}, nil)
	return s
}

var withLoRA = map[string]any{"lora": []map[string]any{{"id": 0, "scale": 1}}}

// A request with a LoRA adapter, then one without on the same slot:
// llama-server keeps the slot's cells across the change, so the base
// request would reuse KV computed under the adapter. The patched server
// recomputes it instead and publishes only KV computed under each
// request's own scope: a second server restoring the base prefix answers
// as a stock server's base model does, and one restoring the adapted
// prefix as the adapted model does.
func TestLoRAThenBase(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	adapter := testenv.LoRA(t, "tiny", 8, 3)
	base1 := testenv.Cat(prefix, testenv.Tokens(40, 5, 11))
	base2 := testenv.Cat(prefix, testenv.Tokens(40, 3, 17))
	adapted2 := testenv.Cat(prefix, testenv.Tokens(40, 9, 21))
	fresh := map[string]any{"cache_prompt": false}

	ref := loraServer(t, "stock", testenv.StockServer(t), model, adapter)
	wantBase1 := ref.Complete(t, testenv.Request{Prompt: base1, Slot: 0, NPredict: nPredict, Extra: fresh})
	wantBase2 := ref.Complete(t, testenv.Request{Prompt: base2, Slot: 0, NPredict: nPredict, Extra: fresh})
	wantAdapted2 := ref.Complete(t, testenv.Request{Prompt: adapted2, Slot: 0, NPredict: nPredict,
		Extra: map[string]any{"cache_prompt": false, "lora": withLoRA["lora"]}})
	require.NotEqual(t, wantBase2.Tokens, wantAdapted2.Tokens, "the adapter must change the greedy output, or this test proves nothing")
	// What stock does with the same sequence: the base request runs on the
	// adapter's cells (informational: it is llama.cpp's behaviour).
	ref.Complete(t, testenv.Request{Prompt: promptA, Slot: 0, NPredict: nPredict, Extra: withLoRA})
	stockBase := ref.Complete(t, testenv.Request{Prompt: base1, Slot: 0, NPredict: nPredict})
	t.Logf("stock, base after LoRA on one slot: cache_n %d, same tokens as a fresh base request: %v",
		stockBase.Timings.CacheN, testenv.JSON(stockBase.Tokens) == testenv.JSON(wantBase1.Tokens))

	etcd := etcdtest.Start(t)
	cfg := bridgeConfig(`, "directory": {"kind": "etcd", "endpoints": ["` + etcd.Endpoint() + `"]}, "transport": {"kind": "mooncake", "lib": "` + mockTE + `"}`)
	a := loraServer(t, "a", testenv.PatchedServer(t), model, adapter, "--mcb-config", cfg)
	adapted := a.Complete(t, testenv.Request{Prompt: promptA, Slot: 0, NPredict: nPredict, Extra: withLoRA})
	assert.Equal(t, "miss", adapted.MCB.Decision, "the adapted request computes")
	base := a.Complete(t, testenv.Request{Prompt: base1, Slot: 0, NPredict: nPredict})
	assert.Zero(t, base.Timings.CacheN, "the base request does not reuse the adapter's cells: %+v", base.Timings)
	assert.Equal(t, wantBase1.Tokens, base.Tokens, "the base request after the adapted one answers as the base model")
	waitMirrored(t, a.URL, 2*shared/block) // the prefix under each scope

	b := loraServer(t, "b", testenv.PatchedServer(t), model, adapter, "--mcb-config", cfg)
	waitMirrored(t, b.URL, 2*shared/block)
	reqBase2 := testenv.Request{Prompt: base2, Slot: 0, NPredict: nPredict}
	got := b.Complete(t, reqBase2)
	assert.Equal(t, []any{"restore", shared}, []any{got.MCB.Decision, got.MCB.RestoredN}, "b restores the base prefix: %+v", got.MCB)
	assert.Equal(t, testenv.StockFrom(t, ref.URL, reqBase2, got.Timings.CacheN).Tokens, got.Tokens, "b's base answer is the stock server's base-model answer")
	reqAdapted2 := testenv.Request{Prompt: adapted2, Slot: 0, NPredict: nPredict, Extra: withLoRA}
	got = b.Complete(t, reqAdapted2)
	assert.Equal(t, []any{"restore", shared}, []any{got.MCB.Decision, got.MCB.RestoredN}, "b restores the adapted prefix: %+v", got.MCB)
	assert.Equal(t, testenv.StockFrom(t, ref.URL, reqAdapted2, got.Timings.CacheN).Tokens, got.Tokens, "b's adapted answer is the stock server's adapted answer")
}
