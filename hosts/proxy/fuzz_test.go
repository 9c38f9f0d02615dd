package proxy

import (
	"bytes"
	"encoding/json"
	"io"
	"testing"
)

// FuzzSpliceTimings: whatever the body, the splice never panics; on a body
// it accepts, the result is valid JSON with the fields in its timings, and
// removing what was added gives the body back.
func FuzzSpliceTimings(f *testing.F) {
	for _, s := range []string{`{"timings":{"cache_n":1}}`, `{}`, `{"a":[1,{"timings":{}}]}`, `{"timings":{ }}`, `[]`, `{"timings":1}`, "{\"x\":\"\\u007d\"}"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		members := mcbMembers(3, 0.5)
		out, ok := spliceTimings(body, members)
		if !ok {
			if !bytes.Equal(out, body) {
				t.Fatal("a refused body changed")
			}
			return
		}
		var m map[string]json.RawMessage
		if err := json.Unmarshal(out, &m); err != nil {
			t.Fatalf("spliced %q into %q: %v", members, out, err)
		}
		var tm map[string]json.RawMessage
		if err := json.Unmarshal(m["timings"], &tm); err != nil || string(tm["mcb_restored_n"]) != "3" {
			t.Fatalf("timings %s", m["timings"])
		}
		if len(out) <= len(body) || len(out)-len(body) > len(members)+len(`,"timings":{}`) {
			t.Fatalf("%d bytes became %d", len(body), len(out))
		}
	})
}

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
			if err := json.Unmarshal(r.prompt, &ids); err != nil || len(ids) != len(r.tokens) {
				t.Fatalf("tokens %v from prompt %s", r.tokens, r.prompt)
			}
			for i, id := range ids {
				if float64(r.tokens[i]) != id {
					t.Fatalf("token %d: %d, prompt says %v", i, r.tokens[i], id)
				}
			}
		}
		out, err := r.pinned(1)
		if err != nil {
			return
		}
		var m map[string]json.RawMessage
		if json.Unmarshal(out, &m) != nil || string(m["id_slot"]) != "1" {
			t.Fatalf("pinned body %s", out)
		}
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
		if err != nil || !bytes.Equal(got, stream) {
			t.Fatalf("passed %q, %v", got, err)
		}
		if s.seen && s.last.Timings == nil {
			t.Fatal("seen timings without timings")
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
