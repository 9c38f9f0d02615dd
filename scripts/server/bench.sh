#!/usr/bin/env bash
# bench.sh: end-to-end time to first token of llama-server with and without mcbridge, on
# the bench model (internal/gguf preset "bench"), measured in one run; writes
# bench/out/e2e.json (read by bench/report.sh) and prints a table.
#
# A stock and a patched llama-server (bridge on, defaults) run side by side and get their
# requests interleaved, so that both see the same background load. For each shared
# prefix P (BENCH_PREFIXES, default "1024 4096 8192") the measured request is P shared
# tokens + BENCH_SUFFIX (64) own tokens, on a slot that holds nothing of it:
#   without: the stock server computes all of it;
#   with:    on the patched server another slot computed P + another suffix just
#            before; this slot restores P and computes the suffix;
#   local:   the stock server's same slot, holding P already, computes another suffix:
#            the unshared remainder alone, against which the restore's own cost is
#            measured (target: with <= local + 1.25 x memcpy(P's KV) + 2 ms).
# TTFT is the client's wall time of a one-token completion. Also measured: the bridge's
# overhead where it cannot help (0% hits: TTFT and decode tokens/s, medians of
# BENCH_ROUNDS interleaved rounds) and llama-server's own slot-file restore of the longest
# prompt, the bar users have today.
#
#   BENCH_THREADS   llama-server -t (default 2)
#   BENCH_DECODE    tokens generated for the decode rate (default 64)
#   BENCH_ROUNDS    rounds of the 0%-hit measurements (default 5)
#   BENCH_OUT       output path (default bench/out/e2e.json)
#   LLAMA_SERVER_STOCK / LLAMA_SERVER_PATCHED  binaries to use instead of building
set -euo pipefail
# shellcheck source=scripts/server/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need curl jq go cc

prefixes=${BENCH_PREFIXES:-1024 4096 8192}
suffix=${BENCH_SUFFIX:-64}
threads=${BENCH_THREADS:-2}
n_decode=${BENCH_DECODE:-64}
rounds=${BENCH_ROUNDS:-5}
out=${BENCH_OUT:-$mcb_repo/bench/out/e2e.json}

work=$(mktemp -d "${TMPDIR:-/tmp}/mcb-bench.XXXXXX")
trap 'srv_stop_all; rm -rf "$work"' EXIT
trap 'exit 130' INT TERM
start=$SECONDS

stock=${LLAMA_SERVER_STOCK:-$("$mcb_repo/scripts/llama/build.sh" stock | tail -n 1)}
patched=${LLAMA_SERVER_PATCHED:-$("$mcb_repo/scripts/llama/build.sh" patched | tail -n 1)}
model_file bench "$work/bench.gguf"

# memcpy bandwidth of this machine, for the restore's physical limit: the best of a few
# copies of 256 MiB that the first pass has paged in.
cat >"$work/memcpy.c" <<'EOF'
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
int main(void) {
    size_t n = (size_t)256 << 20;
    char *a = malloc(n), *b = malloc(n);
    if (!a || !b) return 1;
    memset(a, 1, n);
    memset(b, 2, n);
    double best = 0;
    for (int i = 0; i < 5; i++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        memcpy(b, a, n);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double s = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
        if (n / s > best) best = n / s;
        a[i] = b[n - 1 - i]; /* keep the copies observable */
    }
    printf("%.0f\n", best);
    return 0;
}
EOF
cc -O2 -o "$work/memcpy" "$work/memcpy.c"
memcpy_bps=$("$work/memcpy")

max=1024 # the 0%-hit prompt
for p in $prefixes; do ((p > max)) && max=$p; done
# Two slots, each able to hold the longest prompt and its answer.
slot_ctx=$((max + suffix + n_decode + 256))
args=(-m "$work/bench.gguf" -c $((2 * slot_ctx)) -np 2 -t "$threads" --no-webui --cache-ram 0 --metrics)
config='{}' # the defaults: in-process pool, memory directory, loopback transport, 256-token blocks

# timed NAME PROMPT SLOT N_PREDICT [EXTRA]: the response with the client's wall time
# added as .client_ms.
timed() {
	local t0 t1 body
	t0=$(date +%s%N)
	body=$(complete "$@")
	t1=$(date +%s%N)
	jq -c --argjson us "$(((t1 - t0) / 1000))" '. + {client_ms: ($us / 1000)}' <<<"$body"
}

prefix_of() { ids "$1" 7 $(($1 / 1024 + 3)); } # the shared prefix of length $1, its own per length
own() { cat_ids "$(prefix_of "$1")" "$(ids "$suffix" "$2" "$3")"; }
prompt_a() { own "$1" 11 5; } # the agent that computes the prefix
prompt_b() { own "$1" 13 9; } # the measured agent
prompt_c() { own "$1" 17 2; } # the measured agent's next turn, for the local remainder
unique() { ids "$1" 5 "$2"; } # shares nothing with the above

