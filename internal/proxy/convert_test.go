package proxy

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The conversions give what llama-server v0.5.0's give, key order
// included (tools/server/server-chat.cpp, traced by hand for each case).
func TestResponsesToChat(t *testing.T) {
	tests := []struct{ name, in, want string }{
		{"string input", `{"model":"m","instructions":"sys","input":"hi","max_output_tokens":5,"stream":true}`,
			`{"model":"m","stream":true,"messages":[{"role":"system","content":"sys"},{"role":"user","content":"hi"}],"max_tokens":5}`},
		{"items", `{"input":[{"role":"user","content":"q"},` +
			`{"type":"message","role":"assistant","content":[{"type":"output_text","text":"a"}],"status":"completed","id":"m1"},` +
			`{"type":"function_call","call_id":"c1","name":"f","arguments":"{}"},` +
			`{"type":"function_call_output","call_id":"c1","output":"r"},` +
			`{"type":"reasoning","summary":[],"content":[{"type":"reasoning_text","text":"think"}]}]}`,
			`{"messages":[{"role":"user","content":[{"text":"q","type":"text"}]},` +
				`{"role":"assistant","content":[{"text":"a","type":"text"}],"id":"m1","tool_calls":[{"function":{"arguments":"{}","name":"f"},"id":"c1","type":"function"}]},` +
				`{"content":"r","role":"tool","tool_call_id":"c1"},` +
				`{"role":"assistant","content":[],"reasoning_content":"think"}]}`},
		{"assistant after assistant merges", `{"input":[{"role":"assistant","type":"message","content":"one"},{"role":"assistant","type":"message","content":"two"}]}`,
			`{"messages":[{"role":"assistant","content":[{"text":"one","type":"text"},{"text":"two","type":"text"}]}]}`},
		{"tools", `{"input":"x","tools":[{"type":"function","name":"f","parameters":{"b":1,"a":2.50}},{"type":"web_search"}],"reasoning":{"effort":"low"}}`,
			`{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"b":1,"a":2.50},"strict":true}}],"reasoning_effort":"low"}`},
		{"only unsupported tools", `{"input":"x","tools":[{"type":"web_search"}]}`, `{"messages":[{"role":"user","content":"x"}]}`},
		{"tool output parts", `{"input":[{"type":"function_call_output","call_id":"c","output":[{"type":"input_text","text":"t"},{"type":"input_image","image_url":"u"}]}]}`,
			`{"messages":[{"content":[{"type":"text","text":"t"},{"type":"image_url","image_url":{"url":"u"}}],"role":"tool","tool_call_id":"c"}]}`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := responsesToChat([]byte(tc.in))
			require.NoError(t, err)
			assert.Equal(t, tc.want, string(got))
		})
	}
	for _, bad := range []string{`{}`, `{"input":"x","previous_response_id":"r"}`, `{"input":3}`, `{"input":[{"type":"odd"}]}`,
		`{"input":[{"role":"user","content":[{"type":"input_file"}]}]}`, `{"input":"x","tools":{}}`, `[]`, `{"input":`} {
		_, err := responsesToChat([]byte(bad))
		assert.Error(t, err, bad)
	}
}

func TestMessagesToChat(t *testing.T) {
	tests := []struct{ name, in, want string }{
		{"billing header and metadata", `{"model":"c","system":"x-anthropic-billing-header: cc_version=1; cch=a5145;You are Claude",` +
			`"messages":[{"role":"user","content":"hi"}],"max_tokens":10,"temperature":0,"metadata":{"user_id":"u"},"id_slot":3}`,
			`{"messages":[{"role":"system","content":"x-anthropic-billing-header: cc_version=1; cch=fffff;You are Claude"},{"role":"user","content":"hi"}],` +
				`"max_tokens":10,"temperature":0,"__metadata_user_id":"u"}`},
		{"tools and results", `{"system":[{"type":"text","text":"a"},{"type":"image"},{"type":"text","text":"b"}],"messages":[` +
			`{"role":"user","content":[{"type":"text","text":"q"}]},` +
			`{"role":"assistant","content":[{"type":"thinking","thinking":"hmm"},{"type":"text","text":"let me"},{"type":"tool_use","id":"t1","name":"read","input":{"path":"a.go","n":1.0,"e":1e-5}}]},` +
			`{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":[{"type":"text","text":"pkg"}]},{"type":"tool_result","tool_use_id":"t2"}]},` +
			`{"role":"assistant"}],` +
			`"tools":[{"name":"read","description":"reads","input_schema":{"type":"object","properties":{"path":{"type":"string"}}}},{"name":"x"}],` +
			`"tool_choice":{"type":"any"},"stop_sequences":["END"],"thinking":{"type":"enabled","budget_tokens":2048}}`,
			`{"messages":[{"role":"system","content":"ab"},{"role":"user","content":[{"type":"text","text":"q"}]},` +
				`{"role":"assistant","content":[{"type":"text","text":"let me"}],"tool_calls":[{"id":"t1","type":"function","function":{"name":"read","arguments":"{\"path\":\"a.go\",\"n\":1.0,\"e\":1e-05}"}}],"reasoning_content":"hmm"},` +
				`{"role":"tool","tool_call_id":"t1","content":"pkg"},{"role":"tool","tool_call_id":"t2","content":""}],` +
				`"tools":[{"type":"function","function":{"name":"read","description":"reads","parameters":{"type":"object","properties":{"path":{"type":"string"}}}}},` +
				`{"type":"function","function":{"name":"x","description":"","parameters":{}}}],` +
				`"tool_choice":"required","stop":["END"],"max_tokens":4096,"thinking_budget_tokens":2048}`},
		{"tool use alone", `{"messages":[{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"n"}]}],"max_tokens":1}`,
			`{"messages":[{"role":"assistant","content":"","tool_calls":[{"id":"t","type":"function","function":{"name":"n","arguments":"{}"}}]}],"max_tokens":1}`},
		{"image in a result", `{"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"a"},{"type":"image","source":{"type":"url","url":"u"}}]}]}]}`,
			`{"messages":[{"role":"tool","tool_call_id":"t","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"u"}}]}],"max_tokens":4096}`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := messagesToChat([]byte(tc.in))
			require.NoError(t, err)
			assert.Equal(t, tc.want, string(got))
		})
	}
	for _, bad := range []string{`{}`, `[]`, `{"messages":`} {
		_, err := messagesToChat([]byte(bad))
		assert.Error(t, err, bad)
	}
}

