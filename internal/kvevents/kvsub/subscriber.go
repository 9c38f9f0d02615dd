package kvsub

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
)

// replayTimeout bounds one replay exchange.
const replayTimeout = 5 * time.Second

// Options tune a Subscriber.
type Options struct {
	// Bind makes the SUB socket bind Endpoint, for publishers that
	// connect (llm-d's layout); else it connects.
	Bind bool
	// Replay is the publisher's ROUTER endpoint; empty for none.
	Replay string
	// Drop, when set, discards the batches it returns true for as they
	// arrive: a lossy network, for tests of gap recovery.
	Drop func(seq uint64) bool
	// Silence, when positive, is how long a connecting subscriber hears
	// nothing before it dials the endpoint again on a new socket. A SUB
	// socket's own reconnect does not always bring back a publisher that
	// restarted at the endpoint (libzmq's and zmq4's alike), and with
	// heartbeats on, silence means the stream is lost.
	Silence time.Duration
}

// Counts are what a Subscriber saw.
type Counts struct {
	Batches  int // applied, live or replayed
	Dropped  int // discarded by Options.Drop
	Gaps     int // sequence gaps found (a late join replays without one)
	Replayed int // batches applied from replays
	Restarts int // streams that began again: at a lower sequence number, or past a gap with a clear
	Redials  int // new sockets dialled after Options.Silence
	Errors   []string
}

// Subscriber follows one publisher's stream into an Index.
type Subscriber struct {
	idx      *Index
	opts     Options
	endpoint string
	ctx      context.Context
	cancel   context.CancelFunc
	done     chan struct{}

	mu     sync.Mutex
	sub    zmq4.Socket // replaced when Options.Silence redials
	heard  time.Time   // when the last message arrived, or the socket was dialled
	last   int64       // last sequence number applied; -1 before the first
	counts Counts
}

// Subscribe subscribes to every kv@ topic at endpoint.
func Subscribe(idx *Index, endpoint string, opts Options) (*Subscriber, error) {
	ctx, cancel := context.WithCancel(context.Background())
	s := &Subscriber{idx: idx, opts: opts, endpoint: endpoint, ctx: ctx, cancel: cancel, done: make(chan struct{}), last: -1}
	sub, err := s.open()
	if err != nil {
		cancel()
		return nil, err
	}
	s.sub, s.heard = sub, time.Now()
	if opts.Silence > 0 && !opts.Bind {
		go s.watch()
	}
	go s.run()
	return s, nil
}

// open makes a SUB socket subscribed to every kv@ topic, bound or dialling.
func (s *Subscriber) open() (zmq4.Socket, error) {
	sub := zmq4.NewSub(s.ctx, zmq4.WithDialerMaxRetries(-1), zmq4.WithAutomaticReconnect(!s.opts.Bind))
	err := sub.SetOption(zmq4.OptionSubscribe, "kv@")
	if err == nil && s.opts.Bind {
		err = sub.Listen(s.endpoint)
	}
	if err != nil {
		_ = sub.Close()
		return nil, err
	}
	if !s.opts.Bind {
		// Connecting waits for the publisher, as libzmq's connect does not.
		go func() {
			if err := sub.Dial(s.endpoint); err != nil && s.ctx.Err() == nil && s.current(sub) {
				s.fail("dial %s: %v", s.endpoint, err)
			}
		}()
	}
	return sub, nil
}

func (s *Subscriber) socket() zmq4.Socket {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sub
}

func (s *Subscriber) current(sub zmq4.Socket) bool { return s.socket() == sub }

// watch dials again on a new socket whenever the stream is silent for
// Options.Silence; the sequence numbers then tell a restart from a gap.
func (s *Subscriber) watch() {
	tick := time.NewTicker(s.opts.Silence / 4)
	defer tick.Stop()
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-tick.C:
		}
		s.mu.Lock()
		quiet := time.Since(s.heard) > s.opts.Silence
		s.mu.Unlock()
		if !quiet {
			continue
		}
		sub, err := s.open()
		if err != nil {
			s.fail("redial %s: %v", s.endpoint, err)
			continue
		}
		s.mu.Lock()
		old := s.sub
		s.sub, s.heard = sub, time.Now()
		s.counts.Redials++
		s.mu.Unlock()
		_ = old.Close()
	}
}

// Addr is where a binding subscriber listens.
func (s *Subscriber) Addr() string {
	if a := s.socket().Addr(); a != nil {
		return "tcp://" + a.String()
	}
	return ""
}

