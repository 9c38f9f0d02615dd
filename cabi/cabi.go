// Command cabi is the C ABI of the bridge, built with
// go build -buildmode=c-archive into libmcbridge.a. The public functions of
// include/mcbridge.h are C shims (csrc/mcbridge.c) over the mcbgo_ exports
// here; this file only converts arguments, keeps the handle table and turns
// errors and panics into statuses. Everything else is plain Go in bridge/.
package main

/*
#cgo CFLAGS: -I${SRCDIR}/../include -Wall -Wextra -Werror
*/
import "C"

import (
	"fmt"
	"math"
	"runtime/debug"
	"sync"
	"time"
	"unsafe"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout"
	"github.com/mcbridge/mcbridge/internal/mem"
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
)

type bridgeHandle struct {
	b *bridge.Bridge
}

type modelHandle struct {
	bridge uint64
	b      *bridge.Bridge
	m      *bridge.Model
}

type loadHandle struct{ ld *bridge.Load }

type saveHandle struct{ sv *bridge.Save }

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
	var out key.Scope
	if s.TenantSaltLen > maxSaltBytes {
		return out, status.Errorf(status.InvalidArg, "tenant salt of %d bytes (max %d)", s.TenantSaltLen, maxSaltBytes)
	}
	if s.TenantSaltLen > 0 {
		if s.TenantSalt == 0 {
			return out, status.Errorf(status.InvalidArg, "tenant salt is NULL with length %d", s.TenantSaltLen)
		}
		out.TenantSalt = append([]byte(nil), mem.Bytes(s.TenantSalt, int(s.TenantSaltLen))...)
	}
	var err error
	out.Adapters, err = cString(s.Adapters, maxString, "adapters")
	return out, err
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

func modelArg(p unsafe.Pointer) (bridge.ModelSpec, error) {
	var spec bridge.ModelSpec
	if err := aligned(p, 8, "model params"); err != nil {
		return spec, err
	}
	c := (*cModelParams)(p)
	n := int(c.NLayer)
	if n == 0 || n > maxLayers {
		return spec, status.Errorf(status.InvalidArg, "model of %d layers (1..%d)", n, maxLayers)
	}
	mp := key.Model{NLayer: c.NLayer, BlockTokens: c.BlockTokens, TypeK: c.TypeK, TypeV: c.TypeV,
		VTrans: c.VTrans, RopeType: c.RopeType, RopeFreqBase: c.RopeFreqBase, RopeScale: c.RopeFreqScale,
		NCtxOrig: c.NCtxOrig, AttnRotK: c.AttnRotK, AttnRotV: c.AttnRotV, KVProbe: c.KVProbe, ContentHash: c.ContentHash}
	var err error
	if mp.LlamaVersion, err = cString(c.LlamaVersion, maxString, "llama_version"); err != nil {
		return spec, err
	}
	if mp.Arch, err = cString(c.Arch, maxString, "arch"); err != nil {
		return spec, err
	}
	if mp.Extra, err = cString(c.Extra, maxString, "extra"); err != nil {
		return spec, err
	}
	path, err := cString(c.GGUFPath, maxString, "gguf_path")
	if err != nil {
		return spec, err
	}
	if path != "" {
		if mp.ContentHash, err = key.FileDigest(path); err != nil {
			return spec, status.Wrap(status.InvalidArg, err, "digesting the model file")
		}
	}
	var ek, ev []int
	if ek, err = u32s(c.NEmbdKGQA, n, "n_embd_k_gqa"); err != nil {
		return spec, err
	}
	if ev, err = u32s(c.NEmbdVGQA, n, "n_embd_v_gqa"); err != nil {
		return spec, err
	}
	if spec.KRow, err = u32s(c.KRowBytes, n, "k_row_bytes"); err != nil {
		return spec, err
	}
	if spec.VRow, err = u32s(c.VRowBytes, n, "v_row_bytes"); err != nil {
		return spec, err
	}
	spec.VElem = make([]int, n)
	for l := 0; l < n; l++ {
		mp.NEmbdKGQA = append(mp.NEmbdKGQA, uint32(ek[l]))
		mp.NEmbdVGQA = append(mp.NEmbdVGQA, uint32(ev[l]))
		spec.VElem[l] = 1
		// Transposed V is stored unquantized, so its rows are whole
		// elements; quantized V is never transposed and needs no element.
		if ev[l] > 0 && spec.VRow[l]%ev[l] == 0 {
			spec.VElem[l] = spec.VRow[l] / ev[l]
		} else if c.VTrans {
			return spec, status.Errorf(status.InvalidArg, "layer %d: transposed V row of %d bytes for %d dimensions", l, spec.VRow[l], ev[l])
		}
	}
	spec.Params = mp
	return spec, nil
}

