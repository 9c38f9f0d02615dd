// Package config parses the bridge's JSON configuration. Every field has a
// default that works alone: an empty config gives an in-process pool, the
// memory directory and the loopback transport.
package config

import (
	"bytes"
	"encoding/json"
	"io"
	"net"
	"os"
	"strings"

	"github.com/mcbridge/mcbridge/internal/arbiter"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Config is the whole configuration, as written in JSON.
type Config struct {
	// PoolBytes is the size of this process's block pool.
	PoolBytes int64 `json:"pool_bytes"`
	// BlockTokens is the default block size for models that do not set one.
	BlockTokens int `json:"block_tokens"`
	// Eviction is "lru" or "cost" (cost-aware).
	Eviction string `json:"eviction"`
	// Owner names this process in the directory; empty picks host-pid-random.
	Owner     string    `json:"owner"`
	Transport Transport `json:"transport"`
	Directory Directory `json:"directory"`
	Arbiter   Arbiter   `json:"arbiter"`
	Store     Store     `json:"store"`
	// TransferTimeoutMS bounds a load's wait for its transfers.
	TransferTimeoutMS int `json:"transfer_timeout_ms"`
}

// Transport selects and configures the transfer engine.
type Transport struct {
	// Kind is "loopback" (in-process engines, the default) or "mooncake"
	// (Mooncake Transfer Engine, or the mock TE, loaded from Lib).
	Kind string `json:"kind"`
	// Lib is the path of libtransfer_engine.so; MCB_MOONCAKE_LIB when empty.
	Lib string `json:"lib"`
	// Metadata is the TE metadata connection string: "P2PHANDSHAKE",
	// "etcd://host:port", "redis://...", "http://...".
	Metadata string `json:"metadata"`
	// Protocol is the TE transport to install: "tcp" or "rdma".
	Protocol string `json:"protocol"`
	// Args are the protocol's arguments (RDMA device names, for example).
	Args string `json:"args"`
	// LocalHostname is the address this engine is reached at.
	LocalHostname string `json:"local_hostname"`
	// BandwidthGBps and LatencyUS shape the loopback link (0 = unshaped).
	BandwidthGBps float64 `json:"bandwidth_gbps"`
	LatencyUS     float64 `json:"latency_us"`
}

// Directory selects and configures the block directory.
type Directory struct {
	// Kind is "memory" (one process, the default) or "etcd".
	Kind string `json:"kind"`
	// Name scopes a memory directory inside the process.
	Name        string   `json:"name"`
	Endpoints   []string `json:"endpoints"`
	Prefix      string   `json:"prefix"`
	LeaseTTLS   int      `json:"lease_ttl_s"`
	OpTimeoutMS int      `json:"op_timeout_ms"`
	Username    string   `json:"username"`
	Password    string   `json:"password"`
	CAFile      string   `json:"ca_file"`
	CertFile    string   `json:"cert_file"`
	KeyFile     string   `json:"key_file"`
}

// Store selects a shared store that sealed blocks are written into and
// restored from (docs/store.md). Without one ("none"), directory entries
// name blocks in their owner's pool, read over the transport.
type Store struct {
	// Kind is "none" (the default) or "mooncake" (Mooncake Store).
	Kind string `json:"kind"`
	// Master is mooncake_master's RPC address, host:port.
	Master string `json:"master"`
	// Lib is libmooncake_store.so; MCB_MOONCAKE_STORE_LIB when empty.
	Lib string `json:"lib"`
	// Replicas is how many copies of each block the master places, each
	// in another client segment, this process's first when it has one.
	Replicas int `json:"replicas"`
	// SegmentBytes is the DRAM this process contributes to the store as a
	// client segment (0: none; else at least 16 MiB).
	SegmentBytes int64 `json:"segment_bytes"`
	// Metadata is the store's Transfer Engine metadata: "P2PHANDSHAKE" or
	// the master's HTTP metadata server, "http://host:port/metadata".
	Metadata string `json:"metadata"`
	// Protocol is "tcp" or "rdma"; Device names the RDMA devices.
	Protocol string `json:"protocol"`
	Device   string `json:"device"`
	// LocalHostname is the address other clients reach this one at.
	LocalHostname string `json:"local_hostname"`
	// OpTimeoutMS bounds the store calls of the bridge's own goroutines
	// (puts, existence checks); loads are bounded by transfer_timeout_ms.
	OpTimeoutMS int `json:"op_timeout_ms"`
	// SetupTimeoutMS bounds connecting to the master when the bridge opens
	// (the library retries for about a minute when no master answers).
	SetupTimeoutMS int `json:"setup_timeout_ms"`
	// AuditIntervalMS is how often the directory's store entries are
	// checked against the store, off the request path.
	AuditIntervalMS int `json:"audit_interval_ms"`
}

// Mooncake Store limits the configuration checks.
const (
	MaxStoreReplicas      = 16
	MinStoreSegmentBytes  = 16 << 20
	storeMetadataP2P      = "P2PHANDSHAKE"
	storeMetadataHTTPPref = "http://"
)

// Arbiter configures the restore-or-recompute decision.
type Arbiter struct {
	// Policy is "cost-model" (the default), "always-restore" or
	// "always-recompute".
	Policy string `json:"policy"`
}

// Default returns the configuration used when nothing is configured.
func Default() Config {
	return Config{
		PoolBytes:   1 << 30,
		BlockTokens: 256,
		Eviction:    "lru",
		Transport:   Transport{Kind: "loopback", Metadata: "P2PHANDSHAKE", Protocol: "tcp", LocalHostname: "127.0.0.1"},
		Directory:   Directory{Kind: "memory", Name: "default", Prefix: "/mcbridge", LeaseTTLS: 10, OpTimeoutMS: 2000},
		Arbiter:     Arbiter{Policy: "cost-model"},
		Store: Store{Kind: "none", Replicas: 1, Metadata: storeMetadataP2P, Protocol: "tcp", LocalHostname: "127.0.0.1",
			OpTimeoutMS: 5000, SetupTimeoutMS: 30000, AuditIntervalMS: 5000},
		TransferTimeoutMS: 5000,
	}
}

// MaxSize bounds a configuration document.
const MaxSize = 1 << 20

// Parse reads a JSON document over the defaults. Unknown fields are errors:
// a misspelt key must not silently fall back to a default.
func Parse(doc []byte) (Config, error) {
	c := Default()
	if len(bytes.TrimSpace(doc)) == 0 {
		return c, nil
	}
	if len(doc) > MaxSize {
		return c, status.Errorf(status.Config, "config of %d bytes (max %d)", len(doc), MaxSize)
	}
	dec := json.NewDecoder(bytes.NewReader(doc))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return c, status.Wrap(status.Config, err, "parsing config")
	}
	// dec.More reports false before a stray '}' or ']', so ask for the
	// next token instead: only the end of input is clean.
	if _, err := dec.Token(); err != io.EOF {
		return c, status.Errorf(status.Config, "config: trailing data after the JSON object")
	}
	return c, c.Validate()
}

