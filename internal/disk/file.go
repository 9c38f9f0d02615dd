package disk

import (
	"encoding/binary"

	"github.com/zeebo/xxh3"

	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

// A block file is a fixed header and the block's stored bytes:
//
//	offset  size  field
//	0       4     magic "MCBF"
//	4       2     file format version (1)
//	6       2     codec (Raw, Zstd)
//	8       8     raw length: the block's bytes in the pool
//	16      8     stored length: the bytes after this header
//	24      8     XXH3-64 of the stored bytes
//	32      16    block key
//	48      16    parent key (the scope root for a first block)
//	64      16    model fingerprint
//	80      4     depth: the block's index in its chain
//	84      4     uses when written
//	88      8     the block's header sum (pool.HeaderSum), which the directory names
//	96      24    reserved, zero
//	120     8     XXH3-64 of bytes [0, 120)
//
// The header repeats what the block's own header holds so that a restart
// indexes the directory's files without decoding them; a read decodes the
// block and checks it against both. A file is written under a temporary
// name and renamed, so a crash leaves a temporary file (dropped at the next
// open) or a whole file; a file whose length or sums do not match is torn
// or was changed, and is dropped, never served.
const (
	fileMagic   = 0x4642434d // "MCBF"
	fileVersion = 1
	HeaderSize  = 128
	sumAt       = 120
)

// Meta is what a block file says about its block.
type Meta struct {
	Key, Parent key.Hash
	Model       key.Fingerprint
	Depth       uint32
	Uses        uint32
	HeaderSum   uint64 // the block's own header sum
	Codec       Codec
	RawLen      int64 // the block's bytes
	StoredLen   int64 // the stored bytes in the file
	StoredSum   uint64
}

// FileSize is the bytes the block's file occupies.
func (m *Meta) FileSize() int64 { return HeaderSize + m.StoredLen }

// encodeHeader writes m into dst[:HeaderSize].
func encodeHeader(dst []byte, m *Meta) {
	le := binary.LittleEndian
	clear(dst[:HeaderSize])
	le.PutUint32(dst[0:], fileMagic)
	le.PutUint16(dst[4:], fileVersion)
	le.PutUint16(dst[6:], uint16(m.Codec))
	le.PutUint64(dst[8:], uint64(m.RawLen))
	le.PutUint64(dst[16:], uint64(m.StoredLen))
	le.PutUint64(dst[24:], m.StoredSum)
	copy(dst[32:], m.Key[:])
	copy(dst[48:], m.Parent[:])
	copy(dst[64:], m.Model[:])
	le.PutUint32(dst[80:], m.Depth)
	le.PutUint32(dst[84:], m.Uses)
	le.PutUint64(dst[88:], m.HeaderSum)
	le.PutUint64(dst[sumAt:], xxh3.Hash(dst[:sumAt]))
}

// maxBlock bounds what a header may claim, so that a damaged length
// never sizes an allocation.
const maxBlock = 1 << 34

// decodeHeader parses a file header and checks it is one this package
// wrote, whole.
func decodeHeader(src []byte) (Meta, error) {
	if len(src) < HeaderSize {
		return Meta{}, status.Errorf(status.Corrupt, "block file header truncated: %d of %d bytes", len(src), HeaderSize)
	}
	le := binary.LittleEndian
	switch {
	case le.Uint32(src[0:]) != fileMagic:
		return Meta{}, status.Errorf(status.Corrupt, "not a block file (magic %#x)", le.Uint32(src[0:]))
	case le.Uint64(src[sumAt:]) != xxh3.Hash(src[:sumAt]):
		return Meta{}, status.Errorf(status.Corrupt, "block file header checksum mismatch")
	case le.Uint16(src[4:]) != fileVersion:
		return Meta{}, status.Errorf(status.Corrupt, "block file version %d", le.Uint16(src[4:]))
	case !zero(src[96:sumAt]):
		return Meta{}, status.Errorf(status.Corrupt, "block file reserved bytes are not zero")
	}
	m := Meta{
		Codec:     Codec(le.Uint16(src[6:])),
		RawLen:    int64(le.Uint64(src[8:])),
		StoredLen: int64(le.Uint64(src[16:])),
		StoredSum: le.Uint64(src[24:]),
		Depth:     le.Uint32(src[80:]),
		Uses:      le.Uint32(src[84:]),
		HeaderSum: le.Uint64(src[88:]),
	}
	copy(m.Key[:], src[32:])
	copy(m.Parent[:], src[48:])
	copy(m.Model[:], src[64:])
	switch {
	case m.Codec != Raw && m.Codec != Zstd:
		return m, status.Errorf(status.Corrupt, "block file codec %d", m.Codec)
	case m.RawLen <= 0 || m.RawLen > maxBlock || m.StoredLen <= 0 || m.StoredLen > maxBlock:
		return m, status.Errorf(status.Corrupt, "block file lengths %d/%d", m.RawLen, m.StoredLen)
	case m.Codec == Raw && m.StoredLen != m.RawLen:
		return m, status.Errorf(status.Corrupt, "raw block file stores %d of %d bytes", m.StoredLen, m.RawLen)
	}
	return m, nil
}

func zero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}
