package config

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/status"
)

func TestParseEmptyGivesDefaults(t *testing.T) {
	for _, doc := range []string{"", "  \n\t", "{}", " { } "} {
		c, err := Parse([]byte(doc))
		require.NoError(t, err, "%q", doc)
		require.Equal(t, Default(), c, "%q must give the defaults", doc)
	}
	d := Default()
	require.NoError(t, d.Validate(), "the defaults do not validate")
}

func TestParseOverridesOnlyGivenFields(t *testing.T) {
	c, err := Parse([]byte(`{"pool_bytes": 4194304, "transport": {"kind": "mooncake", "lib": "/opt/te.so"},
		"directory": {"kind": "etcd", "endpoints": ["127.0.0.1:2379"]}, "arbiter": {"policy": "always-restore"}}`))
	require.NoError(t, err)
	want := Default()
	want.PoolBytes = 4 << 20
	want.Transport.Kind, want.Transport.Lib = "mooncake", "/opt/te.so"
	want.Directory.Kind, want.Directory.Endpoints = "etcd", []string{"127.0.0.1:2379"}
	want.Arbiter.Policy = "always-restore"
	require.Equal(t, want, c)
}

func TestParseRejects(t *testing.T) {
	for _, tc := range []struct {
		name, doc, msg string
	}{
		{"unknown field", `{"pool_byte": 4194304}`, "unknown field"},
		{"unknown nested field", `{"transport": {"kind": "loopback", "bandwidth": 1}}`, "unknown field"},
		{"trailing object", `{} {}`, "trailing"},
		{"trailing garbage", `{"eviction": "lru"} x`, "trailing"},
		{"trailing brace", `{"eviction": "lru"}}`, "trailing"},
		{"trailing bracket", `{"eviction": "lru"}]`, "trailing"},
		{"not an object", `[1]`, "a JSON object is expected"},
		{"a string", `"x"`, "a JSON object is expected"},
		{"wrong type", `{"pool_bytes": "big"}`, "parsing"},
		{"truncated", `{"pool_bytes": 1`, "parsing"},
		{"too large", `{"owner": "` + strings.Repeat("a", MaxSize) + `"}`, "max"},
	} {
		_, err := Parse([]byte(tc.doc))
		assert.Equal(t, status.Config, status.Of(err), "%s: %v", tc.name, err)
		assert.ErrorContains(t, err, tc.msg, tc.name)
	}
}

func etcdAt(eps ...string) func(c *Config) {
	return func(c *Config) {
		c.Directory.Kind = "etcd"
		c.Directory.Endpoints = eps
	}
}

