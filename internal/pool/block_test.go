package pool

import (
	"encoding/binary"
	"reflect"
	"strings"
	"testing"

	"github.com/zeebo/xxh3"

	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

func smallGeometry() *Geometry {
	return &Geometry{BlockTokens: 4, KRow: []int{8, 16}, VRow: []int{8, 8}}
}

// fuzzGeometries are the shapes the header tests and the fuzz target run
// over: a tiny one, one whose header needs padding, and a llama-like one.
func fuzzGeometries() []*Geometry {
	return []*Geometry{
		smallGeometry(),
		{BlockTokens: 3, KRow: []int{5}, VRow: []int{7}},
		{BlockTokens: 16, KRow: []int{256, 256, 256}, VRow: []int{256, 256, 128}},
	}
}

func TestGeometrySizes(t *testing.T) {
	g := smallGeometry()
	// 128 fixed + 4*4 tokens + 8*2 sums + 8*2 row sizes = 176, aligned to 192.
	if g.HeaderSize() != 192 || g.LayerSize(0) != 64 || g.LayerSize(1) != 96 ||
		g.LayerOffset(0) != 192 || g.LayerOffset(1) != 256 || g.PayloadSize() != 160 || g.Size() != 384 {
		t.Fatalf("header %d, layers %d/%d at %d/%d, payload %d, size %d",
			g.HeaderSize(), g.LayerSize(0), g.LayerSize(1), g.LayerOffset(0), g.LayerOffset(1), g.PayloadSize(), g.Size())
	}
	for _, g := range append(fuzzGeometries(), &Geometry{BlockTokens: 256, KRow: repeat(32, 1024), VRow: repeat(32, 1024)}) {
		if err := g.Validate(); err != nil {
			t.Fatal(err)
		}
		if h := g.HeaderSize(); h%align != 0 || h < fixedHeader+4*g.BlockTokens+16*g.Layers() { // tokens, layer sums, row sizes
			t.Errorf("%+v: header size %d", g, h)
		}
		sum := 0
		for l := 0; l < g.Layers(); l++ {
			if g.LayerOffset(l+1) != g.LayerOffset(l)+g.LayerSize(l) || g.LayerSize(l) <= 0 {
				t.Errorf("%+v: layer %d at %d of %d bytes, next at %d", g, l, g.LayerOffset(l), g.LayerSize(l), g.LayerOffset(l+1))
			}
			sum += g.LayerSize(l)
		}
		if g.PayloadSize() != sum {
			t.Errorf("payload %d, layers sum to %d", g.PayloadSize(), sum)
		}
		if s := g.Size(); s%align != 0 || s < g.HeaderSize()+sum || s >= g.HeaderSize()+sum+align {
			t.Errorf("size %d for header %d + payload %d", s, g.HeaderSize(), sum)
		}
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
		if status.Of(err) != status.InvalidArg || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want InvalidArg mentioning %q", tc.name, err, tc.want)
		}
	}
	edge := Geometry{BlockTokens: MaxBlockTokens, KRow: []int{MaxRowBytes}, VRow: []int{1}}
	if err := edge.Validate(); err != nil {
		t.Errorf("largest allowed geometry: %v", err)
	}
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
		if g.Digest() == base {
			t.Errorf("geometry with another %s has the same digest", name)
		}
	}
}

