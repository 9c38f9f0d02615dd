package proxy

import (
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The expected answers below are what llama-server v0.5.0 writes for the
// same results (server-task.cpp: to_json_anthropic, to_json_anthropic_stream
// and the partial result's to_json_anthropic); tests/e2e's
// TestProxyAgentAPICompat checks them against the real server.

func TestChatToMessages(t *testing.T) {
	for _, tc := range []struct {
		name, chat, want string
	}{
		{
			name: "thinking, text and tool calls",
			chat: `{"choices":[{"finish_reason":"tool_calls","index":0,"message":{"role":"assistant","content":"Hi <b>\u0001","reasoning_content":"hm",` +
				`"tool_calls":[{"type":"function","function":{"name":"read","arguments":"{\"p\": 1.50, \"q\":[true], \"p\": 2}"},"id":"t1"},` +
				`{"type":"function","function":{"name":"bad","arguments":"{oops"}}]}}],"created":1,"model":"m","system_fingerprint":"b",` +
				`"object":"chat.completion","usage":{"completion_tokens":7,"prompt_tokens":15,"total_tokens":22,"prompt_tokens_details":{"cached_tokens":10}},` +
				`"id":"chatcmpl-X","__verbose":{"stopping_word":""},"timings":{"cache_n":10}}`,
			want: `{"id":"chatcmpl-X","type":"message","role":"assistant","content":[{"type":"thinking","thinking":"hm","signature":""},` +
				`{"type":"text","text":"Hi <b>\u0001"},{"type":"tool_use","id":"t1","name":"read","input":{"p":2,"q":[true]}},` +
				`{"type":"tool_use","id":"","name":"bad","input":{}}],"model":"m","stop_reason":"tool_use","stop_sequence":null,` +
				`"usage":{"cache_read_input_tokens":10,"input_tokens":5,"output_tokens":7}}`,
		},
		{
			name: "a stop word",
			chat: `{"choices":[{"finish_reason":"stop","index":0,"message":{"role":"assistant","content":"a"}}],"model":"m",` +
				`"usage":{"completion_tokens":2,"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":0}},"id":"c","__verbose":{"stopping_word":"\n\n"}}`,
			want: `{"id":"c","type":"message","role":"assistant","content":[{"type":"text","text":"a"}],"model":"m","stop_reason":"end_turn",` +
				`"stop_sequence":"\n\n","usage":{"cache_read_input_tokens":0,"input_tokens":3,"output_tokens":2}}`,
		},
		{
			name: "the limit, nothing said",
			chat: `{"choices":[{"finish_reason":"length","index":0,"message":{"role":"assistant","content":""}}],"model":"m",` +
				`"usage":{"completion_tokens":4,"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":8}},"id":"c"}`,
			want: `{"id":"c","type":"message","role":"assistant","content":[],"model":"m","stop_reason":"max_tokens",` +
				`"stop_sequence":null,"usage":{"cache_read_input_tokens":8,"input_tokens":1,"output_tokens":4}}`,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := chatToMessages([]byte(tc.chat))
			require.NoError(t, err)
			assert.Equal(t, tc.want, string(got))
		})
	}
	for _, bad := range []string{`[]`, `{"choices":[]}`, `{"choices":[{"message":{}}]}`, `{"choices":[1]}`} {
		_, err := chatToMessages([]byte(bad))
		assert.Error(t, err, bad)
	}
}

// chatStream is a streamed chat answer as llama-server writes it with
// timings_per_token and verbose: the first token's result (its opening
// delta), then reasoning, text, a tool call over two results, and the final
// result, whose own diff completes the call.
var chatStream = strings.Join([]string{
	`data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"created":1,"id":"chatcmpl-X","model":"m","object":"chat.completion.chunk","timings":{"cache_n":10,"prompt_n":5,"predicted_n":1}}`,
	`data: {"choices":[{"finish_reason":null,"index":0,"delta":{"reasoning_content":"hm"}}],"created":1,"id":"chatcmpl-X","model":"m","object":"chat.completion.chunk","timings":{"cache_n":10,"prompt_n":5,"predicted_n":2}}`,
	`:`,
	`data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"Hi"}}],"created":1,"id":"chatcmpl-X","model":"m","object":"chat.completion.chunk","timings":{"cache_n":10,"prompt_n":5,"predicted_n":3}}`,
	`data: {"choices":[{"finish_reason":null,"index":0,"delta":{"tool_calls":[{"index":0,"id":"t1","type":"function","function":{"name":"read"}}]}}],"created":1,"id":"chatcmpl-X","model":"m","object":"chat.completion.chunk"}`,
	`data: {"choices":[{"finish_reason":null,"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"p\":"}}]}}],"created":1,"id":"chatcmpl-X","model":"m","object":"chat.completion.chunk","timings":{"cache_n":10,"prompt_n":5,"predicted_n":5}}`,
	`data: {"choices":[{"finish_reason":null,"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"1}"}}]}}],"created":1,"id":"chatcmpl-X","model":"m","object":"chat.completion.chunk","__verbose":{"stopping_word":""}}`,
	`data: {"choices":[{"finish_reason":"tool_calls","index":0,"delta":{}}],"created":1,"id":"chatcmpl-X","model":"m","object":"chat.completion.chunk","timings":{"cache_n":10,"prompt_n":5,"predicted_n":7}}`,
	`data: [DONE]`,
}, "\n\n") + "\n\n"

