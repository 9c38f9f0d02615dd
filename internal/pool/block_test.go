package pool

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/zeebo/xxh3"

	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

func smallGeometry() *Geometry {
	return &Geometry{BlockTokens: 4, KRow: []int{8, 16}, VRow: []int{8, 8}}
}

// fuzzGeometries are the shapes the header tests and the fuzz target run
// over: a tiny one, one whose header needs padding, a llama-like one and
// a K-only one.
func fuzzGeometries() []*Geometry {
	return []*Geometry{
		smallGeometry(),
		{BlockTokens: 3, KRow: []int{5}, VRow: []int{7}},
		{BlockTokens: 16, KRow: []int{256, 256, 256}, VRow: []int{256, 256, 128}},
		{BlockTokens: 4, KRow: []int{24, 24}, VRow: []int{0, 0}}, // K-only (MLA)
	}
}

func TestGeometrySizes(t *testing.T) {
	g := smallGeometry()
	// 128 fixed + 4*4 tokens + 8*2 sums + 8*2 row sizes = 176, aligned to 192.
	require.Equal(t, 192, g.HeaderSize(), "header size")
	require.Equal(t, 64, g.LayerSize(0), "layer 0 size")
	require.Equal(t, 96, g.LayerSize(1), "layer 1 size")
	require.Equal(t, 192, g.LayerOffset(0), "layer 0 offset")
	require.Equal(t, 256, g.LayerOffset(1), "layer 1 offset")
	require.Equal(t, 160, g.PayloadSize(), "payload size")
	require.Equal(t, 384, g.Size(), "block size")
	for _, g := range append(fuzzGeometries(), &Geometry{BlockTokens: 256, KRow: repeat(32, 1024), VRow: repeat(32, 1024)}) {
		require.NoError(t, g.Validate())
		h := g.HeaderSize()
		assert.Zero(t, h%align, "%+v: header size %d is not aligned", g, h)
		assert.GreaterOrEqual(t, h, fixedHeader+4*g.BlockTokens+16*g.Layers(), "%+v: header size", g) // tokens, layer sums, row sizes
		sum := 0
		for l := 0; l < g.Layers(); l++ {
			assert.Equal(t, g.LayerOffset(l)+g.LayerSize(l), g.LayerOffset(l+1), "%+v: layer %d at %d of %d bytes, next", g, l, g.LayerOffset(l), g.LayerSize(l))
			assert.Positive(t, g.LayerSize(l), "%+v: layer %d size", g, l)
			sum += g.LayerSize(l)
		}
		assert.Equal(t, sum, g.PayloadSize(), "payload against the layers' sum")
		s := g.Size()
		assert.Zero(t, s%align, "size %d is not aligned", s)
		assert.GreaterOrEqual(t, s, g.HeaderSize()+sum, "size for header %d + payload %d", g.HeaderSize(), sum)
		assert.Less(t, s, g.HeaderSize()+sum+align, "size for header %d + payload %d", g.HeaderSize(), sum)
	}
}

func repeat(v, n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = v
	}
	return s
}

func TestGeometryValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		g    Geometry
		want string
	}{
		{"no tokens", Geometry{BlockTokens: 0, KRow: []int{1}, VRow: []int{1}}, "block of 0 tokens"},
		{"too many tokens", Geometry{BlockTokens: MaxBlockTokens + 1, KRow: []int{1}, VRow: []int{1}}, "tokens"},
		{"no layers", Geometry{BlockTokens: 1}, "0 layers"},
		{"too many layers", Geometry{BlockTokens: 1, KRow: repeat(1, MaxLayers+1), VRow: repeat(1, MaxLayers+1)}, "layers"},
		{"K/V layer counts", Geometry{BlockTokens: 1, KRow: []int{1, 1}, VRow: []int{1}}, "2 K layers but 1 V"},
		{"empty K row", Geometry{BlockTokens: 1, KRow: []int{1, 0}, VRow: []int{1, 1}}, "layer 1"},
		{"negative V row", Geometry{BlockTokens: 1, KRow: []int{1}, VRow: []int{-1}}, "layer 0"},
		{"K row too long", Geometry{BlockTokens: 1, KRow: []int{MaxRowBytes + 1}, VRow: []int{1}}, "layer 0"},
		{"V row too long", Geometry{BlockTokens: 1, KRow: []int{1}, VRow: []int{MaxRowBytes + 1}}, "layer 0"},
	} {
		err := tc.g.Validate()
		assert.Equal(t, status.InvalidArg, status.Of(err), "%s: %v", tc.name, err)
		assert.ErrorContains(t, err, tc.want, tc.name)
	}
	edge := Geometry{BlockTokens: MaxBlockTokens, KRow: []int{MaxRowBytes}, VRow: []int{1}}
	assert.NoError(t, edge.Validate(), "largest allowed geometry")
	kOnly := Geometry{BlockTokens: 4, KRow: []int{8, 8}, VRow: []int{0, 0}}
	require.NoError(t, kOnly.Validate(), "K-only geometry")
	assert.Equal(t, 4*8, kOnly.LayerSize(1), "a K-only layer is its K rows")
	// An indexer cache's layers without V after an attention cache's with V.
	mixed := Geometry{BlockTokens: 4, KRow: []int{8, 8, 4}, VRow: []int{8, 8, 0}}
	require.NoError(t, mixed.Validate(), "layers with V, then without")
	assert.Equal(t, 4*4, mixed.LayerSize(2))
}

