#!/usr/bin/env bash
# Runs the benchmarks, the trace replay and the arbiter's evaluation and
# writes docs/bench/README.md with its plots. MCB_BENCH_QUICK=1 runs the
# quick mode (CI: every harness once, small sizes); without it, the full
# run takes several minutes. Raw outputs land in bench/out/; results of the
# llama-server benchmarks are read from bench/out/e2e.json, route.json and
# agentapi.json;
# `bench/report.sh -render-only` rewrites the README with them without
# measuring again.
set -euo pipefail
cd "$(dirname "$0")/.."
exec go run ./bench/cmd/report "$@"
