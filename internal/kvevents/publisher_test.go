package kvevents

import (
	"fmt"
	"log/slog"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvevents/kvsub"
	"github.com/mcbridge/mcbridge/internal/status"
)

// wait bounds what the sockets deliver in the background.
const wait = 10 * time.Second

func testConfig(instance string) config.KVEvents {
	c := config.Default().KVEvents
	c.Endpoint, c.ReplayEndpoint, c.Instance = "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", instance
	return c
}

func openPublisher(t *testing.T, c config.KVEvents) *Publisher {
	p, err := Open(c, slog.Default(), nil)
	require.NoError(t, err)
	return p
}

func subscribe(t *testing.T, idx *kvsub.Index, p *Publisher, drop func(uint64) bool) *kvsub.Subscriber {
	s, err := kvsub.Subscribe(idx, p.Addr(), kvsub.Options{Replay: p.ReplayAddr(), Drop: drop})
	require.NoError(t, err)
	t.Cleanup(s.Close)
	return s
}

// untilSubscribed publishes a probe block until the subscriber has it: a
// SUB socket misses what was sent before its subscription reached the
// publisher. The probe goes again when the test is done with it.
func untilSubscribed(t *testing.T, p *Publisher, idx *kvsub.Index, model string) {
	probe := NewChain(tokens(4, 9000), 4, testSeed)
	pod, _, err := kvsub.ParseTopic(p.Topic(model))
	require.NoError(t, err)
	holds := func() bool {
		r := idx.Rank(model, probe.Tokens, 4)
		return len(r) > 0 && r[0].Pod == pod
	}
	require.Eventually(t, func() bool {
		p.Removed([]key.BlockKey{bkey(255)})
		p.Stored(model, 4, []Block{{Key: bkey(255), Chain: probe, Index: 0}})
		return holds()
	}, wait, 20*time.Millisecond, "the subscriber never heard the publisher")
	p.Removed([]key.BlockKey{bkey(255)})
	require.Eventually(t, func() bool { return !holds() }, wait, 5*time.Millisecond, "the probe stays")
}

func TestConsumerRanksTheHolderFirst(t *testing.T) {
	idx := kvsub.NewIndex(testSeed)
	a, b := openPublisher(t, testConfig("10.0.0.1:8080")), openPublisher(t, testConfig("10.0.0.2:8080"))
	defer a.Close()
	defer b.Close()
	subscribe(t, idx, a, nil)
	subscribe(t, idx, b, nil)
	untilSubscribed(t, a, idx, "tiny")
	untilSubscribed(t, b, idx, "tiny")

	shared := tokens(8, 0)
	pa, pb := append(append([]int32{}, shared...), tokens(8, 100)...), append(append([]int32{}, shared...), tokens(4, 200)...)
	ca, cb := NewChain(pa, 4, testSeed), NewChain(pb, 4, testSeed)
	a.Stored("tiny", 4, blocks(ca, 0, 3, 4)) // a holds all four blocks of pa
	b.Stored("tiny", 4, blocks(cb, 0, 2, 3)) // b holds pb's three
	query := append(append([]int32{}, pa...), 7, 7, 7, 7)
	require.Eventually(t, func() bool {
		r := idx.Rank("tiny", query, 4)
		return len(r) == 2 && r[0] == kvsub.Score{Pod: "10.0.0.1:8080", Blocks: 4} && r[1] == kvsub.Score{Pod: "10.0.0.2:8080", Blocks: 2}
	}, wait, 5*time.Millisecond, "ranks %v", idx.Rank("tiny", query, 4))
	require.Equal(t, []kvsub.Score{{Pod: "10.0.0.2:8080", Blocks: 3}, {Pod: "10.0.0.1:8080", Blocks: 2}}, idx.Rank("tiny", pb, 4))
	n, errs := idx.Mismatches()
	require.Zero(t, n, "%v", errs)

	a.Removed([]key.BlockKey{bkey(3)})
	require.Eventually(t, func() bool { return idx.Held("tiny", "10.0.0.1:8080") == 0 }, wait, 5*time.Millisecond)
	require.Equal(t, []kvsub.Score{{Pod: "10.0.0.2:8080", Blocks: 2}}, idx.Rank("tiny", query, 4))
}

