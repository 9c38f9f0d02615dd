#!/usr/bin/env bash
# bench.sh: time to first token through `mcbridge proxy` in front of STOCK llama-servers,
# against the stock server alone, on the bench model (internal/gguf preset "bench"), in one
# run; writes bench/out/proxy.json and prints a table.
#
# Two stock servers, each behind a proxy; the proxies share KV through etcd and the mock
# Transfer Engine (or a store node), with the bridge's default arbiter. For each shared
# prefix P (BENCH_PREFIXES, default "1024 4096 8192") the measured request is P shared
# tokens + BENCH_SUFFIX (64) own tokens, on slots that hold nothing of it:
#   stock:  server 2 alone computes all of it (no proxy on the path);
#   proxy:  proxy 1 has computed P + another suffix on server 1 just before; proxy 2
#           restores P into server 2 and the server computes the suffix;
#   local:  server 2's slot, holding P already, computes another suffix through the
#           proxy: the unshared remainder alone, the floor a restore is measured against.
# TTFT is the client's wall time of a one-token completion; proxy and local are medians
# of BENCH_REPS (3) requests, stock is one (BENCH_STOCK_REPS) as it takes up to a minute.
#
#   BENCH_THREADS   llama-server -t (default 2)
#   BENCH_SLOT_ROOT where the servers' slot directories go (default /dev/shm when there:
#                   slot files of 8k tokens are 100 MB, a disk makes writing them dominate)
#   BENCH_OUT       output path (default bench/out/proxy.json)
#   PROXY_TEST_DIRECTORY  etcd | store | auto (as scripts/proxy/test.sh)
#   LLAMA_SERVER_STOCK    llama-server to use instead of building
set -euo pipefail
# shellcheck source=scripts/proxy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need curl jq go

prefixes=${BENCH_PREFIXES:-1024 4096 8192}
suffix=${BENCH_SUFFIX:-64}
threads=${BENCH_THREADS:-2}
reps=${BENCH_REPS:-3}
stock_reps=${BENCH_STOCK_REPS:-1}
out=${BENCH_OUT:-$mcb_repo/bench/out/proxy.json}

work=$(mktemp -d "${TMPDIR:-/tmp}/mcb-proxy-bench.XXXXXX")
slot_root=${BENCH_SLOT_ROOT:-}
[[ -z $slot_root && -d /dev/shm && -w /dev/shm ]] && slot_root=/dev/shm
slots=$(mktemp -d "${slot_root:-$work}/mcb-proxy-slots.XXXXXX")
trap 'px_stop_all; srv_stop_all; directory_stop; rm -rf "$work" "$slots"' EXIT
trap 'exit 130' INT TERM
start=$SECONDS

stock=${LLAMA_SERVER_STOCK:-$("$mcb_repo/scripts/llama/build.sh" stock | tail -n 1)}
mcb=$(mcb_bin "$work")
te=$(te_lib "$work/te")
model_file bench "$work/bench.gguf"
directory_start "${PROXY_TEST_DIRECTORY:-auto}" "$work/directory"

max=0
for p in $prefixes; do ((p > max)) && max=$p; done
ctx=$(((max + 2 * suffix + 64) * 2))
for s in s1 s2; do
	mkdir -p "$slots/$s"
	srv_start "$s" "$work/$s.log" "$stock" -m "$work/bench.gguf" -c "$ctx" -np 2 -t "$threads" --no-webui \
		--cache-ram 0 --slot-save-path "$slots/$s"
done
cfg=$(bridge_config "/proxybench-$$")
px_start p1 "$work/p1.log" "${srv_urls[s1]}" "$slots/s1" "$cfg" -v
px_start p2 "$work/p2.log" "${srv_urls[s2]}" "$slots/s2" "$cfg" -v

