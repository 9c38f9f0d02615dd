package storenode

import (
	"encoding/hex"
	"log/slog"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

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
// the reader's side (internal/bridge, reports.go) sends at most one
// message per holder and kind every short interval. This file is the
// messages and the holder's side, the Inbox, which every bridge runs.
const (
	ReportName     = "mcbridge/1"           // the notification's name; messages of other names are not ours
	MaxReportItems = 64                     // keys per message: 64 x 33 bytes stays far below every engine's limit
	inboxPoll      = 20 * time.Millisecond  // after a message: the next ones follow it
	inboxIdlePoll  = 320 * time.Millisecond // the slowest, reached by doubling while none come
)

// ReportKind is what a report says of its blocks.
type ReportKind byte

const (
	ReportUsed ReportKind = 'u'
	ReportBad  ReportKind = 'b'
	ReportWant ReportKind = 'w'
)

// ReportItem is one block of a report; Gen only for bad ones.
type ReportItem struct {
	Key key.BlockKey
	Gen uint64
}

// EncodeReports renders items as messages of at most MaxReportItems each:
// the kind, then per item the key in hex and, for bad ones, ":generation".
func EncodeReports(kind ReportKind, items []ReportItem) []string {
	var out []string
	for len(items) > 0 {
		n := min(len(items), MaxReportItems)
		var sb strings.Builder
		sb.WriteByte(byte(kind))
		for _, it := range items[:n] {
			sb.WriteByte(' ')
			sb.WriteString(it.Key.String())
			if kind == ReportBad {
				sb.WriteByte(':')
				sb.WriteString(strconv.FormatUint(it.Gen, 10))
			}
		}
		out = append(out, sb.String())
		items = items[n:]
	}
	return out
}

// ParseReport reads one message of EncodeReports.
func ParseReport(msg string) (ReportKind, []ReportItem, error) {
	fields := strings.Fields(msg)
	if len(fields) < 2 || len(fields[0]) != 1 || len(fields) > MaxReportItems+1 {
		return 0, nil, status.Errorf(status.InvalidArg, "report of %d fields", len(fields))
	}
	kind := ReportKind(fields[0][0])
	if kind != ReportUsed && kind != ReportBad && kind != ReportWant {
		return 0, nil, status.Errorf(status.InvalidArg, "report kind %q", fields[0])
	}
	items := make([]ReportItem, 0, len(fields)-1)
	for _, f := range fields[1:] {
		var it ReportItem
		hexKey := f
		if kind == ReportBad {
			k, g, ok := strings.Cut(f, ":")
			gen, err := strconv.ParseUint(g, 10, 64)
			if !ok || err != nil {
				return 0, nil, status.Errorf(status.InvalidArg, "bad-block report %q: want key:generation", f)
			}
			hexKey, it.Gen = k, gen
		}
		if len(hexKey) != 2*len(it.Key) {
			return 0, nil, status.Errorf(status.InvalidArg, "report key %q", hexKey)
		}
		if _, err := hex.Decode(it.Key[:], []byte(hexKey)); err != nil {
			return 0, nil, status.Errorf(status.InvalidArg, "report key %q: %v", hexKey, err)
		}
		items = append(items, it)
	}
	return kind, items, nil
}

// Inbox is a holder's side of the reports: it counts the uses readers
// report, checks the blocks they found bad, and hands used and wanted
// blocks to the store node attached, if any. Safe for concurrent use.
type Inbox struct {
	hold *holdings.Holdings
	node func() *Node // the attached store node, or nil
	log  *slog.Logger

	peerUses, unreadable atomic.Int64
	badChecks            [holdings.Outcomes]atomic.Int64
}

// InboxStats are an inbox's counters.
type InboxStats struct {
	PeerUses   int64 // restores of this pool's blocks that readers reported
	Unreadable int64 // notifications of ours that could not be parsed
	// BadChecks counts the checks of reported blocks by holdings' outcome
	// (holdings.Dropped, Intact, Gone, Busy).
	BadChecks [holdings.Outcomes]int64
}

// NewInbox is the inbox of the blocks hold holds; node says which store
// node is attached (nil for none) when a report comes.
func NewInbox(hold *holdings.Holdings, node func() *Node, log *slog.Logger) *Inbox {
	return &Inbox{hold: hold, node: node, log: log}
}

// Stats returns a snapshot of the inbox's counters.
func (in *Inbox) Stats() InboxStats {
	s := InboxStats{PeerUses: in.peerUses.Load(), Unreadable: in.unreadable.Load()}
	for i := range in.badChecks {
		s.BadChecks[i] = in.badChecks[i].Load()
	}
	return s
}

// Run polls the engine's notifications and acts on the reports among them
// until stop closes. The engines can only be polled, and each poll wakes
// the Go runtime's threads too, which on a machine with no spare core take
// it from the host's compute threads: an idle holder backs off to
// inboxIdlePoll.
func (in *Inbox) Run(n transport.Notifier, stop <-chan struct{}) {
	wait := inboxPoll
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		select {
		case <-stop:
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
			in.log.Warn("mcbridge: reading the engine's notifications", "err", err)
			continue
		}
		for _, m := range msgs {
			if m.Name != ReportName {
				continue
			}
			kind, items, err := ParseReport(m.Msg)
			if err != nil {
				in.unreadable.Add(1)
				in.log.Warn("mcbridge: an unreadable report from a reader", "err", err)
				continue
			}
			in.Handle(kind, items)
		}
	}
}

// Handle acts on one report: the reader's side hands this process's own
// reports here directly.
func (in *Inbox) Handle(kind ReportKind, items []ReportItem) {
	blockKeys := func() []key.BlockKey {
		keys := make([]key.BlockKey, len(items))
		for i, it := range items {
			keys[i] = it.Key
		}
		return keys
	}
	switch kind {
	case ReportUsed:
		keys := blockKeys()
		in.peerUses.Add(int64(in.hold.Touch(keys...)))
		if n := in.node(); n != nil {
			n.Used(keys)
		}
	case ReportBad:
		for _, it := range items {
			in.recheck(it.Key, it.Gen)
		}
	case ReportWant:
		if n := in.node(); n != nil {
			n.Wanted(blockKeys())
		}
	}
}

// recheck verifies this pool's copy of a block a reader found bad, and
// drops it (with the blocks under it, which no prefix reaches without
// it) and unpublishes it when it fails here too.
func (in *Inbox) recheck(k key.BlockKey, gen uint64) {
	outcome, why, n := in.hold.Drop(k, gen, func(s holdings.Block, block []byte) error {
		_, _, err := pool.VerifyBlock(block, &pool.Expect{Key: k, Parent: s.Entry.Parent, Model: s.Model, Generation: gen})
		if err == nil && pool.HeaderSum(block) != s.Entry.Loc.Checksum {
			err = status.Errorf(status.Corrupt, "block %s header sum differs from the directory's", k)
		}
		return err
	})
	if outcome == holdings.Dropped {
		in.log.Warn("mcbridge: a block readers found bad fails here too: dropped and unpublished", "block", k, "err", why, "with", n-1)
	}
	in.badChecks[outcome].Add(1)
}
