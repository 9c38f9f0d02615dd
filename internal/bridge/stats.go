package bridge

import (
	"sync/atomic"

	"github.com/mcbridge/mcbridge/internal/arbiter"
	"github.com/mcbridge/mcbridge/internal/holdings"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Stats are the bridge's counters since Open.
type Stats struct {
	Lookups           int64
	Hits              int64 // lookups that matched at least one block
	Misses            int64
	DecidedRestore    int64 // lookups the arbiter answered with a restore
	DecidedRecompute  int64 // lookups with a match that the arbiter sent to recompute
	DecidedLocal      int64 // lookups whose host held as much already, or nearly
	MatchedTokens     int64
	Loads             int64
	LoadFailures      int64 // loads that restored less than asked
	RestoredTokens    int64
	RestoredBytes     int64
	Saves             int64
	SaveFailures      int64
	SnapshotsSaved    int64 // partial states stored (snapshot.go)
	SavedBlocks       int64 // published by this process
	DedupedBlocks     int64 // written, but another process published first
	PublishDropped    int64 // sealed blocks the full publish queue could not take
	UnpublishDropped  int64 // evicted blocks whose unpublish the full queue could not take
	Evictions         int64
	DirectoryErrors   int64
	TornReads         int64
	ParkedBatches     int64
	Replicated        int64 // blocks a store node copied from their owners (internal/storenode)
	TakenOver         int64 // copies a store node published when their owner let go
	ReplicationFails  int64
	PeersDown         int64 // times a peer timed out and was planned around
	SharedPoolBlocks  int64 // blocks restored in place from a same-host process's shared pool
	SharedPoolsMapped int64 // same-host processes' shared pools mapped now
	// Reports between readers and blocks' holders (reports.go, and
	// storenode's for the holder's side).
	ReportsSent       int64 // notifications sent to holders
	ReportsFailed     int64 // notifications that could not be sent (holder gone)
	ReportsDropped    int64 // report items a full queue could not take
	ReportsUnreadable int64 // notifications of ours this holder could not parse
	PeerUses          int64 // restores of this pool's blocks that readers reported
	BadReported       int64 // blocks this process found failing verification and reported
	// BadChecks counts the holder's checks of reported blocks by outcome:
	// dropped, intact, gone, busy (BadOutcomeNames).
	BadChecks [holdings.Outcomes]int64
	// A store node's disk tier (internal/storenode).
	Persisted        int64 // blocks written behind to the disk
	Spilled          int64 // blocks written on eviction
	PagedIn          int64 // blocks read back from the disk into the pool
	StorePuts        int64 // blocks written into the store
	StorePutFailures int64 // blocks the store refused; they stayed in the pool, pending
	StoreGets        int64 // blocks read from the store for loads
	StoreAdopted     int64 // store entries this process published again after their owner's went
	StoreDropped     int64 // store entries dropped because the store no longer held their blocks
	// FailuresByStatus counts load failures by the status that ended them.
	FailuresByStatus [status.Count]int64
}

// BadOutcomeNames label Stats.BadChecks: the outcomes of a holder's check
// of a block a reader reported, as holdings.Drop returns them: the copy
// here fails too (dropped and unpublished), it verifies (the reader's read
// went wrong), it is no longer held at that generation, or a load here
// holds it (checked again on the next report).
var BadOutcomeNames = [holdings.Outcomes]string{holdings.Dropped: "dropped", holdings.Intact: "intact", holdings.Gone: "gone", holdings.Busy: "busy"}

type counters struct {
	lookups, hits, misses, decidedRestore, decidedRecompute, decidedLocal   atomic.Int64
	matchedTokens, publishDropped, unpublishDropped                         atomic.Int64
	loads, loadFailures, restoredTokens, restoredBytes                      atomic.Int64
	saves, saveFailures, savedBlocks, dedupedBlocks, snapshotsSaved         atomic.Int64
	evictions, directoryErrors, tornReads, parkedBatches                    atomic.Int64
	takenOver, peersDown, sharedPoolBlocks                                  atomic.Int64
	reportsSent, reportsFailed, reportsDropped, badReported                 atomic.Int64
	storePuts, storePutFailures, storeGets, storeAdopted, storeAuditDropped atomic.Int64
	failuresByStatus                                                        [status.Count]atomic.Int64
}

func (c *counters) add(v *atomic.Int64, n int64) { v.Add(n) }

func (c *counters) lookup(d arbiter.Decision, blockTokens int) {
	c.lookups.Add(1)
	if d.MatchedBlocks == 0 {
		c.misses.Add(1)
		return
	}
	c.hits.Add(1)
	c.matchedTokens.Add(int64(d.MatchedBlocks * blockTokens))
	switch {
	case d.RestoreBlocks > 0:
		c.decidedRestore.Add(1)
	case d.Reason == arbiter.Local:
		c.decidedLocal.Add(1)
	default:
		c.decidedRecompute.Add(1)
	}
}

func (c *counters) load(r LoadResult) {
	c.loads.Add(1)
	c.restoredTokens.Add(int64(r.OKTokens))
	c.restoredBytes.Add(r.Bytes)
	if r.Err != nil {
		c.loadFailures.Add(1)
		c.failuresByStatus[status.Of(r.Err)].Add(1)
	}
}

// Stats returns a snapshot of the counters.
func (b *Bridge) Stats() Stats {
	c := &b.stats
	s := Stats{
		Lookups: c.lookups.Load(), Hits: c.hits.Load(), Misses: c.misses.Load(),
		DecidedRestore: c.decidedRestore.Load(), DecidedRecompute: c.decidedRecompute.Load(), DecidedLocal: c.decidedLocal.Load(),
		MatchedTokens: c.matchedTokens.Load(),
		Loads:         c.loads.Load(), LoadFailures: c.loadFailures.Load(),
		RestoredTokens: c.restoredTokens.Load(), RestoredBytes: c.restoredBytes.Load(),
		Saves: c.saves.Load(), SaveFailures: c.saveFailures.Load(), SnapshotsSaved: c.snapshotsSaved.Load(),
		SavedBlocks: c.savedBlocks.Load(), DedupedBlocks: c.dedupedBlocks.Load(),
		PublishDropped: c.publishDropped.Load(), UnpublishDropped: c.unpublishDropped.Load(),
		Evictions: c.evictions.Load(), DirectoryErrors: c.directoryErrors.Load(),
		TornReads: c.tornReads.Load(), ParkedBatches: c.parkedBatches.Load(),
		TakenOver: c.takenOver.Load(), PeersDown: c.peersDown.Load(), SharedPoolBlocks: c.sharedPoolBlocks.Load(),
		ReportsSent: c.reportsSent.Load(), ReportsFailed: c.reportsFailed.Load(), ReportsDropped: c.reportsDropped.Load(),
		BadReported: c.badReported.Load(),
		StorePuts:   c.storePuts.Load(), StorePutFailures: c.storePutFailures.Load(), StoreGets: c.storeGets.Load(),
		StoreAdopted: c.storeAdopted.Load(), StoreDropped: c.storeAuditDropped.Load(),
	}
	in := b.inbox.Stats()
	s.ReportsUnreadable, s.PeerUses, s.BadChecks = in.Unreadable, in.PeerUses, in.BadChecks
	if b.shared != nil {
		s.SharedPoolsMapped = int64(b.shared.peers.Mapped())
	}
	for i := range c.failuresByStatus {
		s.FailuresByStatus[i] = c.failuresByStatus[i].Load()
	}
	if n := b.storeNode(); n != nil {
		ns := n.Stats()
		s.Replicated, s.ReplicationFails = ns.Replicated, ns.ReplicationFails
		s.Persisted, s.Spilled, s.PagedIn = ns.Persisted, ns.Spilled, ns.PagedIn
	}
	return s
}

// Resident reports the blocks and bytes this bridge holds in its pool, and
// the pool's size.
func (b *Bridge) Resident() (blocks int, bytes, poolBytes int64) {
	blocks, bytes = b.hold.Len()
	return blocks, bytes, b.hold.Size()
}

// Mirrored is the number of blocks the local mirror knows, over every
// registered model.
func (b *Bridge) Mirrored() int {
	b.mu.Lock()
	models := make([]*Model, 0, len(b.models))
	for _, m := range b.models {
		models = append(models, m)
	}
	b.mu.Unlock()
	n := 0
	for _, m := range models {
		n += m.Mirrored()
	}
	return n
}
