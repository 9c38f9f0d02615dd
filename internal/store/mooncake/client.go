//go:build linux && (amd64 || arm64)

package mooncake

import (
	"bytes"
	"context"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/mcbridge/mcbridge/internal/status"
)

// Mirror of struct mooncake_replicate_config (store_c.h) with the padding
// spelled out; TestLayoutMatchesHeader (conformance_test.go) pins it to the
// header compiled by cc.
type cReplicateConfig struct {
	replicaNum     uintptr // size_t
	withSoftPin    int32
	withHardPin    int32
	preferred      uintptr // const char **
	preferredCount uintptr // size_t
}

// Client is one store client (one mooncake_store_t). It is safe for
// concurrent use. Calls that reach the master or a peer run as flights: on
// a goroutine of their own, waited for only until the caller's deadline.
type Client struct {
	lib     *Library
	cfg     Config
	segment string

	mu       sync.Mutex
	handle   uintptr // 0 once closed
	away     int     // flights not yet returned from the library
	closing  bool    // Close ran: the last flight to land destroys
	regions  map[uintptr]uint64
	destroyd chan struct{} // closed once destroy returned
}

// Open loads the library, creates a client and sets it up against the
// master. Setup talks to the master; when ctx ends first Open fails with
// status.Timeout and the half-made client is destroyed once setup returns.
func Open(ctx context.Context, cfg Config) (*Client, error) {
	if err := cfg.check(); err != nil {
		return nil, err
	}
	lib, err := Load(cfg.Library)
	if err != nil {
		return nil, err
	}
	if cfg.Metadata != P2PHandshake {
		if err := bindHandshake(cfg.LocalHostname); err != nil {
			return nil, err
		}
	}
	h, _ := lib.call("mooncake_store_create", lib.sym.create, plain)
	if h == 0 {
		return nil, status.Errorf(status.Internal, "mooncake_store_create failed; the library's log says why")
	}
	c := &Client{lib: lib, cfg: cfg, handle: uintptr(h), regions: map[uintptr]uint64{}, destroyd: make(chan struct{})}
	args := make([][]byte, 5)
	for i, s := range []string{cfg.LocalHostname, cfg.Metadata, cfg.Protocol, cfg.Device, cfg.Master} {
		if args[i], err = cString(s); err != nil {
			return nil, err
		}
	}
	_, err = c.fly(ctx, "mooncake_store_setup", func(h uintptr) (int64, error) {
		return c.lib.call("mooncake_store_setup", c.lib.sym.setup, cInt, h,
			uintptr(unsafe.Pointer(&args[0][0])), uintptr(unsafe.Pointer(&args[1][0])),
			uintptr(cfg.SegmentBytes), uintptr(cfg.BufferBytes),
			uintptr(unsafe.Pointer(&args[2][0])), uintptr(unsafe.Pointer(&args[3][0])),
			uintptr(unsafe.Pointer(&args[4][0])))
	}, nil)
	if err != nil {
		_ = c.Close()
		return nil, status.Wrap(status.Of(err), err, fmt.Sprintf("setting up a Mooncake Store client against master %s", cfg.Master))
	}
	buf := make([]byte, 256)
	if _, err := c.lib.call("mooncake_store_get_hostname", c.lib.sym.getHostname, cInt, c.handle,
		uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf))); err != nil {
		_ = c.Close()
		return nil, err
	}
	c.segment = goString(buf)
	return c, nil
}

// Segment is the name of this client's segment (host:port), the name
// preferred segments are given by.
func (c *Client) Segment() string { return c.segment }

// Contributes reports whether this client mounted a segment of its own.
func (c *Client) Contributes() bool { return c.cfg.SegmentBytes > 0 }

// Library is the library the client runs on.
func (c *Client) Library() *Library { return c.lib }

// launch runs f on a goroutine of its own with the client's handle. While
// it runs the client is kept: Close leaves destroying to the last flight
// to land. f must own everything it passes to C; release, when not nil,
// runs once f has returned, or at once when the call is refused.
func launch[T any](c *Client, op string, f func(h uintptr) (T, error), release func()) (*Op[T], error) {
	if release == nil {
		release = func() {}
	}
	c.mu.Lock()
	if c.handle == 0 || c.closing {
		c.mu.Unlock()
		release()
		return nil, status.Errorf(status.BadHandle, "%s: the Mooncake Store client is closed", op)
	}
	h := c.handle
	c.away++
	c.mu.Unlock()
	o := &Op[T]{done: make(chan struct{})}
	go func() {
		o.res, o.err = f(h)
		release()
		c.mu.Lock()
		c.away--
		destroy := c.away == 0 && c.closing && c.handle != 0
		if destroy {
			c.handle = 0
		}
		c.mu.Unlock()
		close(o.done)
		if destroy {
			c.destroy(h)
		}
	}()
	return o, nil
}

