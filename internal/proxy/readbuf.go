package proxy

import (
	"fmt"
	"io"
	"os"
	"sync"
)

// readBuffers are the buffers saved slot files are read into, kept from one
// save to the next. A slot file is the slot's whole state (94 MB at 4k tokens
// of the bench-size Gemma 3), and a model with a partial state has one saved
// at every snapshot boundary, each read while the request waits. Read into a
// buffer of its own (os.ReadFile), each took 20-420 ms on this machine,
// nearly all of it the kernel faulting in and zeroing pages never written
// before; into a resident buffer it is a copy from the page cache. It owns
// its idle buffers; a buffer it hands out is the caller's until given back.
type readBuffers struct {
	mu    sync.Mutex
	idle  [][]byte
	limit int // the most bytes kept idle: memory the proxy holds between saves
}

// keptBuffers is how many buffers are kept idle: one for the file a request
// waits on, one for the file its publish still holds.
const keptBuffers = 2

// read reads the file at path into a buffer the caller gives back with put.
func (rb *readBuffers) read(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	buf := rb.get(int(st.Size()))
	if _, err := io.ReadFull(f, buf); err != nil {
		rb.put(buf)
		return nil, fmt.Errorf("reading %s: %w", path, err)
	}
	return buf, nil
}

// get returns a buffer of n bytes: the smallest idle one that holds n,
// else a new one.
func (rb *readBuffers) get(n int) []byte {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	best := -1
	for i, b := range rb.idle {
		if cap(b) >= n && (best < 0 || cap(b) < cap(rb.idle[best])) {
			best = i
		}
	}
	if best < 0 {
		// Room to grow, as append leaves: a conversation's slot file
		// grows with each turn, and only the pages read into are
		// resident.
		return make([]byte, n, max(n, min(2*n, rb.limit)))
	}
	b := rb.idle[best]
	rb.idle = append(rb.idle[:best], rb.idle[best+1:]...)
	return b[:n]
}

// put gives a buffer from read back. It is kept while fewer than
// keptBuffers are and they stay within the limit, else the smallest idle
// one makes room for it when that keeps more bytes ready.
func (rb *readBuffers) put(b []byte) {
	if cap(b) == 0 || cap(b) > rb.limit {
		return
	}
	rb.mu.Lock()
	defer rb.mu.Unlock()
	held := 0
	smallest := -1
	for i, x := range rb.idle {
		held += cap(x)
		if smallest < 0 || cap(x) < cap(rb.idle[smallest]) {
			smallest = i
		}
	}
	switch {
	case len(rb.idle) < keptBuffers && held+cap(b) <= rb.limit:
		rb.idle = append(rb.idle, b[:0])
	case smallest >= 0 && cap(rb.idle[smallest]) < cap(b) && held-cap(rb.idle[smallest])+cap(b) <= rb.limit:
		rb.idle[smallest] = b[:0]
	}
}