// Endpoints the etcd client dials are accepted, in every form it takes.
func TestValidEndpoints(t *testing.T) {
	for _, ep := range []string{"127.0.0.1:2379", "localhost:2379", "[::1]:2379", "http://127.0.0.1:2379",
		"https://etcd.example:2379/", "unix:///run/etcd.sock", "unixs://etcd.sock"} {
		c := Default()
		etcdAt(ep)(&c)
		assert.NoError(t, c.Validate(), ep)
	}
	c := Default()
	c.MetricsListen = ":9465"
	assert.NoError(t, c.Validate(), "a metrics address without a host listens everywhere")
}

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mutate func(c *Config)
		msg    string
	}{
		{"small pool", func(c *Config) { c.PoolBytes = 1<<20 - 1 }, "pool_bytes"},
		{"no block tokens", func(c *Config) { c.BlockTokens = 0 }, "block_tokens"},
		{"huge blocks", func(c *Config) { c.BlockTokens = 1<<16 + 1 }, "block_tokens"},
		{"eviction", func(c *Config) { c.Eviction = "fifo" }, "eviction"},
		{"proxy snapshots", func(c *Config) { c.ProxySnapshots = "branches" }, "proxy_snapshots"},
		{"transport kind", func(c *Config) { c.Transport.Kind = "rdma" }, "transport.kind"},
		{"negative bandwidth", func(c *Config) { c.Transport.BandwidthGBps = -1 }, "shaping"},
		{"negative latency", func(c *Config) { c.Transport.LatencyUS = -0.5 }, "shaping"},
		{"directory kind", func(c *Config) { c.Directory.Kind = "redis" }, "directory.kind"},
		{"etcd without endpoints", func(c *Config) { c.Directory.Kind = "etcd" }, "endpoints"},
		{"lease", func(c *Config) { c.Directory.LeaseTTLS = 0 }, "lease_ttl_s"},
		{"op timeout", func(c *Config) { c.Directory.OpTimeoutMS = -1 }, "op_timeout_ms"},
		{"transfer timeout", func(c *Config) { c.TransferTimeoutMS = 0 }, "transfer_timeout_ms"},
		{"arbiter policy", func(c *Config) { c.Arbiter.Policy = "sometimes" }, "arbiter.policy"},
		{"deadline factor below 1", func(c *Config) { c.Arbiter.DeadlineFactor = 0.5 }, "arbiter.deadline_factor"},
		{"no deadline factor", func(c *Config) { c.Arbiter.DeadlineFactor = 0 }, "arbiter.deadline_factor"},
		{"negative deadline margin", func(c *Config) { c.Arbiter.DeadlineMarginMS = -1 }, "arbiter.deadline_margin_ms"},
		{"etcd endpoint of colons", etcdAt("::::"), "directory.endpoints"},
		{"etcd endpoint without a port", etcdAt("127.0.0.1"), "host:port"},
		{"etcd endpoint with a bad port", etcdAt("127.0.0.1:99999"), "1..65535"},
		{"etcd endpoint without a host", etcdAt(":2379"), "no host"},
		{"etcd endpoint of another scheme", etcdAt("ftp://127.0.0.1:2379"), "scheme"},
		{"etcd endpoint with a path", etcdAt("http://127.0.0.1:2379/v3"), "nothing more"},
		{"etcd URL without a port", etcdAt("http://127.0.0.1"), "host:port"},
		{"one bad endpoint of two", etcdAt("127.0.0.1:2379", "x"), `"x"`},
		{"metrics address", func(c *Config) { c.MetricsListen = "127.0.0.1" }, "metrics_listen"},
		{"metrics port", func(c *Config) { c.MetricsListen = "127.0.0.1:0" }, "metrics_listen"},
		{"enabled without an endpoint", func(c *Config) { c.KVEvents.EnableKVCacheEvents = new(true) }, "kv_events.endpoint"},
		{"publisher", func(c *Config) { c.KVEvents.Publisher = "redis" }, "kv_events.publisher"},
		{"events scheme", func(c *Config) { c.KVEvents.Endpoint = "udp://*:5557" }, "tcp:// or ipc://"},
		{"events address", func(c *Config) { c.KVEvents.Endpoint = "tcp://5557" }, "kv_events.endpoint"},
		{"events no host", func(c *Config) { c.KVEvents.Endpoint = "tcp://:5557" }, "no host"},
		{"events port", func(c *Config) { c.KVEvents.Endpoint = "tcp://*:70000" }, "port"},
		{"events no address", func(c *Config) { c.KVEvents.Endpoint = "tcp://" }, "scheme://address"},
		{"replay port", func(c *Config) { c.KVEvents.Endpoint, c.KVEvents.ReplayEndpoint = "tcp://*:5557", "tcp://*:x" }, "kv_events.replay_endpoint"},
		{"replay on the PUB socket", func(c *Config) { c.KVEvents.Endpoint, c.KVEvents.ReplayEndpoint = "tcp://*:5557", "tcp://*:5557" }, "PUB endpoint"},
		{"events buffer", func(c *Config) { c.KVEvents.Endpoint, c.KVEvents.BufferSteps = "tcp://*:5557", 0 }, "buffer_steps"},
		{"events queue", func(c *Config) { c.KVEvents.Endpoint, c.KVEvents.MaxQueueSize = "tcp://*:5557", -1 }, "max_queue_size"},
		{"events heartbeat", func(c *Config) { c.KVEvents.Endpoint, c.KVEvents.HeartbeatMS = "tcp://*:5557", -1 }, "heartbeat_ms"},
		{"events encoding", func(c *Config) { c.KVEvents.Endpoint, c.KVEvents.Encoding = "tcp://*:5557", "json" }, "kv_events.encoding"},
		{"events medium", func(c *Config) { c.KVEvents.Endpoint, c.KVEvents.Medium = "tcp://*:5557", "" }, "kv_events.medium"},
		{"events instance", func(c *Config) { c.KVEvents.Endpoint, c.KVEvents.Instance = "tcp://*:5557", "a@b" }, "'@'"},
		{"events model", func(c *Config) { c.KVEvents.Endpoint, c.KVEvents.Model = "tcp://*:5557", "m@2" }, "'@'"},
		{"store kind", func(c *Config) { c.Store.Kind = "redis" }, "store.kind"},
		{"store without master", func(c *Config) { c.Store.Kind = "mooncake" }, "store.master"},
		{"store master without port", func(c *Config) { mooncake(c); c.Store.Master = "127.0.0.1" }, "store.master"},
		{"store master port 0", func(c *Config) { mooncake(c); c.Store.Master = "127.0.0.1:0" }, "store.master"},
		{"no replicas", func(c *Config) { mooncake(c); c.Store.Replicas = 0 }, "store.replicas"},
		{"too many replicas", func(c *Config) { mooncake(c); c.Store.Replicas = MaxStoreReplicas + 1 }, "store.replicas"},
		{"small segment", func(c *Config) { mooncake(c); c.Store.SegmentBytes = 1 << 20 }, "store.segment_bytes"},
		{"negative segment", func(c *Config) { mooncake(c); c.Store.SegmentBytes = -1 }, "store.segment_bytes"},
		{"store metadata", func(c *Config) { mooncake(c); c.Store.Metadata = "etcd://h:2379" }, "store.metadata"},
		{"store protocol", func(c *Config) { mooncake(c); c.Store.Protocol = "udp" }, "store.protocol"},
		{"store hostname", func(c *Config) { mooncake(c); c.Store.LocalHostname = "" }, "store.local_hostname"},
		{"store op timeout", func(c *Config) { mooncake(c); c.Store.OpTimeoutMS = 0 }, "store.op_timeout_ms"},
		{"store audit", func(c *Config) { mooncake(c); c.Store.AuditIntervalMS = -1 }, "store.audit_interval_ms"},
		{"store setup timeout", func(c *Config) { mooncake(c); c.Store.SetupTimeoutMS = 0 }, "store.setup_timeout_ms"},
	} {
		c := Default()
		tc.mutate(&c)
		err := c.Validate()
		assert.Equal(t, status.Config, status.Of(err), "%s: %v", tc.name, err)
		assert.ErrorContains(t, err, tc.msg, tc.name)
		// Parse reports the same error for the same document.
		doc, _ := json.Marshal(c)
		_, err = Parse(doc)
		assert.Equal(t, status.Config, status.Of(err), "%s: Parse gives %v", tc.name, err)
		assert.ErrorContains(t, err, tc.msg, "%s: Parse", tc.name)
	}
	for _, ok := range []func(c *Config){
		func(c *Config) { c.PoolBytes = 1 << 20 },
		func(c *Config) { c.BlockTokens = 1 << 16 },
		func(c *Config) { c.Eviction = "cost" },
		func(c *Config) { c.Directory.Kind, c.Directory.Endpoints = "etcd", []string{"h:2379"} },
		func(c *Config) { c.Arbiter.Policy = "always-recompute" },
		func(c *Config) { c.Arbiter.DeadlineFactor, c.Arbiter.DeadlineMarginMS = 1, 0 },
		func(c *Config) { c.KVEvents.Endpoint, c.KVEvents.ReplayEndpoint = "tcp://*:5557", "tcp://*:5558" },
		func(c *Config) {
			c.KVEvents.Endpoint, c.KVEvents.ReplayEndpoint = "tcp://127.0.0.1:*", "tcp://127.0.0.1:*"
		},
		func(c *Config) { c.KVEvents.Endpoint = "tcp://indexer.example:5557" },
		func(c *Config) { c.KVEvents.Endpoint, c.KVEvents.Encoding = "ipc:///run/kv.sock", "map" },
		func(c *Config) { c.KVEvents.Endpoint, c.KVEvents.EnableKVCacheEvents = "bad", new(false) },
		func(c *Config) { c.KVEvents.Endpoint, c.KVEvents.Publisher = "bad", "null" },
		mooncake,
		func(c *Config) {
			mooncake(c)
			c.Store.Replicas, c.Store.SegmentBytes = MaxStoreReplicas, MinStoreSegmentBytes
		},
		func(c *Config) {
			mooncake(c)
			c.Store.Metadata, c.Store.Protocol = "http://127.0.0.1:8080/metadata", "rdma"
		},
	} {
		c := Default()
		ok(&c)
		assert.NoError(t, c.Validate(), "%+v", c)
	}
}

