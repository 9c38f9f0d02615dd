// Package e2e holds the end-to-end benchmarks: llama-servers (stock and
// patched), proxies and store nodes in their own processes on the bench
// model, every figure measured against its baseline in the same run.
//
//	go test -run '^$' -bench . -benchtime 1x ./bench/e2e
//
// They need the builds `make test` makes (see internal/testenv), and report
// with b.ReportMetric; `make bench-report` renders them.
package e2e

import (
	"sort"
	"testing"
	"time"

	"github.com/mcbridge/mcbridge/internal/testenv"
)

var mockTE string

func TestMain(m *testing.M) { testenv.MainMockTE(m, &mockTE) }

// ttft is the client's wall time to the first token: a completion of one
// token, which is when a streamed answer's first token would arrive.
func ttft(b *testing.B, url string, prompt []int32, slot int, extra map[string]any) (time.Duration, testenv.Completion) {
	b.Helper()
	t0 := time.Now()
	c := testenv.Complete(b, url, testenv.Request{Prompt: prompt, Slot: slot, NPredict: 1, Extra: extra})
	return time.Since(t0), c
}

func median(d []time.Duration) time.Duration {
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
