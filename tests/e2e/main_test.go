// Package e2e runs the bridge's hosts end to end, each in its own process,
// on loopback: the patched llama-server, stock llama-servers behind
// `mcbridge proxy`, the libllama embedder, store nodes and etcd. Every
// check compares greedy outputs with a stock llama-server's; none trusts
// the bridge's own account of what it restored.
//
// `make test` builds llama-server (stock and patched) and the real Mooncake
// Transfer Engine and passes their paths in the environment (package
// internal/testenv); run alone, the suite fails and names what is missing.
package e2e

import (
	"encoding/json"
	"testing"
	"time"

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
