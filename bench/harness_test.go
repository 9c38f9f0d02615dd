package bench

import (
	"testing"
	"time"
)

// The benchmarks' rigs, run once each at small sizes: every restore must
// place exactly the saved rows, every save must publish every block, for
// the timings to mean anything.

func TestRestoreRig(t *testing.T) {
	for _, g := range []geometry{geo64K, {"odd", 3, 6}} {
		for _, l := range []link{linkLocal, linkUnshaped, shaped(10)} {
			t.Run(g.name+"/"+l.name, func(t *testing.T) {
				r := newRestoreRig(t, g, 3, l)
				if err := r.check(); err == nil {
					t.Fatal("the reader's tensors hold the rows before any restore")
				}
				for range 2 {
					if err := r.restore(); err != nil {
						t.Fatal(err)
					}
					if err := r.check(); err != nil {
						t.Fatal(err)
					}
					r.dst.Clear(len(r.tokens))
				}
				r.memcpy()
				if err := r.check(); err != nil {
					t.Fatalf("memcpy baseline: %v", err)
				}
			})
		}
	}
}

func TestPipelinedRestore(t *testing.T) {
	r := newRestoreRig(t, geometry{"stall", 4, 64}, 2, shaped(1))
	s, err := r.pipelined(50 * time.Microsecond)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.check(); err != nil {
		t.Fatal(err)
	}
	if s.first <= 0 || s.total < s.first || s.total < s.maxLater || s.compute < 4*50*time.Microsecond {
		t.Fatalf("stalls %+v", s)
	}
}

func TestSaveRig(t *testing.T) {
	r := newSaveRig(t, geo64K, 4*blockTokens)
	// The pool holds two saves: the third evicts the first.
	for range 3 {
		if err := r.save(); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.missAndSave(); err != nil {
		t.Fatal(err)
	}
	// The last save is found again under its scope, up to the block that
	// holds the prompt's last token, which a lookup never matches.
	res, err := r.model.Lookup(r.scopeOf(r.salt), r.tokens)
	if err != nil || res.MatchedBlocks != r.blocks-1 {
		t.Fatalf("lookup after save: %+v, %v", res, err)
	}
	r.memcpy()
}

func TestLookupRig(t *testing.T) {
	r := newLookupRig(t, 4*blockTokens, 100)
	for _, n := range []int{blockTokens, 4 * blockTokens} {
		if err := r.lookup(n); err != nil {
			t.Fatal(err)
		}
	}
}
