package kvhost

import (
	"testing"

	"github.com/mcbridge/mcbridge/internal/status"
)

func TestComputeCheck(t *testing.T) {
	for _, tc := range []struct {
		name               string
		layers, krow, vrow int
	}{
		{"tiny", 1, 2, 2},
		{"odd rows", 3, 6, 10},
		{"wide", 2, 512, 256},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, err := New(tc.layers, 64, tc.krow, tc.vrow)
			if err != nil {
				t.Fatal(err)
			}
			defer h.Close()
			tokens := make([]int32, 64)
			for i := range tokens {
				tokens[i] = int32(i * 7919 % 1000)
			}
			if err := h.Check(tokens, 1); err == nil {
				t.Fatal("Check passed on rows never computed")
			}
			h.Compute(tokens, 0, 40)
			if err := h.Check(tokens, 40); err != nil {
				t.Fatal(err)
			}
			if err := h.Check(tokens, 41); status.Of(err) != status.Corrupt {
				t.Fatalf("Check past the computed rows: %v", err)
			}
			// Another token at the same position gives other rows.
			other := append([]int32(nil), tokens...)
			other[7]++
			if err := h.Check(other, 40); err == nil {
				t.Fatal("rows of another token passed")
			}
			other2, err := New(tc.layers, 64, tc.krow, tc.vrow)
			if err != nil {
				t.Fatal(err)
			}
			defer other2.Close()
			other2.CopyFrom(h, 40)
			if err := other2.Check(tokens, 40); err != nil {
				t.Fatalf("after CopyFrom: %v", err)
			}
			buf := make([]byte, 40*tc.layers*(tc.krow+tc.vrow))
			if n := h.CopyTo(buf, 40); n != len(buf) {
				t.Fatalf("CopyTo copied %d of %d bytes", n, len(buf))
			}
			h.Clear(40)
			if err := h.Check(tokens, 1); err == nil {
				t.Fatal("Check passed after Clear")
			}
			lo := h.Layout()
			spec := h.Spec("t", 16)
			if len(lo.Layers) != tc.layers || len(spec.KRow) != tc.layers || int(spec.Params.NLayer) != tc.layers {
				t.Fatalf("layout %d layers, spec %d", len(lo.Layers), len(spec.KRow))
			}
		})
	}
}

func TestNewRejects(t *testing.T) {
	for _, tc := range [][4]int{{0, 8, 2, 2}, {1, 0, 2, 2}, {1, 8, 3, 2}, {1, 8, 2, 0}} {
		if h, err := New(tc[0], tc[1], tc[2], tc[3]); err == nil {
			h.Close()
			t.Errorf("New%v accepted", tc)
		}
	}
}
