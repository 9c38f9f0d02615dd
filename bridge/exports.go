// Command bridge is the C ABI (include/mcbridge.h), built with
// go build -buildmode=c-archive into libmcbridge.a. The public functions of
// include/mcbridge.h are C shims (mcbridge.c, beside this file) over the
// mcbgo_ exports here; this file only converts arguments, keeps the handle
// table and turns errors and panics into statuses. Everything else is plain
// Go under internal/: what every host shares in internal/host, the bridge
// itself in internal/bridge.
package main

/*
#cgo CFLAGS: -I${SRCDIR}/../include -Wall -Wextra -Werror
#include <stdlib.h>
*/
import "C"

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"runtime/debug"
	"sync"
	"time"
	"unsafe"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/host"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout"
	"github.com/mcbridge/mcbridge/internal/llamastate"
	"github.com/mcbridge/mcbridge/internal/logs"
	"github.com/mcbridge/mcbridge/internal/mem"
	"github.com/mcbridge/mcbridge/internal/metrics"
	"github.com/mcbridge/mcbridge/internal/status"
)

func main() {}

// Bounds on what a caller may hand over, so a garbage length is an error
// rather than a huge allocation or a walk through unmapped memory.
const (
	maxTokens    = 1 << 24
	maxLayers    = 4096
	maxString    = 4096
	maxConfig    = config.MaxSize
	maxSaltBytes = 4096
	maxKVStreams = 256 // LLAMA_MAX_SEQ: a context has a KV stream a sequence at most
)

type bridgeHandle struct {
	b *bridge.Bridge
}

type modelHandle struct {
	bridge uint64
	b      *bridge.Bridge
	m      *host.Model
	// nStream is the stream count of the state a state host registered
	// with; 0 for a host with tensors, which cannot restore into states.
	nStream int
}

type planHandle struct {
	bridge uint64
	model  *modelHandle
	p      *bridge.Plan
}

type loadHandle struct {
	ld *bridge.Load
	m  *host.Model
}

type saveHandle struct{ sv *bridge.Save }

// listeners are the metrics listeners of metrics_listen, one per address
// for the process, pointed at the last bridge opened with it.
var listeners = struct {
	sync.Mutex
	byAddr map[string]*metrics.Listener
}{byAddr: map[string]*metrics.Listener{}}

func listener(addr string) (*metrics.Listener, error) {
	listeners.Lock()
	defer listeners.Unlock()
	if l, ok := listeners.byAddr[addr]; ok {
		return l, nil
	}
	l, err := metrics.Listen(addr, nil, status.Errorf(status.State, "the bridge is opening"))
	if err != nil {
		return nil, err
	}
	listeners.byAddr[addr] = l
	return l, nil
}

// stopListeners ends the listeners serving b.
func stopListeners(b *bridge.Bridge) {
	listeners.Lock()
	defer listeners.Unlock()
	for addr, l := range listeners.byAddr {
		if l.Serves(b) {
			_ = l.Close()
			delete(listeners.byAddr, addr)
		}
	}
}

// openRefused is why the last mcb_bridge_open failed, for the metrics of a
// host whose bridge is off.
var openRefused struct {
	sync.Mutex
	err error
}

// table maps handles to objects. Handles are never reused, so a stale
// handle can only miss, never reach a newer object.
var table = struct {
	sync.Mutex
	next uint64
	m    map[uint64]any
}{m: map[uint64]any{}}

func addHandle(v any) uint64 {
	table.Lock()
	defer table.Unlock()
	table.next++
	table.m[table.next] = v
	return table.next
}

func lookupHandle[T any](h uint64, kind string) (T, error) {
	table.Lock()
	defer table.Unlock()
	v, ok := table.m[h].(T)
	if !ok {
		return v, status.Errorf(status.BadHandle, "%d is not an open %s handle", h, kind)
	}
	return v, nil
}

func dropHandle(h uint64) {
	table.Lock()
	delete(table.m, h)
	table.Unlock()
}

// withHandle is the preamble of every export that acts on a handle: under
// guard, it finds the object behind id (MCB_STATUS_BAD_HANDLE when id is
// not an open handle of that kind) and runs f on it.
func withHandle[T any](id uint64, kind string, errbuf unsafe.Pointer, errlen uint64, f func(T) error) int32 {
	return guard(errbuf, errlen, func() error {
		h, err := lookupHandle[T](id, kind)
		if err != nil {
			return err
		}
		return f(h)
	})
}

// withPlan is withHandle for the exports that consume a plan: the plan is
// gone from the table before f runs, also when f fails.
func withPlan(plan uint64, errbuf unsafe.Pointer, errlen uint64, f func(*planHandle) error) int32 {
	return guard(errbuf, errlen, func() error {
		h, err := takePlan(plan)
		if err != nil {
			return err
		}
		return f(h)
	})
}

