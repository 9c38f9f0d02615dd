#!/usr/bin/env bash
# test.sh: llama.cpp with mcbridge, end to end, on 127.0.0.1 only. Exits non-zero when a
# check fails.
#
#   1. the series builds the stock tree when MCBRIDGE_ROOT is unset: every patched file
#      minus its LLAMA_MCBRIDGE blocks is the pristine file;
#   2. stage 2 against real contexts (llama-mcbridge-test): byte-identical K/V after a
#      restore into scattered cells, FA on and off; another model, K type or V layout
#      restores nothing; rollback; clean marks;
#   3. one patched server, -np 2, for flash attention on and off, and with one KV stream
#      shared by the slots (-kvu): slot 0 computes
#      prefix+A, slot 1 gets prefix+B and restores the shared full blocks; both greedy
#      completions are token-identical to a stock server's; a third prompt on slot 0
#      keeps its own longer prefix; the bridge off, and a bad bridge config, answer
#      exactly as stock; tenants do not share;
#   4. two patched servers (two processes) sharing KV through etcd and the mock Mooncake
#      Transfer Engine, when the bridge accepts those config kinds (skipped, saying so,
#      otherwise); there a model or configuration mismatch restores nothing, and a
#      restore from a killed holder fails over to computing, with stock's answer.
#
#   LLAMA_SERVER_STOCK / LLAMA_SERVER_PATCHED  binaries to use instead of building
#   MCB_TEST_KEEP=1                            keep the work directory (logs)
set -euo pipefail
# shellcheck source=scripts/server/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need curl jq go cmake

