package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func writeTrace(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "trace.jsonl")
	lines := []string{
		`{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}`,
		`{"timestamp": 10, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}`,
		`{"timestamp": 20, "input_length": 600, "output_length": 5, "hash_ids": [0, 3]}`,
	}
	if err := os.WriteFile(p, []byte(strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestReplayJSON(t *testing.T) {
	var out bytes.Buffer
	if err := runReplay([]string{"--json", "--servers", "2", "--preset", "llama3-8b-gpu", writeTrace(t)}, &out); err != nil {
		t.Fatal(err)
	}
	var res struct {
		Requests            int                           `json:"requests"`
		IdealPrefixHitRatio float64                       `json:"ideal_prefix_hit_ratio"`
		PrefixHitRatio      float64                       `json:"prefix_hit_ratio"`
		RestoredTokens      int64                         `json:"restored_tokens"`
		RecomputedTokens    int64                         `json:"recomputed_tokens"`
		TTFT                map[string]map[string]float64 `json:"ttft_ms"`
	}
	if err := json.Unmarshal(out.Bytes(), &res); err != nil {
		t.Fatalf("%v in %s", err, out.String())
	}
	// The second request reuses two full blocks (1024 tokens), the third
	// one (512): ideal 1100+512 of 2800 tokens, the bridge 1024+512.
	if res.Requests != 3 || res.PrefixHitRatio != 1536.0/2800 || res.IdealPrefixHitRatio != 1612.0/2800 {
		t.Fatalf("result %+v", res)
	}
	if res.RestoredTokens+res.RecomputedTokens != 2800 {
		t.Fatalf("restored %d + recomputed %d tokens", res.RestoredTokens, res.RecomputedTokens)
	}
	for _, k := range []string{"arbiter", "restore", "recompute"} {
		if res.TTFT[k]["p50"] <= 0 || res.TTFT[k]["p90"] < res.TTFT[k]["p50"] {
			t.Fatalf("ttft %s: %v", k, res.TTFT[k])
		}
	}
}

func TestReplayText(t *testing.T) {
	var out bytes.Buffer
	if err := runReplay([]string{"--policy", "always-restore", "--pool-bytes", "64G", writeTrace(t)}, &out); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "always-restore") || strings.Contains(out.String(), "cost-model") {
		t.Fatalf("output:\n%s", out.String())
	}
}

func TestReplayRejects(t *testing.T) {
	trace := writeTrace(t)
	for _, args := range [][]string{
		{},
		{trace, trace},
		{"--policy", "sometimes", trace},
		{"--preset", "gpt", trace},
		{"--pool-bytes", "lots", trace},
		{"--eviction", "fifo", trace},
		{"--link-gbps", "0", trace},
		{"--latency-us", "-1", trace},
		{filepath.Join(t.TempDir(), "absent.jsonl")},
	} {
		if err := runReplay(args, &bytes.Buffer{}); err == nil {
			t.Errorf("runReplay(%q) succeeded", args)
		}
	}
}
