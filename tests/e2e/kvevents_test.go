package e2e

import (
	"fmt"
	"math/rand"
	"net"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/kvevents/kvsub"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// eventsPod is a process publishing KV events at fixed endpoints, so that
// a restart binds them again, as a restarted server does.
type eventsPod struct {
	name, cfg, pub, replay string
}

// eventsPort is a free loopback port below the ephemeral range. A
// subscriber redialling a port in that range while nothing listens can
// be given it as its own source port and connect to itself; a process
// binding the port later (SO_REUSEADDR) then never hears from it.
func eventsPort(t *testing.T) int {
	for range 100 {
		port := 20000 + rand.Intn(12000)
		if l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port)); err == nil {
			require.NoError(t, l.Close())
			return port
		}
	}
	require.FailNow(t, "no free port in 20000..32000")
	return 0
}

// newEventsPod configures a process of the name, whose directory entries
// live for leaseS seconds; model names its topics ("" for the default).
// later formats as what f returns when the message is written: the
// arguments of testenv.Eventually are evaluated before it polls, and a
// timeout should report the state it gave up on.
type later func() any

func (f later) String() string { return fmt.Sprint(f()) }

func newEventsPod(t *testing.T, name, etcd, prefix string, leaseS int, model string) eventsPod {
	pub, replay := eventsPort(t), eventsPort(t)
	cfg := fmt.Sprintf(`{"block_tokens": 64, "arbiter": {"policy": "always-restore"},
		"directory": {"kind": "etcd", "endpoints": [%q], "prefix": %q, "lease_ttl_s": %d}, "transport": {"kind": "mooncake", "lib": %q},
		"kv_events": {"endpoint": "tcp://*:%d", "replay_endpoint": "tcp://*:%d", "instance": %q, "model": %q, "heartbeat_ms": 200}}`,
		etcd, prefix, leaseS, mockTE, pub, replay, name, model)
	return eventsPod{name: name, cfg: cfg, pub: fmt.Sprintf("tcp://127.0.0.1:%d", pub), replay: fmt.Sprintf("tcp://127.0.0.1:%d", replay)}
}

func (p eventsPod) subscribe(t *testing.T, idx *kvsub.Index, drop func(uint64) bool) *kvsub.Subscriber {
	// The pods send heartbeats every 200 ms: ten missed, and the consumer
	// dials again (a killed pod's successor is not always reconnected).
	s, err := kvsub.Subscribe(idx, p.pub, kvsub.Options{Replay: p.replay, Drop: drop, Silence: 2 * time.Second})
	require.NoError(t, err)
	t.Cleanup(s.Close)
	return s
}

// Processes that publish KV events, patched llama-servers or stock ones
// behind proxies, followed by a consumer written from vLLM's format: it
// ranks the process holding a prompt's prefix first, drops what a killed
// one held once a new one starts at its endpoints, and recovers lost
// batches through the replay socket. Every stored block's hash is checked
// against its tokens.
func TestKVEventsInterop(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	for _, host := range []struct {
		name  string
		start func(t *testing.T, name, cfg string) *testenv.Server
	}{
		{"proxy", func(t *testing.T, name, cfg string) *testenv.Server {
			s, d := stockWithSlots(t, name, model, "on")
			return testenv.StartProxy(t, name, s.URL, d, cfg).Server
		}},
		{"patched-server", func(t *testing.T, name, cfg string) *testenv.Server {
			return testenv.StartLlama(t, name, testenv.PatchedServer(t), append(serverArgs(model, "on", false), "--mcb-config", cfg)).Server
		}},
	} {
		t.Run(host.name, func(t *testing.T) { kvEventsInterop(t, model, "/kvevents-"+host.name, host.start) })
	}
}

