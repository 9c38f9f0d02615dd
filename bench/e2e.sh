#!/usr/bin/env bash
# e2e.sh: the end-to-end benchmark alone (bench/e2e BenchmarkTTFT: stock, slot-file
# restore, own-slot, cross-process over the mock and the real Transfer Engine, the
# proxy; 0%-hit overhead), writing bench/out/e2e.json. `make bench-report` runs it
# with every other benchmark and renders the report; this is for rerunning just it.
# Needs the builds `make deps` makes (build/e2e.env).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=/dev/null
. build/e2e.env
exec go test -run '^$' -bench '^BenchmarkTTFT$' -benchtime 1x -timeout 60m ./bench/e2e/ "$@"
