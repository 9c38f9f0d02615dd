package main

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Lines as BenchmarkDeviceRestore and BenchmarkDeviceStall print them.
const deviceOutput = `pkg: github.com/mcbridge/mcbridge/bench/e2e
BenchmarkDeviceRestore-2   	       1	9000000000 ns/op	        21.50 restore_GB/s	        12.40 restored_ttft_ms	         1.100 restore_vs_tensor_set_x	        19.60 slot_restore_GB/s	        30.00 slot_ttft_ms	       200.0 stock_ttft_ms	        16.13 ttft_cut_x	         2.419 vs_slot_ttft_x	        25.00 host_kv_restore_GB/s
BenchmarkDeviceStall-2   	       1	9000000000 ns/op	         0.500 stall_layers-1GBps	         4.194 layer_ms-1GBps	         3.000 stall_layers-10GBps	         0.4194 layer_ms-10GBps	        8.000 stall_layers-25GBps	         0.1678 layer_ms-25GBps	         1.300 device_GB/s-unshaped	        12 layers
`

func TestDeviceTargets(t *testing.T) {
	res, err := parseBench(strings.NewReader(deviceOutput))
	require.NoError(t, err)
	rows := (&report{Bench: res}).deviceTargets()
	require.Len(t, rows, 3)
	assert.Equal(t, met, rows[0][3], "the cut beats the slot path's: %v", rows[0])
	assert.Equal(t, met, rows[1][3], "1.1 x tensor_set: %v", rows[1])
	assert.Equal(t, notMet, rows[2][3], "stalls of 3 and 8 layers: %v", rows[2])
	assert.Equal(t, "1 GB/s: 0.50 layers; 10 GB/s: 3.00 layers; 25 GB/s: 8.00 layers (unshaped, the device restore runs at 1.30 GB/s: on a link faster than that, the device's upload, not the pipeline, sets the restore's pace)", rows[2][2])

	b, ok := (&report{Bench: res}).bench("DeviceStall")
	require.True(t, ok)
	for _, l := range []string{"10GBps", "25GBps"} {
		b.Metrics["stall_layers-"+l] = 0.9
	}
	_, ok = deviceStalls(b.Metrics)
	assert.True(t, ok, "every stall within a layer")
	_, ok = deviceStalls(map[string]float64{})
	assert.False(t, ok, "nothing reported")

	rows = (&report{}).deviceTargets()
	for _, r := range rows {
		assert.Equal(t, notMeasured, r[3], "%v", r)
	}
}
