// Package etcd is the directory shared by many processes and hosts. Each
// published block is one etcd key bound to its publisher's lease, so a
// process that dies takes its entries with it within the lease TTL, and
// every process mirrors the keys of the models it serves through a watch.
//
// Publish commits one transaction per batch with one compare per block
// (create revision 0, in a nested transaction each), so two processes that
// save the same block store it once and each learns whether it won. Batches
// respect etcd's limits on operations per transaction and request bytes.
// Servers that predate etcd's fix for costing nested transactions (etcd
// PR 22134, 2026; the 3.4 series among them) leave these puts out of the
// backend quota and the NOSPACE alarm: run a fixed release, such as the
// 3.7.3 that package embedded starts.
//
// The process keeps a record of the entries it published. When its lease
// is lost (etcd unreachable for longer than the TTL, and the lease expired
// there) it grants a new one and publishes the record again; when etcd
// still holds the old lease it simply resumes it.
package etcd

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	grpcbackoff "google.golang.org/grpc/backoff"
	"google.golang.org/grpc/connectivity"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Directory is a directory.Directory kept in etcd.
type Directory struct {
	cfg       Config
	cli       *clientv3.Client
	ctx       context.Context // ends at Close
	stop      context.CancelFunc
	leaseDone chan struct{}
	// poke asks the lease goroutine to publish again the entries recorded
	// under a lease other than the current one.
	poke chan struct{}

	mu           sync.Mutex
	lease        clientv3.LeaseID // 0 while none is held
	leaseReady   chan struct{}    // closed while lease != 0
	endKeepAlive context.CancelFunc
	lostAt       time.Time                // when the last lease was lost; zero while held
	finalLease   clientv3.LeaseID         // the lease to revoke at Close
	own          map[string]ownEntry      // by etcd key: what this process published
	subs         map[*subscription]func() // their cancel functions
	closed       bool

	errLease, errSnapshot, errWatch, errDecode atomic.Int64
}

// ownEntry is one entry this process published.
type ownEntry struct {
	value []byte
	owner string
	lease clientv3.LeaseID // the lease it was last put under
}

var (
	_ directory.Directory = (*Directory)(nil)
	_ directory.Checker   = (*Directory)(nil)
)

// minRequestBytes leaves room for one block of the largest names.
const minRequestBytes = 64 << 10

// New connects to etcd and starts keeping a lease. It does not wait for
// etcd (unless a username is set: authenticating needs the server), so a
// process starts while etcd is down and publishes once it is back.
func New(cfg Config) (*Directory, error) {
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	tlsCfg, err := c.TLS.tlsConfig()
	if err != nil {
		return nil, err
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   c.Endpoints,
		DialTimeout: c.DialTimeout,
		// Keepalive pings find a dead connection that sends no reset, so a
		// watch moves to another endpoint instead of waiting forever.
		DialKeepAliveTime:    10 * time.Second,
		DialKeepAliveTimeout: 5 * time.Second,
		MaxCallSendMsgSize:   c.MaxRequestBytes + minRequestBytes,
		// gRPC's default reconnect backoff grows to two minutes; an etcd
		// back from an outage must hear from us within its lease refresh.
		DialOptions: []grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           grpcbackoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: retryCap(c.LeaseTTL)},
			MinConnectTimeout: c.DialTimeout,
		})},
		TLS:      tlsCfg,
		Username: c.Username,
		Password: c.Password,
		// Failures reach callers as errors and Config.Log; the client's
		// own retry chatter would only repeat them.
		Logger: zap.NewNop(),
	})
	if err != nil {
		return nil, status.Wrap(status.Directory, err, "connecting to etcd at "+strings.Join(c.Endpoints, ","))
	}
	ctx, stop := context.WithCancel(context.Background())
	d := &Directory{
		cfg:        c,
		cli:        cli,
		ctx:        ctx,
		stop:       stop,
		leaseDone:  make(chan struct{}),
		poke:       make(chan struct{}, 1),
		leaseReady: make(chan struct{}),
		own:        map[string]ownEntry{},
		subs:       map[*subscription]func(){},
	}
	go d.keepLease()
	return d, nil
}

