#!/usr/bin/env bash
# Makes the pinned llama.cpp source tree (internal/llamapin/PIN) available and prints its
# path on the last line of stdout.
#
#   scripts/llama/fetch.sh                      # cached tree under $MCB_CACHE (default ~/.cache/mcbridge)
#   LLAMA_SRC=~/src/llama.cpp scripts/llama/fetch.sh   # a checkout of the same tag, checked, used as is
#
# The cached tree is cloned from the git bundle inside the npm package named in PIN,
# checked out at the pinned commit, verified by tree id and tagged locally. It must stay
# pristine: the patched build works on its own copy (see build.sh).
set -euo pipefail
# shellcheck source=scripts/llama/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

check_user_tree() {
	local dir=$1 tree version
	[[ -f $dir/CMakeLists.txt && -f $dir/src/llama-kv-cache.cpp ]] ||
		die "LLAMA_SRC=$dir is not a llama.cpp source tree"
	tree=$(tree_id "$dir")
	if [[ $tree == "$LLAMA_TREE" ]]; then
		log "LLAMA_SRC=$dir: tree $tree is $LLAMA_TAG"
		return
	fi
	if [[ -e $dir/.git ]] && git -C "$dir" tag --points-at HEAD 2>/dev/null | grep -qx "$LLAMA_TAG"; then
		log "warning: LLAMA_SRC=$dir: HEAD is tagged $LLAMA_TAG but its tree differs from the pinned one${tree:+ ($tree)} or has local changes"
		return
	fi
	version=$(sed -n 's/^set(LLAMA_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\))$/\2/p' "$dir/CMakeLists.txt" | paste -sd.)
	log "warning: LLAMA_SRC=$dir cannot be verified as $LLAMA_TAG (tree ${tree:-unknown}, CMake version ${version:-unknown}); the hook points and state format may not match"
}

cached_tree_ok() {
	[[ $(tree_id "$llama_root/src") == "$LLAMA_TREE" ]]
}

fetch_bundle() {
	local dest=$llama_root/src tmp
	if cached_tree_ok; then
		log "source tree present: $dest ($LLAMA_TAG, tree $LLAMA_TREE)"
		return
	fi
	if [[ -e $dest ]]; then
		die "$dest exists but is not a clean $LLAMA_TAG tree (tree '$(tree_id "$dest")'); remove it and rerun"
	fi
	command -v npm >/dev/null || die "npm is needed to fetch $LLAMA_NPM_PACKAGE (or set LLAMA_SRC to a $LLAMA_TAG checkout)"
	tmp=$(mktemp -d "$llama_root/fetch.XXXXXX")
	# shellcheck disable=SC2064 # expand now: tmp is local
	trap "rm -rf '$tmp'" EXIT

	log "npm pack $LLAMA_NPM_PACKAGE"
	(cd "$tmp" && npm pack --silent "$LLAMA_NPM_PACKAGE" >/dev/null)
	tar -xzf "$tmp"/*.tgz -C "$tmp" package/llama/gitRelease.bundle package/llama/binariesGithubRelease.json
	grep -q "\"release\": *\"$LLAMA_TAG\"" "$tmp/package/llama/binariesGithubRelease.json" ||
		die "$LLAMA_NPM_PACKAGE does not ship $LLAMA_TAG: $(cat "$tmp/package/llama/binariesGithubRelease.json")"
	git bundle verify --quiet "$tmp/package/llama/gitRelease.bundle" 2>/dev/null ||
		die "git bundle in $LLAMA_NPM_PACKAGE failed verification"

	log "git clone from the bundle, checkout $LLAMA_BUNDLE_COMMIT"
	git clone --quiet --no-checkout "$tmp/package/llama/gitRelease.bundle" "$tmp/src"
	git -C "$tmp/src" -c advice.detachedHead=false checkout --quiet --detach "$LLAMA_BUNDLE_COMMIT"
	git -C "$tmp/src" remote remove origin
	git -C "$tmp/src" tag "$LLAMA_TAG"
	[[ $(tree_id "$tmp/src") == "$LLAMA_TREE" ]] ||
		die "bundle commit has tree $(tree_id "$tmp/src"), PIN says $LLAMA_TREE"
	mv "$tmp/src" "$dest"
	log "source tree ready: $dest"
}

start=$SECONDS
if [[ -n ${LLAMA_SRC:-} ]]; then
	src=$(cd "$LLAMA_SRC" && pwd)
	check_user_tree "$src"
else
	mkdir -p "$llama_root"
	with_lock "$llama_root/.fetch.lock" fetch_bundle
	src=$llama_root/src
fi
log "fetch done in $((SECONDS - start))s"
echo "$src"
