package proxy

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The proxy never relies on its own memory of a slot: when the server
// changed behind it between two requests on slot 0 (a restart on the same
// port, the slot erased through the server's API, another client's prompt
// in it), the second request is restored, and its answer is the server's
// own. With nothing in between, the slot's own prefix is used and nothing
// moves.
func TestSlotsAreVerifiedBeforeTheyAreRelied(t *testing.T) {
	prefix := seqTokens(3*blockTokens, 7, 3)
	first := completionReq(concat(prefix, []int32{1, 2, 3}), "id_slot", 0)
	second := completionReq(concat(prefix, []int32{4, 5}), "id_slot", 0)
	for _, tc := range []struct {
		name     string
		between  func(t *testing.T, fs *fakeServer)
		restored int
		why      string // the unconfirmed reason counted
		restarts int64
	}{
		{"nothing", func(*testing.T, *fakeServer) {}, 0, "", 0},
		{"restart", func(_ *testing.T, fs *fakeServer) { fs.restart() }, 3 * blockTokens, "", 1},
		{"erase", func(t *testing.T, fs *fakeServer) {
			code, b := post(t, fs.url(), "/slots/0?action=erase", map[string]any{})
			require.Equal(t, 200, code, "%s", b)
		}, 3 * blockTokens, "tokens", 0},
		{"direct client", func(t *testing.T, fs *fakeServer) {
			code, b := post(t, fs.url(), "/completion", completionReq(seqTokens(40, 11, 5), "id_slot", 0))
			require.Equal(t, 200, code, "%s", b)
		}, 3 * blockTokens, "task", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs := newFake(t, "slot-fa-on.bin", 2, 1, 1)
			f := startFront(t, []*fakeServer{fs}, directoryName(t), "one", Options{})
			r := postReply(t, f.url, "/completion", first)
			require.Equal(t, 200, r.code, "%s", r.body)
			f.flush(t)
			tc.between(t, fs)

			r = postReply(t, f.url, "/completion", second)
			require.Equal(t, 200, r.code, "%s", r.body)
			assert.Equal(t, tc.restored, r.restored, "restored")
			ref := newFake(t, "slot-fa-on.bin", 1, 1, 1)
			_, want := post(t, ref.url(), "/completion", second)
			assert.Equal(t, cacheFree(t, want), cacheFree(t, r.body), "the answer is the server's own")
			f.flush(t)
			st := f.p.Stats()
			if tc.why != "" {
				assert.Equal(t, int64(1), st.Unconfirmed[tc.why], "unconfirmed %v", st.Unconfirmed)
			}
			assert.Equal(t, tc.restarts, f.p.State().Upstreams[0].Restarts)
			assert.True(t, f.p.State().Bridge, "the bridge is on (relearned after a restart)")
			assertEmptyDir(t, f.p, fs.dir)
		})
	}
}

// What a slot holds after a request is the answer's word: when the
// server counted another prompt than the proxy's tokens, the slot is
// unknown and the next request sharing the prefix restores it.
func TestSlotContentsComeFromTheAnswer(t *testing.T) {
	fs := newFake(t, "slot-fa-on.bin", 1, 1, 1)
	f := startFront(t, []*fakeServer{fs}, directoryName(t), "one", Options{})
	prefix := seqTokens(3*blockTokens, 7, 3)
	r := postReply(t, f.url, "/completion", completionReq(concat(prefix, []int32{1})))
	require.Equal(t, 200, r.code)
	f.flush(t)
	// The proxy's tokenizer and the server disagree from now on.
	fs.mu.Lock()
	fs.tokenShift = 1
	fs.mu.Unlock()
	r = postReply(t, f.url, "/completion", map[string]any{"prompt": "some text", "n_predict": 4})
	require.Equal(t, 200, r.code, "%s", r.body)
	f.flush(t)
	assert.Equal(t, int64(1), f.p.Stats().AnswerMismatches)
	v := f.p.ups[0].table().view(0)
	assert.Nil(t, v.tokens, "the slot's contents are unknown")
	require.NoError(t, f.p.Flush(context.Background()))
}
