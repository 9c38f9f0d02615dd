package e2e

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// hungTimeoutMS is the transfer deadline of TestHungHolder's servers.
const hungTimeoutMS = 1000

// A holder that stops answering (SIGSTOP: alive, its entries still in the
// directory until its lease runs out) costs the request that needed it at most
// the transfer deadline: the server computes the prompt with stock's
// answer, a request that needs nothing of the holder is answered while the
// holder is still stopped, and the next request for the prefix plans
// around the holder instead of waiting again.
func TestHungHolder(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	unrelated := testenv.Tokens(200, 17, 3)
	stock := testenv.StartLlama(t, "stock", testenv.StockServer(t), serverArgs(model, "on", false))
	want := stock.Complete(t, testenv.Request{Prompt: promptB, Slot: 1, NPredict: nPredict})
	wantUnrelated := stock.Complete(t, testenv.Request{Prompt: unrelated, Slot: 0, NPredict: nPredict})
	stock.Stop()
	for name, te := range transports(t) {
		t.Run(name, func(t *testing.T) {
			etcd := etcdtest.Start(t)
			cfg := bridgeConfig(`, "transfer_timeout_ms": ` + strconv.Itoa(hungTimeoutMS) + `, "directory": {"kind": "etcd", "endpoints": ["` + etcd.Endpoint() +
				`"], "lease_ttl_s": 60}, "transport": {"kind": "mooncake", "lib": "` + te + `"}`)
			x := testenv.StartLlama(t, "x", testenv.PatchedServer(t), append(serverArgs(model, "on", false), "--mcb-config", cfg))
			// The mock's same-host path reads a stopped process's memory,
			// which no real transport can: the reader takes the mock's TCP
			// path, as when the kernel refuses process_vm_readv.
			y := testenv.StartLlama(t, "y", testenv.PatchedServer(t), append(serverArgs(model, "on", false), "--mcb-config", cfg),
				"MOCK_TE_VM_EPERM=1")
			x.Complete(t, testenv.Request{Prompt: promptA, Slot: 0, NPredict: nPredict})
			waitMirrored(t, y.URL, shared/block)

			x.Signal(syscall.SIGSTOP)
			t.Cleanup(func() { x.Signal(syscall.SIGCONT) })
			other := make(chan completionOrError, 1)
			go func() {
				time.Sleep(100 * time.Millisecond) // while the restore waits on x
				other <- postCompletion(y.URL, testenv.Request{Prompt: unrelated, Slot: 0, NPredict: nPredict})
			}()
			got := y.Complete(t, testenv.Request{Prompt: promptB, Slot: 1, NPredict: nPredict})
			t.Logf("restore from the stopped holder: %.0f ms, %s", got.MCB.RestoreMS, got.MCB.Error)
			assert.Equal(t, []any{"failed", 0}, []any{got.MCB.Decision, got.MCB.RestoredN}, "restore from the stopped holder: %+v", got.MCB)
			assert.Contains(t, got.MCB.Error, "timed out", "the failure names the deadline")
			assert.Less(t, got.MCB.RestoreMS, float64(hungTimeoutMS+2000), "the restore gave up at the deadline")
			assert.Equal(t, want.Tokens, got.Tokens, "the server computes the prompt and answers as stock")

			o := <-other
			require.NoError(t, o.err, "the unrelated request")
			assert.Equal(t, wantUnrelated.Tokens, o.c.Tokens, "the unrelated request, answered while the holder is stopped")

			again := y.Complete(t, testenv.Request{Prompt: promptB, Slot: 0, NPredict: nPredict})
			assert.Equal(t, []any{"miss", 0}, []any{again.MCB.Decision, again.MCB.RestoredN},
				"the next request plans around the stopped holder: %+v", again.Timings)
			assert.Equal(t, want.Tokens, again.Tokens)
			assert.Equal(t, 1.0, testenv.Metrics(t, y.URL+"/metrics")["mcbridge_peers_down_total"], "the holder went down once")
		})
	}
}

type completionOrError struct {
	c   testenv.Completion
	err error
}

// postCompletion is testenv.Complete for a goroutine other than the
// test's: it returns its failure instead of failing the test.
func postCompletion(url string, r testenv.Request) completionOrError {
	body, err := json.Marshal(r.Body())
	if err != nil {
		return completionOrError{err: err}
	}
	resp, err := http.Post(url+"/completion", "application/json", bytes.NewReader(body))
	if err != nil {
		return completionOrError{err: err}
	}
	defer resp.Body.Close()
	var out completionOrError
	if resp.StatusCode != http.StatusOK {
		out.err = &httpStatusError{resp.StatusCode}
		return out
	}
	out.err = json.NewDecoder(resp.Body).Decode(&out.c)
	return out
}

type httpStatusError struct{ code int }

func (e *httpStatusError) Error() string { return http.StatusText(e.code) }