//export mcbgo_bridge_open
func mcbgo_bridge_open(cfg unsafe.Pointer, out unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return guard(errbuf, errlen, func() error {
		if err := aligned(out, 8, "out"); err != nil {
			return err
		}
		doc, err := cString(uintptr(cfg), maxConfig, "config")
		if err != nil {
			return err
		}
		c, err := config.Load(doc)
		if err != nil {
			return err
		}
		b, err := bridge.Open(c, bridge.Deps{})
		if err != nil {
			return err
		}
		*(*uint64)(out) = addHandle(&bridgeHandle{b: b})
		return nil
	})
}

//export mcbgo_bridge_close
func mcbgo_bridge_close(bridge uint64, errbuf unsafe.Pointer, errlen uint64) int32 {
	return guard(errbuf, errlen, func() error {
		h, err := lookupHandle[*bridgeHandle](bridge, "bridge")
		if err != nil {
			return err
		}
		if err := h.b.Close(); status.Of(err) == status.State {
			return err // work still open: the bridge stays usable
		} else if err != nil {
			dropBridge(bridge)
			return err
		}
		dropBridge(bridge)
		return nil
	})
}

// dropBridge removes a bridge's handle and its models' handles.
func dropBridge(bridge uint64) {
	table.Lock()
	defer table.Unlock()
	delete(table.m, bridge)
	for id, v := range table.m {
		if m, ok := v.(*modelHandle); ok && m.bridge == bridge {
			delete(table.m, id)
		}
	}
}

