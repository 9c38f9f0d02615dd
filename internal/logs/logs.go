// Package logs is where the bridge says what went wrong when no caller can
// hear it: a directory that cannot be read, a lease lost, an entry that does
// not decode. It writes to the host's stderr, where llama-server's own log
// goes, and rate-limits each message so that a failure repeated on every
// request costs one line per interval, with a count of those suppressed.
package logs

import (
	"context"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"
)

// Env names the variable that sets the level: debug, info (the default),
// warn, error or off.
const Env = "MCB_LOG"

// Interval is how often one message may be written.
const Interval = 10 * time.Second

// maxTracked bounds the messages whose last write is remembered; beyond it
// the oldest are forgotten and may be written again early.
const maxTracked = 1024

var std = sync.OnceValue(func() *slog.Logger { return New(os.Stderr, os.Getenv(Env), time.Now) })

// Default is the process's logger: stderr, level from MCB_LOG.
func Default() *slog.Logger { return std() }

// New returns a rate-limited text logger writing to w at level (see Env).
func New(w io.Writer, level string, now func() time.Time) *slog.Logger {
	var lv slog.Level
	switch strings.ToLower(level) {
	case "debug":
		lv = slog.LevelDebug
	case "warn":
		lv = slog.LevelWarn
	case "error":
		lv = slog.LevelError
	case "off":
		return slog.New(slog.DiscardHandler)
	default:
		lv = slog.LevelInfo
	}
	h := slog.NewTextHandler(w, &slog.HandlerOptions{Level: lv})
	return slog.New(&limited{next: h, state: &limiter{now: now, last: map[string]*seen{}}})
}

type seen struct {
	at         time.Time
	suppressed int
}

type limiter struct {
	now func() time.Time

	mu    sync.Mutex
	last  map[string]*seen
	order []string // insertion order, for forgetting
}

// admit reports whether a record with this message may be written now and
// how many were suppressed since the last one written.
func (l *limiter) admit(msg string) (bool, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	s, ok := l.last[msg]
	if ok && now.Sub(s.at) < Interval {
		s.suppressed++
		return false, 0
	}
	if !ok {
		if len(l.order) >= maxTracked {
			delete(l.last, l.order[0])
			l.order = l.order[1:]
		}
		s = &seen{}
		l.last[msg] = s
		l.order = append(l.order, msg)
	}
	n := s.suppressed
	s.at, s.suppressed = now, 0
	return true, n
}

type limited struct {
	next  slog.Handler
	state *limiter
}

func (h *limited) Enabled(ctx context.Context, lv slog.Level) bool { return h.next.Enabled(ctx, lv) }

func (h *limited) Handle(ctx context.Context, r slog.Record) error {
	ok, suppressed := h.state.admit(r.Message)
	if !ok {
		return nil
	}
	if suppressed > 0 {
		r = r.Clone()
		r.AddAttrs(slog.Int("suppressed", suppressed))
	}
	return h.next.Handle(ctx, r)
}

func (h *limited) WithAttrs(as []slog.Attr) slog.Handler {
	return &limited{next: h.next.WithAttrs(as), state: h.state}
}

func (h *limited) WithGroup(name string) slog.Handler {
	return &limited{next: h.next.WithGroup(name), state: h.state}
}