func (d *Directory) check() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return errClosed
	}
	return nil
}

var errClosed = status.Errorf(status.State, "etcd directory: closed")

// op is one block in a batch.
type op struct {
	at    int // index in the caller's slice
	key   string
	value []byte
	owner string
}

// Publish stores each entry that no process holds yet, bound to this
// process's lease. On an error the result still reports the entries of
// the batches committed before it.
func (d *Directory) Publish(ctx context.Context, entries []directory.Entry) ([]bool, error) {
	if err := d.check(); err != nil {
		return nil, err
	}
	ops := make([]op, 0, len(entries))
	seen := make(map[string]struct{}, len(entries))
	for i := range entries {
		e := &entries[i]
		if len(e.Loc.Segment) > directory.MaxNameLen || len(e.Loc.Owner) > directory.MaxNameLen {
			return nil, status.Errorf(status.InvalidArg, "publish: segment or owner name over %d bytes", directory.MaxNameLen)
		}
		k := blockKey(d.cfg.Prefix, e.Model, e.Key)
		// etcd refuses two puts of one key in a transaction; the first
		// copy in the call wins, as it would in two calls.
		if _, dup := seen[k]; dup {
			continue
		}
		seen[k] = struct{}{}
		ops = append(ops, op{at: i, key: k, value: directory.EncodeValue(e), owner: e.Loc.Owner})
	}
	ctx, cancel := context.WithTimeout(ctx, d.cfg.OpTimeout)
	defer cancel()
	out := make([]bool, len(entries))
	for _, batch := range d.batches(ops) {
		stored, lease, err := d.putNew(ctx, batch)
		if err != nil {
			return out, d.fail(ctx, err, "publish")
		}
		d.remember(batch, stored, lease)
		for j := range batch {
			out[batch[j].at] = stored[j]
		}
	}
	return out, nil
}

// putNew puts each block of batch that is absent, under the current lease.
func (d *Directory) putNew(ctx context.Context, batch []op) ([]bool, clientv3.LeaseID, error) {
	for {
		lease, err := d.waitLease(ctx)
		if err != nil {
			return nil, 0, err
		}
		then := make([]clientv3.Op, len(batch))
		for j := range batch {
			k := batch[j].key
			// Held already with this very value: an earlier publish of
			// ours committed after its client gave up.
			same := clientv3.OpTxn([]clientv3.Cmp{clientv3.Compare(clientv3.Value(k), "=", string(batch[j].value))}, nil, nil)
			then[j] = clientv3.OpTxn(
				[]clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(k), "=", 0)},
				[]clientv3.Op{clientv3.OpPut(k, string(batch[j].value), clientv3.WithLease(lease))},
				[]clientv3.Op{same})
		}
		resp, err := d.cli.Txn(ctx).Then(then...).Commit()
		if errors.Is(err, rpctypes.ErrLeaseNotFound) {
			// The lease expired in etcd before our keepalive noticed.
			d.leaseGone(lease)
			continue
		}
		if err != nil {
			return nil, 0, err
		}
		stored := make([]bool, len(batch))
		for j, r := range resp.Responses {
			t := r.GetResponseTxn()
			stored[j] = t.GetSucceeded() || len(t.GetResponses()) == 1 && t.GetResponses()[0].GetResponseTxn().GetSucceeded()
		}
		return stored, lease, nil
	}
}

// remember records the blocks that this process stored under lease.
func (d *Directory) remember(batch []op, stored []bool, lease clientv3.LeaseID) {
	d.mu.Lock()
	for j := range batch {
		if stored[j] {
			d.own[batch[j].key] = ownEntry{value: batch[j].value, owner: batch[j].owner, lease: lease}
		}
	}
	stale := lease != d.lease
	d.mu.Unlock()
	if stale {
		// The lease changed while the batch was in flight: the entries
		// went with the old one.
		d.pokeLease()
	}
}

