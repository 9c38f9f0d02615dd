# shellcheck shell=bash disable=SC2034 # its variables are used by the scripts sourcing it
# Shared by scripts/proxy/*.sh; sourced, not run. Builds on scripts/server/lib.sh (stock
# llama-servers, etcd, token-id prompts) and adds `mcbridge proxy` processes in front of
# them and a directory for several proxies: an etcd server, or a store node
# (`mcbridge serve --embed-etcd`) when no etcd binary is installed.

# shellcheck source=scripts/server/lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/../server" && pwd)/lib.sh"

declare -A px_pids=() px_urls=()
store_pid=

# mcb_bin DIR: builds cmd/mcbridge into DIR and prints the binary's path.
mcb_bin() {
	(cd "$mcb_repo" && go build -o "$1/mcbridge" ./cmd/mcbridge) || die "cmd/mcbridge did not build"
	echo "$1/mcbridge"
}

# te_lib DIR: the mock Transfer Engine: MCB_TE_MOCK_LIB, the top-level build's, or one
# built into DIR.
te_lib() {
	if [[ -n ${MCB_TE_MOCK_LIB:-} ]]; then
		echo "$MCB_TE_MOCK_LIB"
	elif [[ -f $mcb_repo/build/libmooncake_te_mock.so ]]; then
		echo "$mcb_repo/build/libmooncake_te_mock.so"
	else
		mock_te_lib "$1"
	fi
}

# directory_start MODE DIR: a directory the proxies share, "etcd" (an etcd server) or
# "store" (a store node embedding etcd, which also keeps copies of the blocks); sets
# dir_url, the etcd endpoint. MODE "auto" takes etcd when its binary is there. Uses the
# caller's mcb (mcb_bin) and te (te_lib).
# shellcheck disable=SC2154
directory_start() {
	local mode=$1 dir=$2 port
	if [[ $mode == auto ]]; then
		mode=store
		[[ -x ${MCB_ETCD_BIN:-/usr/bin/etcd} ]] && mode=etcd
	fi
	case $mode in
	etcd)
		etcd_start "$dir" || die "etcd did not start"
		dir_url=$etcd_url
		;;
	store)
		port=$(free_port_pair)
		dir_url=http://127.0.0.1:$port
		# The store's own config: the same transport as the proxies', an etcd it embeds.
		"$mcb" serve --embed-etcd --etcd-dir "$dir" --etcd-client-url "$dir_url" --listen 127.0.0.1:0 \
			--config "$(jq -cn --arg lib "$te" '{transport: {kind: "mooncake", lib: $lib}, pool_bytes: 268435456}')" \
			>"$dir.out" 2>"$dir.log" &
		store_pid=$!
		for _ in $(seq 300); do
			[[ -s $dir.out ]] && curl -fsS "$dir_url/health" >/dev/null 2>&1 && break
			kill -0 "$store_pid" 2>/dev/null || { tail -n 20 "$dir.log" >&2; die "the store node exited"; }
			sleep 0.1
		done
		[[ -s $dir.out ]] || die "the store node did not start; log $dir.log"
		log "store node pid $store_pid, embedded etcd on $dir_url"
		;;
	*) die "directory mode $mode: etcd, store or auto" ;;
	esac
	dir_mode=$mode
}

directory_stop() {
	etcd_stop
	if [[ -n ${store_pid:-} ]]; then
		kill -TERM "$store_pid" 2>/dev/null || true
		wait "$store_pid" 2>/dev/null || true
		store_pid=
	fi
}

# bridge_config PREFIX [POLICY]: the proxies' configuration: the shared directory under
# PREFIX, the mock Transfer Engine, 64-token blocks.
bridge_config() {
	jq -cn --arg e "$dir_url" --arg p "$1" --arg lib "$te" --arg pol "${2:-cost-model}" \
		'{block_tokens: 64, pool_bytes: 268435456, directory: {kind: "etcd", endpoints: [$e], prefix: $p},
		  transport: {kind: "mooncake", lib: $lib}, arbiter: {policy: $pol}}'
}

