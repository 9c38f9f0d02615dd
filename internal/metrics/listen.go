package metrics

import (
	"context"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Listener serves /metrics on an address of its own, from a goroutine of
// the library: for hosts whose port is private (llama-server under Ollama)
// or that have none (embedders), configured by metrics_listen.
type Listener struct {
	srv *http.Server
	ln  net.Listener

	mu   sync.Mutex
	b    *bridge.Bridge
	off  error
	done chan struct{}
}

// Listen serves /metrics on addr for b (nil: off, with the reason off).
func Listen(addr string, b *bridge.Bridge, off error) (*Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, status.Wrap(status.Config, err, "metrics_listen "+addr)
	}
	l := &Listener{ln: ln, b: b, off: off, done: make(chan struct{})}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, _ *http.Request) {
		l.mu.Lock()
		b, off := l.b, l.off
		l.mu.Unlock()
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		_ = Write(w, b, off)
	})
	l.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		defer close(l.done)
		_ = l.srv.Serve(ln)
	}()
	return l, nil
}

// Addr is where the listener serves.
func (l *Listener) Addr() string { return l.ln.Addr().String() }

// Set changes the bridge the listener serves.
func (l *Listener) Set(b *bridge.Bridge, off error) {
	l.mu.Lock()
	l.b, l.off = b, off
	l.mu.Unlock()
}

// Serves reports whether the listener serves b.
func (l *Listener) Serves(b *bridge.Bridge) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b == b
}

// Close stops serving and waits for the goroutine.
func (l *Listener) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	err := l.srv.Shutdown(ctx)
	<-l.done
	return err
}
