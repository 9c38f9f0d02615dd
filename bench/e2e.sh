#!/usr/bin/env bash
# e2e.sh: the end-to-end llama-server benchmark (TTFT with and without mcbridge at
# shared prefixes of 1k, 4k and 8k tokens, and decode tokens/s at 0% hits, measured in
# the same run on the bench model). It lives with the server scripts it shares helpers
# with; this entry point sits beside the other benchmarks, and its JSON
# (bench/out/e2e.json) is what `make bench-report` renders.
exec "$(dirname "${BASH_SOURCE[0]}")/../scripts/server/bench.sh" "$@"
