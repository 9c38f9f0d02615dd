package e2e

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// The swarm's blocks in a real Mooncake Store: a master supervised by
// `mcbridge serve --mooncake-master`, client segments contributed by the
// servers, entries in etcd. Every answer is compared with a stock
// llama-server's.

const storeDeadlineMS = 5000

// storeRef is the stock server the answers are compared with
// (assertStock).
func storeRef(t *testing.T, model string) string {
	return testenv.StartLlama(t, "stock", testenv.StockServer(t), serverArgs(model, "on", false)).URL
}

func patched(t *testing.T, name, model, cfg string) *testenv.Llama {
	s := testenv.StartLlama(t, name, testenv.PatchedServer(t), append(serverArgs(model, "on", false), "--mcb-config", cfg))
	require.Equal(t, "on", s.BridgeState(), "%s's bridge", name)
	// The bridge connects to the master in the background.
	testenv.Eventually(t, defaultWait, func() bool { return metric(t, s.URL, "mcbridge_up") == 1 }, "%s never reached the master", name)
	return s
}

func metric(t *testing.T, url, name string) float64 {
	return testenv.Metrics(t, url+"/metrics")[name]
}

// distinctBlocks counts the distinct whole blocks of prompts saved under
// one scope: a block is its prompt's tokens up to its end.
func distinctBlocks(prompts ...[]int32) int {
	seen := map[string]bool{}
	for _, p := range prompts {
		for end := block; end <= len(p); end += block {
			seen[fmt.Sprint(p[:end])] = true
		}
	}
	return len(seen)
}

// storeCounters prints, when a failure message is formatted, the store
// and publish counters of each bridge, to say where the blocks went.
type storeCounters struct {
	t    *testing.T
	urls map[string]string
}

func (c storeCounters) String() string {
	var b strings.Builder
	for _, who := range slices.Sorted(maps.Keys(c.urls)) {
		m := testenv.Metrics(c.t, c.urls[who]+"/metrics")
		fmt.Fprintf(&b, "\n%s:", who)
		for _, name := range slices.Sorted(maps.Keys(m)) {
			if strings.HasPrefix(name, "mcbridge_store_") || strings.HasPrefix(name, "mcbridge_publish") {
				fmt.Fprintf(&b, " %s=%v", strings.TrimPrefix(name, "mcbridge_"), m[name])
			}
		}
	}
	return b.String()
}

