#!/usr/bin/env bash
# build.sh: builds the pinned Ollama from its module source as a new user would
# (CGO_ENABLED=1 go build -tags libsqlite3 -trimpath .), once, and prints the binary's
# path on the last line of stdout. The source comes from the Go module proxy (go mod
# download), the system SQLite from libsqlite3-dev (scripts/bootstrap.sh). Under
# $MCB_CACHE/ollama-<version>/bin/ollama; about 2 minutes on 2 cores, cold.
#
# The binary alone: Ollama looks for its runner, llama-server, in ../lib/ollama beside
# itself, and the tests that run it put a copy of the binary next to the llama-server
# they mean (tests/e2e/ollama_test.go), so the cache stays the same for every checkout.
set -euo pipefail

version=v0.34.4
cache=${MCB_CACHE:-$HOME/.cache/mcbridge}
dir=$cache/ollama-$version
bin=$dir/bin/ollama

log() { printf '[ollama %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

build() {
	[[ -x $bin ]] && return
	local src tmp
	# Outside any module, so that this repository's go.mod does not take part.
	src=$(cd / && GOFLAGS=-mod=mod go mod download -json "github.com/ollama/ollama@$version" | jq -r .Dir)
	[[ -f $src/main.go ]] || { log "error: go mod download gave no source for ollama $version"; exit 1; }
	log "build ollama $version from $src"
	mkdir -p "$dir/bin"
	tmp=$(mktemp "$dir/bin/ollama.XXXXXX")
	# shellcheck disable=SC2064 # expand now
	trap "rm -f '$tmp'" EXIT
	# The version stamp is what Ollama's release build sets; without it the binary
	# calls itself 0.0.0.
	(cd "$src" && CGO_ENABLED=1 GOFLAGS=-buildvcs=false go build -tags libsqlite3 -trimpath \
		-ldflags "-X github.com/ollama/ollama/version.Version=${version#v}" -o "$tmp" .)
	chmod 755 "$tmp"
	mv "$tmp" "$bin"
}

mkdir -p "$dir"
if command -v flock >/dev/null; then
	(
		flock 9
		build
	) 9>"$dir/build.lock"
else
	build
fi
[[ -x $bin ]] || { log "error: build finished without $bin"; exit 1; }
echo "$bin"
