// Package config parses the bridge's JSON configuration. Every field has a
// default that works alone: an empty config gives an in-process pool, the
// memory directory and the loopback transport.
package config

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/url"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
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
	// SnapshotBlocks is how many blocks apart a host whose models keep a
	// partial state (sliding-window, hybrid, recurrent) snapshots it: the
	// only places a restore of such a model can end (docs/design.md §5.9).
	SnapshotBlocks int `json:"snapshot_blocks"`
	// ProxySnapshots is where the proxy, which snapshots a stock server
	// from outside at the price of a prompt stopped at the boundary and a
	// save of the whole slot, takes them for a model with KV blocks:
	// "ends" at a prompt's last block boundary and where the prompt leaves
	// the blocks the directory knows (a branch: the requests after it
	// restore there), "every" every snapshot_blocks blocks as well (any
	// prefix restores to a boundary, each costing its prompt and save).
	// A recurrent-only model, whose saves are its small state, is
	// snapshotted every snapshot_blocks blocks either way.
	ProxySnapshots string `json:"proxy_snapshots"`
	// Eviction is "lru", "cost" (cost-aware) or "frequency" (cost-aware
	// and weighted by uses: what a store node serving many readers wants).
	Eviction string `json:"eviction"`
	// Owner names this process in the directory; empty picks host-pid-random.
	Owner     string    `json:"owner"`
	Transport Transport `json:"transport"`
	Directory Directory `json:"directory"`
	Arbiter   Arbiter   `json:"arbiter"`
	Store     Store     `json:"store"`
	// SharedPool puts the pool in memory that processes of the same host
	// map read-only and restore from in place (docs/design.md §8.2).
	SharedPool SharedPool `json:"shared_pool"`
	// TransferTimeoutMS bounds a load's wait for its transfers, and every
	// engine call that waits on a peer.
	TransferTimeoutMS int `json:"transfer_timeout_ms"`
	// PeerDownMS is how long a peer whose transfers timed out is planned
	// around: lookups treat its blocks as absent meanwhile.
	PeerDownMS int `json:"peer_down_ms"`
	// MetricsListen, when set, is a host:port where the library serves
	// /metrics itself: for hosts whose own port is private or that have
	// none (llama-server under Ollama, embedders).
	MetricsListen string `json:"metrics_listen"`
	// KVEvents publishes which blocks this process holds in vLLM's KV
	// events format (docs/kvevents.md); off while Endpoint is empty.
	KVEvents KVEvents `json:"kv_events"`
}

