package pool

import (
	"encoding/binary"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"github.com/zeebo/xxh3"
	"golang.org/x/sys/unix"

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
		if perr != nil {
			require.Equal(t, status.Corrupt, status.Of(perr), "ParseGeometry refused with %v", perr)
		}
		if perr == nil {
			require.NoError(t, pg.Validate(), "ParseGeometry returned an invalid geometry")
			_, err := DecodeHeader(src, &pg)
			require.NoError(t, err, "ParseGeometry accepted a header that does not decode under its geometry")
		}
		h, err := DecodeHeader(src, g)
		if err != nil {
			require.Equal(t, status.Corrupt, status.Of(err), "refused with %v", err)
			return
		}
		require.NoError(t, perr, "header decodes under %+v but does not describe a geometry", g)
		require.Equal(t, g, &pg, "header decodes under one geometry but describes another")
		require.Len(t, h.Tokens, g.BlockTokens, "accepted tokens for %+v", g)
		require.Len(t, h.LayerSums, g.Layers(), "accepted sums for %+v", g)
		again := make([]byte, n)
		binary.LittleEndian.PutUint64(again[genOffset:], h.Generation)
		require.NoError(t, EncodeHeader(again, g, &h), "re-encoding an accepted header")
		require.Equal(t, src[:n], again, "accepted header re-encodes differently")
	})
}

// FuzzParseAddress: ParseAddress never panics, refuses with InvalidArg,
// and what it accepts is exactly what String writes back.
func FuzzParseAddress(f *testing.F) {
	f.Add("0123456789abcdef:/run/user/1000/mcbridge/pool.sock")
	f.Add("0123456789ABCDEF:/x")
	f.Add(":/x")
	f.Add("0123456789abcdef:/a\x00b")
	f.Fuzz(func(t *testing.T, s string) {
		a, err := ParseAddress(s)
		if err != nil {
			require.Equal(t, status.InvalidArg, status.Of(err))
			return
		}
		require.Equal(t, s, a.String())
	})
}

// FuzzParseInotify: parseInotify never panics or reads past what it was
// given, and events it builds are read back whole.
func FuzzParseInotify(f *testing.F) {
	f.Add(inotifyRecord(unix.IN_CREATE, "pool-1.sock", 16))
	f.Add(append(inotifyRecord(unix.IN_ATTRIB, "a.sock", 8), inotifyRecord(unix.IN_DELETE, "", 0)...))
	f.Add([]byte{1, 2, 3})
	f.Fuzz(func(t *testing.T, b []byte) {
		evs := parseInotify(b)
		var again []byte
		for _, ev := range evs {
			require.NotContains(t, ev.name, "\x00")
			again = append(again, inotifyRecord(ev.mask, ev.name, len(ev.name))...)
		}
		require.Equal(t, evs, parseInotify(again), "events re-encode to themselves")
	})
}

// inotifyRecord is one event as the kernel writes it, the name padded
// with NULs to pad bytes (at least its length).
func inotifyRecord(mask uint32, name string, pad int) []byte {
	b := make([]byte, unix.SizeofInotifyEvent+max(pad, len(name)))
	binary.NativeEndian.PutUint32(b[4:], mask)
	binary.NativeEndian.PutUint32(b[12:], uint32(len(b)-unix.SizeofInotifyEvent))
	copy(b[unix.SizeofInotifyEvent:], name)
	return b
}
