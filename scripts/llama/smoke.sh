#!/usr/bin/env bash
# smoke.sh [stock|patched]: proves that llama-server of that build (default stock)
# loads the generated tiny model and serves it: /tokenize and /detokenize through the
# byte-level BPE vocabulary, greedy /completion of a token-id prompt on both slots,
# the same tokens twice. LLAMA_SERVER=/path/to/llama-server skips the build.
set -euo pipefail
# shellcheck source=scripts/llama/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need curl jq go

variant=${1:-stock}
bin=${LLAMA_SERVER:-$("$mcb_repo/scripts/llama/build.sh" "$variant" | tail -n 1)}
work=$(mktemp -d "${TMPDIR:-/tmp}/mcb-smoke.XXXXXX")
server_pid= # set by start_server, read by stop_server (lib.sh)
trap 'stop_server; rm -rf "$work"' EXIT
trap 'exit 130' INT TERM

model_file tiny "$work/tiny.gguf"
start_server "$bin" "$work/server.log" -m "$work/tiny.gguf" -c 4096 -np 2 -t 2 --no-webui

fail() {
	log "FAIL: $*"
	tail -n 30 "$work/server.log" >&2
	exit 1
}

# "banana" is 6 bytes; the tiny vocabulary merges "a n" (its merges all start with
# 'a'), so BPE must give b, an, an, a.
tok=$(post /tokenize '{"content":"banana"}')
[[ $(jq '.tokens | length' <<<"$tok") == 4 ]] || fail "/tokenize banana: $tok"
text=$(post /detokenize "$tok" | jq -r .content)
[[ $text == banana ]] || fail "/detokenize gave '$text'"

prompt=$(token_ids 40 3)
req='{"prompt": '$prompt', "n_predict": 8, "temperature": 0, "return_tokens": true, "id_slot": %d}'
for slot in 0 1; do
	# shellcheck disable=SC2059 # the format is ours
	out=$(post /completion "$(printf "$req" "$slot")")
	n=$(jq '.tokens | length' <<<"$out")
	stop=$(jq -r .stop_type <<<"$out")
	# A random model may emit EOS early: fewer than 8 tokens then, but never none.
	[[ $n -ge 1 && ($n -eq 8 || $stop == eos) ]] || fail "slot $slot: $out"
	[[ $(jq '.timings.prompt_n + .timings.cache_n' <<<"$out") == 40 ]] || fail "slot $slot timings: $out"
	tokens[slot]=$(jq -c .tokens <<<"$out")
	log "slot $slot: $n tokens ${tokens[slot]}, prompt $(jq .timings.prompt_per_second <<<"$out") tok/s"
done
[[ ${tokens[0]} == "${tokens[1]}" ]] || fail "greedy output differs between slots: ${tokens[0]} vs ${tokens[1]}"

props=$(curl -fsS "$server_url/props")
[[ $(jq -r '.model_path' <<<"$props") == "$work/tiny.gguf" ]] || fail "/props: $props"
log "smoke test passed ($variant, $bin)"
