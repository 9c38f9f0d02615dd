package llamastate

import (
	"bytes"
	"os"
	"path/filepath"
	"runtime"
	"testing"
)

// FuzzParse: Parse never panics, allocates in proportion to its input,
// and whatever it accepts builds back to the same bytes. Whatever Slice
// accepts is a state of exactly positions 0..n-1 that slices to itself.
func FuzzParse(f *testing.F) {
	files, err := filepath.Glob(filepath.Join("testdata", "*.bin"))
	if err != nil || len(files) == 0 {
		f.Fatalf("no seeds in testdata: %v", err)
	}
	// The real states cut to two positions: every framing and layout, in
	// a few hundred bytes, so that minimizing an interesting input is quick.
	for _, name := range files {
		b, err := os.ReadFile(name)
		if err != nil {
			f.Fatal(err)
		}
		st, err := Parse(b)
		if err != nil {
			f.Fatal(err)
		}
		small, err := st.Slice(2)
		if err != nil {
			f.Fatal(err)
		}
		seed, err := small.Build()
		if err != nil {
			f.Fatal(err)
		}
		f.Add(seed)
	}
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		st, err := Parse(b)
		runtime.ReadMemStats(&after)
		// The worst case is a stream list: 4 input bytes per 56-byte Stream.
		if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 16*uint64(len(b))+64<<10 {
			t.Fatalf("Parse of %d bytes allocated %d", len(b), alloc)
		}
		if err != nil {
			return
		}
		out, err := st.Build()
		if err != nil || !bytes.Equal(out, b) || st.Size() != len(b) {
			t.Fatalf("accepted %d bytes but built %d (size %d): %v", len(b), len(out), st.Size(), err)
		}
		si, err := st.Sequence()
		if err != nil {
			return
		}
		cells := len(st.Streams[si].Cells)
		for _, n := range []int{1, cells / 2, cells} {
			sl, err := st.Slice(n)
			if err != nil {
				continue
			}
			s := sl.Streams[si]
			if len(s.Cells) != n || len(sl.Streams) != len(st.Streams) {
				t.Fatalf("Slice(%d): %d cells in %d streams", n, len(s.Cells), len(sl.Streams))
			}
			for p, c := range s.Cells {
				if c.Pos != int32(p) || len(c.SeqIDs) != 1 {
					t.Fatalf("Slice(%d): cell %d: %+v", n, p, c)
				}
			}
			again, err := sl.Slice(n)
			if err != nil {
				t.Fatalf("Slice(%d) of a slice: %v", n, err)
			}
			b1, _ := sl.Build()
			b2, _ := again.Build()
			if !bytes.Equal(b1, b2) {
				t.Fatalf("Slice(%d) is not idempotent", n)
			}
		}
	})
}