// Two patched servers and a proxy-fronted stock server write into one
// master and restore what each other computed.
func TestStoreSwarm(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	other := testenv.Tokens(600, 5, 29)
	promptD := testenv.Cat(other, testenv.Tokens(30, 3, 1))
	promptE := testenv.Cat(other, testenv.Tokens(50, 7, 2))
	ref := storeRef(t, model)
	etcd := etcdtest.Start(t)
	node := testenv.StartStoreNode(t, "node", etcd.Endpoint(), testenv.StoreNodeOptions{})
	cfg := node.Config(t, testenv.BridgeOptions{SegmentBytes: 32 << 20, DeadlineMS: storeDeadlineMS})
	x, y := patched(t, "x", model, cfg), patched(t, "y", model, cfg)
	s, dir := stockWithSlots(t, "s", model, "on")
	p := testenv.StartProxy(t, "p", s.URL, dir, cfg)
	// The bridges connect to the master in the background.
	testenv.Eventually(t, defaultWait, func() bool { return len(node.Segments(t)) == 4 }, "the node, x, y and the proxy each contribute a segment")

	got := x.Complete(t, testenv.Request{Prompt: promptA, Slot: 0, NPredict: nPredict})
	assertStock(t, ref, promptA, got, "x answers as stock")
	waitMirrored(t, y.URL, shared/block)
	got = y.Complete(t, testenv.Request{Prompt: promptB, Slot: 1, NPredict: nPredict})
	assert.Equal(t, []any{"restore", shared}, []any{got.MCB.Decision, got.MCB.RestoredN}, "y restores x's blocks from the store: %+v", got.MCB)
	assertStock(t, ref, promptB, got, "y answers as stock")
	waitMirrored(t, p.URL, shared/block)
	got = testenv.Complete(t, p.URL, testenv.Request{Prompt: promptC, Slot: -1, NPredict: nPredict})
	assert.Equal(t, shared, got.MCB.RestoredN, "the proxy restores x's blocks: %+v", got.MCB)
	assertStock(t, ref, promptC, got, "the proxy answers as stock")

	// What the stock server behind the proxy computed, a patched server
	// restores.
	before := metric(t, y.URL, "mcbridge_mirrored_blocks")
	got = testenv.Complete(t, p.URL, testenv.Request{Prompt: promptD, Slot: -1, NPredict: nPredict})
	assertStock(t, ref, promptD, got)
	waitMirrored(t, y.URL, int(before)+len(other)/block)
	got = y.Complete(t, testenv.Request{Prompt: promptE, Slot: 0, NPredict: nPredict})
	assert.Equal(t, []any{"restore", len(other) / block * block}, []any{got.MCB.Decision, got.MCB.RestoredN}, "%+v", got.MCB)
	assertStock(t, ref, promptE, got)

	assert.GreaterOrEqual(t, metric(t, x.URL, "mcbridge_store_put_blocks_total"), float64(shared/block))
	assert.GreaterOrEqual(t, metric(t, p.URL, "mcbridge_store_put_blocks_total"), float64(len(other)/block))
	assert.GreaterOrEqual(t, metric(t, y.URL, "mcbridge_store_get_blocks_total"), float64(shared/block+len(other)/block))
	assert.GreaterOrEqual(t, metric(t, p.URL, "mcbridge_store_get_blocks_total"), float64(shared/block))
	assert.Equal(t, float64(1), metric(t, y.URL, "mcbridge_up"))
}

// A server restores what another computed after that one exited: with two
// replicas the node's segment holds a copy, and the node publishes the
// entries again once the writer's leave.
func TestStoreRestoreAfterExit(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	ref := storeRef(t, model)
	etcd := etcdtest.Start(t)
	node := testenv.StartStoreNode(t, "node", etcd.Endpoint(), testenv.StoreNodeOptions{})
	cfg := node.Config(t, testenv.BridgeOptions{Replicas: 2, SegmentBytes: 32 << 20, DeadlineMS: storeDeadlineMS})
	x := patched(t, "x", model, cfg)
	assertStock(t, ref, promptA, x.Complete(t, testenv.Request{Prompt: promptA, Slot: 0, NPredict: nPredict}))
	testenv.Eventually(t, defaultWait, func() bool {
		return metric(t, x.URL, "mcbridge_store_put_blocks_total") >= float64(shared/block)
	}, "x never wrote its blocks")
	x.Stop()
	testenv.Eventually(t, defaultWait, func() bool {
		return metric(t, node.URL, "mcbridge_store_adopted_blocks_total") >= float64(shared/block)
	}, "the node never published x's blocks again")

	z := patched(t, "z", model, node.Config(t, testenv.BridgeOptions{Replicas: 2, DeadlineMS: storeDeadlineMS}))
	testenv.Eventually(t, defaultWait, func() bool { return metric(t, z.URL, "mcbridge_up") == 1 }, "z never reached the master")
	waitMirrored(t, z.URL, shared/block)
	got := z.Complete(t, testenv.Request{Prompt: promptB, Slot: 1, NPredict: nPredict})
	assert.Equal(t, []any{"restore", shared}, []any{got.MCB.Decision, got.MCB.RestoredN}, "z restores after x exited: %+v", got.MCB)
	assertStock(t, ref, promptB, got)
}

