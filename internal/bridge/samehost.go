package bridge

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"os"
	"time"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/status"
)

// sameHost is the bridge's side of shared pools (docs/design.md §8.2): its
// own pool handed to readers of this host, and the pools of this host's
// other processes, mapped read-only, which loads read blocks from in place
// instead of through the transport.
type sameHost struct {
	host     string       // this machine, as entries name it (pool.HostID)
	server   *pool.Server // hands this pool out
	addr     string       // the server's pool.Address, as entries carry it
	peers    *pool.Peers
	unfollow func() // a store node's: stops following the host's pools (nil if none)
}

// peerMapIdle is how long a peer's pool stays mapped while no load reads
// it: the pages of a holder that exited live on while mapped.
const peerMapIdle = time.Minute

// followCheck is how often a store node asks whether the holders of the
// pools it follows still listen: a killed runner's pool is unpinned at
// most this late, and then goes once idle.
const followCheck = 5 * time.Second

// openShared hands a shared pool to same-host readers and readies the
// mapping of theirs, when the configuration says so.
func (b *Bridge) openShared() error {
	sp := &b.cfg.SharedPool
	if !sp.Enabled {
		return nil
	}
	gid, err := sp.GID()
	if err != nil {
		return err
	}
	host, err := pool.HostID()
	if err != nil {
		return err
	}
	var tag [4]byte
	_, _ = rand.Read(tag[:])
	name := fmt.Sprintf("pool-%d-%08x.sock", os.Getpid(), binary.LittleEndian.Uint32(tag[:]))
	srv, err := b.hold.Share(sp.SocketDir(), name, pool.Access{GID: gid})
	if err != nil {
		return err
	}
	timeout := time.Duration(b.cfg.TransferTimeoutMS) * time.Millisecond
	b.shared = &sameHost{host: host, server: srv, addr: srv.Address().String(), peers: pool.NewPeers(b.now, timeout, peerMapIdle)}
	return nil
}

// closeShared stops handing the pool out and unmaps the peers' pools; no
// load may be running.
func (b *Bridge) closeShared() error {
	if b.shared == nil {
		return nil
	}
	if b.shared.unfollow != nil {
		b.shared.unfollow()
	}
	err := b.shared.server.Close()
	if perr := b.shared.peers.Close(); err == nil {
		err = perr
	}
	return err
}

// followSameHost has a store node map every shared pool of its host as
// soon as its socket appears, before the holder publishes any block: the
// store then copies a holder's blocks even when the holder is killed
// right after it publishes them (Ollama kills a runner as soon as its
// answer is out when keep_alive is 0), because the pages of a mapped pool
// outlive the process. Called with b.mu held, once.
func (b *Bridge) followSameHost() error {
	if b.shared == nil {
		return nil
	}
	var err error
	b.shared.unfollow, err = b.shared.peers.FollowDir(b.cfg.SharedPool.SocketDir(), b.shared.server.Address().Path, followCheck)
	return err
}

// location is where a block of this pool at off is read: over the
// transport at its address, and by same-host readers in the shared pool.
func (b *Bridge) location(off, size int64, checksum, gen uint64) directory.Location {
	loc := directory.Location{Segment: b.tr.LocalSegment(), Addr: uint64(b.hold.Base()) + uint64(off), Length: uint64(size),
		Checksum: checksum, Generation: gen, Owner: b.owner}
	if b.shared != nil {
		loc.Host, loc.Pool = b.shared.host, b.shared.addr
	}
	return loc
}

// onSameHost returns the address of the shared pool an entry of another
// process names on this host, or false.
func (b *Bridge) onSameHost(e *directory.Entry) (pool.Address, bool) {
	if b.shared == nil || e.Loc.Host != b.shared.host || e.Loc.Pool == "" || e.Loc.Pool == b.shared.addr {
		return pool.Address{}, false
	}
	a, err := pool.ParseAddress(e.Loc.Pool)
	return a, err == nil
}

// warmSameHost maps, in the background, the pool of a same-host entry as
// soon as the mirror hears of it, so that no load waits on its holder.
func (b *Bridge) warmSameHost(e *directory.Entry) {
	if a, ok := b.onSameHost(e); ok {
		b.shared.peers.Warm(a)
	}
}

// sameHostBlock returns the block e names in its holder's shared pool,
// mapped read-only, and a release for when the read is done, or ok false
// when e is not in a pool of this host that can be mapped. The bytes are
// the holder's live memory: a reader copies them once and then checks the
// generation again (pool.Generation), as from its own pool. Only a pool
// not yet mapped waits on its holder, until ctx ends.
func (b *Bridge) sameHostBlock(ctx context.Context, e *directory.Entry) (src []byte, release func(), ok bool, err error) {
	a, ok := b.onSameHost(e)
	if !ok {
		return nil, nil, false, nil
	}
	m, release, err := b.shared.peers.Get(ctx, a)
	if err != nil {
		return nil, nil, true, err
	}
	if src, err = m.Block(e.Loc.Addr, e.Loc.Length); err != nil {
		release()
		return nil, nil, true, err
	}
	return src, release, true, nil
}

// SharedPool is where same-host readers map this bridge's pool (a
// pool.Address), empty when it is not shared.
func (b *Bridge) SharedPool() string {
	if b.shared == nil {
		return ""
	}
	return b.shared.addr
}

// mapSameHost points the load's blocks that sit in same-host shared pools
// at their mapped bytes: they are then read as blocks of the own pool are,
// one fused copy and check into the cells, with no transfer and no fence.
// A pool that cannot be mapped leaves its blocks to the transport; one
// whose holder does not answer in time fails the load there, as a hung
// peer would.
func (ld *Load) mapSameHost() {
	b := ld.m.b
	for i := 0; i < ld.ok; i++ {
		lb := &ld.blocks[i]
		if lb.local {
			continue
		}
		src, release, ok, err := b.sameHostBlock(ld.ctx, &lb.entry)
		switch {
		case !ok:
			continue
		case err != nil && status.Of(err) == status.Timeout:
			ld.fail(i, err)
			b.peerFailed(lb.entry.Loc.Segment, err)
			return
		case err != nil:
			continue
		}
		if uint64(len(src)) != uint64(ld.m.geo.Size()) {
			release()
			ld.fail(i, status.Errorf(status.Corrupt, "block %s published with %d bytes, model blocks are %d", lb.entry.Key, len(src), ld.m.geo.Size()))
			return
		}
		lb.src, lb.mapped, lb.unmap = src, true, release
	}
}

// copySameHost copies the block e names from a same-host shared pool into
// dst, a store node's copy, and checks its generation after the copy; ok
// is false when e is not in a pool of this host that can be mapped. The
// caller verifies the copy whole.
func (b *Bridge) copySameHost(ctx context.Context, e *directory.Entry, dst []byte) (ok bool, err error) {
	src, release, ok, err := b.sameHostBlock(ctx, e)
	if !ok || err != nil {
		return ok && status.Of(err) == status.Timeout, err
	}
	defer release()
	copy(dst, src)
	if gen := pool.Generation(src); gen != e.Loc.Generation {
		b.stats.add(&b.stats.tornReads, 1)
		return true, status.Errorf(status.Corrupt, "block %s changed while copied (generation %d, read at %d)", e.Key, gen, e.Loc.Generation)
	}
	return true, nil
}
