// Package directory records which process holds which block, so that every
// process's local index can match prefixes that others computed.
//
// Two implementations: Memory (one process, the default) and etcd (package
// directory/etcd: many processes and hosts, entries bound to their owner's
// lease). Lookups never ask the directory: each process mirrors it through
// Subscribe.
package directory

import (
	"context"
	"encoding/binary"

	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Location is where a published block can be read.
type Location struct {
	Segment    string // transport segment of the holder
	Addr       uint64 // virtual address of the block in the holder's registered memory
	Length     uint64 // bytes of the whole block: header and payload
	Checksum   uint64 // the block's header sum, which covers every layer's sum
	Generation uint64 // the generation the block had when published
	Owner      string // the publishing process; its lease bounds the entry's life
	// Host names the machine (its kernel's boot id) whose processes can
	// map the holder's pool at Pool (a pool.Address), and read the block
	// there instead of over the transport. Both are empty where the
	// holder's pool is not shared.
	Host string
	Pool string
}

// Entry is one published block of one model.
type Entry struct {
	Model  key.Fingerprint
	Key    key.BlockKey
	Parent key.Hash // previous block, or the scope root
	Loc    Location
}

// EventKind says whether an entry appeared or went away.
type EventKind int

const (
	Put EventKind = iota
	Delete
)

// Event is one change seen by a subscriber. A Delete carries the entry as
// it was published when the directory still knows it, else only the key.
type Event struct {
	Kind  EventKind
	Entry Entry
}

// Directory is the swarm-wide map from block keys to locations.
type Directory interface {
	// Publish stores each entry that is not yet present and reports, per
	// entry, whether the directory now holds exactly it: stored by this
	// call, or by an earlier call whose answer was lost (a timeout after
	// the commit). An entry already held by anyone else is left as it is:
	// two processes saving the same block publish it once, and the loser
	// frees its copy.
	Publish(ctx context.Context, entries []Entry) ([]bool, error)
	// Unpublish removes the given blocks of owner; blocks that another
	// owner holds are left alone.
	Unpublish(ctx context.Context, owner string, model key.Fingerprint, keys []key.BlockKey) error
	// Subscribe calls fn with a Put for every current entry of model and
	// then with every change, in order, from one goroutine at a time, until
	// cancel is called. fn must not call back into the directory.
	Subscribe(model key.Fingerprint, fn func(Event)) (cancel func(), err error)
	// Close releases the directory; an etcd directory revokes its lease,
	// which removes every entry it published.
	Close() error
}

// ErrorCounts are the failures a directory met where no caller could hear
// them: they leave the local mirror stale, so they must show somewhere.
type ErrorCounts struct {
	Lease    int64 // lease grants that failed, and leases lost
	Snapshot int64 // subscription snapshots that could not be read
	Watch    int64 // watches that broke and were restarted
	Decode   int64 // keys or entries this build cannot read, skipped
}

// Checker is a directory whose reachability can change (etcd).
type Checker interface {
	// Healthy is nil while the directory can publish and deliver events,
	// else why it cannot.
	Healthy() error
	// Errors counts the failures since open.
	Errors() ErrorCounts
}

// Watcher is a directory that can also deliver every model's events, as
// a store node that holds blocks of any model needs.
type Watcher interface {
	// SubscribeAll is Subscribe for every model at once.
	SubscribeAll(fn func(Event)) (cancel func(), err error)
}

// Value encoding, shared by directories that store entries as bytes:
//
//	u8 version (2) | parent[16] | addr u64 | length u64 | checksum u64 |
//	generation u64 | str segment | str owner | str host | str pool
//	(str = u16 length + bytes)
//
// Version 1 had no host and pool. Every process of a swarm runs one build,
// so a value of another version is refused, not guessed at.
const valueVersion = 2

// MaxNameLen bounds segment and owner names.
const MaxNameLen = 1024

// EncodeValue encodes the parts of e that are not in its key.
func EncodeValue(e *Entry) []byte {
	b := make([]byte, 0, 1+16+32+8+len(e.Loc.Segment)+len(e.Loc.Owner)+len(e.Loc.Host)+len(e.Loc.Pool))
	b = append(b, valueVersion)
	b = append(b, e.Parent[:]...)
	b = binary.LittleEndian.AppendUint64(b, e.Loc.Addr)
	b = binary.LittleEndian.AppendUint64(b, e.Loc.Length)
	b = binary.LittleEndian.AppendUint64(b, e.Loc.Checksum)
	b = binary.LittleEndian.AppendUint64(b, e.Loc.Generation)
	b = appendName(b, e.Loc.Segment)
	b = appendName(b, e.Loc.Owner)
	b = appendName(b, e.Loc.Host)
	return appendName(b, e.Loc.Pool)
}

func appendName(b []byte, s string) []byte {
	b = binary.LittleEndian.AppendUint16(b, uint16(len(s)))
	return append(b, s...)
}

// DecodeValue parses a value from EncodeValue into e's Parent and Loc.
func DecodeValue(b []byte, e *Entry) error {
	const fixed = 1 + 16 + 32
	if len(b) < fixed || b[0] != valueVersion {
		return status.Errorf(status.Directory, "directory value: bad version or %d bytes", len(b))
	}
	copy(e.Parent[:], b[1:17])
	le := binary.LittleEndian
	e.Loc.Addr = le.Uint64(b[17:])
	e.Loc.Length = le.Uint64(b[25:])
	e.Loc.Checksum = le.Uint64(b[33:])
	e.Loc.Generation = le.Uint64(b[41:])
	rest := b[fixed:]
	var err error
	if e.Loc.Segment, rest, err = readName(rest); err != nil {
		return err
	}
	if e.Loc.Owner, rest, err = readName(rest); err != nil {
		return err
	}
	if e.Loc.Host, rest, err = readName(rest); err != nil {
		return err
	}
	if e.Loc.Pool, rest, err = readName(rest); err != nil {
		return err
	}
	if len(rest) != 0 {
		return status.Errorf(status.Directory, "directory value: %d trailing bytes", len(rest))
	}
	return nil
}

func readName(b []byte) (string, []byte, error) {
	if len(b) < 2 {
		return "", nil, status.Errorf(status.Directory, "directory value: truncated name")
	}
	n := int(binary.LittleEndian.Uint16(b))
	if n > MaxNameLen || len(b)-2 < n {
		return "", nil, status.Errorf(status.Directory, "directory value: name of %d bytes", n)
	}
	return string(b[2 : 2+n]), b[2+n:], nil
}
