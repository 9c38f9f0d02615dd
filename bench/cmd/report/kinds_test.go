package main

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A line as BenchmarkMemoryKinds prints it: the patched server's cuts as
// measured 2026-12-06, the proxy's made up.
const kindsOutput = `pkg: github.com/mcbridge/mcbridge/bench/e2e
BenchmarkMemoryKinds-2   	       1	25544929977 ns/op	        11.27 cut-hybrid-4096	        17.63 cut-hybrid-8192	         7.131 cut-plain-4096	        15.38 cut-plain-8192	         9.829 cut-sliding-window-4096	        16.77 cut-sliding-window-8192	 5.0 proxycut-hybrid-4096	 2.0 proxycut-plain-4096	 1.0 proxycut-sliding-window-4096
`

func TestMemoryKindCuts(t *testing.T) {
	res, err := parseBench(strings.NewReader(kindsOutput))
	require.NoError(t, err)
	b, ok := (&report{Bench: res}).bench("MemoryKinds")
	require.True(t, ok)
	measured, met := memoryKindCuts(b.Metrics, "cut")
	assert.True(t, met)
	assert.Equal(t, "4096 shared: plain 7.13x, sliding-window 9.83x, hybrid 11.27x; 8192 shared: plain 15.38x, sliding-window 16.77x, hybrid 17.63x", measured)
	measured, met = memoryKindCuts(b.Metrics, "proxycut")
	assert.False(t, met, "the proxy's sliding-window cut is half its plain one's")
	assert.Equal(t, "4096 shared: plain 2.00x, sliding-window 1.00x, hybrid 5.00x", measured)

	b.Metrics["cut-hybrid-8192"] = 11
	_, met = memoryKindCuts(b.Metrics, "cut")
	assert.False(t, met, "a kind below 0.75 of plain's cut")
	delete(b.Metrics, "cut-hybrid-8192")
	_, met = memoryKindCuts(b.Metrics, "cut")
	assert.False(t, met, "a kind missing")
	_, met = memoryKindCuts(map[string]float64{}, "cut")
	assert.False(t, met, "nothing reported")
}