// guard runs one export: it recovers panics (and memory faults, which
// SetPanicOnFault turns into panics) into MCB_STATUS_INTERNAL and writes
// the error's message into the caller's thread-local buffer.
func guard(errbuf unsafe.Pointer, errlen uint64, f func() error) (code int32) {
	defer func() {
		if r := recover(); r != nil {
			writeError(errbuf, errlen, fmt.Sprintf("internal error: %v", r))
			code = int32(status.Internal)
		}
	}()
	debug.SetPanicOnFault(true)
	err := f()
	msg := ""
	if err != nil {
		msg = err.Error()
	}
	writeError(errbuf, errlen, msg)
	return int32(status.Of(err))
}

func writeError(buf unsafe.Pointer, n uint64, msg string) {
	if buf == nil || n == 0 {
		return
	}
	b := unsafe.Slice((*byte)(buf), n)
	k := copy(b[:n-1], msg)
	b[k] = 0
}

// cString reads a NUL-terminated string whose terminator lies within its
// first limit bytes. It reads no byte past those, so an unterminated string
// that runs into unmapped memory is an error, not a fault.
func cString(p uintptr, limit int, what string) (string, error) {
	if p == 0 {
		return "", nil
	}
	for n := 0; n < limit; n++ {
		if *(*byte)(ptr(p + uintptr(n))) == 0 {
			return string(mem.Bytes(p, n)), nil
		}
	}
	return "", status.Errorf(status.InvalidArg, "%s not terminated within %d bytes", what, limit)
}

// ptr converts a caller's address; the caller vouches that it is mapped.
func ptr(p uintptr) unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(&p)) }

func aligned(p unsafe.Pointer, n uintptr, what string) error {
	if p == nil {
		return status.Errorf(status.InvalidArg, "%s is NULL", what)
	}
	if uintptr(p)%n != 0 {
		return status.Errorf(status.InvalidArg, "%s at %p is not %d-byte aligned", what, p, n)
	}
	return nil
}

func u32s(p uintptr, n int, what string) ([]int, error) {
	if err := aligned(ptr(p), 4, what); err != nil {
		return nil, err
	}
	src := unsafe.Slice((*uint32)(ptr(p)), n)
	out := make([]int, n)
	for i, v := range src {
		out[i] = int(v)
	}
	return out, nil
}

// tokensArg copies the caller's tokens: a plan keeps them past the call.
func tokensArg(p unsafe.Pointer, n uint64) ([]int32, error) {
	if n == 0 || n > maxTokens {
		return nil, status.Errorf(status.InvalidArg, "%d tokens (1..%d)", n, maxTokens)
	}
	if err := aligned(p, 4, "tokens"); err != nil {
		return nil, err
	}
	return append([]int32(nil), unsafe.Slice((*int32)(p), n)...), nil
}

// cellsArg reads n cells, or gives cell i for position i when p is NULL.
func cellsArg(p unsafe.Pointer, n int) ([]uint32, error) {
	if p == nil {
		c := make([]uint32, n)
		for i := range c {
			c[i] = uint32(i)
		}
		return c, nil
	}
	if err := aligned(p, 4, "cells"); err != nil {
		return nil, err
	}
	return append([]uint32(nil), unsafe.Slice((*uint32)(p), n)...), nil
}

func scopeArg(p unsafe.Pointer) (key.Scope, error) {
	if p == nil {
		return key.Scope{}, nil
	}
	if err := aligned(p, 8, "scope"); err != nil {
		return key.Scope{}, err
	}
	s := (*cScope)(p)
	if s.TenantSaltLen > maxSaltBytes {
		return key.Scope{}, status.Errorf(status.InvalidArg, "tenant salt of %d bytes (max %d)", s.TenantSaltLen, maxSaltBytes)
	}
	if s.NAdapters > host.MaxAdapters {
		return key.Scope{}, status.Errorf(status.InvalidArg, "%d adapters (max %d)", s.NAdapters, host.MaxAdapters)
	}
	var salt []byte
	if s.TenantSaltLen > 0 {
		if s.TenantSalt == 0 {
			return key.Scope{}, status.Errorf(status.InvalidArg, "tenant salt is NULL with length %d", s.TenantSaltLen)
		}
		salt = mem.Bytes(s.TenantSalt, int(s.TenantSaltLen))
	}
	var adapters []host.Adapter
	if s.NAdapters > 0 {
		if err := aligned(ptr(s.Adapters), 8, "adapters"); err != nil {
			return key.Scope{}, err
		}
		for i, a := range unsafe.Slice((*cAdapter)(ptr(s.Adapters)), s.NAdapters) {
			path, err := cString(a.Path, maxString, fmt.Sprintf("adapters[%d].path", i))
			if err != nil {
				return key.Scope{}, err
			}
			if path == "" {
				return key.Scope{}, status.Errorf(status.InvalidArg, "adapters[%d].path is empty", i)
			}
			adapters = append(adapters, host.Adapter{Path: path, Scale: a.Scale})
		}
	}
	return host.NewScope(salt, adapters)
}