// nlohmann's dump of numbers, as v0.5.0's json library printed them.
func TestNlohmannNumbers(t *testing.T) {
	for in, want := range map[string]string{
		"1": "1", "-7": "-7", "1.0": "1.0", "2.5": "2.5", "100.0": "100.0", "1e2": "100.0", "1e15": "1e+15", "1e16": "1e+16",
		"123456789012345678": "123456789012345678", "1.5e-3": "0.0015", "0.0001": "0.0001", "1e-5": "1e-05", "-0.0": "-0.0",
		"0.1": "0.1", "1e100": "1e+100", "3.141592653589793": "3.141592653589793", "18446744073709551615": "18446744073709551615",
		"18446744073709551616": "1.8446744073709552e+19", "1.7976931348623157e308": "1.7976931348623157e+308", "5e-324": "5e-324",
		"12345678.9": "12345678.9",
	} {
		got, err := nlohmannNumber(in)
		require.NoError(t, err, in)
		assert.Equal(t, want, got, in)
	}
	s, err := dumpJSON(mustParse(t, `{"z":1,"a":"x\u0001\u001f\b\t\"\\/é\u2028<"}`))
	require.NoError(t, err)
	assert.Equal(t, "{\"z\":1,\"a\":\"x\\u0001\\u001f\\b\\t\\\"\\\\/é\u2028<\"}", s, "nlohmann escapes only what JSON requires")
}

func mustParse(t testing.TB, s string) any {
	t.Helper()
	v, err := parseOrdered([]byte(s))
	require.NoError(t, err)
	return v
}

// FuzzConversions: whatever the body, the conversions never panic, and
// what they accept is a chat body with its messages.
func FuzzConversions(f *testing.F) {
	for _, s := range []string{`{"input":"hi","instructions":"s"}`, `{"input":[{"role":"user","content":"q"},{"type":"function_call","call_id":"c","name":"f","arguments":"{}"}]}`,
		`{"messages":[{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"n","input":{"a":[1,2.5,null,true]}}]}],"system":"s"}`,
		`{"messages":[{"role":"user","content":[{"type":"tool_result","content":[{"type":"image","source":{"type":"base64","data":"x"}}]}]}]}`,
		`{"input":[{"type":"reasoning","summary":[],"content":[{"text":"t"}]}]}`, `{"messages":"x","tools":[1]}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		for _, conv := range []func([]byte) ([]byte, error){responsesToChat, messagesToChat} {
			out, err := conv(body)
			if err != nil {
				continue
			}
			var m map[string]json.RawMessage
			require.NoError(t, json.Unmarshal(out, &m), "%s gave %s", body, out)
			var msgs []json.RawMessage
			require.NoError(t, json.Unmarshal(m["messages"], &msgs), "%s gave no messages: %s", body, out)
		}
	})
}

// FuzzParseOrdered: what parses writes back as JSON that parses to the
// same value, keys in the same order.
func FuzzParseOrdered(f *testing.F) {
	for _, s := range []string{`{"b":1,"a":[true,null,"x"],"b":2}`, `1e400`, `"\ud800"`, `{"a":{"b":{"c":[]}}}`, `-0.0`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		v, err := parseOrdered(b)
		if err != nil {
			return
		}
		var out []byte
		if o, ok := v.(*object); ok {
			out, err = o.MarshalJSON()
		} else {
			out, err = json.Marshal(v)
		}
		require.NoError(t, err, "%s", b)
		w, err := parseOrdered(out)
		require.NoError(t, err, "%s wrote %s, which does not parse", b, out)
		d1, e1 := dumpJSON(v)
		d2, e2 := dumpJSON(w)
		require.Equal(t, e1 == nil, e2 == nil, "%s: dumped with %v then %v", b, e1, e2)
		require.Equal(t, d1, d2, "%s", b)
	})
}

// FuzzReadAnswer: any answer or event reads without panicking, and a
// read one has counts.
func FuzzReadAnswer(f *testing.F) {
	for _, s := range []string{`{"timings":{"cache_n":3,"prompt_n":4}}`, `{"usage":{"cache_read_input_tokens":2,"input_tokens":5}}`,
		`{"response":{"usage":{"input_tokens":5,"input_tokens_details":{"cached_tokens":1}}}}`, `{"message":{"usage":{}}}`, `[]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, ep := range []endpoint{completion, chat, responses, messages} {
			if a, ok := readAnswer(ep, b); ok {
				require.NotNil(t, a.Timings, "%s: read without counts", b)
			}
		}
	})
}
