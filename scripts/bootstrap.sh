#!/usr/bin/env bash
# bootstrap.sh: installs the Debian packages the build and the tests need, when
# missing, so that `make demo` and `make test` work as the first command on a machine
# with only Go, gcc, make and git. Root installs with apt-get; anyone else is told
# what to install. Fast when everything is there.
set -euo pipefail

# The C toolchain's build tools; etcd for the directory tests; curl and jq for
# scripts/llama/prefill.sh; iproute2 for the network-namespace tests; the real Mooncake Transfer Engine's
# and Mooncake Store's build and runtime dependencies (scripts/mooncake/build.sh te|store;
# the store adds zstd, xxhash and msgpack, which brings the boost headers); llama.cpp's
# server test suite's Python packages (tests/llamasuite; openai is not packaged); SQLite
# for Ollama (scripts/ollama/build.sh builds it with -tags libsqlite3).
pkgs=(cmake ninja-build ccache pkg-config jq curl etcd-server iproute2 git patch
	python3 python3-dev python3-pytest python3-requests python3-wget
	python3-filelock python3-numpy python3-prometheus-client python3-aiohttp libibverbs-dev libnuma-dev libgoogle-glog-dev libgflags-dev
	libjsoncpp-dev libyaml-cpp-dev libcurl4-openssl-dev
	libzstd-dev libxxhash-dev libmsgpack-cxx-dev libboost-dev libsqlite3-dev)

missing=()
for p in "${pkgs[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
((${#missing[@]} == 0)) && exit 0

if [[ $(id -u) != 0 ]]; then
	echo "bootstrap: missing Debian packages: ${missing[*]}" >&2
	echo "bootstrap: run as root, or: sudo apt-get install -y ${missing[*]}" >&2
	exit 1
fi
echo "bootstrap: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
