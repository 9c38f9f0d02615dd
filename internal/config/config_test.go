package config

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/mcbridge/mcbridge/internal/status"
)

func TestParseEmptyGivesDefaults(t *testing.T) {
	for _, doc := range []string{"", "  \n\t", "{}", " { } "} {
		c, err := Parse([]byte(doc))
		if err != nil {
			t.Fatalf("%q: %v", doc, err)
		}
		if !reflect.DeepEqual(c, Default()) {
			t.Fatalf("%q: %+v, want the defaults", doc, c)
		}
	}
	d := Default()
	if err := d.Validate(); err != nil {
		t.Fatalf("the defaults do not validate: %v", err)
	}
}

func TestParseOverridesOnlyGivenFields(t *testing.T) {
	c, err := Parse([]byte(`{"pool_bytes": 4194304, "transport": {"kind": "mooncake", "lib": "/opt/te.so"},
		"directory": {"kind": "etcd", "endpoints": ["127.0.0.1:2379"]}, "arbiter": {"policy": "always-restore"}}`))
	if err != nil {
		t.Fatal(err)
	}
	want := Default()
	want.PoolBytes = 4 << 20
	want.Transport.Kind, want.Transport.Lib = "mooncake", "/opt/te.so"
	want.Directory.Kind, want.Directory.Endpoints = "etcd", []string{"127.0.0.1:2379"}
	want.Arbiter.Policy = "always-restore"
	if !reflect.DeepEqual(c, want) {
		t.Fatalf("got %+v\nwant %+v", c, want)
	}
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
		if status.Of(err) != status.Config || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("%s: %v, want Config mentioning %q", tc.name, err, tc.msg)
		}
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
	} {
		c := Default()
		tc.mutate(&c)
		err := c.Validate()
		if status.Of(err) != status.Config || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("%s: %v, want Config mentioning %q", tc.name, err, tc.msg)
		}
		// Parse reports the same error for the same document.
		doc, _ := json.Marshal(c)
		if _, err := Parse(doc); status.Of(err) != status.Config || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("%s: Parse gives %v", tc.name, err)
		}
	}
	for _, ok := range []func(c *Config){
		func(c *Config) { c.PoolBytes = 1 << 20 },
		func(c *Config) { c.BlockTokens = 1 << 16 },
		func(c *Config) { c.Eviction = "cost" },
		func(c *Config) { c.Directory.Kind, c.Directory.Endpoints = "etcd", []string{"h:2379"} },
		func(c *Config) { c.Arbiter.Policy = "always-recompute" },
	} {
		c := Default()
		ok(&c)
		if err := c.Validate(); err != nil {
			t.Errorf("%+v: %v", c, err)
		}
	}
}

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "mcb.json")
	if err := os.WriteFile(path, []byte(`{"owner": "from-file", "block_tokens": 64}`), 0o600); err != nil {
		t.Fatal(err)
	}

	t.Setenv("MCB_CONFIG", "")
	if c, err := Load(""); err != nil || !reflect.DeepEqual(c, Default()) {
		t.Fatalf("no config anywhere: %+v, %v", c, err)
	}

	t.Setenv("MCB_CONFIG", ` {"owner": "from-env"} `)
	if c, err := Load(""); err != nil || c.Owner != "from-env" {
		t.Fatalf("inline MCB_CONFIG: %+v, %v", c, err)
	}
	if c, err := Load(`{"owner": "from-arg"}`); err != nil || c.Owner != "from-arg" {
		t.Fatalf("an argument must win over MCB_CONFIG: %+v, %v", c, err)
	}

	t.Setenv("MCB_CONFIG", path+"\n")
	if c, err := Load("  "); err != nil || c.Owner != "from-file" || c.BlockTokens != 64 {
		t.Fatalf("MCB_CONFIG file: %+v, %v", c, err)
	}
	if c, err := Load(path); err != nil || c.Owner != "from-file" {
		t.Fatalf("file argument: %+v, %v", c, err)
	}

	if _, err := Load(filepath.Join(dir, "missing.json")); status.Of(err) != status.Config {
		t.Fatalf("missing file: %v", err)
	}
	bad := filepath.Join(dir, "bad.json")
	if err := os.WriteFile(bad, []byte(`{"eviction": "never"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(bad); status.Of(err) != status.Config || !strings.Contains(err.Error(), "eviction") {
		t.Fatalf("invalid file: %v", err)
	}
}

// FuzzParse: any document either fails with status.Config or yields a
// configuration that validates and survives a JSON round trip unchanged.
func FuzzParse(f *testing.F) {
	for _, seed := range []string{
		"", "{}", "null", "[]", `{"pool_bytes": 2097152}`, `{"pool_bytes": 1}`, `{"x": 1}`, `{} {}`, `{}}`,
		`{"transport": {"kind": "mooncake", "metadata": "etcd://h:2379", "bandwidth_gbps": 12.5, "latency_us": 3}}`,
		`{"directory": {"kind": "etcd", "endpoints": ["a:1", "b:2"], "lease_ttl_s": 5}}`,
		`{"arbiter": {"policy": "always-restore"}, "eviction": "cost", "block_tokens": 16}`,
		`{"POOL_BYTES": 2097152}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, doc []byte) {
		c, err := Parse(doc)
		if err != nil {
			if status.Of(err) != status.Config {
				t.Fatalf("Parse(%q) = %v, want status.Config", doc, err)
			}
			return
		}
		if err := c.Validate(); err != nil {
			t.Fatalf("Parse(%q) accepted a config that does not validate: %v", doc, err)
		}
		again, err := json.Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		c2, err := Parse(again)
		if err != nil || !reflect.DeepEqual(c, c2) {
			t.Fatalf("round trip of %q: %+v, %v; want %+v", doc, c2, err, c)
		}
	})
}