// The segment of the server that computed a prefix is SIGKILLed. With two
// replicas the prefix is restored from the other; with one, restores fail
// at once (the dead segment refuses), the prompt is computed within the
// deadline, and once the master drops the segment the audits drop the
// entries.
func TestStoreSegmentKilled(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	ref := storeRef(t, model)
	for _, replicas := range []int{2, 1} {
		t.Run(map[int]string{1: "one replica", 2: "two replicas"}[replicas], func(t *testing.T) {
			etcd := etcdtest.Start(t)
			node := testenv.StartStoreNode(t, "node", etcd.Endpoint(), testenv.StoreNodeOptions{})
			cfg := node.Config(t, testenv.BridgeOptions{Replicas: replicas, SegmentBytes: 32 << 20, DeadlineMS: storeDeadlineMS})
			x := patched(t, "x", model, cfg)
			y := patched(t, "y", model, node.Config(t, testenv.BridgeOptions{Replicas: replicas, DeadlineMS: storeDeadlineMS}))
			testenv.Eventually(t, defaultWait, func() bool { return len(node.Segments(t)) == 2 }, "x's segment never joined the node's")
			segments := 2
			assertStock(t, ref, promptA, x.Complete(t, testenv.Request{Prompt: promptA, Slot: 0, NPredict: nPredict}))
			waitMirrored(t, y.URL, shared/block)
			x.Kill()

			got := y.Complete(t, testenv.Request{Prompt: promptB, Slot: 1, NPredict: nPredict})
			assertStock(t, ref, promptB, got, "right after the kill y answers as stock: %+v", got.Timings)
			assert.Less(t, got.MCB.RestoreMS, float64(storeDeadlineMS), "no restore waits past the deadline")
			if replicas == 1 {
				assert.Equal(t, []any{"failed", 0}, []any{got.MCB.Decision, got.MCB.RestoredN},
					"the only replica died with x: %+v", got.Timings)
			}
			testenv.Eventually(t, defaultWait, func() bool { return len(node.Segments(t)) == segments-1 },
				"the master never dropped x's segment")
			if replicas == 2 {
				// x's entries leave with its lease; the survivors publish them
				// again, as the node's segment holds the other replicas.
				testenv.Eventually(t, defaultWait, func() bool {
					return metric(t, node.URL, "mcbridge_store_adopted_blocks_total")+metric(t, y.URL, "mcbridge_store_adopted_blocks_total") >= float64(shared/block)
				}, "nobody published x's blocks again")
				got = y.Complete(t, testenv.Request{Prompt: promptC, Slot: 0, NPredict: nPredict})
				assert.Equal(t, []any{"restore", shared}, []any{got.MCB.Decision, got.MCB.RestoredN}, "restored from the other replica: %+v", got.MCB)
				assertStock(t, ref, promptC, got)
				return
			}
			testenv.Eventually(t, defaultWait, func() bool {
				return metric(t, y.URL, "mcbridge_store_dropped_blocks_total") >= float64(shared/block)
			}, "the audits never dropped the dead segment's blocks")
			got = y.Complete(t, testenv.Request{Prompt: promptC, Slot: 0, NPredict: nPredict})
			assert.Equal(t, []any{"miss", 0}, []any{got.MCB.Decision, got.MCB.RestoredN}, "%+v", got.MCB)
			assertStock(t, ref, promptC, got)
		})
	}
}

