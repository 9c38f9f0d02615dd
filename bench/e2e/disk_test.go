package e2e

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
	"time"
	"unsafe"

	"github.com/klauspost/compress/zstd"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mcbridge/mcbridge/internal/disk"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/residency"
)

// BenchmarkDiskCodec measures the disk tier's codecs on real KV (the bench
// model's, and Llama-3-8B-shaped layers'): the stored size against the
// block's, and encode and decode speed. "zstd-flat" is zstd without the
// byte planes, to show what the shuffle adds. The tier's default codec is
// set from these figures (internal/disk DefaultCodec).
func BenchmarkDiskCodec(b *testing.B) {
	for _, model := range []string{"bench", "llama3-8b-layers"} {
		blocks, _ := realBlocks(b, model, 2048, 256)
		var raw int64
		for _, blk := range blocks {
			raw += int64(len(blk))
		}
		flat, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedFastest), zstd.WithEncoderConcurrency(1))
		require.NoError(b, err)
		flatDec, err := zstd.NewReader(nil, zstd.WithDecoderConcurrency(1))
		require.NoError(b, err)
		codecs := map[string]struct {
			enc func(dst, blk []byte) []byte
			dec func(dst, stored []byte)
		}{
			"raw": {
				func(dst, blk []byte) []byte { out, _ := disk.Encode(disk.Raw, dst, blk, nil); return out },
				func(dst, stored []byte) { require.NoError(b, disk.Decode(disk.Raw, dst, stored, nil)) },
			},
			"zstd": {
				func(dst, blk []byte) []byte { out, _ := disk.Encode(disk.Zstd, dst, blk, nil); return out },
				func(dst, stored []byte) { require.NoError(b, disk.Decode(disk.Zstd, dst, stored, nil)) },
			},
			"zstd-flat": {
				func(dst, blk []byte) []byte { return flat.EncodeAll(blk, dst) },
				func(dst, stored []byte) { _, err := flatDec.DecodeAll(stored, dst[:0]); require.NoError(b, err) },
			},
		}
		for _, name := range []string{"raw", "zstd", "zstd-flat"} {
			c := codecs[name]
			stored := make([][]byte, len(blocks))
			var size int64
			t0 := time.Now()
			for i, blk := range blocks {
				stored[i] = c.enc(nil, blk)
				size += int64(len(stored[i]))
			}
			encSecs := time.Since(t0).Seconds()
			out := make([]byte, len(blocks[0]))
			b.Run("model="+model+"/codec="+name, func(b *testing.B) {
				b.SetBytes(raw)
				for b.Loop() {
					for i := range blocks {
						c.dec(out, stored[i])
					}
				}
				b.ReportMetric(float64(size)/float64(raw), "stored/raw")
				b.ReportMetric(float64(raw)/encSecs/1e9, "encode-GB/s")
				b.ReportMetric(float64(raw)*float64(b.N)/b.Elapsed().Seconds()/1e9, "decode-GB/s")
			})
		}
	}
}

// BenchmarkDiskRestore reads a 2048-token prefix of the bench model's real
// KV (8 blocks) back as a store node does when a reader asks for blocks
// its pool evicted: from the disk tier with the page cache warm, and cold
// (every file's pages dropped before each pass), each verified, against
// copying and verifying the same blocks from memory and against the
// prefill that computed them, measured in the same run. "x-recompute" is
// the prefill's time over the restore's.
func BenchmarkDiskRestore(b *testing.B) {
	blocks, prefillMS := realBlocks(b, "bench", 2048, 256)
	require.Positive(b, prefillMS)
	var raw int64
	for _, blk := range blocks {
		raw += int64(len(blk))
	}
	// Under the repository, not the temporary directory: a tmpfs has no
	// page cache to drop.
	dir, err := os.MkdirTemp(".", "disk-restore-")
	require.NoError(b, err)
	b.Cleanup(func() { os.RemoveAll(dir) })
	var metas []disk.Meta
	for _, blk := range blocks {
		g, err := pool.ParseGeometry(blk)
		require.NoError(b, err)
		h, err := pool.DecodeHeader(blk, &g)
		require.NoError(b, err)
		metas = append(metas, disk.Meta{Key: h.Key, Parent: h.Parent, Model: h.Model, Depth: h.Depth})
	}
	for _, codec := range []disk.Codec{disk.Raw, disk.Zstd} {
		tier, err := disk.Open(disk.Config{Dir: dir + "/" + codec.String(), Bytes: 4 * raw, Codec: codec, Policy: residency.LRU})
		require.NoError(b, err)
		for i, blk := range blocks {
			require.NoError(b, tier.Put(blk, metas[i]))
		}
		dst := make([]byte, len(blocks[0]))
		read := func() {
			for _, m := range metas {
				_, err := tier.Get(m.Key, dst)
				require.NoError(b, err)
			}
		}
		for _, cache := range []string{"warm", "cold"} {
			b.Run("from=disk-"+cache+"/codec="+codec.String(), func(b *testing.B) {
				b.SetBytes(raw)
				read()
				for b.Loop() {
					if cache == "cold" {
						b.StopTimer()
						dropPageCache(b, tier.Dir())
						b.StartTimer()
					}
					read()
				}
				reportRestore(b, prefillMS)
			})
		}
	}
	b.Run("from=memory", func(b *testing.B) {
		b.SetBytes(raw)
		dst := make([]byte, len(blocks[0]))
		for b.Loop() {
			for i, blk := range blocks {
				copy(dst, blk)
				m := metas[i]
				_, _, err := pool.VerifyBlock(dst, &pool.Expect{Key: m.Key, Parent: m.Parent, Model: m.Model, Generation: pool.Generation(blk)})
				require.NoError(b, err)
			}
		}
		reportRestore(b, prefillMS)
	})
}

func reportRestore(b *testing.B, prefillMS float64) {
	ms := b.Elapsed().Seconds() * 1e3 / float64(b.N)
	b.ReportMetric(ms, "ms/prefix")
	b.ReportMetric(prefillMS, "recompute-ms")
	b.ReportMetric(prefillMS/ms, "x-recompute")
}

// dropPageCache writes back and evicts every file under dir from the page
// cache, and checks with mincore that no page stayed: a "cold" figure
// read from memory would flatter the disk.
func dropPageCache(tb testing.TB, dir string) {
	tb.Helper()
	require.NoError(tb, filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		defer f.Close()
		fd := int(f.Fd())
		if err := unix.Fdatasync(fd); err != nil {
			return err
		}
		if err := unix.Fadvise(fd, 0, 0, unix.FADV_DONTNEED); err != nil {
			return err
		}
		st, err := f.Stat()
		if err != nil || st.Size() == 0 {
			return err
		}
		m, err := unix.Mmap(fd, 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED)
		if err != nil {
			return err
		}
		defer unix.Munmap(m)
		vec := make([]byte, (len(m)+os.Getpagesize()-1)/os.Getpagesize())
		if _, _, e := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(len(m)), uintptr(unsafe.Pointer(&vec[0]))); e != 0 {
			return e
		}
		for i, v := range vec {
			if v&1 != 0 {
				return fmt.Errorf("%s: page %d still cached after FADV_DONTNEED", path, i)
			}
		}
		return nil
	}))
}