// vLLM's --kv-events-config reads as it is.
func TestKVEventsReadsVLLMsConfig(t *testing.T) {
	c, err := Parse([]byte(`{"kv_events": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
		"replay_endpoint": "tcp://*:5558", "buffer_steps": 100, "hwm": 1000, "max_queue_size": 1000, "topic": "kv-events"}}`))
	require.NoError(t, err)
	require.True(t, c.KVEvents.Enabled())
	require.Equal(t, "kv-events", c.KVEvents.Topic)
	for doc, on := range map[string]bool{
		`{}`: false, `{"kv_events": {"endpoint": "tcp://*:5557"}}`: true,
		`{"kv_events": {"endpoint": "tcp://*:5557", "enable_kv_cache_events": false}}`: false,
		`{"kv_events": {"endpoint": "tcp://*:5557", "publisher": "null"}}`:             false,
	} {
		c, err := Parse([]byte(doc))
		require.NoError(t, err, doc)
		require.Equal(t, on, c.KVEvents.Enabled(), doc)
	}
}

func mooncake(c *Config) { c.Store.Kind, c.Store.Master = "mooncake", "127.0.0.1:50051" }

func TestParseStore(t *testing.T) {
	c, err := Parse([]byte(`{"store": {"kind": "mooncake", "master": "10.0.0.1:50051", "lib": "/opt/libmooncake_store.so", "replicas": 2, "segment_bytes": 1073741824}}`))
	require.NoError(t, err)
	want := Default()
	want.Store.Kind, want.Store.Master, want.Store.Lib = "mooncake", "10.0.0.1:50051", "/opt/libmooncake_store.so"
	want.Store.Replicas, want.Store.SegmentBytes = 2, 1<<30
	require.Equal(t, want, c)
	_, err = Parse([]byte(`{"store": {"kind": "mooncake", "master": "h:1", "replica": 2}}`))
	require.ErrorContains(t, err, "unknown field")
}

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "mcb.json")
	require.NoError(t, os.WriteFile(path, []byte(`{"owner": "from-file", "block_tokens": 64}`), 0o600))

	t.Setenv("MCB_CONFIG", "")
	c, err := Load("")
	require.NoError(t, err, "no config anywhere")
	require.Equal(t, Default(), c, "no config anywhere")

	t.Setenv("MCB_CONFIG", ` {"owner": "from-env"} `)
	c, err = Load("")
	require.NoError(t, err, "inline MCB_CONFIG")
	require.Equal(t, "from-env", c.Owner, "inline MCB_CONFIG")
	c, err = Load(`{"owner": "from-arg"}`)
	require.NoError(t, err, "an argument must win over MCB_CONFIG")
	require.Equal(t, "from-arg", c.Owner, "an argument must win over MCB_CONFIG")

	t.Setenv("MCB_CONFIG", path+"\n")
	c, err = Load("  ")
	require.NoError(t, err, "MCB_CONFIG file")
	require.Equal(t, "from-file", c.Owner, "MCB_CONFIG file")
	require.Equal(t, 64, c.BlockTokens, "MCB_CONFIG file")
	c, err = Load(path)
	require.NoError(t, err, "file argument")
	require.Equal(t, "from-file", c.Owner, "file argument")

	_, err = Load(filepath.Join(dir, "missing.json"))
	require.Equal(t, status.Config, status.Of(err), "missing file: %v", err)
	bad := filepath.Join(dir, "bad.json")
	require.NoError(t, os.WriteFile(bad, []byte(`{"eviction": "never"}`), 0o600))
	_, err = Load(bad)
	require.Equal(t, status.Config, status.Of(err), "invalid file: %v", err)
	require.ErrorContains(t, err, "eviction", "invalid file")

	// A JSON array is JSON, refused as such: no file named "[...]" is read.
	t.Setenv("MCB_CONFIG", `["127.0.0.1:2379"]`)
	_, err = Load("")
	require.Equal(t, status.Config, status.Of(err), "array: %v", err)
	require.ErrorContains(t, err, "a JSON object is expected", "array")
	require.NotContains(t, err.Error(), "file", "array")
	t.Setenv("MCB_CONFIG", "no-such-config.json")
	_, err = Load("")
	require.ErrorContains(t, err, "MCB_CONFIG is neither inline JSON", "a missing file named by MCB_CONFIG")
}

