# Thin driver over CMake, go and the scripts. `make` builds everything into
# build/, `make test` runs every test, `make demo` runs the swarm demo. Each of
# them works as the first command on a machine with Go, gcc, make and git:
# scripts/bootstrap.sh installs the Debian packages, scripts/deps.sh builds (once,
# cached under $MCB_CACHE) llama.cpp, the real Mooncake Transfer Engine and Mooncake
# Store.
BUILD ?= build
GO ?= go
CMAKE_FLAGS ?= -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
FUZZTIME ?= 30s
export MCB_CACHE ?= $(HOME)/.cache/mcbridge
export CCACHE_DIR ?= $(MCB_CACHE)/ccache
export MCB_TE_MOCK_LIB := $(abspath $(BUILD))/libmooncake_te_mock.so
# The end-to-end environment scripts/deps.sh writes.
E2E := . $(abspath $(BUILD))/e2e.env &&

.PHONY: all bootstrap configure deps test test-go test-cgocheck test-c test-bench test-llama-suite test-models test-vulkan demo fuzz bench-report clean

all: configure
	cmake --build $(BUILD) -j$$(nproc)

bootstrap:
	@scripts/bootstrap.sh

configure: bootstrap
	@test -f $(BUILD)/CMakeCache.txt || cmake -S . -B $(BUILD) $(CMAKE_FLAGS)

deps: all
	scripts/deps.sh $(BUILD)

test: test-go test-c test-bench test-llama-suite

# The packages that call C: the exported ABI (bridge) and the Mooncake
# libraries through purego.
CGO_PKGS := ./bridge/... ./internal/transport/mooncake/... ./internal/store/mooncake/...
CGOCHECK_TEST = GOEXPERIMENT=cgocheck2 $(GO) test -race -count=1 -timeout 45m $(CGO_PKGS)

# Every Go package, the end-to-end suites (tests/e2e) included, under the race
# detector; those that call C under cgocheck2 too, which catches Go pointers
# kept by C. cgocheck2 is a build setting, so they are a second go test,
# run beside the first (test-cgocheck runs it alone). tests/e2e, the longest
# package, starts first; the others wait on processes, peers and timeouts
# more than they compute: one at a time beside it, they ended 230 s after it.
test-go: deps
	@unformatted=$$(gofmt -l $$(git ls-files '*.go')); test -z "$$unformatted" || { echo "gofmt -l: $$unformatted"; exit 1; }
	$(GO) vet ./...
	$(GO) vet -tags demo ./demo/
	$(E2E) { $(CGOCHECK_TEST) & cgo=$$!; \
		pkgs=$$($(GO) list ./... | grep -vxF "$$($(GO) list $(CGO_PKGS))"); \
		$(GO) test -race -count=1 -p 3 -timeout 45m ./tests/e2e/ $$pkgs; rc=$$?; \
		wait $$cgo || rc=1; exit $$rc; }

test-cgocheck: deps
	$(E2E) $(CGOCHECK_TEST)

test-c: deps
	$(E2E) ctest --test-dir $(BUILD) --output-on-failure

# The report's benchmarks once each at its quick sizes, so that one that no
# longer builds or runs fails the run (about a minute): bench/, and those of
# internal/ and the router's that bench/cmd/report runs. The llama-server
# benchmarks of bench/e2e and bench/agentapi (about nine minutes at the quick
# sizes) run with the report's own run, bench-report.
test-bench: deps
	MCB_BENCH_QUICK=1 $(GO) test -run '^$$' -bench . -benchtime 1x -count 1 ./bench/ ./internal/residency/
	$(E2E) MCB_BENCH_QUICK=1 $(GO) test -run '^$$' -bench PeerRead -benchtime 1x -count 1 ./internal/transport/mooncake/
	$(E2E) MCB_BENCH_QUICK=1 $(GO) test -run '^$$' -bench Store -benchtime 1x -count 1 ./internal/store/mooncake/
	$(E2E) MCB_BENCH_QUICK=1 $(GO) test -run '^$$' -bench Route -benchtime 1x -count 1 ./bench/route/

# llama.cpp's own server test suite (pytest) against stock and the patched server with
# the bridge on (tests/llamasuite): the whole suite in a swarm, its contract files with
# '{}'; stock's results come from $(MCB_CACHE)/llamasuite while its inputs are unchanged.
# -v prints each run's pass count. LLAMA_SUITE_TIMEOUT bounds the whole go test: about
# 3 min a whole run on a quiet 2-core machine, several times that under load.
LLAMA_SUITE_TIMEOUT ?= 45m
test-llama-suite: deps
	$(E2E) $(GO) test -tags llamasuite -count=1 -v -timeout $(LLAMA_SUITE_TIMEOUT) -run '^TestLlamaServerSuite$$' ./tests/llamasuite/

# Every architecture test-llama-archs writes through the patched server and the proxy
# (tests/e2e TestModels; test-go runs its representatives), and its table, docs/models.md.
test-models: deps
	$(E2E) MCB_MODELS_ALL=1 MCB_MODELS_TABLE=$(abspath docs/models.md) $(GO) test -count=1 -v -timeout 3h -run '^TestModels$$' ./tests/e2e/

# The device tests on Vulkan (Mesa's llvmpipe; tests/e2e/vulkan_test.go, docs/design.md
# §5.7): stock and patched llama-server built with ggml's Vulkan backend. Not in `make
# test`: the Vulkan build takes about half an hour of two cores the first time, and
# needs libvulkan-dev, glslc and mesa-vulkan-drivers.
test-vulkan: deps
	$(E2E) MCB_VULKAN_STOCK_SERVER=$$(LLAMA_BACKEND=vulkan scripts/llama/build.sh stock) && \
	  MCB_VULKAN_PATCHED_SERVER=$$(LLAMA_BACKEND=vulkan scripts/llama/build.sh patched) && \
	  export MCB_VULKAN_STOCK_SERVER MCB_VULKAN_PATCHED_SERVER && \
	  $(GO) test -tags vulkan -count=1 -v -timeout 30m -run '^TestVulkanKV$$' ./tests/e2e/

# The swarm demo is a Go test behind the build tag "demo" (demo/demo_test.go),
# so that test-go leaves it out.
demo: deps
	$(E2E) $(GO) test -tags demo -count=1 -v -timeout 30m -run '^TestSwarmDemo$$' ./demo/

# Runs every fuzz target for FUZZTIME each (make test runs their seeds).
fuzz:
	@for pkg in $$($(GO) list ./...); do \
	  for t in $$($(GO) test -list '^Fuzz' $$pkg 2>/dev/null | grep '^Fuzz'); do \
	    echo "== $$pkg $$t"; $(GO) test -run '^$$' -fuzz "^$$t$$" -fuzztime $(FUZZTIME) $$pkg || exit 1; \
	  done; \
	done

# Regenerates docs/bench/README.md and its plots (MCB_BENCH_QUICK=1: a quick run).
bench-report: deps
	$(E2E) bench/report.sh

clean:
	rm -rf $(BUILD)
