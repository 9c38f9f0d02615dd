package kvlayout

import (
	"math/rand"
	"runtime/debug"
	"sort"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/status"
)

// FuzzLayout builds a one-layer layout from arbitrary numbers over tensors
// mapped to exactly the extent the layout describes, each ending against an
// inaccessible page. Whatever passes Validate and CheckCells must place and
// gather inside those tensors: a stray write past the end faults (turned
// into a test failure), one before the start or into another cell or stride
// gap differs from the reference.
func FuzzLayout(f *testing.F) {
	f.Add(uint16(64), uint8(16), uint16(32), uint16(16), uint8(1), false, uint32(32), uint32(16), int64(1), []byte(nil))
	f.Add(uint16(64), uint8(16), uint16(32), uint16(16), uint8(1), true, uint32(40), uint32(128), int64(2), []byte(nil))
	f.Add(uint16(9), uint8(4), uint16(3), uint16(24), uint8(3), true, uint32(3), uint32(72), int64(3), []byte(nil))
	f.Add(uint16(5), uint8(5), uint16(1), uint16(5), uint8(0), false, uint32(1), uint32(7), int64(4), []byte{4, 3, 2, 1, 0})
	f.Add(uint16(5), uint8(3), uint16(1), uint16(2), uint8(1), true, uint32(1), uint32(9), int64(5), []byte{4, 4, 0})
	f.Add(uint16(300), uint8(3), uint16(8), uint16(8), uint8(2), true, uint32(7), uint32(1199), int64(6), []byte{255, 44, 1})
	f.Add(uint16(64), uint8(16), uint16(32), uint16(0), uint8(1), false, uint32(32), uint32(0), int64(7), []byte(nil)) // K-only
	f.Add(uint16(9), uint8(4), uint16(5), uint16(0), uint8(0), true, uint32(9), uint32(3), int64(8), []byte(nil))      // K-only
	f.Fuzz(func(t *testing.T, cellCount uint16, block uint8, krow, vrow uint16, elemSel uint8, vtrans bool,
		kstride, vstride uint32, seed int64, rawCells []byte) {
		if cellCount == 0 || block == 0 || krow == 0 || int(block) > int(cellCount) {
			return
		}
		elem := 1 << (elemSel % 4)
		s := &Shape{
			Geometry: &pool.Geometry{BlockTokens: int(block), KRow: []int{int(krow)}, VRow: []int{int(vrow)}},
			VElem:    []int{elem},
		}
		// vrow 0 is a K-only model (MLA), whose layers have no V tensor.
		v := uintptr(1)
		if vrow == 0 {
			v = 0
		}
		lo := &Layout{Cells: uint32(cellCount), VTrans: vtrans, Location: "cpu:0",
			Layers: []Layer{{K: 1, V: v, KStride: uint64(kstride), VStride: uint64(vstride)}}}
		// Validate sees placeholder addresses first: tensors are mapped
		// only for layouts it accepts, and only when they are small.
		if err := lo.Validate(s); err != nil {
			require.Equal(t, status.Layout, status.Of(err), "Validate: %v", err)
			return
		}
		const maxTensor = 4 << 20
		if kExtent(lo, int(krow), lo.Layers[0]) > maxTensor || vExtent(lo, int(vrow), elem, lo.Layers[0]) > maxTensor {
			return
		}

		r := rand.New(rand.NewSource(seed))
		var cells []uint32
		if len(rawCells) >= int(block) {
			// Raw cells may repeat or run past the layout: CheckCells
			// must refuse every set that Place cannot take.
			for _, c := range rawCells[:block] {
				cells = append(cells, uint32(c)%(uint32(cellCount)+2))
			}
		} else {
			for _, c := range r.Perm(int(cellCount))[:block] {
				cells = append(cells, uint32(c))
			}
			if seed%2 == 0 {
				sort.Slice(cells, func(i, j int) bool { return cells[i] < cells[j] })
			}
		}
		if err := lo.CheckCells(cells); err != nil {
			require.Equal(t, status.Layout, status.Of(err), "CheckCells: %v", err)
			return
		}

		ts := buildLayout(t, lo, s)
		defer freeLayout(ts)
		require.NoError(t, lo.Validate(s), "Validate refuses the mapped layout")
		defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
		checkPlaceGather(t, r, lo, s, 0, cells, ts)
	})
}