mkdir -p "$work/slots"
log "stock: ${args[*]}"
srv_start stock "$work/stock.log" "$stock" "${args[@]}" --slot-save-path "$work/slots/"
log "patched, bridge on: ${args[*]} --mcb-config $config"
srv_start on "$work/on.log" "$patched" "${args[@]}" --mcb-config "$config"
[[ $(bridge_state "$work/on.log") == on ]] || die "the bridge did not come on: $(bridge_state "$work/on.log")"

rows=()
for p in $prefixes; do
	log "$p shared tokens: the computing agent"
	a=$(timed on "$(prompt_a "$p")" 0 1)
	log "$p shared tokens: without, with, local remainder"
	without=$(timed stock "$(prompt_b "$p")" 1 1)
	with=$(timed on "$(prompt_b "$p")" 1 1)
	local_rest=$(timed stock "$(prompt_c "$p")" 1 1)
	rows+=("$(jq -cn --argjson p "$p" --argjson s "$suffix" --argjson a "$a" --argjson off "$without" \
		--argjson on "$with" --argjson loc "$local_rest" --argjson bps "$memcpy_bps" '{
			shared_tokens: $p, suffix_tokens: $s,
			ttft_ms_without: $off.client_ms, ttft_ms_with: $on.client_ms,
			ratio: ($off.client_ms / $on.client_ms),
			prompt_ms_without: $off.timings.prompt_ms, prompt_ms_with: $on.timings.prompt_ms,
			decision: $on.timings.mcb_decision, reason: $on.timings.mcb_reason,
			restored_tokens: $on.timings.mcb_restored_n, restored_bytes: $on.timings.mcb_restored_bytes,
			restore_ms: $on.timings.mcb_restore_ms, lookup_ms: $on.timings.mcb_lookup_ms,
			restore_gb_per_s: (if $on.timings.mcb_restore_ms > 0 then $on.timings.mcb_restored_bytes / $on.timings.mcb_restore_ms / 1e6 else null end),
			ttft_ms_local_remainder: $loc.client_ms,
			limit_ms: ($loc.client_ms + 1.25 * $on.timings.mcb_restored_bytes / $bps * 1000 + 2),
			within_limit: ($on.client_ms <= $loc.client_ms + 1.25 * $on.timings.mcb_restored_bytes / $bps * 1000 + 2),
			computing_agent: {ttft_ms: $a.client_ms, saved_blocks: $a.timings.mcb_saved_blocks, save_ms: $a.timings.mcb_save_ms},
			first_token_identical: ($off.tokens == $on.tokens)
		}')")
done

# llama-server's slot files on the same KV: stock slot 1 holds the longest prompt now.
saved=$(srv_post stock "/slots/1?action=save" '{"filename": "bench.bin"}')
restored=$(srv_post stock "/slots/1?action=restore" '{"filename": "bench.bin"}')

log "0% hits: $rounds interleaved rounds of a 1024-token prompt and of $n_decode decoded tokens"
miss_s=() miss_o=() dec_s=() dec_o=()
for r in $(seq "$rounds"); do
	miss_s+=("$(timed stock "$(unique 1024 $((r * 3)))" 0 1)")
	miss_o+=("$(timed on "$(unique 1024 $((r * 3)))" 0 1)")
	dec_s+=("$(timed stock "$(unique 128 $((r * 3 + 1)))" 0 "$n_decode" '{"ignore_eos": true}')")
	dec_o+=("$(timed on "$(unique 128 $((r * 3 + 1)))" 0 "$n_decode" '{"ignore_eos": true}')")
done
srv_stop stock
srv_stop on
arr() { printf '%s\n' "$@" | jq -cs .; }

