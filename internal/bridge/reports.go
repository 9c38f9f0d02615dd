package bridge

import (
	"context"
	"sync"
	"time"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/storenode"
	"github.com/mcbridge/mcbridge/internal/transport"
)

// The reader's side of the reports to blocks' holders (storenode's
// reports.go says what they are and why notifications): reports are
// queued by the host's thread, one map insert each, and sent by the
// bridge's goroutine, at most one message per holder and kind every
// reportDelay (BenchmarkReport measures both). The holder's side is the
// bridge's storenode.Inbox.
const (
	reportDelay   = 10 * time.Millisecond
	reportTimeout = time.Second
	maxQueued     = 4096 // keys queued per holder; beyond, reports are dropped and counted
	wantAhead     = 16   // blocks a want names past the last one found
)

// outbox is what waits to be told to one holder.
type outbox struct {
	used map[key.BlockKey]struct{}
	bad  map[key.BlockKey]uint64
	want []key.BlockKey
	seen map[key.BlockKey]struct{} // of want
}

func (o *outbox) size() int { return len(o.used) + len(o.bad) + len(o.want) }

// reporter is the reader's side: reports queued by the host's thread and
// sent by the bridge's goroutine.
type reporter struct {
	mu    sync.Mutex
	boxes map[string]*outbox // by holder segment
	wake  chan struct{}
	stop  chan struct{}
	done  chan struct{}
	once  sync.Once
}

// startReports builds the inbox and, when the engine can send and receive
// notifications, starts the reporter and the inbox's polling. Without a
// Notifier nothing is reported: the holder ranks by its own restores and
// republishes alone.
func (b *Bridge) startReports() {
	b.inbox = storenode.NewInbox(b.hold, b.storeNode, b.log)
	n, ok := b.tr.(transport.Notifier)
	if !ok {
		return
	}
	r := &reporter{boxes: map[string]*outbox{}, wake: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	b.rep = r
	go b.sendLoop(r, n)
	go func() {
		defer func() { r.done <- struct{}{} }()
		b.inbox.Run(n, r.stop)
	}()
}

// stopReports ends both goroutines; what is still queued is not sent.
func (b *Bridge) stopReports() {
	r := b.rep
	if r == nil {
		return
	}
	r.once.Do(func() {
		close(r.stop)
		<-r.done
		<-r.done
	})
}

// queue adds a report for the holder behind segment; it never blocks.
func (b *Bridge) queue(segment string, kind storenode.ReportKind, items ...storenode.ReportItem) {
	r := b.rep
	if r == nil || len(items) == 0 {
		return
	}
	r.mu.Lock()
	o := r.boxes[segment]
	if o == nil {
		o = &outbox{used: map[key.BlockKey]struct{}{}, bad: map[key.BlockKey]uint64{}, seen: map[key.BlockKey]struct{}{}}
		r.boxes[segment] = o
	}
	dropped := 0
	for _, it := range items {
		if o.size() >= maxQueued {
			dropped++
			continue
		}
		switch kind {
		case storenode.ReportUsed:
			o.used[it.Key] = struct{}{}
		case storenode.ReportBad:
			o.bad[it.Key] = it.Gen
		case storenode.ReportWant:
			if _, dup := o.seen[it.Key]; !dup {
				o.seen[it.Key] = struct{}{}
				o.want = append(o.want, it.Key)
			}
		}
	}
	r.mu.Unlock()
	if dropped > 0 {
		b.stats.add(&b.stats.reportsDropped, int64(dropped))
	}
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// noteRestored reports the blocks a load restored from their holders.
func (b *Bridge) noteRestored(blocks []loadBlock) {
	local := b.tr.LocalSegment()
	for i := range blocks {
		if e := &blocks[i].entry; e.Loc.Segment != local {
			b.queue(e.Loc.Segment, storenode.ReportUsed, storenode.ReportItem{Key: e.Key})
		}
	}
}

// suspect is a load's hook for a block that failed. One that failed
// verification (status.Corrupt) is reported to its holder, or checked
// here when it is this process's own; a transfer that failed retires the
// holder's cached segment.
func (b *Bridge) suspect(e *directory.Entry, err error) {
	switch status.Of(err) {
	case status.Corrupt:
		b.stats.add(&b.stats.badReported, 1)
		b.queue(e.Loc.Segment, storenode.ReportBad, storenode.ReportItem{Key: e.Key, Gen: e.Loc.Generation})
	case status.Transfer:
		if e.Loc.Segment != b.tr.LocalSegment() {
			b.retireSegment(e.Loc.Segment)
		}
	}
}

// wantAfter tells the holder of a prompt's last block found which blocks
// the prompt wanted next.
func (b *Bridge) wantAfter(segment string, next []key.BlockKey) {
	if _, _, inStore := parseStoreSegment(segment); inStore || segment == "" || segment == b.tr.LocalSegment() || len(next) == 0 {
		return
	}
	items := make([]storenode.ReportItem, 0, min(len(next), wantAhead))
	for _, k := range next[:min(len(next), wantAhead)] {
		items = append(items, storenode.ReportItem{Key: k})
	}
	b.queue(segment, storenode.ReportWant, items...)
}

func (b *Bridge) sendLoop(r *reporter, n transport.Notifier) {
	defer func() { r.done <- struct{}{} }()
	for {
		select {
		case <-r.stop:
			return
		case <-r.wake:
		}
		// Reports that arrive close together go out as one message.
		select {
		case <-r.stop:
			return
		case <-time.After(reportDelay):
		}
		r.mu.Lock()
		boxes := r.boxes
		r.boxes = map[string]*outbox{}
		r.mu.Unlock()
		for segment, o := range boxes {
			b.send(n, segment, o)
		}
	}
}

// send delivers one holder's reports: this process's own are handled
// here, a peer's go out as notifications.
func (b *Bridge) send(n transport.Notifier, segment string, o *outbox) {
	var msgs []string
	byKind := map[storenode.ReportKind][]storenode.ReportItem{}
	for k := range o.used {
		byKind[storenode.ReportUsed] = append(byKind[storenode.ReportUsed], storenode.ReportItem{Key: k})
	}
	for k, g := range o.bad {
		byKind[storenode.ReportBad] = append(byKind[storenode.ReportBad], storenode.ReportItem{Key: k, Gen: g})
	}
	for _, k := range o.want {
		byKind[storenode.ReportWant] = append(byKind[storenode.ReportWant], storenode.ReportItem{Key: k})
	}
	if segment == b.tr.LocalSegment() {
		for kind, items := range byKind {
			b.inbox.Handle(kind, items)
		}
		return
	}
	for _, kind := range []storenode.ReportKind{storenode.ReportBad, storenode.ReportUsed, storenode.ReportWant} {
		msgs = append(msgs, storenode.EncodeReports(kind, byKind[kind])...)
	}
	ctx, cancel := context.WithTimeout(context.Background(), reportTimeout)
	seg, err := b.segment(ctx, segment)
	cancel()
	if err != nil {
		b.stats.add(&b.stats.reportsFailed, int64(len(msgs)))
		return
	}
	for _, msg := range msgs {
		ctx, cancel := context.WithTimeout(context.Background(), reportTimeout)
		err := n.SendNotify(ctx, seg, storenode.ReportName, msg)
		cancel()
		if err != nil {
			// The holder is gone or unreachable: what it would have
			// learnt no longer matters to it.
			b.stats.add(&b.stats.reportsFailed, 1)
			b.log.Debug("mcbridge: a report to a block's holder failed", "segment", segment, "err", err)
			return
		}
		b.stats.add(&b.stats.reportsSent, 1)
	}
}
