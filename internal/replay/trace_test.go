package replay

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestReadTrace(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   string
		want []Request
		ok   bool
	}{
		{"two lines", `{"timestamp": 0, "input_length": 600, "output_length": 6, "hash_ids": [0, 1]}` + "\n" +
			`{"timestamp": 27, "input_length": 10, "output_length": 0, "hash_ids": [2]}` + "\n",
			[]Request{{0, 600, 6, []int64{0, 1}}, {27, 10, 0, []int64{2}}}, true},
		{"blank lines and CRLF, no final newline", "\r\n" + `{"timestamp":1,"input_length":3,"output_length":1,"hash_ids":[7]}` + "\r\n\n",
			[]Request{{1, 3, 1, []int64{7}}}, true},
		{"unknown fields ignored", `{"timestamp":1,"input_length":3,"output_length":1,"hash_ids":[7],"session":"a"}`,
			[]Request{{1, 3, 1, []int64{7}}}, true},
		{"empty", "", nil, true},
		{"not JSON", "timestamp=1", nil, false},
		{"float length", `{"timestamp":1,"input_length":3.5,"output_length":1,"hash_ids":[7]}`, nil, false},
		{"no ids", `{"timestamp":1,"input_length":3,"output_length":1,"hash_ids":[]}`, nil, false},
		{"missing length", `{"timestamp":1,"output_length":1,"hash_ids":[7]}`, nil, false},
		{"negative id", `{"timestamp":1,"input_length":3,"output_length":1,"hash_ids":[-1]}`, nil, false},
		{"id past 2^53", `{"timestamp":1,"input_length":3,"output_length":1,"hash_ids":[9007199254740992]}`, nil, false},
		{"negative timestamp", `{"timestamp":-1,"input_length":3,"output_length":1,"hash_ids":[7]}`, nil, false},
		{"negative output", `{"timestamp":1,"input_length":3,"output_length":-1,"hash_ids":[7]}`, nil, false},
		{"prompt past the arbiter's limit", `{"timestamp":1,"input_length":16777217,"output_length":1,"hash_ids":[7]}`, nil, false},
		{"second line bad", `{"timestamp":1,"input_length":3,"output_length":1,"hash_ids":[7]}` + "\n{", nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ReadTrace(strings.NewReader(tc.in))
			if tc.ok {
				require.NoError(t, err)
				require.Equal(t, tc.want, got)
			} else {
				require.Error(t, err)
			}
		})
	}
}

func TestIdealHitTokens(t *testing.T) {
	for _, tc := range []struct {
		name       string
		trace      []Request
		hit, total int64
	}{
		{"nothing shared", []Request{req(0, 8, 1, 2), req(0, 8, 3, 4)}, 0, 16},
		// A partial last block counts with the tokens the request has.
		{"repeat with a partial block", []Request{req(0, 6, 1, 2), req(0, 6, 1, 2)}, 6, 12},
		// Only the leading run counts: id 3 was seen, but after a miss.
		{"a miss ends the run", []Request{req(0, 12, 1, 2, 3), req(0, 12, 1, 4, 5)}, 4, 24},
		// An id seen later in an earlier request counts as the prefix it names.
		{"longer request first", []Request{req(0, 12, 1, 2, 3), req(0, 8, 1, 2)}, 8, 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.NoError(t, Check(tc.trace, 4))
			hit, total := IdealHitTokens(tc.trace, 4)
			require.Equal(t, tc.hit, hit, "IdealHitTokens hit")
			require.Equal(t, tc.total, total, "IdealHitTokens total")
		})
	}
}

func TestPromptTokens(t *testing.T) {
	a := promptTokens(nil, &Request{InputLength: 10, HashIDs: []int64{5, 6, 7}}, 4)
	b := promptTokens(nil, &Request{InputLength: 8, HashIDs: []int64{5, 6}}, 4)
	c := promptTokens(nil, &Request{InputLength: 8, HashIDs: []int64{5, 8}}, 4)
	require.Len(t, a, 10, "tokens")
	require.Len(t, b, 8, "tokens")
	require.Equal(t, a[:8], b, "equal ids gave unequal tokens")
	require.NotEqual(t, b[4:], c[4:], "unequal ids gave equal tokens")
	for _, tok := range a {
		require.GreaterOrEqual(t, tok, int32(0), "token outside the vocabulary")
		require.Less(t, tok, int32(vocab), "token outside the vocabulary")
	}
}

func FuzzReadTrace(f *testing.F) {
	f.Add([]byte(`{"timestamp": 0, "input_length": 600, "output_length": 6, "hash_ids": [0, 1]}` + "\n"))
	f.Add([]byte(`{"timestamp":1,"input_length":3,"output_length":1,"hash_ids":[7]}` + "\r\n\n{}"))
	f.Add([]byte(`{"input_length":1e3,"hash_ids":[1,2,3,4,5,6]}`))
	f.Add([]byte("\n\n[1,2]\n"))
	f.Fuzz(func(t *testing.T, in []byte) {
		trace, err := ReadTrace(strings.NewReader(string(in)))
		if err != nil {
			return
		}
		for _, r := range trace {
			require.NoError(t, r.validate(), "accepted an invalid request %+v", r)
		}
		// Whatever parses, the ideal is a ratio of tokens.
		if Check(trace, 512) == nil {
			hit, total := IdealHitTokens(trace, 512)
			require.GreaterOrEqual(t, hit, int64(0), "ideal %d of %d tokens", hit, total)
			require.LessOrEqual(t, hit, total, "ideal %d of %d tokens", hit, total)
		}
	})
}
