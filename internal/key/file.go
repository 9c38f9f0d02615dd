package key

import (
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"github.com/zeebo/xxh3"
)

type fileStamp struct {
	path  string
	size  int64
	mtime time.Time
}

var fileDigests = struct {
	sync.Mutex
	m map[fileStamp]Hash
}{m: map[fileStamp]Hash{}}

// FileDigest returns the XXH3-128 digest of a file's bytes (a GGUF's
// metadata and tensor data), cached by path, size and modification time so
// that registering a model again does not reread gigabytes.
func FileDigest(path string) (Hash, error) {
	st, err := os.Stat(path)
	if err != nil {
		return Hash{}, err
	}
	if !st.Mode().IsRegular() {
		// A FIFO or a device would never end, or never mean the same bytes.
		return Hash{}, fmt.Errorf("%s is not a regular file", path)
	}
	stamp := fileStamp{path: path, size: st.Size(), mtime: st.ModTime()}
	fileDigests.Lock()
	h, ok := fileDigests.m[stamp]
	fileDigests.Unlock()
	if ok {
		return h, nil
	}
	f, err := os.Open(path)
	if err != nil {
		return Hash{}, err
	}
	defer f.Close()
	d := xxh3.New()
	if _, err := io.Copy(d, f); err != nil {
		return Hash{}, err
	}
	h = FromU128(d.Sum128())
	fileDigests.Lock()
	fileDigests.m[stamp] = h
	fileDigests.Unlock()
	return h, nil
}
