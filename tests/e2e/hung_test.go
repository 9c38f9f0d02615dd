package e2e

import (
	"bytes"
	"encoding/json"
	"net/http"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// The hung holder's prompts: a 2560-token prefix, as in issue 27's report,
// in a context whose slots hold it.
var (
	hungPrefix  = testenv.Tokens(2560, 7, 3)
	hungPromptA = testenv.Cat(hungPrefix, testenv.Tokens(50, 11, 5))
	hungPromptB = testenv.Cat(hungPrefix, testenv.Tokens(70, 13, 9))
	hungOther   = testenv.Tokens(200, 17, 3)
)

// otherAfter is when the request on the other slot is sent after the one
// that needs the holder: while that one's restore is still in flight.
const otherAfter = 20 * time.Millisecond

func hungArgs(model string) []string { return testenv.ServerArgs(model, 8192, 2, "on") }

// A holder that stops answering (SIGSTOP: alive, its entries still in the
// directory until its lease runs out), with the default configuration,
// costs the request that needed it the restore's deadline, which the cost
// model sets at a few estimated restores plus its margin, and then the
// prompt is computed with stock's answer. A request on the other slot,
// sent while that restore is in flight, is decoded meanwhile: the loop does
// not wait for the restore. The next request for the prefix plans around
// the holder instead of waiting again. The times are logged against the
// same two requests on a stock server (docs/llama.md has a run's figures);
// no time is asserted.
func TestHungHolder(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	stock := testenv.StartLlama(t, "stock", testenv.StockServer(t), hungArgs(model))
	stock.Complete(t, testenv.Request{Prompt: testenv.Tokens(64, 3, 1), Slot: 0, NPredict: 1}) // warm up
	base := hungPair(t, stock.URL)
	for name, te := range transports(t) {
		t.Run(name, func(t *testing.T) {
			etcd := etcdtest.Start(t)
			cfg := bridgeConfig(`, "directory": {"kind": "etcd", "endpoints": ["` + etcd.Endpoint() +
				`"], "lease_ttl_s": 60}, "transport": {"kind": "mooncake", "lib": "` + te + `"}`)
			x := testenv.StartLlama(t, "x", testenv.PatchedServer(t), append(hungArgs(model), "--mcb-config", cfg))
			// The mock's same-host path reads a stopped process's memory,
			// which no real transport can: the reader takes the mock's TCP
			// path, as when the kernel refuses process_vm_readv.
			y := testenv.StartLlama(t, "y", testenv.PatchedServer(t), append(hungArgs(model), "--mcb-config", cfg),
				"MOCK_TE_VM_EPERM=1")
			x.Complete(t, testenv.Request{Prompt: hungPromptA, Slot: 0, NPredict: nPredict})
			waitMirrored(t, y.URL, len(hungPrefix)/block)
			y.Complete(t, testenv.Request{Prompt: testenv.Tokens(64, 3, 1), Slot: 0, NPredict: 1}) // warm up

			x.Signal(syscall.SIGSTOP)
			t.Cleanup(func() { x.Signal(syscall.SIGCONT) })
			got := hungPair(t, y.URL)
			t.Logf("%s: stopped sole holder of %d tokens, default config: its request %.0f ms (stock %.0f ms, %.2fx; "+
				"the restore gave up after %.1f ms: %s), the other slot's %.0f ms (stock %.0f ms, %.2fx)",
				name, len(hungPrefix), ms(got.holderTook), ms(base.holderTook), float64(got.holderTook)/float64(base.holderTook),
				got.holder.MCB.RestoreMS, got.holder.MCB.Error,
				ms(got.otherTook), ms(base.otherTook), float64(got.otherTook)/float64(base.otherTook))
			assert.Equal(t, []any{"failed", 0}, []any{got.holder.MCB.Decision, got.holder.MCB.RestoredN},
				"restore from the stopped holder: %+v", got.holder.MCB)
			assert.Contains(t, got.holder.MCB.Error, "timed out", "the failure names the deadline")
			// Each answer against stock's computed alone: the other request
			// is decoded while the holder's waits on its restore, where on
			// the stock server both prompts were computed together.
			assertStock(t, stock.URL, hungPromptB, got.holder, "the server computes the prompt and answers as stock")
			assertStock(t, stock.URL, hungOther, got.other, "the other slot's request, answered while the holder is stopped")

			again := y.Complete(t, testenv.Request{Prompt: hungPromptB, Slot: 0, NPredict: nPredict})
			assert.Equal(t, []any{"miss", 0}, []any{again.MCB.Decision, again.MCB.RestoredN},
				"the next request plans around the stopped holder: %+v", again.MCB)
			assertStock(t, stock.URL, hungPromptB, again)
			assert.Equal(t, 1.0, testenv.Metrics(t, y.URL+"/metrics")["mcbridge_peers_down_total"], "the holder went down once")
		})
	}
}

// hungRun is the two requests of TestHungHolder and how long each took,
// as its client saw it.
type hungRun struct {
	holder, other         testenv.Completion
	holderTook, otherTook time.Duration
}

// hungPair sends the request for the holder's prefix to slot 1 and, while
// it is served, the unrelated one to slot 0.
func hungPair(t *testing.T, url string) hungRun {
	type timed struct {
		completionOrError
		took time.Duration
	}
	send := func(r testenv.Request, out chan<- timed) {
		t0 := time.Now()
		c := postCompletion(url, r)
		out <- timed{c, time.Since(t0)}
	}
	holder, other := make(chan timed, 1), make(chan timed, 1)
	go send(testenv.Request{Prompt: hungPromptB, Slot: 1, NPredict: nPredict}, holder)
	time.Sleep(otherAfter)
	go send(testenv.Request{Prompt: hungOther, Slot: 0, NPredict: nPredict}, other)
	h, o := <-holder, <-other
	require.NoError(t, h.err, "the request for the prefix")
	require.NoError(t, o.err, "the request on the other slot")
	return hungRun{holder: h.c, other: o.c, holderTook: h.took, otherTook: o.took}
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

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
