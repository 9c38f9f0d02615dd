#!/usr/bin/env bash
# test.sh: `mcbridge proxy` in front of STOCK llama-servers (v0.5.0, no patch), end to
# end, on 127.0.0.1 only. Exits non-zero when a check fails. For each flash-attention
# setting (on, then off):
#
#   1. request 1, prefix+A, through proxy 1 in front of server 1: nothing restored; the
#      proxy saves the slot and publishes its full blocks;
#   2. request 2, prefix+B, through proxy 2 in front of server 2 (another process,
#      sharing KV through etcd and the mock Mooncake Transfer Engine, or a store node):
#      the 512 shared prefix tokens are restored and the greedy completion (temperature
#      0, token-id prompt, n_predict 16) is token-identical to a stock server's answer
#      without any proxy, streamed or not;
#   3. a chat request through proxy 2 restores the blocks proxy 1 published for a chat
#      with the same system prompt, and answers as the stock server;
#   4. a server with another model (other seed), and one with the other flash-attention
#      setting, behind proxies sharing the same directory: nothing restored, answers
#      unchanged.
#
#   LLAMA_SERVER_STOCK      llama-server to use instead of building scripts/llama/build.sh stock
#   PROXY_TEST_DIRECTORY    etcd | store | auto (default: etcd when installed, else store)
#   PROXY_TEST_FA           flash-attention settings to run (default "on off")
#   MCB_TEST_KEEP=1         keep the work directory (logs)
set -euo pipefail
# shellcheck source=scripts/proxy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need curl jq go

