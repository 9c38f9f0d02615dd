package bridge

import (
	"context"
	"encoding/hex"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/holdings"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/transport"
)

// Readers tell a block's holder what happened to the blocks they read, as
// Transfer Engine notifications to the holder's segment (the path they
// already have to it):
//
//   - used: blocks restored and verified. Reads through the engine are
//     invisible to the holder; these reports are its only measure of
//     demand, and its eviction ranks by them.
//   - bad: blocks that failed verification, with the generation read. The
//     holder checks its copy again and, if that fails too, drops it and
//     unpublishes it, so that no later reader pays a failed restore for it.
//   - want: the blocks a reader's lookup wanted right after the last one
//     this holder gave it. A store node with a disk tier reads them back
//     into its pool and publishes them.
//
// Why notifications: a use counter in the directory would be an etcd
// write per restore, watched by every mirror; an HTTP call would need the
// holder's address (the directory names only its segment) and a listener
// in every host. A notification costs the host's thread one map insert;
// the bridge's own goroutine sends at most one message per holder and kind
// every reportDelay (BenchmarkReport measures both).
const (
	reportName     = "mcbridge/1" // the notification's name; messages of other names are not ours
	reportDelay    = 10 * time.Millisecond
	inboxPoll      = 20 * time.Millisecond  // after a message: the next ones follow it
	inboxIdlePoll  = 320 * time.Millisecond // the slowest, reached by doubling while none come
	reportTimeout  = time.Second
	maxReportItems = 64   // keys per message: 64 x 33 bytes stays far below every engine's limit
	maxQueued      = 4096 // keys queued per holder; beyond, reports are dropped and counted
	wantAhead      = 16   // blocks a want names past the last one found
)

type reportKind byte

const (
	reportUsed reportKind = 'u'
	reportBad  reportKind = 'b'
	reportWant reportKind = 'w'
)

// reportItem is one block of a report; gen only for bad ones.
type reportItem struct {
	key key.BlockKey
	gen uint64
}

// encodeReports renders items as messages of at most maxReportItems each:
// the kind, then per item the key in hex and, for bad ones, ":generation".
func encodeReports(kind reportKind, items []reportItem) []string {
	var out []string
	for len(items) > 0 {
		n := min(len(items), maxReportItems)
		var sb strings.Builder
		sb.WriteByte(byte(kind))
		for _, it := range items[:n] {
			sb.WriteByte(' ')
			sb.WriteString(it.key.String())
			if kind == reportBad {
				sb.WriteByte(':')
				sb.WriteString(strconv.FormatUint(it.gen, 10))
			}
		}
		out = append(out, sb.String())
		items = items[n:]
	}
	return out
}

// parseReport reads one message of encodeReports.
func parseReport(msg string) (reportKind, []reportItem, error) {
	fields := strings.Fields(msg)
	if len(fields) < 2 || len(fields[0]) != 1 || len(fields) > maxReportItems+1 {
		return 0, nil, status.Errorf(status.InvalidArg, "report of %d fields", len(fields))
	}
	kind := reportKind(fields[0][0])
	if kind != reportUsed && kind != reportBad && kind != reportWant {
		return 0, nil, status.Errorf(status.InvalidArg, "report kind %q", fields[0])
	}
	items := make([]reportItem, 0, len(fields)-1)
	for _, f := range fields[1:] {
		var it reportItem
		hexKey := f
		if kind == reportBad {
			k, g, ok := strings.Cut(f, ":")
			gen, err := strconv.ParseUint(g, 10, 64)
			if !ok || err != nil {
				return 0, nil, status.Errorf(status.InvalidArg, "bad-block report %q: want key:generation", f)
			}
			hexKey, it.gen = k, gen
		}
		if len(hexKey) != 2*len(it.key) {
			return 0, nil, status.Errorf(status.InvalidArg, "report key %q", hexKey)
		}
		if _, err := hex.Decode(it.key[:], []byte(hexKey)); err != nil {
			return 0, nil, status.Errorf(status.InvalidArg, "report key %q: %v", hexKey, err)
		}
		items = append(items, it)
	}
	return kind, items, nil
}

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

