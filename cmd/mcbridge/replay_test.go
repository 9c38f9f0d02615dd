package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func writeTrace(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "trace.jsonl")
	lines := []string{
		`{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}`,
		`{"timestamp": 10, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}`,
		`{"timestamp": 20, "input_length": 600, "output_length": 5, "hash_ids": [0, 3]}`,
	}
	require.NoError(t, os.WriteFile(p, []byte(strings.Join(lines, "\n")+"\n"), 0o644))
	return p
}

func TestReplayJSON(t *testing.T) {
	var out bytes.Buffer
	require.NoError(t, runReplay([]string{"--json", "--servers", "2", "--preset", "llama3-8b-gpu", writeTrace(t)}, &out))
	var res struct {
		Requests            int                           `json:"requests"`
		IdealPrefixHitRatio float64                       `json:"ideal_prefix_hit_ratio"`
		PrefixHitRatio      float64                       `json:"prefix_hit_ratio"`
		RestoredTokens      int64                         `json:"restored_tokens"`
		RecomputedTokens    int64                         `json:"recomputed_tokens"`
		TTFT                map[string]map[string]float64 `json:"ttft_ms"`
	}
	require.NoError(t, json.Unmarshal(out.Bytes(), &res), "in %s", out.String())
	// The second request reuses two full blocks (1024 tokens), the third
	// one (512): ideal 1100+512 of 2800 tokens, the bridge 1024+512.
	require.Equal(t, 3, res.Requests, "result %+v", res)
	require.Equal(t, 1536.0/2800, res.PrefixHitRatio, "result %+v", res)
	require.Equal(t, 1612.0/2800, res.IdealPrefixHitRatio, "result %+v", res)
	require.Equal(t, int64(2800), res.RestoredTokens+res.RecomputedTokens, "restored %d + recomputed %d tokens", res.RestoredTokens, res.RecomputedTokens)
	for _, k := range []string{"arbiter", "restore", "recompute"} {
		require.Positive(t, res.TTFT[k]["p50"], "ttft %s: %v", k, res.TTFT[k])
		require.GreaterOrEqual(t, res.TTFT[k]["p90"], res.TTFT[k]["p50"], "ttft %s: %v", k, res.TTFT[k])
	}
}

func TestReplayText(t *testing.T) {
	var out bytes.Buffer
	require.NoError(t, runReplay([]string{"--policy", "always-restore", "--pool-bytes", "64G", writeTrace(t)}, &out))
	require.Contains(t, out.String(), "always-restore", "output")
	require.NotContains(t, out.String(), "cost-model", "output")
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
		assert.Error(t, runReplay(args, &bytes.Buffer{}), "runReplay(%q) succeeded", args)
	}
}
