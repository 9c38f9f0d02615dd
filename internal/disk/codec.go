package disk

import (
	"encoding/binary"
	"fmt"
	"sync"

	"github.com/klauspost/compress/zstd"

	"github.com/mcbridge/mcbridge/internal/status"
)

// Codec is how a block's bytes are stored in its file.
type Codec uint16

const (
	// Raw stores the block as it is in the pool.
	Raw Codec = iota
	// Zstd splits the block into byte planes of its 16-bit elements (every
	// low byte, then every high byte: f16 KV's exponents and signs end up
	// together) and compresses the planes with zstd at its fastest level.
	Zstd
)

// DefaultCodec is what a disk tier writes unless told otherwise. Raw:
// measured on the KV the bench model really produces (docs/bench/disk.md,
// BenchmarkDiskCodec), byte planes and zstd saved too little to pay for
// what they cost on every spill and every read back.
const DefaultCodec = Raw

func (c Codec) String() string {
	switch c {
	case Raw:
		return "raw"
	case Zstd:
		return "zstd"
	}
	return fmt.Sprintf("codec(%d)", uint16(c))
}

// ParseCodec reads a codec's name.
func ParseCodec(s string) (Codec, error) {
	switch s {
	case "raw":
		return Raw, nil
	case "zstd":
		return Zstd, nil
	}
	return 0, status.Errorf(status.Config, "disk codec %q: raw or zstd", s)
}

// Shuffle writes the byte planes of src's 16-bit elements into dst: every
// even byte, then every odd one. len(src) must be even and len(dst) equal.
// Eight elements move per step, as 64-bit words through slices of fixed
// length (no bounds checks inside): a byte loop ran at a tenth of memcpy.
func Shuffle(dst, src []byte) {
	n := len(src) / 2
	lo, hi := dst[:n:n], dst[n:2*n:2*n]
	le := binary.LittleEndian
	i := 0
	for ; i+8 <= n; i += 8 {
		s := src[2*i : 2*i+16 : 2*i+16]
		w0, w1 := le.Uint64(s[0:8]), le.Uint64(s[8:16])
		const even = 0x00ff00ff00ff00ff
		le.PutUint64(lo[i:i+8:i+8], uint64(compact(w0&even))|uint64(compact(w1&even))<<32)
		le.PutUint64(hi[i:i+8:i+8], uint64(compact(w0>>8&even))|uint64(compact(w1>>8&even))<<32)
	}
	for ; i < n; i++ {
		lo[i] = src[2*i]
		hi[i] = src[2*i+1]
	}
}

// Unshuffle is Shuffle's inverse.
func Unshuffle(dst, src []byte) {
	n := len(src) / 2
	lo, hi := src[:n:n], src[n:2*n:2*n]
	le := binary.LittleEndian
	i := 0
	for ; i+8 <= n; i += 8 {
		l, h := le.Uint64(lo[i:i+8:i+8]), le.Uint64(hi[i:i+8:i+8])
		d := dst[2*i : 2*i+16 : 2*i+16]
		le.PutUint64(d[0:8], spread(uint32(l))|spread(uint32(h))<<8)
		le.PutUint64(d[8:16], spread(uint32(l>>32))|spread(uint32(h>>32))<<8)
	}
	for ; i < n; i++ {
		dst[2*i] = lo[i]
		dst[2*i+1] = hi[i]
	}
}

// spread puts byte k of x at byte 2k of the result.
func spread(x uint32) uint64 {
	w := uint64(x)
	w = (w | w<<16) & 0x0000ffff0000ffff
	return (w | w<<8) & 0x00ff00ff00ff00ff
}

// compact is spread's inverse, for a word whose odd bytes are zero.
func compact(w uint64) uint32 {
	w = (w | w>>8) & 0x0000ffff0000ffff
	return uint32(w | w>>16)
}

// coders are zstd's encoder and decoder, built once: each holds tables a
// fresh one would allocate again. EncodeAll and DecodeAll are safe for
// concurrent use.
var coders struct {
	once sync.Once
	enc  *zstd.Encoder
	dec  *zstd.Decoder
	err  error
}

func zstdCoders() (*zstd.Encoder, *zstd.Decoder, error) {
	coders.once.Do(func() {
		// KV's byte planes have few repeats for LZ to find; what pays is
		// the entropy coding of the exponent plane, which zstd's fast
		// levels skip for blocks without matches unless told otherwise.
		coders.enc, coders.err = zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedFastest),
			zstd.WithAllLitEntropyCompression(true), zstd.WithEncoderConcurrency(1))
		if coders.err == nil {
			coders.dec, coders.err = zstd.NewReader(nil, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxMemory(1<<32))
		}
	})
	return coders.enc, coders.dec, coders.err
}

// Encode appends block's stored form under c to dst; scratch, when large
// enough, saves an allocation.
func Encode(c Codec, dst, block, scratch []byte) ([]byte, error) {
	switch c {
	case Raw:
		return append(dst, block...), nil
	case Zstd:
		if len(block)%2 != 0 {
			return dst, status.Errorf(status.InvalidArg, "zstd codec: a block of %d bytes is not 16-bit elements", len(block))
		}
		enc, _, err := zstdCoders()
		if err != nil {
			return dst, status.Wrap(status.Internal, err, "zstd")
		}
		if cap(scratch) < len(block) {
			scratch = make([]byte, len(block))
		}
		planes := scratch[:len(block)]
		Shuffle(planes, block)
		return enc.EncodeAll(planes, dst), nil
	}
	return dst, status.Errorf(status.InvalidArg, "unknown codec %d", c)
}

// Decode fills block (exactly the raw size) from stored under c. A stored
// form that does not decode to exactly len(block) bytes is status.Corrupt.
func Decode(c Codec, block, stored, scratch []byte) error {
	switch c {
	case Raw:
		if len(stored) != len(block) {
			return status.Errorf(status.Corrupt, "raw block of %d bytes, want %d", len(stored), len(block))
		}
		copy(block, stored)
		return nil
	case Zstd:
		_, dec, err := zstdCoders()
		if err != nil {
			return status.Wrap(status.Internal, err, "zstd")
		}
		if cap(scratch) < len(block) {
			scratch = make([]byte, len(block))
		}
		planes, err := dec.DecodeAll(stored, scratch[:0:len(block)])
		if err != nil {
			return status.Wrap(status.Corrupt, err, "zstd block")
		}
		if len(planes) != len(block) {
			return status.Errorf(status.Corrupt, "zstd block decodes to %d bytes, want %d", len(planes), len(block))
		}
		Unshuffle(block, planes)
		return nil
	}
	return status.Errorf(status.Corrupt, "unknown codec %d", c)
}
