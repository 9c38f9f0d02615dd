package main

import (
	"bufio"
	"io"
	"strconv"
	"strings"
)

// benchResult is one line of `go test -bench` output.
type benchResult struct {
	Pkg  string `json:"pkg"`
	Name string `json:"name"` // without the "Benchmark" prefix and the -GOMAXPROCS suffix
	N    int64  `json:"n"`
	// Metrics maps a unit ("ns/op", "MB/s", "x_memcpy", ...) to its value.
	Metrics map[string]float64 `json:"metrics"`
}

// Param returns the value of a "key=value" element of the name.
func (b benchResult) Param(key string) string {
	for _, part := range strings.Split(b.Name, "/") {
		if k, v, ok := strings.Cut(part, "="); ok && k == key {
			return v
		}
	}
	return ""
}

// parseBench reads `go test -bench` output and returns its benchmark
// lines, each with the package announced by the last "pkg:" line. Lines
// that are not results (headers, PASS, logs) are skipped; a line that
// starts like a result but does not parse is skipped too, as `go test`
// interleaves a benchmark's log output with its result line.
func parseBench(r io.Reader) ([]benchResult, error) {
	var out []benchResult
	pkg := ""
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if p, ok := strings.CutPrefix(line, "pkg: "); ok {
			pkg = strings.TrimSpace(p)
			continue
		}
		if res, ok := parseBenchLine(line); ok {
			res.Pkg = pkg
			out = append(out, res)
		}
	}
	return out, sc.Err()
}

func parseBenchLine(line string) (benchResult, bool) {
	f := strings.Fields(line)
	// Name, iterations, then value-unit pairs.
	if len(f) < 4 || len(f)%2 != 0 || !strings.HasPrefix(f[0], "Benchmark") {
		return benchResult{}, false
	}
	name := strings.TrimPrefix(f[0], "Benchmark")
	if i := strings.LastIndexByte(name, '-'); i >= 0 {
		if _, err := strconv.Atoi(name[i+1:]); err == nil {
			name = name[:i]
		}
	}
	n, err := strconv.ParseInt(f[1], 10, 64)
	if err != nil || n <= 0 || name == "" {
		return benchResult{}, false
	}
	res := benchResult{Name: name, N: n, Metrics: map[string]float64{}}
	for i := 2; i < len(f); i += 2 {
		v, err := strconv.ParseFloat(f[i], 64)
		if err != nil {
			return benchResult{}, false
		}
		res.Metrics[f[i+1]] = v
	}
	return res, true
}
