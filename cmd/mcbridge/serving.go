package main

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"
)

// httpServer is the HTTP side of serve and proxy: serving from start
// until a signal stops it.
type httpServer struct {
	srv *http.Server
	ln  net.Listener
}

// serveHTTP listens on addr and serves h there in the background.
// readHeader bounds a request's headers; there is no write timeout, as a
// streamed completion runs as long as it runs.
func serveHTTP(addr string, h http.Handler, readHeader time.Duration) (*httpServer, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	s := &httpServer{srv: &http.Server{Handler: h, ReadHeaderTimeout: readHeader}, ln: ln}
	go func() { _ = s.srv.Serve(ln) }()
	return s, nil
}

// Addr is where the server listens (the port chosen for ":0").
func (s *httpServer) Addr() string { return s.ln.Addr().String() }

// untilSignal waits for SIGINT or SIGTERM, logs what stopping does next,
// and shuts the server down, giving requests in flight grace to finish.
func (s *httpServer) untilSignal(log *slog.Logger, stopping string, grace time.Duration) {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	<-sig
	signal.Stop(sig)
	log.Info("shutting down: " + stopping)
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	_ = s.srv.Shutdown(ctx)
}
