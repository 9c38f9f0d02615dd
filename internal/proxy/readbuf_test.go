package proxy

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func writeFile(t *testing.T, n int, fill byte) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "slot.bin")
	require.NoError(t, os.WriteFile(p, bytes.Repeat([]byte{fill}, n), 0o644))
	return p
}

func same(a, b []byte) bool { return unsafe.SliceData(a) == unsafe.SliceData(b) }

func TestReadBuffersReuse(t *testing.T) {
	rb := readBuffers{limit: 1 << 20}
	first, err := rb.read(writeFile(t, 1000, 1))
	require.NoError(t, err)
	assert.Equal(t, bytes.Repeat([]byte{1}, 1000), first)
	assert.Equal(t, 2000, cap(first), "room to grow, as append leaves")
	rb.put(first)

	// A file that fits the idle buffer is read into it, whole.
	again, err := rb.read(writeFile(t, 1500, 2))
	require.NoError(t, err)
	assert.True(t, same(first, again))
	assert.Equal(t, bytes.Repeat([]byte{2}, 1500), again)

	// One that does not, while the first is out, gets a buffer of its own.
	other, err := rb.read(writeFile(t, 3000, 3))
	require.NoError(t, err)
	assert.False(t, same(first, other))
	rb.put(again)
	rb.put(other)
	assert.Len(t, rb.idle, keptBuffers)

	// The smallest that holds it is taken.
	small, err := rb.read(writeFile(t, 10, 4))
	require.NoError(t, err)
	assert.True(t, same(first, small))
}

func TestReadBuffersLimit(t *testing.T) {
	rb := readBuffers{limit: 4000}
	big, err := rb.read(writeFile(t, 3000, 1))
	require.NoError(t, err)
	assert.Equal(t, 4000, cap(big), "growth room stops at the limit")
	a, err := rb.read(writeFile(t, 500, 2))
	require.NoError(t, err)
	b, err := rb.read(writeFile(t, 400, 3))
	require.NoError(t, err)
	rb.put(a)
	rb.put(b)
	require.Len(t, rb.idle, 2)
	// Kept only in place of a smaller one, within the limit: 4000 does
	// not fit beside 1000.
	rb.put(big)
	assert.Len(t, rb.idle, 2)
	for _, x := range rb.idle {
		assert.False(t, same(x, big))
	}

	// Over the limit alone: never kept.
	huge, err := rb.read(writeFile(t, 5000, 4))
	require.NoError(t, err)
	rb.put(huge)
	for _, x := range rb.idle {
		assert.False(t, same(x, huge))
	}
	rb.put(nil)
	assert.Len(t, rb.idle, 2)
}

func TestReadBuffersMissingFile(t *testing.T) {
	rb := readBuffers{limit: 1 << 20}
	_, err := rb.read(filepath.Join(t.TempDir(), "missing.bin"))
	require.Error(t, err)
}
