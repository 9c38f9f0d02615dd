#!/usr/bin/env bash
# Replays the agent-swarm workload through three stock llama-servers behind
# `mcbridge proxy` under each routing policy and writes bench/out/route.json;
# then renders docs/bench/README.md with it (bench/report.sh -render-only).
# MCB_BENCH_QUICK=1 replays a smaller swarm.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -f build/e2e.env ]; then . build/e2e.env; fi
start=$(date +%s)
go test -run '^$' -bench Route -benchtime 1x -timeout 60m -v ./bench/route
echo "bench/route: $(( $(date +%s) - start )) s"
if [ -f bench/out/report.json ]; then bench/report.sh -render-only; fi
