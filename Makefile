# Thin driver over CMake, go and the scripts. `make` builds everything into
# build/, `make test` runs every test, `make demo` runs the swarm demo.
BUILD ?= build
GO ?= go
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=RelWithDebInfo
FUZZTIME ?= 30s
export MCB_TE_MOCK_LIB := $(abspath $(BUILD))/libmooncake_te_mock.so

.PHONY: all configure test test-go test-cgocheck test-c test-llama demo fuzz bench-report clean

all: configure
	cmake --build $(BUILD) -j$$(nproc)

configure:
	@test -f $(BUILD)/CMakeCache.txt || cmake -S . -B $(BUILD) $(CMAKE_FLAGS)

test: all test-go test-cgocheck test-c test-llama

test-go: all
	$(GO) vet ./...
	$(GO) test -race -count=1 ./...

# cgocheck2 catches Go pointers kept by C; the cgo packages run under it.
test-cgocheck: all
	GOEXPERIMENT=cgocheck2 $(GO) test -count=1 ./cabi/... ./internal/transport/mooncake/...

test-c: all
	ctest --test-dir $(BUILD) --output-on-failure

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
