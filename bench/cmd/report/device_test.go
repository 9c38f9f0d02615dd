package main

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Lines as BenchmarkDeviceRestore and BenchmarkDeviceStall print them.
const deviceOutput = `pkg: github.com/mcbridge/mcbridge/bench/e2e
BenchmarkDeviceRestore-2   	       1	9000000000 ns/op	        5.500 restore_GB/s	        12.40 restored_ttft_ms	         1.100 restore_vs_tensor_set_x	        5.000 slot_restore_GB/s	        30.00 slot_ttft_ms	       200.0 stock_ttft_ms	        16.13 ttft_cut_x	         2.419 vs_slot_ttft_x	        25.00 host_kv_restore_GB/s
BenchmarkDeviceStall-2   	       1	9000000000 ns/op	         0.500 stall_layers-1GBps	        52.40 host_restore_ms-1GBps	        54.50 device_restore_ms-1GBps	         3.000 stall_layers-10GBps	         5.500 host_restore_ms-10GBps	        10.70 device_restore_ms-10GBps	         8.000 stall_layers-25GBps	         2.600 host_restore_ms-25GBps	        10.70 device_restore_ms-25GBps	  50332800 prefix_bytes	        12 layers
`

func TestDeviceTargets(t *testing.T) {
	res, err := parseBench(strings.NewReader(deviceOutput))
	require.NoError(t, err)
	rows := (&report{Bench: res}).deviceTargets()
	require.Len(t, rows, 3)
	assert.Equal(t, met, rows[0][3], "the cut beats the slot path's: %v", rows[0])
	assert.Equal(t, met, rows[1][3], "1.1 x tensor_set: %v", rows[1])
	assert.Equal(t, met, rows[2][3], "within a layer of the slower stage: %v", rows[2])
	assert.Equal(t, "1 GB/s: 0.50 layers of the link; 10 GB/s: 0.76 layers of the device's tensor_set; 25 GB/s: 0.76 layers of the device's tensor_set", rows[2][2])

	b, ok := (&report{Bench: res}).bench("DeviceStall")
	require.True(t, ok)
	measured, ok := deviceStalls(b.Metrics, 0)
	assert.False(t, ok, "without the device's rate, the link's layers alone: %s", measured)
	b.Metrics["device_restore_ms-25GBps"] = 100
	_, ok = deviceStalls(b.Metrics, 5)
	assert.False(t, ok, "a device restore far past its upload")
	_, ok = deviceStalls(map[string]float64{}, 5)
	assert.False(t, ok, "nothing reported")

	rows = (&report{}).deviceTargets()
	for _, r := range rows {
		assert.Equal(t, notMeasured, r[3], "%v", r)
	}
}
