package proxy

import (
	"bytes"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// What is written through a slot file's mapping is the file the server
// reads, at the size of the last resize, and closing removes it.
func TestSlotFile(t *testing.T) {
	dir := t.TempDir()
	sf, err := createSlotFile(dir, "r0.bin")
	require.NoError(t, err)
	_, err = createSlotFile(dir, "r0.bin")
	require.Error(t, err, "a file of that name exists: another proxy's")

	for _, n := range []int{3 << 20, 1 << 20, 5 << 20, 5<<20 + 7} {
		b, err := sf.resize(n)
		require.NoError(t, err, "resize to %d", n)
		require.Len(t, b, n)
		for i := range b {
			b[i] = byte(i*7 + n)
		}
		got, err := os.ReadFile(sf.path)
		require.NoError(t, err)
		require.Len(t, got, n)
		assert.True(t, bytes.Equal(b, got), "%d bytes: the file holds what was written through the mapping", n)
	}

	require.NoError(t, sf.close())
	_, err = os.Stat(sf.path)
	assert.True(t, os.IsNotExist(err), "closed files are removed: %v", err)
}