func TestGeometryDigest(t *testing.T) {
	base := smallGeometry().Digest()
	for name, g := range map[string]*Geometry{
		"tokens": {BlockTokens: 5, KRow: []int{8, 16}, VRow: []int{8, 8}},
		"K row":  {BlockTokens: 4, KRow: []int{8, 17}, VRow: []int{8, 8}},
		"V row":  {BlockTokens: 4, KRow: []int{8, 16}, VRow: []int{9, 8}},
		"K<->V":  {BlockTokens: 4, KRow: []int{8, 8}, VRow: []int{8, 16}},
		"layers": {BlockTokens: 4, KRow: []int{8, 16, 8}, VRow: []int{8, 8, 8}},
	} {
		assert.NotEqual(t, base, g.Digest(), "geometry with another %s has the same digest", name)
	}
}

func sampleHeader(g *Geometry) *Header {
	h := &Header{
		Key:       key.Hash{1, 2, 3},
		Parent:    key.Hash{4, 5, 6},
		Model:     key.Hash{7, 8, 9},
		Depth:     0x01020304,
		Tokens:    make([]int32, g.BlockTokens),
		LayerSums: make([]uint64, g.Layers()),
	}
	for i := range h.Tokens {
		h.Tokens[i] = int32(i*1000 - 7)
	}
	for i := range h.LayerSums {
		h.LayerSums[i] = uint64(i+1) * 0x9e3779b97f4a7c15
	}
	return h
}

// encodedBlock returns a whole, 8-byte aligned block buffer holding h at
// generation gen.
func encodedBlock(t testing.TB, g *Geometry, h *Header, gen uint64) []byte {
	t.Helper()
	words := make([]uint64, g.Size()/8)
	b := unsafeBytes(words)
	require.NoError(t, EncodeHeader(b, g, h))
	EndWrite(b, gen)
	return b
}

func TestHeaderRoundTrip(t *testing.T) {
	for _, g := range fuzzGeometries() {
		h := sampleHeader(g)
		b := encodedBlock(t, g, h, 42)
		got, err := DecodeHeader(b, g)
		require.NoError(t, err)
		h.Generation = 42
		require.Equal(t, h, &got, "decoded against encoded")
		require.Equal(t, xxh3.Hash(b[sumFrom:g.HeaderSize()]), HeaderSum(b), "HeaderSum is not the sum of bytes [24, header size)")
		require.Equal(t, uint32(0x4b42434d), binary.LittleEndian.Uint32(b), "magic %q", b[:4])
		require.Equal(t, "MCBK", string(b[:4]), "magic")
		// The generation is outside the sum: a seqlock bump keeps the header valid.
		BeginWrite(b, 44)
		EndWrite(b, 44)
		got, err = DecodeHeader(b, g)
		require.NoError(t, err, "after a rewrite")
		require.Equal(t, uint64(44), got.Generation, "after a rewrite: %+v", got)
	}
}

func TestEncodeHeaderRefusesMisfits(t *testing.T) {
	g := smallGeometry()
	h := sampleHeader(g)
	err := EncodeHeader(make([]byte, g.HeaderSize()-1), g, h)
	assert.Equal(t, status.Internal, status.Of(err), "short buffer: %v", err)
	short := *h
	short.Tokens = short.Tokens[:3]
	err = EncodeHeader(make([]byte, g.HeaderSize()), g, &short)
	assert.Equal(t, status.Internal, status.Of(err), "3 tokens for a 4-token block: %v", err)
	sums := *h
	sums.LayerSums = append(sums.LayerSums, 0)
	err = EncodeHeader(make([]byte, g.HeaderSize()), g, &sums)
	assert.Equal(t, status.Internal, status.Of(err), "3 sums for 2 layers: %v", err)
}

