package main

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const sampleOutput = `goos: linux
goarch: amd64
pkg: github.com/mcbridge/mcbridge/bench
cpu: Intel(R) Xeon(R) Processor
BenchmarkKeyLookup/tokens=1024-2         	       3	      8689 ns/op	         8.486 ns/token	         8.689 us/lookup	     848 B/op	       4 allocs/op
BenchmarkRestore/block=1MiB/link=10GBps-2                    	       3	    670333 ns/op	6257.05 MB/s	         0.6303 x_linerate	         0.5087 x_memcpy
    rig_test.go:12: a log line
BenchmarkBroken-2   3   12 ns/op   7
PASS
pkg: github.com/mcbridge/mcbridge/internal/residency
BenchmarkMatch/blocks=1000-2   	  100	     12000 ns/op	        23.4 ns/block
ok  	github.com/mcbridge/mcbridge/bench	1.202s
`

func TestParseBench(t *testing.T) {
	got, err := parseBench(strings.NewReader(sampleOutput))
	require.NoError(t, err)
	want := []benchResult{
		{Pkg: "github.com/mcbridge/mcbridge/bench", Name: "KeyLookup/tokens=1024", N: 3,
			Metrics: map[string]float64{"ns/op": 8689, "ns/token": 8.486, "us/lookup": 8.689, "B/op": 848, "allocs/op": 4}},
		{Pkg: "github.com/mcbridge/mcbridge/bench", Name: "Restore/block=1MiB/link=10GBps", N: 3,
			Metrics: map[string]float64{"ns/op": 670333, "MB/s": 6257.05, "x_linerate": 0.6303, "x_memcpy": 0.5087}},
		{Pkg: "github.com/mcbridge/mcbridge/internal/residency", Name: "Match/blocks=1000", N: 100,
			Metrics: map[string]float64{"ns/op": 12000, "ns/block": 23.4}},
	}
	require.Equal(t, want, got)
	require.Equal(t, "10GBps", got[1].Param("link"), "Param(link)")
	require.Empty(t, got[1].Param("size"), "Param(size)")
}

func TestParseBenchLine(t *testing.T) {
	for _, tc := range []struct {
		line string
		ok   bool
	}{
		{"BenchmarkX-8 10 5 ns/op", true},
		{"BenchmarkX 10 5 ns/op", true}, // GOMAXPROCS=1 prints no suffix
		{"BenchmarkX-8 10 5", false},
		{"BenchmarkX-8 0 5 ns/op", false},
		{"BenchmarkX-8 ten 5 ns/op", false},
		{"BenchmarkX-8 10 five ns/op", false},
		{"Benchmark-8 10 5 ns/op", false},
		{"TestX 10 5 ns/op", false},
	} {
		_, ok := parseBenchLine(tc.line)
		assert.Equal(t, tc.ok, ok, "parseBenchLine(%q) ok", tc.line)
	}
}

func FuzzParseBench(f *testing.F) {
	f.Add(sampleOutput)
	f.Add("BenchmarkX-8 10 5 ns/op 1e3 MB/s\n")
	f.Add("pkg: a\nBenchmark-1 1 1 x\n")
	f.Fuzz(func(t *testing.T, in string) {
		res, err := parseBench(strings.NewReader(in))
		if err != nil {
			return
		}
		for _, r := range res {
			require.Positive(t, r.N, "accepted %+v", r)
			require.NotEmpty(t, r.Name, "accepted %+v", r)
			require.NotEmpty(t, r.Metrics, "accepted %+v", r)
			require.GreaterOrEqual(t, blockBytes(r.Param("block")), int64(0), "block size from %q", r.Name)
		}
	})
}
