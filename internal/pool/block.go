// Package pool stores KV blocks in one registered memory region.
//
// A block is a header followed by its payload, both 64-byte aligned:
//
//	offset  size  field
//	0       4     magic "MCBK"
//	4       2     format version (3)
//	6       2     reserved, zero
//	8       8     generation: odd while the block is written, even when stable
//	16      8     header sum: XXH3-64 of bytes [24, HeaderSize)
//	24      16    block key
//	40      16    parent key (the scope root for a first block)
//	56      16    model fingerprint
//	72      4     tokens in the block (the model's block size)
//	76      4     layers
//	80      8     payload bytes
//	88      8     geometry digest: XXH3-64 of the per-layer K and V row sizes
//	96      4     depth: the block's index in its chain (0 for a first block)
//	100     28    reserved, zero
//	128     4*B   the block's tokens, little-endian int32
//	...     8*L   per-layer payload sums (Sum) of the layer's K rows then V rows
//	...     8*L   per-layer row sizes: u32 K bytes per token, u32 V bytes per token
//
// The row sizes make a block self-describing: a store node that holds
// blocks of models it never registered can still check every layer. The
// depth tells it what the block costs to recompute (attention grows with
// position), for its eviction and for a disk tier read back after a
// restart, where no chain is walked. Version 1 had no depth; version 2
// summed a layer in one XXH3 pass, which a copy cannot fuse at full speed.
//
// The payload holds, per layer, B K rows then B V rows, one row per token in
// position order. V is always stored by token, also when the host keeps it
// transposed, so blocks are interchangeable between flash-attention settings
// only if the fingerprint says so (it does not: v_trans is keyed).
//
// The generation is a seqlock: a reader that sees the same even generation
// before and after copying, and sums that match, holds the bytes a writer
// published. Every rewrite of a location takes a fresh generation, so a
// reader directed to an evicted and reused block fails verification.
package pool

