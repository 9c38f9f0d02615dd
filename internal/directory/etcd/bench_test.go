package etcd

import (
	"context"
	"os"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
)

// benchBlocks is how many blocks the catch-up benchmark publishes first:
// MCB_ETCD_BENCH_BLOCKS (1e5 and 1e6 accepted), default 1e4.
func benchBlocks(b *testing.B) int {
	s := os.Getenv("MCB_ETCD_BENCH_BLOCKS")
	if s == "" {
		return 10000
	}
	f, err := strconv.ParseFloat(s, 64)
	require.NoError(b, err, "MCB_ETCD_BENCH_BLOCKS=%q: want a count such as 1e5", s)
	require.GreaterOrEqual(b, f, 1.0, "MCB_ETCD_BENCH_BLOCKS=%q: want a count such as 1e5", s)
	return int(f)
}

// BenchmarkSubscribeCatchUp times a new subscriber receiving every one of
// N published blocks (the snapshot read page by page and decoded).
//
//	go test -run '^$' -bench SubscribeCatchUp ./bridge/directory/etcd/
//	MCB_ETCD_BENCH_BLOCKS=1e6 go test -run '^$' -bench SubscribeCatchUp -benchtime 3x -timeout 30m ./bridge/directory/etcd/
func BenchmarkSubscribeCatchUp(b *testing.B) {
	n := benchBlocks(b)
	srv := etcdtest.Start(b)
	pub := openDir(b, srv, nil)
	for i := 0; i < n; i += 10000 { // a chunk at a time: 1e6 entries at once take 200 MB
		publishAll(b, pub, testEntries(modelA, i, min(i+10000, n), "pub"))
	}
	sub := openDir(b, srv, nil)
	for b.Loop() {
		var seen atomic.Int64
		done := make(chan struct{})
		cancel, err := sub.Subscribe(modelA, func(directory.Event) {
			if seen.Add(1) == int64(n) {
				close(done)
			}
		})
		require.NoError(b, err)
		<-done
		cancel()
	}
	b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds(), "blocks/s")
}

// BenchmarkPublish measures publish throughput of new blocks, one call of
// batch blocks per iteration.
func BenchmarkPublish(b *testing.B) {
	for _, batch := range []int{1, 127, 1000} {
		b.Run("batch="+strconv.Itoa(batch), func(b *testing.B) {
			srv := etcdtest.Start(b)
			d := openDir(b, srv, nil)
			next := 0
			for b.Loop() {
				got, err := d.Publish(context.Background(), testEntries(modelA, next, next+batch, "pub"))
				require.NoError(b, err, "publish")
				require.Equal(b, batch, count(got), "publish: blocks stored")
				next += batch
			}
			b.ReportMetric(float64(next)/b.Elapsed().Seconds(), "blocks/s")
		})
	}
}
