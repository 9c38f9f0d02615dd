package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Lines as BenchmarkStore, BenchmarkPeerRead and BenchmarkStoreTTFT print
// them (BenchmarkStore's from a run of -benchtime 1x on this machine).
const storeOutput = `pkg: github.com/mcbridge/mcbridge/internal/store/mooncake
BenchmarkStore/memcpy/prefix48MiB-2         	       1	   5091651 ns/op	9885.13 MB/s
BenchmarkStore/memcpy/blocks1MiB-2          	       1	   5308207 ns/op	9481.85 MB/s
BenchmarkStore/get/remote/prefix48MiB-2     	       1	  48941337 ns/op	1028.41 MB/s	         0.1039 x_memcpy
BenchmarkStore/get/remote/blocks1MiB-2      	       1	  52850931 ns/op	 952.33 MB/s	         0.1004 x_memcpy
BenchmarkStore/get/own-replica/prefix48MiB-2         	       1	   9622110 ns/op	5230.83 MB/s	         0.5287 x_memcpy
BenchmarkStore/get/own-replica/blocks1MiB-2          	       1	  11014210 ns/op	4569.70 MB/s	         0.4818 x_memcpy
BenchmarkStore/put/registered/replicas=2/prefix48MiB-2             	       1	  38359968 ns/op	1312.09 MB/s	         0.1326 x_memcpy
BenchmarkStore/put/copying/replicas=1-own/blocks1MiB-2             	       1	 108406294 ns/op	 464.29 MB/s	         0.04894 x_memcpy
pkg: github.com/mcbridge/mcbridge/internal/transport/mooncake
BenchmarkPeerRead/way=real-tcp/shape=prefix48MiB-2         	       1	  40000000 ns/op	1258.29 MB/s	         0.1200 x_memcpy
pkg: github.com/mcbridge/mcbridge/bench/e2e
BenchmarkStoreTTFT-2   	       1	90000000000 ns/op	        10.5 store/te-4096	         9.80 store/te-8192	      1200 ttft-ms-local-4096	      1500 ttft-ms-local-8192	      2100 ttft-ms-store-4096	      3900 ttft-ms-store-8192	       200 ttft-ms-te-4096	       398 ttft-ms-te-8192	     14000 ttft-ms-without-4096	     32000 ttft-ms-without-8192	         6.667 x-faster-store-4096	         8.205 x-faster-store-8192
`

func TestWriteStore(t *testing.T) {
	res, err := parseBench(strings.NewReader(storeOutput))
	require.NoError(t, err)
	var out bytes.Buffer
	r := &report{Bench: res}
	r.writeStore(&md{w: &out})
	s := out.String()
	assert.Contains(t, s, "| operation | prefix48MiB | blocks1MiB | blocks16MiB |")
	assert.Contains(t, s, "| `memcpy` | 9.89 GB/s | 9.48 GB/s |  |")
	assert.Contains(t, s, "| `get/remote` | 1.03 GB/s, 0.10 x memcpy | 0.95 GB/s, 0.10 x memcpy |  |")
	assert.Contains(t, s, "| `put/registered/replicas=2` | 1.31 GB/s, 0.13 x memcpy |  |  |")
	assert.Contains(t, s, "| `put/copying/replicas=1-own` |  | 0.46 GB/s, 0.05 x memcpy |  |")
	assert.Contains(t, s, "| Transfer Engine, direct (`PeerRead` real-tcp) | 1.26 GB/s, 0.12 x memcpy |  |  |")
	assert.Contains(t, s, "0.10 x at worst from another process's segment (blocks1MiB), 0.48 x from a replica in the own segment (blocks1MiB); **not met**")
	assert.Contains(t, s, "| 4096 | 14000 | 2100 | 200 | 1200 | 6.7 | 10.50 |")
	assert.Contains(t, s, "| 8192 | 32000 | 3900 | 398 | 1500 | 8.2 | 9.80 |")

	out.Reset()
	r.writeTargets(&md{w: &out})
	assert.Contains(t, out.String(), "| restore throughput through Mooncake Store, >= 1 MiB objects | >= 0.8 x memcpy from a peer process, >= 0.9 x from the own segment | 0.10 x at worst")

	out.Reset()
	(&report{}).writeStore(&md{w: &out})
	assert.Contains(t, out.String(), "BenchmarkStore did not run; not measured")
	assert.Contains(t, out.String(), "_No data._")
	assert.Contains(t, out.String(), "BenchmarkStoreTTFT did not run.")
	assert.NotContains(t, out.String(), "PeerRead` real-tcp) |")
}

func TestStoreTargetMet(t *testing.T) {
	res, err := parseBench(strings.NewReader(`BenchmarkStore/get/remote/blocks1MiB-2 1 1 ns/op 9000 MB/s 0.85 x_memcpy
BenchmarkStore/get/own-replica/blocks1MiB-2 1 1 ns/op 9000 MB/s 0.95 x_memcpy
`))
	require.NoError(t, err)
	measured, verdict := (&report{Bench: res}).storeRestoreTarget()
	assert.Equal(t, met, verdict, measured)
}
