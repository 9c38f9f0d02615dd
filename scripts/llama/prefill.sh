#!/usr/bin/env bash
# prefill.sh [stock|patched]: prefill speed of llama-server on the bench model
# (internal/gguf preset "bench"), as the server's own timings report it.
#
#   PREFILL_SIZES   prompt lengths in tokens (default "512 2048")
#   PREFILL_RUNS    runs per length (default 2; the first may pay for page faults)
#   PREFILL_THREADS llama-server -t (default 2, the CI machines' cores)
#   LLAMA_SERVER    a llama-server binary to use instead of building one
#   PREFILL_ARGS    more llama-server arguments (word-split), e.g. "-fa off"
#
# Prints one line per run: tokens, prompt_ms, prompt tokens per second.
set -euo pipefail
# shellcheck source=scripts/llama/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need curl jq go

variant=${1:-stock}
sizes=${PREFILL_SIZES:-512 2048}
runs=${PREFILL_RUNS:-2}
bin=${LLAMA_SERVER:-$("$mcb_repo/scripts/llama/build.sh" "$variant" | tail -n 1)}
work=$(mktemp -d "${TMPDIR:-/tmp}/mcb-prefill.XXXXXX")
server_pid= # set by start_server, read by stop_server (lib.sh)
trap 'stop_server; rm -rf "$work"' EXIT
trap 'exit 130' INT TERM

max=0
for n in $sizes; do ((n > max)) && max=$n; done
model_file bench "$work/bench.gguf"
# -fa auto resolves to on for the CPU backend (V not transposed); "-fa off" in
# PREFILL_ARGS measures the transposed layout.
# shellcheck disable=SC2206 # PREFILL_ARGS is word-split on purpose
args=(-m "$work/bench.gguf" -c $((max + 64)) -np 1 -t "${PREFILL_THREADS:-2}" --no-webui --cache-ram 0 ${PREFILL_ARGS:-})
log "llama-server ${args[*]}"
start_server "$bin" "$work/server.log" "${args[@]}"

printf '%8s %10s %10s\n' tokens prompt_ms tok/s
for n in $sizes; do
	for run in $(seq "$runs"); do
		# A different prompt each run and no prompt cache: every token is computed.
		req='{"prompt": '$(token_ids "$n" "$run")', "n_predict": 1, "temperature": 0, "cache_prompt": false}'
		post /completion "$req" | jq -r '.timings | "\(.prompt_n) \(.prompt_ms) \(.prompt_per_second)"' |
			while read -r pn ms tps; do printf '%8d %10.1f %10.1f\n' "$pn" "$ms" "$tps"; done
	done
done