func layoutArg(p unsafe.Pointer) (kvlayout.Layout, error) {
	if err := aligned(p, 8, "layout"); err != nil {
		return kvlayout.Layout{}, err
	}
	c := (*cKVLayout)(p)
	if c.NLayer == 0 || c.NLayer > maxLayers {
		return kvlayout.Layout{}, status.Errorf(status.Layout, "layout of %d layers (1..%d)", c.NLayer, maxLayers)
	}
	if err := aligned(ptr(c.Layers), 8, "layout layers"); err != nil {
		return kvlayout.Layout{}, err
	}
	loc, err := cString(c.Location, 64, "layout location")
	if err != nil {
		return kvlayout.Layout{}, err
	}
	if loc == "" {
		loc = "cpu:0"
	}
	lo := kvlayout.Layout{Cells: c.NCells, VTrans: c.VTrans, Location: loc}
	for _, l := range unsafe.Slice((*cKVLayer)(ptr(c.Layers)), c.NLayer) {
		lo.Layers = append(lo.Layers, kvlayout.Layer{K: l.K, V: l.V, KStride: l.KStride, VStride: l.VStride})
	}
	return lo, nil
}

// identityArg reads what names a model.
func identityArg(p unsafe.Pointer) (host.Identity, error) {
	var id host.Identity
	if err := aligned(p, 8, "model params"); err != nil {
		return id, err
	}
	c := (*cModelParams)(p)
	var err error
	if id.LlamaVersion, err = cString(c.LlamaVersion, maxString, "llama_version"); err != nil {
		return id, err
	}
	if id.LlamaVersion == "" {
		return id, status.Errorf(status.InvalidArg, "llama_version is empty: pass the tag the host is built from")
	}
	if id.GGUFPath, err = cString(c.GGUFPath, maxString, "gguf_path"); err != nil {
		return id, err
	}
	if id.Extra, err = cString(c.Extra, maxString, "extra"); err != nil {
		return id, err
	}
	if id.Partial, err = cString(c.PartialState, maxString, "partial_state"); err != nil {
		return id, err
	}
	switch n := c.PartialKVStreams; {
	case n > 0 && id.Partial == "":
		return id, status.Errorf(status.InvalidArg, "partial_kv_streams %d without a partial_state", n)
	case n > maxKVStreams:
		return id, status.Errorf(status.InvalidArg, "partial_kv_streams %d (a context has at most %d)", n, maxKVStreams)
	}
	id.PartialKVStreams = int(c.PartialKVStreams)
	id.BlockTokens = int(c.BlockTokens)
	return id, nil
}

// formatArg reads a KV cache's shape. The widths are checked against the
// row sizes: a host that reports both must report them consistently.
func formatArg(p unsafe.Pointer) (host.Format, error) {
	var f host.Format
	if err := aligned(p, 8, "format"); err != nil {
		return f, err
	}
	c := (*cKVFormat)(p)
	n := int(c.NLayer)
	if n == 0 || n > maxLayers {
		return f, status.Errorf(status.InvalidArg, "model of %d layers (1..%d)", n, maxLayers)
	}
	ek, err := u32s(c.NEmbdKGQA, n, "n_embd_k_gqa")
	if err != nil {
		return f, err
	}
	ev, err := u32s(c.NEmbdVGQA, n, "n_embd_v_gqa")
	if err != nil {
		return f, err
	}
	kr, err := u32s(c.KRowBytes, n, "k_row_bytes")
	if err != nil {
		return f, err
	}
	vr, err := u32s(c.VRowBytes, n, "v_row_bytes")
	if err != nil {
		return f, err
	}
	f.VTrans = c.VTrans
	for l := 0; l < n; l++ {
		// A layer without V (MLA; an indexer cache's) has 0 V dimensions
		// in 0 bytes.
		noV := ev[l] == 0 && vr[l] == 0
		if ek[l] == 0 || ev[l] == 0 && !noV {
			return f, status.Errorf(status.InvalidArg, "layer %d: %d K and %d V dimensions, V in %d bytes (no V is 0 and 0)", l, ek[l], ev[l], vr[l])
		}
		if err := rowArg(l, "K", c.TypeK, ek[l], kr[l]); err != nil {
			return f, err
		}
		if noV {
			// type_v names no tensor: every host gives a layer without V
			// its K type (host.LayerFormat).
			f.Layers = append(f.Layers, host.LayerFormat{KType: c.TypeK, KRow: uint64(kr[l]), VType: c.TypeK})
			continue
		}
		if !c.VTrans {
			if err := rowArg(l, "V", c.TypeV, ev[l], vr[l]); err != nil {
				return f, err
			}
		}
		ly := host.LayerFormat{KType: c.TypeK, KRow: uint64(kr[l]), VType: c.TypeV, VRow: uint64(vr[l])}
		if c.VTrans {
			if vr[l] == 0 || vr[l]%ev[l] != 0 {
				return f, status.Errorf(status.InvalidArg, "layer %d: transposed V row of %d bytes for %d dimensions", l, vr[l], ev[l])
			}
			ly.VElSize, ly.NEmbdV = uint32(vr[l]/ev[l]), uint32(ev[l])
		}
		f.Layers = append(f.Layers, ly)
	}
	return f, nil
}

