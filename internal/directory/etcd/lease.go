package etcd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// LeaseState says what happened to the lease that binds this process's
// entries.
type LeaseState int

const (
	// LeaseGranted: a new lease; publishing goes on under it.
	LeaseGranted LeaseState = iota
	// LeaseLost: no keepalive reached etcd for a TTL. Publishing waits
	// until the lease is resumed or a new one granted.
	LeaseLost
	// LeaseResumed: etcd still held the lost lease (it had restarted, or
	// the outage was short in etcd's view), so no entry was lost.
	LeaseResumed
	// LeaseRepublished: entries this process published under an expired
	// lease were put back under the current one.
	LeaseRepublished
)

func (s LeaseState) String() string {
	switch s {
	case LeaseGranted:
		return "granted"
	case LeaseLost:
		return "lost"
	case LeaseResumed:
		return "resumed"
	case LeaseRepublished:
		return "republished"
	}
	return fmt.Sprintf("LeaseState(%d)", int(s))
}

// LeaseReport is one change of the lease, given to Config.OnLease.
type LeaseReport struct {
	State LeaseState
	Lease int64
	// Republished counts the entries put back under Lease; Taken those
	// that another process published while ours were gone, which this
	// process no longer owns (its copy of the block is redundant).
	Republished, Taken int
	// Err is why republishing stopped short; it is retried.
	Err error
}

func (d *Directory) report(r LeaseReport) {
	level := slog.LevelInfo
	switch {
	case r.State == LeaseGranted:
		level = slog.LevelDebug // every start
	case r.State == LeaseLost || r.Err != nil:
		level = slog.LevelWarn
	}
	d.cfg.Log.Log(context.Background(), level, "etcd directory lease", "state", r.State.String(), "lease", fmt.Sprintf("%x", r.Lease),
		"republished", r.Republished, "taken", r.Taken, "err", r.Err)
	if d.cfg.OnLease != nil {
		d.cfg.OnLease(r)
	}
}

// keepLease holds a lease for the directory's whole life: grant, keep
// alive, and on loss resume or grant again and republish.
func (d *Directory) keepLease() {
	defer close(d.leaseDone)
	var lease clientv3.LeaseID
	defer func() { d.finalLease = lease }()
	wait := d.newBackoff()
	for d.ctx.Err() == nil {
		if lease == 0 {
			l, err := d.grant()
			if err != nil {
				if d.ctx.Err() == nil {
					d.errLease.Add(1)
					d.cfg.Log.Warn("etcd directory: granting a lease", "err", d.fail(d.ctx, err, "grant"))
				}
				if !sleep(d.ctx, wait.next()) {
					return
				}
				continue
			}
			wait.reset()
			lease = l
			d.report(LeaseReport{State: LeaseGranted, Lease: int64(lease)})
		}
		if !d.holdLease(lease) {
			return
		}
		d.errLease.Add(1)
		d.report(LeaseReport{State: LeaseLost, Lease: int64(lease)})
		alive, ok := d.stillAlive(lease)
		if !ok {
			return
		}
		if alive {
			d.report(LeaseReport{State: LeaseResumed, Lease: int64(lease)})
			continue
		}
		lease = 0
	}
}

func (d *Directory) grant() (clientv3.LeaseID, error) {
	ctx, cancel := context.WithTimeout(d.ctx, d.cfg.OpTimeout)
	defer cancel()
	ttl := int64((d.cfg.LeaseTTL + time.Second - 1) / time.Second)
	resp, err := d.cli.Grant(ctx, ttl)
	if err != nil {
		return 0, err
	}
	return resp.ID, nil
}

// holdLease keeps lease alive and publishes under it whatever the record
// holds under another, until the keepalive stops. It reports whether the
// lease was lost (false: the directory is closing).
func (d *Directory) holdLease(lease clientv3.LeaseID) bool {
	kactx, endKeepAlive := context.WithCancel(d.ctx)
	defer endKeepAlive()
	alive, err := d.cli.KeepAlive(kactx, lease)
	if err != nil {
		return d.ctx.Err() == nil
	}
	d.mu.Lock()
	d.lease = lease
	d.endKeepAlive = endKeepAlive
	d.lostAt = time.Time{}
	close(d.leaseReady)
	d.mu.Unlock()
	defer func() {
		d.mu.Lock()
		d.lease = 0
		d.leaseReady = make(chan struct{})
		d.lostAt = time.Now()
		d.mu.Unlock()
	}()

	// A failed republish is retried on a timer while the lease lasts.
	wait := d.newBackoff()
	retry := time.NewTimer(0)
	defer retry.Stop()
	for {
		select {
		case _, ok := <-alive:
			if !ok {
				return d.ctx.Err() == nil
			}
			continue
		case <-d.poke:
		case <-retry.C:
		}
		if err := d.republish(lease); err != nil {
			if d.ctx.Err() != nil {
				return false
			}
			retry.Reset(wait.next())
		} else {
			wait.reset()
		}
	}
}