// KVEvents configures the KV events publisher, after vLLM's
// --kv-events-config: a ZMQ PUB socket, an optional ROUTER socket that
// replays buffered batches, and a topic per model.
type KVEvents struct {
	// EnableKVCacheEvents and Publisher are vLLM's switches, so that its
	// configuration reads here as it is: false, or publisher "null", turns
	// the publisher off; unset, it is on when Endpoint is set.
	EnableKVCacheEvents *bool  `json:"enable_kv_cache_events"`
	Publisher           string `json:"publisher"`
	// Endpoint is the PUB socket: bound when it has a wildcard host ("*",
	// "::") or is ipc://, else connected (a consumer that binds), as vLLM
	// decides. Empty turns the publisher off.
	Endpoint string `json:"endpoint"`
	// ReplayEndpoint is the ROUTER socket, always bound; empty for none.
	ReplayEndpoint string `json:"replay_endpoint"`
	// Topic is every batch's first frame; {instance} and {model} are
	// replaced by Instance and the model's name.
	Topic string `json:"topic"`
	// Instance names this process to routers, the host:port they send its
	// requests to; empty takes the host name.
	Instance string `json:"instance"`
	// Model names the model in topics; empty takes the name the host
	// registers it under (the GGUF file's base name), or the model's
	// fingerprint on a store node.
	Model string `json:"model"`
	// BufferSteps is how many batches the replay socket keeps.
	BufferSteps int `json:"buffer_steps"`
	// HWM is the PUB socket's high-water mark, in batches.
	HWM int `json:"hwm"`
	// MaxQueueSize bounds the events waiting for the publisher's goroutine;
	// past it events are dropped, counted, and the stream is resent whole.
	MaxQueueSize int `json:"max_queue_size"`
	// Encoding is "array" (vLLM's tagged arrays, msgspec array_like) or
	// "map" (tagged maps, vLLM since it dropped array_like from events).
	Encoding string `json:"encoding"`
	// Medium is every event's medium: where the blocks are.
	Medium string `json:"medium"`
	// HashSeed seeds the XXH3-64 sequence hashes sent as block hashes.
	HashSeed uint64 `json:"hash_seed"`
	// HeartbeatMS, when positive, sends an empty batch on a topic that sent
	// nothing for that long, so that subscribers notice a late join or a
	// restart of this process (vLLM sends none).
	HeartbeatMS int `json:"heartbeat_ms"`
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

// SharedPool configures this process's pool as a shared one.
type SharedPool struct {
	// Enabled puts the pool in a sealed memfd and hands it to same-host
	// readers over a unix socket in Dir.
	Enabled bool `json:"enabled"`
	// Dir holds the socket; empty is $XDG_RUNTIME_DIR/mcbridge, else
	// /tmp/mcbridge-<uid>. It is made, or must be, a directory of this
	// user that only the user (and Group) can enter.
	Dir string `json:"dir"`
	// Group (a name or a numeric id) may map the pool too; empty: only
	// this user.
	Group string `json:"group"`
}

// SocketDir is the directory the pool's socket goes in.
func (s *SharedPool) SocketDir() string {
	if s.Dir != "" {
		return s.Dir
	}
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "mcbridge")
	}
	return filepath.Join(os.TempDir(), fmt.Sprintf("mcbridge-%d", os.Geteuid()))
}

// GID is the group's id, -1 without a group.
func (s *SharedPool) GID() (int, error) {
	if s.Group == "" {
		return -1, nil
	}
	g, err := user.LookupGroup(s.Group)
	if err != nil {
		if g, err = user.LookupGroupId(s.Group); err != nil {
			return -1, status.Errorf(status.Config, "shared_pool.group %q: no such group", s.Group)
		}
	}
	return strconv.Atoi(g.Gid)
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
	// DeadlineFactor and DeadlineMarginMS give a restore the cost model
	// chose its deadline: this many times its estimated time, at most the
	// compute it saves, plus the margin; TransferTimeoutMS caps it.
	DeadlineFactor   float64 `json:"deadline_factor"`
	DeadlineMarginMS int     `json:"deadline_margin_ms"`
}