// rowArg checks one layer's row size against its width. A type the host
// cannot name is left to host.Format, which refuses it as UNSUPPORTED.
func rowArg(l int, what string, typ int32, elements, bytes int) error {
	want, known := host.RowBytes(typ, uint32(elements))
	if bytes == 0 || (known && uint64(bytes) != want) {
		return status.Errorf(status.InvalidArg, "layer %d: %s row of %d bytes for %d elements of type %d", l, what, bytes, elements, typ)
	}
	return nil
}

//export mcbgo_bridge_open
func mcbgo_bridge_open(cfg unsafe.Pointer, out unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return guard(errbuf, errlen, func() error {
		if err := aligned(out, 8, "out"); err != nil {
			return err
		}
		err := func() error {
			doc, err := cString(uintptr(cfg), maxConfig, "config")
			if err != nil {
				return err
			}
			c, err := config.Load(doc)
			if err != nil {
				return err
			}
			var l *metrics.Listener
			if c.MetricsListen != "" {
				// A port another process holds (a second runner of the same
				// configuration) costs this host its own metrics, not the bridge.
				if l, err = listener(c.MetricsListen); err != nil {
					logs.Default().Warn("mcbridge: no metrics listener; the bridge runs without it", "err", err)
				}
			}
			b, err := bridge.Open(c, bridge.Deps{})
			if err != nil {
				if l != nil {
					l.Set(nil, err) // it says why the bridge is off
				}
				return err
			}
			if l != nil {
				l.Set(b, nil)
			}
			*(*uint64)(out) = addHandle(&bridgeHandle{b: b})
			return nil
		}()
		openRefused.Lock()
		openRefused.err = err
		openRefused.Unlock()
		return err
	})
}

//export mcbgo_bridge_close
func mcbgo_bridge_close(bridge uint64, errbuf unsafe.Pointer, errlen uint64) int32 {
	return withHandle(bridge, "bridge", errbuf, errlen, func(h *bridgeHandle) error {
		if err := h.b.Close(); status.Of(err) == status.State {
			return err // work still open: the bridge stays usable
		} else if err != nil {
			stopListeners(h.b)
			dropBridge(bridge)
			return err
		}
		stopListeners(h.b)
		dropBridge(bridge)
		return nil
	})
}

// dropBridge removes a bridge's handle and its models' and plans' handles.
func dropBridge(bridge uint64) {
	table.Lock()
	defer table.Unlock()
	delete(table.m, bridge)
	for id, v := range table.m {
		switch h := v.(type) {
		case *modelHandle:
			if h.bridge == bridge {
				delete(table.m, id)
			}
		case *planHandle:
			if h.bridge == bridge {
				delete(table.m, id)
			}
		}
	}
}

//export mcbgo_bridge_stats
func mcbgo_bridge_stats(bridge uint64, out unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return withHandle(bridge, "bridge", errbuf, errlen, func(h *bridgeHandle) error {
		if err := aligned(out, 8, "out"); err != nil {
			return err
		}
		s := h.b.Stats()
		blocks, bytes, poolBytes := h.b.Resident()
		*(*cStats)(out) = cStats{
			Lookups: u64(s.Lookups), Hits: u64(s.Hits), Misses: u64(s.Misses),
			DecidedRestore: u64(s.DecidedRestore), DecidedRecompute: u64(s.DecidedRecompute), DecidedLocal: u64(s.DecidedLocal),
			Loads: u64(s.Loads), LoadFailures: u64(s.LoadFailures),
			RestoredTokens: u64(s.RestoredTokens), RestoredBytes: u64(s.RestoredBytes),
			Saves: u64(s.Saves), SaveFailures: u64(s.SaveFailures),
			SavedBlocks: u64(s.SavedBlocks), DedupedBlocks: u64(s.DedupedBlocks),
			Evictions: u64(s.Evictions), DirectoryErrors: u64(s.DirectoryErrors), TornReads: u64(s.TornReads),
			ResidentBlocks: u64(int64(blocks)), ResidentBytes: u64(bytes), PoolBytes: u64(poolBytes),
		}
		return nil
	})
}

