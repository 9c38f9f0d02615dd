package etcd

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
)

// snapshotPage is how many keys one read of a snapshot returns: large
// enough that a million blocks take a few hundred round trips, small
// enough that a page stays a few MiB with the longest names.
const snapshotPage = 2000

// subscription mirrors one model's keys, or every model's, into fn: a
// snapshot, then the watch from the snapshot's revision on.
type subscription struct {
	d      *Directory
	model  key.Fingerprint // the zero hash for every model
	prefix string
	parse  func(etcdKey []byte) (key.Fingerprint, key.BlockKey, error)
	fn     func(directory.Event)
	done   chan struct{}

	// known holds every key delivered as present, with the revision of the
	// value delivered, so a resync tells new, changed and vanished keys
	// apart without keeping the values.
	known  map[key.BlockKey]delivered
	epoch  uint32 // the resync pass in progress
	rev    int64  // every change up to rev has been delivered
	synced bool   // false: rev may have been compacted away, re-read
}

type delivered struct {
	rev   int64
	epoch uint32
	model key.Fingerprint
}

// Subscribe delivers a Put for every entry of model and then every change,
// in order, from one goroutine. It returns at once: the snapshot arrives
// from that goroutine, and while etcd is unreachable the goroutine retries.
// Cancel stops the goroutine and waits for it, so it must not be called
// from fn.
func (d *Directory) Subscribe(model key.Fingerprint, fn func(directory.Event)) (func(), error) {
	return d.start(d.newSubscription(model, fn))
}

// SubscribeAll is Subscribe for every model under the prefix, as a store
// node that holds blocks of any model needs.
func (d *Directory) SubscribeAll(fn func(directory.Event)) (func(), error) {
	s := d.newSubscription(key.Fingerprint{}, fn)
	s.prefix = d.cfg.Prefix + "/"
	s.parse = func(k []byte) (key.Fingerprint, key.BlockKey, error) { return parseAnyKey(d.cfg.Prefix, k) }
	return d.start(s)
}

func (d *Directory) start(s *subscription) (func(), error) {
	ctx, stop := context.WithCancel(d.ctx)
	var once sync.Once
	cancel := func() {
		once.Do(func() {
			stop()
			<-s.done
			d.mu.Lock()
			delete(d.subs, s)
			d.mu.Unlock()
		})
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		stop()
		return nil, errClosed
	}
	d.subs[s] = cancel
	go s.run(ctx)
	return cancel, nil
}

func (d *Directory) newSubscription(model key.Fingerprint, fn func(directory.Event)) *subscription {
	prefix := modelPrefix(d.cfg.Prefix, model)
	return &subscription{
		d:      d,
		model:  model,
		prefix: prefix,
		parse: func(k []byte) (key.Fingerprint, key.BlockKey, error) {
			b, err := parseBlockKey(prefix, k)
			return model, b, err
		},
		fn:    fn,
		done:  make(chan struct{}),
		known: map[key.BlockKey]delivered{},
	}
}

func (s *subscription) run(ctx context.Context) {
	defer close(s.done)
	wait := s.d.newBackoff()
	for ctx.Err() == nil {
		if !s.synced {
			if err := s.sync(ctx); err != nil {
				if ctx.Err() == nil {
					s.d.errSnapshot.Add(1)
					s.d.cfg.Log.Warn("etcd directory: reading snapshot", "model", s.model.String(), "err", s.d.fail(ctx, err, "snapshot"))
				}
				sleep(ctx, wait.next())
				continue
			}
		}
		progressed, err := s.watch(ctx)
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, rpctypes.ErrCompacted) {
			s.synced = false
		}
		s.d.errWatch.Add(1)
		s.d.cfg.Log.Warn("etcd directory: watch ended", "model", s.model.String(), "rev", s.rev, "resync", !s.synced, "err", err)
		if progressed {
			wait.reset()
		}
		sleep(ctx, wait.next())
	}
}

// sync reads the model's keys at one revision, page by page, delivers Puts
// for keys new or changed since the last delivery and Deletes for keys
// gone, and leaves rev at the snapshot's revision.
func (s *subscription) sync(ctx context.Context) error {
	s.epoch++
	end := clientv3.GetPrefixRangeEnd(s.prefix)
	var rev int64
	// etcd counts every key of the requested range for each page it
	// returns, so paging through N keys costs N^2/page. The first page tells
	// N; the rest is read in buckets of leading block key digits, each a
	// few pages long.
	first, err := s.page(ctx, s.prefix, end, &rev)
	if err != nil {
		return err
	}
	if first.More {
		from := string(first.Kvs[len(first.Kvs)-1].Key) + "\x00"
		for _, r := range bucketRanges(s.prefix, from, end, first.Count) {
			for r[0] != "" {
				resp, err := s.page(ctx, r[0], r[1], &rev)
				if err != nil {
					return err
				}
				r[0] = ""
				if resp.More {
					r[0] = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
				}
			}
		}
	}
	for k, v := range s.known {
		if v.epoch != s.epoch {
			delete(s.known, k)
			s.fn(directory.Event{Kind: directory.Delete, Entry: directory.Entry{Model: v.model, Key: k}})
		}
	}
	s.rev, s.synced = rev, true
	return nil
}

