package llamastate

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/status"
)

// recurrentState is the state of a recurrent memory after n tokens: the
// framing, then one cell at position n-1 and some tensor bytes.
func recurrentState(t testing.TB, kind Kind, n int, tensorBytes int) []byte {
	t.Helper()
	st := &State{Kind: kind, SeqID: 3}
	if kind == SlotFile {
		for i := range n {
			st.Words = append(st.Words, int32(100+i))
		}
	}
	rec := binary.LittleEndian.AppendUint32(nil, 1)
	rec = binary.LittleEndian.AppendUint32(rec, uint32(n-1))
	rec = binary.LittleEndian.AppendUint32(rec, 0)
	for i := range tensorBytes {
		rec = append(rec, byte(i))
	}
	out, err := st.AppendRecurrent(nil, rec)
	require.NoError(t, err)
	return out
}

func TestRecurrentState(t *testing.T) {
	for _, kind := range []Kind{SlotFile, Memory} {
		b := recurrentState(t, kind, 40, 100)
		st, rec, err := ParseRecurrent(b)
		require.NoError(t, err)
		assert.Equal(t, kind, st.Kind)
		assert.Empty(t, st.Streams)
		pos, err := RecurrentPos(rec)
		require.NoError(t, err)
		assert.Equal(t, int32(39), pos)
		if kind == SlotFile {
			toks, err := st.PromptTokens()
			require.NoError(t, err)
			assert.Len(t, toks, 40)
		}
		out, err := st.AppendRecurrent(nil, rec)
		require.NoError(t, err)
		assert.True(t, bytes.Equal(b, out))
		assert.Equal(t, len(b), st.RecurrentSize(rec))
		// A KV cache's state is no recurrent one.
		_, _, err = ParseRecurrent(append(b[:len(b)-len(rec):len(b)-len(rec)], 2, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 9))
		assert.Equal(t, status.InvalidArg, status.Of(err))
	}
	for name, rec := range map[string][]byte{
		"short":         {1, 0, 0, 0},
		"two cells":     {2, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 1},
		"sequence ids":  {1, 0, 0, 0, 5, 0, 0, 0, 1, 0, 0, 0, 1},
		"negative pos":  {1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, 1},
		"meta, no data": {1, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0},
	} {
		_, err := RecurrentPos(rec)
		assert.Equal(t, status.InvalidArg, status.Of(err), name)
	}
	_, err := (&State{Kind: Memory, Streams: []Stream{{}}}).AppendRecurrent(nil, []byte{1, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 1})
	assert.Equal(t, status.InvalidArg, status.Of(err), "KV streams beside a recurrent state")
}
