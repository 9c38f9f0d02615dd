//go:build !gpu

package e2e

import (
	"testing"

	"github.com/mcbridge/mcbridge/internal/testenv"
)

// The device of BenchmarkDeviceRestore: ggml's RPC backend, one rpc-server
// per llama-server (it serves one client at a time). It computes with the
// host's CPU backend, so its KV bytes are a host-KV server's.
const deviceComputesLikeHost = true

func onDevice(b *testing.B, name string) []string {
	return []string{"--rpc", testenv.StartRPC(b, "rpc-"+name).Endpoint, "-ngl", "99"}
}
