package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

const sampleE2E = `{
  "date": "2026-11-29T19:11:51Z",
  "cpus": 2,
  "ttft": [
    {"shared_tokens": 1024, "ratio": 59.31554171576053, "agent": {"ttft_ms": 9009.503}, "identical": true},
    {"shared_tokens": 4096, "ratio": 59.4, "extra": null}
  ],
  "target": {"shared_tokens": 8192, "ratio_at_least": 10},
  "target_met": true,
  "slot_met": "yes"
}`

func TestE2ETables(t *testing.T) {
	v, err := decodeOrdered([]byte(sampleE2E))
	require.NoError(t, err)
	got := e2eTables(v)
	want := []e2eTable{
		{head: []string{"", ""}, rows: [][]string{{"date", "2026-11-29T19:11:51Z"}, {"cpus", "2"}, {"target_met", "true"}, {"slot_met", "yes"}}},
		{title: "ttft", head: []string{"shared_tokens", "ratio", "agent.ttft_ms", "identical", "extra"},
			rows: [][]string{{"1024", "59.32", "9009.5", "true", ""}, {"4096", "59.40", "", "", "null"}}},
		{title: "target", head: []string{"", ""}, rows: [][]string{{"shared_tokens", "8192"}, {"ratio_at_least", "10"}}},
	}
	require.Equal(t, want, got)
	targets := e2eTargets(v)
	require.Len(t, targets, 1, "targets")
	require.Equal(t, "end-to-end: target", targets[0][0], "targets %q", targets)
	require.Equal(t, "{shared_tokens: 8192, ratio_at_least: 10}", targets[0][1], "targets %q", targets)
	require.Equal(t, met, targets[0][3], "targets %q", targets)
}

func TestReadE2E(t *testing.T) {
	dir := t.TempDir()
	d, err := readE2E(filepath.Join(dir, "absent.json"))
	require.NoError(t, err, "absent file")
	require.Nil(t, d, "absent file: %s", d)
	for _, tc := range []struct {
		name, doc string
		ok        bool
	}{
		{"sample", sampleE2E, true},
		{"empty object", `{}`, true},
		{"array", `[1, 2]`, false},
		{"trailing data", `{} {}`, false},
		{"truncated", `{"a": [1, 2`, false},
		{"not JSON", `summary: s`, false},
		{"too deep", strings.Repeat("[", 100) + strings.Repeat("]", 100), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(dir, tc.name+".json")
			require.NoError(t, os.WriteFile(p, []byte(tc.doc), 0o644))
			d, err := readE2E(p)
			if tc.ok {
				require.NoError(t, err, "readE2E")
				require.NotNil(t, d, "readE2E")
			} else {
				require.Error(t, err, "readE2E = %s", d)
			}
		})
	}
}

func FuzzDecodeOrdered(f *testing.F) {
	f.Add([]byte(sampleE2E))
	f.Add([]byte(`{"a":{"b":[{"c":1e400}]},"d_met":false}`))
	f.Add([]byte(`[[[]]]`))
	f.Fuzz(func(t *testing.T, b []byte) {
		v, err := decodeOrdered(b)
		if err != nil || v.kind != 'o' {
			return
		}
		for _, tb := range e2eTables(v) {
			for _, r := range tb.rows {
				require.Len(t, r, len(tb.head), "ragged table %+v", tb)
			}
		}
		_ = e2eTargets(v)
	})
}
