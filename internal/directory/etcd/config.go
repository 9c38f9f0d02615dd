package etcd

import (
	"crypto/tls"
	"crypto/x509"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/mcbridge/mcbridge/internal/logs"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Config says how to reach etcd and how this process's entries live there.
type Config struct {
	// Endpoints are etcd client URLs: http://host:2379, or https:// with TLS.
	Endpoints []string
	// Prefix roots every key; processes that share it share blocks.
	Prefix string
	// LeaseTTL bounds how long a dead process's entries outlive it. etcd
	// grants whole seconds and raises very short TTLs to its own minimum.
	LeaseTTL time.Duration
	// DialTimeout bounds connecting, and authenticating when a user is set.
	DialTimeout time.Duration
	// OpTimeout bounds each Publish, Unpublish and Close, and each page of a
	// subscription's snapshot.
	OpTimeout time.Duration
	// Username and Password enable etcd authentication.
	Username string
	Password string
	// TLS holds PEM files; any one set turns TLS on.
	TLS TLSFiles
	// MaxTxnOps and MaxRequestBytes must not exceed the server's
	// --max-txn-ops and --max-request-bytes; batches are cut to fit them.
	MaxTxnOps       int
	MaxRequestBytes int
	// OnLease, when set, hears every change of the lease, from the
	// goroutine that keeps it; it must not block for long.
	OnLease func(LeaseReport)
	// Log receives what cannot be returned to a caller: undecodable
	// entries, subscription resyncs, lease losses. Nil is the process's
	// rate-limited stderr log (package logs).
	Log *slog.Logger
}

// TLSFiles names the PEM files of a TLS connection to etcd.
type TLSFiles struct {
	CAFile   string // verifies the server; the system pool when empty
	CertFile string // client certificate, for etcd's --client-cert-auth
	KeyFile  string
}

// Defaults, as etcd's own server defaults where they mirror one.
const (
	DefaultPrefix          = "/mcbridge"
	DefaultLeaseTTL        = 10 * time.Second
	DefaultDialTimeout     = 5 * time.Second
	DefaultOpTimeout       = 2 * time.Second
	DefaultMaxTxnOps       = 128
	DefaultMaxRequestBytes = 3 << 19 // 1.5 MiB
)

func (c *Config) withDefaults() (Config, error) {
	out := *c
	if out.Prefix == "" {
		out.Prefix = DefaultPrefix
	}
	out.Prefix = strings.TrimRight(out.Prefix, "/")
	if out.LeaseTTL == 0 {
		out.LeaseTTL = DefaultLeaseTTL
	}
	if out.DialTimeout == 0 {
		out.DialTimeout = DefaultDialTimeout
	}
	if out.OpTimeout == 0 {
		out.OpTimeout = DefaultOpTimeout
	}
	if out.MaxTxnOps == 0 {
		out.MaxTxnOps = DefaultMaxTxnOps
	}
	if out.MaxRequestBytes == 0 {
		out.MaxRequestBytes = DefaultMaxRequestBytes
	}
	if out.Log == nil {
		out.Log = logs.Default()
	}
	switch {
	case len(out.Endpoints) == 0:
		return out, status.Errorf(status.Config, "etcd directory: no endpoints")
	case out.Prefix == "":
		return out, status.Errorf(status.Config, "etcd directory: prefix %q is only slashes", c.Prefix)
	case out.LeaseTTL < time.Second:
		return out, status.Errorf(status.Config, "etcd directory: lease TTL %v: at least 1s", out.LeaseTTL)
	case out.DialTimeout < 0 || out.OpTimeout < 0:
		return out, status.Errorf(status.Config, "etcd directory: negative timeout")
	case out.MaxTxnOps < 3:
		// A publish nests two transactions deep; each level spends one op
		// of its parent's budget.
		return out, status.Errorf(status.Config, "etcd directory: max txn ops %d: at least 3", out.MaxTxnOps)
	case out.MaxRequestBytes < minRequestBytes:
		return out, status.Errorf(status.Config, "etcd directory: max request bytes %d: at least %d", out.MaxRequestBytes, minRequestBytes)
	case (out.TLS.CertFile == "") != (out.TLS.KeyFile == ""):
		return out, status.Errorf(status.Config, "etcd directory: TLS cert and key files go together")
	}
	return out, nil
}

// tlsConfig loads the PEM files, or returns nil when none is set.
func (f TLSFiles) tlsConfig() (*tls.Config, error) {
	if f == (TLSFiles{}) {
		return nil, nil
	}
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if f.CAFile != "" {
		pem, err := os.ReadFile(f.CAFile)
		if err != nil {
			return nil, status.Wrap(status.Config, err, "etcd directory: reading TLS CA file")
		}
		tc.RootCAs = x509.NewCertPool()
		if !tc.RootCAs.AppendCertsFromPEM(pem) {
			return nil, status.Errorf(status.Config, "etcd directory: no PEM certificate in CA file %s", f.CAFile)
		}
	}
	if f.CertFile != "" {
		cert, err := tls.LoadX509KeyPair(f.CertFile, f.KeyFile)
		if err != nil {
			return nil, status.Wrap(status.Config, err, "etcd directory: loading TLS client certificate")
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}
