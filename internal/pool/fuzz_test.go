package pool

import (
	"bytes"
	"encoding/binary"
	"reflect"
	"testing"
	"unsafe"

	"github.com/zeebo/xxh3"

	"github.com/mcbridge/mcbridge/internal/status"
)

// unsafeBytes views words as bytes, giving an 8-byte aligned buffer for the
// atomic generation word.
func unsafeBytes(words []uint64) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(words))), 8*len(words))
}

// FuzzDecodeHeader feeds arbitrary bytes to DecodeHeader under a few
// geometries. It must never panic, must refuse with status.Corrupt, and any
// header it accepts must be exactly what EncodeHeader writes for the decoded
// fields. With resum set, the target rewrites the header sum first, so the
// fuzzer gets past the checksum and exercises the checks behind it.
func FuzzDecodeHeader(f *testing.F) {
	geos := fuzzGeometries()
	for gi, g := range geos {
		b := encodedBlock(f, g, sampleHeader(g), 12)
		n := g.HeaderSize()
		f.Add(b[:n], uint8(gi), false)
		f.Add(b[:n], uint8(gi), true)
		f.Add(b[:n-1], uint8(gi), true)
		f.Add(b[:n], uint8(gi+1), true) // another geometry
		odd := append([]byte{}, b[:n]...)
		odd[6] = 0xff
		f.Add(odd, uint8(gi), true)
	}
	f.Add([]byte{}, uint8(0), false)
	f.Add([]byte("MCBK"), uint8(1), true)
	f.Fuzz(func(t *testing.T, data []byte, gi uint8, resum bool) {
		g := geos[int(gi)%len(geos)]
		n := g.HeaderSize()
		src := unsafeBytes(make([]uint64, (len(data)+7)/8))[:len(data)]
		copy(src, data)
		if resum && len(src) >= n {
			binary.LittleEndian.PutUint64(src[sumOffset:], xxh3.Hash(src[sumFrom:n]))
		}
		// A self-described geometry must be one the header decodes under.
		pg, perr := ParseGeometry(src)
		if perr != nil && status.Of(perr) != status.Corrupt {
			t.Fatalf("ParseGeometry refused with %v, want status.Corrupt", perr)
		}
		if perr == nil {
			if err := pg.Validate(); err != nil {
				t.Fatalf("ParseGeometry returned an invalid geometry: %v", err)
			}
			if _, err := DecodeHeader(src, &pg); err != nil {
				t.Fatalf("ParseGeometry accepted a header that does not decode under its geometry: %v", err)
			}
		}
		h, err := DecodeHeader(src, g)
		if err != nil {
			if status.Of(err) != status.Corrupt {
				t.Fatalf("refused with %v, want status.Corrupt", err)
			}
			return
		}
		if perr != nil || !reflect.DeepEqual(&pg, g) {
			t.Fatalf("header decodes under %+v but describes %+v (%v)", g, pg, perr)
		}
		if len(h.Tokens) != g.BlockTokens || len(h.LayerSums) != g.Layers() {
			t.Fatalf("accepted %d tokens and %d sums for %+v", len(h.Tokens), len(h.LayerSums), g)
		}
		again := make([]byte, n)
		binary.LittleEndian.PutUint64(again[genOffset:], h.Generation)
		if err := EncodeHeader(again, g, &h); err != nil {
			t.Fatalf("re-encoding an accepted header: %v", err)
		}
		if !bytes.Equal(again, src[:n]) {
			t.Fatalf("accepted header re-encodes differently:\n got %x\nwant %x", again, src[:n])
		}
	})
}
