package key

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/zeebo/xxh3"
)

func TestFileDigest(t *testing.T) {
	path := filepath.Join(t.TempDir(), "model.gguf")
	// Larger than io.Copy's buffer, so the streaming digest spans many writes.
	data := TokenBytes(seqTokens(100_000, 5))
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	h, err := FileDigest(path)
	if err != nil {
		t.Fatal(err)
	}
	if h != canonical128(xxh3.Hash128(data)) {
		t.Fatalf("FileDigest is not XXH3-128 of the file's bytes")
	}
	if again, err := FileDigest(path); err != nil || again != h {
		t.Fatalf("second digest: %s, %v", again, err)
	}

	// Same size, new bytes, new mtime: the cache must not answer.
	data[len(data)/2] ^= 1
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	later := time.Now().Add(time.Hour)
	if err := os.Chtimes(path, later, later); err != nil {
		t.Fatal(err)
	}
	if h2, err := FileDigest(path); err != nil || h2 != canonical128(xxh3.Hash128(data)) {
		t.Fatalf("after a rewrite: %s, %v", h2, err)
	}

	if _, err := FileDigest(filepath.Join(t.TempDir(), "missing.gguf")); err == nil {
		t.Fatalf("a missing file has a digest")
	}
}
