// Package embedded runs a single-member etcd inside the process, so that a
// store node gives one host a directory without another service. It is
// apart from package etcd because the server brings raft, bbolt and their
// dependencies: only binaries that embed a server link them.
package embedded

import (
	"fmt"
	"net"
	"net/url"
	"strconv"
	"time"

	"go.etcd.io/etcd/server/v3/embed"

	"github.com/mcbridge/mcbridge/internal/status"
)

// Options tune the server; zero values take the defaults below.
type Options struct {
	// PeerURL is where the member listens for peers; a free loopback port
	// when empty, as a single member talks to none.
	PeerURL string
	// QuotaBytes is the backend size past which etcd raises the NOSPACE
	// alarm and refuses every write. Default 8 GiB, etcd's suggested
	// maximum: a million blocks take well under one.
	QuotaBytes int64
	// CompactionRetention is how much history periodic auto-compaction
	// keeps. A subscriber disconnected for longer re-reads its snapshot;
	// without compaction the history of every publish grows to the quota.
	// Default 10 minutes.
	CompactionRetention time.Duration
	// MaxTxnOps and MaxRequestBytes raise etcd's limits (128 operations,
	// 1.5 MiB); give package etcd's Config the same values.
	MaxTxnOps       uint
	MaxRequestBytes uint
	// StartTimeout bounds the wait until the server serves. Default 60 s.
	StartTimeout time.Duration
}

// Defaults of Options.
const (
	DefaultQuotaBytes          = 8 << 30
	DefaultCompactionRetention = 10 * time.Minute
	DefaultStartTimeout        = 60 * time.Second
)

// Start runs etcd with its data in dir, serving clients at clientURL (for
// example http://127.0.0.1:2379), and returns once it serves. Entries and
// leases survive a stop and a start on the same dir. stop shuts it down
// and waits.
func Start(dir, clientURL string, opts Options) (stop func(), err error) {
	client, err := url.Parse(clientURL)
	if err != nil || client.Host == "" {
		return nil, status.Errorf(status.Config, "embedded etcd: client URL %q: want scheme://host:port", clientURL)
	}
	peerURL := opts.PeerURL
	if peerURL == "" {
		if peerURL, err = freeLoopbackURL(client.Port()); err != nil {
			return nil, err
		}
	}
	peer, err := url.Parse(peerURL)
	if err != nil || peer.Host == "" {
		return nil, status.Errorf(status.Config, "embedded etcd: peer URL %q: want scheme://host:port", peerURL)
	}
	if opts.QuotaBytes == 0 {
		opts.QuotaBytes = DefaultQuotaBytes
	}
	if opts.CompactionRetention == 0 {
		opts.CompactionRetention = DefaultCompactionRetention
	}
	if opts.StartTimeout == 0 {
		opts.StartTimeout = DefaultStartTimeout
	}

	cfg := embed.NewConfig()
	cfg.Name = "mcbridge"
	cfg.Dir = dir
	cfg.ListenClientUrls = []url.URL{*client}
	cfg.AdvertiseClientUrls = []url.URL{*client}
	cfg.ListenPeerUrls = []url.URL{*peer}
	cfg.AdvertisePeerUrls = []url.URL{*peer}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.QuotaBackendBytes = opts.QuotaBytes
	cfg.AutoCompactionMode = embed.CompactorModePeriodic
	cfg.AutoCompactionRetention = opts.CompactionRetention.String()
	if opts.MaxTxnOps != 0 {
		cfg.MaxTxnOps = opts.MaxTxnOps
	}
	if opts.MaxRequestBytes != 0 {
		cfg.MaxRequestBytes = opts.MaxRequestBytes
	}
	// The server shares the host process's stderr: warnings only.
	cfg.LogLevel = "warn"

	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, status.Wrap(status.Directory, err, "embedded etcd: starting in "+dir)
	}
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		e.Close()
		return nil, status.Wrap(status.Directory, err, "embedded etcd: serving")
	case <-time.After(opts.StartTimeout):
		e.Close()
		return nil, status.Errorf(status.Timeout, "embedded etcd: not ready after %v", opts.StartTimeout)
	}
	return e.Close, nil
}

// freeLoopbackURL returns a URL on a loopback port that was free a moment
// ago and is not avoid (the client port, which is not bound yet either).
func freeLoopbackURL(avoid string) (string, error) {
	for {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return "", status.Wrap(status.Directory, err, "embedded etcd: finding a free peer port")
		}
		addr := l.Addr().(*net.TCPAddr)
		l.Close()
		if strconv.Itoa(addr.Port) != avoid {
			return fmt.Sprintf("http://%s", addr), nil
		}
	}
}