// Unpublish deletes the blocks whose stored entry names owner. Blocks this
// process published are compared with the value it wrote; others are read
// first, so that an entry another owner holds is never deleted.
func (d *Directory) Unpublish(ctx context.Context, owner string, model key.Fingerprint, keys []key.BlockKey) error {
	if err := d.check(); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, d.cfg.OpTimeout)
	defer cancel()
	var mine, unknown []op
	seen := make(map[string]struct{}, len(keys))
	d.mu.Lock()
	for _, bk := range keys {
		k := blockKey(d.cfg.Prefix, model, bk)
		if _, dup := seen[k]; dup {
			continue
		}
		seen[k] = struct{}{}
		rec, ok := d.own[k]
		switch {
		case !ok:
			unknown = append(unknown, op{key: k})
		case rec.owner == owner:
			// Forget it before deleting, so that a re-publish after a
			// lease loss never brings it back. If the delete fails, a
			// retry finds the entry by reading it.
			delete(d.own, k)
			mine = append(mine, op{key: k, value: rec.value})
		}
	}
	d.mu.Unlock()
	theirs, err := d.readOwnedBy(ctx, owner, unknown)
	if err != nil {
		return d.fail(ctx, err, "unpublish")
	}
	if err := d.deleteIfUnchanged(ctx, append(mine, theirs...)); err != nil {
		return d.fail(ctx, err, "unpublish")
	}
	return nil
}

// readOwnedBy returns the blocks of ops that etcd holds for owner, with
// their stored values.
func (d *Directory) readOwnedBy(ctx context.Context, owner string, ops []op) ([]op, error) {
	var out []op
	for _, batch := range d.batches(ops) {
		gets := make([]clientv3.Op, len(batch))
		for j := range batch {
			gets[j] = clientv3.OpGet(batch[j].key)
		}
		resp, err := d.cli.Txn(ctx).Then(gets...).Commit()
		if err != nil {
			return nil, err
		}
		for j, r := range resp.Responses {
			kvs := r.GetResponseRange().GetKvs()
			if len(kvs) == 0 {
				continue
			}
			var e directory.Entry
			if directory.DecodeValue(kvs[0].Value, &e) == nil && e.Loc.Owner == owner {
				out = append(out, op{key: batch[j].key, value: kvs[0].Value})
			}
		}
	}
	return out, nil
}

// deleteIfUnchanged deletes each key whose value is still the one in ops.
func (d *Directory) deleteIfUnchanged(ctx context.Context, ops []op) error {
	for _, batch := range d.batches(ops) {
		then := make([]clientv3.Op, len(batch))
		for j := range batch {
			k := batch[j].key
			then[j] = clientv3.OpTxn(
				[]clientv3.Cmp{clientv3.Compare(clientv3.Value(k), "=", string(batch[j].value))},
				[]clientv3.Op{clientv3.OpDelete(k)},
				nil)
		}
		if _, err := d.cli.Txn(ctx).Then(then...).Commit(); err != nil {
			return err
		}
	}
	return nil
}

// Request bytes of one block's nested transaction beyond its key (written
// up to four times: compare, put or delete, get, the compare of the value)
// and value (twice: the put and the compare).
const opOverhead = 64

// batches cuts ops into runs that fit one transaction. Each nesting level
// spends one op of the budget its parent left (etcd checks each level
// against what the levels above left over), and a publish nests two deep
// (put if absent, else compare the value), hence MaxTxnOps-2.
func (d *Directory) batches(ops []op) [][]op {
	var out [][]op
	maxOps := d.cfg.MaxTxnOps - 2
	maxBytes := d.cfg.MaxRequestBytes - minRequestBytes/2
	start, bytes := 0, 0
	for i := range ops {
		n := 4*len(ops[i].key) + 2*len(ops[i].value) + opOverhead
		if i > start && (i-start == maxOps || bytes+n > maxBytes) {
			out = append(out, ops[start:i])
			start, bytes = i, 0
		}
		bytes += n
	}
	if start < len(ops) {
		out = append(out, ops[start:])
	}
	return out
}

