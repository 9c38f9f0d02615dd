//go:build gpu

package e2e

import "testing"

// The device of BenchmarkDeviceRestore in a -tags gpu build: CUDA0, with
// llama-server built with -DGGML_CUDA=ON (scripts/gpu/check.sh). Its
// kernels compute other bytes than the host's.
const deviceComputesLikeHost = false

func onDevice(*testing.B, string) []string { return []string{"-ngl", "99"} }
