package e2e

import (
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/disk"
)

// BenchmarkDiskCodec measures the disk tier's codecs on real KV (the bench
// model's, and Llama-3-8B-shaped layers'): the stored size against the
// block's, and encode and decode speed. "zstd-flat" is zstd without the
// byte planes, to show what the shuffle adds. The tier's default codec is
// set from these figures (internal/disk DefaultCodec).
func BenchmarkDiskCodec(b *testing.B) {
	for _, model := range []string{"bench", "llama3-8b-layers"} {
		blocks := realBlocks(b, model, 2048, 256)
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
