package main

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mcbridge/mcbridge/internal/gguf"
	"github.com/mcbridge/mcbridge/internal/host"
	"github.com/mcbridge/mcbridge/internal/mem"
)

// The model files every registration names: the library reads the
// architecture from them and digests them, so they must be real GGUFs.
// otherGGUF has the same shape and other weights.
var ggufPath, otherGGUF string

// probeTokens is the prompt whose KV a host registers with.
var probeTokens = host.ProbeTokens()

// TestMain writes the model files and fails the package when any handle
// outlives its tests: a host checks mcb_handles_open at exit, and so does
// this suite.
func TestMain(m *testing.M) { os.Exit(runTests(m)) }

func runTests(m *testing.M) int {
	dir, err := os.MkdirTemp("", "mcbridge-bridge-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	ggufPath, otherGGUF = filepath.Join(dir, "tiny.gguf"), filepath.Join(dir, "tiny-seed2.gguf")
	other := gguf.Presets["tiny"]
	other.Seed = 2
	for path, cfg := range map[string]gguf.Config{ggufPath: gguf.Presets["tiny"], otherGGUF: other} {
		if err := gguf.WriteFile(path, cfg); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	code := m.Run()
	if n := mcbgo_handles_open(); code == 0 && n != 0 {
		fmt.Fprintf(os.Stderr, "FAIL: %d handles still open after every test\n", n)
		code = 1
	}
	return code
}

// writeFile writes a file of content into a test's own directory, for
// adapters (named by their bytes) and copies of a model file.
func writeFile(tb testing.TB, name string, content []byte) string {
	tb.Helper()
	path := filepath.Join(tb.TempDir(), name)
	require.NoError(tb, os.WriteFile(path, content, 0o644))
	return path
}

// cmem is memory outside the Go heap, as a C host's is, handed out
// bump-style. Tests build the ABI's structs, strings, arrays and KV tensors
// in it, so the library sees exactly what it sees from C.
type cmem struct {
	buf  []byte
	next int
}

func newCmem(tb testing.TB, size int) *cmem {
	tb.Helper()
	b, err := mem.Map(size)
	require.NoError(tb, err)
	tb.Cleanup(func() { _ = mem.Unmap(b) })
	return &cmem{buf: b}
}

// take returns n bytes aligned to align, or nil once the memory is used up.
func (c *cmem) take(n, align int) []byte {
	n = max(n, 1)
	off := (c.next + align - 1) &^ (align - 1)
	if off+n > len(c.buf) {
		return nil
	}
	c.next = off + n
	return c.buf[off : off+n : off+n]
}

func (c *cmem) alloc(tb testing.TB, n, align int) []byte {
	tb.Helper()
	b := c.take(n, align)
	require.NotNil(tb, b, "host memory of %d bytes used up", len(c.buf))
	return b
}

func pointer(b []byte) unsafe.Pointer { return unsafe.Pointer(unsafe.SliceData(b)) }

func address(b []byte) uintptr { return uintptr(pointer(b)) }

// put copies v into host memory at v's alignment plus skew bytes; a skew
// that is not a multiple of the alignment gives the misaligned structs a
// careless host passes. It returns nil once the memory is used up.
func put[T any](c *cmem, v T, skew int) *T {
	size, align := int(unsafe.Sizeof(v)), int(unsafe.Alignof(v))
	b := c.take(size+skew, align)
	if b == nil {
		return nil
	}
	copy(b[skew:], unsafe.Slice((*byte)(unsafe.Pointer(&v)), size))
	return (*T)(unsafe.Add(pointer(b), skew))
}

// putT is put for the tests, which fail when the memory is used up.
func putT[T any](tb testing.TB, c *cmem, v T, skew int) *T {
	tb.Helper()
	p := put(c, v, skew)
	require.NotNil(tb, p, "host memory of %d bytes used up", len(c.buf))
	return p
}

func (c *cmem) cstr(tb testing.TB, s string) uintptr {
	b := c.alloc(tb, len(s)+1, 1)
	copy(b, s)
	b[len(s)] = 0
	return address(b)
}

func (c *cmem) bytes(tb testing.TB, v []byte) unsafe.Pointer {
	b := c.alloc(tb, len(v), 8)
	copy(b, v)
	return pointer(b)
}

func (c *cmem) u32s(tb testing.TB, v []uint32) uintptr {
	b := c.alloc(tb, 4*len(v), 4)
	copy(unsafe.Slice((*uint32)(pointer(b)), len(v)), v)
	return address(b)
}

func (c *cmem) i32s(tb testing.TB, v []int32) unsafe.Pointer {
	b := c.alloc(tb, 4*len(v), 4)
	copy(unsafe.Slice((*int32)(pointer(b)), len(v)), v)
	return pointer(b)
}

// edgeString returns n bytes that end where an unreadable page begins:
// with last != 0 no terminator is in reach, the string a host forgot to
// terminate; with last == 0 it is the longest string that may sit there.
// Reading one byte too far faults.
func edgeString(tb testing.TB, n int, last byte) []byte {
	tb.Helper()
	b := edgeBytes(tb, n)
	for i := range b {
		b[i] = 'x'
	}
	b[n-1] = last
	return b
}

// edgeBytes returns n bytes followed by an unreadable page.
func edgeBytes(tb testing.TB, n int) []byte {
	tb.Helper()
	page := os.Getpagesize()
	size := (n+page-1)/page*page + page
	b, err := mem.Map(size)
	require.NoError(tb, err)
	tb.Cleanup(func() { _ = mem.Unmap(b) })
	require.NoError(tb, unix.Mprotect(b[size-page:], unix.PROT_NONE))
	return b[size-page-n : size-page : size-page]
}

// model is the KV shape a host registers, with f16 rows as llama.cpp's
// default cache type has: two bytes per embedding element. A layer whose
// vEmbd is 0 has no V tensor: every layer of a K-only cache (MLA), an
// indexer cache's beside an attention cache's.
type model struct {
	block        uint32
	kEmbd, vEmbd []uint32
	vtrans       bool
}

const (
	elem    = 2 // bytes of an f16
	typeF16 = 1 // GGML_TYPE_F16
)

func (m model) layers() int    { return len(m.kEmbd) }
func (m model) krow(l int) int { return elem * int(m.kEmbd[l]) }
func (m model) vrow(l int) int { return elem * int(m.vEmbd[l]) }
func (m model) row(l, kv int) int {
	if kv == 0 {
		return m.krow(l)
	}
	return m.vrow(l)
}

// payload is the KV bytes of one block, what a load reports per block.
func (m model) payload() int {
	n := 0
	for l := range m.kEmbd {
		n += int(m.block) * (m.krow(l) + m.vrow(l))
	}
	return n
}

// params builds the host's struct mcb_model_params for m, naming path.
// It returns nil once c is used up.
func (m model) params(c *cmem, path string) *cModelParams {
	version, file := c.take(len(host.LlamaVersion)+1, 1), c.take(len(path)+1, 1)
	if version == nil || file == nil {
		return nil
	}
	copy(version, host.LlamaVersion+"\x00")
	copy(file, path+"\x00")
	return put(c, cModelParams{LlamaVersion: address(version), GGUFPath: address(file), BlockTokens: m.block}, 0)
}

// format builds the host's struct mcb_kv_format for m, or nil once c is
// used up.
func (m model) format(c *cmem) *cKVFormat {
	n := m.layers()
	kr, vr := make([]uint32, n), make([]uint32, n)
	for l := 0; l < n; l++ {
		kr[l], vr[l] = uint32(m.krow(l)), uint32(m.vrow(l))
	}
	arrays := make([]uintptr, 4)
	for i, a := range [][]uint32{m.kEmbd, m.vEmbd, kr, vr} {
		b := c.take(4*n, 4)
		if b == nil {
			return nil
		}
		copy(unsafe.Slice((*uint32)(pointer(b)), n), a)
		arrays[i] = address(b)
	}
	return put(c, cKVFormat{NLayer: uint32(n), NEmbdKGQA: arrays[0], NEmbdVGQA: arrays[1], KRowBytes: arrays[2], VRowBytes: arrays[3],
		TypeK: typeF16, TypeV: typeF16, VTrans: m.vtrans}, 0)
}

// registration is the arguments of one mcb_model_register, in host
// memory: the model's names, its KV format and a cache holding the probe
// prompt's KV at cells.
type registration struct {
	params *cModelParams
	format *cKVFormat
	probe  *tensors
	cells  []uint32
	pcells unsafe.Pointer // cells, in host memory
}

// probeCells are where registrations keep the probe: wrapped around the
// end of a small cache, so that gathering it in position order matters.
var probeCells = wrapCells(len(probeTokens), 11, 16)

// registration lays out a registration of m naming path, its probe
// computed at probeCells. It returns nil once c is used up.
func (m model) registration(c *cmem, path string) *registration {
	r := &registration{params: m.params(c, path), format: m.format(c), probe: newTensors(c, m, 16, m.vtrans, tight),
		cells: append([]uint32(nil), probeCells...)}
	if r.params == nil || r.format == nil || r.probe == nil {
		return nil
	}
	r.probe.compute(probeTokens, r.cells, len(probeTokens))
	b := c.take(4*len(r.cells), 4)
	if b == nil {
		return nil
	}
	copy(unsafe.Slice((*uint32)(pointer(b)), len(r.cells)), r.cells)
	r.pcells = pointer(b)
	return r
}

func (m model) reg(tb testing.TB, c *cmem) *registration {
	tb.Helper()
	r := m.registration(c, ggufPath)
	require.NotNil(tb, r, "host memory of %d bytes used up", len(c.buf))
	return r
}

// value is the byte a token at position pos has at byte i of layer l's K
// (kv 0) or V (kv 1) row. It depends on nothing else, so every block of a
// prompt holds the same bytes whoever computed it.
func value(tok int32, pos, l, kv, i int) byte {
	return byte(int(tok)*31 + pos*7 + l*13 + kv*101 + i*3)
}

// tensors is a host's KV cache for a model: per layer a K and a V tensor of
// cells rows (V optionally transposed, one row per dimension), each
// followed by a guard gap, all inside one region that the tests compare
// byte for byte. The layout struct describing them lives in host memory.
type tensors struct {
	m          model
	cells      uint32
	vtrans     bool
	kstride    []uint64
	vstride    []uint64
	koff, voff []int
	region     []byte
	layers     []cKVLayer // the layout's layer array, in host memory
	layout     *cKVLayout
}

const guardGap = 64

// newTensors lays out tensors for m with pad(l, kv) bytes added to the
// tightest stride of each; a negative pad gives the strides below the row
// size that a layout must refuse. It returns nil when c is used up.
func newTensors(c *cmem, m model, cells uint32, vtrans bool, pad func(l, kv int) int) *tensors {
	n := m.layers()
	t := &tensors{m: m, cells: cells, vtrans: vtrans,
		kstride: make([]uint64, n), vstride: make([]uint64, n), koff: make([]int, n), voff: make([]int, n)}
	size := guardGap
	for l := 0; l < n; l++ {
		t.kstride[l] = uint64(max(m.krow(l)+pad(l, 0), 0))
		t.koff[l] = size
		size += extent(int(t.kstride[l]), m.krow(l), int(cells)) + guardGap
		t.voff[l] = size
		if m.vEmbd[l] == 0 {
			continue // no V tensor
		}
		if vtrans {
			t.vstride[l] = uint64(max(int(cells)*elem+pad(l, 1), 0))
			size += extent(int(t.vstride[l]), int(cells)*elem, int(m.vEmbd[l])) + guardGap
		} else {
			t.vstride[l] = uint64(max(m.vrow(l)+pad(l, 1), 0))
			size += extent(int(t.vstride[l]), m.vrow(l), int(cells)) + guardGap
		}
	}
	if t.region = c.take(size, 64); t.region == nil {
		return nil
	}
	scribble(t.region, uint64(address(t.region)))
	lb := c.take(n*int(unsafe.Sizeof(cKVLayer{})), 8)
	if lb == nil {
		return nil
	}
	t.layers = unsafe.Slice((*cKVLayer)(pointer(lb)), n)
	base := address(t.region)
	for l := 0; l < n; l++ {
		t.layers[l] = cKVLayer{K: base + uintptr(t.koff[l]), KStride: t.kstride[l]}
		if m.vEmbd[l] > 0 {
			t.layers[l].V, t.layers[l].VStride = base+uintptr(t.voff[l]), t.vstride[l]
		}
	}
	loc := c.take(len("cpu:0")+1, 1)
	if loc == nil {
		return nil
	}
	copy(loc, "cpu:0\x00")
	t.layout = put(c, cKVLayout{NLayer: uint32(n), NCells: cells, VTrans: vtrans,
		Location: address(loc), Layers: address(lb)}, 0)
	if t.layout == nil {
		return nil
	}
	return t
}

func mustTensors(tb testing.TB, c *cmem, m model, cells uint32, vtrans bool, pad func(l, kv int) int) *tensors {
	tb.Helper()
	t := newTensors(c, m, cells, vtrans, pad)
	require.NotNil(tb, t, "host memory of %d bytes used up", len(c.buf))
	return t
}

// extent is the bytes n rows of row bytes at stride span, never less than
// the rows themselves so that a refused stride still has memory behind it.
func extent(stride, row, n int) int { return (n-1)*max(stride, row) + row }

func tight(int, int) int { return 0 }

// scribble fills b with bytes no restore writes by accident: a xorshift
// stream, so a row landing one cell off differs from what was there.
func scribble(b []byte, seed uint64) {
	x := seed | 1
	for i := range b {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		b[i] = byte(x >> 32)
	}
}

// at is the region offset of byte i of the layer-l K (kv 0) or V row of cell.
func (t *tensors) at(l, kv int, cell uint32, i int) int {
	if kv == 0 {
		return t.koff[l] + int(uint64(cell)*t.kstride[l]) + i
	}
	if t.vtrans {
		return t.voff[l] + int(uint64(i/elem)*t.vstride[l]) + int(cell)*elem + i%elem
	}
	return t.voff[l] + int(uint64(cell)*t.vstride[l]) + i
}

func cellOf(cells []uint32, p int) uint32 {
	if cells == nil {
		return uint32(p)
	}
	return cells[p]
}

// compute writes the KV of positions [0, n) of tokens into their cells, as
// the host's decode would.
func (t *tensors) compute(tokens []int32, cells []uint32, n int) {
	for p := 0; p < n; p++ {
		for l := 0; l < t.m.layers(); l++ {
			for kv := 0; kv < 2; kv++ {
				for i := 0; i < t.m.row(l, kv); i++ {
					t.region[t.at(l, kv, cellOf(cells, p), i)] = value(tokens[p], p, l, kv, i)
				}
			}
		}
	}
}

func (t *tensors) snapshot() []byte { return append([]byte(nil), t.region...) }

// checkRestore compares the region with before, after a restore of
// positions [0, n) into cells: positions below ok hold their values in the
// layers below layers, byte for byte. The rows of the load's other
// positions are unspecified (a restore may write transfers straight into
// them, and a failed block leaves them as it arrived); every other byte,
// guard gaps, stride padding and the cells of other positions included,
// is as before.
func (t *tensors) checkRestore(before []byte, tokens []int32, cells []uint32, n, ok, layers int) error {
	covered := make([]bool, len(t.region))
	for p := 0; p < n; p++ {
		for l := 0; l < t.m.layers(); l++ {
			for kv := 0; kv < 2; kv++ {
				for i := 0; i < t.m.row(l, kv); i++ {
					off := t.at(l, kv, cellOf(cells, p), i)
					covered[off] = true
					if want, got := value(tokens[p], p, l, kv, i), t.region[off]; p < ok && l < layers && got != want {
						return fmt.Errorf("position %d layer %d %s byte %d = %#x, restored %#x", p, l, "KV"[kv:kv+1], i, got, want)
					}
				}
			}
		}
	}
	for off, c := range covered {
		if !c && t.region[off] != before[off] {
			return fmt.Errorf("byte %d of the tensors, outside every restored row, changed from %#x to %#x", off, before[off], t.region[off])
		}
	}
	return nil
}

// checkUntouched reports the first byte of the region that differs from before.
func (t *tensors) checkUntouched(before []byte) error {
	for off := range t.region {
		if t.region[off] != before[off] {
			return fmt.Errorf("byte %d of the tensors changed from %#x to %#x", off, before[off], t.region[off])
		}
	}
	return nil
}

// prompt returns n tokens of family f that agree with family 0 before
// position diverge, so that prompts share a cached prefix.
func prompt(n, f, diverge int) []int32 {
	tok := make([]int32, n)
	for i := range tok {
		tok[i] = int32((i*7919 + 13) % 32000)
		if i >= diverge {
			tok[i] = int32((i*104729 + f*65537 + 7) % 32000)
		}
	}
	return tok
}

// wrapCells puts positions into cells that wrap around holes, as
// llama.cpp's find_slot leaves them, starting at first.
func wrapCells(n, first, cells int) []uint32 {
	c := make([]uint32, n)
	for i := range c {
		c[i] = uint32((first + i) % cells)
	}
	return c
}

func reversed(n, cells int) []uint32 {
	c := make([]uint32, n)
	for i := range c {
		c[i] = uint32(cells - 1 - i)
	}
	return c
}
