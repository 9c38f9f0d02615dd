#!/usr/bin/env bash
# archs.sh: the random-weight model of every architecture the pinned llama.cpp supports,
# written by its own tests/test-llama-archs.cpp (`test-llama-archs -s 42 -o DIR`), and
# prints DIR on the last line of stdout. The binary is built once per pinned tree
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
dir=$build/models-s$seed

write_models() {
	[[ -f $dir/.done ]] && return
	rm -rf "$dir"
	mkdir -p "$dir"
	log "test-llama-archs -s $seed -o $dir"
	"$bin" -s "$seed" -o "$dir" >&2
	touch "$dir/.done"
}

with_lock "$build.lock" write_models
log "$(find "$dir" -name '*.gguf' | wc -l) models in $dir"
echo "$dir"