func sampleHeader(g *Geometry) *Header {
	h := &Header{
		Key:       key.Hash{1, 2, 3},
		Parent:    key.Hash{4, 5, 6},
		Model:     key.Hash{7, 8, 9},
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
	if err := EncodeHeader(b, g, h); err != nil {
		t.Fatal(err)
	}
	EndWrite(b, gen)
	return b
}

func TestHeaderRoundTrip(t *testing.T) {
	for _, g := range fuzzGeometries() {
		h := sampleHeader(g)
		b := encodedBlock(t, g, h, 42)
		got, err := DecodeHeader(b, g)
		if err != nil {
			t.Fatal(err)
		}
		h.Generation = 42
		if !reflect.DeepEqual(&got, h) {
			t.Fatalf("decoded %+v, encoded %+v", got, *h)
		}
		if HeaderSum(b) != xxh3.Hash(b[sumFrom:g.HeaderSize()]) {
			t.Fatalf("HeaderSum is not the sum of bytes [24, header size)")
		}
		if binary.LittleEndian.Uint32(b) != 0x4b42434d || string(b[:4]) != "MCBK" {
			t.Fatalf("magic %q", b[:4])
		}
		// The generation is outside the sum: a seqlock bump keeps the header valid.
		BeginWrite(b, 44)
		EndWrite(b, 44)
		if got, err := DecodeHeader(b, g); err != nil || got.Generation != 44 {
			t.Fatalf("after a rewrite: %+v, %v", got, err)
		}
	}
}

func TestEncodeHeaderRefusesMisfits(t *testing.T) {
	g := smallGeometry()
	h := sampleHeader(g)
	if err := EncodeHeader(make([]byte, g.HeaderSize()-1), g, h); status.Of(err) != status.Internal {
		t.Errorf("short buffer: %v", err)
	}
	short := *h
	short.Tokens = short.Tokens[:3]
	if err := EncodeHeader(make([]byte, g.HeaderSize()), g, &short); status.Of(err) != status.Internal {
		t.Errorf("3 tokens for a 4-token block: %v", err)
	}
	sums := *h
	sums.LayerSums = append(sums.LayerSums, 0)
	if err := EncodeHeader(make([]byte, g.HeaderSize()), g, &sums); status.Of(err) != status.Internal {
		t.Errorf("3 sums for 2 layers: %v", err)
	}
}

func TestVerifyHeader(t *testing.T) {
	g := smallGeometry()
	h := sampleHeader(g)
	expect := func() *Expect {
		return &Expect{Key: h.Key, Parent: h.Parent, Model: h.Model, Tokens: append([]int32{}, h.Tokens...), Generation: 8}
	}
	if _, err := VerifyHeader(encodedBlock(t, g, h, 8), g, expect()); err != nil {
		t.Fatalf("a matching block fails: %v", err)
	}
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
		{name: "version", block: func(b []byte) { b[4] = 2 }, msg: "version"},
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
		if status.Of(err) != status.Corrupt || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("%s: %v, want Corrupt mentioning %q", tc.name, err, tc.msg)
		}
	}
}

func TestSeqlockGeneration(t *testing.T) {
	b := unsafeBytes(make([]uint64, 8))
	if Generation(b) != 0 {
		t.Fatalf("fresh block at generation %d", Generation(b))
	}
	BeginWrite(b, 6)
	if Generation(b) != 7 {
		t.Fatalf("BeginWrite(6) left %d, want odd 7", Generation(b))
	}
	EndWrite(b, 6)
	if Generation(b) != 6 {
		t.Fatalf("EndWrite(6) left %d", Generation(b))
	}
	EndWrite(b, 9)
	if Generation(b) != 8 {
		t.Fatalf("EndWrite of an odd generation published %d, want even 8", Generation(b))
	}
	defer func() {
		if recover() == nil {
			t.Fatalf("a misaligned generation word did not panic")
		}
	}()
	Generation(b[1:])
}

func TestSum(t *testing.T) {
	p := []byte("layer payload")
	if Sum(p) != xxh3.Hash(p) {
		t.Fatalf("Sum is not XXH3-64")
	}
	q := append([]byte{}, p...)
	q[3] ^= 1
	if Sum(p) == Sum(q) {
		t.Fatalf("one flipped bit keeps the sum")
	}
}

func TestParseGeometry(t *testing.T) {
	for _, g := range fuzzGeometries() {
		b := encodedBlock(t, g, sampleHeader(g), 2)
		got, err := ParseGeometry(b[:g.HeaderSize()])
		if err != nil || !reflect.DeepEqual(&got, g) {
			t.Fatalf("ParseGeometry = %+v, %v; want %+v", got, err, g)
		}
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
		if status.Of(err) != status.Corrupt || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("%s: %v, want Corrupt mentioning %q", tc.name, err, tc.msg)
		}
	}
}
