package proxy

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseRequest(t *testing.T) {
	tests := []struct {
		name   string
		ep     endpoint
		body   string
		err    bool
		prompt string  // the single prompt, "" for none
		tokens []int32 // its tokens when it is ids only
		stream bool
		slot   int
		cache  bool
		dirty  bool
		multi  bool
	}{
		{"token ids", completion, `{"prompt":[1,2,3],"stream":true,"id_slot":1}`, false, `[1,2,3]`, []int32{1, 2, 3}, true, 1, true, false, false},
		{"string", completion, `{"prompt":"hello","cache_prompt":false}`, false, `"hello"`, nil, false, -1, false, false, false},
		{"mixed", completion, `{"prompt":["a",5,"b"]}`, false, `["a",5,"b"]`, nil, false, -1, true, false, false},
		{"one prompt in a list", completion, `{"prompt":[[7,8]]}`, false, `[7,8]`, []int32{7, 8}, false, -1, true, false, false},
		{"several prompts", completion, `{"prompt":["a","b"]}`, false, "", nil, false, -1, true, false, false},
		{"lists of ids", completion, `{"prompt":[[1],[2]]}`, false, "", nil, false, -1, true, false, false},
		{"multimodal object", completion, `{"prompt":{"prompt_string":"x"}}`, false, "", nil, false, -1, true, false, false},
		{"id out of int32", completion, `{"prompt":[3000000000]}`, false, "", nil, false, -1, true, false, false},
		{"fractional id", completion, `{"prompt":[1.5]}`, false, "", nil, false, -1, true, false, false},
		{"any slot", completion, `{"prompt":[1],"id_slot":-1}`, false, `[1]`, []int32{1}, false, -1, true, false, false},
		{"cache reuse", completion, `{"prompt":[1],"n_cache_reuse":256}`, false, `[1]`, []int32{1}, false, -1, true, true, false},
		{"cache reuse off", completion, `{"prompt":[1],"n_cache_reuse":0}`, false, `[1]`, []int32{1}, false, -1, true, false, false},
		{"lora", completion, `{"prompt":[1],"lora":[{"id":0,"scale":1}]}`, false, `[1]`, []int32{1}, false, -1, true, true, false},
		{"no lora", completion, `{"prompt":[1],"lora":[]}`, false, `[1]`, []int32{1}, false, -1, true, false, false},
		{"n_cmpl", completion, `{"prompt":[1],"n_cmpl":2}`, false, `[1]`, []int32{1}, false, -1, true, false, true},
		{"n", completion, `{"prompt":[1],"n":3}`, false, `[1]`, []int32{1}, false, -1, true, false, true},
		{"chat", chat, `{"messages":[{"role":"user","content":"hi"}],"stream":true}`, false, "", nil, true, -1, true, false, false},
		{"not an object", completion, `[1,2]`, true, "", nil, false, -1, true, false, false},
		{"null", completion, `null`, true, "", nil, false, -1, true, false, false},
		{"broken", completion, `{"prompt":`, true, "", nil, false, -1, true, false, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r, err := parseRequest(tc.ep, []byte(tc.body))
			if tc.err {
				require.Error(t, err, "parsed %q", tc.body)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.prompt, string(r.prompt), "prompt")
			assert.Equal(t, tc.tokens, r.tokens, "tokens")
			assert.Equal(t, tc.stream, r.stream, "stream")
			assert.Equal(t, tc.slot, r.idSlot, "slot")
			assert.Equal(t, tc.cache, r.cachePrompt, "cache")
			assert.Equal(t, tc.dirty, r.dirty, "dirty")
			assert.Equal(t, tc.multi, r.multi, "multi")
		})
	}
}

func TestPinnedKeepsTheRestOfTheBody(t *testing.T) {
	body := `{"prompt":"<a> & b","id_slot":0,"n_predict":3,"x":{"y":[1,2.50]}}`
	r, err := parseRequest(completion, []byte(body))
	require.NoError(t, err)
	out, err := r.pinned(3)
	require.NoError(t, err)
	var got, want map[string]any
	require.NoError(t, json.Unmarshal(out, &got))
	_ = json.Unmarshal([]byte(body), &want)
	want["id_slot"] = float64(3)
	require.Equal(t, want, got, "pinned body %s", out)
	assert.True(t, json.Valid(out), "pinned body %s", out)
	assert.Contains(t, string(out), `"<a> & b"`, "the prompt's bytes changed")
}

// A /v1/messages request is read as the chat the server converts it into:
// the fields the conversion drops (a slot, lora) do nothing, and the
// pinned body is that chat with its slot and the fields its answer is
// written back from.
func TestParseMessagesRequest(t *testing.T) {
	body := `{"model":"m","system":"be brief","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"stream":true,` +
		`"id_slot":3,"lora":[{"id":0,"scale":1}],"tools":[{"name":"f","input_schema":{"type":"object"}}]}`
	r, err := parseRequest(messages, []byte(body))
	require.NoError(t, err)
	assert.True(t, r.asChat)
	assert.Equal(t, messages, r.ep)
	assert.True(t, r.stream)
	assert.Equal(t, -1, r.idSlot, "the server's conversion drops id_slot")
	assert.False(t, r.dirty, "and lora")
	assert.Equal(t, 5, r.predict)
	out, err := r.pinned(1)
	require.NoError(t, err)
	var m map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(out, &m))
	chatBody, err := messagesToChat([]byte(body))
	require.NoError(t, err)
	var want map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(chatBody, &want))
	want["id_slot"], want["verbose"], want["timings_per_token"] = json.RawMessage("1"), json.RawMessage("true"), json.RawMessage("true")
	assert.Equal(t, want, m)

	_, err = parseRequest(messages, []byte(`{"system":"no messages"}`))
	assert.Error(t, err, "the server refuses it too")
}
