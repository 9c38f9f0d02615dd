package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"time"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/directory/etcd/embedded"
	"github.com/mcbridge/mcbridge/internal/disk"
	"github.com/mcbridge/mcbridge/internal/metrics"
	"github.com/mcbridge/mcbridge/internal/residency"
	"github.com/mcbridge/mcbridge/internal/storenode"
)

func init() {
	commands["serve"] = command{"run a store node: a DRAM pool that keeps KV past the processes that computed it (--mooncake-master: Mooncake Store's)", serve}
}

func serve(args []string) error {
	// The store node of a Mooncake Store deployment (serve_mooncake.go).
	if mooncakeMode(args) {
		return serveMooncake(args)
	}
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	cfgDoc := fs.String("config", "", "bridge configuration: JSON or a file path (default $MCB_CONFIG)")
	poolBytes := fs.Int64("pool-bytes", 0, "pool size in bytes (default: the config's)")
	listen := fs.String("listen", "127.0.0.1:9464", "HTTP address for /metrics, /state and /healthz")
	embed := fs.Bool("embed-etcd", false, "run a single-node etcd inside this process and use it as the directory")
	etcdDir := fs.String("etcd-dir", "", "embedded etcd data directory (default: a directory under the user cache)")
	etcdURL := fs.String("etcd-client-url", "http://127.0.0.1:2379", "where the embedded etcd serves clients")
	eviction := fs.String("eviction", "frequency", "what the pool evicts first: frequency (uses readers report x recompute cost), cost or lru; overrides the config's")
	diskDir := fs.String("disk-dir", "", "keep every block in files under this directory too: evicted blocks come back on demand, and a restarted store reads them back")
	diskBytes := fs.Int64("disk-bytes", 0, "the disk tier's budget in bytes (required with --disk-dir)")
	diskCodec := fs.String("disk-codec", disk.DefaultCodec.String(), "how blocks are stored: raw, or zstd over byte planes (about 15% smaller on f16 KV, slower to read back: docs/bench/disk.md)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cfg, err := config.Load(*cfgDoc)
	if err != nil {
		return err
	}
	if *poolBytes > 0 {
		cfg.PoolBytes = *poolBytes
	}
	if cfg.KVEvents.Instance == "" {
		cfg.KVEvents.Instance = *listen
	}
	cfg.Eviction = *eviction
	if err := cfg.Validate(); err != nil {
		return err
	}
	codec, err := disk.ParseCodec(*diskCodec)
	if err != nil {
		return err
	}
	if (*diskDir == "") != (*diskBytes == 0) {
		return fmt.Errorf("--disk-dir and --disk-bytes go together")
	}
	if cfg.Owner == "" {
		host, _ := os.Hostname()
		cfg.Owner = fmt.Sprintf("store-%s-%d", host, os.Getpid())
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))

	if *embed {
		dir := *etcdDir
		if dir == "" {
			cache, err := os.UserCacheDir()
			if err != nil {
				return err
			}
			dir = cache + "/mcbridge/etcd"
		}
		stop, err := embedded.Start(dir, *etcdURL, embedded.Options{})
		if err != nil {
			return err
		}
		defer stop()
		cfg.Directory.Kind = "etcd"
		cfg.Directory.Endpoints = []string{*etcdURL}
		log.Info("embedded etcd serving", "url", *etcdURL, "dir", dir)
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
	var nodeCfg storenode.Config
	if *diskDir != "" {
		policy, _ := residency.PolicyNamed(cfg.Eviction)
		tier, err := disk.Open(disk.Config{Dir: *diskDir, Bytes: *diskBytes, Codec: codec, Policy: policy, Log: log})
		if err != nil {
			return err
		}
		st := tier.Stats()
		log.Info("disk tier open", "dir", tier.Dir(), "blocks", st.Files, "bytes", st.Bytes, "dropped", st.Dropped, "codec", codec)
		nodeCfg.Disk = tier
	}
	// The bridge is the node's host endpoint; its Close stops the node.
	node, err := storenode.New(b, nodeCfg)
	if err != nil {
		return err
	}
	if err := node.Replicate(); err != nil {
		return err
	}
	if n := node.RefillFromDisk(); n > 0 {
		log.Info("disk tier read back into the pool", "blocks", n)
	}
	srv, err := serveHTTP(*listen, serveMux(b), 5*time.Second)
	if err != nil {
		return err
	}
	log.Info("store node serving", "segment", b.Segment(), "owner", b.Owner(), "pool_bytes", cfg.PoolBytes,
		"http", srv.Addr(), "directory", cfg.Directory.Kind, "transport", cfg.Transport.Kind)
	// The first line on stdout is machine-readable, for scripts that start
	// a store and need its addresses.
	_ = json.NewEncoder(os.Stdout).Encode(map[string]string{"segment": b.Segment(), "http": srv.Addr(), "owner": b.Owner()})

	srv.untilSignal(log, "writing the pool to the disk tier (if any) and unpublishing this store's blocks", 5*time.Second)
	closed = true
	return b.Close()
}

func serveMux(b *bridge.Bridge) *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("/metrics", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		_ = metrics.Write(w, b, nil)
	})
	mux.HandleFunc("/state", func(w http.ResponseWriter, _ *http.Request) {
		blocks, bytes, poolBytes := b.Resident()
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{
			"segment": b.Segment(), "owner": b.Owner(),
			"blocks": blocks, "bytes": bytes, "pool_bytes": poolBytes, "stats": b.Stats(), "disk": b.DiskStats(),
		})
	})
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	return mux
}
