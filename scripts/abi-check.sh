#!/usr/bin/env bash
# Checks that the hand-written header, the cgo-generated header and the C
# shims agree: both headers compile together without warnings, every
# function the public header declares is defined in the archive, and every
# Go export is called by the shims (an export nobody calls means a shim
# was lost).
# usage: abi-check.sh CC include/mcbridge.h build/libmcbridge.h build/libmcbridge.a bridge/mcbridge.c
set -euo pipefail
cc=$1 public=$2 generated=$3 archive=$4 shims=$5
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

printf '#include "%s"\n#include "%s"\nint main(void) { return 0; }\n' "$public" "$generated" >"$tmp/both.c"
"$cc" -std=c11 -Wall -Wextra -Werror -c "$tmp/both.c" -o "$tmp/both.o"

declared=$(grep -oE '\bmcb_[a-z_]+\(' "$public" | tr -d '(' | sort -u)
defined=$(nm "$archive" 2>/dev/null | awk '$2 == "T" && $3 ~ /^mcb_/ {print $3}' | sort -u)
missing=$(comm -23 <(echo "$declared") <(echo "$defined"))
if [[ -n $missing ]]; then
  echo "declared in $public but not defined in $archive:" $missing >&2
  exit 1
fi
exports=$(grep -oE '\bmcbgo_[a-z_]+\b' "$generated" | sort -u)
for e in $exports; do
  grep -q "\b$e(" "$shims" || { echo "Go export $e is not called by $shims" >&2; exit 1; }
done
echo "abi: $(echo "$declared" | wc -l) public functions, $(echo "$exports" | wc -l) Go exports agree"
