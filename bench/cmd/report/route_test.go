package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/bench/route"
)

func TestRouteSection(t *testing.T) {
	dir := t.TempDir()
	rep := route.Report{Note: "measured on a loaded machine", Workload: route.DefaultWorkload, Upstreams: 3, Slots: 2, Model: "m",
		OutputsIdentical: true, Seconds: 200, Results: []route.Result{
			{Policy: "cache-aware", Requests: 15, PrefixHitRatio: 0.8, LocalHitRatio: 0.6, TTFT: route.Percentiles{Mean: 900, P50: 800, P90: 1500},
				RestoredBytes: 3 << 20, SavedBytes: 1 << 20, BytesMoved: 4 << 20, PerUpstream: []int{5, 5, 5}, Decisions: map[string]int64{"prefix": 9, "load": 3, "spread": 3}},
			{Policy: "round-robin", Requests: 15, PrefixHitRatio: 0.8, LocalHitRatio: 0.2, TTFT: route.Percentiles{Mean: 1200, P50: 1000, P90: 2500}},
		}}
	b, err := json.Marshal(rep)
	require.NoError(t, err)
	path := filepath.Join(dir, "route.json")
	require.NoError(t, os.WriteFile(path, b, 0o644))
	got, err := readRoute(path)
	require.NoError(t, err)
	r := &report{Route: got}
	var out bytes.Buffer
	r.writeRoute(&md{w: &out})
	text := out.String()
	assert.Contains(t, text, "| cache-aware | 15 | 0.800 | 0.600 | 900 | 800 | 1500 | 3.0 | 1.0 | 4.0 | 5 5 5 | load 3, prefix 9, spread 3 |")
	assert.Contains(t, text, "Measured on a loaded machine")
	assert.Contains(t, text, "every policy got the same greedy answers")
	assert.NotContains(t, text, "differ from")

	got.OutputsIdentical = false
	got.Differing = map[string][]string{"1:round-robin": {"agent 2 turn 1 (a restore in its history)", "agent 4 turn 0 (no restore in either history)"}}
	out.Reset()
	r.writeRoute(&md{w: &out})
	text = out.String()
	assert.Contains(t, text, "**the policies' greedy answers differed**")
	assert.Contains(t, text, "differ from cache-aware's for the same prompt (a request whose history already differed is not listed): 1:round-robin: agent 2 turn 1 (a restore in its history); agent 4 turn 0 (no restore in either history).")
	require.NoError(t, writeRoutePlot(dir, got))
	_, err = os.Stat(filepath.Join(dir, routePlot))
	assert.NoError(t, err)

	none, err := readRoute(filepath.Join(dir, "absent.json"))
	assert.NoError(t, err)
	assert.Nil(t, none)
	require.NoError(t, os.WriteFile(path, []byte(`{"results":[]}`), 0o644))
	_, err = readRoute(path)
	assert.Error(t, err)
}
