//go:build linux && (amd64 || arm64)

package mooncake

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/store/mooncake/mastertest"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// storeShape is 48 MiB moved as objects of one size: the shapes of the
// Transfer Engine binding's BenchmarkRestore (internal/transport/mooncake),
// as whole objects, which is how the store moves them (one object per
// block; "prefix48MiB" is 16 blocks of the bench model's 3 MiB).
type storeShape struct {
	name    string
	objects int
	size    int
}

const benchBytes = 48 << 20

var storeShapes = []storeShape{
	{"prefix48MiB", 16, 3 << 20},
	{"blocks1MiB", 48, 1 << 20},
	{"blocks16MiB", 3, 16 << 20},
}

func (s storeShape) keys(prefix string) []string {
	keys := make([]string, s.objects)
	for i := range keys {
		keys[i] = fmt.Sprintf("%s-%s-%d", prefix, s.name, i)
	}
	return keys
}

func (s storeShape) bufs(r region) []Buffer {
	out := make([]Buffer, s.objects)
	for i := range out {
		out[i] = r.buf(i*s.size, s.size)
	}
	return out
}

// benchHolderMain is a store client in its own process: it contributes a
// segment and puts every shape's objects under "remote-..." with one
// replica, in its own segment, then waits to be killed.
func benchHolderMain() int {
	ctx := context.Background()
	c, err := Open(ctx, Config{Library: os.Getenv(EnvLibrary), Master: os.Getenv(envChildMaster), SegmentBytes: 10 * benchBytes})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	buf, err := syscall.Mmap(-1, 0, benchBytes, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fill(buf, 11)
	r := region(buf)
	if err := c.Register(ctx, r.addr(), benchBytes); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	for _, s := range storeShapes {
		errs, err := c.PutFrom(ctx, s.keys("remote"), s.bufs(r), PutOptions{Preferred: []string{c.Segment()}})
		if err = firstError(errs, err); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	fmt.Println(c.Segment())
	select {}
}

func firstError(errs []error, err error) error {
	if err != nil {
		return err
	}
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}

func startBenchHolder(b *testing.B, m *mastertest.Master) string {
	b.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envChild+"=benchholder", envChildMaster+"="+m.Addr(), EnvLibrary+"="+mastertest.Lib(b))
	out, err := cmd.StdoutPipe()
	require.NoError(b, err)
	stderr := &testenv.LockedBuffer{}
	cmd.Stderr = stderr
	require.NoError(b, cmd.Start())
	b.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	sc := bufio.NewScanner(out)
	require.True(b, sc.Scan(), "the holder did not come up: %s", stderr.String())
	return strings.TrimSpace(sc.Text())
}

// BenchmarkStore moves 48 MiB through Mooncake Store in each shape, in one
// run beside a memcpy of the same bytes (x_memcpy divides a row's
// throughput by it):
//
//   - get/remote: batch_get_into of objects whose only replica sits in
//     another process's segment, over the store's TCP transport on
//     loopback: the store's counterpart of the Transfer Engine binding's
//     BenchmarkRestore real-tcp rows.
//   - get/own-replica: objects with a second replica in the reader's own
//     segment, which the library reads by memcpy.
//   - put/registered and put/copying: batch_put_from from registered
//     memory against put, which copies through the library's staging
//     buffer, with 1 replica (in the writer's own segment, or in the other
//     process's) and 2 (both).
func BenchmarkStore(b *testing.B) {
	m := mastertest.Start(b, mastertest.Options{})
	other := startBenchHolder(b, m)
	src, dst := newRegion(b, benchBytes), newRegion(b, benchBytes)
	fill(src, 11)
	fill(dst, 0) // page faults out of the timed loops
	c, err := Open(context.Background(), Config{Library: mastertest.Lib(b), Master: m.Addr(), SegmentBytes: 8 * benchBytes, BufferBytes: 32 << 20})
	require.NoError(b, err)
	ctx := context.Background()
	require.NoError(b, c.Register(ctx, src.addr(), benchBytes))
	require.NoError(b, c.Register(ctx, dst.addr(), benchBytes))
	b.Cleanup(func() {
		_ = c.Unregister(ctx, src.addr())
		_ = c.Unregister(ctx, dst.addr())
		_ = c.Close()
	})
	for _, s := range storeShapes {
		require.NoError(b, firstError(c.PutFrom(ctx, s.keys("two"), s.bufs(src), PutOptions{Replicas: 2, Preferred: []string{other, c.Segment()}})))
		for prefix, want := range map[string][]string{"remote": {other}, "two": {other, c.Segment()}} {
			segs, err := m.Segments(s.keys(prefix)[0])
			require.NoError(b, err)
			require.ElementsMatch(b, want, segs, "where %s's replicas are", prefix)
		}
	}

	memcpyNs := map[string]float64{}
	b.Run("memcpy", func(b *testing.B) {
		for _, s := range storeShapes {
			b.Run(s.name, func(b *testing.B) {
				b.SetBytes(benchBytes)
				for range b.N {
					for i := 0; i < s.objects; i++ {
						copy(dst[i*s.size:(i+1)*s.size], src[i*s.size:(i+1)*s.size])
					}
				}
				memcpyNs[s.name] = float64(b.Elapsed().Nanoseconds()) / float64(b.N)
			})
		}
	})
	// b.Elapsed leaves out what runs with the timer stopped (the puts'
	// removes).
	report := func(b *testing.B, name string) {
		if mc := memcpyNs[name]; mc > 0 {
			b.ReportMetric(mc/(float64(b.Elapsed().Nanoseconds())/float64(b.N)), "x_memcpy")
		}
	}
	for _, get := range []struct{ name, prefix string }{{"remote", "remote"}, {"own-replica", "two"}} {
		b.Run("get/"+get.name, func(b *testing.B) {
			for _, s := range storeShapes {
				b.Run(s.name, func(b *testing.B) {
					keys, bufs := s.keys(get.prefix), s.bufs(dst)
					read := func() {
						got, err := c.GetInto(ctx, keys, bufs)
						require.NoError(b, err)
						for i, g := range got {
							require.NoError(b, g.Err, "object %d", i)
						}
					}
					clear(dst)
					read() // connections and pages warm
					require.Equal(b, -1, mismatch(dst[:s.objects*s.size], 11), "the bytes read")
					b.SetBytes(benchBytes)
					b.ResetTimer()
					for range b.N {
						read()
					}
					report(b, s.name)
				})
			}
		})
	}
	puts := []struct {
		name      string
		copying   bool
		preferred []string
		replicas  int
	}{
		{"registered/replicas=1-own", false, []string{c.Segment()}, 1},
		{"registered/replicas=1-other", false, []string{other}, 1},
		{"registered/replicas=2", false, []string{c.Segment(), other}, 2},
		{"copying/replicas=1-own", true, []string{c.Segment()}, 1},
		{"copying/replicas=1-other", true, []string{other}, 1},
		{"copying/replicas=2", true, []string{c.Segment(), other}, 2},
	}
	for _, p := range puts {
		b.Run("put/"+p.name, func(b *testing.B) {
			for _, s := range storeShapes {
				b.Run(s.name, func(b *testing.B) {
					opts := PutOptions{Replicas: p.replicas, Preferred: p.preferred}
					round := 0
					write := func(check bool) {
						keys := s.keys("put-" + strconv.Itoa(round))
						round++
						if p.copying {
							for i, k := range keys {
								require.NoError(b, c.Put(ctx, k, src[i*s.size:(i+1)*s.size], opts))
							}
						} else {
							require.NoError(b, firstError(c.PutFrom(ctx, keys, s.bufs(src), opts)))
						}
						b.StopTimer()
						if check {
							segs, err := m.Segments(keys[0])
							require.NoError(b, err)
							require.ElementsMatch(b, p.preferred, segs, "where the replicas landed")
							clear(dst)
							got, err := c.GetInto(ctx, keys, s.bufs(dst))
							require.NoError(b, err)
							for i, g := range got {
								require.NoError(b, g.Err, "object %d", i)
							}
							require.Equal(b, -1, mismatch(dst[:s.objects*s.size], 11), "the bytes put")
						}
						for _, k := range keys {
							require.NoError(b, c.Remove(ctx, k, true))
						}
						b.StartTimer()
					}
					write(true)
					b.SetBytes(benchBytes)
					b.ResetTimer()
					for range b.N {
						write(false)
					}
					report(b, s.name)
				})
			}
		})
	}
}

// mismatch is the first offset of b that does not hold seed's pattern, or
// -1.
func mismatch(b []byte, seed byte) int {
	want := make([]byte, len(b))
	fill(want, seed)
	for i := range b {
		if b[i] != want[i] {
			return i
		}
	}
	return -1
}
