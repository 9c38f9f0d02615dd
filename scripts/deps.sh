#!/usr/bin/env bash
# deps.sh BUILD: builds, or finds cached, everything outside the Go module that the
# end-to-end tests and the demo run, and writes the environment they read to
# BUILD/e2e.env (sourced by the Makefile's recipes):
#
#   MCB_LLAMA_SRC                                      scripts/llama/fetch.sh: the pinned tree
#   MCB_LLAMA_SERVER_STOCK, MCB_LLAMA_SERVER_PATCHED   scripts/llama/build.sh
#   MCB_LLAMA_ARCHS                                    scripts/llama/archs.sh: the folder of
#                                                      test-llama-archs' model of every
#                                                      architecture
#   MCB_LLAMA_ARCHS_BENCH                              scripts/llama/archs.sh bench: its
#                                                      bench-sized Llama, Gemma 3, Qwen3.5
#   MCB_GGML_RPC_SERVER                                ggml's RPC server, next to the stock
#                                                      llama-server: the device-KV tests' device
#   MCB_TE_REAL_LIB                                    scripts/mooncake/build.sh te
#   MCB_MOONCAKE_STORE_DIR                             scripts/mooncake/build.sh store: the
#                                                      folder of mooncake_master, libasio.so,
#                                                      libmooncake_store.so and store_c.h
#   MCB_LIBLLAMA_BUILD                                 csrc/embed (mcb_libllama) against the stock build
#   MCB_TE_MOCK_LIB                                    the mock Transfer Engine of BUILD
#   MCB_OLLAMA                                         scripts/ollama/build.sh: the pinned
#                                                      Ollama, whose runner the e2e suite
#                                                      points at llama-server
#
# Each step prints its time. Everything slow is cached under $MCB_CACHE. A step that
# fails fails the whole script: the suites that need its output never skip. The
# Mooncake Store build (about 25 minutes on 2 cores, cold) runs alone, after the
# llama.cpp builds, with -j2: each of its compiler processes can take 5 GB.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$(cd "${1:?usage: $0 BUILD}" && pwd)

step() {
	local name=$1 start=$SECONDS
	shift
	"$@"
	printf '[deps] %-32s %4ds\n' "$name" $((SECONDS - start)) >&2
}

last() { "$@" | tail -n 1; }

stock=
patched=
te=
llama_stock() { stock=$(last "$repo/scripts/llama/build.sh" stock); }
llama_patched() {
	patched=$(last "$repo/scripts/llama/build.sh" patched)
	cmake --build "$(dirname "$(dirname "$patched")")" --target llama-mcbridge-test -j "$(nproc)" >/dev/null
}
archs=
archs_bench=
llama_archs() {
	archs=$(last "$repo/scripts/llama/archs.sh")
	archs_bench=$(last "$repo/scripts/llama/archs.sh" bench)
}
mooncake_te() { te=$(last "$repo/scripts/mooncake/build.sh" te)/install/lib/libtransfer_engine.so; }
store=
mooncake_store() { store=$(JOBS=2 last "$repo/scripts/mooncake/build.sh" store)/out; }
ollama=
ollama_build() { ollama=$(last "$repo/scripts/ollama/build.sh"); }
libllama() {
	local dir=$build/libllama
	[[ -f $dir/CMakeCache.txt ]] || cmake -S "$repo/csrc/embed" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
		-DLLAMA_BUILD_DIR="$(dirname "$(dirname "$stock")")" -DMCB_BUILD_DIR="$build" >/dev/null
	cmake --build "$dir" -j "$(nproc)" >/dev/null
}

step "llama-server (stock)" llama_stock
step "llama-server (patched)" llama_patched
step "llama.cpp test models" llama_archs
step "Ollama" ollama_build
step "Mooncake Transfer Engine" mooncake_te
step "Mooncake Store" mooncake_store
step "csrc/embed (mcb_libllama)" libllama

cat >"$build/e2e.env" <<ENV
export MCB_LLAMA_SRC=$("$repo/scripts/llama/fetch.sh" | tail -n 1)
export MCB_LLAMA_SERVER_STOCK=$stock
export MCB_LLAMA_SERVER_PATCHED=$patched
export MCB_LLAMA_ARCHS=$archs
export MCB_LLAMA_ARCHS_BENCH=$archs_bench
export MCB_GGML_RPC_SERVER=$(dirname "$stock")/ggml-rpc-server
export MCB_TE_REAL_LIB=$te
export MCB_MOONCAKE_STORE_DIR=$store
export MCB_LIBLLAMA_BUILD=$build/libllama
export MCB_TE_MOCK_LIB=$build/libmooncake_te_mock.so
export MCB_OLLAMA=$ollama
ENV