# timed URL BODY OUTFILE: the wall time of one request, in ms.
timed() {
	curl -fsS --max-time 900 -o "$3" -w '%{time_total}' -H 'Content-Type: application/json' -d "$2" "$1" |
		awk '{ printf "%.1f", $1 * 1000 }'
}
median() { tr ' ' '\n' | grep . | sort -n | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
# erase: both of server 2's slots emptied, through proxy 2 so that it knows.
erase() {
	local i
	for i in 0 1; do
		curl -fsS -o /dev/null -X POST -H 'Content-Type: application/json' -d '{}' "${px_urls[p2]}/slots/$i?action=erase"
	done
}

rows=()
for p in $prefixes; do
	prefix=$(ids "$p" 7 3)
	log "--- shared prefix $p ---"
	# Proxy 1 computes P + its own suffix and publishes the blocks.
	px_post p1 /completion "$(request "$(cat_ids "$prefix" "$(ids "$suffix" 5 11)")" 1)" >/dev/null
	px_synced p1 p2 || die "proxy 2 never saw proxy 1's blocks"

	stock_ms=()
	for r in $(seq "$stock_reps"); do
		erase
		stock_ms+=("$(timed "${srv_urls[s2]}/completion" "$(request "$(cat_ids "$prefix" "$(ids "$suffix" 3 $((17 + r)))")" 1)" "$work/stock.json")")
		log "stock: ${stock_ms[-1]} ms ($(jq -c '.timings | {cache_n, prompt_n, prompt_ms}' "$work/stock.json"))"
	done
	erase
	proxy_ms=() local_ms=() restore_ms=() restored=()
	for r in $(seq "$reps"); do
		erase
		proxy_ms+=("$(timed "${px_urls[p2]}/completion" "$(request "$(cat_ids "$prefix" "$(ids "$suffix" 3 $((40 + r)))")" 1)" "$work/proxy.json")")
		restored+=("$(jq .timings.mcb_restored_n "$work/proxy.json")")
		restore_ms+=("$(jq .timings.mcb_restore_ms "$work/proxy.json")")
		log "proxy: ${proxy_ms[-1]} ms ($(jq -c '.timings | {mcb_restored_n, mcb_restore_ms, cache_n, prompt_n, prompt_ms}' "$work/proxy.json"))"
		log "  $(grep 'mcbridge proxy: restored' "$work/p2.log" | tail -n 1 | grep -o 'bytes=.*')"
		px_idle p2 # it saves the new suffix block holding the slot
		local_ms+=("$(timed "${px_urls[p2]}/completion" "$(request "$(cat_ids "$prefix" "$(ids "$suffix" 9 $((60 + r)))")" 1)" "$work/local.json")")
		log "local: ${local_ms[-1]} ms ($(jq -c '.timings | {mcb_restored_n, cache_n, prompt_n, prompt_ms}' "$work/local.json"))"
	done
	row=$(jq -cn --argjson p "$p" --argjson s "$suffix" \
		--argjson stock "$(printf '%s\n' "${stock_ms[@]}" | jq -s .)" \
		--argjson proxy "$(printf '%s\n' "${proxy_ms[@]}" | jq -s .)" \
		--argjson local "$(printf '%s\n' "${local_ms[@]}" | jq -s .)" \
		--argjson restored "$(printf '%s\n' "${restored[@]}" | jq -s .)" \
		--argjson rms "$(printf '%s\n' "${restore_ms[@]}" | jq -s .)" \
		--argjson sm "$(echo "${stock_ms[*]}" | median)" --argjson pm "$(echo "${proxy_ms[*]}" | median)" \
		--argjson lm "$(echo "${local_ms[*]}" | median)" --argjson rm "$(echo "${restore_ms[*]}" | median)" \
		'{shared_tokens: $p, own_tokens: $s, stock_ttft_ms: $sm, proxy_ttft_ms: $pm, local_ttft_ms: $lm,
		  speedup: (($sm / $pm * 100 | round) / 100), restore_ms: $rm, overhead_over_local_ms: ((($pm - $lm) * 10 | round) / 10),
		  restored_tokens: $restored, samples: {stock: $stock, proxy: $proxy, local: $local, restore_ms: $rms}}')
	rows+=("$row")
done

mkdir -p "$(dirname "$out")"
jq -n --argjson rows "$(printf '%s\n' "${rows[@]}" | jq -s .)" --arg model "mcbridge-bench (internal/gguf preset bench)" \
	--arg dir "$dir_mode" --argjson threads "$threads" --arg host "$(uname -n)" --argjson cores "$(nproc)" \
	--argjson secs $((SECONDS - start)) --arg slotfs "$(df --output=fstype "$slots" | tail -n 1)" \
	--argjson load "$(awk '{ print $1 }' /proc/loadavg)" \
	'{what: "TTFT through mcbridge proxy (stock llama-server v0.5.0, slot files) vs the stock server alone",
	  model: $model, block_tokens: 64, directory: $dir, transport: "mooncake (mock TE)", arbiter: "cost-model",
	  llama_threads: $threads, host: $host, cores: $cores, slot_dir_fs: $slotfs, load_average_at_end: $load,
	  seconds: $secs, results: $rows}' >"$out"
log "wrote $out"
printf '%8s %12s %12s %12s %8s %11s\n' shared stock_ms proxy_ms local_ms speedup restore_ms
jq -r '.results[] | [.shared_tokens, .stock_ttft_ms, .proxy_ttft_ms, .local_ttft_ms, .speedup, .restore_ms] | @tsv' "$out" |
	while IFS=$'\t' read -r a b c d e f; do printf '%8s %12s %12s %12s %8s %11s\n' "$a" "$b" "$c" "$d" "$e" "$f"; done
