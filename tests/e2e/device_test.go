package e2e

import (
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// The device of these tests is ggml's RPC backend: the KV lives in another
// process (an rpc-server), reached only through ggml's backend API, as a
// GPU's is. An rpc-server serves one client at a time, so every
// llama-server that uses a device has its own.

// onDevice are the arguments that put every layer, KV included, on the
// devices at endpoints.
func onDevice(model string, endpoints ...string) []string {
	rpc := endpoints[0]
	for _, e := range endpoints[1:] {
		rpc += "," + e
	}
	return append(serverArgs(model, "on", false), "--rpc", rpc, "-ngl", "99")
}

// deviceSwarm is one etcd directory and the mock Transfer Engine. A
// restore's deadline gets a margin of a second over the cost model's: the
// tiny model recomputes in milliseconds, so the default 50 ms margin is the
// whole deadline, and the first restore from a holder opens its segment
// (a connection and a handshake), which a loaded machine can take longer
// than that. The fault cases wait that second out.
func deviceSwarm(t *testing.T) string {
	etcd := etcdtest.Start(t)
	return bridgeConfig(`, "transfer_timeout_ms": 2000, "arbiter": {"deadline_margin_ms": 1000}, "directory": {"kind": "etcd", "endpoints": ["` +
		etcd.Endpoint() + `"], "lease_ttl_s": 60}, "transport": {"kind": "mooncake", "lib": "` + mockTE + `"}`)
}

// stockAnswer is stock's answer to prompt from its first k tokens
// (stockFrom), with the given placement arguments.
func stockAnswer(t *testing.T, args []string, prompt []int32, k int) []int32 {
	s := testenv.StartLlama(t, "stock", testenv.StockServer(t), args)
	defer s.Stop()
	return testenv.StockFrom(t, s.URL, testenv.Request{Prompt: prompt, NPredict: nPredict}, k).Tokens
}

// With KV on a device, fully or partly offloaded, on two devices, or kept
// on the host (--no-kv-offload), a second process restores the whole
// blocks of a shared prefix that a device-KV server computed and answers
// as stock; a host-KV server restores what a device-KV server saved and
// the other way round; a stock server with device KV behind the proxy
// restores it too.
func TestDeviceKV(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	cfg := deviceSwarm(t)
	spare := testenv.StartRPC(t, "rpc-spare") // for one server at a time
	// Every server below restores the prefix's whole blocks.
	want := stockAnswer(t, onDevice(model, spare.Endpoint), promptB, shared)

	holder := testenv.StartRPC(t, "rpc-holder")
	dev := testenv.StartLlama(t, "dev", testenv.PatchedServer(t), append(onDevice(model, holder.Endpoint), "--mcb-config", cfg))
	require.Equal(t, "on", dev.BridgeState())
	assert.Contains(t, dev.LogLine("mcbridge: on:"), "KV on RPC", "the log names the device")
	first := dev.Complete(t, testenv.Request{Prompt: promptA, Slot: 0, NPredict: nPredict})
	assert.Equal(t, len(promptA)/block, first.MCB.SavedBlocks, "the device-KV server saves the prompt's full blocks")

	for _, c := range []struct {
		name string
		args func() []string
	}{
		{"partial offload", func() []string {
			return append(serverArgs(model, "on", false), "--rpc", spare.Endpoint, "-ngl", "1")
		}},
		{"no kv offload", func() []string { return append(onDevice(model, spare.Endpoint), "-nkvo") }},
		{"two devices", func() []string {
			return append(onDevice(model, spare.Endpoint, testenv.StartRPC(t, "rpc-second").Endpoint), "-ts", "1,1")
		}},
		{"host KV", func() []string { return serverArgs(model, "on", false) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := testenv.StartLlama(t, c.name, testenv.PatchedServer(t), append(c.args(), "--mcb-config", cfg))
			defer s.Stop()
			require.Equal(t, "on", s.BridgeState())
			waitMirrored(t, s.URL, shared/block)
			got := s.Complete(t, testenv.Request{Prompt: promptB, Slot: 1, NPredict: nPredict})
			assert.Equal(t, []any{"restore", shared}, []any{got.MCB.Decision, got.MCB.RestoredN},
				"restores what the device-KV server computed: %+v", got.MCB)
			assert.Equal(t, want, got.Tokens, "answers as stock")
		})
	}

	t.Run("device restores what the host saved", func(t *testing.T) {
		host := testenv.StartLlama(t, "host", testenv.PatchedServer(t), append(serverArgs(model, "on", false), "--mcb-config", cfg))
		defer host.Stop()
		prefix2 := testenv.Tokens(600, 3, 100)
		q1 := testenv.Cat(prefix2, testenv.Tokens(50, 7, 9))
		q2 := testenv.Cat(prefix2, testenv.Tokens(60, 11, 13))
		host.Complete(t, testenv.Request{Prompt: q1, Slot: 0, NPredict: nPredict})
		waitMirrored(t, dev.URL, 2*shared/block)
		got := dev.Complete(t, testenv.Request{Prompt: q2, Slot: 1, NPredict: nPredict})
		assert.Equal(t, []any{"restore", shared}, []any{got.MCB.Decision, got.MCB.RestoredN},
			"the device-KV server restores what the host-KV server computed: %+v", got.MCB)
		assert.Equal(t, stockAnswer(t, onDevice(model, spare.Endpoint), q2, got.Timings.CacheN), got.Tokens, "answers as stock")
	})

	t.Run("proxy", func(t *testing.T) {
		dir := testenv.SlotDir(t, "stock-dev")
		up := testenv.StartLlama(t, "stock-dev", testenv.StockServer(t), append(onDevice(model, spare.Endpoint), "--slot-save-path", dir))
		defer up.Stop()
		etcdCfg := cfg // the proxy is one more bridge of the swarm
		proxy := testenv.StartProxy(t, "proxy", up.URL, dir, etcdCfg)
		waitMirrored(t, proxy.URL, shared/block)
		got := testenv.Complete(t, proxy.URL, testenv.Request{Prompt: promptB, Slot: -1, NPredict: nPredict})
		assert.Equal(t, shared, got.MCB.RestoredN, "the proxy restores into a device-KV upstream: %+v", got.MCB)
		assert.Equal(t, want, got.Tokens, "answers as stock")
	})
}

// The cache shapes beyond plain attention with their KV on a device: an MLA
// cache (K alone, no V tensors) is staged through host memory as K rows
// only, and so is an indexer cache beside an attention cache; a
// sliding-window and a hybrid memory stage their attention cache so,
// and their partial state (the window cache, the recurrent state) travels in
// a snapshot that llama.cpp's own state reader and writer move to and from
// the device. For each, a device-KV server restores what another computed,
// a host-KV server what a device-KV server computed, and both answer as
// stock.
func TestDeviceKVMemoryKinds(t *testing.T) {
	for _, c := range []struct{ model, log string }{
		{"deepseek2-moe", "no V (MLA), 2 stream(s) of 2048 cells"},
		{"gemma3-dense", "iswa window 32"},
		{"qwen35-dense", "recurrent layers"},
		// An attention cache with an indexer cache beside it, both staged:
		// DSA's K-only pair, and a hybrid's whose indexer has no V where the
		// attention cache has it.
		{"deepseek32-moe", "of them an indexer cache's"},
		{"qwen4exp-moe", "of them an indexer cache's"},
	} {
		t.Run(c.model, func(t *testing.T) { deviceKVModel(t, c.model, c.log) })
	}
}

func deviceKVModel(t *testing.T, name, log string) {
	model := filepath.Join(testenv.ArchModels(t), name+".gguf")
	su := setupArch(t, model, nil)
	cfg := deviceSwarm(t)
	onRPC := func(endpoint string) []string { return append(slices.Clone(su.args), "--rpc", endpoint, "-ngl", "99") }
	reqA := testenv.Request{Prompt: su.promptA, Slot: 0, NPredict: nPredict}
	reqB := testenv.Request{Prompt: su.promptB, Slot: 1, NPredict: nPredict}

	holder := testenv.StartRPC(t, "rpc-holder")
	dev := testenv.StartLlama(t, "dev", testenv.PatchedServer(t), append(onRPC(holder.Endpoint), "--mcb-config", cfg))
	defer dev.Stop()
	require.Equal(t, "on", dev.BridgeState())
	on := dev.LogLine("mcbridge: on:")
	assert.Contains(t, on, log, "the log names the cache")
	assert.Contains(t, on, "KV on RPC", "the log names the device")
	first := dev.Complete(t, reqA)
	assert.Equal(t, len(su.promptA)/block, first.MCB.SavedBlocks, "the device-KV server saves the prompt's full blocks")

	spare := testenv.StartRPC(t, "rpc-spare")
	for _, c := range []struct {
		name string
		args []string
	}{
		{"device KV", onRPC(spare.Endpoint)},
		{"host KV", su.args},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := testenv.StartLlama(t, "asker", testenv.PatchedServer(t), append(slices.Clone(c.args), "--mcb-config", cfg))
			require.Equal(t, "on", s.BridgeState())
			waitMirrored(t, s.URL, su.shared/block)
			got := s.Complete(t, reqB)
			s.Stop()
			assert.Equal(t, []any{"restore", su.shared}, []any{got.MCB.Decision, got.MCB.RestoredN},
				"restores what the device-KV server computed: %+v", got.MCB)
			assert.Equal(t, stockAnswer(t, onRPC(spare.Endpoint), su.promptB, got.Timings.CacheN), got.Tokens, "answers as stock")
		})
	}
}

