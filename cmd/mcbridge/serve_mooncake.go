package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/store/mooncake/master"
)

// `mcbridge serve --mooncake-master ...` is the store node of a Mooncake
// Store deployment (docs/store.md): it supervises mooncake_master (started,
// and restarted when it dies), contributes a DRAM segment to the store as a
// plain client, and keeps the directory's store entries true to the store
// for every model (the keeper of internal/bridge, fed with every model's
// events). Replication, takeover and eviction are Mooncake Store's; the
// home-made store node (the other serve mode) does them itself.

// mooncakeMode reports whether serve's arguments ask for this mode:
// --mooncake-master (supervise one) or --master-addr (join one).
func mooncakeMode(args []string) bool {
	for _, a := range args {
		name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if name != a && (name == "mooncake-master" || name == "master-addr") {
			return true
		}
	}
	return false
}

func serveMooncake(args []string) error {
	fs := flag.NewFlagSet("serve (Mooncake Store)", flag.ContinueOnError)
	bin := fs.String("mooncake-master", "", "mooncake_master to run and supervise (libasio.so beside it); empty: join the master at --master-addr")
	addr := fs.String("master-addr", "127.0.0.1:50051", "the master's RPC address, where clients (store.master) reach it")
	admin := fs.String("master-admin", "127.0.0.1:9003", "the master's admin and metrics HTTP address")
	metadata := fs.String("master-metadata", "", "also serve Transfer Engine metadata over HTTP at this address (clients then use store.metadata http://ADDR/metadata)")
	clientTTL := fs.Duration("client-ttl", 10*time.Second, "how long a silent client's segment, and the replicas in it, stay in the store")
	segment := fs.Int64("segment-bytes", 1<<30, "DRAM this node contributes to the store")
	poolBytes := fs.Int64("pool-bytes", 16<<20, "the node's own pool (registered with the store; it saves nothing)")
	cfgDoc := fs.String("config", "", "bridge configuration: JSON or a file path (default $MCB_CONFIG); its directory is the swarm's")
	listen := fs.String("listen", "127.0.0.1:9464", "HTTP address for /metrics, /state, /master and /healthz")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cfg, err := config.Load(*cfgDoc)
	if err != nil {
		return err
	}
	if cfg.Directory.Kind != "etcd" {
		return fmt.Errorf("the Mooncake Store node keeps the swarm's etcd directory true to the store: configure directory.kind etcd")
	}
	cfg.PoolBytes = *poolBytes
	cfg.Store.Kind, cfg.Store.Master, cfg.Store.SegmentBytes = "mooncake", *addr, *segment
	if *metadata != "" {
		cfg.Store.Metadata = "http://" + *metadata + "/metadata"
	}
	if cfg.Owner == "" {
		host, _ := os.Hostname()
		cfg.Owner = fmt.Sprintf("mooncake-store-%s-%d", host, os.Getpid())
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))

	var sup *supervisor
	if *bin != "" {
		sup, err = supervise(master.Config{Binary: *bin, Addr: *addr, AdminAddr: *admin, MetadataAddr: *metadata,
			ClientTTL: *clientTTL, Log: os.Stderr}, log)
		if err != nil {
			return err
		}
		defer sup.stop()
	}
	b, err := bridge.Open(cfg, bridge.Deps{})
	if err != nil {
		return err
	}
	closed := false
	defer func() {
		if !closed {
			_ = b.Close()
		}
	}()
	if err := b.WatchStore(); err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.Handle("/", serveMux(b))
	mux.HandleFunc("/master", func(w http.ResponseWriter, _ *http.Request) {
		st := map[string]any{"addr": *addr, "admin": "http://" + *admin, "supervised": sup != nil}
		if sup != nil {
			st["pid"], st["restarts"] = sup.pid(), sup.restarts.Load()
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(st)
	})
	srv, err := serveHTTP(*listen, mux, 5*time.Second)
	if err != nil {
		return err
	}
	log.Info("Mooncake Store node serving", "master", *addr, "supervised", sup != nil, "segment", b.StoreSegment(),
		"segment_bytes", *segment, "owner", b.Owner(), "http", srv.Addr())
	// The first line on stdout is machine-readable, for scripts that start
	// a node and need its addresses.
	_ = json.NewEncoder(os.Stdout).Encode(map[string]string{"master": *addr, "admin": "http://" + *admin,
		"segment": b.StoreSegment(), "http": srv.Addr(), "owner": b.Owner()})

	srv.untilSignal(log, "leaving the store, then stopping the master", 5*time.Second)
	closed = true
	return b.Close()
}

// supervisor keeps a mooncake_master running: when it exits it is started
// again, with backoff. A master without HA keeps nothing across a restart:
// every replica it placed is gone, which the keepers' audits then find.
type supervisor struct {
	cfg      master.Config
	log      *slog.Logger
	restarts atomic.Int64

	mu   sync.Mutex
	cur  *master.Process
	quit chan struct{}
	done chan struct{}
}

// masterStartTimeout bounds one start of the master.
const masterStartTimeout = 30 * time.Second

func supervise(cfg master.Config, log *slog.Logger) (*supervisor, error) {
	ctx, cancel := context.WithTimeout(context.Background(), masterStartTimeout)
	defer cancel()
	p, err := master.Start(ctx, cfg)
	if err != nil {
		return nil, err
	}
	s := &supervisor{cfg: cfg, log: log, cur: p, quit: make(chan struct{}), done: make(chan struct{})}
	log.Info("mooncake_master started", "pid", p.Pid(), "addr", cfg.Addr, "admin", p.AdminURL())
	go s.run()
	return s, nil
}

func (s *supervisor) current() *master.Process {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cur
}

func (s *supervisor) pid() int { return s.current().Pid() }

func (s *supervisor) run() {
	defer close(s.done)
	const minBackoff, maxBackoff = time.Second, 30 * time.Second
	for {
		p := s.current()
		select {
		case <-s.quit:
			return
		case <-p.Done():
		}
		s.log.Warn("mooncake_master exited; restarting it (the blocks it placed are gone)", "err", p.Err())
		for backoff := minBackoff; ; backoff = min(2*backoff, maxBackoff) {
			select {
			case <-s.quit:
				return
			case <-time.After(backoff):
			}
			ctx, cancel := context.WithTimeout(context.Background(), masterStartTimeout)
			np, err := master.Start(ctx, s.cfg)
			cancel()
			if err == nil {
				s.mu.Lock()
				s.cur = np
				s.mu.Unlock()
				s.restarts.Add(1)
				s.log.Info("mooncake_master restarted", "pid", np.Pid())
				break
			}
			s.log.Warn("restarting mooncake_master failed", "err", err, "retry_in", 2*backoff)
		}
	}
}

// stop ends supervision and stops the master.
func (s *supervisor) stop() {
	close(s.quit)
	<-s.done
	if err := s.current().Stop(10 * time.Second); err != nil {
		s.log.Warn("stopping mooncake_master", "err", err)
	}
}