func u64(v int64) uint64 { return uint64(max(v, 0)) }

//export mcbgo_bridge_wait_published
func mcbgo_bridge_wait_published(bridge uint64, timeoutMS uint32, errbuf unsafe.Pointer, errlen uint64) int32 {
	return withHandle(bridge, "bridge", errbuf, errlen, func(h *bridgeHandle) error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(timeoutMS)*time.Millisecond)
		defer cancel()
		return h.b.Published(ctx)
	})
}

// mcbgo_metrics_text writes the metric text for bridge (0: off) into buf
// and returns its full length. A bridge handle that is not open reads as
// off, with the handle error as the reason.
//
//export mcbgo_metrics_text
func mcbgo_metrics_text(handle uint64, offReason, buf unsafe.Pointer, capacity uint64) (n uint64) {
	defer func() {
		if recover() != nil {
			n = 0
		}
	}()
	var b *bridge.Bridge
	var off error
	if why, err := cString(uintptr(offReason), maxString, "off_reason"); err != nil || why != "" {
		if err == nil {
			err = status.Errorf(status.Unsupported, "%s", why)
		}
		off = err
	}
	switch h, err := lookupHandle[*bridgeHandle](handle, "bridge"); {
	case err == nil:
		b = h.b
	case off != nil:
	case handle == 0:
		openRefused.Lock()
		off = openRefused.err
		openRefused.Unlock()
		if off == nil {
			off = status.Errorf(status.Config, "not configured")
		}
	default:
		off = err
	}
	var text bytes.Buffer
	_ = metrics.Write(&text, b, off)
	if buf != nil && capacity > 0 {
		writeError(buf, capacity, text.String())
	}
	return uint64(text.Len())
}

//export mcbgo_probe_tokens
func mcbgo_probe_tokens(out unsafe.Pointer, capacity uint64) uint64 {
	toks := host.ProbeTokens()
	if out != nil && uintptr(out)%4 == 0 {
		copy(unsafe.Slice((*int32)(out), min(capacity, uint64(len(toks)))), toks)
	}
	return uint64(len(toks))
}

var llamaVersionC = C.CString(host.LlamaVersion)

//export mcbgo_llama_version
func mcbgo_llama_version() *C.char { return llamaVersionC }

//export mcbgo_model_register
func mcbgo_model_register(bridge uint64, params, format, probe, probeCells unsafe.Pointer, out unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return withHandle(bridge, "bridge", errbuf, errlen, func(h *bridgeHandle) error {
		if err := aligned(out, 8, "out"); err != nil {
			return err
		}
		id, err := identityArg(params)
		if err != nil {
			return err
		}
		if id.Format, err = formatArg(format); err != nil {
			return err
		}
		lo, err := layoutArg(probe)
		if err != nil {
			return err
		}
		n := len(host.ProbeTokens())
		if probeCells == nil {
			return status.Errorf(status.InvalidArg, "probe_cells is NULL")
		}
		cells, err := cellsArg(probeCells, n)
		if err != nil {
			return err
		}
		m, err := host.Register(h.b, id, lo, cells)
		if err != nil {
			return err
		}
		*(*uint64)(out) = addHandle(&modelHandle{bridge: bridge, b: h.b, m: m})
		return nil
	})
}

//export mcbgo_model_register_state
func mcbgo_model_register_state(bridge uint64, params, state unsafe.Pointer, n uint64, out unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return withHandle(bridge, "bridge", errbuf, errlen, func(h *bridgeHandle) error {
		if err := aligned(out, 8, "out"); err != nil {
			return err
		}
		id, err := identityArg(params)
		if err != nil {
			return err
		}
		blob, err := stateArg(state, n)
		if err != nil {
			return err
		}
		if id.Partial != "" {
			m, err := host.RegisterPartialOnly(h.b, id, blob)
			if err != nil {
				return err
			}
			*(*uint64)(out) = addHandle(&modelHandle{bridge: bridge, b: h.b, m: m})
			return nil
		}
		m, nStream, err := host.RegisterState(h.b, id, blob)
		if ce := (*llamastate.CachesError)(nil); errors.As(err, &ce) {
			// The states of several caches that the library does not restore
			// (a sliding-window memory's, or more than two KV caches): the
			// status says that its caller serves no such model; a malformed
			// blob stays INVALID_ARG.
			return status.Wrap(status.Unsupported, err, "a memory of several caches")
		}
		if err != nil {
			return err
		}
		*(*uint64)(out) = addHandle(&modelHandle{bridge: bridge, b: h.b, m: m, nStream: nStream})
		return nil
	})
}

