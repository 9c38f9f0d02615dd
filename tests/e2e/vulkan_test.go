//go:build vulkan

package e2e

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/testenv"
)

// The device tests on Vulkan, built with -tags vulkan where stock and
// patched llama-server are built with ggml's Vulkan backend
// (LLAMA_BACKEND=vulkan scripts/llama/build.sh; `make test-vulkan`). The
// device is Mesa's llvmpipe, which ggml lists only when named, and flash
// attention stays off: llvmpipe 22.3.6 crashes on its shaders (docs/design.md
// §5.7).
const (
	envVulkanStock   = "MCB_VULKAN_STOCK_SERVER"
	envVulkanPatched = "MCB_VULKAN_PATCHED_SERVER"
)

var vulkanEnv = []string{"GGML_VK_VISIBLE_DEVICES=0"}

// A Vulkan-KV server restores the shared blocks another Vulkan-KV server
// computed and answers as Vulkan stock. A host-KV server of the same swarm
// gets what the probe says, and answers as host stock either way: on
// llvmpipe 22.3.6 the probe's bytes are not the CPU backend's, so it was a
// swarm of its own and restored nothing.
func TestVulkanKV(t *testing.T) {
	stockVK := testenv.Binary(t, envVulkanStock, "stock llama-server with Vulkan (LLAMA_BACKEND=vulkan scripts/llama/build.sh stock)")
	patchedVK := testenv.Binary(t, envVulkanPatched, "patched llama-server with Vulkan (LLAMA_BACKEND=vulkan scripts/llama/build.sh patched)")
	model := testenv.Model(t, "tiny", 0)
	cfg := deviceSwarm(t)
	onVulkan := append(serverArgs(model, "off", false), "-ngl", "99")
	onHost := serverArgs(model, "off", false)
	stockFrom := func(bin string, args []string, k int) []int32 {
		s := testenv.StartLlama(t, "stock", bin, args, vulkanEnv...)
		defer s.Stop()
		return testenv.StockFrom(t, s.URL, testenv.Request{Prompt: promptB, NPredict: nPredict}, k).Tokens
	}

	dev := testenv.StartLlama(t, "dev", patchedVK, append(onVulkan, "--mcb-config", cfg), vulkanEnv...)
	require.Equal(t, "on", dev.BridgeState())
	assert.Contains(t, dev.LogLine("mcbridge: on:"), "KV on Vulkan0", "the log names the device")
	first := dev.Complete(t, testenv.Request{Prompt: promptA, Slot: 0, NPredict: nPredict})
	assert.Equal(t, len(promptA)/block, first.MCB.SavedBlocks, "the Vulkan-KV server saves the prompt's full blocks")

	t.Run("vulkan KV", func(t *testing.T) {
		s := testenv.StartLlama(t, "vulkan", patchedVK, append(onVulkan, "--mcb-config", cfg), vulkanEnv...)
		defer s.Stop()
		waitMirrored(t, s.URL, shared/block)
		got := s.Complete(t, testenv.Request{Prompt: promptB, Slot: 1, NPredict: nPredict})
		assert.Equal(t, []any{"restore", shared}, []any{got.MCB.Decision, got.MCB.RestoredN},
			"restores what the Vulkan-KV server computed: %+v", got.MCB)
		assert.Equal(t, stockFrom(stockVK, onVulkan, shared), got.Tokens, "answers as Vulkan stock")
	})
	t.Run("host KV", func(t *testing.T) {
		s := testenv.StartLlama(t, "host", testenv.PatchedServer(t), append(onHost, "--mcb-config", cfg))
		defer s.Stop()
		require.Equal(t, "on", s.BridgeState())
		got := s.Complete(t, testenv.Request{Prompt: promptB, Slot: 1, NPredict: nPredict})
		assert.Contains(t, []int{0, shared}, got.MCB.RestoredN, "whole blocks or nothing: %+v", got.MCB)
		t.Logf("the host-KV server restored %d tokens of Vulkan KV (%s)", got.MCB.RestoredN, got.MCB.Reason)
		assert.Equal(t, stockFrom(testenv.StockServer(t), onHost, got.Timings.CacheN), got.Tokens, "answers as host stock")
	})
}