// page reads and delivers the first snapshotPage keys of [from, to) at
// *rev; the first page of a snapshot, at *rev 0, reads the latest revision
// and sets *rev to it, so that the snapshot is consistent.
func (s *subscription) page(ctx context.Context, from, to string, rev *int64) (*clientv3.GetResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, s.d.cfg.OpTimeout)
	defer cancel()
	resp, err := s.d.cli.Get(ctx, from, clientv3.WithRange(to), clientv3.WithLimit(snapshotPage), clientv3.WithRev(*rev))
	if err != nil {
		return nil, err
	}
	if *rev == 0 {
		*rev = resp.Header.Revision
	}
	for _, kv := range resp.Kvs {
		model, k, err := s.parse(kv.Key)
		if err != nil {
			s.d.errDecode.Add(1)
			s.d.cfg.Log.Warn("etcd directory: skipping key", "err", err)
			continue
		}
		if prev, ok := s.known[k]; ok && prev.rev == kv.ModRevision {
			s.known[k] = delivered{rev: prev.rev, epoch: s.epoch, model: model}
			continue
		}
		s.put(model, k, kv)
	}
	return resp, nil
}

// bucketRanges splits [from, end) under prefix into ranges of block keys
// sharing their leading hex digits, as many digits as leave each range a
// few pages of a total of n keys. The ranges cover [from, end) in order.
func bucketRanges(prefix, from, end string, n int64) [][2]string {
	digits, buckets := 1, int64(16)
	for n/buckets > 4*snapshotPage && digits < 4 {
		digits++
		buckets *= 16
	}
	var out [][2]string
	for b := int64(0); b < buckets; b++ {
		lo, hi := prefix+fmt.Sprintf("%0*x", digits, b), end
		if b+1 < buckets {
			hi = prefix + fmt.Sprintf("%0*x", digits, b+1)
		}
		if b == 0 || lo < from {
			lo = from
		}
		if lo < hi {
			out = append(out, [2]string{lo, hi})
		}
	}
	return out
}

// watch delivers changes after rev until the watch fails; progressed says
// whether it delivered any.
func (s *subscription) watch(ctx context.Context) (progressed bool, err error) {
	// Require a leader: a member cut off from its cluster ends the watch
	// instead of silently delivering nothing.
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	ch := s.d.cli.Watch(wctx, s.prefix, clientv3.WithPrefix(), clientv3.WithRev(s.rev+1), clientv3.WithPrevKV())
	for resp := range ch {
		if err := resp.Err(); err != nil {
			return progressed, err
		}
		for _, ev := range resp.Events {
			s.apply(ev)
			s.rev = ev.Kv.ModRevision
			progressed = true
		}
		if resp.IsProgressNotify() && resp.Header.Revision > s.rev {
			s.rev = resp.Header.Revision
		}
	}
	return progressed, ctx.Err()
}

func (s *subscription) apply(ev *clientv3.Event) {
	model, k, err := s.parse(ev.Kv.Key)
	if err != nil {
		s.d.errDecode.Add(1)
		s.d.cfg.Log.Warn("etcd directory: skipping key", "err", err)
		return
	}
	switch ev.Type {
	case mvccpb.PUT:
		s.put(model, k, ev.Kv)
	case mvccpb.DELETE:
		if _, ok := s.known[k]; !ok {
			return
		}
		delete(s.known, k)
		e := directory.Entry{Model: model, Key: k}
		if ev.PrevKv != nil && directory.DecodeValue(ev.PrevKv.Value, &e) != nil {
			e = directory.Entry{Model: model, Key: k}
		}
		s.fn(directory.Event{Kind: directory.Delete, Entry: e})
	}
}

// put delivers a present key. A value this build cannot read hides the
// block: it was deleted as far as the mirror can tell.
func (s *subscription) put(model key.Fingerprint, k key.BlockKey, kv *mvccpb.KeyValue) {
	e := directory.Entry{Model: model, Key: k}
	if err := directory.DecodeValue(kv.Value, &e); err != nil {
		s.d.errDecode.Add(1)
		s.d.cfg.Log.Warn("etcd directory: skipping entry", "key", string(kv.Key), "err", err)
		if _, ok := s.known[k]; ok {
			delete(s.known, k)
			s.fn(directory.Event{Kind: directory.Delete, Entry: directory.Entry{Model: model, Key: k}})
		}
		return
	}
	s.known[k] = delivered{rev: kv.ModRevision, epoch: s.epoch, model: model}
	s.fn(directory.Event{Kind: directory.Put, Entry: e})
}
