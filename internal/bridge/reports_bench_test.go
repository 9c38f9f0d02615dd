package bridge_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge/bridgetest"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/storenode"
	"github.com/mcbridge/mcbridge/internal/transport"
)

// BenchmarkReport is what telling a holder of a restore costs: on the
// host's thread, queueing the report of a 16-block restore (a map insert
// per block); on the bridges' goroutines, encoding the message of 64
// blocks, sending it to a peer as an engine notification and taking it
// from the peer's inbox (the Loopback engine, which delivers in memory;
// the mock and real engines carry the same message over their own path).
func BenchmarkReport(b *testing.B) {
	cfg := bridgetest.Config(b)
	reader, holder := bridgetest.Open(b, cfg, "reader"), bridgetest.Open(b, cfg, "holder")
	items := make([]storenode.ReportItem, storenode.MaxReportItems)
	for i := range items {
		items[i] = storenode.ReportItem{Key: key.BlockKey{0: byte(i), 1: byte(i >> 8), 2: 7}}
	}
	b.Run("queue-16-blocks", func(b *testing.B) {
		for b.Loop() {
			reader.QueueUsed(holder.Segment(), items[:16]...)
		}
	})
	b.Run("encode-send-receive-64-blocks", func(b *testing.B) {
		n, ok := reader.Transport().(transport.Notifier)
		require.True(b, ok, "the Loopback engine sends notifications")
		inbox := holder.Transport().(transport.Notifier)
		ctx := context.Background()
		seg, err := reader.OpenSegment(ctx, holder.Segment())
		require.NoError(b, err)
		for b.Loop() {
			for _, msg := range storenode.EncodeReports(storenode.ReportUsed, items) {
				require.NoError(b, n.SendNotify(ctx, seg, storenode.ReportName, msg))
			}
			// The holder's own inbox goroutine may take some first.
			_, err := inbox.Notifications()
			require.NoError(b, err)
		}
	})
}
