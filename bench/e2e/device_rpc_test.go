//go:build !gpu

package e2e

import (
	"testing"

	"github.com/mcbridge/mcbridge/internal/testenv"
)

// onDevice puts every layer of a BenchmarkDeviceRestore server, KV
// included, on its device: ggml's RPC backend, one rpc-server per
// llama-server (it serves one client at a time).
func onDevice(b *testing.B, name string) []string {
	return []string{"--rpc", testenv.StartRPC(b, "rpc-"+name).Endpoint, "-ngl", "99"}
}
