// Package storenode is what a process does as a holder of blocks for the
// swarm, on top of a bridge's holdings (internal/holdings):
//
//   - the Inbox of readers' reports (used, bad, want), which every bridge
//     runs (reports.go);
//   - the Keeper of a store-backed bridge's store entries (keeper.go);
//   - a store node's roles, a Node: replication (copies of every block
//     other owners publish, published when their owner lets go) and the
//     disk tier (every block in a file too, spilled on eviction, read back
//     on demand and after a restart), which `mcbridge serve` attaches.
//
// The package imports no bridge code: a Node reaches its bridge only
// through Host, the Keeper through Store, and the bridge, which imports
// this package, runs the Inbox and the Keeper and tells an attached Node
// what only the endpoint sees (evictions, readers' reports, its Close).
package storenode

import (
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/mcbridge/mcbridge/internal/arbiter"
	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/disk"
	"github.com/mcbridge/mcbridge/internal/holdings"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/logs"
)

// Host is what a store node needs from the endpoint it runs on:
// *bridge.Bridge.
type Host interface {
	// Owner names the endpoint in the directory.
	Owner() string
	// Holdings is the pool and the blocks in it.
	Holdings() *holdings.Holdings
	// Arbiter prices recomputation, which ranks blocks for eviction.
	Arbiter() *arbiter.Arbiter
	// SubscribeAll hears every model's directory events until cancel.
	SubscribeAll(func(directory.Event)) (cancel func(), err error)
	// ReadBlock reads the whole block an entry names into the pool at off.
	ReadBlock(e directory.Entry, off int64) error
	// PublishHeld offers held replicas to the directory as the endpoint's.
	PublishHeld(keys []key.BlockKey)
	// Attach has the endpoint tell n what only it sees, until its Close.
	Attach(n *Node) error
}

// ErrParked says that a read timed out with its transfer still in flight:
// the batch was parked with the pool memory it may write into, which the
// caller must leave to the host to free. Host.ReadBlock's errors wrap it.
var ErrParked = errors.New("transfer parked in flight")

// Config builds a Node.
type Config struct {
	// Disk is the node's disk tier, nil for none. The caller keeps
	// ownership of it; the node uses it until the bridge closes, which
	// writes every block of the pool to it first.
	Disk *disk.Tier
	// Log hears what no caller can: blocks the disk tier could not take or
	// give back. Nil is the process's rate-limited stderr log.
	Log *slog.Logger
}

// Node is a store node's roles on one bridge. Safe for concurrent use.
type Node struct {
	host  Host
	hold  *holdings.Holdings
	log   *slog.Logger
	stats counters
	tier  *diskTier // nil without a disk tier

	mu      sync.Mutex
	stopped bool
	// stopReplication ends replication (Replicate).
	stopReplication func()
}

type counters struct {
	replicated, replicationFailures, persisted, spilled, pagedIn atomic.Int64
}

// New attaches a store node to host, with the disk tier cfg gives, and
// starts the tier. Replicate starts replication.
func New(host Host, cfg Config) (*Node, error) {
	n := &Node{host: host, hold: host.Holdings(), log: cfg.Log}
	if n.log == nil {
		n.log = logs.Default()
	}
	if cfg.Disk != nil {
		n.tier = newDiskTier(n, cfg.Disk)
	}
	if err := host.Attach(n); err != nil {
		return nil, err
	}
	if n.tier != nil {
		go n.tier.run()
	}
	return n, nil
}

// Stop ends replication, then has the disk tier write what the pool holds
// and end. The bridge calls it at Close, before it unpublishes its blocks.
func (n *Node) Stop() {
	n.mu.Lock()
	n.stopped = true
	stopReplication := n.stopReplication
	n.stopReplication = nil
	n.mu.Unlock()
	if stopReplication != nil {
		stopReplication()
	}
	if n.tier != nil {
		n.tier.stopOnce()
	}
}

// Evicted writes blocks evicted from the pool to the disk tier, when there
// is one, before their memory is reused.
func (n *Node) Evicted(gone []holdings.Entry) {
	if n.tier != nil {
		n.tier.spill(gone)
	}
}

// Used counts the blocks readers restored as used on the disk tier too.
func (n *Node) Used(keys []key.BlockKey) {
	if n.tier != nil {
		n.tier.disk.Touch(keys...)
	}
}

// Wanted queues the blocks a reader's lookup wanted next, for the disk
// tier to bring back.
func (n *Node) Wanted(keys []key.BlockKey) {
	if n.tier != nil {
		n.tier.want(keys)
	}
}

// Stats are a node's counters since New.
type Stats struct {
	Replicated       int64 // blocks copied from their owners
	ReplicationFails int64
	Persisted        int64 // blocks written behind to the disk
	Spilled          int64 // blocks written on eviction
	PagedIn          int64 // blocks read back from the disk into the pool
}

// Stats returns a snapshot of the node's counters.
func (n *Node) Stats() Stats {
	c := &n.stats
	return Stats{Replicated: c.replicated.Load(), ReplicationFails: c.replicationFailures.Load(),
		Persisted: c.persisted.Load(), Spilled: c.spilled.Load(), PagedIn: c.pagedIn.Load()}
}

// DiskStats is the disk tier's counters; zero without one.
func (n *Node) DiskStats() disk.Stats {
	if n.tier == nil {
		return disk.Stats{}
	}
	return n.tier.disk.Stats()
}

// blockCost is what recomputing a block at depth costs, by the arbiter's
// prefill model: a block further down a chain attends to more positions.
func (n *Node) blockCost(blockTokens int, depth uint32) float64 {
	start := int(depth) * blockTokens
	return n.host.Arbiter().PrefillTime(start, start+blockTokens).Seconds()
}
