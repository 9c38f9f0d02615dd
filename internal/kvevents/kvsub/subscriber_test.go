package kvsub

import (
	"context"
	"encoding/binary"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/kvevents"
)

// A restarted publisher's first batch, heard live right after the old
// stream's last, is a restart: its replay buffer holds nothing before that
// batch, and the batch begins with AllBlocksCleared.
func TestRestartHeardLive(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pub, router := zmq4.NewPub(ctx), zmq4.NewRouter(ctx)
	defer pub.Close()
	defer router.Close()
	require.NoError(t, pub.Listen("tcp://127.0.0.1:0"))
	require.NoError(t, router.Listen("tcp://127.0.0.1:0"))
	starts := make(chan uint64, 4)
	go func() {
		for {
			msg, err := router.Recv()
			if err != nil {
				return
			}
			f := msg.Frames
			if len(f) != 3 || len(f[2]) != 8 {
				continue
			}
			starts <- binary.BigEndian.Uint64(f[2])
			end := []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}
			_ = router.SendMulti(zmq4.NewMsgFrom(f[0], nil, end, nil))
		}
	}()
	idx := NewIndex(1)
	s, err := Subscribe(idx, "tcp://"+pub.Addr().String(), Options{Replay: "tcp://" + router.Addr().String()})
	require.NoError(t, err)
	defer s.Close()
	// send runs inside Eventually's goroutine too, where require must not.
	send := func(seq uint64, events ...kvevents.Event) {
		payload, err := kvevents.Encode(&kvevents.Batch{Events: events}, false)
		assert.NoError(t, err)
		var seqb [8]byte
		binary.BigEndian.PutUint64(seqb[:], seq)
		assert.NoError(t, pub.SendMulti(zmq4.NewMsgFrom([]byte("kv@pod@m"), seqb[:], payload)))
	}
	stored := kvevents.Event{Tag: kvevents.TagStored, Hashes: SeqHashes([]uint32{1, 2, 3, 4}, 4, 1, nil), Tokens: []int32{1, 2, 3, 4}, BlockSize: 4}
	// The old stream holds a block; it goes on until the subscription has
	// reached the publisher, and its batches arrive in order before the new
	// stream's first.
	seq := uint64(10)
	require.Eventually(t, func() bool { seq++; send(seq, stored); return idx.Held("m", "pod") == 1 }, 5*time.Second, 20*time.Millisecond)
	require.Eventually(t, func() bool { return len(starts) > 0 }, 5*time.Second, 5*time.Millisecond, "a late join replays")
	<-starts
	send(seq+1000, kvevents.Event{Tag: kvevents.TagCleared})
	require.Eventually(t, func() bool { return idx.Held("m", "pod") == 0 }, 5*time.Second, 5*time.Millisecond, "the clear is applied")
	assert.Equal(t, seq+1, <-starts, "the gap is replayed from the old stream's next number")
	c := s.Counts()
	assert.Equal(t, 1, c.Gaps)
	assert.Equal(t, 1, c.Restarts)
	assert.Empty(t, c.Errors)
}