import (
	"encoding/binary"
	"fmt"
	"sync/atomic"
	"unsafe"

	"github.com/zeebo/xxh3"

	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

const (
	magic         = 0x4b42434d // "MCBK"
	formatVersion = 3
	fixedHeader   = 128
	depthOffset   = 96
	reservedFrom  = 100
	align         = 64
	genOffset     = 8
	sumOffset     = 16
	sumFrom       = 24
)

// Geometry is the block shape of one model.
type Geometry struct {
	BlockTokens int
	KRow        []int // K bytes per token, per layer
	VRow        []int // V bytes per token, per layer
}

// MaxLayers and MaxRowBytes bound a geometry so that sizes never overflow.
const (
	MaxLayers      = 4096
	MaxRowBytes    = 1 << 24
	MaxBlockTokens = 1 << 16
)

// Validate checks that g describes a block this package can store.
func (g *Geometry) Validate() error {
	switch {
	case g.BlockTokens <= 0 || g.BlockTokens > MaxBlockTokens:
		return status.Errorf(status.InvalidArg, "block of %d tokens (1..%d)", g.BlockTokens, MaxBlockTokens)
	case len(g.KRow) == 0 || len(g.KRow) > MaxLayers:
		return status.Errorf(status.InvalidArg, "%d layers (1..%d)", len(g.KRow), MaxLayers)
	case len(g.VRow) != len(g.KRow):
		return status.Errorf(status.InvalidArg, "%d K layers but %d V layers", len(g.KRow), len(g.VRow))
	}
	// A layer without V (MLA: attention reads V out of K's latent; an
	// indexer cache's keys) has V rows of 0 bytes.
	for l := range g.KRow {
		if g.KRow[l] <= 0 || g.KRow[l] > MaxRowBytes || g.VRow[l] < 0 || g.VRow[l] > MaxRowBytes {
			return status.Errorf(status.InvalidArg, "layer %d rows of %d/%d bytes (K 1..%d, V 0..%d)", l, g.KRow[l], g.VRow[l], MaxRowBytes, MaxRowBytes)
		}
	}
	return nil
}

// Layers is the number of layers.
func (g *Geometry) Layers() int { return len(g.KRow) }

// HeaderSize is the aligned size of a block's header.
func (g *Geometry) HeaderSize() int {
	return alignUp(fixedHeader + 4*g.BlockTokens + 16*len(g.KRow))
}

// LayerSize is the payload bytes of layer l: its K rows then its V rows.
func (g *Geometry) LayerSize(l int) int { return g.BlockTokens * (g.KRow[l] + g.VRow[l]) }

// LayerOffset is where layer l starts, from the start of the block.
func (g *Geometry) LayerOffset(l int) int {
	off := g.HeaderSize()
	for i := 0; i < l; i++ {
		off += g.LayerSize(i)
	}
	return off
}

// PayloadSize is the bytes of all layers.
func (g *Geometry) PayloadSize() int { return g.LayerOffset(len(g.KRow)) - g.HeaderSize() }

// Size is a whole block's aligned size.
func (g *Geometry) Size() int { return alignUp(g.LayerOffset(len(g.KRow))) }

// Digest summarises the row sizes so a header names the geometry it was
// written with.
func (g *Geometry) Digest() uint64 {
	b := make([]byte, 0, 8+8*len(g.KRow))
	b = binary.LittleEndian.AppendUint32(b, uint32(g.BlockTokens))
	b = binary.LittleEndian.AppendUint32(b, uint32(len(g.KRow)))
	for l := range g.KRow {
		b = binary.LittleEndian.AppendUint32(b, uint32(g.KRow[l]))
		b = binary.LittleEndian.AppendUint32(b, uint32(g.VRow[l]))
	}
	return xxh3.Hash(b)
}

func alignUp(n int) int { return (n + align - 1) &^ (align - 1) }

// Header is a block's identity and integrity data.
type Header struct {
	Generation uint64
	Key        key.BlockKey
	Parent     key.Hash
	Model      key.Fingerprint
	Depth      uint32 // the block's index in its chain
	Tokens     []int32
	LayerSums  []uint64
}

// SumChunk is the span of a layer's payload each part of its sum covers:
// small enough that a copy can sum each chunk right after moving it, while
// the chunk is still in cache.
const SumChunk = 64 << 10

// Sum is the checksum of a layer's payload: XXH3-64 over the XXH3-64 of
// each SumChunk bytes (the last chunk may be shorter), as little-endian
// u64s. One-shot XXH3 of a chunk runs about 2.4 times as fast as feeding
// the same bytes to XXH3's streaming state, which a single pass over a
// whole layer that copies as it goes would need.
func Sum(payload []byte) uint64 {
	s := NewSummer()
	for off := 0; off < len(payload); off += SumChunk {
		s.Add(payload[off:min(off+SumChunk, len(payload))])
	}
	return s.Sum64()
}

// Summer computes Sum chunk by chunk, for copies that sum as they move.
type Summer struct {
	h *xxh3.Hasher
	b [8]byte
}

func NewSummer() Summer { return Summer{h: xxh3.New()} }

// Add sums the next chunk: SumChunk bytes, fewer only for the last.
func (s *Summer) Add(chunk []byte) { s.AddSum(xxh3.Hash(chunk)) }

// AddSum sums the next chunk given its xxh3.Hash, computed as it was
// copied (chunksum).
func (s *Summer) AddSum(chunk uint64) {
	binary.LittleEndian.PutUint64(s.b[:], chunk)
	_, _ = s.h.Write(s.b[:])
}

func (s *Summer) Sum64() uint64 { return s.h.Sum64() }

// EncodeHeader writes h into the first g.HeaderSize() bytes of dst, all but
// the generation, which only BeginWrite and EndWrite change.
func EncodeHeader(dst []byte, g *Geometry, h *Header) error {
	n := g.HeaderSize()
	if len(dst) < n {
		return status.Errorf(status.Internal, "header needs %d bytes, have %d", n, len(dst))
	}
	if len(h.Tokens) != g.BlockTokens || len(h.LayerSums) != g.Layers() {
		return status.Errorf(status.Internal, "header of %d tokens/%d sums for a %d-token %d-layer geometry",
			len(h.Tokens), len(h.LayerSums), g.BlockTokens, g.Layers())
	}
	le := binary.LittleEndian
	le.PutUint32(dst[0:], magic)
	le.PutUint16(dst[4:], formatVersion)
	le.PutUint16(dst[6:], 0)
	copy(dst[24:], h.Key[:])
	copy(dst[40:], h.Parent[:])
	copy(dst[56:], h.Model[:])
	le.PutUint32(dst[72:], uint32(g.BlockTokens))
	le.PutUint32(dst[76:], uint32(g.Layers()))
	le.PutUint64(dst[80:], uint64(g.PayloadSize()))
	le.PutUint64(dst[88:], g.Digest())
	le.PutUint32(dst[depthOffset:], h.Depth)
	clear(dst[reservedFrom:fixedHeader])
	off := fixedHeader
	for _, t := range h.Tokens {
		le.PutUint32(dst[off:], uint32(t))
		off += 4
	}
	for _, s := range h.LayerSums {
		le.PutUint64(dst[off:], s)
		off += 8
	}
	for l := range g.KRow {
		le.PutUint32(dst[off:], uint32(g.KRow[l]))
		le.PutUint32(dst[off+4:], uint32(g.VRow[l]))
		off += 8
	}
	clear(dst[off:n])
	le.PutUint64(dst[sumOffset:], xxh3.Hash(dst[sumFrom:n]))
	return nil
}

// DecodeHeader parses and checks a header written for geometry g. It checks
// the format, not the identity: Verify compares the identity.
func DecodeHeader(src []byte, g *Geometry) (Header, error) {
	n := g.HeaderSize()
	if len(src) < n {
		return Header{}, status.Errorf(status.Corrupt, "header truncated: %d of %d bytes", len(src), n)
	}
	le := binary.LittleEndian
	switch {
	case le.Uint32(src[0:]) != magic:
		return Header{}, status.Errorf(status.Corrupt, "bad block magic %#x", le.Uint32(src[0:]))
	case le.Uint16(src[4:]) != formatVersion:
		return Header{}, status.Errorf(status.Corrupt, "block format version %d", le.Uint16(src[4:]))
	case le.Uint64(src[sumOffset:]) != xxh3.Hash(src[sumFrom:n]):
		return Header{}, status.Errorf(status.Corrupt, "header checksum mismatch")
	case int(le.Uint32(src[72:])) != g.BlockTokens || int(le.Uint32(src[76:])) != g.Layers() ||
		le.Uint64(src[80:]) != uint64(g.PayloadSize()) || le.Uint64(src[88:]) != g.Digest():
		return Header{}, status.Errorf(status.Corrupt, "block geometry differs from the model's")
	case le.Uint16(src[6:]) != 0 || !allZero(src[reservedFrom:fixedHeader]) || !allZero(src[fixedHeader+4*g.BlockTokens+16*g.Layers():n]):
		// Bytes 6..8 are outside the header sum; the others are inside it
		// but a header written by EncodeHeader has them zero, so any other
		// value is not a header this format version wrote.
		return Header{}, status.Errorf(status.Corrupt, "reserved header bytes are not zero")
	}
	h := Header{
		Generation: le.Uint64(src[genOffset:]),
		Depth:      le.Uint32(src[depthOffset:]),
		Tokens:     make([]int32, g.BlockTokens),
		LayerSums:  make([]uint64, g.Layers()),
	}
	copy(h.Key[:], src[24:])
	copy(h.Parent[:], src[40:])
	copy(h.Model[:], src[56:])
	off := fixedHeader
	for i := range h.Tokens {
		h.Tokens[i] = int32(le.Uint32(src[off:]))
		off += 4
	}
	for i := range h.LayerSums {
		h.LayerSums[i] = le.Uint64(src[off:])
		off += 8
	}
	for l := range g.KRow {
		if int(le.Uint32(src[off:])) != g.KRow[l] || int(le.Uint32(src[off+4:])) != g.VRow[l] {
			return Header{}, status.Errorf(status.Corrupt, "layer %d row sizes differ from the model's", l)
		}
		off += 8
	}
	return h, nil
}

// ParseGeometry reads the geometry a block's header describes, for holders
// that do not know the block's model. It checks that the header is whole
// and consistent, not that it names any particular block.
func ParseGeometry(src []byte) (Geometry, error) {
	if len(src) < fixedHeader {
		return Geometry{}, status.Errorf(status.Corrupt, "header truncated: %d bytes", len(src))
	}
	le := binary.LittleEndian
	g := Geometry{BlockTokens: int(le.Uint32(src[72:]))}
	layers := int(le.Uint32(src[76:]))
	if g.BlockTokens <= 0 || g.BlockTokens > MaxBlockTokens || layers <= 0 || layers > MaxLayers {
		return Geometry{}, status.Errorf(status.Corrupt, "header names %d tokens and %d layers", g.BlockTokens, layers)
	}
	off := fixedHeader + 4*g.BlockTokens + 8*layers
	if len(src) < off+8*layers {
		return Geometry{}, status.Errorf(status.Corrupt, "header truncated: %d bytes", len(src))
	}
	g.KRow, g.VRow = make([]int, layers), make([]int, layers)
	for l := 0; l < layers; l++ {
		g.KRow[l] = int(le.Uint32(src[off:]))
		g.VRow[l] = int(le.Uint32(src[off+4:]))
		off += 8
	}
	if err := g.Validate(); err != nil {
		return Geometry{}, status.Wrap(status.Corrupt, err, "header geometry")
	}
	if _, err := DecodeHeader(src, &g); err != nil {
		return Geometry{}, err
	}
	return g, nil
}

// Expect is what a reader asked for; Verify compares a header against it.
type Expect struct {
	Key        key.BlockKey
	Parent     key.Hash
	Model      key.Fingerprint
	Tokens     []int32 // nil skips the comparison: the holder never saw them
	Generation uint64
}

// VerifyHeader decodes src and checks it names exactly the block expected,
// at the expected stable generation. Tokens are compared, not only keys, so
// a key collision restores nothing.
func VerifyHeader(src []byte, g *Geometry, want *Expect) (Header, error) {
	h, err := DecodeHeader(src, g)
	if err != nil {
		return h, err
	}
	switch {
	case h.Generation&1 == 1:
		return h, status.Errorf(status.Corrupt, "block %s is being written (generation %d)", want.Key, h.Generation)
	case h.Generation != want.Generation:
		return h, status.Errorf(status.Corrupt, "block %s generation %d, directory says %d: evicted or rewritten", want.Key, h.Generation, want.Generation)
	case h.Key != want.Key:
		return h, status.Errorf(status.Corrupt, "block holds key %s, want %s", h.Key, want.Key)
	case h.Parent != want.Parent:
		return h, status.Errorf(status.Corrupt, "block %s has another parent", want.Key)
	case h.Model != want.Model:
		return h, status.Errorf(status.Corrupt, "block %s belongs to model %s", want.Key, h.Model)
	}
	// A holder that never saw the tokens (a store node copying a block)
	// passes none; it still checks everything else.
	if want.Tokens != nil && len(want.Tokens) != len(h.Tokens) {
		return h, status.Errorf(status.Corrupt, "block %s holds %d tokens, want %d", want.Key, len(h.Tokens), len(want.Tokens))
	}
	for i, t := range want.Tokens {
		if h.Tokens[i] != t {
			return h, status.Errorf(status.Corrupt, "block %s token %d is %d, want %d (key collision)", want.Key, i, h.Tokens[i], t)
		}
	}
	return h, nil
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// HeaderSum returns the header checksum stored in a block.
func HeaderSum(block []byte) uint64 { return binary.LittleEndian.Uint64(block[sumOffset:]) }

// Generation loads a block's generation word with acquire semantics.
func Generation(block []byte) uint64 {
	return atomic.LoadUint64(genWord(block))
}

// BeginWrite marks a block as being written with an odd generation.
func BeginWrite(block []byte, gen uint64) {
	atomic.StoreUint64(genWord(block), gen|1)
}

// EndWrite publishes a block at the even generation gen; every store to
// the block before it is visible to a reader that loads gen.
func EndWrite(block []byte, gen uint64) {
	atomic.StoreUint64(genWord(block), gen&^1)
}

func genWord(block []byte) *uint64 {
	_ = block[genOffset+7]
	p := unsafe.Pointer(&block[genOffset])
	if uintptr(p)%8 != 0 {
		panic(fmt.Sprintf("pool: block at %p is not 8-byte aligned", p))
	}
	return (*uint64)(p)
}

// VerifyBlock checks a whole block: its header names exactly the block
// expected (VerifyHeader) and every layer's payload matches its sum. It
// reads the geometry from the header, for holders that do not know the
// block's model; the block must be exactly that geometry's size.
func VerifyBlock(block []byte, want *Expect) (Geometry, Header, error) {
	g, err := ParseGeometry(block)
	if err != nil {
		return g, Header{}, err
	}
	if len(block) != g.Size() {
		return g, Header{}, status.Errorf(status.Corrupt, "block %s is %d bytes, its header says %d", want.Key, len(block), g.Size())
	}
	h, err := VerifyHeader(block, &g, want)
	if err != nil {
		return g, h, err
	}
	for l := 0; l < g.Layers(); l++ {
		off := g.LayerOffset(l)
		if Sum(block[off:off+g.LayerSize(l)]) != h.LayerSums[l] {
			return g, h, status.Errorf(status.Corrupt, "block %s layer %d: checksum mismatch", want.Key, l)
		}
	}
	return g, h, nil
}