func TestConsumerRecoversAGapThroughReplay(t *testing.T) {
	idx, ref := kvsub.NewIndex(testSeed), kvsub.NewIndex(testSeed)
	p := openPublisher(t, testConfig("pod"))
	defer p.Close()
	var first atomic.Uint64
	lossy := subscribe(t, idx, p, func(seq uint64) bool { f := first.Load(); return f > 0 && seq >= f && seq < f+3 })
	subscribe(t, ref, p, nil)
	untilSubscribed(t, p, idx, "m")
	untilSubscribed(t, p, ref, "m")
	replays, before := p.Stats().Replays, lossy.Counts()
	first.Store(p.seqNow())
	// Three batches lost on the way, then one more: the subscriber asks
	// the replay socket for what it missed.
	for i := range 4 {
		c := NewChain(tokens(8, int32(1000*i)), 4, testSeed)
		p.Stored("m", 4, blocks(c, byte(10*i), 1, 2))
		require.Eventually(t, func() bool { return ref.Held("m", "pod") == 2*(i+1) }, wait, 5*time.Millisecond)
	}
	require.Eventually(t, func() bool { return idx.Held("m", "pod") == 8 }, wait, 5*time.Millisecond)
	c := lossy.Counts()
	assert.Equal(t, 3, c.Dropped)
	assert.Equal(t, 1, c.Gaps-before.Gaps)
	assert.Equal(t, 3, c.Replayed-before.Replayed)
	assert.Empty(t, c.Errors)
	assert.Equal(t, replays+1, p.Stats().Replays)
	for i := range 4 {
		q := tokens(8, int32(1000*i))
		assert.Equal(t, ref.Rank("m", q, 4), idx.Rank("m", q, 4), "chain %d", i)
	}
}

// A killed publisher's successor at the same endpoints clears what it left;
// a subscriber with Options.Silence meets it on a new socket it dials after
// the silence, whether or not its old socket would have reconnected.
//
// The new process numbers its batches from its start time, above the old
// one's: the subscriber meets a gap and replays the new stream from its
// clear. A predecessor that sent more batches than microseconds passed
// (set by hand here; numbered from 0, as vLLM's publisher is, any
// long-lived one) makes the sequence go back instead, and the subscriber
// replays the new stream from 0.
func TestRestartClearsWhatAKilledPublisherLeft(t *testing.T) {
	for _, silence := range []time.Duration{0, 200 * time.Millisecond} {
		for _, back := range []bool{false, true} {
			t.Run(fmt.Sprintf("silence=%s/back=%v", silence, back), func(t *testing.T) {
				restart(t, silence, back)
			})
		}
	}
}

func restart(t *testing.T, silence time.Duration, back bool) {
	idx := kvsub.NewIndex(testSeed)
	c := testConfig("pod")
	// A restarted server binds the same endpoints again.
	c.Endpoint, c.ReplayEndpoint = "tcp://*:"+freePort(t), "tcp://*:"+freePort(t)
	p := openPublisher(t, c)
	if back {
		p.bufMu.Lock()
		p.seq += 1 << 40
		p.bufMu.Unlock()
	}
	s, err := kvsub.Subscribe(idx, p.Addr(), kvsub.Options{Replay: p.ReplayAddr(), Silence: silence})
	require.NoError(t, err)
	t.Cleanup(s.Close)
	untilSubscribed(t, p, idx, "m")
	p.Stored("m", 4, blocks(NewChain(tokens(12, 0), 4, testSeed), 0, 2, 3))
	require.Eventually(t, func() bool { return idx.Held("m", "pod") == 3 }, wait, 5*time.Millisecond)
	// Killed: the sockets go, nothing more is said.
	p.abort()
	if silence > 0 {
		require.Eventually(t, func() bool { return s.Counts().Redials > 0 }, wait, 10*time.Millisecond, "a silent stream is dialled again")
	}
	q := openPublisher(t, c)
	defer q.Close()
	untilSubscribed(t, q, idx, "m")
	require.Zero(t, idx.Held("m", "pod"), "the new publisher's first batch cleared the old one's blocks")
	require.Equal(t, 1, s.Counts().Restarts)
	require.Empty(t, s.Counts().Errors)
}

