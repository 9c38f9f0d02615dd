// Package bench holds the bridge's benchmarks, run with the Loopback
// transport standing in for RDMA: key and lookup cost, restore and save
// throughput against memcpy per block size and link, the layer-wise
// pipeline's stall, and the overhead on requests that hit nothing. They
// live in this package's tests; `go test -bench . ./bench` runs them,
// MCB_BENCH_QUICK=1 at small sizes, and bench/report.sh turns them, the
// trace replay (internal/replay, which `mcbridge replay` ships) and the arbiter's evaluation
// (bench/arbitereval) into docs/bench/README.md.
package bench
