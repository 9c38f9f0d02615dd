package mooncake

import (
	"context"
	"strings"
	"time"

	"github.com/mcbridge/mcbridge/internal/status"
)

// EnvLibrary names the environment variable that gives the store library's
// path when none is passed.
const EnvLibrary = "MCB_MOONCAKE_STORE_LIB"

// P2PHandshake is the Transfer Engine metadata mode that needs no metadata
// service: clients find each other's segments by ip:port.
const P2PHandshake = "P2PHANDSHAKE"

// DefaultCloseTimeout bounds how long Close waits for destroy.
const DefaultCloseTimeout = 5 * time.Second

// MaxKeyLen bounds a key; the bridge's are 32 hex digits.
const MaxKeyLen = 4096

// Config opens a client.
type Config struct {
	// Library is libmooncake_store.so; empty means $MCB_MOONCAKE_STORE_LIB.
	Library string
	// Master is the master's RPC address, host:port.
	Master string
	// LocalHostname is the address other clients reach this one at; the
	// library picks a free port on it (12300-14300). Empty means 127.0.0.1.
	LocalHostname string
	// Metadata is the Transfer Engine metadata: P2PHANDSHAKE (the default)
	// or the master's HTTP metadata server, http://host:port/metadata.
	Metadata string
	// Protocol is "tcp" (the default) or "rdma"; Device names the RDMA
	// devices ("" lets the library discover them).
	Protocol string
	Device   string
	// SegmentBytes is the memory this client contributes to the store, in
	// which the master places replicas of anyone's objects; 0 contributes
	// none (a pure client). The library allocates it.
	SegmentBytes uint64
	// BufferBytes is the library's own staging buffer, which copying puts
	// (Put) go through; 0 means 16 MiB.
	BufferBytes uint64
	// CloseTimeout bounds Close's wait for destroy; 0 means
	// DefaultCloseTimeout.
	CloseTimeout time.Duration
}

// MinSegmentBytes is the smallest segment the library accepts (its
// allocator's minimum; setup fails with invalid parameters below it).
const MinSegmentBytes = 16 << 20

func (cfg *Config) check() error {
	switch {
	case cfg.Master == "":
		return status.Errorf(status.Config, "Mooncake Store: no master address")
	case cfg.SegmentBytes != 0 && cfg.SegmentBytes < MinSegmentBytes:
		return status.Errorf(status.Config, "Mooncake Store: segment of %d bytes (0, or at least %d)", cfg.SegmentBytes, MinSegmentBytes)
	}
	if cfg.LocalHostname == "" {
		cfg.LocalHostname = "127.0.0.1"
	}
	if cfg.Metadata == "" {
		cfg.Metadata = P2PHandshake
	}
	if cfg.Metadata != P2PHandshake && !strings.HasPrefix(cfg.Metadata, "http://") {
		// The library aborts on a scheme it was built without (etcd, redis).
		return status.Errorf(status.Config, "Mooncake Store metadata %q: want %s or http://host:port/metadata (the master's HTTP metadata server)", cfg.Metadata, P2PHandshake)
	}
	if cfg.Protocol == "" {
		cfg.Protocol = "tcp"
	}
	if cfg.Protocol != "tcp" && cfg.Protocol != "rdma" {
		return status.Errorf(status.Config, "Mooncake Store protocol %q: want tcp or rdma", cfg.Protocol)
	}
	if cfg.BufferBytes == 0 {
		cfg.BufferBytes = 16 << 20
	}
	if cfg.CloseTimeout <= 0 {
		cfg.CloseTimeout = DefaultCloseTimeout
	}
	return nil
}

// Op is a library call in flight. Its result is the caller's once Done is
// closed; memory the call reads or writes must stay valid until then.
type Op[T any] struct {
	done chan struct{}
	res  T
	err  error
}

// Done is closed once the call has returned from the library.
func (o *Op[T]) Done() <-chan struct{} { return o.done }

// Wait returns the call's result, or status.Timeout once ctx ends first;
// the call goes on without this caller.
func (o *Op[T]) Wait(ctx context.Context) (T, error) {
	select {
	case <-o.done:
		return o.res, o.err
	case <-ctx.Done():
	}
	select {
	case <-o.done:
		return o.res, o.err
	default:
		var zero T
		return zero, status.Wrap(status.Timeout, ctx.Err(), "no answer from Mooncake Store in time (the call goes on inside the library)")
	}
}

// Buffer is memory outside the Go heap that a call reads or writes.
type Buffer struct {
	Addr uintptr
	Len  uint64
}

// PutOptions place an object's replicas.
type PutOptions struct {
	// Replicas is how many copies the master places, each in another
	// segment (fewer when fewer segments have room); 0 means 1.
	Replicas int
	// SoftPin keeps the object from eviction while the store has other
	// candidates; HardPin forbids its eviction.
	SoftPin, HardPin bool
	// Preferred segments are tried first, in order, one replica each.
	Preferred []string
}

// Got is one key's result of a get.
type Got struct {
	Len uint64 // bytes written into the buffer
	Err error
}
