# Thin driver over CMake, go and the scripts. `make` builds everything into
# build/, `make test` runs every test, `make demo` runs the swarm demo.
BUILD ?= build
GO ?= go
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=RelWithDebInfo
FUZZTIME ?= 30s
export MCB_TE_MOCK_LIB := $(abspath $(BUILD))/libmooncake_te_mock.so
# The transport tests run every case on the mock and on the real Transfer
# Engine, whose path te-real writes here; they fail without it.
TE_REAL_LIB_FILE := $(BUILD)/te-real-lib
with_te_real = MCB_TE_REAL_LIB="$$(cat $(TE_REAL_LIB_FILE))"

.PHONY: all configure te-real test test-go test-cgocheck test-c test-llama demo fuzz bench-report clean

all: configure
	cmake --build $(BUILD) -j$$(nproc)

configure:
	@test -f $(BUILD)/CMakeCache.txt || cmake -S . -B $(BUILD) $(CMAKE_FLAGS)

# The real Transfer Engine: $MCB_TE_REAL_LIB when set, else the library
# scripts/mooncake/build.sh te builds once (cached by its tarball's sha256).
te-real:
	@mkdir -p $(BUILD)
	@if [ -n "$${MCB_TE_REAL_LIB:-}" ]; then lib=$$MCB_TE_REAL_LIB; \
	else out=$$(scripts/mooncake/build.sh te) || exit 1; \
	  lib="$$(printf '%s\n' "$$out" | tail -n1)/install/lib/libtransfer_engine.so"; fi; \
	printf '%s\n' "$$lib" > $(TE_REAL_LIB_FILE)

test: all test-go test-cgocheck test-c test-llama

test-go: all te-real
	$(GO) vet ./...
	$(with_te_real) $(GO) test -race -count=1 ./...

# cgocheck2 catches Go pointers kept by C; the cgo packages run under it.
test-cgocheck: all te-real
	$(with_te_real) GOEXPERIMENT=cgocheck2 $(GO) test -count=1 ./cabi/... ./internal/transport/mooncake/...

test-c: all te-real
	$(with_te_real) ctest --test-dir $(BUILD) --output-on-failure

test-llama: all
	scripts/llama/smoke.sh stock
	scripts/stage1/test.sh
	scripts/server/test.sh
	scripts/proxy/test.sh

demo: all
	scripts/demo/run.sh

# Runs every fuzz target for FUZZTIME each (make test runs their seeds).
fuzz:
	@for pkg in $$($(GO) list ./...); do \
	  for t in $$($(GO) test -list '^Fuzz' $$pkg 2>/dev/null | grep '^Fuzz'); do \
	    echo "== $$pkg $$t"; $(GO) test -run '^$$' -fuzz "^$$t$$" -fuzztime $(FUZZTIME) $$pkg || exit 1; \
	  done; \
	done

# Regenerates docs/bench/README.md and its plots (MCB_BENCH_QUICK=1: a quick run).
bench-report:
	bench/report.sh

clean:
	rm -rf $(BUILD)
