// Package reach says, in the log, when a process cannot reach its swarm: the
// directory that names every block, or the store that keeps them. The bridge
// runs on while it cannot (it restores what its mirror and pool still hold and
// computes the rest), so nothing fails where a user would see it: without
// these lines a runner logs "mcbridge: on" and then restores nothing, silently.
// mcbridge_up{reason} says the same to a scraper (package metrics); this is
// for whoever reads the log.
//
// A Watch owns what the swarm's health was when last seen, and its
// transitions: reachable → unreachable writes one warning saying why,
// unreachable → reachable one line saying it is back and after how long.
// While the swarm stays out of reach, each failed publish or lookup that meets
// it writes a reminder, at most one an Interval. A process connects at start:
// an error within the grace of its first dial is not yet an outage.
package reach

import (
	"log/slog"
	"sync"
	"time"
)

// Interval is how often a reminder may be written while the swarm stays
// out of reach.
const Interval = 30 * time.Second

// Watch is one process's view of whether its swarm answers. Safe for
// concurrent use.
type Watch struct {
	log     *slog.Logger
	now     func() time.Time
	started time.Time
	grace   time.Duration

	mu       sync.Mutex
	down     error     // why the swarm is out of reach; nil while it answers
	since    time.Time // when down began
	reminded time.Time // the last line written about down
}

// New starts a watch at now(); errors seen before grace has passed are
// taken for the first connection still being made.
func New(log *slog.Logger, now func() time.Time, grace time.Duration) *Watch {
	return &Watch{log: log, now: now, started: now(), grace: grace}
}

// Probe records the swarm's health as a periodic check found it (nil: it
// answers), writing a line only when the state changes.
func (w *Watch) Probe(health error) { w.observe("probe", health, false) }

// Met records the swarm's health as an operation (what: "publish",
// "lookup") met it: a change writes a line, and so, at most once an
// Interval, does an outage that goes on.
func (w *Watch) Met(what string, health error) { w.observe(what, health, true) }

func (w *Watch) observe(what string, health error, remind bool) {
	now := w.now()
	w.mu.Lock()
	defer w.mu.Unlock()
	switch {
	case health == nil && w.down == nil:
	case health == nil:
		w.log.Info("mcbridge: swarm reachable again", "seen", what, "after", now.Sub(w.since).Round(time.Millisecond))
		w.down = nil
	case w.down == nil:
		if now.Sub(w.started) < w.grace {
			return
		}
		w.down, w.since, w.reminded = health, now, now
		w.log.Warn("mcbridge: swarm unreachable: restoring only what this process holds", "seen", what, "err", health)
	default:
		w.down = health
		if !remind || now.Sub(w.reminded) < Interval {
			return
		}
		w.reminded = now
		w.log.Warn("mcbridge: swarm still unreachable", "seen", what, "since", w.since.Format(time.RFC3339), "err", health)
	}
}
