#!/usr/bin/env bash
# build.sh stock|patched|archs: builds llama-server (CPU, with ggml's RPC backend) and
# ggml-rpc-server for the pinned llama.cpp and prints llama-server's path on the last line
# of stdout.
#
#   stock    the pristine tree from fetch.sh
#   patched  a copy of that tree with llama-patches/apply.sh applied, configured with
#            -DMCBRIDGE_ROOT=<a mirror of this repository> so that the patches' CMake
#            hook finds csrc/, include/ and the Go module there
#   archs    a copy of the tree with scripts/llama/patches/archs/ applied (model sizes
#            from the environment) and llama.cpp's tests on, building only
#            test-llama-archs (the random-weight model of every architecture,
#            scripts/llama/archs.sh) and printing its path instead
#
# The hash in the directory names covers everything that needs a fresh configure: the
# source tree, the CMake options below, LLAMA_EXTRA_CMAKE_ARGS (word-split) and, for
# patched, apply.sh and the patch series. The repository is not in it: the patched build
# reads it through patched-<hash>/mcbridge/, a copy that every build brings up to date
# file by file (sync_mirror), so a checkout anywhere else (each CI clone is a new
# directory) reuses the build and rebuilds only what its files change, where a build
# keyed by the checkout's path configured and compiled anew (about 200 s with ccache).
# Checkouts share the mirror, so the binary is the one built for the checkout that ran
# last: every make target that runs the binary runs deps.sh first, and two checkouts of
# different code building at the same time take turns on the build's lock. An engineer
# who works in several checkouts at once names each with MCB_LLAMA_MIRROR=<name>: the
# name goes into the patched build's hash, so each checkout gets a build of its own
# (ccache makes the first one cheap) and none overwrites another's binary.
# LLAMA_BACKEND=vulkan builds stock or patched with ggml's Vulkan backend instead (the
# device of `make test-vulkan`, docs/design.md §5.7): the tree is a private copy with
# scripts/llama/patches/vulkan/ applied (and, patched, the series), the Vulkan headers
# come from the Go module cache, and the backend and its patches join the hash. The CPU
# builds' directories and hashes do not change with it.
# A rebuild with nothing changed is a ninja no-op. Under $MCB_CACHE/llama.cpp-<tag>/:
#
#   src/  build-stock-<hash>/              the pristine tree and its build
#   patched-<hash>/src/  patched-<hash>/build/  patched-<hash>/mcbridge/
#   stock-vulkan-<hash>/src/  stock-vulkan-<hash>/build/
#   archs-cpu-<hash>/src/  archs-cpu-<hash>/build/
#
# Both builds reach their sources as ../src: with ccache's base_dir that makes the
# compile commands identical, so a patched build recompiles only what the patches
# change.
set -euo pipefail
# shellcheck source=scripts/llama/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

variant=${1:-}
case $variant in
stock | patched | archs) ;;
*) die "usage: $0 stock|patched|archs" ;;
esac

start=$SECONDS
src=$("$mcb_repo/scripts/llama/fetch.sh")

# The web UI would be fetched from the network (LLAMA_USE_PREBUILT_UI) or built with
# npm (LLAMA_BUILD_UI); with both off the server embeds an empty asset table.
# LLAMA_CURL no longer exists in this version (deprecated, ignored); HTTPS would only
# pull in OpenSSL. GGML_NATIVE=OFF keeps the AVX2/FMA/F16C baseline (not -march=native),
# so every machine sharing a ccache or comparing KV probe digests builds the same code.
# GGML_RPC=ON adds ggml's RPC backend (a device in another process, reached only through
# ggml's backend API: llama-server --rpc HOST:PORT) and its server, ggml-rpc-server, the
# device of the device-KV tests. Without --rpc it changes nothing: the backend registers
# no device until one is named (common/arg.cpp, add_rpc_devices).
cmake_args=(
	-DCMAKE_BUILD_TYPE=Release
	-DBUILD_SHARED_LIBS=OFF
	-DGGML_NATIVE=OFF
	-DLLAMA_BUILD_TESTS=OFF
	-DLLAMA_BUILD_EXAMPLES=OFF
	-DLLAMA_BUILD_APP=OFF
	-DLLAMA_BUILD_TOOLS=ON
	-DLLAMA_BUILD_SERVER=ON
	-DLLAMA_BUILD_UI=OFF
	-DLLAMA_USE_PREBUILT_UI=OFF
	-DLLAMA_OPENSSL=OFF
	-DGGML_RPC=ON
)
targets=(llama-server ggml-rpc-server)
if [[ $variant == archs ]]; then
	# The same options otherwise, so ccache serves ggml and libllama from the stock build.
	cmake_args=("${cmake_args[@]/-DLLAMA_BUILD_TESTS=OFF/-DLLAMA_BUILD_TESTS=ON}")
	targets=(test-llama-archs)
