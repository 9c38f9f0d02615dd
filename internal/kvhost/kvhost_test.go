package kvhost

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

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
			require.NoError(t, err)
			defer h.Close()
			tokens := make([]int32, 64)
			for i := range tokens {
				tokens[i] = int32(i * 7919 % 1000)
			}
			require.Error(t, h.Check(tokens, 1), "Check passed on rows never computed")
			h.Compute(tokens, 0, 40)
			require.NoError(t, h.Check(tokens, 40))
			err = h.Check(tokens, 41)
			require.Equal(t, status.Corrupt, status.Of(err), "Check past the computed rows: %v", err)
			// Another token at the same position gives other rows.
			other := append([]int32(nil), tokens...)
			other[7]++
			require.Error(t, h.Check(other, 40), "rows of another token passed")
			require.Zero(t, h.WrongPositions(tokens, 40))
			require.Equal(t, 1, h.WrongPositions(other, 40), "one position's token differs")
			require.Equal(t, 1, h.WrongPositions(tokens, 41), "one position never computed")
			other2, err := New(tc.layers, 64, tc.krow, tc.vrow)
			require.NoError(t, err)
			defer other2.Close()
			other2.CopyFrom(h, 40)
			require.NoError(t, other2.Check(tokens, 40), "after CopyFrom")
			buf := make([]byte, 40*tc.layers*(tc.krow+tc.vrow))
			require.Equal(t, len(buf), h.CopyTo(buf, 40), "bytes CopyTo copied")
			h.Clear(40)
			require.Error(t, h.Check(tokens, 1), "Check passed after Clear")
			lo := h.Layout()
			spec := h.Spec("t", 16)
			require.Len(t, lo.Layers, tc.layers, "layout layers")
			require.Len(t, spec.KRow, tc.layers, "spec K rows")
			require.Equal(t, tc.layers, int(spec.Params.NLayer), "spec layers")
		})
	}
}

func TestNewRejects(t *testing.T) {
	for _, tc := range [][4]int{{0, 8, 2, 2}, {1, 0, 2, 2}, {1, 8, 3, 2}, {1, 8, 2, 0}} {
		h, err := New(tc[0], tc[1], tc[2], tc[3])
		if err == nil {
			h.Close()
		}
		assert.Error(t, err, "New%v accepted", tc)
	}
}
