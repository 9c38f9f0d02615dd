package main

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A line as BenchmarkMemoryKinds prints it: the patched server's cuts as
// measured 2026-12-06, the proxy's and the holder costs made up.
const kindsOutput = `pkg: github.com/mcbridge/mcbridge/bench/e2e
BenchmarkMemoryKinds-2   	       1	25544929977 ns/op	        11.27 cut-hybrid-4096	        17.63 cut-hybrid-8192	         7.131 cut-plain-4096	        15.38 cut-plain-8192	         9.829 cut-sliding-window-4096	        16.77 cut-sliding-window-8192	 5.0 proxycut-hybrid-4096	 2.0 proxycut-plain-4096	 1.0 proxycut-sliding-window-4096	 1.004 holdercost-plain-4096	 1.008 holdercost-sliding-window-4096	 1.009 holdercost-hybrid-4096	 1.002 proxyholdercost-plain-4096	 1.31 proxyholdercost-sliding-window-4096	 1.52 proxyholdercost-hybrid-4096
`

// kindsMetrics is kindsOutput's metrics as the report reads them.
func kindsMetrics(t *testing.T) map[string]float64 {
	res, err := parseBench(strings.NewReader(kindsOutput))
	require.NoError(t, err)
	b, ok := (&report{Bench: res}).bench("MemoryKinds")
	require.True(t, ok)
	return b.Metrics
}

func TestMemoryKindVerdicts(t *testing.T) {
	for _, c := range []struct {
		metric   string
		verdict  func(map[string]float64, string) (string, bool)
		met      bool
		measured string
	}{
		{"cut", memoryKindCuts, true, "4096 shared: plain 7.13x, sliding-window 9.83x, hybrid 11.27x; 8192 shared: plain 15.38x, sliding-window 16.77x, hybrid 17.63x"},
		// The proxy's sliding-window cut is half its plain one's.
		{"proxycut", memoryKindCuts, false, "4096 shared: plain 2.00x, sliding-window 1.00x, hybrid 5.00x"},
		{"holdercost", memoryKindHolderCosts, true, "4096 shared: plain 1.004x, sliding-window 1.008x, hybrid 1.009x"},
		// The proxy's snapshot prompts cost a third and a half.
		{"proxyholdercost", memoryKindHolderCosts, false, "4096 shared: plain 1.002x, sliding-window 1.310x, hybrid 1.520x"},
	} {
		measured, met := c.verdict(kindsMetrics(t), c.metric)
		assert.Equal(t, c.met, met, c.metric)
		assert.Equal(t, c.measured, measured, c.metric)
	}

	metrics := kindsMetrics(t)
	metrics["cut-hybrid-8192"] = 11
	_, met := memoryKindCuts(metrics, "cut")
	assert.False(t, met, "a kind below 0.75 of plain's cut")
	delete(metrics, "cut-hybrid-8192")
	_, met = memoryKindCuts(metrics, "cut")
	assert.False(t, met, "a kind missing")
	_, met = memoryKindCuts(map[string]float64{}, "cut")
	assert.False(t, met, "nothing reported")
	metrics["holdercost-plain-4096"] = 1.02
	_, met = memoryKindHolderCosts(metrics, "holdercost")
	assert.False(t, met, "plain's cost is judged too")
}
