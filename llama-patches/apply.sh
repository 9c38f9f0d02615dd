#!/usr/bin/env bash
# apply.sh TREE: brings a llama.cpp tree of the pinned tag (internal/llamapin/PIN) to the state of
# llama-patches/[0-9]*.patch applied in name order. Idempotent: a tree with some or
# all of the series already applied gets only the rest; a tree where the series
# neither applies nor is applied is an error, and nothing in it is changed.
#
# Later patches may edit lines earlier ones added, so no patch is checked on its own
# against TREE: git apply --check on several files, or on a --reverse stream, checks
# each patch against the unpatched file. Instead the series is really applied, one
# patch at a time, to a scratch copy of the files it touches: undone from patch K down
# to 1 to find the applied prefix, then forward for the rest, before TREE is touched.
set -euo pipefail

die() {
	echo "apply: error: $*" >&2
	exit 1
}

patch_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=internal/llamapin/PIN
source "$patch_dir/../internal/llamapin/PIN"
[[ $# -eq 1 ]] || die "usage: $0 LLAMA_TREE"
[[ -f $1/CMakeLists.txt && -d $1/src ]] || die "$1 is not a llama.cpp source tree"
tree=$(cd "$1" && pwd)

# The series is cut against one tree. A git checkout says which tree it holds; one of
# another tag would mostly fail below, but a patch whose context happens to match would
# land hooks in code they were not written for, so say so first.
if head_tree=$(git -C "$tree" rev-parse --verify --quiet 'HEAD^{tree}' 2>/dev/null) &&
	[[ $head_tree != "$LLAMA_TREE" ]]; then
	echo "apply: warning: $tree's HEAD is tree $head_tree, not llama.cpp $LLAMA_TAG ($LLAMA_TREE)" >&2
fi

mapfile -t series < <(LC_ALL=C compgen -G "$patch_dir/[0-9]*.patch" | LC_ALL=C sort)
n=${#series[@]}
if ((n == 0)); then
	echo "apply: no patches in $patch_dir; $tree left as is" >&2
	exit 0
fi

# Every path the series names, old and new.
mapfile -t paths < <(sed -n 's|^diff --git a/\(.*\) b/\(.*\)$|\1\n\2|p' "${series[@]}" | LC_ALL=C sort -u)

# git_apply DIR ARGS...: git apply inside DIR, which is taken as the top of the paths
# even when some repository contains it.
git_apply() {
	local dir=$1
	shift
	(cd "$dir" && GIT_CEILING_DIRECTORIES=${dir%/*} git apply --whitespace=nowarn "$@")
}

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

# fresh_scratch: the touched files of TREE, copied into the scratch directory.
fresh_scratch() {
	find "$scratch" -mindepth 1 -delete
	local f
	for f in "${paths[@]}"; do
		if [[ -e $tree/$f ]]; then
			mkdir -p "$scratch/$(dirname "$f")"
			cp -p "$tree/$f" "$scratch/$f"
		fi
	done
}

# undoes K: patches K..1 can be reversed, in that order, on a copy of TREE.
undoes() {
	local i
	fresh_scratch
	for ((i = $1 - 1; i >= 0; i--)); do
		git_apply "$scratch" --reverse "${series[i]}" 2>/dev/null || return 1
	done
}

applied=0
for ((k = n; k > 0; k--)); do
	if undoes "$k"; then
		applied=$k
		break
	fi
done

todo=("${series[@]:applied}")
if ((${#todo[@]} == 0)); then
	echo "apply: all $n patches already applied to $tree" >&2
	exit 0
fi
fresh_scratch
for p in "${todo[@]}"; do
	git_apply "$scratch" "$p" ||
		die "${p##*/} does not apply to $tree after the first $applied of $n patches; nothing changed"
done
for p in "${todo[@]}"; do
	git_apply "$tree" "$p"
	echo "apply: applied ${p##*/}" >&2
done
echo "apply: $n patches applied to $tree" >&2
