package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Lines as BenchmarkDiskCodec and BenchmarkDiskRestore print them.
const diskOutput = `pkg: github.com/mcbridge/mcbridge/bench/e2e
BenchmarkDiskCodec/model=bench/codec=raw-2         	       3	   3100176 ns/op	8121.02 MB/s	         8.121 decode-GB/s	         0.9185 encode-GB/s	         1.000 stored/raw
BenchmarkDiskCodec/model=bench/codec=zstd-2        	       3	  39506128 ns/op	 637.28 MB/s	         0.6373 decode-GB/s	         0.2339 encode-GB/s	         0.8464 stored/raw
BenchmarkDiskRestore/from=disk-cold/codec=raw-2         	      20	  90055468 ns/op	 279.57 MB/s	        90.06 ms/prefix	     52832 recompute-ms	       586.7 x-recompute
BenchmarkDiskRestore/from=memory-2                      	      20	  18513149 ns/op	1359.93 MB/s	        18.51 ms/prefix	     52832 recompute-ms	      2854 x-recompute
`

func TestWriteDisk(t *testing.T) {
	res, err := parseBench(strings.NewReader(diskOutput))
	require.NoError(t, err)
	var out bytes.Buffer
	(&report{Bench: res}).writeDisk(&md{w: &out})
	s := out.String()
	assert.Contains(t, s, "| bench | zstd | 0.846 | 0.23 | 0.64 |")
	assert.Contains(t, s, "**raw**")
	assert.Contains(t, s, "saves 15.36% of the bytes and decodes 12.7x slower")
	assert.Contains(t, s, "| disk-cold (raw) | 90.06 | 0.28 | 52832.0 | 586.7 |")
	assert.Contains(t, s, "| memory | 18.51 | 1.36 | 52832.0 | 2854.0 |")

	out.Reset()
	(&report{}).writeDisk(&md{w: &out})
	assert.Contains(t, out.String(), "did not run")
}
