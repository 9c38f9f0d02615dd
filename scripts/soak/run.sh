#!/usr/bin/env bash
# run.sh: the long soak. Runs tests/reliability's TestLoad for DURATION (default 10m):
# MCB_SOAK_PROCS load generators (default 8), each a bridge over etcd and the mock
# Transfer Engine with a 1 MiB pool, and a store node with a 4 MiB pool, so every
# process evicts all the time. It fails on any failed request, any wrong restored byte,
# any pool over its size, or a one-minute window whose p99 exceeds MCB_SOAK_DRIFT times
# (default 3) the median window's p99. The fault matrix runs first unless MATRIX=0.
#
#   scripts/soak/run.sh [DURATION]
#   MCB_SOAK_PROCS=16 RACE=1 scripts/soak/run.sh 30m
#
# The report (matrix, totals, p50/p99 per minute, store and generator memory) goes to
# $MCB_RELIABILITY_REPORT, default build/soak-report.md; copy its numbers into
# docs/reliability.md. Needs Go, a C compiler (the mock) and etcd (Debian: etcd-server).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
duration=${1:-10m}
report=${MCB_RELIABILITY_REPORT:-$repo/build/soak-report.md}
mkdir -p "$(dirname "$report")"
: >"$report"

tests='^TestLoad$'
if [[ ${MATRIX:-1} != 0 ]]; then
	tests='^(TestFaultMatrix|TestLoad)$'
fi
race=()
if [[ ${RACE:-0} != 0 ]]; then
	race=(-race)
fi

echo "soak: $duration, ${MCB_SOAK_PROCS:-8} processes; report: $report" >&2
cd "$repo"
# The soak sets its own length; go test's default 10-minute limit would cut it.
set +e
MCB_SOAK=$duration MCB_RELIABILITY_REPORT=$report \
	go test "${race[@]}" -count=1 -timeout 0 -run "$tests" -v ./tests/reliability |
	grep -v '^{"level"' # the embedded etcd's JSON log lines
status=${PIPESTATUS[0]}
set -e
echo "soak: report in $report" >&2
exit "$status"
