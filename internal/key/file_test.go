package key

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/zeebo/xxh3"
)

func TestFileDigest(t *testing.T) {
	path := filepath.Join(t.TempDir(), "model.gguf")
	// Larger than io.Copy's buffer, so the streaming digest spans many writes.
	data := TokenBytes(seqTokens(100_000, 5))
	require.NoError(t, os.WriteFile(path, data, 0o600))
	h, err := FileDigest(path)
	require.NoError(t, err)
	require.Equal(t, canonical128(xxh3.Hash128(data)), h, "FileDigest is not XXH3-128 of the file's bytes")
	again, err := FileDigest(path)
	require.NoError(t, err, "second digest")
	require.Equal(t, h, again, "second digest")

	// Same size, new bytes, new mtime: the cache must not answer.
	data[len(data)/2] ^= 1
	require.NoError(t, os.WriteFile(path, data, 0o600))
	later := time.Now().Add(time.Hour)
	require.NoError(t, os.Chtimes(path, later, later))
	h2, err := FileDigest(path)
	require.NoError(t, err, "after a rewrite")
	require.Equal(t, canonical128(xxh3.Hash128(data)), h2, "after a rewrite")

	_, err = FileDigest(filepath.Join(t.TempDir(), "missing.gguf"))
	require.Error(t, err, "a missing file has a digest")
}
