package e2e

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// BenchmarkEtcdStopped is the TTFT of a patched llama-server whose etcd is
// stopped (SIGSTOP: alive, answering nothing) against the same server with
// etcd running, in one run: requests that miss (they compute and save) and
// requests that hit blocks this server saved (they restore from its pool).
// Nothing on the server's thread waits on the directory, so the two must
// match (target: within 5%).
func BenchmarkEtcdStopped(b *testing.B) {
	model := testenv.Model(b, "bench", 0)
	etcd := etcdtest.Start(b)
	cfg := fmt.Sprintf(`{"block_tokens": 256, "directory": {"kind": "etcd", "endpoints": [%q], "op_timeout_ms": 2000}, "transport": {"kind": "mooncake", "lib": %q}}`,
		etcd.Endpoint(), mockTE)
	s := testenv.StartLlama(b, "patched", testenv.PatchedServer(b), append(testenv.BenchServerArgs(model, 8192, 2, "on"), "--mcb-config", cfg))
	const prefixLen, suffixLen, rounds = 1024, 64, 5
	family := 0
	next := func() []int32 { family++; return testenv.Tokens(prefixLen, 7+2*family, family) }
	// One miss and one hit with etcd as it is; rounds alternate running and
	// stopped so that load on the machine falls on both alike.
	round := func(phase string, r int) (miss, hit time.Duration) {
		prefix := next()
		miss, c := ttft(b, s.URL, testenv.Cat(prefix, testenv.Tokens(suffixLen, 3, r)), 0, nil)
		require.Equal(b, "miss", c.MCB.Decision, "%s: a new prefix misses", phase)
		hit, c = ttft(b, s.URL, testenv.Cat(prefix, testenv.Tokens(suffixLen, 5, r)), 1, nil)
		require.Equal(b, "restore", c.MCB.Decision, "%s: the other slot restores it: %+v", phase, c.MCB)
		return miss, hit
	}
	for i := 0; i < b.N; i++ {
		round("warm-up", 0)
		var missRuns, hitRuns, missStops, hitStops []time.Duration
		for r := 0; r < rounds; r++ {
			m, h := round("etcd running", r)
			missRuns, hitRuns = append(missRuns, m), append(hitRuns, h)
			etcd.Pause()
			m, h = round("etcd stopped", r)
			etcd.Resume()
			missStops, hitStops = append(missStops, m), append(hitStops, h)
		}
		missRun, hitRun, missStop, hitStop := median(missRuns), median(hitRuns), median(missStops), median(hitStops)
		b.ReportMetric(ms(missRun), "miss-ttft-ms-etcd-running")
		b.ReportMetric(ms(missStop), "miss-ttft-ms-etcd-stopped")
		b.ReportMetric(ms(hitRun), "hit-ttft-ms-etcd-running")
		b.ReportMetric(ms(hitStop), "hit-ttft-ms-etcd-stopped")
		b.ReportMetric(float64(missStop)/float64(missRun), "miss-stopped/running")
		b.ReportMetric(float64(hitStop)/float64(hitRun), "hit-stopped/running")
	}
}