// Counts returns what the subscriber saw so far.
func (s *Subscriber) Counts() Counts {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.counts
	c.Errors = append([]string(nil), c.Errors...)
	return c
}

// Close stops the subscriber.
func (s *Subscriber) Close() {
	s.cancel()
	_ = s.socket().Close()
	<-s.done
}

func (s *Subscriber) run() {
	defer close(s.done)
	ctx := s.ctx
	for {
		msg, err := s.socket().Recv()
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			continue // a replaced socket, or the socket's own reconnect
		}
		if len(msg.Frames) != 3 || len(msg.Frames[1]) != 8 {
			s.fail("a message of %d frames, not [topic, seq, payload]", len(msg.Frames))
			continue
		}
		topic, seq, payload := string(msg.Frames[0]), binary.BigEndian.Uint64(msg.Frames[1]), msg.Frames[2]
		s.mu.Lock()
		s.heard = time.Now()
		if s.opts.Drop != nil && s.opts.Drop(seq) {
			s.counts.Dropped++
			s.mu.Unlock()
			continue
		}
		last := s.last
		switch {
		case last >= 0 && int64(seq) <= last:
			// Sequence numbers start again: a new publisher at this
			// endpoint, whose first batch clears what the old one held.
			s.counts.Restarts++
			last, s.last = -1, -1
		case last >= 0 && int64(seq) > last+1:
			s.counts.Gaps++
		}
		s.mu.Unlock()
		gap, replayed := int64(seq) > last+1, false
		if gap {
			replayed = s.replay(ctx, topic, uint64(last+1), seq)
		}
		cleared := s.apply(topic, seq, payload, false)
		// Past a gap with nothing to replay before it, a clear is the new
		// process's first batch, heard live.
		if gap && !replayed && last >= 0 && cleared {
			s.countRestart()
		}
	}
}

func (s *Subscriber) countRestart() {
	s.mu.Lock()
	s.counts.Restarts++
	s.mu.Unlock()
}

// replay asks for the batches from start on and applies those before until.
// It says whether it applied any.
func (s *Subscriber) replay(ctx context.Context, topic string, start, until uint64) bool {
	if s.opts.Replay == "" {
		s.fail("gap before %d and no replay endpoint", until)
		return false
	}
	rctx, cancel := context.WithTimeout(ctx, replayTimeout)
	defer cancel()
	d := zmq4.NewDealer(rctx)
	defer d.Close()
	if err := d.Dial(s.opts.Replay); err != nil {
		s.fail("replay dial: %v", err)
		return false
	}
	var startb [8]byte
	binary.BigEndian.PutUint64(startb[:], start)
	if err := d.SendMulti(zmq4.NewMsgFrom(nil, startb[:])); err != nil {
		s.fail("replay request: %v", err)
		return false
	}
	end := bytes.Repeat([]byte{0xff}, 8)
	first := true
	for {
		msg, err := d.Recv()
		if err != nil {
			s.fail("replay answer: %v", err)
			return !first
		}
		f := msg.Frames
		if len(f) != 3 || len(f[0]) != 0 || len(f[1]) != 8 {
			s.fail("replay answer of %d frames, not [empty, seq, payload]", len(f))
			return !first
		}
		if bytes.Equal(f[1], end) && len(f[2]) == 0 {
			return !first
		}
		seq := binary.BigEndian.Uint64(f[1])
		if seq < start || seq >= until {
			continue
		}
		cleared := s.apply(topic, seq, f[2], true)
		// The stream asked to continue from start begins later, with a
		// clear: not a gap in the old stream but a new process whose
		// numbers went on above the old one's (as mcbridge's do).
		if first && start > 0 && seq > start && cleared {
			s.countRestart()
		}
		first = false
	}
}

// apply applies a batch and says whether it begins with AllBlocksCleared.
func (s *Subscriber) apply(topic string, seq uint64, payload []byte, replayed bool) bool {
	b, err := Decode(payload)
	if err == nil {
		err = s.idx.Apply(topic, b)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if int64(seq) > s.last {
		s.last = int64(seq)
	}
	if err != nil {
		s.counts.Errors = append(s.counts.Errors, fmt.Sprintf("seq %d: %v", seq, err))
		return false
	}
	s.counts.Batches++
	if replayed {
		s.counts.Replayed++
	}
	return len(b.Events) > 0 && b.Events[0].Tag == "AllBlocksCleared"
}

func (s *Subscriber) fail(format string, args ...any) {
	s.mu.Lock()
	s.counts.Errors = append(s.counts.Errors, fmt.Sprintf(format, args...))
	s.mu.Unlock()
}
