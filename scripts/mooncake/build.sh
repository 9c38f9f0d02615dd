#!/usr/bin/env bash
# build.sh te|store: builds the real Mooncake Transfer Engine (te) or Mooncake Store's
# master and C client (store) from the vendored, pinned source tarballs, once, into
# $MCB_CACHE, keyed by the tarball's sha256, and prints the output directory on the last
# line of stdout:
#
#   te     <dir>/install/lib/libtransfer_engine.so (+ libasio.so beside it)
#   store  <dir>/out/{mooncake_master,libmooncake_store.so,libasio.so,store_c.h}
#
# The numbered patches in patches/<what>/ (each says why it is carried; the store gets
# patches/te/ first) are applied to the sources before the build, in order; the cache key covers them too, so a changed
# patch rebuilds. A warm rerun checks a stamp and costs nothing. A failed build fails
# (exit 1): the suites that use these libraries never skip for want of them.
#
# MCB_MOONCAKE_VENDOR points at the vendor folder (default: ../shared/vendor beside the
# checkout, or, for a clone of a local checkout such as CI's, beside the checkout it was
# cloned from). The store build takes about 25 minutes on 2 cores and up to 5 GB per
# compiler process: it runs with -j2 and nothing else should compile beside it.
set -euo pipefail

what=${1:-}
case $what in
te) tarball_name=mooncake-te/mooncake-te-src.tar.gz script_name=mooncake-te/build-mooncake-te.sh ;;
store) tarball_name=mooncake-store/mooncake-store-src.tar.gz script_name=mooncake-store/build-mooncake-store.sh ;;
*) echo "usage: $0 te|store" >&2; exit 2 ;;
esac

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# vendor_dir prints the first folder that holds the vendored tarballs.
vendor_dir() {
	if [[ -n ${MCB_MOONCAKE_VENDOR:-} ]]; then
		echo "$MCB_MOONCAKE_VENDOR"
		return
	fi
	local origin
	origin=$(git -C "$repo" remote get-url origin 2>/dev/null || true)
	for d in "$repo/../shared/vendor" ${origin:+"$origin/../shared/vendor"}; do
		if [[ -d $d ]]; then
			echo "$d"
			return
		fi
	done
	echo "$repo/../shared/vendor"
}
vendor=$(vendor_dir)
cache=${MCB_CACHE:-$HOME/.cache/mcbridge}
log() { printf '[mooncake-%s %s] %s\n' "$what" "$(date +%H:%M:%S)" "$*" >&2; }

tarball=$vendor/$tarball_name
script=$vendor/$script_name
[[ -f $tarball && -f $script ]] || { log "error: no $tarball_name or $script_name under $vendor (set MCB_MOONCAKE_VENDOR)"; exit 1; }

# The store's client runs a Transfer Engine built from the store tree's own copy of
# the engine's sources, so the engine's patches apply to the store too, first.
patch_dirs=(te)
[[ $what == store ]] && patch_dirs+=(store)
patches=()
for d in "${patch_dirs[@]}"; do
	for p in "$repo/scripts/mooncake/patches/$d"/[0-9]*.patch; do
		[[ -f $p ]] && patches+=("$p")
	done
done
# The key: the tarball's sha256 alone where no patch is carried (so that such a build
# keeps its cache folder), else that of the tarball and the patches together.
sha=$(sha256sum "$tarball" | cut -c1-64)
((${#patches[@]} == 0)) || sha=$(cat "$tarball" "${patches[@]}" | sha256sum | cut -c1-64)
dir=$cache/mooncake-$what-${sha:0:16}
stamp=$dir/.built
case $what in
te) product=$dir/install/lib/libtransfer_engine.so ;;
store) product=$dir/out/libmooncake_store.so ;;
esac

if [[ -f $stamp && -f $product && $(cat "$stamp") == "$sha" ]]; then
	echo "$dir"
	exit 0
fi

# The vendor scripts install their Debian packages themselves; as non-root they cannot,
# so they are asked to skip and the packages must already be there.
skip_apt=
[[ $(id -u) == 0 ]] || skip_apt=1
# Everything from the previous attempt goes: a half-built tree is never reused.
rm -rf "$dir"
mkdir -p "$dir"
log "building from $tarball with ${#patches[@]} patch(es) (key ${sha:0:16}); log in $dir/build.log"
start=$SECONDS
# apply_patches SRC: applies each patch not already in SRC (its reverse applies
# cleanly there), so that a tree patched once is left as it is.
apply_patches() {
	local p
	for p in "${patches[@]}"; do
		if patch -d "$1" -p1 -R -s -f --dry-run <"$p" >/dev/null 2>&1; then
			continue
		fi
		patch -d "$1" -p1 -s -f --no-backup-if-mismatch <"$p" || { log "error: $(basename "$p") does not apply"; return 1; }
	done
}
if ((${#patches[@]})); then
	# The vendor script builds from a tarball: it gets one of the patched tree.
	tar xzf "$tarball" -C "$dir"
	top=$(tar tzf "$tarball" | sed -n '1s|/.*||p')
	apply_patches "$dir/$top"
	tar czf "$dir/patched-src.tar.gz" -C "$dir" "$top"
	rm -rf "${dir:?}/$top"
	tarball=$dir/patched-src.tar.gz
fi
if ! (SKIP_APT=$skip_apt JOBS=${JOBS:-2} SKIP_PY_RPC=1 bash "$script" "$tarball" "$dir") >"$dir/build.log" 2>&1; then
	tail -n 40 "$dir/build.log" >&2
	log "error: build failed after $((SECONDS - start)) s (full log: $dir/build.log)"
	exit 1
fi
[[ -f $product ]] || { log "error: the build ran but $product is missing"; exit 1; }
if [[ $what == store ]]; then
	# The master needs libasio.so at run time; the build copies it beside the master.
	[[ -f $dir/out/mooncake_master && -f $dir/out/libasio.so ]] || { log "error: mooncake_master or libasio.so missing in $dir/out"; exit 1; }
fi
echo "$sha" >"$stamp"
log "built in $((SECONDS - start)) s"
echo "$dir"