func kvEventsInterop(t *testing.T, model, prefixKey string, start func(t *testing.T, name, cfg string) *testenv.Server) {
	name := strings.TrimSuffix(filepath.Base(model), ".gguf")
	etcd := etcdtest.Start(t)
	pods := []eventsPod{newEventsPod(t, "pod-1", etcd.Endpoint(), prefixKey, 10, ""), newEventsPod(t, "pod-2", etcd.Endpoint(), prefixKey, 10, "")}
	idx, lossy := kvsub.NewIndex(1337), kvsub.NewIndex(1337)
	var armed atomic.Bool
	var subs, live []*kvsub.Subscriber
	for _, p := range pods {
		live = append(live, p.subscribe(t, idx, nil))
	}
	var servers []*testenv.Server
	for i, p := range pods {
		servers = append(servers, start(t, p.name, p.cfg))
		drop := func(uint64) bool { return i == 1 && armed.CompareAndSwap(true, false) }
		subs = append(subs, p.subscribe(t, lossy, drop))
	}

	// Each process computes its own prompt; both share the first 512 tokens.
	pa := testenv.Cat(prefix[:512], testenv.Tokens(200, 5, 11))
	pb := testenv.Cat(prefix[:512], testenv.Tokens(100, 3, 17))
	testenv.Complete(t, servers[0].URL, testenv.Request{Prompt: pa, Slot: -1, NPredict: nPredict})
	testenv.Complete(t, servers[1].URL, testenv.Request{Prompt: pb, Slot: -1, NPredict: nPredict})
	qa := testenv.Cat(pa, testenv.Tokens(64, 1, 1))
	qb := testenv.Cat(pb, testenv.Tokens(64, 1, 1))
	testenv.Eventually(t, defaultWait, func() bool {
		ra, rb := idx.Rank(name, qa, block), idx.Rank(name, qb, block)
		return len(ra) > 0 && ra[0] == kvsub.Score{Pod: "pod-1", Blocks: len(pa) / block} &&
			len(rb) > 0 && rb[0] == kvsub.Score{Pod: "pod-2", Blocks: len(pb) / block}
	}, "the holders never ranked first: %v %v; subscribers saw %v %v", later(func() any { return idx.Rank(name, qa, block) }),
		later(func() any { return idx.Rank(name, qb, block) }), later(func() any { return live[0].Counts() }),
		later(func() any { return live[1].Counts() }))
	// pod-2 restored the shared prefix from pod-1 and announces its whole
	// chain from position 0: both hold the shared blocks.
	assert.Equal(t, []kvsub.Score{{Pod: "pod-1", Blocks: 8}, {Pod: "pod-2", Blocks: 8}}, idx.Rank(name, prefix[:512], block))
	n, errs := idx.Mismatches()
	require.Zero(t, n, "stored hashes that are not the standard hash of their tokens: %v", errs)
	assert.Positive(t, testenv.Metrics(t, servers[0].URL+"/metrics")["mcbridge_kv_events_published_total"])

	// A batch of pod-2's is lost on the way to the lossy consumer; the
	// next one shows the gap and the replay socket fills it.
	before := subs[1].Counts()
	armed.Store(true)
	pc := testenv.Cat(testenv.Tokens(300, 13, 7), testenv.Tokens(10, 1, 0))
	testenv.Complete(t, servers[1].URL, testenv.Request{Prompt: pc, Slot: -1, NPredict: nPredict})
	testenv.Eventually(t, defaultWait, func() bool { return subs[1].Counts().Dropped > before.Dropped }, "no batch was dropped")
	testenv.Complete(t, servers[1].URL, testenv.Request{Prompt: testenv.Tokens(200, 19, 3), Slot: -1, NPredict: nPredict})
	qc := pc
	testenv.Eventually(t, defaultWait, func() bool {
		r := lossy.Rank(name, qc, block)
		return len(r) == 1 && r[0].Pod == "pod-2" && r[0].Blocks == len(pc)/block
	}, "the lossy consumer never recovered pod-2's blocks: %v, %v", later(func() any { return lossy.Rank(name, qc, block) }),
		later(func() any { return subs[1].Counts() }))
	after := subs[1].Counts()
	assert.Greater(t, after.Gaps, before.Gaps)
	assert.Greater(t, after.Replayed, before.Replayed)
	assert.Empty(t, after.Errors)
	assert.Equal(t, idx.Rank(name, qc, block), lossy.Rank(name, qc, block))

	// pod-1 is killed: it says nothing. A new process at its endpoints
	// starts with AllBlocksCleared, and the consumer drops what the old
	// one held; pod-2's blocks stay.
	servers[0].Kill()
	again := start(t, "pod-1-again", pods[0].cfg)
	// A consumer learns of a new stream from its batches: the new process
	// computes a prompt of its own.
	pd := testenv.Tokens(130, 23, 5)
	testenv.Complete(t, again.URL, testenv.Request{Prompt: pd, Slot: -1, NPredict: nPredict})
	testenv.Eventually(t, defaultWait, func() bool { return idx.Held(name, "pod-1") == len(pd)/block },
		"pod-1 holds %v blocks, not only the new process's %d", later(func() any { return idx.Held(name, "pod-1") }), len(pd)/block)
	assert.Equal(t, []kvsub.Score{{Pod: "pod-2", Blocks: 8}}, idx.Rank(name, prefix[:512], block))
	assert.Equal(t, 1, live[0].Counts().Restarts, "the consumer saw pod-1's stream begin again")
	for i, sub := range append(live, subs...) {
		assert.Empty(t, sub.Counts().Errors, "subscriber %d", i)
	}
}