mkdir -p "$(dirname "$out")"
jq -n --argjson rows "$(printf '%s\n' "${rows[@]}" | jq -cs .)" \
	--argjson saved "$saved" --argjson restored "$restored" \
	--argjson ms "$(arr "${miss_s[@]}")" --argjson mo "$(arr "${miss_o[@]}")" \
	--argjson ds "$(arr "${dec_s[@]}")" --argjson dw "$(arr "${dec_o[@]}")" \
	--argjson threads "$threads" --argjson bps "$memcpy_bps" --argjson secs $((SECONDS - start)) \
	--arg date "$(date -u +%Y-%m-%dT%H:%M:%SZ)" --arg host "$(uname -srm)" --arg load "$(cut -d' ' -f1-3 /proc/loadavg)" \
	--arg cpu "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')" --argjson ncpu "$(nproc)" '
	def median: sort | if length == 0 then null else .[(length - 1) / 2 | floor] end;
	($rows | map(.shared_tokens) | max) as $longest |
	($rows[] | select(.shared_tokens == $longest)) as $l |
	{
		date: $date, host: $host, cpu: $cpu, cpus: $ncpu, threads: $threads, load_average_at_end: $load,
		seconds: $secs, memcpy_gb_per_s: ($bps / 1e9),
		model: "internal/gguf preset bench (12 layers, n_embd 768, 4 KV heads, f16 KV: 12 KiB a token)",
		bridge_config: "defaults (in-process pool, memory directory, loopback transport, 256-token blocks)",
		flash_attention: "auto (on for the CPU backend: V row-major)",
		ttft: $rows,
		target: {shared_tokens: 8192, ratio_at_least: 10},
		target_met: ([$rows[] | select(.shared_tokens == 8192) | .ratio >= 10] | first // null),
		slot_restore: {
			tokens: $restored.n_restored, bytes: $saved.n_written,
			slot_save_ms: $saved.timings.save_ms, slot_restore_ms: $restored.timings.restore_ms,
			mcb_restored_tokens: $l.restored_tokens, mcb_restored_bytes: $l.restored_bytes, mcb_restore_ms: $l.restore_ms,
			speedup: ($restored.timings.restore_ms / $l.restore_ms)
		},
		zero_hits: {
			rounds: ($ms | length), prompt_tokens: 1024, decode_tokens: ($dw[0].timings.predicted_n),
			ttft_ms_stock: ($ms | map(.client_ms) | median), ttft_ms_with: ($mo | map(.client_ms) | median),
			ttft_ms_stock_rounds: ($ms | map(.client_ms)), ttft_ms_with_rounds: ($mo | map(.client_ms)),
			ttft_overhead_pct: ((($mo | map(.client_ms) | median) / ($ms | map(.client_ms) | median) - 1) * 100),
			lookup_ms: ($mo | map(.timings.mcb_lookup_ms) | median), save_ms: ($mo | map(.timings.mcb_save_ms) | median),
			decode_tokens_per_s_stock: ($ds | map(.timings.predicted_per_second) | median),
			decode_tokens_per_s_with: ($dw | map(.timings.predicted_per_second) | median),
			decode_tokens_per_s_stock_rounds: ($ds | map(.timings.predicted_per_second)),
			decode_tokens_per_s_with_rounds: ($dw | map(.timings.predicted_per_second)),
			decode_overhead_pct: ((1 - ($dw | map(.timings.predicted_per_second) | median) / ($ds | map(.timings.predicted_per_second) | median)) * 100)
		}
	}' >"$out"

jq -r '
	def r1: . * 10 | round / 10;
	"shared\tsuffix\tTTFT without\tTTFT with\tratio\trestored\trestore\tlocal remainder\tlimit\tsame 1st token",
	(.ttft[] | "\(.shared_tokens)\t\(.suffix_tokens)\t\(.ttft_ms_without | round) ms\t\(.ttft_ms_with | r1) ms\t\(.ratio | r1)x\t\(.restored_tokens)\t\(.restore_ms) ms (\(.restore_gb_per_s | r1) GB/s)\t\(.ttft_ms_local_remainder | r1) ms\t\(.limit_ms | r1) ms \(if .within_limit then "(met)" else "(missed)" end)\t\(.first_token_identical)")' "$out" |
	column -t -s $'\t'
jq -r '
	def r2: . * 100 | round / 100;
	"",
	"memcpy on this machine: \(.memcpy_gb_per_s | r2) GB/s; load average at the end: \(.load_average_at_end)",
	"slot-file restore of \(.slot_restore.tokens) tokens: \(.slot_restore.slot_restore_ms) ms; mcbridge restore of \(.slot_restore.mcb_restored_tokens): \(.slot_restore.mcb_restore_ms) ms (\(.slot_restore.speedup | r2)x)",
	"0% hits (medians of \(.zero_hits.rounds)): TTFT of 1024 tokens \(.zero_hits.ttft_ms_stock | round) ms stock, \(.zero_hits.ttft_ms_with | round) ms with the bridge (\(.zero_hits.ttft_overhead_pct | r2)%; lookup \(.zero_hits.lookup_ms) ms, save \(.zero_hits.save_ms) ms)",
	"decode: \(.zero_hits.decode_tokens_per_s_stock | r2) tok/s stock, \(.zero_hits.decode_tokens_per_s_with | r2) tok/s with the bridge (\(.zero_hits.decode_overhead_pct | r2)% slower)",
	"target (8192 shared, >= 10x): \(.target_met)"' "$out"
log "wrote $out in $((SECONDS - start))s"
