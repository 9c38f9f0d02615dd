#!/usr/bin/env bash
# Runs the etcd directory benchmarks: publish throughput, and the time a new subscriber
# takes to catch up with N published blocks, for each N given.
#
#   scripts/etcd/bench.sh               # N = 1e4
#   scripts/etcd/bench.sh 1e4 1e5 1e6   # 1e6 publishes a million blocks first (minutes)
#
# Each run starts its own etcd (scripts/etcd/ensure.sh finds or installs one).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
MCB_ETCD_BIN=$("$repo/scripts/etcd/ensure.sh" | tail -n1)
export MCB_ETCD_BIN
cd "$repo"
go test -run '^$' -bench 'BenchmarkPublish' -benchtime 2s ./internal/directory/etcd/
for n in "${@:-1e4}"; do
	MCB_ETCD_BENCH_BLOCKS=$n go test -run '^$' -bench 'BenchmarkSubscribeCatchUp' \
		-benchtime 3x -timeout 60m ./internal/directory/etcd/
done
