#!/bin/sh
# harness-real.sh HARNESS GGUF: runs the C harness over the purego binding on the
# real Transfer Engine that MCB_TE_REAL_LIB names when the test runs (make
# test sets it from scripts/mooncake/build.sh te). Without it the test fails:
# a real-library test that could not run must not pass.
set -eu
harness=$1 model=$2
lib=${MCB_TE_REAL_LIB:-}
if [ -z "$lib" ]; then
	echo "harness_mooncake_real: MCB_TE_REAL_LIB is unset; it must name the real libtransfer_engine.so (scripts/mooncake/build.sh te prints its directory)" >&2
	exit 1
fi
if [ ! -f "$lib" ]; then
	echo "harness_mooncake_real: MCB_TE_REAL_LIB=$lib is not a file" >&2
	exit 1
fi
exec "$harness" --model "$model" --config "{\"transport\":{\"kind\":\"mooncake\",\"lib\":\"$lib\"}}"