func (c *Client) fly(ctx context.Context, op string, f func(h uintptr) (int64, error), release func()) (int64, error) {
	if err := ctx.Err(); err != nil {
		if release != nil {
			release()
		}
		return 0, status.Wrap(status.Timeout, err, op)
	}
	o, err := launch(c, op, f, release)
	if err != nil {
		return 0, err
	}
	return o.Wait(ctx)
}

// Healthy is nil while the client's heartbeat reaches the master, else why
// not. It does not wait on the master.
func (c *Client) Healthy() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.handle == 0 || c.closing {
		return status.Errorf(status.BadHandle, "the Mooncake Store client is closed")
	}
	r, err := c.lib.call("mooncake_store_health_check", c.lib.sym.healthCheck, cInt, c.handle)
	switch {
	case err != nil:
		return err
	case r == 0:
		return nil
	case r == 2:
		return status.Errorf(status.Transfer, "Mooncake Store master %s unreachable (missed heartbeats)", c.cfg.Master)
	}
	return status.Errorf(status.State, "Mooncake Store client not initialized (health %d)", r)
}

// Register makes [addr, addr+n) a buffer puts read from and gets write
// into without a copy through the library's staging buffer.
func (c *Client) Register(ctx context.Context, addr uintptr, n uint64) error {
	if addr == 0 || n == 0 {
		return status.Errorf(status.InvalidArg, "register buffer: empty range [%#x, +%d)", addr, n)
	}
	_, err := c.fly(ctx, "mooncake_store_register_buffer", func(h uintptr) (int64, error) {
		return c.lib.call("mooncake_store_register_buffer", c.lib.sym.registerBuffer, cInt, h, addr, uintptr(n))
	}, nil)
	if err == nil {
		c.mu.Lock()
		c.regions[addr] = n
		c.mu.Unlock()
	}
	return err
}

// Unregister undoes Register.
func (c *Client) Unregister(ctx context.Context, addr uintptr) error {
	c.mu.Lock()
	_, ok := c.regions[addr]
	c.mu.Unlock()
	if !ok {
		return status.Errorf(status.InvalidArg, "unregister buffer %#x: not registered", addr)
	}
	_, err := c.fly(ctx, "mooncake_store_unregister_buffer", func(h uintptr) (int64, error) {
		return c.lib.call("mooncake_store_unregister_buffer", c.lib.sym.unregisterBuffer, cInt, h, addr)
	}, nil)
	if err == nil {
		c.mu.Lock()
		delete(c.regions, addr)
		c.mu.Unlock()
	}
	return err
}

// keyArray is NUL-terminated keys and the char* array naming them, pinned
// for C.
type keyArray struct {
	pin  runtime.Pinner
	ptrs []uintptr
}

func newKeyArray(keys []string) (*keyArray, error) {
	if len(keys) == 0 {
		return nil, status.Errorf(status.InvalidArg, "no keys")
	}
	a := &keyArray{ptrs: make([]uintptr, len(keys))}
	for i, k := range keys {
		if k == "" || len(k) > MaxKeyLen {
			a.pin.Unpin()
			return nil, status.Errorf(status.InvalidArg, "key %d of %d bytes (1..%d)", i, len(k), MaxKeyLen)
		}
		b, err := cString(k)
		if err != nil {
			a.pin.Unpin()
			return nil, err
		}
		a.pin.Pin(&b[0])
		a.ptrs[i] = uintptr(unsafe.Pointer(&b[0]))
	}
	a.pin.Pin(&a.ptrs[0])
	return a, nil
}

func (a *keyArray) addr() uintptr { return uintptr(unsafe.Pointer(&a.ptrs[0])) }

// replicateConfig is a pinned cReplicateConfig for opts.
type replicateConfig struct {
	keys *keyArray // the preferred segments, nil when none
	c    cReplicateConfig
}

func newReplicateConfig(opts PutOptions) (*replicateConfig, error) {
	n := opts.Replicas
	if n == 0 {
		n = 1
	}
	if n < 0 {
		return nil, status.Errorf(status.InvalidArg, "%d replicas", opts.Replicas)
	}
	r := &replicateConfig{c: cReplicateConfig{replicaNum: uintptr(n), withSoftPin: boolArg(opts.SoftPin), withHardPin: boolArg(opts.HardPin)}}
	if len(opts.Preferred) > 0 {
		keys, err := newKeyArray(opts.Preferred)
		if err != nil {
			return nil, status.Wrap(status.InvalidArg, err, "preferred segments")
		}
		r.keys = keys
		r.c.preferred = keys.addr()
		r.c.preferredCount = uintptr(len(opts.Preferred))
	}
	return r, nil
}