work=$(mktemp -d "${TMPDIR:-/tmp}/mcb-proxy-test.XXXXXX")
cleanup() {
	px_stop_all
	srv_stop_all
	directory_stop
	if [[ ${MCB_TEST_KEEP:-0} == 1 ]]; then
		log "work directory kept: $work"
	else
		rm -rf "$work"
	fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

failures=0

stock=${LLAMA_SERVER_STOCK:-$("$mcb_repo/scripts/llama/build.sh" stock | tail -n 1)}
mcb=$(mcb_bin "$work")
te=$(te_lib "$work/te")
model_file tiny "$work/tiny.gguf"
model_file tiny "$work/other.gguf" -seed 2
directory_start "${PROXY_TEST_DIRECTORY:-auto}" "$work/directory"
log "directory: $dir_mode on $dir_url, transport: mock TE $te"

block=64
prefix=$(ids 512 7 3)
pa=$(cat_ids "$prefix" "$(ids 40 5 11)")
pb=$(cat_ids "$prefix" "$(ids 40 3 17)")
shared=512
n_predict=16
system=$(printf 'You are agent %s of a swarm. Follow the repository conventions. ' $(seq 12))

# server NAME MODEL FA: a stock server with two slots and a slot directory of its own.
server() {
	mkdir -p "$work/slots-$1"
	srv_start "$1" "$work/$1.log" "$stock" -m "$2" -c 4096 -np 2 -t 1 --no-webui --cache-ram 0 \
		-fa "$3" --slot-save-path "$work/slots-$1"
}

# proxy NAME SERVER PREFIX: a proxy in front of SERVER's llama-server.
proxy() {
	px_start "$1" "$work/$1.log" "${srv_urls[$2]}" "$work/slots-$2" "$(bridge_config "$3" always-restore)"
}

restored() { jq -r '.timings.mcb_restored_n' <<<"$1"; }
tokens() { jq -c '.tokens' <<<"$1"; }
# events: a streamed answer's events without their timings. (The "tokens" of an event are
# not all its tokens: llama-server holds back tokens that end inside a UTF-8 character and
# sends them with the next event, listing only the last.)
events() { sed -n 's/^data: //p' | grep -v '^\[DONE\]' | jq -cs '[.[] | {content, tokens, stop}]'; }
# template_tokens USER: the tokens the stock server computes for a chat.
template_tokens() {
	local prompt
	prompt=$(srv_post ref /apply-template "$(chat "$1")" | jq -c '{content: .prompt, add_special: true}')
	srv_post ref /tokenize "$prompt" | jq -c .tokens
}
chat() { jq -cn --arg s "$system" --arg u "$1" '{messages: [{role: "system", content: $s}, {role: "user", content: $u}], max_tokens: 8, temperature: 0, seed: 42}'; }

round() {
	local fa=$1 other_fa=off pre=/proxytest-$1-$$ out ref n
	[[ $fa == off ]] && other_fa=on
	log "--- flash attention $fa ---"
	server s1 "$work/tiny.gguf" "$fa"
	server s2 "$work/tiny.gguf" "$fa"
	server ref "$work/tiny.gguf" "$fa"
	proxy p1 s1 "$pre"
	proxy p2 s2 "$pre"

	# 1. prefix+A through proxy 1.
	out=$(px_post p1 /completion "$(request "$pa" $n_predict)")
	expect "[fa $fa] request 1 restores nothing from an empty directory" test "$(restored "$out")" == 0
	expect "[fa $fa] request 1 answers as stock" \
		test "$(tokens "$out")" == "$(tokens "$(srv_post ref /completion "$(request "$pa" $n_predict '{"cache_prompt":false}')")")"
	n=$(((512 + 40 + n_predict - 1) / block))
	expect "[fa $fa] proxy 1 publishes the $n full blocks of its slot" px_wait p1 metric mcbridge_proxy_published_blocks_total $n
	expect "[fa $fa] proxy 2 sees them through the directory" px_wait p2 state mirrored_blocks $n

	# 2. prefix+B through proxy 2: the shared prefix is restored, the answer is stock's.
	ref=$(srv_post ref /completion "$(request "$pb" $n_predict '{"cache_prompt":false}')")
	out=$(px_post p2 /completion "$(request "$pb" $n_predict)")
	log "request 2 timings: $(jq -c .timings <<<"$out")"
	expect "[fa $fa] request 2 restores the $shared shared tokens" test "$(restored "$out")" == $shared
	expect "[fa $fa] server 2 computes only the rest" test "$(jq .timings.cache_n <<<"$out")" == $shared
	expect "[fa $fa] request 2 is token-identical to stock" test "$(tokens "$out")" == "$(tokens "$ref")"
	expect "[fa $fa] proxy 2 counts the restored tokens" \
		test "$(px_metric p2 mcbridge_restored_tokens_total)" == $shared
	# Streamed, on the other slot: the restore again, events passed through.
	local other=$((1 - $(jq .id_slot <<<"$out")))
	out=$(curl -fsSN --max-time 900 -H 'Content-Type: application/json' \
		-d "$(request "$pb" $n_predict "{\"stream\":true,\"id_slot\":$other}")" "${px_urls[p2]}/completion" | events)
	ref=$(curl -fsSN --max-time 900 -H 'Content-Type: application/json' \
		-d "$(request "$pb" $n_predict '{"stream":true,"cache_prompt":false}')" "${srv_urls[ref]}/completion" | events)
	expect "[fa $fa] the streamed answer is stock's, event by event" test "$out" == "$ref"
	expect "[fa $fa] the streamed request restored too" \
		test "$(px_metric p2 mcbridge_restored_tokens_total)" == $((2 * shared))

	# 3. chat: the same system prompt, other user messages.
	local ta tb lcp pub mirrored
	pub=$(px_metric p1 mcbridge_proxy_published_blocks_total)
	mirrored=$(px_state p2 mirrored_blocks)
	ta=$(template_tokens "first question")
	tb=$(template_tokens "another one")
	lcp=$(jq -n --argjson a "$ta" --argjson b "$tb" \
		'([$a, $b] | map(length) | min) as $n | [range(0; $n) | select($a[.] != $b[.])] | first // $n')
	n=$((lcp / block * block))
	out=$(px_post p1 /v1/chat/completions "$(chat "first question")")
	expect "[fa $fa] proxy 1 publishes the chat's blocks" px_wait p1 metric mcbridge_proxy_published_blocks_total $((pub + n / block))
	expect "[fa $fa] proxy 2 sees them" px_wait p2 state mirrored_blocks $((mirrored + n / block))
	out=$(px_post p2 /v1/chat/completions "$(chat "another one")")
	ref=$(srv_post ref /v1/chat/completions "$(chat "another one" | jq -c '. + {cache_prompt: false}')")
	expect "[fa $fa] a chat restores the $n tokens its template shares with another" test "$(restored "$out")" == "$n"
	expect "[fa $fa] the chat answer is stock's" \
		test "$(jq -c .choices <<<"$out")" == "$(jq -c .choices <<<"$ref")"

	# 4. what must not share: other weights, the other flash-attention setting.
	local name model sfa
	for name in other fa; do
		model=$work/tiny.gguf sfa=$other_fa
		[[ $name == other ]] && model=$work/other.gguf sfa=$fa
		server "s-$name" "$model" "$sfa"
		proxy "p-$name" "s-$name" "$pre"
		out=$(px_post "p-$name" /completion "$(request "$pb" $n_predict)")
		ref=$(srv_post "s-$name" /completion "$(request "$pb" $n_predict '{"cache_prompt":false}')")
		expect "[fa $fa] $name: nothing restored" test "$(restored "$out")" == 0
		expect "[fa $fa] $name: the answer is the server's own" test "$(tokens "$out")" == "$(tokens "$ref")"
		expect "[fa $fa] $name: another fingerprint" \
			test "$(px_state "p-$name" fingerprint)" != "$(px_state p1 fingerprint)"
		px_stop "p-$name"
		srv_stop "s-$name"
	done
	for name in p1 p2; do
		expect "[fa $fa] $name left no file in its slot directory" \
			test -z "$(ls -A "$work/slots-s${name#p}")"
	done
	px_stop_all
	srv_stop_all
}

for fa in ${PROXY_TEST_FA:-on off}; do
	round "$fa"
done

if ((failures > 0)); then
	log "$failures check(s) failed"
	exit 1
fi
log "all proxy checks passed ($dir_mode directory)"