// fail turns an etcd client error into a status error that says what to do.
func (d *Directory) fail(ctx context.Context, err error, what string) error {
	var se *status.Error
	if errors.As(err, &se) {
		return err
	}
	eps := strings.Join(d.cfg.Endpoints, ",")
	switch {
	case errors.Is(err, rpctypes.ErrNoSpace):
		return status.Wrap(status.Directory, err, what+": etcd at "+eps+" is out of space (NOSPACE alarm): compact and defragment it, or raise --quota-backend-bytes, then disarm the alarm")
	case errors.Is(err, rpctypes.ErrTooManyOps), errors.Is(err, rpctypes.ErrRequestTooLarge):
		return status.Wrap(status.Directory, err, what+": etcd refused the batch: set MaxTxnOps and MaxRequestBytes to the server's --max-txn-ops and --max-request-bytes")
	case errors.Is(err, rpctypes.ErrPermissionDenied), errors.Is(err, rpctypes.ErrAuthFailed), errors.Is(err, rpctypes.ErrInvalidAuthToken), errors.Is(err, rpctypes.ErrUserEmpty):
		return status.Wrap(status.Directory, err, what+": etcd at "+eps+" refused access under prefix "+d.cfg.Prefix)
	case errors.Is(err, context.Canceled) && ctx.Err() == context.Canceled:
		return status.Wrap(status.Timeout, err, what+": cancelled")
	case errors.Is(err, context.DeadlineExceeded) || ctx.Err() != nil:
		if !d.connected() {
			return status.Errorf(status.Directory, "%s: etcd at %s unreachable: gave up after %v%s", what, eps, d.cfg.OpTimeout, d.leaseNote())
		}
		return status.Wrap(status.Timeout, err, fmt.Sprintf("%s: etcd at %s did not answer within %v%s", what, eps, d.cfg.OpTimeout, d.leaseNote()))
	}
	return status.Wrap(status.Directory, err, what+": etcd at "+eps)
}

// Healthy implements directory.Checker: publishing needs a lease, and the
// mirror a connection.
func (d *Directory) Healthy() error {
	eps := strings.Join(d.cfg.Endpoints, ",")
	if !d.connected() {
		return status.Errorf(status.Directory, "etcd at %s unreachable%s", eps, d.leaseNote())
	}
	d.mu.Lock()
	lease := d.lease
	d.mu.Unlock()
	if lease == 0 {
		return status.Errorf(status.Directory, "etcd at %s holds no lease for this process%s", eps, d.leaseNote())
	}
	return nil
}

// Errors implements directory.Checker.
func (d *Directory) Errors() directory.ErrorCounts {
	return directory.ErrorCounts{Lease: d.errLease.Load(), Snapshot: d.errSnapshot.Load(), Watch: d.errWatch.Load(), Decode: d.errDecode.Load()}
}

func (d *Directory) connected() bool {
	return d.cli.ActiveConnection().GetState() == connectivity.Ready
}

// leaseNote says since when publishing has waited for a lease, if it has.
func (d *Directory) leaseNote() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.lease != 0 {
		return ""
	}
	if d.lostAt.IsZero() {
		return "; no lease granted yet"
	}
	return "; lease lost at " + d.lostAt.Format(time.RFC3339)
}

// Close stops every subscription, revokes the lease (removing every entry
// this process published) and closes the client. When etcd is unreachable
// the entries expire with the lease instead, and Close says so.
func (d *Directory) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return status.Errorf(status.State, "etcd directory: closed twice")
	}
	d.closed = true
	cancels := make([]func(), 0, len(d.subs))
	for _, cancel := range d.subs {
		cancels = append(cancels, cancel)
	}
	d.mu.Unlock()
	for _, cancel := range cancels {
		cancel()
	}
	d.stop()
	<-d.leaseDone
	var err error
	if lease := d.finalLease; lease != 0 {
		ctx, cancel := context.WithTimeout(context.Background(), d.cfg.OpTimeout)
		_, rerr := d.cli.Revoke(ctx, lease)
		if rerr != nil && !errors.Is(rerr, rpctypes.ErrLeaseNotFound) {
			err = d.fail(ctx, rerr, fmt.Sprintf("close: revoking lease %x (its entries expire within %v)", int64(lease), d.cfg.LeaseTTL))
		}
		cancel()
	}
	if cerr := d.cli.Close(); cerr != nil && err == nil && !errors.Is(cerr, context.Canceled) {
		err = status.Wrap(status.Directory, cerr, "close: etcd client")
	}
	return err
}
