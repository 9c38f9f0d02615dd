package bench

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/transport"
)

// BenchmarkFaultedRestores counts wrong KV over a faulted run: a prefix
// restored from a peer under each fault the Loopback engine injects
// (every request failing, a flipped byte in each payload, the peer gone,
// the link dying a third of the way, the peer hung past the deadline),
// each faulted restore followed by a clean one, and every row a load
// reports good compared with what prefill computes. wrong_kv_positions
// must be 0; checked_positions and faulted_loads say how much it covered.
// The report's "wrong KV" verdict is this count, not a literal.
func BenchmarkFaultedRestores(b *testing.B) {
	l := linkUnshaped
	l.name, l.timeoutMS = "faulted", 300
	r := newRestoreRig(b, geo64K, 4, l)
	lb, ok := r.writer.Transport().(*transport.Loopback)
	require.True(b, ok, "the rig's engine is Loopback")
	faults := []transport.Fault{
		{Kind: transport.FailAll},
		{Kind: transport.Corrupt},
		{Kind: transport.DropPeer},
		{Kind: transport.FailAfter, Arg: r.payload/3 + 17},
		{Kind: transport.Delay, Arg: int64(time.Hour)},
	}
	var wrong, checked, faulted, loads int
	b.ResetTimer()
	for range b.N {
		for _, f := range faults {
			for _, fault := range []transport.Fault{f, {}} {
				lb.SetFault(fault)
				r.dst.Clear(len(r.tokens))
				ld, err := r.reader.LoadBegin(key.Scope{}, r.dst.Layout(), r.tokens, r.cells)
				require.NoError(b, err)
				res, err := ld.End()
				loads++
				if fault.Kind != transport.NoFault {
					require.Error(b, err, "a restore under fault %d reported no failure", fault.Kind)
					faulted++
				} else {
					require.NoError(b, err, "the clean restore after fault %d", f.Kind)
				}
				checked += res.OKTokens
				wrong += r.dst.WrongPositions(r.tokens, res.OKTokens)
			}
		}
	}
	lb.SetFault(transport.Fault{})
	b.ReportMetric(float64(wrong), "wrong_kv_positions")
	b.ReportMetric(float64(checked), "checked_positions")
	b.ReportMetric(float64(faulted), "faulted_loads")
	b.ReportMetric(float64(loads), "loads")
}
