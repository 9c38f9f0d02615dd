#!/usr/bin/env bash
# check.sh INPUTS: issue 25's device checks on a CUDA GPU, on a machine with the CUDA
# toolkit, CMake and ninja but no Go or network. INPUTS is prepare.sh's
# gpu-inputs.tar.xz. It builds ggml with CUDA once (shared libraries), stock and patched
# llama-server against that ggml (-DLLAMA_USE_SYSTEM_GGML=ON), and runs TestGPUKV,
# BenchmarkDeviceRestore and BenchmarkDeviceStall with llama-server on CUDA0. Logs go to $OUT (default
# /tmp/gpu-out). MCB_GPU_CMAKE replaces the CUDA options (an empty value builds for the
# CPU: a dry run of the flow on a machine without a GPU).
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
inputs=$(readlink -f "$1")
out=${OUT:-/tmp/gpu-out}
work=${MCB_GPU_WORK:-/tmp/mcb-gpu}
jobs=$(nproc)
cuda_args=${MCB_GPU_CMAKE--DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_CUDA_NCCL=OFF}
rm -rf "$work" # every run builds from scratch
mkdir -p "$out" "$work"
t0=$SECONDS
log() { echo "[gpu $((SECONDS - t0))s] $*" | tee -a "$out/summary.txt"; }
step() { # step NAME CMD...: runs CMD with its output in $out/NAME.log
	local name=$1 rc
	shift
	log "$name"
	"$@" >"$out/$name.log" 2>&1
	rc=$?
	((rc == 0)) || { log "$name failed ($rc):"; tail -n 40 "$out/$name.log" | tee -a "$out/summary.txt"; }
	return $rc
}

{ nvidia-smi -L; nvcc --version | tail -n 2; cmake --version | head -n 1; } 2>&1 | tee -a "$out/summary.txt"
mkdir -p "$work/in" && xz -dc "$inputs" | tar -C "$work/in" -xf - || exit 1
in=$work/in
rm -rf "$work/patched" && cp -a "$in/llama-src" "$work/patched" && cp -a "$in/llama-patched/." "$work/patched/"

common=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF)
llama_args=(-DBUILD_SHARED_LIBS=OFF -DLLAMA_USE_SYSTEM_GGML=ON "-DCMAKE_PREFIX_PATH=$work/ggml"
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON
	-DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF)
build_ggml() {
	# Through llama.cpp's top level: the bundled ggml/ lacks what a standalone ggml
	# build wants (tests/, examples/, ggml.pc.in). Its own install rules install the
	# libraries and the CMake package that -DLLAMA_USE_SYSTEM_GGML=ON finds.
	# shellcheck disable=SC2086 # cuda_args is a word list
	cmake -S "$in/llama-src" -B "$work/ggml-build" "${common[@]}" -DBUILD_SHARED_LIBS=ON \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
		-DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF "-DCMAKE_INSTALL_PREFIX=$work/ggml" $cuda_args &&
		cmake --build "$work/ggml-build" --target ggml -j "$jobs" && cmake --install "$work/ggml-build/ggml"
}
build_server() { # build_server SRC DIR CMAKE-ARGS...
	local src=$1 dir=$2
	shift 2
	cmake -S "$src" -B "$dir" "${common[@]}" "${llama_args[@]}" "$@" &&
		cmake --build "$dir" --target llama-server -j "$((jobs / 2))"
}
step ggml build_ggml || exit 1
step stock build_server "$in/llama-src" "$work/stock" &
stock=$!
step patched build_server "$work/patched" "$work/patched-build" "-DMCBRIDGE_ROOT=$repo" "-DMCBRIDGE_ARCHIVE=$in/libmcbridge.a"
patched_rc=$?
wait $stock && ((patched_rc == 0)) || exit 1

export LD_LIBRARY_PATH=$work/ggml/lib:$work/ggml/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export MCB_LLAMA_SERVER_STOCK=$work/stock/bin/llama-server MCB_LLAMA_SERVER_PATCHED=$work/patched-build/bin/llama-server
export MCB_BIN=$in/mcbridge MCB_ETCD_BIN=$in/etcd MCB_TE_MOCK_LIB=$in/libmooncake_te_mock.so
(cd "$repo/tests/e2e" && step TestGPUKV "$in/e2e.test" -test.run '^TestGPUKV$' -test.v -test.timeout 5m)
(cd "$repo/bench/e2e" && step BenchmarkDeviceRestore "$in/bench.test" -test.run '^$' -test.bench '^BenchmarkDeviceRestore$' -test.benchtime 1x -test.timeout 5m)
(cd "$repo/bench/e2e" && step BenchmarkDeviceStall "$in/bench.test" -test.run '^$' -test.bench '^BenchmarkDeviceStall$' -test.benchtime 1x -test.timeout 5m)
grep -h -E '^(=== RUN|--- |    --- |PASS|FAIL|ok|Benchmark)' "$out/TestGPUKV.log" "$out/BenchmarkDeviceRestore.log" "$out/BenchmarkDeviceStall.log" | tee -a "$out/summary.txt"
log done
