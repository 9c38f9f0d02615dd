#!/usr/bin/env bash
# run.sh: the swarm demo (`make demo`). Agents share a long prefix ("system prompt +
# tools", 4096 tokens by default) and each adds its own task; their requests go round-
# robin to three patched llama-servers that share KV through mcbridge: a store node
# (`mcbridge serve --embed-etcd`, the directory and a DRAM pool) and the mock Mooncake
# Transfer Engine between the processes. Only the first agent computes the prefix; the
# others restore it, whichever server they land on.
#
# For every request the table shows the tokens restored, the time to first token with
# mcbridge and without it (the same request on a stock llama-server that has nothing
# cached), and whether the two greedy completions are the same tokens.
#
# Without a store node (no `serve --embed-etcd` in cmd/mcbridge) the demo falls back to
# one patched server with three slots and the in-process bridge, and says so.
#
#   DEMO_AGENTS   requests (default 6)
#   DEMO_PREFIX   shared prefix tokens (default 4096)
#   DEMO_SUFFIX   tokens of the first agent's own task (default 64; each next agent +8)
#   DEMO_THREADS  llama-server -t (default 2)
#   DEMO_PREDICT  tokens generated per request (default 16)
set -euo pipefail
# shellcheck source=scripts/server/lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/../server" && pwd)/lib.sh"
need curl jq go cmake column

agents=${DEMO_AGENTS:-6}
prefix_n=${DEMO_PREFIX:-4096}
suffix_n=${DEMO_SUFFIX:-64}
threads=${DEMO_THREADS:-2}
n_predict=${DEMO_PREDICT:-16}
n_servers=3

