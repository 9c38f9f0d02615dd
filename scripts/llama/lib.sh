# shellcheck shell=bash disable=SC2034 # its variables are used by the scripts sourcing it
# Shared by the scripts in this directory; sourced, not run.
# Progress goes to stderr so that stdout carries only the result path (the last line),
# which Makefiles and other scripts capture with $(...).

mcb_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# shellcheck source=internal/llamapin/PIN
source "$mcb_repo/internal/llamapin/PIN"
mcb_cache=${MCB_CACHE:-$HOME/.cache/mcbridge}
llama_root=$mcb_cache/llama.cpp-$LLAMA_TAG

log() { printf '[llama %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# tree_id DIR: the git tree of DIR's checked-out commit, empty when DIR is not a git
# checkout or has uncommitted changes to tracked files (then the id would not describe it).
tree_id() {
	local dir=$1
	[[ -e $dir/.git ]] || return 0
	git -C "$dir" diff --quiet HEAD -- 2>/dev/null || return 0
	git -C "$dir" rev-parse --verify --quiet 'HEAD^{tree}' 2>/dev/null || true
}

# with_lock FILE CMD...: serialises CI jobs and engineers sharing one cache.
with_lock() {
	local lock=$1
	shift
	mkdir -p "$(dirname "$lock")"
	if command -v flock >/dev/null; then
		(
			flock 9
			"$@"
		) 9>"$lock"
	else
		"$@"
	fi
}

# model_file PRESET PATH [mcb-gguf flags]: writes a random-weight model with the repo's
# generator (internal/gguf).
model_file() {
	local preset=$1 path=$2
	shift 2
	(cd "$mcb_repo" && go run ./cmd/mcb-gguf -preset "$preset" -o "$path" "$@")
}

# free_port: a loopback port nothing listens on now (a refused connection).
free_port() {
	local port
	for _ in $(seq 100); do
		port=$((20000 + RANDOM % 40000))
		if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
			echo "$port"
			return
		fi
	done
	die "no free loopback port found"
}

# start_server BIN LOG ARGS...: starts llama-server on a free loopback port and waits
# until /health answers. Sets server_pid and server_url; a port taken between the
# probe and the bind is retried on another.
start_server() {
	local bin=$1 log=$2 port
	shift 2
	for _ in 1 2 3; do
		port=$(free_port)
		"$bin" --host 127.0.0.1 --port "$port" "$@" >"$log" 2>&1 &
		server_pid=$!
		server_url=http://127.0.0.1:$port
		for _ in $(seq 1200); do
			if curl -fsS "$server_url/health" >/dev/null 2>&1; then
				log "llama-server pid $server_pid on $server_url"
				return
			fi
			kill -0 "$server_pid" 2>/dev/null || break
			sleep 0.1
		done
		if kill -0 "$server_pid" 2>/dev/null; then
			stop_server
			die "llama-server not healthy after 120s; log $log"
		fi
		wait "$server_pid" || true
		server_pid=
		if ! grep -qi "bind\|address already in use" "$log"; then
			tail -n 30 "$log" >&2
			die "llama-server exited; log $log"
		fi
		log "port $port taken, retrying"
	done
	die "llama-server could not bind a port"
}

# stop_server: SIGTERM, then SIGKILL after 10s; safe to call twice (traps do).
stop_server() {
	[[ -n ${server_pid:-} ]] || return 0
	if kill -0 "$server_pid" 2>/dev/null; then
		kill -TERM "$server_pid" 2>/dev/null || true
		for _ in $(seq 100); do
			kill -0 "$server_pid" 2>/dev/null || break
			sleep 0.1
		done
		kill -KILL "$server_pid" 2>/dev/null || true
	fi
	wait "$server_pid" 2>/dev/null || true
	server_pid=
}

# post PATH JSON: POSTs to the running server and prints the response body.
post() {
	curl -fsS --max-time 600 -H 'Content-Type: application/json' -d "$2" "$server_url$1"
}

# token_ids N OFFSET: a JSON array of N ids that spell no special token, varied by OFFSET.
token_ids() {
	awk -v n="$1" -v off="$2" 'BEGIN { printf "["; for (i = 0; i < n; i++) printf "%s%d", (i ? "," : ""), (i * 7 + off) % 256; printf "]" }'
}

need() {
	local tool
	for tool in "$@"; do
		command -v "$tool" >/dev/null || die "$tool is required (apt-get install $tool)"
	done
}
