//go:build gpu

package e2e

import "testing"

// onDevice puts every layer of a BenchmarkDeviceRestore server, KV
// included, on CUDA0, in a -tags gpu build where llama-server is built
// with -DGGML_CUDA=ON (scripts/gpu/check.sh).
func onDevice(*testing.B, string) []string { return []string{"-ngl", "99"} }
