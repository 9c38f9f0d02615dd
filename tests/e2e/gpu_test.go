//go:build gpu

package e2e

import (
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/testenv"
)

// The device tests on a CUDA GPU, built with -tags gpu where llama-server
// (stock and patched) is built with -DGGML_CUDA=ON (scripts/gpu/check.sh).
// Whether a GPU's KV bytes are the host's is the probe's call (docs/design.md
// §3.2, §5.7): where they are, the placements share one swarm, as they did
// for these models on an H200; where they are not, each is a swarm of its
// own. Either way every answer is stock's for the same placement.

func mirroredBlocks(t *testing.T, url string) int {
	return int(testenv.Metrics(t, url+"/metrics")["mcbridge_mirrored_blocks"])
}

// onGPU are the arguments that put the first n layers, and their KV, on
// CUDA0.
func onGPU(model, layers string) []string {
	return append(serverArgs(model, "on", false), "-ngl", layers)
}

func TestGPUKV(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	cfg := deviceSwarm(t)
	start := func(name string, args []string, env ...string) *testenv.Llama {
		s := testenv.StartLlama(t, name, testenv.PatchedServer(t), append(args, "--mcb-config", cfg), env...)
		require.Equal(t, "on", s.BridgeState())
		return s
	}
	want := stockAnswer(t, onGPU(model, "99"), promptB, shared)

	holder := start("gpu-holder", onGPU(model, "99"))
	assert.Contains(t, holder.LogLine("mcbridge: on:"), "KV on CUDA0", "the log names the device")
	first := holder.Complete(t, testenv.Request{Prompt: promptA, Slot: 0, NPredict: nPredict})
	assert.Equal(t, len(promptA)/block, first.MCB.SavedBlocks, "the GPU server saves the prompt's full blocks")

	t.Run("second process", func(t *testing.T) {
		s := start("gpu-reader", onGPU(model, "99"))
		defer s.Stop()
		waitMirrored(t, s.URL, shared/block)
		got := s.Complete(t, testenv.Request{Prompt: promptB, Slot: 1, NPredict: nPredict})
		assert.Equal(t, []any{"restore", shared}, []any{got.MCB.Decision, got.MCB.RestoredN},
			"restores what the other GPU process computed: %+v", got.MCB)
		assert.Equal(t, want, got.Tokens, "answers as stock")
	})

	t.Run("partial offload", func(t *testing.T) {
		// The first layer on the GPU, the other on the host: one KV of
		// mixed placement, saved by one process and restored by another.
		a := start("gpu-partial-a", onGPU(model, "1"))
		defer a.Stop()
		b := start("gpu-partial-b", onGPU(model, "1"))
		defer b.Stop()
		waitMirrored(t, b.URL, shared/block)
		mirrored := mirroredBlocks(t, b.URL)
		saved := a.Complete(t, testenv.Request{Prompt: promptA, Slot: 0, NPredict: nPredict}).MCB.SavedBlocks
		waitMirrored(t, b.URL, mirrored+saved) // none new where a's KV is the holder's
		got := b.Complete(t, testenv.Request{Prompt: promptB, Slot: 1, NPredict: nPredict})
		assert.Equal(t, []any{"restore", shared}, []any{got.MCB.Decision, got.MCB.RestoredN},
			"restores what a partial-offload process computed: %+v", got.MCB)
		assert.Equal(t, stockAnswer(t, onGPU(model, "1"), promptB, shared), got.Tokens, "answers as stock")
	})

	t.Run("host KV", func(t *testing.T) {
		s := start("host", serverArgs(model, "on", false))
		defer s.Stop()
		waitMirrored(t, s.URL, shared/block)
		got := s.Complete(t, testenv.Request{Prompt: promptB, Slot: 1, NPredict: nPredict})
		t.Logf("a host-KV server asking for the GPU's prefix: %s, %d tokens restored", got.MCB.Decision, got.MCB.RestoredN)
		assert.Equal(t, stockAnswer(t, serverArgs(model, "on", false), promptB, got.Timings.CacheN), got.Tokens, "answers as stock")
	})

	t.Run("proxy", func(t *testing.T) {
		dir := testenv.SlotDir(t, "stock-gpu")
		up := testenv.StartLlama(t, "stock-gpu", testenv.StockServer(t), append(onGPU(model, "99"), "--slot-save-path", dir))
		defer up.Stop()
		proxy := testenv.StartProxy(t, "proxy", up.URL, dir, cfg)
		waitMirrored(t, proxy.URL, shared/block)
		got := testenv.Complete(t, proxy.URL, testenv.Request{Prompt: promptB, Slot: -1, NPredict: nPredict})
		assert.Equal(t, shared, got.MCB.RestoredN, "the proxy restores into a GPU upstream: %+v", got.MCB)
		assert.Equal(t, want, got.Tokens, "answers as stock")
	})

	t.Run("holder stopped, then killed", func(t *testing.T) {
		// Prefixes only the holder has: nothing else in the swarm can serve
		// them.
		prefixes := [][]int32{testenv.Tokens(600, 3, 100), testenv.Tokens(600, 5, 200)}
		// The mock's same-host path reads a stopped process's memory, which
		// no real transport can (see TestHungHolder).
		s := start("gpu-faults", onGPU(model, "99"), "MOCK_TE_VM_EPERM=1")
		defer s.Stop()
		waitMirrored(t, s.URL, shared/block)
		mirrored := mirroredBlocks(t, s.URL)
		for _, p := range prefixes {
			holder.Complete(t, testenv.Request{Prompt: testenv.Cat(p, testenv.Tokens(50, 7, 9)), Slot: 0, NPredict: 1})
		}
		waitMirrored(t, s.URL, mirrored+len(prefixes)*(len(prefixes[0])+50)/block)
		ask := func(p []int32) testenv.Completion {
			return s.Complete(t, testenv.Request{Prompt: testenv.Cat(p, testenv.Tokens(60, 11, 13)), Slot: 1, NPredict: nPredict})
		}

		holder.Signal(syscall.SIGSTOP)
		got := ask(prefixes[0])
		holder.Signal(syscall.SIGCONT)
		assert.Equal(t, []any{"failed", 0}, []any{got.MCB.Decision, got.MCB.RestoredN}, "holder stopped: %+v", got.MCB)
		assert.Contains(t, got.MCB.Error, "timed out", "the failure names the deadline")
		assert.Equal(t, stockAnswer(t, onGPU(model, "99"), testenv.Cat(prefixes[0], testenv.Tokens(60, 11, 13)), got.Timings.CacheN),
			got.Tokens, "holder stopped: computes and answers as stock")

		// The stopped holder's miss marked it down in s's mirror, so s may
		// not even try it now ("miss"); either way nothing is restored.
		holder.Kill()
		got = ask(prefixes[1])
		assert.Zero(t, got.MCB.RestoredN, "holder killed: %+v", got.MCB)
		assert.Equal(t, stockAnswer(t, onGPU(model, "99"), testenv.Cat(prefixes[1], testenv.Tokens(60, 11, 13)), got.Timings.CacheN),
			got.Tokens, "holder killed: computes and answers as stock")
	})
}
