package proxy

import (
	"bytes"
	"encoding/json"
	"io"
	"testing"

	"github.com/stretchr/testify/require"
)

// FuzzParseRequest: parsing never panics, and a single prompt of token ids
// is exactly the ids the body lists.
func FuzzParseRequest(f *testing.F) {
	for _, s := range []string{`{"prompt":[1,2,3]}`, `{"prompt":"x","id_slot":2,"stream":true}`, `{"prompt":[[1],[2]]}`,
		`{"prompt":["a",1]}`, `{"prompt":[1e3]}`, `{"lora":[1],"n_cache_reuse":1,"n":2}`, `{"prompt":[-1]}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		r, err := parseRequest(completion, body)
		if err != nil {
			return
		}
		if r.tokens != nil {
			var ids []float64
			require.NoError(t, json.Unmarshal(r.prompt, &ids), "tokens %v from prompt %s", r.tokens, r.prompt)
			require.Len(t, ids, len(r.tokens), "tokens %v from prompt %s", r.tokens, r.prompt)
			for i, id := range ids {
				require.Equal(t, id, float64(r.tokens[i]), "token %d", i)
			}
		}
		out, err := r.pinned(1)
		if err != nil {
			return
		}
		var m map[string]json.RawMessage
		require.NoError(t, json.Unmarshal(out, &m), "pinned body %s", out)
		require.Equal(t, "1", string(m["id_slot"]), "pinned body %s", out)
	})
}

// FuzzSSESniffer: the stream passes through byte for byte however it is
// cut, and the sniffer never panics.
func FuzzSSESniffer(f *testing.F) {
	f.Add([]byte("data: {\"timings\":{\"cache_n\":3}}\n\ndata: [DONE]\n\n"), uint8(3))
	f.Add([]byte("data:{\"timings\":{}}\r\n"), uint8(1))
	f.Add([]byte("\n\n\ndata: x"), uint8(7))
	f.Fuzz(func(t *testing.T, stream []byte, chunk uint8) {
		s := &sseSniffer{rc: io.NopCloser(&chunked{b: stream, n: int(chunk%16) + 1})}
		got, err := io.ReadAll(s)
		require.NoError(t, err)
		require.Equal(t, string(stream), string(got), "passed")
		if s.seen {
			require.NotNil(t, s.last.Timings, "seen timings without timings")
		}
	})
}

type chunked struct {
	b []byte
	n int
}

func (c *chunked) Read(p []byte) (int, error) {
	if len(c.b) == 0 {
		return 0, io.EOF
	}
	n := copy(p[:min(len(p), c.n)], c.b)
	c.b = c.b[n:]
	return n, nil
}

// FuzzMessagesStream: any chat stream, however it is cut, converts to the
// same events or fails, and never panics.
func FuzzMessagesStream(f *testing.F) {
	f.Add([]byte(chatStream), uint8(5))
	f.Add([]byte("data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":-1}]}}],\"timings\":{}}\n\n"), uint8(2))
	f.Add([]byte("data: {\"choices\":[{\"finish_reason\":\"stop\",\"delta\":{}}],\"__verbose\":{}}\n\n"), uint8(9))
	f.Fuzz(func(t *testing.T, stream []byte, chunk uint8) {
		whole, werr := io.ReadAll(newMessagesStream(io.NopCloser(bytes.NewReader(stream))))
		cut, cerr := io.ReadAll(newMessagesStream(io.NopCloser(&chunked{b: stream, n: int(chunk%16) + 1})))
		require.Equal(t, werr == nil, cerr == nil)
		require.Equal(t, string(whole), string(cut))
	})
}

// FuzzChatToMessages: any answer converts or fails, and a conversion is
// one JSON object.
func FuzzChatToMessages(f *testing.F) {
	f.Add([]byte(`{"choices":[{"finish_reason":"stop","message":{"content":"a","tool_calls":[{"function":{"arguments":"{\"x\":1e400}"}}]}}],"usage":{}}`))
	f.Add([]byte(`{"choices":[{"message":{"reasoning_content":"r"}}],"usage":{"prompt_tokens":"x"}}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		out, err := chatToMessages(b)
		if err != nil {
			return
		}
		var m map[string]any
		require.NoError(t, json.Unmarshal(out, &m), "%s", out)
	})
}
