package kvevents

import (
	"context"
	"encoding/binary"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

const (
	// maxBatchEvents bounds one batch, so that a burst (or the whole state
	// sent again) goes out as several frames of bounded size.
	maxBatchEvents = 1024
	// linger is how long Close lets the socket's own goroutine write the
	// last batches to connected subscribers before it closes them.
	linger = 100 * time.Millisecond
	// closeWait bounds how long Close waits for the publishing goroutine.
	closeWait = 2 * time.Second
)

// endSeq ends a replay: -1 as a signed 64-bit big-endian integer, with an
// empty payload, as vLLM sends it.
var endSeq = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// Stats count block events: a BlockStored or BlockRemoved of n blocks is n
// events, an AllBlocksCleared one.
type Stats struct {
	Published int64 // handed to the PUB socket
	Dropped   int64 // dropped from the full queue (the state was sent again whole)
	Replays   int64 // replay requests answered
}

// Publisher sends this process's block events. Stored, Removed and Clear
// never block: they update the publisher's view and queue the events,
// which one goroutine of its own encodes and sends.
type Publisher struct {
	cfg      config.KVEvents
	instance string
	log      *slog.Logger
	now      func() time.Time
	cancel   context.CancelFunc
	pub      zmq4.Socket
	replay   zmq4.Socket // nil without a replay endpoint

	mu      sync.Mutex
	h       *holdings
	resync  bool // events were dropped: send the whole state before anything else
	closing bool
	wake    chan struct{}
	done    chan struct{}

	bufMu sync.Mutex
	buf   []sent // the last BufferSteps batches, oldest first
	seq   uint64

	replayDone chan struct{}
	published  atomic.Int64
	dropped    atomic.Int64
	replays    atomic.Int64
}

type sent struct {
	seq     uint64
	payload []byte
}

// Open opens the PUB socket (and the replay socket) cfg names. A socket
// that binds is bound before Open returns, so a taken port is an error
// here; one that connects keeps dialling in the background, as libzmq does.
func Open(cfg config.KVEvents, log *slog.Logger, now func() time.Time) (*Publisher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if !cfg.Enabled() {
		return nil, status.Errorf(status.Config, "kv_events is off")
	}
	if now == nil {
		now = time.Now
	}
	p := &Publisher{cfg: cfg, instance: cfg.Instance, log: log, now: now, h: newHoldings(cfg.Medium),
		wake: make(chan struct{}, 1), done: make(chan struct{}), replayDone: make(chan struct{}),
		seq: firstSeq(now())}
	if p.instance == "" {
		p.instance, _ = os.Hostname()
	}
	ctx, cancel := context.WithCancel(context.Background())
	p.cancel = cancel
	binds := Binds(cfg.Endpoint)
	zlog := zmq4.WithLogger(slog.NewLogLogger(log.Handler(), slog.LevelWarn))
	opts := []zmq4.Option{zlog}
	if !binds {
		opts = append(opts, zmq4.WithDialerMaxRetries(-1), zmq4.WithAutomaticReconnect(true))
	}
	p.pub = zmq4.NewPub(ctx, opts...)
	if err := p.pub.SetOption(zmq4.OptionHWM, cfg.HWM); err != nil {
		p.abort()
		return nil, status.Wrap(status.Config, err, "kv_events.hwm")
	}
	if binds {
		if err := p.pub.Listen(cfg.Endpoint); err != nil {
			p.abort()
			return nil, status.Wrap(status.Config, err, "kv_events.endpoint")
		}
	} else {
		go func() {
			if err := p.pub.Dial(cfg.Endpoint); err != nil && ctx.Err() == nil {
				p.log.Warn("mcbridge: kv events: connecting the PUB socket", "endpoint", cfg.Endpoint, "err", err)
			}
		}()
	}
	if cfg.ReplayEndpoint != "" {
		p.replay = zmq4.NewRouter(ctx, zlog)
		if err := p.replay.Listen(cfg.ReplayEndpoint); err != nil {
			p.abort()
			return nil, status.Wrap(status.Config, err, "kv_events.replay_endpoint")
		}
		go p.serveReplays(ctx)
	} else {
		close(p.replayDone)
	}
	go p.run()
	return p, nil
}

// Binds reports whether the PUB endpoint is bound rather than connected,
// by vLLM's rule: a wildcard host, or an ipc:// or inproc:// endpoint.
func Binds(endpoint string) bool {
	return strings.Contains(endpoint, "*") || strings.Contains(endpoint, "::") ||
		strings.HasPrefix(endpoint, "ipc://") || strings.HasPrefix(endpoint, "inproc://")
}

func (p *Publisher) abort() {
	p.cancel()
	_ = p.pub.Close()
	if p.replay != nil {
		_ = p.replay.Close()
	}
}

// Addr is where the PUB socket listens (nil when it connects); with port *
// it tells which port was taken.
func (p *Publisher) Addr() string { return addr(p.pub) }

func addr(s zmq4.Socket) string {
	if a := s.Addr(); a != nil {
		return "tcp://" + a.String()
	}
	return ""
}

// Topic is the topic of a model's events.
func (p *Publisher) Topic(model string) string {
	return strings.NewReplacer("{instance}", p.instance, "{model}", model).Replace(p.cfg.Topic)
}

// Model starts a model's topic: its first batch is AllBlocksCleared, so
// that consumers forget what a killed process publishing under the same
// topic left.
func (p *Publisher) Model(model string, blockSize int) {
	p.update(func() { p.h.topic(p.Topic(model), blockSize) })
}

// Stored announces blocks of model this process now answers for, with the
// chains above them.
func (p *Publisher) Stored(model string, blockSize int, blocks []Block) {
	p.update(func() { p.h.stored(p.h.topic(p.Topic(model), blockSize), blocks) })
}

// Removed announces that blocks are gone from this process; blocks never
// announced are ignored.
func (p *Publisher) Removed(keys []key.BlockKey) {
	p.update(func() { p.h.removed(keys) })
}

// Clear announces that this process holds nothing any more.
func (p *Publisher) Clear() {
	p.update(p.h.clear)
}

func (p *Publisher) update(f func()) {
	p.mu.Lock()
	if p.closing {
		p.mu.Unlock()
		return
	}
	f()
	if p.h.blocks > p.cfg.MaxQueueSize {
		// The view stays exact; the consumers get it whole instead.
		p.dropped.Add(int64(p.h.blocks))
		p.h.take()
		p.resync = true
	}
	p.mu.Unlock()
	p.kick()
}

func (p *Publisher) kick() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// Stats returns the counters.
func (p *Publisher) Stats() Stats {
	return Stats{Published: p.published.Load(), Dropped: p.dropped.Load(), Replays: p.replays.Load()}
}

// Close announces AllBlocksCleared on every topic, sends what is queued
// within a bounded wait, and closes the sockets.
func (p *Publisher) Close() error {
	p.mu.Lock()
	if p.closing {
		p.mu.Unlock()
		return status.Errorf(status.State, "kv events publisher closed twice")
	}
	p.h.clear()
	p.closing = true
	p.mu.Unlock()
	p.kick()
	var err error
	select {
	case <-p.done:
	case <-time.After(closeWait):
		err = status.Errorf(status.Timeout, "kv events: the last batches were not sent within %s", closeWait)
	}
	if p.published.Load() > 0 {
		// The socket has no flush; asking it for its subscribers would take
		// a lock its writer holds while a subscriber is slow.
		time.Sleep(linger)
	}
	p.abort()
	<-p.replayDone
	return err
}

// firstSeq numbers a process's first batch by its start time in
// microseconds, so that a process restarted at the same endpoints continues
// above every number its predecessor sent (unless that one averaged more
// than a batch a microsecond). A consumer that missed the restart then sees
// a gap, and its replay from its last number on brings the new process's
// whole buffer, AllBlocksCleared first. Numbered from 0, as vLLM does, the
// new stream could overtake the old one's last number before the consumer
// heard it and read as the old stream's continuation.
func firstSeq(start time.Time) uint64 { return uint64(max(start.UnixMicro(), 0)) }

// run is the publishing goroutine. With a heartbeat, a topic that sent
// nothing for an interval gets an empty batch, so that a subscriber that
// connected late, or across a restart of this process, sees the sequence
// and catches up through the replay socket without waiting for a change.
func (p *Publisher) run() {
	defer close(p.done)
	var tick <-chan time.Time
	if p.cfg.HeartbeatMS > 0 {
		t := time.NewTicker(time.Duration(p.cfg.HeartbeatMS) * time.Millisecond)
		defer t.Stop()
		tick = t.C
	}
	for {
		p.mu.Lock()
		if p.resync {
			p.h.snapshot()
			p.resync = false
		}
		qs := p.h.take()
		closing := p.closing
		p.mu.Unlock()
		sent := p.send(qs)
		if closing {
			return
		}
		select {
		case <-p.wake:
		case <-tick:
			p.mu.Lock()
			idle := make([]string, 0, len(p.h.topics))
			for _, t := range p.h.sorted() {
				if !sent[t.name] {
					idle = append(idle, t.name)
				}
			}
			p.mu.Unlock()
			for _, name := range idle {
				p.sendBatch(name, &Batch{TS: p.timestamp()}, 0)
			}
		}
	}
}

func (p *Publisher) timestamp() float64 { return float64(p.now().UnixNano()) / 1e9 }

// send encodes queued events into batches, one topic each, sends them, and
// says which topics it sent on.
func (p *Publisher) send(qs []queued) map[string]bool {
	sent := map[string]bool{}
	for len(qs) > 0 {
		n := 1
		for n < len(qs) && n < maxBatchEvents && qs[n].t == qs[0].t {
			n++
		}
		b := Batch{TS: p.timestamp(), Events: make([]Event, n)}
		blocks := 0
		for i := range n {
			b.Events[i] = qs[i].ev
			blocks += max(len(qs[i].ev.Hashes), 1)
		}
		topic := qs[0].t.name
		qs = qs[n:]
		p.sendBatch(topic, &b, blocks)
		sent[topic] = true
	}
	return sent
}

// sendBatch gives b the next sequence number, keeps it for replays and
// hands it to the socket.
func (p *Publisher) sendBatch(topic string, b *Batch, blocks int) {
	payload, err := Encode(b, p.cfg.Encoding == "map")
	if err != nil {
		p.log.Error("mcbridge: kv events", "err", err)
		return
	}
	p.bufMu.Lock()
	seq := p.seq
	p.seq++
	if len(p.buf) == p.cfg.BufferSteps {
		p.buf = append(p.buf[:0], p.buf[1:]...)
	}
	p.buf = append(p.buf, sent{seq: seq, payload: payload})
	p.bufMu.Unlock()
	var seqb [8]byte
	binary.BigEndian.PutUint64(seqb[:], seq)
	// The socket queues (or, past its high-water mark, drops) and writes
	// from a goroutine of its own: this never waits on a subscriber. A
	// batch no subscriber got is still in the buffer.
	if err := p.pub.SendMulti(zmq4.NewMsgFrom([]byte(topic), seqb[:], payload)); err != nil {
		p.log.Warn("mcbridge: kv events: sending a batch", "seq", seq, "err", err)
	}
	p.published.Add(int64(blocks))
}

// serveReplays answers replay requests: [identity, empty, start seq as 8
// bytes big-endian] gets every buffered batch from start on as [identity,
// empty, seq, payload], then [identity, empty, -1, empty].
func (p *Publisher) serveReplays(ctx context.Context) {
	defer close(p.replayDone)
	for {
		msg, err := p.replay.Recv()
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			continue
		}
		f := msg.Frames
		if len(f) != 3 || len(f[1]) != 0 || len(f[2]) != 8 {
			p.log.Warn("mcbridge: kv events: a replay request is not [identity, empty, 8-byte sequence]", "frames", len(f))
			continue
		}
		id, start := f[0], binary.BigEndian.Uint64(f[2])
		p.bufMu.Lock()
		var out []sent
		for _, s := range p.buf {
			if s.seq >= start {
				out = append(out, s)
			}
		}
		p.bufMu.Unlock()
		for _, s := range out {
			var seqb [8]byte
			binary.BigEndian.PutUint64(seqb[:], s.seq)
			if p.replay.SendMulti(zmq4.NewMsgFrom(id, nil, seqb[:], s.payload)) != nil {
				break
			}
		}
		_ = p.replay.SendMulti(zmq4.NewMsgFrom(id, nil, endSeq, nil))
		p.replays.Add(1)
	}
}
