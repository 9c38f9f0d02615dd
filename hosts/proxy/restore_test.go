package proxy

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A restore's buffer comes back for the next one that fits in it, and the
// pool keeps the largest ones, at most one a slot.
func TestStatePool(t *testing.T) {
	var sp statePool
	addr := func(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }
	a := sp.get(100)
	require.Len(t, a, 100)
	sp.put(a, 2)
	b := sp.get(80)
	assert.Len(t, b, 80)
	assert.Equal(t, addr(a), addr(b), "a kept buffer that fits is reused")
	c := sp.get(200)
	assert.NotEqual(t, addr(a), addr(c), "a buffer in use is not handed out")
	d := sp.get(50)
	sp.put(b, 2)
	sp.put(c, 2)
	sp.put(d, 2)
	require.Len(t, sp.free, 2, "at most one a slot")
	for _, f := range sp.free {
		assert.GreaterOrEqual(t, cap(f), 100, "the smallest buffer went")
	}
	e := sp.get(150)
	assert.Equal(t, addr(c), addr(e), "the buffer that fits")
}
