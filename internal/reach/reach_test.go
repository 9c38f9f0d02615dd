package reach

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// lines records what a Watch writes: level and message.
type lines struct {
	mu  sync.Mutex
	got []string
}

func (l *lines) Enabled(context.Context, slog.Level) bool { return true }
func (l *lines) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.got = append(l.got, r.Level.String()+" "+r.Message)
	return nil
}
func (l *lines) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *lines) WithGroup(string) slog.Handler      { return l }

func (l *lines) take() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := l.got
	l.got = nil
	return out
}

type clock struct{ t time.Time }

func (c *clock) now() time.Time          { return c.t }
func (c *clock) advance(d time.Duration) { c.t = c.t.Add(d) }

const (
	down  = "WARN mcbridge: swarm unreachable: restoring only what this process holds"
	still = "WARN mcbridge: swarm still unreachable"
	back  = "INFO mcbridge: swarm reachable again"
	grace = 5 * time.Second
)

var errDir = errors.New("etcd at http://127.0.0.1:2379 unreachable")

func newWatch() (*Watch, *lines, *clock) {
	l := &lines{}
	c := &clock{t: time.Unix(1000, 0)}
	return New(slog.New(l), c.now, grace), l, c
}

func TestOutageAndRecoveryWriteOneLineEach(t *testing.T) {
	w, l, c := newWatch()
	w.Probe(nil)
	assert.Empty(t, l.take(), "a swarm that answers says nothing")
	c.advance(grace)
	w.Probe(errDir)
	w.Probe(errDir)
	assert.Equal(t, []string{down}, l.take(), "one warning when the swarm goes, none for probes that find it gone")
	c.advance(time.Minute)
	w.Probe(nil)
	w.Probe(nil)
	assert.Equal(t, []string{back}, l.take(), "one line when it is back")
}

func TestAnErrorWithinTheFirstDialsGraceIsNoOutage(t *testing.T) {
	w, l, c := newWatch()
	w.Probe(errDir)
	w.Met("lookup", errDir)
	c.advance(grace - time.Nanosecond)
	w.Probe(errDir)
	assert.Empty(t, l.take(), "still connecting")
	w.Probe(nil)
	assert.Empty(t, l.take(), "connected: nothing was said, so nothing is taken back")
	c.advance(time.Hour)
	w.Met("publish", errDir)
	assert.Equal(t, []string{down}, l.take(), "after the grace an error is an outage")
}

func TestAStartWithoutTheSwarmIsReportedOnceTheGraceEnds(t *testing.T) {
	w, l, c := newWatch()
	w.Probe(errDir)
	c.advance(grace)
	w.Probe(errDir)
	assert.Equal(t, []string{down}, l.take())
}

func TestFailuresDuringAnOutageRemindAtMostOnceAnInterval(t *testing.T) {
	w, l, c := newWatch()
	c.advance(grace)
	w.Met("publish", errDir)
	require.Equal(t, []string{down}, l.take())
	for range 5 {
		c.advance(Interval / 5)
		w.Met("lookup", errDir)
		w.Probe(errDir)
	}
	assert.Equal(t, []string{still}, l.take(), "five failures over one interval: one reminder, at its end")
	c.advance(Interval - time.Nanosecond)
	w.Met("lookup", errDir)
	assert.Empty(t, l.take())
	c.advance(time.Nanosecond)
	w.Met("lookup", errDir)
	assert.Equal(t, []string{still}, l.take())
	w.Met("lookup", nil)
	assert.Equal(t, []string{back}, l.take(), "an operation that finds the swarm back clears the outage")
}

func TestProbesNeverRemind(t *testing.T) {
	w, l, c := newWatch()
	c.advance(grace)
	w.Probe(errDir)
	require.Equal(t, []string{down}, l.take())
	for range 10 {
		c.advance(Interval)
		w.Probe(errDir)
	}
	assert.Empty(t, l.take(), "an idle process says it once")
}