func TestCloseClears(t *testing.T) {
	idx := kvsub.NewIndex(testSeed)
	p := openPublisher(t, testConfig("pod"))
	subscribe(t, idx, p, nil)
	untilSubscribed(t, p, idx, "m")
	p.Stored("m", 4, blocks(NewChain(tokens(8, 0), 4, testSeed), 0, 1, 2))
	require.Eventually(t, func() bool { return idx.Held("m", "pod") == 2 }, wait, 5*time.Millisecond)
	require.NoError(t, p.Close())
	require.Eventually(t, func() bool { return idx.Held("m", "pod") == 0 }, wait, 5*time.Millisecond)
	require.Error(t, p.Close(), "closed twice")
	p.Stored("m", 4, blocks(NewChain(tokens(8, 0), 4, testSeed), 0, 1, 2)) // ignored, never blocks
}

func TestFullQueueDropsAndResendsTheState(t *testing.T) {
	idx := kvsub.NewIndex(testSeed)
	c := testConfig("pod")
	c.MaxQueueSize = 4
	p := openPublisher(t, c)
	defer p.Close()
	subscribe(t, idx, p, nil)
	untilSubscribed(t, p, idx, "m")
	// One update of more blocks than the queue takes drops them all.
	var many []Block
	for i := range 6 {
		many = append(many, Block{Key: bkey(byte(i)), Chain: NewChain(tokens(4, int32(100*i)), 4, testSeed), Index: 0})
	}
	p.Stored("m", 4, many)
	p.Removed([]key.BlockKey{bkey(0)})
	require.Eventually(t, func() bool { return idx.Held("m", "pod") == 5 }, wait, 5*time.Millisecond)
	require.Positive(t, p.Stats().Dropped, "%+v", p.Stats())
	for i := 1; i < 6; i++ {
		require.Len(t, idx.Rank("m", tokens(4, int32(100*i)), 4), 1, "block %d", i)
	}
}

func TestConnectingPublisher(t *testing.T) {
	idx := kvsub.NewIndex(testSeed)
	s, err := kvsub.Subscribe(idx, "tcp://127.0.0.1:"+freePort(t), kvsub.Options{Bind: true})
	require.NoError(t, err)
	defer s.Close()
	c := testConfig("pod")
	c.Endpoint, c.ReplayEndpoint = s.Addr(), ""
	require.False(t, Binds(c.Endpoint))
	p := openPublisher(t, c)
	defer p.Close()
	untilSubscribed(t, p, idx, "m")
}

func TestOpenRefusesATakenPort(t *testing.T) {
	c := testConfig("pod")
	c.Endpoint = "tcp://*:" + freePort(t)
	p := openPublisher(t, c)
	defer p.Close()
	_, err := Open(c, slog.Default(), nil)
	require.Equal(t, status.Config, status.Of(err))
	require.ErrorContains(t, err, "kv_events.endpoint")
	c.Endpoint, c.ReplayEndpoint = "tcp://127.0.0.1:*", p.ReplayAddr()
	_, err = Open(c, slog.Default(), nil)
	require.ErrorContains(t, err, "kv_events.replay_endpoint")
}

func freePort(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	_, port, _ := net.SplitHostPort(l.Addr().String())
	return port
}

// seqNow is the sequence number the next batch gets.
func (p *Publisher) seqNow() uint64 {
	p.bufMu.Lock()
	defer p.bufMu.Unlock()
	return p.seq
}

// A subscriber that connects after the last change catches up on the
// heartbeat: it sees a sequence number past 0 and asks for the rest.
func TestHeartbeatLetsALateSubscriberCatchUp(t *testing.T) {
	c := testConfig("pod")
	c.HeartbeatMS = 20
	p := openPublisher(t, c)
	defer p.Close()
	ch := NewChain(tokens(8, 0), 4, testSeed)
	p.Stored("m", 4, blocks(ch, 0, 1, 2))
	require.Eventually(t, func() bool { return p.seqNow() >= 3 }, wait, time.Millisecond, "no heartbeats")
	idx := kvsub.NewIndex(testSeed)
	s := subscribe(t, idx, p, nil)
	require.Eventually(t, func() bool { return idx.Held("m", "pod") == 2 }, wait, 5*time.Millisecond, "%+v", s.Counts())
	require.Empty(t, s.Counts().Errors)
	require.Equal(t, int64(3), p.Stats().Published, "the clear and two blocks: heartbeats are no block events")
}