work=$(mktemp -d "${TMPDIR:-/tmp}/mcb-demo.XXXXXX")
store_pid=
cleanup() {
	srv_stop_all
	if [[ -n $store_pid ]]; then
		kill -TERM "$store_pid" 2>/dev/null || true
		wait "$store_pid" 2>/dev/null || true
	fi
	rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
start=$SECONDS

# --- builds ---------------------------------------------------------------------------
log "building llama-server (patched and stock), the mcbridge command and the mock Transfer Engine"
patched=$("$mcb_repo/scripts/llama/build.sh" patched | tail -n 1)
stock=$("$mcb_repo/scripts/llama/build.sh" stock | tail -n 1)
demo_cache=$mcb_cache/demo
mkdir -p "$demo_cache"
mcbridge_bin=$demo_cache/mcbridge
store=no
serve_help=
if (cd "$mcb_repo" && CGO_ENABLED=1 go build -trimpath -o "$mcbridge_bin" ./cmd/mcbridge) >"$work/go-build.log" 2>&1; then
	serve_help=$("$mcbridge_bin" serve -h 2>&1 || true) # -h exits non-zero
fi
if grep -q -- -embed-etcd <<<"$serve_help"; then
	store=yes
	te=$(mock_te_lib "$demo_cache/te")
else
	log "no store node (mcbridge serve --embed-etcd did not build or is missing: $work/go-build.log):"
	log "falling back to one patched llama-server with $n_servers slots and the in-process bridge"
fi
model_file bench "$work/bench.gguf"

ctx=$((prefix_n + suffix_n + 8 * agents + n_predict + 256))
common=(-m "$work/bench.gguf" -t "$threads" --no-webui --cache-ram 0 --metrics)

# --- the swarm ------------------------------------------------------------------------
if [[ $store == yes ]]; then
	port=$(free_port_pair)
	http=$(free_port)
	etcd_url=http://127.0.0.1:$port
	transport=$(jq -cn --arg lib "$te" '{kind: "mooncake", lib: $lib}')
	"$mcbridge_bin" serve --embed-etcd --etcd-dir "$work/etcd" --etcd-client-url "$etcd_url" \
		--listen "127.0.0.1:$http" --config "$(jq -cn --argjson t "$transport" '{transport: $t}')" \
		>"$work/store.out" 2>"$work/store.log" &
	store_pid=$!
	for _ in $(seq 300); do
		curl -fsS "http://127.0.0.1:$http/healthz" >/dev/null 2>&1 && break
		kill -0 "$store_pid" 2>/dev/null || { tail -n 20 "$work/store.log" >&2; die "the store node exited"; }
		sleep 0.1
	done
	log "store node pid $store_pid: $(head -n 1 "$work/store.out"), etcd $etcd_url"
	config=$(jq -cn --arg e "$etcd_url" --argjson t "$transport" '{directory: {kind: "etcd", endpoints: [$e]}, transport: $t}')
	for s in $(seq "$n_servers"); do
		srv_start "s$s" "$work/s$s.log" "$patched" "${common[@]}" -c "$ctx" -np 1 --mcb-config "$config"
		[[ $(bridge_state "$work/s$s.log") == on ]] || die "server s$s: the bridge is off: $(bridge_state "$work/s$s.log")"
	done
	target() { echo "s$((($1 - 1) % n_servers + 1)) 0"; } # server, slot
	where="$n_servers llama-servers + a store node (etcd directory, mock Mooncake TE)"
else
	srv_start s1 "$work/s1.log" "$patched" "${common[@]}" -c $((n_servers * ctx)) -np "$n_servers" --mcb-config '{}'
	[[ $(bridge_state "$work/s1.log") == on ]] || die "the bridge is off: $(bridge_state "$work/s1.log")"
	target() { echo "s1 $((($1 - 1) % n_servers))"; }
	where="1 llama-server with $n_servers slots (in-process bridge)"
fi
srv_start stock "$work/stock.log" "$stock" "${common[@]}" -c "$ctx" -np 1

# The shared prefix and each agent's own task, as token ids.
prefix=$(ids "$prefix_n" 7 3)
task() { ids $((suffix_n + 8 * ($1 - 1))) $((11 + 2 * $1)) "$1"; }

rows=()
for a in $(seq "$agents"); do
	read -r srv slot <<<"$(target "$a")"
	prompt=$(cat_ids "$prefix" "$(task "$a")")
	n=$(jq length <<<"$prompt")
	log "agent $a -> $srv (slot $slot): $n prompt tokens"
	with=$(complete "$srv" "$prompt" "$slot" "$n_predict")
	# Without mcbridge: the same request where nothing of it is cached.
	without=$(complete stock "$prompt" 0 "$n_predict" '{"cache_prompt": false}')
	rows+=("$(jq -rn --argjson a "$a" --arg s "$srv" --argjson n "$n" --argjson w "$with" --argjson o "$without" '
		[$a, $s, $n, $w.timings.mcb_restored_n, $w.timings.cache_n,
		 ($w.timings.mcb_decision + (if $w.timings.mcb_decision == "local" then " (own slot)" else "" end)),
		 ($w.timings.prompt_ms | floor), ($o.timings.prompt_ms | floor),
		 (($o.timings.prompt_ms / $w.timings.prompt_ms * 10 | floor) / 10 | tostring + "x"),
		 (if $w.tokens == $o.tokens then "yes" else "NO" end)] | @tsv')")
done

echo
echo "mcbridge swarm demo: $agents agents, $prefix_n shared tokens, bench model, $where"
{
	printf 'agent\tserver\tprompt\trestored\tcached\tdecision\tTTFT with (ms)\tTTFT without (ms)\tspeedup\tsame output\n'
	printf '%s\n' "${rows[@]}"
} | column -t -s $'\t'
echo
total=0
for s in "${!srv_urls[@]}"; do
	[[ $s == stock ]] && continue
	total=$((total + $(srv_metric "$s" mcbridge_restored_tokens_total)))
done
echo "restored across the swarm: $total tokens; TTFT is the server's prompt time (prompt start to first token)."
if [[ $store == yes ]]; then
	echo "store node: $(curl -fsS "http://127.0.0.1:$http/state" | jq -c '{blocks, bytes, pool_bytes}')"
fi
mismatch=$(printf '%s\n' "${rows[@]}" | awk -F'\t' '$NF != "yes"' | wc -l)
log "demo done in $((SECONDS - start))s"
((mismatch == 0)) || die "$mismatch requests gave other tokens with mcbridge than without"
