#!/usr/bin/env bash
# prepare.sh DIR: writes DIR/gpu-inputs.tar.xz, everything check.sh needs on a machine
# with a CUDA GPU but no Go toolchain (nor network), built here from this checkout after
# `make deps`:
#   llama-src/             the pinned llama.cpp tree (no models, docs or web UI)
#   llama-patched/         the files the patch series changes, as patched
#   libmcbridge.a          this checkout's bridge (csrc/mcbridge.cmake's MCBRIDGE_ARCHIVE)
#   e2e.test, bench.test   tests/e2e and bench/e2e built with -tags gpu
#   mcbridge etcd libmooncake_te_mock.so
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
[[ $# -eq 1 ]] || { echo "usage: $0 DIR" >&2; exit 2; }
mkdir -p "$1"
out=$(cd "$1" && pwd)
if [[ -z ${MCB_LLAMA_SRC:-} ]]; then
	# shellcheck source=/dev/null
	source "$repo/build/e2e.env" # make deps writes it
fi
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT

# The patched tree sits beside the patched build: patched-<hash>/{src,build/bin/llama-server}.
patched=$(cd "$(dirname "$MCB_LLAMA_SERVER_PATCHED")/../../src" && pwd)
mkdir -p "$stage/llama-src" "$stage/llama-patched"
tar -C "$MCB_LLAMA_SRC" --exclude=./.git --exclude=./models --exclude=./docs --exclude=./media \
	--exclude=./tools/server/webui --exclude=./examples --exclude=./gguf-py --exclude=./benches -cf - . |
	tar -C "$stage/llama-src" -xf -
sed -n 's|^diff --git a/\(.*\) b/.*$|\1|p' "$repo"/llama-patches/[0-9]*.patch | LC_ALL=C sort -u |
	(cd "$patched" && xargs tar -cf -) | tar -C "$stage/llama-patched" -xf -

cd "$repo"
CGO_ENABLED=1 go build -buildmode=c-archive -trimpath -o "$stage/libmcbridge.a" ./bridge
rm -f "$stage/libmcbridge.h"
go test -c -tags gpu -trimpath -ldflags='-s -w' -o "$stage/e2e.test" ./tests/e2e
go test -c -tags gpu -trimpath -ldflags='-s -w' -o "$stage/bench.test" ./bench/e2e
go build -trimpath -ldflags='-s -w' -o "$stage/mcbridge" ./cmd/mcbridge
cp "$MCB_TE_MOCK_LIB" "$stage/libmooncake_te_mock.so"
cp "$("$repo/scripts/etcd/ensure.sh" | tail -n1)" "$stage/etcd"
tar -C "$stage" -cf - . | xz -T0 -6 >"$out/gpu-inputs.tar.xz"
ls -l "$out/gpu-inputs.tar.xz"