// maxState bounds a state blob: 16 GiB is more KV than any host holds in
// one sequence.
const maxState = 16 << 30

func stateArg(p unsafe.Pointer, n uint64) ([]byte, error) {
	if p == nil || n == 0 || n > maxState {
		return nil, status.Errorf(status.InvalidArg, "state of %d bytes at %p", n, p)
	}
	return mem.Bytes(uintptr(p), int(n)), nil
}

//export mcbgo_model_unregister
func mcbgo_model_unregister(model uint64, errbuf unsafe.Pointer, errlen uint64) int32 {
	return withHandle(model, "model", errbuf, errlen, func(h *modelHandle) error {
		dropHandle(model)
		return h.b.UnregisterModel(h.m.Model)
	})
}

//export mcbgo_model_observe_prefill
func mcbgo_model_observe_prefill(model uint64, start, end uint32, seconds float64, errbuf unsafe.Pointer, errlen uint64) int32 {
	return withHandle(model, "model", errbuf, errlen, func(h *modelHandle) error {
		if end <= start || !(seconds > 0) || math.IsInf(seconds, 0) {
			return status.Errorf(status.InvalidArg, "prefill of [%d, %d) in %g s", start, end, seconds)
		}
		h.b.Arbiter().ObservePrefill(int(start), int(end), time.Duration(seconds*float64(time.Second)))
		return nil
	})
}

//export mcbgo_scope_id
func mcbgo_scope_id(scope unsafe.Pointer, out unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return guard(errbuf, errlen, func() error {
		if out == nil {
			return status.Errorf(status.InvalidArg, "out is NULL")
		}
		sc, err := scopeArg(scope)
		if err != nil {
			return err
		}
		id := sc.ID()
		copy(unsafe.Slice((*byte)(out), len(id)), id[:])
		return nil
	})
}

//export mcbgo_lookup
func mcbgo_lookup(model uint64, scope unsafe.Pointer, tokens unsafe.Pointer, n, cached uint64, out unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return withHandle(model, "model", errbuf, errlen, func(h *modelHandle) error {
		if err := aligned(out, 8, "out"); err != nil {
			return err
		}
		sc, err := scopeArg(scope)
		if err != nil {
			return err
		}
		toks, err := tokensArg(tokens, n)
		if err != nil {
			return err
		}
		if cached > n {
			return status.Errorf(status.InvalidArg, "%d cached of %d tokens", cached, n)
		}
		p, err := h.m.Lookup(sc, toks, int(cached))
		if err != nil {
			return err
		}
		d := p.Decision
		r := cLookupResult{
			NBlockTokens: uint32(h.m.BlockTokens()), NMatchedBlocks: uint32(p.MatchedBlocks),
			NRestoreTokens: uint32(p.RestoreTokens), Reason: int32(d.Reason),
			EstRestoreMS: ms(d.EstRestore.Seconds()), EstRecomputeMS: ms(d.EstRecompute.Seconds()), EstTotalMS: ms(d.EstTotal.Seconds()),
		}
		if p.RestoreTokens > 0 {
			r.Plan = addHandle(&planHandle{bridge: h.bridge, model: h, p: p})
		}
		*(*cLookupResult)(out) = r
		return nil
	})
}

func ms(s float64) float64 { return s * 1e3 }

// takePlan removes a plan from the table: a plan is used once.
func takePlan(plan uint64) (*planHandle, error) {
	h, err := lookupHandle[*planHandle](plan, "plan")
	if err == nil {
		dropHandle(plan)
	}
	return h, err
}

//export mcbgo_plan_drop
func mcbgo_plan_drop(plan uint64, errbuf unsafe.Pointer, errlen uint64) int32 {
	return guard(errbuf, errlen, func() error {
		_, err := takePlan(plan)
		return err
	})
}

//export mcbgo_load_begin
func mcbgo_load_begin(plan uint64, layout, cells unsafe.Pointer, out unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return withPlan(plan, errbuf, errlen, func(h *planHandle) error {
		if err := aligned(out, 8, "out"); err != nil {
			return err
		}
		var lo kvlayout.Layout
		var cs []uint32
		if !h.model.m.SnapshotOnly() || layout != nil || cells != nil {
			var err error
			if lo, err = layoutArg(layout); err != nil {
				return err
			}
			if cs, err = cellsArg(cells, h.p.RestoreTokens); err != nil {
				return err
			}
		}
		ld, err := h.p.Load(lo, cs)
		if err != nil {
			return err
		}
		*(*uint64)(out) = addHandle(&loadHandle{ld: ld, m: h.model.m})
		return nil
	})
}