// startReports starts the reporter and, when the engine can receive
// notifications, the inbox. Without a Notifier nothing is reported:
// the holder ranks by its own restores and republishes alone.
func (b *Bridge) startReports() {
	n, ok := b.tr.(transport.Notifier)
	if !ok {
		return
	}
	r := &reporter{boxes: map[string]*outbox{}, wake: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	b.rep = r
	go b.sendLoop(r, n)
	go b.inboxLoop(r, n)
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
func (b *Bridge) queue(segment string, kind reportKind, items ...reportItem) {
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
		case reportUsed:
			o.used[it.key] = struct{}{}
		case reportBad:
			o.bad[it.key] = it.gen
		case reportWant:
			if _, dup := o.seen[it.key]; !dup {
				o.seen[it.key] = struct{}{}
				o.want = append(o.want, it.key)
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
			b.queue(e.Loc.Segment, reportUsed, reportItem{key: e.Key})
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
		b.queue(e.Loc.Segment, reportBad, reportItem{key: e.Key, gen: e.Loc.Generation})
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
	items := make([]reportItem, 0, min(len(next), wantAhead))
	for _, k := range next[:min(len(next), wantAhead)] {
		items = append(items, reportItem{key: k})
	}
	b.queue(segment, reportWant, items...)
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
	byKind := map[reportKind][]reportItem{}
	for k := range o.used {
		byKind[reportUsed] = append(byKind[reportUsed], reportItem{key: k})
	}
	for k, g := range o.bad {
		byKind[reportBad] = append(byKind[reportBad], reportItem{key: k, gen: g})
	}
	for _, k := range o.want {
		byKind[reportWant] = append(byKind[reportWant], reportItem{key: k})
	}
	if segment == b.tr.LocalSegment() {
		for kind, items := range byKind {
			b.handleReport(kind, items)
		}
		return
	}
	for _, kind := range []reportKind{reportBad, reportUsed, reportWant} {
		msgs = append(msgs, encodeReports(kind, byKind[kind])...)
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
		err := n.SendNotify(ctx, seg, reportName, msg)
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

// inboxLoop is the holder's side: it polls the engine's notifications
// and acts on this bridge's reports. The engines can only be polled, and
// each poll wakes the Go runtime's threads too, which on a machine with no
// spare core take it from the host's compute threads: an idle host backs
// off to inboxIdlePoll.
func (b *Bridge) inboxLoop(r *reporter, n transport.Notifier) {
	defer func() { r.done <- struct{}{} }()
	wait := inboxPoll
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		select {
		case <-r.stop:
			return
		case <-timer.C:
		}
		msgs, err := n.Notifications()
		if len(msgs) > 0 {
			wait = inboxPoll
		} else {
			wait = min(2*wait, inboxIdlePoll)
		}
		timer.Reset(wait)
		if err != nil {
			b.log.Warn("mcbridge: reading the engine's notifications", "err", err)
			continue
		}
		for _, m := range msgs {
			if m.Name != reportName {
				continue
			}
			kind, items, err := parseReport(m.Msg)
			if err != nil {
				b.stats.add(&b.stats.reportsUnreadable, 1)
				b.log.Warn("mcbridge: an unreadable report from a reader", "err", err)
				continue
			}
			b.handleReport(kind, items)
		}
	}
}

func (b *Bridge) handleReport(kind reportKind, items []reportItem) {
	switch kind {
	case reportUsed:
		keys := make([]key.BlockKey, len(items))
		for i, it := range items {
			keys[i] = it.key
		}
		n := b.hold.Touch(keys...)
		b.stats.add(&b.stats.peerUses, int64(n))
		if sn := b.storeNode(); sn != nil {
			sn.Used(keys)
		}
	case reportBad:
		for _, it := range items {
			b.recheck(it.key, it.gen)
		}
	case reportWant:
		if sn := b.storeNode(); sn != nil {
			keys := make([]key.BlockKey, len(items))
			for i, it := range items {
				keys[i] = it.key
			}
			sn.Wanted(keys)
		}
	}
}

// Outcomes of a holder's check of a block a reader reported, as Drop
// returns them: the copy here fails too (dropped and unpublished), it
// verifies (the reader's read went wrong), it is no longer held at that
// generation, or a load here holds it (checked again on the next report).
const badOutcomes = holdings.Outcomes

var badOutcomeNames = [badOutcomes]string{holdings.Dropped: "dropped", holdings.Intact: "intact", holdings.Gone: "gone", holdings.Busy: "busy"}

// recheck verifies this pool's copy of a block a reader found bad, and
// drops it (with the blocks under it, which no prefix reaches without
// it) and unpublishes it when it fails here too.
func (b *Bridge) recheck(k key.BlockKey, gen uint64) {
	outcome, why, n := b.hold.Drop(k, gen, func(s holdings.Block, block []byte) error {
		_, _, err := pool.VerifyBlock(block, &pool.Expect{Key: k, Parent: s.Entry.Parent, Model: s.Model, Generation: gen})
		if err == nil && pool.HeaderSum(block) != s.Entry.Loc.Checksum {
			err = status.Errorf(status.Corrupt, "block %s header sum differs from the directory's", k)
		}
		return err
	})
	if outcome == holdings.Dropped {
		b.log.Warn("mcbridge: a block readers found bad fails here too: dropped and unpublished", "block", k, "err", why, "with", n-1)
	}
	b.stats.add(&b.stats.badChecks[outcome], 1)
}

// discard forgets blocks that left the pool and withdraws those the
// directory names as this process's; holdings frees their memory after.
func (b *Bridge) discard(gone []holdings.Entry) {
	byModel := map[key.Fingerprint][]key.BlockKey{}
	for _, e := range gone {
		// A block in the store stays published: the store still holds it.
		if b.store != nil && b.store.names(e.Value.Entry.Loc) {
			continue
		}
		if e.Value.State.Ours() {
			byModel[e.Value.Model] = append(byModel[e.Value.Model], e.Key)
		}
		if m := b.model(e.Value.Model); m != nil {
			m.forget(e.Key, b.tr.LocalSegment())
		}
	}
	b.removedEvents(byModel)
	for fp, keys := range byModel {
		if dropped := b.pub.withdraw(fp, keys); dropped > 0 {
			b.stats.add(&b.stats.unpublishDropped, int64(dropped))
		}
	}
}
