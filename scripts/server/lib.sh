# shellcheck shell=bash disable=SC2034 # its variables are used by the scripts sourcing it
# Shared by scripts/server/*.sh and scripts/demo/run.sh; sourced, not run. Builds on
# scripts/llama/lib.sh (log, die, model_file, start_server, stop_server, need) and adds
# several named llama-servers at once, token-id prompts and completions.

# shellcheck source=scripts/llama/lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/../llama" && pwd)/lib.sh"

# Check bookkeeping of the test scripts: each fail counts in $failures,
# which the caller sets to 0 and reports at the end.
pass() { log "ok   $*"; }
fail() {
	log "FAIL $*"
	failures=$((failures + 1))
}
expect() { # expect DESCRIPTION COMMAND...
	local what=$1
	shift
	if "$@"; then pass "$what"; else fail "$what"; fi
}

declare -A srv_pids=() srv_urls=()
server_pid=

# srv_start NAME LOG BIN ARGS...: a llama-server on a free loopback port, healthy.
srv_start() {
	local name=$1 logf=$2
	shift 2
	start_server "$1" "$logf" "${@:2}"
	srv_pids[$name]=$server_pid
	srv_urls[$name]=$server_url
	server_pid=
}

# srv_stop NAME: stops it; safe to call twice.
srv_stop() {
	local name=$1
	[[ -n ${srv_pids[$name]:-} ]] || return 0
	server_pid=${srv_pids[$name]}
	stop_server
	unset "srv_pids[$name]" "srv_urls[$name]"
}

srv_stop_all() {
	local name
	for name in "${!srv_pids[@]}"; do
		srv_stop "$name"
	done
}

# srv_post NAME PATH JSON: the response body.
srv_post() {
	curl -fsS --max-time 900 -H 'Content-Type: application/json' -d "$3" "${srv_urls[$1]}$2"
}

# srv_metric NAME SERIES: the value of a /metrics series (0 when absent).
srv_metric() {
	curl -fsS --max-time 30 "${srv_urls[$1]}/metrics" | awk -v s="$2" '$1 == s { v = $2 } END { print v + 0 }'
}

# ids N MUL OFF: a JSON array of N byte-token ids (no special tokens), (i*MUL+OFF) % 256.
ids() {
	awk -v n="$1" -v m="$2" -v off="$3" 'BEGIN { printf "["; for (i = 0; i < n; i++) printf "%s%d", (i ? "," : ""), (i * m + off) % 256; printf "]" }'
}

# cat_ids A B: the concatenation of two JSON arrays.
cat_ids() {
	jq -cn --argjson a "$1" --argjson b "$2" '$a + $b'
}

# complete NAME PROMPT SLOT N_PREDICT [EXTRA]: a greedy, seeded completion of a token-id
# prompt on one slot; EXTRA is a JSON object merged into the request.
complete() {
	local req
	req=$(jq -cn --argjson p "$2" --argjson s "$3" --argjson n "$4" --argjson x "${5:-{\}}" \
		'{prompt: $p, id_slot: $s, n_predict: $n, temperature: 0, seed: 42, return_tokens: true, cache_prompt: true} + $x')
	srv_post "$1" /completion "$req"
}

# free_port_pair: a loopback port P such that P and P+1 are free (etcd's client and
# peer ports).
free_port_pair() {
	local p
	for _ in $(seq 100); do
		p=$(free_port)
		if ! (exec 3<>"/dev/tcp/127.0.0.1/$((p + 1))") 2>/dev/null; then
			echo "$p"
			return
		fi
	done
	die "no free pair of loopback ports"
}

etcd_pid=

# etcd_start DIR: a single-member etcd on loopback with its data in DIR; sets etcd_url.
etcd_start() {
	local dir=$1 port bin=${MCB_ETCD_BIN:-/usr/bin/etcd}
	[[ -x $bin ]] || return 1
	port=$(free_port_pair)
	mkdir -p "$dir"
	chmod 700 "$dir"
	etcd_url=http://127.0.0.1:$port
	"$bin" --name=mcbtest --data-dir="$dir" \
		--listen-client-urls="$etcd_url" --advertise-client-urls="$etcd_url" \
		--listen-peer-urls="http://127.0.0.1:$((port + 1))" \
		--initial-advertise-peer-urls="http://127.0.0.1:$((port + 1))" \
		--initial-cluster="mcbtest=http://127.0.0.1:$((port + 1))" \
		--auto-compaction-mode=periodic --auto-compaction-retention=10m \
		--logger=zap --log-level=warn >"$dir.log" 2>&1 &
	etcd_pid=$!
	for _ in $(seq 100); do
		if curl -fsS "$etcd_url/health" 2>/dev/null | grep -q true; then
			log "etcd pid $etcd_pid on $etcd_url"
			return 0
		fi
		kill -0 "$etcd_pid" 2>/dev/null || break
		sleep 0.1
	done
	tail -n 20 "$dir.log" >&2
	return 1
}

etcd_stop() {
	[[ -n ${etcd_pid:-} ]] || return 0
	kill -TERM "$etcd_pid" 2>/dev/null || true
	wait "$etcd_pid" 2>/dev/null || true
	etcd_pid=
}

# mock_te_lib DIR: builds the mock Mooncake Transfer Engine into DIR (a private build
# directory, so that no one else's build is touched) and prints the library's path.
mock_te_lib() {
	local dir=$1
	cmake -S "$mcb_repo/mooncake-capi" -B "$dir" -DCMAKE_BUILD_TYPE=Release >/dev/null
	cmake --build "$dir" --target mooncake_te_mock -j "$(nproc)" >/dev/null
	echo "$dir/libmooncake_te_mock.so"
}

# bridge_state LOG: "on", or the reason the server logged for leaving the bridge off.
bridge_state() {
	local line
	line=$(grep -m1 -o 'mcbridge: \(on\|off\): .*' "$1" || true)
	case $line in
	"mcbridge: on: "*) echo on ;;
	"") echo "no mcbridge line in $1" ;;
	*) echo "${line#mcbridge: off: }" ;;
	esac
}