// FuzzParse: any document either fails with status.Config or yields a
// configuration that validates and survives a JSON round trip unchanged.
func FuzzParse(f *testing.F) {
	for _, seed := range []string{
		"", "{}", "null", "[]", `{"pool_bytes": 2097152}`, `{"pool_bytes": 1}`, `{"x": 1}`, `{} {}`, `{}}`,
		`{"transport": {"kind": "mooncake", "metadata": "etcd://h:2379", "bandwidth_gbps": 12.5, "latency_us": 3}}`,
		`{"directory": {"kind": "etcd", "endpoints": ["a:1", "b:2"], "lease_ttl_s": 5}}`,
		`{"store": {"kind": "mooncake", "master": "127.0.0.1:50051", "replicas": 2, "segment_bytes": 16777216}}`,
		`{"arbiter": {"policy": "always-restore"}, "eviction": "cost", "block_tokens": 16}`,
		`{"POOL_BYTES": 2097152}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, doc []byte) {
		c, err := Parse(doc)
		if err != nil {
			require.Equal(t, status.Config, status.Of(err), "Parse(%q) = %v", doc, err)
			return
		}
		require.NoError(t, c.Validate(), "Parse(%q) accepted a config that does not validate", doc)
		again, err := json.Marshal(c)
		require.NoError(t, err)
		c2, err := Parse(again)
		require.NoError(t, err, "round trip of %q", doc)
		require.Equal(t, c, c2, "round trip of %q", doc)
	})
}

func TestParseSharedPool(t *testing.T) {
	c, err := Parse([]byte(`{"shared_pool": {"enabled": true, "dir": "/run/mcb", "group": "0"}}`))
	require.NoError(t, err)
	require.Equal(t, SharedPool{Enabled: true, Dir: "/run/mcb", Group: "0"}, c.SharedPool)
	gid, err := c.SharedPool.GID()
	require.NoError(t, err)
	require.Zero(t, gid)
	require.Equal(t, "/run/mcb", c.SharedPool.SocketDir())
	t.Setenv("XDG_RUNTIME_DIR", "/run/user/7")
	require.Equal(t, "/run/user/7/mcbridge", (&SharedPool{}).SocketDir())
	t.Setenv("XDG_RUNTIME_DIR", "")
	require.Contains(t, (&SharedPool{}).SocketDir(), "mcbridge-")
	gid, err = (&SharedPool{}).GID()
	require.NoError(t, err)
	require.Equal(t, -1, gid, "no group: only this user")
	for _, bad := range []string{`{"shared_pool": {"enabled": true, "dir": "rel"}}`, `{"shared_pool": {"enabled": true, "group": "no-such-group-here"}}`} {
		_, err = Parse([]byte(bad))
		require.Equal(t, status.Config, status.Of(err), bad)
	}
}