work=$(mktemp -d "${TMPDIR:-/tmp}/mcb-server-test.XXXXXX")
cleanup() {
	srv_stop_all
	etcd_stop
	if [[ ${MCB_TEST_KEEP:-0} == 1 ]]; then
		log "work directory kept: $work"
	else
		rm -rf "$work"
	fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

failures=0

# --- builds -------------------------------------------------------------------------

stock=${LLAMA_SERVER_STOCK:-$("$mcb_repo/scripts/llama/build.sh" stock | tail -n 1)}
patched=${LLAMA_SERVER_PATCHED:-$("$mcb_repo/scripts/llama/build.sh" patched | tail -n 1)}
patched_build=$(dirname "$(dirname "$patched")")
log "building llama-mcbridge-test in $patched_build"
cmake --build "$patched_build" --target llama-mcbridge-test -j "$(nproc)" >"$work/build-test.log" 2>&1 ||
	{ tail -n 30 "$work/build-test.log" >&2; die "llama-mcbridge-test did not build"; }

model_file tiny "$work/tiny.gguf"
model_file tiny "$work/tiny-seed2.gguf" -seed 2

# --- 1. the patched tree without MCBRIDGE_ROOT is the stock tree --------------------

# strip_hooks FILE: FILE without its "#ifdef LLAMA_MCBRIDGE ... #endif" blocks (the
# series never nests them).
strip_hooks() {
	awk '/^#ifdef LLAMA_MCBRIDGE$/ { skip = 1; next } skip && /^#endif$/ { skip = 0; next } !skip' "$1"
}
stock_tree() {
	local src patched_src f n=0
	src=$("$mcb_repo/scripts/llama/fetch.sh" | tail -n 1)
	patched_src=$(dirname "$patched_build")/src
	while read -r f; do
		[[ $f == CMakeLists.txt ]] && continue # the hook itself, guarded by if (MCBRIDGE_ROOT)
		if ! diff -B <(strip_hooks "$patched_src/$f") "$src/$f" >"$work/strip.diff"; then
			log "$f differs from the pristine file outside LLAMA_MCBRIDGE blocks:"
			head -n 20 "$work/strip.diff" >&2
			return 1
		fi
		n=$((n + 1))
	done < <(sed -n 's|^diff --git a/\(.*\) b/.*$|\1|p' "$mcb_repo"/llama-patches/[0-9]*.patch | sort -u)
	grep -q '^if (MCBRIDGE_ROOT)$' "$patched_src/CMakeLists.txt" && ((n > 0))
}
expect "the series changes nothing outside LLAMA_MCBRIDGE blocks and the if (MCBRIDGE_ROOT) hook" stock_tree

# --- 2. stage 2 inside one process --------------------------------------------------

if "$patched_build/bin/llama-mcbridge-test" "$work/tiny.gguf" "$work/tiny-seed2.gguf" >"$work/stage2.log" 2>&1; then
	pass "stage 2 against real contexts: $(grep -c '^ok ' "$work/stage2.log") checks"
else
	grep -E '^(FAIL|llama-mcbridge-test)' "$work/stage2.log" >&2 || tail -n 30 "$work/stage2.log" >&2
	fail "stage 2 against real contexts (log: $work/stage2.log)"
fi

# --- 3. one server, two slots -------------------------------------------------------

block=64
prefix=$(ids 600 7 3)
shared=$((600 / block * block))
pa=$(cat_ids "$prefix" "$(ids 50 11 5)")
pb=$(cat_ids "$prefix" "$(ids 70 13 9)")
pc=$(cat_ids "$prefix" "$(ids 40 17 1)")
config='{"block_tokens": '$block'}'
n_predict=16

# The same arguments for every server of a comparison: slot contexts, streams and batch
# sizes stay equal, so only the bridge differs. MODE: on, off (flash attention) or
# on-kvu (flash attention on, one KV stream for both slots).
server_args() {
	local fa=${2%-kvu}
	echo -m "$1" -c 4096 -np 2 -t 2 -fa "$fa" --no-webui --cache-ram 0 --metrics
	[[ $2 == *-kvu ]] && echo -kvu
	return 0
}

# run_prompts NAME OUT: slot 0 prefix+A, slot 1 prefix+B, slot 0 prefix+C, in order; the
# responses one per line in OUT.
run_prompts() {
	{
		complete "$1" "$pa" 0 $n_predict
		echo
		complete "$1" "$pb" 1 $n_predict
		echo
		complete "$1" "$pc" 0 $n_predict
		echo
	} >"$2"
}
field() { sed -n "${2}p" "$1" | jq -c "$3"; } # field FILE LINE FILTER

for fa in on off on-kvu; do
	# shellcheck disable=SC2046 # server_args is a word list
	srv_start stock "$work/stock-$fa.log" "$stock" $(server_args "$work/tiny.gguf" $fa)
	run_prompts stock "$work/stock-$fa.out"
	srv_stop stock

	# The bridge off: no flag, no MCB_CONFIG.
	# shellcheck disable=SC2046
	MCB_CONFIG='' srv_start off "$work/off-$fa.log" "$patched" $(server_args "$work/tiny.gguf" $fa)
	run_prompts off "$work/off-$fa.out"
	srv_stop off
	for i in 1 2 3; do
		expect "fa $fa, bridge off, prompt $i: the same tokens as stock" \
			test "$(field "$work/off-$fa.out" $i .tokens)" == "$(field "$work/stock-$fa.out" $i .tokens)"
	done
	expect "fa $fa, bridge off: no mcb timings, and the log says why" \
		test "$(field "$work/off-$fa.out" 1 '[.timings | keys[] | select(startswith("mcb"))] | length')" == 0 -a \
		"$(bridge_state "$work/off-$fa.log")" != on

	# shellcheck disable=SC2046
	srv_start on "$work/on-$fa.log" "$patched" $(server_args "$work/tiny.gguf" $fa) --mcb-config "$config"
	expect "fa $fa: the bridge is on" test "$(bridge_state "$work/on-$fa.log")" == on
	run_prompts on "$work/on-$fa.out"
	restored_metric=$(srv_metric on mcbridge_restored_tokens_total)
	srv_stop on
	for i in 1 2 3; do
		expect "fa $fa, prompt $i: the same tokens as stock ($(field "$work/on-$fa.out" $i .tokens))" \
			test "$(field "$work/on-$fa.out" $i .tokens)" == "$(field "$work/stock-$fa.out" $i .tokens)"
	done
	expect "fa $fa: slot 0 finds nothing and computes prefix+A" \
		test "$(field "$work/on-$fa.out" 1 '[.timings.mcb_decision, .timings.mcb_restored_n]')" == '["miss",0]'
	expect "fa $fa: slot 1 restores the $shared tokens of the shared full blocks" \
		test "$(field "$work/on-$fa.out" 2 '[.timings.mcb_decision, .timings.mcb_restored_n, .timings.cache_n]')" == \
		"[\"restore\",$shared,$shared]"
	expect "fa $fa: slot 0 keeps its own longer prefix for prefix+C" \
		test "$(field "$work/on-$fa.out" 3 '[.timings.mcb_decision, .timings.mcb_restored_n, .timings.cache_n]')" == \
		'["local",0,600]'
	expect "fa $fa: /metrics counts the $shared restored tokens" test "$restored_metric" == "$shared"
done

# A configuration the bridge refuses leaves the server as stock.
# shellcheck disable=SC2046
srv_start bad "$work/bad.log" "$patched" $(server_args "$work/tiny.gguf" on) --mcb-config '{"no_such_key": 1}'
out=$(complete bad "$pa" 0 $n_predict)
srv_stop bad
expect "a bad bridge config: the bridge stays off ($(bridge_state "$work/bad.log")) and the answer is stock's" \
	test "$(jq -c .tokens <<<"$out")" == "$(field "$work/stock-on.out" 1 .tokens)" -a \
	"$(bridge_state "$work/bad.log")" != on

# Tenants: blocks saved under one tenant are invisible to another.
prefix2=$(ids 600 3 100)
# shellcheck disable=SC2046
srv_start tenants "$work/tenants.log" "$patched" $(server_args "$work/tiny.gguf" on) --mcb-config "$config"
complete tenants "$(cat_ids "$prefix2" "$(ids 30 5 2)")" 0 4 '{"mcb_tenant": "alpha"}' >/dev/null
beta=$(complete tenants "$(cat_ids "$prefix2" "$(ids 30 7 3)")" 1 4 '{"mcb_tenant": "beta"}')
complete tenants "$(ids 300 9 50)" 1 4 >/dev/null # slot 1 forgets prefix2
alpha=$(complete tenants "$(cat_ids "$prefix2" "$(ids 30 11 4)")" 1 4 '{"mcb_tenant": "alpha"}')
srv_stop tenants
expect "tenant beta does not see tenant alpha's blocks" \
	test "$(jq -c '[.timings.mcb_decision, .timings.mcb_restored_n]' <<<"$beta")" == '["miss",0]'
expect "tenant alpha does" \
	test "$(jq -c '[.timings.mcb_decision, .timings.mcb_restored_n]' <<<"$alpha")" == "[\"restore\",$shared]"

# --- 4. two processes ---------------------------------------------------------------

two_servers() {
	local te cfg state
	if ! etcd_start "$work/etcd"; then
		log "SKIP two servers: no etcd server could be started (${MCB_ETCD_BIN:-/usr/bin/etcd})"
		return
	fi
	te=$(mock_te_lib "$work/te") || { fail "the mock Transfer Engine did not build"; return; }
	cfg=$(jq -cn --arg e "$etcd_url" --arg lib "$te" --argjson b $block \
		'{block_tokens: $b, directory: {kind: "etcd", endpoints: [$e]}, transport: {kind: "mooncake", lib: $lib}}')
	# shellcheck disable=SC2046
	srv_start x "$work/x.log" "$patched" $(server_args "$work/tiny.gguf" on) --mcb-config "$cfg"
	state=$(bridge_state "$work/x.log")
	if [[ $state != on ]]; then
		case $state in
		*unsupported* | *"not built in"*)
			log "SKIP two servers: this bridge does not take the etcd directory and mooncake transport yet ($state)"
			return
			;;
		esac
		fail "two servers: the bridge did not open with etcd and the mock TE: $state"
		return
	fi
	# shellcheck disable=SC2046
	srv_start y "$work/y.log" "$patched" $(server_args "$work/tiny.gguf" on) --mcb-config "$cfg"
	complete x "$pa" 0 $n_predict >/dev/null
	out=$(complete y "$pb" 1 $n_predict)
	expect "two servers: y restores the $shared shared tokens that x computed" \
		test "$(jq -c '[.timings.mcb_decision, .timings.mcb_restored_n]' <<<"$out")" == "[\"restore\",$shared]"
	expect "two servers: y's answer is stock's" \
		test "$(jq -c .tokens <<<"$out")" == "$(field "$work/stock-on.out" 2 .tokens)"
	srv_stop y

	# What must never share: other weights, another K type, another V layout.
	local name args
	for name in seed2 bf16k fa-off; do
		case $name in
		seed2) args=$(server_args "$work/tiny-seed2.gguf" on) ;;
		bf16k) args="$(server_args "$work/tiny.gguf" on) -ctk bf16" ;;
		fa-off) args=$(server_args "$work/tiny.gguf" off) ;;
		esac
		# shellcheck disable=SC2086
		srv_start "$name" "$work/$name.log" "$patched" $args --mcb-config "$cfg"
		out=$(complete "$name" "$pb" 1 4)
		srv_stop "$name"
		expect "two servers, $name against x: nothing restored" \
			test "$(jq -c '[.timings.mcb_decision, .timings.mcb_restored_n]' <<<"$out")" == '["miss",0]'
	done

	# x dies without unpublishing; its entries outlive it until its lease runs out, so
	# a new server finds the blocks, fails to read them, and computes the prompt.
	kill -KILL "${srv_pids[x]}"
	srv_stop x
	# shellcheck disable=SC2046
	srv_start z "$work/z.log" "$patched" $(server_args "$work/tiny.gguf" on) --mcb-config "$cfg"
	out=$(complete z "$pb" 1 $n_predict)
	srv_stop z
	expect "two servers, x killed: z's restore fails ($(jq -r .timings.mcb_error <<<"$out"))" \
		test "$(jq -c '[.timings.mcb_decision, .timings.mcb_restored_n, .timings.cache_n]' <<<"$out")" == '["failed",0,0]'
	expect "two servers, x killed: z computes the prompt and answers as stock" \
		test "$(jq -c .tokens <<<"$out")" == "$(field "$work/stock-on.out" 2 .tokens)"
	etcd_stop
}
two_servers

if ((failures > 0)); then
	log "$failures checks failed (logs: MCB_TEST_KEEP=1 keeps $work)"
	exit 1
fi
log "all checks passed"
