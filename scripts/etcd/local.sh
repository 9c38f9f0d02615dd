#!/usr/bin/env bash
# Runs a single-member etcd in the foreground for trying the etcd directory by hand, with
# the settings the directory expects: loopback only, a space quota and periodic
# auto-compaction (without it the history of every publish grows until NOSPACE).
#
#   scripts/etcd/local.sh [DATA_DIR]      # default $MCB_CACHE/etcd-local (~/.cache/mcbridge)
#
# MCB_ETCD_PORT (2379) sets the client port, the peer port is the next one. Extra etcd
# flags go in MCB_ETCD_FLAGS. Point the bridge at it with
#   {"directory": {"kind": "etcd", "endpoints": ["http://127.0.0.1:2379"]}}
set -euo pipefail

bin=$("$(dirname "${BASH_SOURCE[0]}")/ensure.sh" | tail -n1)
data=${1:-${MCB_CACHE:-$HOME/.cache/mcbridge}/etcd-local}
port=${MCB_ETCD_PORT:-2379}
client=http://127.0.0.1:$port
peer=http://127.0.0.1:$((port + 1))
mkdir -p "$data"
chmod 700 "$data" # etcd warns about a data directory others can read
printf '[etcd] serving %s, data in %s\n' "$client" "$data" >&2
# shellcheck disable=SC2086 # MCB_ETCD_FLAGS is a list of flags
exec "$bin" --name=mcbridge --data-dir="$data" \
	--listen-client-urls="$client" --advertise-client-urls="$client" \
	--listen-peer-urls="$peer" --initial-advertise-peer-urls="$peer" \
	--initial-cluster="mcbridge=$peer" \
	--quota-backend-bytes=$((8 << 30)) \
	--auto-compaction-mode=periodic --auto-compaction-retention=10m \
	--logger=zap --log-level=warn ${MCB_ETCD_FLAGS:-}