func TestVerifyHeader(t *testing.T) {
	g := smallGeometry()
	h := sampleHeader(g)
	expect := func() *Expect {
		return &Expect{Key: h.Key, Parent: h.Parent, Model: h.Model, Tokens: append([]int32{}, h.Tokens...), Generation: 8}
	}
	_, err := VerifyHeader(encodedBlock(t, g, h, 8), g, expect())
	require.NoError(t, err, "a matching block fails")
	resum := func(b []byte) { binary.LittleEndian.PutUint64(b[sumOffset:], xxh3.Hash(b[sumFrom:g.HeaderSize()])) }
	for _, tc := range []struct {
		name  string
		block func(b []byte) // damage the stored block
		want  func(e *Expect)
		geo   *Geometry
		msg   string
	}{
		{name: "key", want: func(e *Expect) { e.Key[0] ^= 1 }, msg: "holds key"},
		{name: "parent", want: func(e *Expect) { e.Parent[15] ^= 1 }, msg: "another parent"},
		{name: "model", want: func(e *Expect) { e.Model[7] ^= 1 }, msg: "belongs to model"},
		{name: "token", want: func(e *Expect) { e.Tokens[3]++ }, msg: "key collision"},
		{name: "fewer tokens", want: func(e *Expect) { e.Tokens = e.Tokens[:3] }, msg: "holds 4 tokens"},
		{name: "more tokens", want: func(e *Expect) { e.Tokens = append(e.Tokens, 0) }, msg: "holds 4 tokens"},
		{name: "generation odd", block: func(b []byte) { BeginWrite(b, 8) }, msg: "being written"},
		{name: "generation differs", want: func(e *Expect) { e.Generation = 10 }, msg: "evicted or rewritten"},
		{name: "magic", block: func(b []byte) { b[0] ^= 1 }, msg: "magic"},
		{name: "version", block: func(b []byte) { b[4] = 1 }, msg: "version"},
		{name: "reserved", block: func(b []byte) { b[6] = 1 }, msg: "reserved"},
		{name: "reserved under the sum", block: func(b []byte) { b[100] = 1; resum(b) }, msg: "reserved"},
		{name: "padding", block: func(b []byte) { b[g.HeaderSize()-1] = 1; resum(b) }, msg: "reserved"},
		{name: "header sum", block: func(b []byte) { b[30] ^= 0x10 }, msg: "checksum"},
		{name: "token under the sum", block: func(b []byte) { b[fixedHeader] ^= 1 }, msg: "checksum"},
		{name: "stored sum", block: func(b []byte) { b[sumOffset] ^= 1 }, msg: "checksum"},
		{name: "truncated", block: nil, geo: nil, msg: "truncated"},
		{name: "geometry rows", geo: &Geometry{BlockTokens: 4, KRow: []int{8, 16}, VRow: []int{8, 16}}, msg: "geometry"},
		{name: "geometry layers", block: func(b []byte) { b[76]++; resum(b) }, msg: "geometry"},
		{name: "geometry payload", block: func(b []byte) { b[80]++; resum(b) }, msg: "geometry"},
	} {
		b := encodedBlock(t, g, h, 8)
		if tc.block != nil {
			tc.block(b)
		}
		if tc.name == "truncated" {
			b = b[:g.HeaderSize()-1]
		}
		e := expect()
		if tc.want != nil {
			tc.want(e)
		}
		geo := g
		if tc.geo != nil {
			geo = tc.geo
		}
		_, err := VerifyHeader(b, geo, e)
		assert.Equal(t, status.Corrupt, status.Of(err), "%s: %v", tc.name, err)
		assert.ErrorContains(t, err, tc.msg, tc.name)
	}
}

func TestSeqlockGeneration(t *testing.T) {
	b := unsafeBytes(make([]uint64, 8))
	require.Zero(t, Generation(b), "fresh block's generation")
	BeginWrite(b, 6)
	require.Equal(t, uint64(7), Generation(b), "BeginWrite(6) must leave an odd generation")
	EndWrite(b, 6)
	require.Equal(t, uint64(6), Generation(b), "EndWrite(6)")
	EndWrite(b, 9)
	require.Equal(t, uint64(8), Generation(b), "EndWrite of an odd generation must publish an even one")
	require.Panics(t, func() { Generation(b[1:]) }, "a misaligned generation word did not panic")
}