// leaseGone ends the keepalive of lease after etcd said it has no such
// lease, so that keepLease grants a new one.
func (d *Directory) leaseGone(lease clientv3.LeaseID) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.lease == lease && d.endKeepAlive != nil {
		d.endKeepAlive()
	}
}

func (d *Directory) pokeLease() {
	select {
	case d.poke <- struct{}{}:
	default:
	}
}

// waitLease returns the current lease, waiting for one while it is lost.
func (d *Directory) waitLease(ctx context.Context) (clientv3.LeaseID, error) {
	for {
		d.mu.Lock()
		lease, ready := d.lease, d.leaseReady
		d.mu.Unlock()
		if lease != 0 {
			return lease, nil
		}
		select {
		case <-ready:
		case <-ctx.Done():
			return 0, d.fail(ctx, ctx.Err(), "waiting for a lease")
		case <-d.ctx.Done():
			return 0, d.check()
		}
	}
}

// stillAlive asks etcd whether it still holds lease, until it answers. ok
// is false when the directory closes first.
func (d *Directory) stillAlive(lease clientv3.LeaseID) (alive, ok bool) {
	wait := d.newBackoff()
	for {
		ctx, cancel := context.WithTimeout(d.ctx, d.cfg.OpTimeout)
		resp, err := d.cli.TimeToLive(ctx, lease)
		cancel()
		switch {
		case err == nil:
			return resp.TTL > 0, true
		case errors.Is(err, rpctypes.ErrLeaseNotFound):
			return false, true
		}
		if !sleep(d.ctx, wait.next()) {
			return false, false
		}
	}
}

// republish puts back, under lease, every recorded entry last put under
// another lease, until there is none.
func (d *Directory) republish(lease clientv3.LeaseID) error {
	for {
		var pending []op
		d.mu.Lock()
		for k, rec := range d.own {
			if rec.lease != lease {
				pending = append(pending, op{key: k, value: rec.value, owner: rec.owner})
			}
		}
		d.mu.Unlock()
		if len(pending) == 0 {
			return nil
		}
		r := LeaseReport{State: LeaseRepublished, Lease: int64(lease)}
		for _, batch := range d.batches(pending) {
			put, taken, err := d.republishBatch(lease, batch)
			r.Republished += put
			r.Taken += taken
			if err != nil {
				r.Err = d.fail(d.ctx, err, "republish")
				d.report(r)
				return r.Err
			}
		}
		d.report(r)
	}
}

func (d *Directory) republishBatch(lease clientv3.LeaseID, batch []op) (put, taken int, err error) {
	ctx, cancel := context.WithTimeout(d.ctx, d.cfg.OpTimeout)
	defer cancel()
	then := make([]clientv3.Op, len(batch))
	for j := range batch {
		k := batch[j].key
		then[j] = clientv3.OpTxn(
			[]clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(k), "=", 0)},
			[]clientv3.Op{clientv3.OpPut(k, string(batch[j].value), clientv3.WithLease(lease))},
			[]clientv3.Op{clientv3.OpGet(k, clientv3.WithKeysOnly())})
	}
	resp, err := d.cli.Txn(ctx).Then(then...).Commit()
	if errors.Is(err, rpctypes.ErrLeaseNotFound) {
		d.leaseGone(lease)
	}
	if err != nil {
		return 0, 0, err
	}
	var orphans []op
	d.mu.Lock()
	for j, r := range resp.Responses {
		t := r.GetResponseTxn()
		ours := t.GetSucceeded()
		if !ours {
			// A Publish under the new lease may have stored it first.
			kvs := t.GetResponses()[0].GetResponseRange().GetKvs()
			ours = len(kvs) == 1 && kvs[0].Lease == int64(lease)
		}
		rec, kept := d.own[batch[j].key]
		kept = kept && bytes.Equal(rec.value, batch[j].value)
		switch {
		case ours && kept:
			rec.lease = lease
			d.own[batch[j].key] = rec
			put++
		case ours:
			// Unpublished while this batch was in flight: undo the put.
			orphans = append(orphans, batch[j])
		case kept:
			delete(d.own, batch[j].key)
			taken++
		}
	}
	d.mu.Unlock()
	return put, taken, d.deleteIfUnchanged(ctx, orphans)
}

// backoff spaces retries against an unreachable etcd.
type backoff struct{ d, max time.Duration }

// newBackoff caps retries at a quarter of the lease TTL (and 2 s): once
// etcd is back, the lost lease must be found alive before etcd's own
// refresh of it (one TTL after its restart) runs out.
func (d *Directory) newBackoff() backoff {
	return backoff{max: retryCap(d.cfg.LeaseTTL)}
}

func retryCap(ttl time.Duration) time.Duration { return min(2*time.Second, ttl/4) }

func (b *backoff) next() time.Duration {
	b.d = min(max(2*b.d, 50*time.Millisecond), b.max)
	return b.d
}

func (b *backoff) reset() { b.d = 0 }

// sleep waits for d unless ctx ends first; it reports whether ctx is alive.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