// A store node keeps what a killed proxy computed routable: it announces
// nothing while the proxy holds the blocks, and once the proxy's lease
// expires it publishes its copies under its own topic, where the consumer
// ranks it for the prefix. The store names its topics with the model's
// name, as an operator configures one serving that model.
func TestKVEventsStoreNode(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	name := strings.TrimSuffix(filepath.Base(model), ".gguf")
	etcd := etcdtest.Start(t)
	pod := newEventsPod(t, "pod-1", etcd.Endpoint(), "/kvevents-store", 2, "")
	storePod := newEventsPod(t, "store", etcd.Endpoint(), "/kvevents-store", 10, name)
	idx := kvsub.NewIndex(1337)
	subs := []*kvsub.Subscriber{pod.subscribe(t, idx, nil), storePod.subscribe(t, idx, nil)}
	store := testenv.StartStore(t, "store", storePod.cfg, "--pool-bytes", fmt.Sprint(256<<20))
	stock, slots := stockWithSlots(t, "pod-1", model, "on")
	proxy := testenv.StartProxy(t, "pod-1", stock.URL, slots, pod.cfg)

	pa := testenv.Cat(prefix[:512], testenv.Tokens(200, 5, 11))
	testenv.Complete(t, proxy.URL, testenv.Request{Prompt: pa, Slot: -1, NPredict: nPredict})
	n := len(pa) / block
	testenv.Eventually(t, defaultWait, func() bool {
		return testenv.Metrics(t, store.URL+"/metrics")["mcbridge_replicated_blocks_total"] >= float64(n)
	}, "the store never copied the proxy's %d blocks", n)
	testenv.Eventually(t, defaultWait, func() bool {
		r := idx.Rank(name, pa, block)
		return len(r) == 1 && r[0] == kvsub.Score{Pod: "pod-1", Blocks: n}
	}, "the proxy never ranked alone: %v", later(func() any { return idx.Rank(name, pa, block) }))
	assert.Zero(t, idx.Held(name, "store"), "the store announced copies their owner still holds")

	proxy.Kill()
	testenv.Eventually(t, defaultWait, func() bool { return idx.Held(name, "store") == n },
		"the store announces %v blocks, not the killed proxy's %d (taken over: %v)", later(func() any { return idx.Held(name, "store") }), n,
		later(func() any { return testenv.Metrics(t, store.URL+"/metrics")["mcbridge_taken_over_blocks_total"] }))
	assert.Contains(t, idx.Rank(name, pa, block), kvsub.Score{Pod: "store", Blocks: n})
	bad, errs := idx.Mismatches()
	require.Zero(t, bad, "stored hashes that are not the standard hash of their tokens: %v", errs)
	for i, sub := range subs {
		assert.Empty(t, sub.Counts().Errors, "subscriber %d", i)
	}
}