// The master stopped (SIGSTOP): restores give up at the deadline and the
// servers answer as stock, saves leave the request path alone. Started
// again, it serves; killed, the node restarts it empty, the audits drop
// every entry, and new blocks flow again.
func TestStoreMasterStopped(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	other := testenv.Tokens(600, 5, 29)
	promptD := testenv.Cat(other, testenv.Tokens(30, 3, 1))
	promptE := testenv.Cat(other, testenv.Tokens(50, 7, 2))
	promptF := testenv.Cat(prefix, testenv.Tokens(20, 19, 4))
	ref := storeRef(t, model)
	etcd := etcdtest.Start(t)
	node := testenv.StartStoreNode(t, "node", etcd.Endpoint(), testenv.StoreNodeOptions{})
	const deadline = 2000
	x := patched(t, "x", model, node.Config(t, testenv.BridgeOptions{SegmentBytes: 32 << 20, DeadlineMS: deadline}))
	y := patched(t, "y", model, node.Config(t, testenv.BridgeOptions{DeadlineMS: deadline}))
	assertStock(t, ref, promptA, x.Complete(t, testenv.Request{Prompt: promptA, Slot: 0, NPredict: nPredict}))
	waitMirrored(t, y.URL, shared/block)

	pid := node.MasterState(t).Pid
	require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
	stopped := true
	defer func() {
		if stopped {
			_ = syscall.Kill(pid, syscall.SIGCONT)
		}
	}()
	got := y.Complete(t, testenv.Request{Prompt: promptB, Slot: 1, NPredict: nPredict})
	assertStock(t, ref, promptB, got, "the master stopped: y answers as stock")
	// The restore gives up at its deadline, or, once y has found the
	// master silent, y matches nothing it cannot read.
	assert.Contains(t, []string{"failed", "miss"}, got.MCB.Decision, "%+v", got.MCB)
	assert.Zero(t, got.MCB.RestoredN)
	assert.Less(t, got.MCB.RestoreMS, float64(deadline+1000), "no restore waits past its deadline")
	got = x.Complete(t, testenv.Request{Prompt: promptD, Slot: 1, NPredict: nPredict})
	assertStock(t, ref, promptD, got, "the master stopped: x computes and saves as stock answers")

	require.NoError(t, syscall.Kill(pid, syscall.SIGCONT))
	stopped = false
	testenv.Eventually(t, defaultWait, func() bool { return metric(t, y.URL, "mcbridge_up") == 1 }, "y never saw the master again")
	got = y.Complete(t, testenv.Request{Prompt: promptC, Slot: 0, NPredict: nPredict})
	assert.Equal(t, []any{"restore", shared}, []any{got.MCB.Decision, got.MCB.RestoredN}, "the master serves again: %+v", got.MCB)
	assertStock(t, ref, promptC, got)

	// Killed: the node starts a new, empty master. The audits find the
	// blocks gone; the copies still in the pools go into the new one by
	// themselves (whichever of x and y gets to a shared block first), and
	// saves flow again.
	require.NoError(t, syscall.Kill(pid, syscall.SIGKILL))
	testenv.Eventually(t, defaultWait, func() bool { return node.MasterState(t).Restarts == 1 }, "the node never restarted the master")
	testenv.Eventually(t, defaultWait, func() bool {
		return metric(t, x.URL, "mcbridge_store_dropped_blocks_total") >= float64(shared/block)
	}, "the audits never dropped the blocks the old master held")
	testenv.Eventually(t, defaultWait, func() bool { return metric(t, x.URL, "mcbridge_up") == 1 }, "x never reached the new master")
	got = x.Complete(t, testenv.Request{Prompt: promptE, Slot: 0, NPredict: nPredict})
	assertStock(t, ref, promptE, got)
	// Every block computed so far, promptD's included, which x saved while
	// the master was stopped; nothing else writes into this master.
	blocks := distinctBlocks(promptA, promptB, promptC, promptD, promptE)
	testenv.Eventually(t, defaultWait, func() bool { return len(node.Keys(t)) >= blocks },
		"the new master never held the %d blocks the pools keep%v", blocks, storeCounters{t, map[string]string{"x": x.URL, "y": y.URL, "node": node.URL}})
	z := patched(t, "z", model, node.Config(t, testenv.BridgeOptions{DeadlineMS: deadline}))
	waitMirrored(t, z.URL, blocks)
	got = z.Complete(t, testenv.Request{Prompt: promptF, Slot: 0, NPredict: nPredict})
	assert.Equal(t, []any{"restore", shared}, []any{got.MCB.Decision, got.MCB.RestoredN}, "x's copies, put back: %+v", got.MCB)
	assertStock(t, ref, promptF, got)
	got = z.Complete(t, testenv.Request{Prompt: promptD, Slot: 1, NPredict: nPredict})
	assert.Equal(t, []any{"restore", len(other) / block * block}, []any{got.MCB.Decision, got.MCB.RestoredN},
		"blocks x saved while the master was stopped: %+v", got.Timings)
	assertStock(t, ref, promptD, got)
}
