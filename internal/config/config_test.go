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
		{"not an object", `[1]`, "parsing"},
		{"wrong type", `{"pool_bytes": "big"}`, "parsing"},
		{"truncated", `{"pool_bytes": 1`, "parsing"},
		{"too large", `{"owner": "` + strings.Repeat("a", MaxSize) + `"}`, "max"},
	} {
		_, err := Parse([]byte(tc.doc))
		assert.Equal(t, status.Config, status.Of(err), "%s: %v", tc.name, err)
		assert.ErrorContains(t, err, tc.msg, tc.name)
	}
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
		{"transport kind", func(c *Config) { c.Transport.Kind = "rdma" }, "transport.kind"},
		{"negative bandwidth", func(c *Config) { c.Transport.BandwidthGBps = -1 }, "shaping"},
		{"negative latency", func(c *Config) { c.Transport.LatencyUS = -0.5 }, "shaping"},
		{"directory kind", func(c *Config) { c.Directory.Kind = "redis" }, "directory.kind"},
		{"etcd without endpoints", func(c *Config) { c.Directory.Kind = "etcd" }, "endpoints"},
		{"lease", func(c *Config) { c.Directory.LeaseTTLS = 0 }, "lease_ttl_s"},
		{"op timeout", func(c *Config) { c.Directory.OpTimeoutMS = -1 }, "op_timeout_ms"},
		{"transfer timeout", func(c *Config) { c.TransferTimeoutMS = 0 }, "transfer_timeout_ms"},
		{"arbiter policy", func(c *Config) { c.Arbiter.Policy = "sometimes" }, "arbiter.policy"},
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