//export mcbgo_save_begin
func mcbgo_save_begin(model uint64, scope, layout, tokens unsafe.Pointer, n uint64, cells unsafe.Pointer, out unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return withHandle(model, "model", errbuf, errlen, func(h *modelHandle) error {
		if err := aligned(out, 8, "out"); err != nil {
			return err
		}
		sc, err := scopeArg(scope)
		if err != nil {
			return err
		}
		lo, err := layoutArg(layout)
		if err != nil {
			return err
		}
		toks, err := tokensArg(tokens, n)
		if err != nil {
			return err
		}
		cs, err := cellsArg(cells, len(toks))
		if err != nil {
			return err
		}
		sv, err := h.m.SaveBegin(sc, lo, toks, cs)
		if err != nil {
			return err
		}
		*(*uint64)(out) = addHandle(&saveHandle{sv: sv})
		return nil
	})
}

//export mcbgo_load_wait_layer
func mcbgo_load_wait_layer(load uint64, il uint32, nok unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return withHandle(load, "load", errbuf, errlen, func(h *loadHandle) error {
		if err := aligned(nok, 4, "n_tokens_ok"); err != nil {
			return err
		}
		ok, err := h.ld.WaitLayer(int(il))
		if err != nil {
			return err
		}
		*(*uint32)(nok) = uint32(ok)
		return nil
	})
}

//export mcbgo_load_progress
func mcbgo_load_progress(load uint64, nLayers, nok unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return withHandle(load, "load", errbuf, errlen, func(h *loadHandle) error {
		if err := aligned(nLayers, 4, "n_layers"); err != nil {
			return err
		}
		if err := aligned(nok, 4, "n_tokens_ok"); err != nil {
			return err
		}
		layers, ok, err := h.ld.Progress()
		if err != nil {
			return err
		}
		*(*uint32)(nLayers), *(*uint32)(nok) = uint32(layers), uint32(ok)
		return nil
	})
}

func loadResult(r bridge.LoadResult) cLoadResult {
	return cLoadResult{NBlocks: uint32(r.Blocks), NBlocksOK: uint32(r.OKBlocks),
		NTokensOK: uint32(r.OKTokens), FirstError: int32(status.Of(r.Err)), NBytes: u64(r.Bytes)}
}

//export mcbgo_load_poll
func mcbgo_load_poll(load uint64, timeoutUS uint32, done unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return withHandle(load, "load", errbuf, errlen, func(h *loadHandle) error {
		if err := aligned(done, 1, "done"); err != nil {
			return err
		}
		*(*bool)(done) = h.ld.Poll(time.Duration(timeoutUS) * time.Microsecond)
		return nil
	})
}

//export mcbgo_load_cancel
func mcbgo_load_cancel(load uint64, errbuf unsafe.Pointer, errlen uint64) int32 {
	return withHandle(load, "load", errbuf, errlen, func(h *loadHandle) error {
		h.ld.Cancel()
		return nil
	})
}

//export mcbgo_load_end
func mcbgo_load_end(load uint64, out unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return withHandle(load, "load", errbuf, errlen, func(h *loadHandle) error {
		if err := aligned(out, 8, "out"); err != nil {
			return err
		}
		dropHandle(load)
		r, err := h.ld.End()
		*(*cLoadResult)(out) = loadResult(r)
		return err
	})
}

//export mcbgo_save_layer
func mcbgo_save_layer(save uint64, il uint32, errbuf unsafe.Pointer, errlen uint64) int32 {
	return withHandle(save, "save", errbuf, errlen, func(h *saveHandle) error {
		return h.sv.SaveLayer(int(il))
	})
}

func saveResult(r bridge.SaveResult) cSaveResult {
	return cSaveResult{NBlocks: uint32(r.Blocks), NKnown: uint32(r.Known), NWritten: uint32(r.Written), NQueued: uint32(r.Queued)}
}

//export mcbgo_save_end
func mcbgo_save_end(save uint64, out unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return withHandle(save, "save", errbuf, errlen, func(h *saveHandle) error {
		if err := aligned(out, 4, "out"); err != nil {
			return err
		}
		dropHandle(save)
		r, err := h.sv.End()
		*(*cSaveResult)(out) = saveResult(r)
		return err
	})
}