// Sum as the format defines it, written out: XXH3-64 over the chunks'
// XXH3-64s, little-endian.
func TestSum(t *testing.T) {
	p := make([]byte, 2*SumChunk+SumChunk/2)
	for i := range p {
		p[i] = byte(i*7 ^ i>>9)
	}
	var digests []byte
	for _, c := range [][]byte{p[:SumChunk], p[SumChunk : 2*SumChunk], p[2*SumChunk:]} {
		digests = binary.LittleEndian.AppendUint64(digests, xxh3.Hash(c))
	}
	require.Equal(t, xxh3.Hash(digests), Sum(p))
	short := []byte("layer payload")
	require.Equal(t, xxh3.Hash(binary.LittleEndian.AppendUint64(nil, xxh3.Hash(short))), Sum(short))
	for _, at := range []int{3, SumChunk, 2*SumChunk + 9} {
		q := append([]byte{}, p...)
		q[at] ^= 1
		require.NotEqual(t, Sum(p), Sum(q), "a flipped bit at %d keeps the sum", at)
	}
	swapped := append(append([]byte{}, p[SumChunk:2*SumChunk]...), p[:SumChunk]...)
	require.NotEqual(t, Sum(p[:2*SumChunk]), Sum(swapped), "two chunks swapped keep the sum")
}

func TestParseGeometry(t *testing.T) {
	for _, g := range fuzzGeometries() {
		b := encodedBlock(t, g, sampleHeader(g), 2)
		got, err := ParseGeometry(b[:g.HeaderSize()])
		require.NoError(t, err, "ParseGeometry")
		require.Equal(t, g, &got, "ParseGeometry")
	}
	g := smallGeometry()
	rows := fixedHeader + 4*g.BlockTokens + 8*g.Layers() // the row-size table
	resum := func(b []byte) { binary.LittleEndian.PutUint64(b[sumOffset:], xxh3.Hash(b[sumFrom:g.HeaderSize()])) }
	for _, tc := range []struct {
		name  string
		block func(b []byte) []byte
		msg   string
	}{
		{"shorter than the fixed header", func(b []byte) []byte { return b[:fixedHeader-1] }, "truncated"},
		{"no row sizes", func(b []byte) []byte { return b[:rows+8] }, "truncated"},
		{"zero tokens", func(b []byte) []byte { binary.LittleEndian.PutUint32(b[72:], 0); return b }, "0 tokens"},
		{"too many layers", func(b []byte) []byte { binary.LittleEndian.PutUint32(b[76:], MaxLayers+1); return b }, "layers"},
		{"empty row", func(b []byte) []byte { binary.LittleEndian.PutUint32(b[rows:], 0); resum(b); return b }, "header geometry"},
		{"row size under the sum", func(b []byte) []byte { b[rows]++; return b }, "checksum"},
		{"row size resummed", func(b []byte) []byte { b[rows]++; resum(b); return b }, "geometry"},
	} {
		b := encodedBlock(t, g, sampleHeader(g), 2)[:g.HeaderSize()]
		_, err := ParseGeometry(tc.block(b))
		assert.Equal(t, status.Corrupt, status.Of(err), "%s: %v", tc.name, err)
		assert.ErrorContains(t, err, tc.msg, tc.name)
	}
}

func TestVerifyBlock(t *testing.T) {
	g := smallGeometry()
	h := sampleHeader(g)
	b := encodedBlock(t, g, h, 8)
	for l := range g.KRow {
		off := g.LayerOffset(l)
		pattern := b[off : off+g.LayerSize(l)]
		for i := range pattern {
			pattern[i] = byte(i*7 + l)
		}
		h.LayerSums[l] = Sum(pattern)
	}
	require.NoError(t, EncodeHeader(b, g, h))
	want := &Expect{Key: h.Key, Parent: h.Parent, Model: h.Model, Generation: 8}
	got, hdr, err := VerifyBlock(b, want)
	require.NoError(t, err)
	require.Equal(t, *g, got)
	require.Equal(t, h.Depth, hdr.Depth)

	_, _, err = VerifyBlock(b[:len(b)-64], want)
	assert.ErrorContains(t, err, "its header says", "short block")
	b[g.LayerOffset(1)+3] ^= 1
	_, _, err = VerifyBlock(b, want)
	assert.Equal(t, status.Corrupt, status.Of(err))
	assert.ErrorContains(t, err, "layer 1: checksum mismatch")
	other := *want
	other.Key[0] ^= 1
	_, _, err = VerifyBlock(b, &other)
	assert.ErrorContains(t, err, "holds key")
}