//export mcbgo_bridge_stats
func mcbgo_bridge_stats(bridge uint64, out unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return guard(errbuf, errlen, func() error {
		h, err := lookupHandle[*bridgeHandle](bridge, "bridge")
		if err != nil {
			return err
		}
		if err := aligned(out, 8, "out"); err != nil {
			return err
		}
		s := h.b.Stats()
		blocks, bytes, poolBytes := h.b.Resident()
		*(*cStats)(out) = cStats{
			Lookups: u64(s.Lookups), Hits: u64(s.Hits), Misses: u64(s.Misses),
			DecidedRestore: u64(s.DecidedRestore), DecidedRecompute: u64(s.DecidedRecompute),
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

//export mcbgo_model_register
func mcbgo_model_register(bridge uint64, params unsafe.Pointer, out unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return guard(errbuf, errlen, func() error {
		h, err := lookupHandle[*bridgeHandle](bridge, "bridge")
		if err != nil {
			return err
		}
		if err := aligned(out, 8, "out"); err != nil {
			return err
		}
		spec, err := modelArg(params)
		if err != nil {
			return err
		}
		m, err := h.b.RegisterModel(spec)
		if err != nil {
			return err
		}
		*(*uint64)(out) = addHandle(&modelHandle{bridge: bridge, b: h.b, m: m})
		return nil
	})
}

//export mcbgo_model_unregister
func mcbgo_model_unregister(model uint64, errbuf unsafe.Pointer, errlen uint64) int32 {
	return guard(errbuf, errlen, func() error {
		h, err := lookupHandle[*modelHandle](model, "model")
		if err != nil {
			return err
		}
		dropHandle(model)
		return h.b.UnregisterModel(h.m)
	})
}

//export mcbgo_model_observe_prefill
func mcbgo_model_observe_prefill(model uint64, start, end uint32, seconds float64, errbuf unsafe.Pointer, errlen uint64) int32 {
	return guard(errbuf, errlen, func() error {
		h, err := lookupHandle[*modelHandle](model, "model")
		if err != nil {
			return err
		}
		if end <= start || !(seconds > 0) || math.IsInf(seconds, 0) {
			return status.Errorf(status.InvalidArg, "prefill of [%d, %d) in %g s", start, end, seconds)
		}
		h.b.Arbiter().ObservePrefill(int(start), int(end), time.Duration(seconds*float64(time.Second)))
		return nil
	})
}

//export mcbgo_lookup
func mcbgo_lookup(model uint64, scope unsafe.Pointer, tokens unsafe.Pointer, n uint64, out unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return guard(errbuf, errlen, func() error {
		h, err := lookupHandle[*modelHandle](model, "model")
		if err != nil {
			return err
		}
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
		r, err := h.m.Lookup(sc, toks)
		if err != nil {
			return err
		}
		d := r.Decision
		*(*cLookupResult)(out) = cLookupResult{
			NBlockTokens: uint32(h.m.BlockTokens()), NMatchedBlocks: uint32(r.MatchedBlocks),
			NRestoreTokens: uint32(r.RestoreTokens), Reason: int32(d.Reason),
			EstRestoreMS: ms(d.EstRestore.Seconds()), EstRecomputeMS: ms(d.EstRecompute.Seconds()), EstTotalMS: ms(d.EstTotal.Seconds()),
		}
		return nil
	})
}

func ms(s float64) float64 { return s * 1e3 }

//export mcbgo_load_begin
func mcbgo_load_begin(model uint64, scope, layout, tokens unsafe.Pointer, n uint64, cells unsafe.Pointer, out unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return guard(errbuf, errlen, func() error {
		h, sc, lo, toks, cs, err := transferArgs(model, scope, layout, tokens, n, cells, out)
		if err != nil {
			return err
		}
		ld, err := h.m.LoadBegin(sc, lo, toks, cs)
		if err != nil {
			return err
		}
		*(*uint64)(out) = addHandle(&loadHandle{ld: ld})
		return nil
	})
}

//export mcbgo_save_begin
func mcbgo_save_begin(model uint64, scope, layout, tokens unsafe.Pointer, n uint64, cells unsafe.Pointer, out unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return guard(errbuf, errlen, func() error {
		h, sc, lo, toks, cs, err := transferArgs(model, scope, layout, tokens, n, cells, out)
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

// transferArgs converts the arguments that loads and saves share.
func transferArgs(model uint64, scope, layout, tokens unsafe.Pointer, n uint64, cells, out unsafe.Pointer) (
	*modelHandle, key.Scope, kvlayout.Layout, []int32, []uint32, error) {
	h, err := lookupHandle[*modelHandle](model, "model")
	if err != nil {
		return nil, key.Scope{}, kvlayout.Layout{}, nil, nil, err
	}
	if err := aligned(out, 8, "out"); err != nil {
		return nil, key.Scope{}, kvlayout.Layout{}, nil, nil, err
	}
	sc, err := scopeArg(scope)
	if err != nil {
		return nil, key.Scope{}, kvlayout.Layout{}, nil, nil, err
	}
	lo, err := layoutArg(layout)
	if err != nil {
		return nil, key.Scope{}, kvlayout.Layout{}, nil, nil, err
	}
	toks, err := tokensArg(tokens, n)
	if err != nil {
		return nil, key.Scope{}, kvlayout.Layout{}, nil, nil, err
	}
	cs, err := cellsArg(cells, len(toks))
	return h, sc, lo, toks, cs, err
}

//export mcbgo_load_wait_layer
func mcbgo_load_wait_layer(load uint64, il uint32, nok unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return guard(errbuf, errlen, func() error {
		h, err := lookupHandle[*loadHandle](load, "load")
		if err != nil {
			return err
		}
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

//export mcbgo_load_end
func mcbgo_load_end(load uint64, out unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return guard(errbuf, errlen, func() error {
		h, err := lookupHandle[*loadHandle](load, "load")
		if err != nil {
			return err
		}
		if err := aligned(out, 8, "out"); err != nil {
			return err
		}
		dropHandle(load)
		r, err := h.ld.End()
		*(*cLoadResult)(out) = cLoadResult{NBlocks: uint32(r.Blocks), NBlocksOK: uint32(r.OKBlocks),
			NTokensOK: uint32(r.OKTokens), FirstError: int32(status.Of(r.Err)), NBytes: u64(r.Bytes)}
		return err
	})
}

//export mcbgo_save_layer
func mcbgo_save_layer(save uint64, il uint32, errbuf unsafe.Pointer, errlen uint64) int32 {
	return guard(errbuf, errlen, func() error {
		h, err := lookupHandle[*saveHandle](save, "save")
		if err != nil {
			return err
		}
		return h.sv.SaveLayer(int(il))
	})
}

//export mcbgo_save_end
func mcbgo_save_end(save uint64, out unsafe.Pointer, errbuf unsafe.Pointer, errlen uint64) int32 {
	return guard(errbuf, errlen, func() error {
		h, err := lookupHandle[*saveHandle](save, "save")
		if err != nil {
			return err
		}
		if err := aligned(out, 4, "out"); err != nil {
			return err
		}
		dropHandle(save)
		r, err := h.sv.End()
		*(*cSaveResult)(out) = cSaveResult{NBlocks: uint32(r.Blocks), NKnown: uint32(r.Known),
			NWritten: uint32(r.Written), NPublished: uint32(r.Published), NDeduped: uint32(r.Deduped)}
		return err
	})
}

//export mcbgo_handles_open
func mcbgo_handles_open() uint64 {
	table.Lock()
	defer table.Unlock()
	return uint64(len(table.m))
}