//export mcbgo_state_restore
func mcbgo_state_restore(plan uint64, state, n, out unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return withPlan(plan, errbuf, errlen, func(h *planHandle) error {
		if err := aligned(state, 8, "state"); err != nil {
			return err
		}
		if err := aligned(n, 8, "n_bytes"); err != nil {
			return err
		}
		if err := aligned(out, 8, "out"); err != nil {
			return err
		}
		if h.model.nStream == 0 {
			return status.Errorf(status.Unsupported, "the model was registered with tensors: restore with mcb_load_begin")
		}
		// The blob lives in C memory, so the host frees it with
		// mcb_state_free; the transfers land in it directly.
		var bufs []unsafe.Pointer
		alloc := func(size int) []byte {
			p := C.malloc(C.size_t(max(size, 1)))
			if p == nil {
				panic("out of memory for a state blob")
			}
			bufs = append(bufs, p)
			return unsafe.Slice((*byte)(p), size)
		}
		blob, res, err := h.model.m.RestoreState(h.p, host.Frame{Kind: llamastate.Memory, NStream: h.model.nStream}, alloc)
		if err == nil || res.Blocks > 0 {
			if res.Err == nil {
				res.Err = err
			}
			*(*cLoadResult)(out) = loadResult(res)
		}
		if blob == nil {
			for _, p := range bufs {
				C.free(p)
			}
			return err
		}
		keep := unsafe.Pointer(unsafe.SliceData(blob))
		for _, p := range bufs {
			if p != keep {
				C.free(p)
			}
		}
		*(*unsafe.Pointer)(state) = keep
		*(*uint64)(n) = uint64(len(blob))
		return err
	})
}

//export mcbgo_state_free
func mcbgo_state_free(state unsafe.Pointer) {
	C.free(state)
}

//export mcbgo_state_save
func mcbgo_state_save(model uint64, scope, state unsafe.Pointer, n uint64, tokens unsafe.Pointer, nTokens uint64, out unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return withHandle(model, "model", errbuf, errlen, func(h *modelHandle) error {
		if err := aligned(out, 4, "out"); err != nil {
			return err
		}
		sc, err := scopeArg(scope)
		if err != nil {
			return err
		}
		blob, err := stateArg(state, n)
		if err != nil {
			return err
		}
		toks, err := tokensArg(tokens, nTokens)
		if err != nil {
			return err
		}
		r, err := h.m.SaveState(sc, blob, toks)
		if err == nil || r != (bridge.SaveResult{}) {
			*(*cSaveResult)(out) = saveResult(r)
		}
		return err
	})
}

//export mcbgo_model_snapshot_tokens
func mcbgo_model_snapshot_tokens(model uint64) uint32 {
	h, err := lookupHandle[*modelHandle](model, "model")
	if err != nil {
		return 0
	}
	return uint32(h.m.SnapshotTokens())
}

//export mcbgo_snapshot_save
func mcbgo_snapshot_save(model uint64, scope, tokens unsafe.Pointer, nTokens uint64, state unsafe.Pointer, n uint64, errbuf unsafe.Pointer, errlen uint64) int32 {
	return withHandle(model, "model", errbuf, errlen, func(h *modelHandle) error {
		sc, err := scopeArg(scope)
		if err != nil {
			return err
		}
		toks, err := tokensArg(tokens, nTokens)
		if err != nil {
			return err
		}
		blob, err := stateArg(state, n)
		if err != nil {
			return err
		}
		return h.m.SaveSnapshot(sc, toks, blob)
	})
}

//export mcbgo_load_snapshot
func mcbgo_load_snapshot(load uint64, state, n unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return withHandle(load, "load", errbuf, errlen, func(h *loadHandle) error {
		if err := aligned(state, 8, "state"); err != nil {
			return err
		}
		if err := aligned(n, 8, "n_bytes"); err != nil {
			return err
		}
		*(*unsafe.Pointer)(state), *(*uint64)(n) = nil, 0
		snap, err := h.m.Snapshot(h.ld)
		if err != nil || snap == nil {
			return err
		}
		// C memory: the host frees it with mcb_state_free, and it outlives
		// the load's pool pins.
		p := C.malloc(C.size_t(len(snap)))
		if p == nil {
			return status.Errorf(status.Internal, "out of memory for a snapshot of %d bytes", len(snap))
		}
		copy(unsafe.Slice((*byte)(p), len(snap)), snap)
		*(*unsafe.Pointer)(state), *(*uint64)(n) = p, uint64(len(snap))
		return nil
	})
}

//export mcbgo_handles_open
func mcbgo_handles_open() uint64 {
	table.Lock()
	defer table.Unlock()
	return uint64(len(table.m))
}