func (r *replicateConfig) unpin() {
	if r.keys != nil {
		r.keys.pin.Unpin()
	}
}

func boolArg(b bool) int32 {
	if b {
		return 1
	}
	return 0
}

// batchArgs is what the batch calls take: the pinned key array, and bufs
// split into void* and size_t arrays, checked to be one per key. The
// buffers are checked first, so that only a usable call pins.
func batchArgs(keys []string, bufs []Buffer) (ka *keyArray, addrs, sizes []uintptr, err error) {
	if len(bufs) != len(keys) {
		return nil, nil, nil, status.Errorf(status.InvalidArg, "%d keys and %d buffers", len(keys), len(bufs))
	}
	addrs, sizes = make([]uintptr, len(bufs)), make([]uintptr, len(bufs))
	for i, b := range bufs {
		if b.Addr == 0 || b.Len == 0 {
			return nil, nil, nil, status.Errorf(status.InvalidArg, "buffer %d is empty", i)
		}
		addrs[i], sizes[i] = b.Addr, uintptr(b.Len)
	}
	ka, err = newKeyArray(keys)
	return ka, addrs, sizes, err
}

// StartPutFrom starts writing bufs (registered memory) under keys without
// a copy, all with opts. The op's result has one error per key (nil where
// the object was stored); its error is for the call as a whole. bufs must
// stay unchanged until the op is done.
func (c *Client) StartPutFrom(keys []string, bufs []Buffer, opts PutOptions) (*Op[[]error], error) {
	ka, addrs, sizes, err := batchArgs(keys, bufs)
	if err != nil {
		return nil, err
	}
	rc, err := newReplicateConfig(opts)
	if err != nil {
		ka.pin.Unpin()
		return nil, err
	}
	const op = "mooncake_store_batch_put_from"
	return launch(c, op, func(h uintptr) ([]error, error) {
		out := make([]int32, len(keys))
		if _, err := c.lib.call(op, c.lib.sym.batchPutFrom, cInt, h, ka.addr(),
			uintptr(unsafe.Pointer(&addrs[0])), uintptr(unsafe.Pointer(&sizes[0])), uintptr(len(keys)),
			uintptr(unsafe.Pointer(&rc.c)), uintptr(unsafe.Pointer(&out[0]))); err != nil {
			return nil, err
		}
		errs := make([]error, len(keys))
		for i, r := range out {
			if r < 0 {
				errs[i] = codeError(fmt.Sprintf("put %s", keys[i]), int64(r))
			}
		}
		return errs, nil
	}, func() { ka.pin.Unpin(); rc.unpin() })
}

// PutFrom is StartPutFrom waited for until ctx ends.
func (c *Client) PutFrom(ctx context.Context, keys []string, bufs []Buffer, opts PutOptions) ([]error, error) {
	o, err := c.StartPutFrom(keys, bufs, opts)
	if err != nil {
		return nil, err
	}
	return o.Wait(ctx)
}

// Put stores value under key, copied through the library's staging buffer
// (it must fit Config.BufferBytes): the copying put the registered one is
// measured against. value is the caller's again once Put returns nil or a
// non-timeout error; after a timeout it must stay valid, as the call goes
// on (Put keeps it referenced until then).
func (c *Client) Put(ctx context.Context, key string, value []byte, opts PutOptions) error {
	if len(value) == 0 {
		return status.Errorf(status.InvalidArg, "put %s: empty value", key)
	}
	ck, err := cString(key)
	if err != nil {
		return err
	}
	rc, err := newReplicateConfig(opts)
	if err != nil {
		return err
	}
	const op = "mooncake_store_put"
	_, err = c.fly(ctx, op, func(h uintptr) (int64, error) {
		var pin runtime.Pinner
		pin.Pin(&value[0])
		defer pin.Unpin()
		return c.lib.call(op, c.lib.sym.put, cInt, h, uintptr(unsafe.Pointer(&ck[0])),
			uintptr(unsafe.Pointer(&value[0])), uintptr(len(value)), uintptr(unsafe.Pointer(&rc.c)))
	}, rc.unpin)
	return err
}

// StartGetInto starts reading the objects under keys into bufs
// (registered memory), each whole: a buffer smaller than its object fails
// that key (InvalidArg). The op's result has, per key, the object's length
// or the key's error; bufs must stay valid until the op is done.
func (c *Client) StartGetInto(keys []string, bufs []Buffer) (*Op[[]Got], error) {
	ka, addrs, sizes, err := batchArgs(keys, bufs)
	if err != nil {
		return nil, err
	}
	const op = "mooncake_store_batch_get_into"
	return launch(c, op, func(h uintptr) ([]Got, error) {
		out := make([]int64, len(keys))
		if _, err := c.lib.call(op, c.lib.sym.batchGetInto, cInt, h, ka.addr(),
			uintptr(unsafe.Pointer(&addrs[0])), uintptr(unsafe.Pointer(&sizes[0])), uintptr(len(keys)),
			uintptr(unsafe.Pointer(&out[0]))); err != nil {
			return nil, err
		}
		got := make([]Got, len(keys))
		for i, r := range out {
			if r < 0 {
				got[i].Err = codeError(fmt.Sprintf("get %s", keys[i]), r)
			} else {
				got[i].Len = uint64(r)
			}
		}
		return got, nil
	}, ka.pin.Unpin)
}

