package e2e

import (
	"fmt"
	"sort"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// One swarm of mixed hosts: a patched llama-server and a stock one behind
// `mcbridge proxy`, the same GGUF, one etcd directory and a store node.
// Blocks saved by either host are restored by the other, both ways, with
// the stock server's greedy answers, and all three processes expose the
// same mcbridge_* series.
func TestMixedSwarm(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	etcd := etcdtest.Start(t)
	cfg := fmt.Sprintf(`{"block_tokens": 64, "directory": {"kind": "etcd", "endpoints": [%q]}, "transport": {"kind": "mooncake", "lib": %q}}`,
		etcd.Endpoint(), mockTE)
	store := testenv.StartStore(t, "store", cfg, "--pool-bytes", fmt.Sprint(256<<20))
	patched := testenv.StartLlama(t, "patched", testenv.PatchedServer(t), append(testenv.ServerArgs(model, 4096, 2, "on"), "--mcb-config", cfg))
	require.Equal(t, "on", patched.BridgeState())
	stock, slots := stockWithSlots(t, "stock", model, "on")
	proxy := testenv.StartProxy(t, "proxy", stock.URL, slots, cfg)
	ref := testenv.StartLlama(t, "ref", testenv.StockServer(t), testenv.ServerArgs(model, 4096, 2, "on"))

	// Patched → proxy.
	patched.Complete(t, testenv.Request{Prompt: promptA, Slot: 0, NPredict: nPredict})
	waitMirrored(t, proxy.URL, shared/block)
	got := testenv.Complete(t, proxy.URL, testenv.Request{Prompt: promptB, Slot: -1, NPredict: nPredict})
	assert.Equal(t, shared, got.MCB.RestoredN, "the proxy restores what the patched server computed: %+v", got.MCB)
	assertStock(t, ref.URL, promptB, got, "the proxy's answer is stock's")

	// Proxy → patched.
	prefix2 := testenv.Tokens(600, 3, 100)
	q1 := testenv.Cat(prefix2, testenv.Tokens(50, 7, 9))
	q2 := testenv.Cat(prefix2, testenv.Tokens(60, 11, 13))
	testenv.Complete(t, proxy.URL, testenv.Request{Prompt: q1, Slot: -1, NPredict: nPredict})
	waitMirrored(t, patched.URL, 2*shared/block)
	got = patched.Complete(t, testenv.Request{Prompt: q2, Slot: 1, NPredict: nPredict})
	assert.Equal(t, []any{"restore", shared}, []any{got.MCB.Decision, got.MCB.RestoredN},
		"the patched server restores what the proxied stock server computed: %+v", got.Timings)
	assertStock(t, ref.URL, q2, got, "the patched server's answer is stock's")

	// One vocabulary.
	names := map[string][]string{}
	for name, url := range map[string]string{"patched": patched.URL, "proxy": proxy.URL, "store": store.URL} {
		n := testenv.HelpNames(t, url+"/metrics", "mcbridge_")
		sort.Strings(n)
		names[name] = n
		assert.Equal(t, float64(1), testenv.Metrics(t, url+"/metrics")["mcbridge_up"], "%s: mcbridge_up", name)
	}
	require.NotEmpty(t, names["patched"])
	assert.Equal(t, names["patched"], names["proxy"], "the proxy's mcbridge_ series are the patched server's")
	assert.Equal(t, names["patched"], names["store"], "the store node's mcbridge_ series are the patched server's")
}