# px_start NAME LOG UPSTREAM SLOT_DIR CONFIG [FLAGS...]: a proxy on a free loopback
# port in front of UPSTREAM, healthy and with its model learned; sets px_urls[NAME].
px_start() {
	local name=$1 logf=$2 upstream=$3 slots=$4 cfg=$5 pid listen
	shift 5
	"$mcb" proxy --upstream "$upstream" --listen 127.0.0.1:0 --slot-dir "$slots" --config "$cfg" "$@" \
		>"$logf.out" 2>"$logf" &
	pid=$!
	for _ in $(seq 600); do
		[[ -s $logf.out ]] && break
		kill -0 "$pid" 2>/dev/null || { tail -n 20 "$logf" >&2; die "proxy $name exited"; }
		sleep 0.1
	done
	listen=$(head -n 1 "$logf.out" | jq -r .listen)
	[[ -n $listen && $listen != null ]] || die "proxy $name printed no address; log $logf"
	px_pids[$name]=$pid
	px_urls[$name]=http://$listen
	log "proxy $name pid $pid on ${px_urls[$name]} -> $upstream ($(head -n 1 "$logf.out" | jq -c '{bridge, fingerprint}'))"
}

# px_stop NAME: SIGTERM (it finishes publishing and unpublishes its blocks); safe twice.
px_stop() {
	local pid=${px_pids[$1]:-}
	[[ -n $pid ]] || return 0
	kill -TERM "$pid" 2>/dev/null || true
	wait "$pid" 2>/dev/null || true
	unset "px_pids[$1]" "px_urls[$1]"
}

px_stop_all() {
	local name
	for name in "${!px_pids[@]}"; do
		px_stop "$name"
	done
}

# px_post NAME PATH JSON: the response body.
px_post() {
	curl -fsS --max-time 900 -H 'Content-Type: application/json' -d "$3" "${px_urls[$1]}$2"
}

# px_metric NAME SERIES: a series of the proxy's /metrics (0 when absent).
px_metric() {
	curl -fsS --max-time 30 "${px_urls[$1]}/metrics" | awk -v s="$2" '$1 == s { v = $2 } END { print v + 0 }'
}

# px_state NAME FIELD: a field of the proxy's /healthz.
px_state() {
	curl -fsS --max-time 30 "${px_urls[$1]}/healthz" | jq -r ".$2"
}

# px_wait NAME WHAT SERIES|FIELD N: waits up to 30 s until the metric (WHAT=metric) or
# the /healthz field (WHAT=state) reaches N.
px_wait() {
	local name=$1 what=$2 key=$3 n=$4 v=0
	for _ in $(seq 300); do
		if [[ $what == metric ]]; then v=$(px_metric "$name" "$key"); else v=$(px_state "$name" "$key"); fi
		((v >= n)) && return 0
		sleep 0.1
	done
	log "proxy $name: $key is $v after 30s, waited for $n"
	return 1
}

# px_idle NAME: waits up to 60 s until the proxy has saved and published every answer.
px_idle() {
	local n
	for _ in $(seq 600); do
		n=$(px_state "$1" pending)
		[[ $n == 0 ]] && return 0
		sleep 0.1
	done
	log "proxy $1: $n answers still pending after 60s"
	return 1
}

# px_synced A B: waits until proxy A has published everything and proxy B's mirror of the
# directory holds at least as many blocks as A's.
px_synced() {
	px_idle "$1" || return 1
	px_wait "$2" state mirrored_blocks "$(px_state "$1" mirrored_blocks)"
}

# request PROMPT N_PREDICT [EXTRA]: a greedy completion request of a token-id prompt.
request() {
	jq -cn --argjson p "$1" --argjson n "$2" --argjson x "${3:-{\}}" \
		'{prompt: $p, n_predict: $n, temperature: 0, seed: 42, return_tokens: true} + $x'
}
