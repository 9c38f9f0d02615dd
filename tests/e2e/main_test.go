// Package e2e runs the bridge's hosts end to end, each in its own process,
// on loopback: the patched llama-server, stock llama-servers behind
// `mcbridge proxy`, the libllama embedder, store nodes and etcd. Every
// check compares greedy outputs with a stock llama-server's in the same
// cache state (testenv.StockFrom); none trusts the bridge's own account of
// what it restored.
//
// `make test` builds llama-server (stock and patched) and the real Mooncake
// Transfer Engine and passes their paths in the environment (package
// internal/testenv); run alone, the suite fails and names what is missing.
package e2e

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/mcbridge/mcbridge/internal/testenv"
)

// mockTE is the mock Transfer Engine library.
var mockTE string

func TestMain(m *testing.M) { testenv.MainMockTE(m, &mockTE) }

// defaultWait bounds what the tests wait for that happens in the
// background: publishing, the directory's watch, a lease's expiry.
const defaultWait = 60 * time.Second

func jsonGet(t *testing.T, url string, out any) error {
	t.Helper()
	return json.Unmarshal(testenv.Get(t, url), out)
}

// assertStock checks that got, a server's answer to prompt (nPredict
// tokens), is the stock server's at url in the state got was computed
// from: holding as many of the prompt's tokens as got's cache_n says.
func assertStock(t *testing.T, url string, prompt []int32, got testenv.Completion, msgAndArgs ...any) bool {
	t.Helper()
	want := testenv.StockFrom(t, url, testenv.Request{Prompt: prompt, NPredict: nPredict}, got.Timings.CacheN)
	return assert.Equal(t, want.Tokens, got.Tokens, msgAndArgs...)
}
