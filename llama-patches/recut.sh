#!/usr/bin/env bash
# recut.sh: the series as commits, and the numbered patches cut again from them.
#
#   recut.sh tree SRC DIR   DIR becomes a git repository: the pinned llama.cpp tree SRC
#                           (internal/llamapin/PIN; scripts/llama/fetch.sh prints it) as
#                           one commit, then one commit per patch in name order, whose
#                           message is the patch's text before its first diff.
#   recut.sh cut DIR [OUT]  writes commit N after the pinned tree in DIR as patch N into
#                           OUT (default: this directory): its message, then its diff.
#
# Changing the series: `tree`, edit DIR's commits (git rebase -i, commit --amend; a new
# patch is a new commit whose message starts "mcbridge NNNN: "), then `cut`. Patch N
# keeps its file name; a new one is named after its subject; files past the last
# commit are removed. Cutting the tree `tree` made gives the committed files back byte
# for byte (tests/tree TestRecutIsIdentity), so a re-cut changes only what was edited.
set -euo pipefail

die() {
	echo "recut: error: $*" >&2
	exit 1
}

patch_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=internal/llamapin/PIN
source "$patch_dir/../internal/llamapin/PIN"

# The hunk headers of C and C++ files name their function or type by git's cpp
# driver, as the series has them ("struct server_context_impl {", not "private:").
attributes=$(mktemp)
trap 'rm -f "$attributes"' EXIT
printf '*.%s diff=cpp\n' c cpp h hpp >"$attributes"

# git_in DIR ARGS...: git in DIR with none of the user's settings that change what
# diff, commit or apply write (prefixes, colours, renames, hooks, signing).
git_in() {
	local dir=$1
	shift
	GIT_CONFIG_GLOBAL=/dev/null GIT_CONFIG_NOSYSTEM=1 GIT_CEILING_DIRECTORIES=${dir%/*} \
		GIT_CONFIG_COUNT=1 GIT_CONFIG_KEY_0=core.attributesFile GIT_CONFIG_VALUE_0="$attributes" \
		GIT_AUTHOR_NAME=mcbridge GIT_AUTHOR_EMAIL=mcbridge@localhost GIT_AUTHOR_DATE="2000-01-01T00:00:00+0000" \
		GIT_COMMITTER_NAME=mcbridge GIT_COMMITTER_EMAIL=mcbridge@localhost GIT_COMMITTER_DATE="2000-01-01T00:00:00+0000" \
		git -C "$dir" "$@"
}

series() { LC_ALL=C compgen -G "$patch_dir/[0-9][0-9][0-9][0-9]-*.patch" | LC_ALL=C sort || true; }

# base DIR: the commit of DIR's history whose tree is the pinned one.
base() {
	local c t
	while read -r c t; do
		if [[ $t == "$LLAMA_TREE" ]]; then
			echo "$c"
			return
		fi
	done < <(git_in "$1" log --format='%H %T' HEAD)
	die "no commit of $1 holds llama.cpp $LLAMA_TAG (tree $LLAMA_TREE)"
}

tree() {
	local src=$1 dir=$2 p
	[[ -f $src/CMakeLists.txt && -d $src/src ]] || die "$src is not a llama.cpp source tree"
	[[ ! -e $dir ]] || die "$dir exists"
	mkdir -p "$dir"
	dir=$(cd "$dir" && pwd)
	# A copy without SRC's history: the pinned tree is one commit whatever SRC's is.
	tar -C "$src" --exclude=.git -cf - . | tar -C "$dir" -xf -
	git_in "$dir" init -q
	git_in "$dir" add -A -f
	git_in "$dir" commit -q --no-verify -m "llama.cpp $LLAMA_TAG"
	[[ $(git_in "$dir" rev-parse 'HEAD^{tree}') == "$LLAMA_TREE" ]] ||
		die "$src is not llama.cpp $LLAMA_TAG: its files are not tree $LLAMA_TREE"
	while read -r p; do
		git_in "$dir" apply --index --whitespace=nowarn "$p" || die "${p##*/} does not apply"
		sed '/^diff --git /,$d' "$p" | git_in "$dir" commit -q --no-verify --cleanup=verbatim -F -
		echo "recut: ${p##*/}" >&2
	done < <(series)
	echo "$dir"
}

cut() {
	local dir=$1 out=${2:-$patch_dir} n=0 c num name subject old
	dir=$(cd "$dir" && pwd)
	out=$(cd "$out" && pwd)
	while read -r c; do
		n=$((n + 1))
		printf -v num '%04d' "$n"
		subject=$(git_in "$dir" log -1 --format=%s "$c")
		[[ $subject == "mcbridge $num: "* ]] || die "commit $n ($c) is \"$subject\": it must start \"mcbridge $num: \""
		name=$(cd "$patch_dir" && compgen -G "$num-*.patch" || true)
		if [[ -z $name ]]; then
			name=$(printf '%s' "${subject#"mcbridge $num: "}" | tr -cs 'A-Za-z0-9' '-' | tr 'A-Z' 'a-z')
			name=$num-mcbridge-${name%-}.patch
			name=${name/-.patch/.patch}
		fi
		{
			# The message as committed (verbatim), then the diff, its blob ids
			# cut to the 7 digits the series has always had, whatever length
			# git would pick to keep them unique.
			git_in "$dir" cat-file commit "$c" | sed '1,/^$/d'
			git_in "$dir" diff --no-color --no-ext-diff --no-renames --full-index "$c~1" "$c" |
				sed -E 's/^index ([0-9a-f]{7})[0-9a-f]*\.\.([0-9a-f]{7})[0-9a-f]*/index \1..\2/'
		} >"$out/$name"
		echo "recut: $name" >&2
	done < <(git_in "$dir" rev-list --reverse "$(base "$dir")..HEAD")
	# Patches past the last commit are gone from the series.
	for old in "$out"/[0-9][0-9][0-9][0-9]-*.patch; do
		[[ -e $old ]] || continue
		num=${old##*/}
		((10#${num%%-*} <= n)) || { rm "$old" && echo "recut: removed ${old##*/}" >&2; }
	done
}

case ${1:-} in
tree) [[ $# -eq 3 ]] || die "usage: $0 tree SRC DIR"; tree "$2" "$3" ;;
cut) [[ $# -ge 2 && $# -le 3 ]] || die "usage: $0 cut DIR [OUT]"; cut "$2" "${3:-}" ;;
*) die "usage: $0 tree SRC DIR | cut DIR [OUT]" ;;
esac
