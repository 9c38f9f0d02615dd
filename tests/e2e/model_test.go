package e2e

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/testenv"
)

// A stock llama-server loads the generated tiny model and serves it: the
// byte-level BPE vocabulary tokenizes and detokenizes, and a greedy
// completion of a token-id prompt gives the same tokens on both slots.
func TestStockServerServesTheModel(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	s := testenv.StartLlama(t, "stock", testenv.StockServer(t), testenv.ServerArgs(model, 4096, 2, "on"))
	var tok struct {
		Tokens []int32 `json:"tokens"`
	}
	// "banana" is 6 bytes; the tiny vocabulary merges "a n" (its merges all
	// start with 'a'), so BPE must give b, an, an, a.
	testenv.Post(t, s.URL+"/tokenize", map[string]any{"content": "banana"}, &tok)
	require.Len(t, tok.Tokens, 4, "/tokenize banana: %v", tok.Tokens)
	var text struct {
		Content string `json:"content"`
	}
	testenv.Post(t, s.URL+"/detokenize", map[string]any{"tokens": tok.Tokens}, &text)
	assert.Equal(t, "banana", text.Content)

	prompt := testenv.Tokens(40, 7, 3)
	var out [2]testenv.Completion
	for slot := range out {
		out[slot] = s.Complete(t, testenv.Request{Prompt: prompt, Slot: slot, NPredict: 8})
		require.NotEmpty(t, out[slot].Tokens, "slot %d", slot)
		assert.Equal(t, 40, out[slot].Timings.PromptN+out[slot].Timings.CacheN, "slot %d timings", slot)
	}
	assert.Equal(t, out[0].Tokens, out[1].Tokens, "greedy output differs between slots")
	var props struct {
		ModelPath string `json:"model_path"`
	}
	require.NoError(t, jsonGet(t, s.URL+"/props", &props))
	assert.Equal(t, model, props.ModelPath)
}