// Default returns the configuration used when nothing is configured.
func Default() Config {
	return Config{
		PoolBytes:      1 << 30,
		BlockTokens:    256,
		SnapshotBlocks: 4,
		ProxySnapshots: "ends",
		Eviction:       "lru",
		Transport:      Transport{Kind: "loopback", Metadata: "P2PHANDSHAKE", Protocol: "tcp", LocalHostname: "127.0.0.1"},
		Directory:      Directory{Kind: "memory", Name: "default", Prefix: "/mcbridge", LeaseTTLS: 10, OpTimeoutMS: 2000},
		Arbiter:        Arbiter{Policy: "cost-model", DeadlineFactor: 4, DeadlineMarginMS: 50},
		Store: Store{Kind: "none", Replicas: 1, Metadata: storeMetadataP2P, Protocol: "tcp", LocalHostname: "127.0.0.1",
			OpTimeoutMS: 5000, SetupTimeoutMS: 30000, AuditIntervalMS: 5000},
		TransferTimeoutMS: 5000,
		PeerDownMS:        30000,
		KVEvents: KVEvents{Topic: "kv@{instance}@{model}", BufferSteps: 10000, HWM: 100000, MaxQueueSize: 100000,
			Encoding: "array", Medium: "CPU", HashSeed: 1337},
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
	if t := bytes.TrimSpace(doc); t[0] != '{' {
		return c, status.Errorf(status.Config, "parsing config: a JSON object is expected, not %q...", t[:min(len(t), 16)])
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
// variable: inline JSON when it starts with '{' or '[' (an array is JSON,
// and refused as such, never a file name), else a file path.
func Load(doc string) (Config, error) {
	from := "config"
	if strings.TrimSpace(doc) == "" {
		doc, from = os.Getenv("MCB_CONFIG"), "MCB_CONFIG"
	}
	doc = strings.TrimSpace(doc)
	if doc != "" && doc[0] != '{' && doc[0] != '[' {
		b, err := os.ReadFile(doc)
		if err != nil {
			return Default(), status.Wrap(status.Config, err, from+" is neither inline JSON (starting with '{') nor a readable file")
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
	case c.SnapshotBlocks <= 0 || c.SnapshotBlocks > 1<<16:
		return status.Errorf(status.Config, "snapshot_blocks %d: 1..65536", c.SnapshotBlocks)
	case c.ProxySnapshots != "ends" && c.ProxySnapshots != "every":
		return status.Errorf(status.Config, "proxy_snapshots %q: ends or every", c.ProxySnapshots)
	case c.Eviction != "lru" && c.Eviction != "cost" && c.Eviction != "frequency":
		return status.Errorf(status.Config, "eviction %q: lru, cost or frequency", c.Eviction)
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
	case c.PeerDownMS < 0:
		return status.Errorf(status.Config, "peer_down_ms must not be negative")
	case !(c.Arbiter.DeadlineFactor >= 1) || math.IsInf(c.Arbiter.DeadlineFactor, 0):
		return status.Errorf(status.Config, "arbiter.deadline_factor %v: finite and >= 1", c.Arbiter.DeadlineFactor)
	case c.Arbiter.DeadlineMarginMS < 0:
		return status.Errorf(status.Config, "arbiter.deadline_margin_ms must not be negative")
	}
	if _, err := arbiter.ParsePolicy(c.Arbiter.Policy); err != nil {
		return status.Wrap(status.Config, err, "arbiter.policy")
	}
	if c.Directory.Kind == "etcd" {
		for _, ep := range c.Directory.Endpoints {
			if err := checkEndpoint(ep); err != nil {
				return status.Errorf(status.Config, "directory.endpoints: %q: %v", ep, err)
			}
		}
	}
	if c.MetricsListen != "" {
		if err := hostPort(c.MetricsListen, false); err != nil {
			return status.Errorf(status.Config, "metrics_listen %q: %v", c.MetricsListen, err)
		}
	}
	if err := c.KVEvents.Validate(); err != nil {
		return err
	}
	if c.SharedPool.Enabled {
		if c.SharedPool.Dir != "" && !filepath.IsAbs(c.SharedPool.Dir) {
			return status.Errorf(status.Config, "shared_pool.dir %q: an absolute path", c.SharedPool.Dir)
		}
		if _, err := c.SharedPool.GID(); err != nil {
			return err
		}
	}
	return c.Store.validate()
}

// Enabled reports whether the publisher runs.
func (k *KVEvents) Enabled() bool {
	if k.Publisher == "null" || (k.EnableKVCacheEvents != nil && !*k.EnableKVCacheEvents) {
		return false
	}
	return k.Endpoint != "" || k.EnableKVCacheEvents != nil
}

// Validate checks the publisher's settings; when it is off they need
// nothing else.
func (k *KVEvents) Validate() error {
	switch {
	case k.Publisher != "" && k.Publisher != "zmq" && k.Publisher != "null":
		return status.Errorf(status.Config, "kv_events.publisher %q: zmq or null", k.Publisher)
	case !k.Enabled():
		return nil
	case k.Endpoint == "":
		return status.Errorf(status.Config, "kv_events.enable_kv_cache_events without kv_events.endpoint")
	}
	if err := checkZMQEndpoint("kv_events.endpoint", k.Endpoint); err != nil {
		return err
	}
	switch {
	case k.ReplayEndpoint != "" && checkZMQEndpoint("kv_events.replay_endpoint", k.ReplayEndpoint) != nil:
		return checkZMQEndpoint("kv_events.replay_endpoint", k.ReplayEndpoint)
	case k.ReplayEndpoint != "" && k.ReplayEndpoint == k.Endpoint && !strings.HasSuffix(k.Endpoint, ":*"):
		return status.Errorf(status.Config, "kv_events.replay_endpoint %q is the PUB endpoint too", k.ReplayEndpoint)
	case k.BufferSteps <= 0 || k.HWM <= 0 || k.MaxQueueSize <= 0:
		return status.Errorf(status.Config, "kv_events buffer_steps, hwm and max_queue_size must be positive")
	case k.HeartbeatMS < 0:
		return status.Errorf(status.Config, "kv_events.heartbeat_ms must not be negative")
	case k.Encoding != "array" && k.Encoding != "map":
		return status.Errorf(status.Config, "kv_events.encoding %q: array or map", k.Encoding)
	case k.Medium == "":
		return status.Errorf(status.Config, "kv_events.medium must not be empty")
	case strings.ContainsAny(k.Instance, "@") || strings.ContainsAny(k.Model, "@"):
		// Consumers split the topic kv@<instance>@<model> on '@'.
		return status.Errorf(status.Config, "kv_events instance %q and model %q must not contain '@'", k.Instance, k.Model)
	}
	return nil
}

// checkEndpoint accepts what the etcd client can dial: a URL of scheme
// http, https, unix or unixs, or host:port. Anything else would be taken,
// and every directory call would then wait out its deadline and fail.
func checkEndpoint(ep string) error {
	scheme, rest, ok := strings.Cut(ep, "://")
	if !ok {
		return hostPort(ep, true)
	}
	switch scheme {
	case "unix", "unixs":
		if rest == "" {
			return fmt.Errorf("a unix endpoint needs a socket path")
		}
		return nil
	case "http", "https":
	default:
		return fmt.Errorf("scheme %q: http, https, unix or unixs", scheme)
	}
	u, err := url.Parse(ep)
	if err != nil {
		return err
	}
	if u.Path != "" && u.Path != "/" || u.RawQuery != "" || u.User != nil {
		return fmt.Errorf("an endpoint is scheme://host:port, nothing more")
	}
	return hostPort(u.Host, true)
}

// hostPort checks host:port with a port in 1..65535 and, when needHost,
// a host (an address to listen on may leave it empty: every interface).
func hostPort(s string, needHost bool) error {
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		return fmt.Errorf("want host:port: %v", err)
	}
	if needHost && host == "" {
		return fmt.Errorf("want host:port: no host")
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return fmt.Errorf("port %q: 1..65535", port)
	}
	return nil
}

// checkZMQEndpoint accepts the ZMQ endpoints the publisher can open:
// tcp://host:port (port * binds a free one) and ipc://path.
func checkZMQEndpoint(name, ep string) error {
	scheme, addr, ok := strings.Cut(ep, "://")
	switch {
	case !ok || addr == "":
		return status.Errorf(status.Config, "%s %q: not scheme://address", name, ep)
	case scheme == "ipc":
		return nil
	case scheme != "tcp":
		return status.Errorf(status.Config, "%s %q: tcp:// or ipc://", name, ep)
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return status.Wrap(status.Config, err, name)
	}
	if n, err := strconv.Atoi(port); port != "*" && (err != nil || n <= 0 || n > 65535) {
		return status.Errorf(status.Config, "%s %q: port 1..65535, or * for any free one", name, ep)
	}
	if host == "" {
		return status.Errorf(status.Config, "%s %q: no host (\"*\" binds every interface)", name, ep)
	}
	return nil
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