// The fault cases with KV on a device, each answering as stock: the
// holder killed, the holder stopped (SIGSTOP) past the transfer deadline,
// and the restoring server's own device killed mid-restore, which ends the
// server as it ends a stock one (ggml's RPC client aborts) while the
// swarm goes on.
func TestDeviceFaults(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	cfg := deviceSwarm(t)
	rpcs := []*testenv.RPC{testenv.StartRPC(t, "rpc-x"), testenv.StartRPC(t, "rpc-y")}
	// Until the last request, every restore fails: the prompt is computed.
	want := stockAnswer(t, onDevice(model, rpcs[1].Endpoint), promptB, 0)

	start := func(name string, rpc *testenv.RPC, env ...string) *testenv.Llama {
		s := testenv.StartLlama(t, name, testenv.PatchedServer(t), append(onDevice(model, rpc.Endpoint), "--mcb-config", cfg), env...)
		require.Equal(t, "on", s.BridgeState())
		return s
	}
	x := start("x", rpcs[0])
	// The mock's same-host path reads a stopped process's memory, which no
	// real transport can (see TestHungHolder).
	y := start("y", rpcs[1], "MOCK_TE_VM_EPERM=1")
	x.Complete(t, testenv.Request{Prompt: promptA, Slot: 0, NPredict: nPredict})
	waitMirrored(t, y.URL, shared/block)

	x.Signal(syscall.SIGSTOP)
	got := y.Complete(t, testenv.Request{Prompt: promptB, Slot: 1, NPredict: nPredict})
	x.Signal(syscall.SIGCONT)
	assert.Equal(t, []any{"failed", 0}, []any{got.MCB.Decision, got.MCB.RestoredN}, "holder stopped: %+v", got.MCB)
	assert.Contains(t, got.MCB.Error, "timed out", "the failure names the deadline")
	assert.Equal(t, want, got.Tokens, "holder stopped: y computes and answers as stock")

	// y now holds the prefix too; x dies without unpublishing.
	y.Stop()
	x.Kill()
	z := start("z", rpcs[1])
	waitMirrored(t, z.URL, shared/block)
	got = z.Complete(t, testenv.Request{Prompt: promptB, Slot: 1, NPredict: nPredict})
	assert.Equal(t, []any{"failed", 0}, []any{got.MCB.Decision, got.MCB.RestoredN}, "holder killed: %+v", got.MCB)
	assert.Equal(t, want, got.Tokens, "holder killed: z computes and answers as stock")

	// A device lost while a request uses it: ggml's RPC client aborts the
	// process, the patched server's as a stock one's; the swarm goes on.
	for name, bin := range map[string]string{"stock": testenv.StockServer(t), "patched": testenv.PatchedServer(t)} {
		rpc := testenv.StartRPC(t, "rpc-"+name)
		args := onDevice(model, rpc.Endpoint)
		if name == "patched" {
			args = append(args, "--mcb-config", cfg)
		}
		s := testenv.StartLlama(t, name+"-lost", bin, args)
		rpc.Signal(syscall.SIGSTOP)
		done := make(chan completionOrError, 1)
		go func() { done <- postCompletion(s.URL, testenv.Request{Prompt: promptB, Slot: 1, NPredict: nPredict}) }()
		time.Sleep(500 * time.Millisecond) // the request is waiting on the device
		rpc.Kill()
		_ = s.Wait(time.Minute)
		assert.True(t, s.Exited(), "%s: the server ends with its device", name)
		assert.True(t, s.LogContains("Remote RPC server crashed"), "%s: ggml's RPC client says why", name)
		assert.Error(t, (<-done).err, "%s: the request in flight gets no answer", name)
	}
	got = z.Complete(t, testenv.Request{Prompt: promptB, Slot: 0, NPredict: nPredict})
	assert.Equal(t, stockAnswer(t, onDevice(model, testenv.StartRPC(t, "rpc-ref").Endpoint), promptB, got.Timings.CacheN), got.Tokens,
		"the rest of the swarm answers as stock")
}