// GetInto is StartGetInto waited for until ctx ends.
func (c *Client) GetInto(ctx context.Context, keys []string, bufs []Buffer) ([]Got, error) {
	o, err := c.StartGetInto(keys, bufs)
	if err != nil {
		return nil, err
	}
	return o.Wait(ctx)
}

// Exist reports, per key, whether the master holds a complete object
// under it (a key's error, such as an unreachable master, fails the call).
func (c *Client) Exist(ctx context.Context, keys []string) ([]bool, error) {
	ka, err := newKeyArray(keys)
	if err != nil {
		return nil, err
	}
	const op = "mooncake_store_batch_is_exist"
	out := make([]int32, len(keys))
	_, err = c.fly(ctx, op, func(h uintptr) (int64, error) {
		return c.lib.call(op, c.lib.sym.batchExist, cInt, h, ka.addr(), uintptr(len(keys)), uintptr(unsafe.Pointer(&out[0])))
	}, ka.pin.Unpin)
	if err != nil {
		return nil, err
	}
	have := make([]bool, len(keys))
	for i, r := range out {
		if r < 0 {
			return nil, codeError("exist "+keys[i], int64(r))
		}
		have[i] = r == 1
	}
	return have, nil
}

// Remove deletes the object under key; a leased object (read in the last
// lease period) is removed only with force.
func (c *Client) Remove(ctx context.Context, key string, force bool) error {
	ck, err := cString(key)
	if err != nil {
		return err
	}
	const op = "mooncake_store_remove"
	_, err = c.fly(ctx, op, func(h uintptr) (int64, error) {
		f := uintptr(0)
		if force {
			f = 1
		}
		return c.lib.call(op, c.lib.sym.remove, cInt, h, uintptr(unsafe.Pointer(&ck[0])), f)
	}, nil)
	return err
}

// Size is the length of the object under key.
func (c *Client) Size(ctx context.Context, key string) (uint64, error) {
	ck, err := cString(key)
	if err != nil {
		return 0, err
	}
	const op = "mooncake_store_get_size"
	n, err := c.fly(ctx, op, func(h uintptr) (int64, error) {
		return c.lib.call(op, c.lib.sym.getSize, cInt64, h, uintptr(unsafe.Pointer(&ck[0])))
	}, nil)
	return uint64(n), err
}

// Close destroys the client: its segment leaves the store, with the
// replicas in it. It refuses while buffers are registered, since a call
// still in flight may move bytes into them. While a call is in flight it
// returns at once and the last call to land destroys; destroy itself is
// waited for only up to Config.CloseTimeout (status.Timeout after).
func (c *Client) Close() error {
	c.mu.Lock()
	if c.handle == 0 || c.closing {
		c.mu.Unlock()
		return status.Errorf(status.BadHandle, "Mooncake Store client closed twice")
	}
	if n := len(c.regions); n > 0 {
		c.mu.Unlock()
		return status.Errorf(status.State, "close: %d registered buffers remain", n)
	}
	c.closing = true
	h := c.handle
	if c.away > 0 {
		c.mu.Unlock()
		return nil
	}
	c.handle = 0
	c.mu.Unlock()
	go c.destroy(h)
	select {
	case <-c.destroyd:
		return nil
	case <-time.After(c.cfg.CloseTimeout):
		return status.Errorf(status.Timeout, "Mooncake Store client destroy still running after %v (the master is slow or gone); left to finish in the background", c.cfg.CloseTimeout)
	}
}

func (c *Client) destroy(h uintptr) {
	_, _ = c.lib.call("mooncake_store_destroy", c.lib.sym.destroy, plain, h)
	close(c.destroyd)
}

// cString is s with a terminating NUL; C cannot see past an inner one.
func cString(s string) ([]byte, error) {
	if strings.IndexByte(s, 0) >= 0 {
		return nil, status.Errorf(status.InvalidArg, "string %q contains a NUL byte", s)
	}
	return append([]byte(s), 0), nil
}

// goString reads a NUL-terminated string from a Go buffer C wrote into.
func goString(buf []byte) string {
	if i := bytes.IndexByte(buf, 0); i >= 0 {
		buf = buf[:i]
	}
	return string(buf)
}
