# Thin driver over CMake and go. `make` builds everything into build/,
# `make test` runs every test, `make demo` runs the swarm demo.
BUILD ?= build
GO ?= go
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=RelWithDebInfo

.PHONY: all configure test test-go test-c demo fuzz bench-report clean

all: configure
	cmake --build $(BUILD) -j$$(nproc)

configure:
	@test -f $(BUILD)/CMakeCache.txt || cmake -S . -B $(BUILD) $(CMAKE_FLAGS)

test: all test-go test-c

test-go:
	$(GO) vet ./...
	$(GO) test -race -count=1 ./...
	GOEXPERIMENT=cgocheck2 $(GO) test -count=1 ./bridge/cabi/...

test-c: all
	ctest --test-dir $(BUILD) --output-on-failure -j2

clean:
	rm -rf $(BUILD)