// Load parses doc, or, when doc is empty, the MCB_CONFIG environment
// variable: inline JSON when it starts with '{', else a file path.
func Load(doc string) (Config, error) {
	if strings.TrimSpace(doc) == "" {
		doc = os.Getenv("MCB_CONFIG")
	}
	doc = strings.TrimSpace(doc)
	if doc != "" && doc[0] != '{' {
		b, err := os.ReadFile(doc)
		if err != nil {
			return Default(), status.Wrap(status.Config, err, "reading config file")
		}
		return Parse(b)
	}
	return Parse([]byte(doc))
}

// Validate checks values that parse but cannot work.
func (c *Config) Validate() error {
	switch {
	case c.PoolBytes < 1<<20:
		return status.Errorf(status.Config, "pool_bytes %d: at least 1 MiB", c.PoolBytes)
	case c.BlockTokens <= 0 || c.BlockTokens > 1<<16:
		return status.Errorf(status.Config, "block_tokens %d: 1..65536", c.BlockTokens)
	case c.Eviction != "lru" && c.Eviction != "cost":
		return status.Errorf(status.Config, "eviction %q: lru or cost", c.Eviction)
	case c.Transport.Kind != "loopback" && c.Transport.Kind != "mooncake":
		return status.Errorf(status.Config, "transport.kind %q: loopback or mooncake", c.Transport.Kind)
	case c.Transport.BandwidthGBps < 0 || c.Transport.LatencyUS < 0:
		return status.Errorf(status.Config, "transport link shaping must not be negative")
	case c.Directory.Kind != "memory" && c.Directory.Kind != "etcd":
		return status.Errorf(status.Config, "directory.kind %q: memory or etcd", c.Directory.Kind)
	case c.Directory.Kind == "etcd" && len(c.Directory.Endpoints) == 0:
		return status.Errorf(status.Config, "directory.kind etcd needs endpoints")
	case c.Directory.LeaseTTLS <= 0 || c.Directory.OpTimeoutMS <= 0:
		return status.Errorf(status.Config, "directory lease_ttl_s and op_timeout_ms must be positive")
	case c.TransferTimeoutMS <= 0:
		return status.Errorf(status.Config, "transfer_timeout_ms must be positive")
	}
	if _, err := arbiter.ParsePolicy(c.Arbiter.Policy); err != nil {
		return status.Wrap(status.Config, err, "arbiter.policy")
	}
	return c.Store.validate()
}

func (s *Store) validate() error {
	switch s.Kind {
	case "none":
		return nil
	case "mooncake":
	default:
		return status.Errorf(status.Config, "store.kind %q: none or mooncake", s.Kind)
	}
	if _, port, err := net.SplitHostPort(s.Master); err != nil || port == "" || port == "0" {
		return status.Errorf(status.Config, "store.master %q: the master's RPC address, host:port", s.Master)
	}
	switch {
	case s.Replicas < 1 || s.Replicas > MaxStoreReplicas:
		return status.Errorf(status.Config, "store.replicas %d: 1..%d", s.Replicas, MaxStoreReplicas)
	case s.SegmentBytes != 0 && s.SegmentBytes < MinStoreSegmentBytes:
		return status.Errorf(status.Config, "store.segment_bytes %d: 0 (contribute none) or at least %d", s.SegmentBytes, MinStoreSegmentBytes)
	case s.Metadata != storeMetadataP2P && !strings.HasPrefix(s.Metadata, storeMetadataHTTPPref):
		return status.Errorf(status.Config, "store.metadata %q: %s or the master's http://host:port/metadata", s.Metadata, storeMetadataP2P)
	case s.Protocol != "tcp" && s.Protocol != "rdma":
		return status.Errorf(status.Config, "store.protocol %q: tcp or rdma", s.Protocol)
	case s.LocalHostname == "":
		return status.Errorf(status.Config, "store.local_hostname must not be empty")
	case s.OpTimeoutMS <= 0 || s.SetupTimeoutMS <= 0 || s.AuditIntervalMS <= 0:
		return status.Errorf(status.Config, "store.op_timeout_ms, store.setup_timeout_ms and store.audit_interval_ms must be positive")
	}
	return nil
}
