#!/usr/bin/env bash
# Makes an etcd server binary available for the directory tests and prints its path on
# the last line of stdout.
#
#   scripts/etcd/ensure.sh          # $MCB_ETCD_BIN, /usr/bin/etcd or etcd on PATH; as root,
#                                   # installs Debian's etcd-server package when none is found
#
# The tests (internal/directory/etcd/etcdtest) look in the same places and skip without one.
set -euo pipefail

log() { printf '[etcd %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

find_etcd() {
	if [[ -n ${MCB_ETCD_BIN:-} ]]; then
		[[ -x $MCB_ETCD_BIN ]] || die "MCB_ETCD_BIN=$MCB_ETCD_BIN is not an executable"
		echo "$MCB_ETCD_BIN"
	elif [[ -x /usr/bin/etcd ]]; then
		echo /usr/bin/etcd
	else
		command -v etcd || true
	fi
}

bin=$(find_etcd)
if [[ -z $bin ]]; then
	[[ $(id -u) == 0 ]] || die "no etcd server: install Debian's etcd-server package (apt-get install etcd-server) or set MCB_ETCD_BIN"
	log "installing etcd-server"
	apt-get update -qq >&2
	# The package's service is not wanted: tests start their own servers.
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends etcd-server >&2
	bin=$(find_etcd)
	[[ -n $bin ]] || die "etcd-server installed but no etcd binary found"
fi
log "$("$bin" --version | head -1) at $bin"
echo "$bin"