fi
# shellcheck disable=SC2206 # word splitting is the interface
extra_args=(${LLAMA_EXTRA_CMAKE_ARGS:-})
if [[ $variant == patched ]]; then
	extra_args+=("-DMCBRIDGE_ROOT=<mirror>") # named once the hash is known
fi
backend=${LLAMA_BACKEND:-cpu}
# The build patches of the private tree: the backend's, or test-llama-archs'.
tree_patches=()
if [[ $variant == archs ]]; then
	tree_patches=("$mcb_repo/scripts/llama/patches/archs"/[0-9]*.patch)
fi
# A release of Khronos' Vulkan headers new enough for ggml-vulkan.cpp that the Go module
# proxy serves (it does not serve every tag).
vulkan_headers=github.com/KhronosGroup/Vulkan-Headers@v1.3.280
case $backend in
cpu) ;;
vulkan)
	[[ $variant != archs ]] || die "the archs build is CPU only"
	command -v glslc >/dev/null && [[ -f /usr/include/vulkan/vulkan.h ]] ||
		die "the Vulkan build needs: apt-get install libvulkan-dev glslc mesa-vulkan-drivers"
	# Debian 12's headers (1.3.239) lack what ggml-vulkan.cpp uses (vk::LayerSettingEXT);
	# the Go module proxy serves Khronos' headers as a module.
	headers=$(cd "$mcb_repo" && go mod download -json "$vulkan_headers" |
		sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
	[[ -f $headers/include/vulkan/vulkan.hpp ]] || die "no Vulkan headers from $vulkan_headers"
	cmake_args+=(-DGGML_VULKAN=ON "-DVulkan_INCLUDE_DIR=$headers/include")
	for p in "$mcb_repo/scripts/llama/patches/vulkan"/[0-9]*.patch; do
		[[ -f $p ]] && tree_patches+=("$p")
	done
	;;
*) die "LLAMA_BACKEND=$backend: cpu or vulkan" ;;
esac

# series_digest: apply.sh and every patch, by name and content.
series_digest() {
	(
		cd "$mcb_repo/llama-patches"
		{ LC_ALL=C compgen -G '[0-9]*.patch' || true; } | LC_ALL=C sort | while read -r p; do
			printf '%s\n' "$p"
			sha256sum <"$p"
		done
		sha256sum <apply.sh
	) | sha256sum | cut -c1-64
}

key="tag=$LLAMA_TAG
src=$src tree=$(tree_id "$src")
variant=$variant
cmake=${cmake_args[*]}
extra=${extra_args[*]}"
if [[ $backend != cpu ]]; then
	key+="
backend=$backend $(cat "${tree_patches[@]}" | sha256sum | cut -c1-64)"
elif [[ $variant == archs ]]; then
	key+="
patches=$(cat "${tree_patches[@]}" | sha256sum | cut -c1-64)"
fi
if [[ $variant == patched ]]; then
	key+="
series=$(series_digest)"
	[[ -z ${MCB_LLAMA_MIRROR:-} ]] || key+="
mirror=$MCB_LLAMA_MIRROR"
fi
hash=$(printf '%s' "$key" | sha256sum | cut -c1-12)
if [[ $variant == stock && $backend == cpu ]]; then
	build=$llama_root/build-$variant-$hash
elif [[ $variant != patched ]]; then
	build=$llama_root/$variant-$backend-$hash/build