var messagesEvents = []string{
	`message_start`, `{"type":"message_start","message":{"id":"chatcmpl-X","type":"message","role":"assistant","content":[],"model":"m","stop_reason":null,"stop_sequence":null,"usage":{"cache_read_input_tokens":10,"input_tokens":5,"output_tokens":0}}}`,
	`content_block_start`, `{"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":""}}`,
	`content_block_delta`, `{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"hm"}}`,
	`:`, ``,
	`content_block_start`, `{"type":"content_block_start","index":1,"content_block":{"type":"text","text":""}}`,
	`content_block_delta`, `{"type":"content_block_delta","index":1,"delta":{"type":"text_delta","text":"Hi"}}`,
	`content_block_start`, `{"type":"content_block_start","index":2,"content_block":{"type":"tool_use","id":"t1","name":"read"}}`,
	`content_block_delta`, `{"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"{\"p\":"}}`,
	// The final result starts its blocks again (its own count of them).
	`content_block_start`, `{"type":"content_block_start","index":2,"content_block":{"type":"tool_use","id":"t1","name":"read"}}`,
	`content_block_delta`, `{"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"1}"}}`,
	`content_block_delta`, `{"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":""}}`,
	`content_block_stop`, `{"type":"content_block_stop","index":0}`,
	`content_block_stop`, `{"type":"content_block_stop","index":1}`,
	`content_block_stop`, `{"type":"content_block_stop","index":2}`,
	`message_delta`, `{"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":7}}`,
	`message_stop`, `{"type":"message_stop"}`,
}

func TestMessagesStream(t *testing.T) {
	var want strings.Builder
	for i := 0; i < len(messagesEvents); i += 2 {
		if messagesEvents[i] == ":" {
			want.WriteString(":\n\n")
			continue
		}
		want.WriteString("event: " + messagesEvents[i] + "\ndata: " + messagesEvents[i+1] + "\n\n")
	}
	// Read in small pieces: events do not depend on how the bytes arrive.
	got, err := io.ReadAll(io.LimitReader(&slowReader{newMessagesStream(io.NopCloser(strings.NewReader(chatStream)))}, 1<<20))
	require.NoError(t, err)
	assert.Equal(t, want.String(), string(got))
}

func TestMessagesStreamError(t *testing.T) {
	in := `data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"id":"c","model":"m","timings":{"cache_n":0,"prompt_n":3}}` +
		"\n\n" + `data: {"error":{"code":500,"message":"boom","type":"server_error"}}` + "\n\n"
	got, err := io.ReadAll(newMessagesStream(io.NopCloser(strings.NewReader(in))))
	require.NoError(t, err)
	assert.Equal(t, `event: message_start`+"\n"+`data: {"type":"message_start","message":{"id":"c","type":"message","role":"assistant","content":[],"model":"m","stop_reason":null,"stop_sequence":null,"usage":{"cache_read_input_tokens":0,"input_tokens":3,"output_tokens":0}}}`+"\n\n"+
		`event: error`+"\n"+`data: {"code":500,"message":"boom","type":"server_error"}`+"\n\n", string(got))

	_, err = io.ReadAll(newMessagesStream(io.NopCloser(strings.NewReader("data: {oops\n\n"))))
	assert.Error(t, err, "a chat stream that is not JSON")
}

// slowReader reads 7 bytes at a time.
type slowReader struct{ r io.Reader }

func (s *slowReader) Read(p []byte) (int, error) { return s.r.Read(p[:min(len(p), 7)]) }
