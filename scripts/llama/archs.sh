#!/usr/bin/env bash
# archs.sh [bench]: the random-weight model of every architecture the pinned llama.cpp
# supports, written by its own tests/test-llama-archs.cpp (`test-llama-archs -s 42 -o
# DIR`), and prints DIR on the last line of stdout. With bench, the models of the
# benchmarks of memory kinds instead (bench/e2e BenchmarkMemoryKinds): Llama (plain),
# Gemma 3 (sliding window) and Qwen3.5 (hybrid) at the bench model's size, 12 layers of
# n_embd 768 (in the test's 2 heads, of 384: Qwen3.5's gated delta-net takes its head
# count from it and needs heads of its state's 128), with a training context of 8192,
# which gives Gemma 3 a window of 1024 as in its 27B (the patch in
# scripts/llama/patches/archs reads the size from MCB_ARCHS_SIZE, which names the
# folder). The binary is built once per pinned tree
# (build.sh archs) and the models are written once per build, beside it, under its lock:
# a DIR with .done in it is complete, so a run killed half-way writes them again.
# tests/e2e's TestModels serves each through stock llama-server, the patched server and
# the proxy (make test-models).
set -euo pipefail
# shellcheck source=scripts/llama/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

seed=42
bin=$("$mcb_repo/scripts/llama/build.sh" archs | tail -n 1)
build=$(dirname "$(dirname "$bin")")
case ${1:-} in
"")
	dir=$build/models-s$seed
	args=()
	;;
bench)
	export MCB_ARCHS_SIZE=8192,768,2,2048,12
	dir=$build/models-bench-${MCB_ARCHS_SIZE//,/-}-s$seed
	args=(-a '^(llama|gemma3|qwen35)$')
	;;
*) die "usage: $0 [bench]" ;;
esac

write_models() {
	[[ -f $dir/.done ]] && return
	rm -rf "$dir"
	mkdir -p "$dir"
	log "test-llama-archs -s $seed -o $dir ${args[*]}"
	"$bin" -s "$seed" -o "$dir" "${args[@]}" >&2
	touch "$dir/.done"
}

with_lock "$build.lock" write_models
log "$(find "$dir" -name '*.gguf' | wc -l) models in $dir"
echo "$dir"