else
	build=$llama_root/patched-$hash/build
	mirror=$llama_root/patched-$hash/mcbridge
	extra_args[${#extra_args[@]}-1]="-DMCBRIDGE_ROOT=$mirror"
fi

# sync_mirror: makes the mirror hold this checkout's files (tracked, and untracked ones
# git does not ignore) byte for byte. Only files that differ are copied, so ninja and go
# see the others unchanged; files the checkout no longer has are removed (a stale .go
# file would still be built). Runs under the build's lock.
sync_mirror() {
	local list=$mirror.files f
	mkdir -p "$mirror"
	: >"$list"
	git -C "$mcb_repo" ls-files -z --cached --others --exclude-standard | LC_ALL=C sort -z |
		while IFS= read -r -d '' f; do
			[[ -f $mcb_repo/$f ]] || continue # deleted in the work tree, not yet in git
			printf '%s\0' "$f" >>"$list"
			if ! cmp -s "$mcb_repo/$f" "$mirror/$f"; then
				mkdir -p "$(dirname "$mirror/$f")"
				cp "$mcb_repo/$f" "$mirror/$f"
			fi
		done
	(cd "$mirror" && find . -type f -printf '%P\0' | LC_ALL=C sort -z) |
		LC_ALL=C comm -z -13 "$list" - | while IFS= read -r -d '' f; do
			rm -f "$mirror/$f"
		done
}

# tree_patch TREE: applies the build patches not already in TREE.
tree_patch() {
	local p
	for p in "${tree_patches[@]}"; do
		patch -d "$1" -p1 -R -s -f --dry-run <"$p" >/dev/null 2>&1 && continue
		patch -d "$1" -p1 -s -f --no-backup-if-mismatch <"$p" >&2 || die "$(basename "$p") does not apply"
	done
}

# private_tree: a private copy of the pristine tree with the series (patched) and the
# build patches applied, keyed like the build directory, beside it, so the stock
# tree (and a user's LLAMA_SRC) is never modified.
private_tree() {
	local top dest tmp
	top=$(dirname "$build")
	dest=$top/src
	if [[ ! -d $dest ]]; then
		mkdir -p "$top"
		tmp=$(mktemp -d "$top/tmp.XXXXXX")
		# shellcheck disable=SC2064 # expand now: tmp is local; this runs in $(...)
		trap "rm -rf '$tmp'" EXIT
		if [[ -e $src/.git ]]; then
			git -c advice.detachedHead=false clone --quiet --shared "$src" "$tmp/src"
		else
			cp -a "$src" "$tmp/src"
			git -C "$tmp/src" init --quiet
			git -C "$tmp/src" add -A
			git -C "$tmp/src" -c user.name=mcbridge -c user.email=mcbridge@localhost commit --quiet -m "$LLAMA_TAG as found in $src"
		fi
		[[ $variant != patched ]] || "$mcb_repo/llama-patches/apply.sh" "$tmp/src"
		tree_patch "$tmp/src"
		mv "$tmp/src" "$dest"
	else
		[[ $variant != patched ]] || "$mcb_repo/llama-patches/apply.sh" "$dest"
		tree_patch "$dest"
	fi
	echo "$dest"
}

build_server() {
	local tree=$src launcher=() generator=()
	if [[ $variant != stock || $backend != cpu ]]; then
		tree=$(private_tree)
	fi
	if [[ $variant == patched ]]; then
		sync_mirror
	fi
	if command -v ccache >/dev/null; then
		# Paths under base_dir are hashed relative to the build directory (see above).
		export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$llama_root}
		launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
	else
		log "ccache not found: every new build directory compiles from scratch (apt-get install ccache)"
	fi
	if command -v ninja >/dev/null; then
		generator=(-G Ninja)
	fi
	if [[ ! -f $build/CMakeCache.txt ]]; then
		log "configure $variant: $tree -> $build"
		log "cmake options: ${cmake_args[*]} ${extra_args[*]}"
		cmake -S "$tree" -B "$build" "${generator[@]}" "${launcher[@]}" "${cmake_args[@]}" "${extra_args[@]}" >&2
	fi
	log "build ${targets[*]} ($variant) with $(nproc) jobs"
	cmake --build "$build" --target "${targets[@]}" -j "$(nproc)" >&2
}

mkdir -p "$(dirname "$build")"
with_lock "$build.lock" build_server
for t in "${targets[@]}"; do
	[[ -x $build/bin/$t ]] || die "build finished without $build/bin/$t"
done
log "${targets[0]} ($variant) ready in $((SECONDS - start))s"
echo "$build/bin/${targets[0]}"
