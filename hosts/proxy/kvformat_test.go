package proxy

import (
	"bytes"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/llamastate"
	"github.com/mcbridge/mcbridge/internal/mem"
)

func readState(t testing.TB, name string) *llamastate.State {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "llamastate", "testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	st, err := llamastate.Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func TestRowElements(t *testing.T) {
	tests := []struct {
		typ   int32
		bytes uint64
		want  uint32
	}{
		{1, 64, 32}, {0, 128, 32}, {30, 64, 32}, {8, 68, 64}, {2, 36, 64},
		{1, 63, 0}, {8, 64, 0}, {99, 64, 0}, {1, 0, 0},
	}
	for _, tc := range tests {
		if got := rowElements(tc.typ, tc.bytes); got != tc.want {
			t.Errorf("rowElements(%d, %d) = %d, want %d", tc.typ, tc.bytes, got, tc.want)
		}
	}
}

func TestSpecFromRealSlotFiles(t *testing.T) {
	for _, tc := range []struct {
		file   string
		vtrans bool
		velem  int
	}{
		{"slot-fa-on.bin", false, 2},
		{"slot-plain-fa-off.bin", true, 2},
	} {
		t.Run(tc.file, func(t *testing.T) {
			f, _, err := formatOf(readState(t, tc.file))
			if err != nil {
				t.Fatal(err)
			}
			spec, err := f.spec(key.Hash{1}, key.Hash{2}, "x")
			if err != nil {
				t.Fatal(err)
			}
			p := spec.Params
			if p.NLayer != 2 || p.VTrans != tc.vtrans || p.TypeK != 1 || p.NEmbdKGQA[1] != 32 || p.NEmbdVGQA[1] != 32 ||
				spec.KRow[0] != 64 || spec.VRow[0] != 64 || spec.VElem[0] != tc.velem || p.LlamaVersion != llamaVersion {
				t.Fatalf("spec %+v", spec)
			}
			// What the fingerprint must tell apart.
			fp := p.Fingerprint()
			for name, other := range map[string]func(*kvFormat) (key.Hash, key.Hash, string){
				"model": func(*kvFormat) (key.Hash, key.Hash, string) { return key.Hash{9}, key.Hash{2}, "x" },
				"probe": func(*kvFormat) (key.Hash, key.Hash, string) { return key.Hash{1}, key.Hash{9}, "x" },
				"build": func(*kvFormat) (key.Hash, key.Hash, string) { return key.Hash{1}, key.Hash{2}, "y" },
				"v_trans": func(g *kvFormat) (key.Hash, key.Hash, string) {
					g.VTrans = !g.VTrans
					for i := range g.Layers {
						g.Layers[i].VElSize, g.Layers[i].NEmbdV = 2, 32
					}
					return key.Hash{1}, key.Hash{2}, "x"
				},
			} {
				g := kvFormat{NStream: f.NStream, VTrans: f.VTrans, Layers: append([]layerFormat(nil), f.Layers...)}
				c, pr, ex := other(&g)
				s2, err := g.spec(c, pr, ex)
				if err != nil {
					t.Fatal(err)
				}
				if s2.Params.Fingerprint() == fp {
					t.Errorf("another %s gives the same fingerprint", name)
				}
			}
		})
	}
}

func TestSpecRefusesMixedTypes(t *testing.T) {
	f, _, _ := formatOf(readState(t, "slot-fa-on.bin"))
	f.Layers[1].KType = 0
	f.Layers[1].KRow = 128
	if _, err := f.spec(key.Hash{}, key.Hash{}, ""); err == nil {
		t.Fatal("accepted layers of different K types")
	}
}

// A restore file filled with a real state's rows is byte for byte what
// llamastate's Slice writes for the same prefix.
func TestRestoreFileMatchesSlice(t *testing.T) {
	for _, file := range []string{"slot-fa-on.bin", "slot-plain-fa-off.bin"} {
		t.Run(file, func(t *testing.T) {
			src := readState(t, file)
			toks, err := src.PromptTokens()
			if err != nil {
				t.Fatal(err)
			}
			const n = 16
			want, err := src.Slice(n)
			if err != nil {
				t.Fatal(err)
			}
			// The proxy frames tokens as llama-server does; the second file
			// has the plain token list older servers wrote.
			want.Words = serverWords(toks[:n])
			wantBytes, _ := want.Build()
			f, si, _ := formatOf(src)
			seq := src.Streams[si].Cells[0].SeqIDs[0]
			rf, err := f.newRestoreFile(int(seq), toks[:n])
			if err != nil {
				t.Fatal(err)
			}
			// Copy position p's rows from the sliced state (cells in position
			// order) through the layout, as a load does.
			ws := &want.Streams[si]
			for l, ly := range rf.layout.Layers {
				wl := ws.Layers[l]
				kr, vr := int(wl.KRowSize), int(wl.VRowSize)
				for p := 0; p < n; p++ {
					copy(mem.Bytes(ly.K+uintptr(uint64(p)*ly.KStride), kr), wl.K[p*kr:])
					if !f.VTrans {
						copy(mem.Bytes(ly.V+uintptr(uint64(p)*ly.VStride), vr), wl.V[p*vr:])
						continue
					}
					el := int(wl.VElSize)
					for j := 0; j < int(wl.NEmbdV); j++ {
						copy(mem.Bytes(ly.V+uintptr(uint64(j)*ly.VStride+uint64(p*el)), el), wl.V[(j*n+p)*el:(j*n+p+1)*el])
					}
				}
			}
			runtime.KeepAlive(rf.bytes)
			if !bytes.Equal(rf.bytes, wantBytes) {
				t.Fatalf("restore file of %d bytes differs from the slice (%d bytes)", len(rf.bytes), len(wantBytes))
			}
		})
	}
}

func TestRestoreFileStreams(t *testing.T) {
	f, _, _ := formatOf(readState(t, "slot-fa-on.bin"))
	f.NStream = 3
	rf, err := f.newRestoreFile(2, []int32{5, 6})
	if err != nil {
		t.Fatal(err)
	}
	if si, err := rf.state.Sequence(); err != nil || si != 2 || len(rf.state.Streams) != 3 {
		t.Fatalf("sequence in stream %d of %d: %v", si, len(rf.state.Streams), err)
	}
	if _, err := f.newRestoreFile(3, []int32{5}); err == nil {
		t.Fatal("restore file for a slot without a stream")
	}
	if _, err := f.newRestoreFile(0, nil); err == nil {
		t.Fatal("restore file of no tokens")
	}
}

// The probe digest reads positions, not cells: the same KV in scattered
// cells hashes the same, other KV does not.
func TestProbeDigestIsPositional(t *testing.T) {
	plain, scattered := readState(t, "seq-fa-off.bin"), readState(t, "seq-scattered-fa-off.bin")
	a, err := probeDigest(plain, 8)
	if err != nil {
		t.Fatal(err)
	}
	b, err := probeDigest(scattered, 8)
	if err != nil {
		t.Fatal(err)
	}
	if a != b {
		t.Fatal("the same positions in other cells digest differently")
	}
	c, _ := probeDigest(readState(t, "seq-fa-on.bin"), 8)
	d, _ := probeDigest(plain, 7)
	if c == a || d == a {
		t.Fatal("other KV digests the same")
	}
}
