#!/usr/bin/env bash
# test.sh: builds libmcb_stage1 (hosts/libllama) against the stock llama.cpp v0.5.0 build and
# runs its tests, plain and under ASan/UBSan, then the two-process case and the Go tests of
# internal/llamastate. Prints one summary line per step; exits non-zero if any step failed.
#
#   scripts/stage1/test.sh             # everything
#   scripts/stage1/test.sh testdata    # regenerate internal/llamastate/testdata from the stock build
#
#   STAGE1_BUILD   build directory of hosts/libllama (default build/stage1)
#   STAGE1_ASAN=0  skip the sanitizer builds and runs
#   STAGE1_XPROC=0 skip the two-process case (it needs an etcd server, scripts/etcd/ensure.sh)
set -euo pipefail
# shellcheck source=scripts/llama/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../llama/lib.sh"
need cmake go

mode=${1:-all}
[[ $mode == all || $mode == testdata ]] || die "usage: $0 [testdata]"
build=${STAGE1_BUILD:-$mcb_repo/build/stage1}
asan=${STAGE1_ASAN:-1}
start=$SECONDS
work=$(mktemp -d "${TMPDIR:-/tmp}/mcb-stage1.XXXXXX")
etcd_pid='' xsave_pid=''
cleanup() {
	exec 8>&- 2>/dev/null || true # closing xsave's stdin ends it
	for pid in $xsave_pid $etcd_pid; do
		kill "$pid" 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
	done
	rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The bridge archives (plain and -asan) and the mock Transfer Engine come from the
# top-level build; llama.cpp's static libraries from the cached stock build.
t0=$SECONDS
if [[ ! -f $mcb_repo/build/CMakeCache.txt ]]; then
	cmake -S "$mcb_repo" -B "$mcb_repo/build" >&2
fi
targets=(mcbridge_archive mooncake_te_mock)
[[ $asan == 1 ]] && targets+=(mcbridge_archive_asan)
cmake --build "$mcb_repo/build" --target "${targets[@]}" >&2
src=$("$mcb_repo/scripts/llama/fetch.sh" | tail -n 1)
server=$("$mcb_repo/scripts/llama/build.sh" stock | tail -n 1)
llama_build=$(dirname "$(dirname "$server")")
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [[ ! -f $build/CMakeCache.txt ]]; then
	cmake -S "$mcb_repo/hosts/libllama" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
		-DLLAMA_BUILD_DIR="$llama_build" -DLLAMA_SRC_DIR="$src" -DMCB_BUILD_DIR="$mcb_repo/build" \
		-DMCB_STAGE1_SANITIZE="$([[ $asan == 1 ]] && echo ON || echo OFF)" >&2
fi
cmake --build "$build" -j "$(nproc)" >&2
log "build: $((SECONDS - t0))s"

model_file tiny "$work/tiny.gguf" >&2
model_file tiny "$work/other.gguf" -seed 2 >&2

testdata=$mcb_repo/internal/llamastate/testdata
if [[ $mode == testdata ]]; then
	"$build/stage1_test" testdata "$work/tiny.gguf" "$testdata"
	log "testdata written to $testdata"
	exit 0
fi

summary=()
failed=0
# step NAME CMD...: runs one test step, keeps its output, records PASS/FAIL and its time.
step() {
	local name=$1 t=$SECONDS rc=0
	shift
	log "step: $name"
	"$@" || rc=$?
	if ((rc == 0)); then
		summary+=("PASS  $(printf '%-28s' "$name") $((SECONDS - t))s")
	else
		summary+=("FAIL  $(printf '%-28s' "$name") $((SECONDS - t))s (exit $rc)")
		failed=$((failed + 1))
	fi
}

te_mock=$mcb_repo/build/libmooncake_te_mock.so
blobs=()
for f in "$testdata"/seq-*.bin; do [[ -e $f ]] && blobs+=("$f"); done
export MCB_TE_MOCK_LIB=$te_mock

step "seq_state_test" "$build/seq_state_test" "${blobs[@]}"
step "stage1_test" "$build/stage1_test" "$work/tiny.gguf" "$work/other.gguf"
if [[ $asan == 1 ]]; then
	# Go's -asan runtime and the sanitized C++ agree on memory; leaks are checked at exit.
	export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
	step "seq_state_test (asan)" "$build/seq_state_test_asan" "${blobs[@]}"
	step "stage1_test (asan)" "$build/stage1_test_asan" "$work/tiny.gguf" "$work/other.gguf"
	unset ASAN_OPTIONS UBSAN_OPTIONS
fi

# two_processes: A saves and serves its pool, B restores from it, through an etcd
# directory and the mock Transfer Engine (process_vm_readv, or TCP where ptrace is denied).
two_processes() {
	local etcd port ready=$work/xsave.ready
	etcd=$("$mcb_repo/scripts/etcd/ensure.sh" | tail -n 1)
	port=$(free_port)
	MCB_ETCD_BIN=$etcd MCB_ETCD_PORT=$port "$mcb_repo/scripts/etcd/local.sh" "$work/etcd" 2>"$work/etcd.log" &
	etcd_pid=$!
	# A loaded CI machine can take a while to start etcd; wait for it
	# rather than let the first publish time out.
	local healthy=0
	for _ in $(seq 600); do
		curl -fsS "http://127.0.0.1:$port/health" 2>/dev/null | grep -q true && { healthy=1; break; }
		sleep 0.1
	done
	((healthy)) || { log "etcd on port $port never became healthy; log $work/etcd.log"; return 1; }
	local cfg='{"directory":{"kind":"etcd","endpoints":["http://127.0.0.1:'$port'"],"prefix":"/stage1","op_timeout_ms":10000},
		"transport":{"kind":"mooncake","lib":"'$te_mock'"},"arbiter":{"policy":"always-restore"},"pool_bytes":16777216}'
	mkfifo "$work/xsave.stdin"
	"$build/stage1_test" xsave "$work/tiny.gguf" "$cfg" "$ready" <"$work/xsave.stdin" &
	xsave_pid=$!
	exec 8>"$work/xsave.stdin"
	for _ in $(seq 300); do
		[[ -e $ready ]] && break
		kill -0 "$xsave_pid" 2>/dev/null || break
		sleep 0.1
	done
	local rc=0
	if [[ -e $ready ]]; then
		"$build/stage1_test" xrestore "$work/tiny.gguf" "$cfg" || rc=$?
	else
		log "xsave never became ready"
		rc=1
	fi
	exec 8>&-
	wait "$xsave_pid" || rc=$?
	xsave_pid=
	kill "$etcd_pid" 2>/dev/null || true
	wait "$etcd_pid" 2>/dev/null || true
	etcd_pid=
	return "$rc"
}
if [[ ${STAGE1_XPROC:-1} == 1 ]]; then
	step "two processes (etcd)" two_processes
fi

step "go vet internal/llamastate" go -C "$mcb_repo" vet ./internal/llamastate/
step "go test -race llamastate" go -C "$mcb_repo" test -race -count=1 ./internal/llamastate/

printf '\nstage1 summary (%ds in all):\n' $((SECONDS - start))
printf '  %s\n' "${summary[@]}"
if ((failed > 0)); then
	printf '%d step(s) failed\n' "$failed"
	exit 1
fi
printf 'all %d steps passed\n' "${#summary[@]}"
