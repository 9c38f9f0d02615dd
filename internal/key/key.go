// Package key derives the identities the cache is addressed by: a model
// fingerprint over everything that changes KV bytes, a scope root per tenant
// and adapter set, and 128-bit block keys chained over the prompt's blocks.
//
// Byte formats (all integers little-endian, strings as u32 length + bytes):
//
//	fingerprint = XXH3-128("MCBFP\x01" || encode(Model))
//	root        = XXH3-128("MCBRT\x01" || fingerprint || str(tenant salt) || str(adapters))
//	block[i]    = XXH3-128(parent || tokens[i*B:(i+1)*B] as i32), parent = root for i = 0
//
// A 128-bit value is written as its high 64 bits then its low 64 bits, each
// big-endian, so keys print like XXH128's canonical form.
package key

import (
	"encoding/binary"
	"encoding/hex"
	"unsafe"

	"github.com/zeebo/xxh3"
)

// Hash is a 128-bit digest: a fingerprint, a scope root or a block key.
type Hash [16]byte

// BlockKey names one block: the tokens at positions [kB, (k+1)B) and,
// through the chain, every token before them.
type BlockKey = Hash

// Fingerprint names a model configuration whose KV bytes are interchangeable.
type Fingerprint = Hash

func (h Hash) String() string { return hex.EncodeToString(h[:]) }

// IsZero reports whether h is the zero hash, which no digest ever produces in
// practice and which the index uses as "no parent".
func (h Hash) IsZero() bool { return h == Hash{} }

// FromU128 converts an XXH3-128 digest into a Hash in that byte order.
func FromU128(u xxh3.Uint128) Hash {
	var h Hash
	binary.BigEndian.PutUint64(h[0:8], u.Hi)
	binary.BigEndian.PutUint64(h[8:16], u.Lo)
	return h
}

// Model lists every input that changes the bytes of a KV cache. Two models
// whose encodings differ never share blocks.
//
// Settings that only change the values in the cache, not its shape (rope
// base and scaling, YaRN, the Hadamard rotation of quantized K/V, control
// vectors and adapters applied server-wide, the backend's numerics) are not
// listed one by one: a host cannot see all of them (a proxy sees only slot
// files), and the KV probe covers every one of them, since each changes the
// probe's K or V at positions 1..7.
type Model struct {
	LlamaVersion string   // llama.cpp release; the state format is keyed on it
	Arch         string   // general.architecture
	ContentHash  Hash     // digest of the GGUF's metadata and tensor data (ContentDigest)
	NLayer       uint32   // layers that hold KV
	NEmbdKGQA    []uint32 // per layer
	NEmbdVGQA    []uint32 // per layer
	TypeK        int32    // ggml_type of K
	TypeV        int32    // ggml_type of V
	VTrans       bool     // V stored transposed (flash attention off)
	KVProbe      Hash     // digest of the KV the probe tokens produce on this node
	BlockTokens  uint32   // tokens per block; fixed per model
	Extra        string   // what changes KV bytes that the probe cannot see
	// Partial describes the host's partial state (llama.cpp's
	// PARTIAL_ONLY: a sliding-window cache, a recurrent state), which a
	// restore needs beside the blocks, as a snapshot; empty when the KV
	// rows are the whole state. Encoded only when set, so that the
	// fingerprints of models without one stay what they were.
	Partial string
}

const (
	fingerprintMagic = "MCBFP\x02"
	partialMagic     = "MCBPS\x01"
	snapshotMagic    = "MCBSN\x01"
)

// Encode returns the canonical byte encoding of m, the fingerprint's preimage.
func (m *Model) Encode() []byte {
	b := make([]byte, 0, 128+8*len(m.NEmbdKGQA))
	b = append(b, fingerprintMagic...)
	b = appendStr(b, m.LlamaVersion)
	b = appendStr(b, m.Arch)
	b = append(b, m.ContentHash[:]...)
	b = binary.LittleEndian.AppendUint32(b, m.NLayer)
	b = appendU32s(b, m.NEmbdKGQA)
	b = appendU32s(b, m.NEmbdVGQA)
	b = binary.LittleEndian.AppendUint32(b, uint32(m.TypeK))
	b = binary.LittleEndian.AppendUint32(b, uint32(m.TypeV))
	b = appendBool(b, m.VTrans)
	b = append(b, m.KVProbe[:]...)
	b = binary.LittleEndian.AppendUint32(b, m.BlockTokens)
	b = appendStr(b, m.Extra)
	if m.Partial != "" {
		b = append(b, partialMagic...)
		b = appendStr(b, m.Partial)
	}
	return b
}

// Fingerprint returns the model's fingerprint.
func (m *Model) Fingerprint() Fingerprint {
	return FromU128(xxh3.Hash128(m.Encode()))
}

// Scope separates key spaces inside one model: a tenant salt and the adapter
// set (LoRA, aLoRA, control vectors) that a request runs with.
type Scope struct {
	TenantSalt []byte
	Adapters   string // canonical adapter set, e.g. "name@scale;..." sorted; empty for the base model
}

const (
	rootMagic  = "MCBRT\x01"
	scopeMagic = "MCBSC\x01"
)

// ID names a scope alone, with no model: hosts compare it to tell whether
// cells were computed under the scope a request runs with.
func (s Scope) ID() Hash {
	b := make([]byte, 0, len(scopeMagic)+8+len(s.TenantSalt)+len(s.Adapters))
	b = append(b, scopeMagic...)
	b = appendStr(b, string(s.TenantSalt))
	b = appendStr(b, s.Adapters)
	return FromU128(xxh3.Hash128(b))
}

// Root returns the parent of a scope's first block.
func Root(fp Fingerprint, s Scope) Hash {
	b := make([]byte, 0, len(rootMagic)+16+8+len(s.TenantSalt)+len(s.Adapters))
	b = append(b, rootMagic...)
	b = append(b, fp[:]...)
	b = appendStr(b, string(s.TenantSalt))
	b = appendStr(b, s.Adapters)
	return FromU128(xxh3.Hash128(b))
}

// Chain returns the keys of the full blocks of tokens: len(tokens)/blockTokens
// keys, each chained on its parent. A trailing partial block has no key.
func Chain(root Hash, tokens []int32, blockTokens int) []BlockKey {
	if blockTokens <= 0 {
		return nil
	}
	n := len(tokens) / blockTokens
	return AppendChain(make([]BlockKey, 0, n), root, tokens, blockTokens)
}

// AppendChain appends the keys of the full blocks of tokens to dst, chained
// from root, and returns the extended slice. It allocates only when dst is
// short, so a caller that keeps dst hashes a long prompt without garbage.
func AppendChain(dst []BlockKey, root Hash, tokens []int32, blockTokens int) []BlockKey {
	if blockTokens <= 0 {
		return dst
	}
	var buf [16 + 4*1024]byte
	parent := root
	for off := 0; off+blockTokens <= len(tokens); off += blockTokens {
		blk := tokens[off : off+blockTokens]
		parent = BlockHash(parent, blk, buf[:])
		dst = append(dst, parent)
	}
	return dst
}

// BlockHash returns the key of one block given its parent's key. scratch
// avoids an allocation when it holds 16+4*len(tokens) bytes.
func BlockHash(parent Hash, tokens []int32, scratch []byte) Hash {
	need := 16 + 4*len(tokens)
	if cap(scratch) < need {
		scratch = make([]byte, need)
	}
	b := scratch[:need]
	copy(b, parent[:])
	putTokens(b[16:], tokens)
	return FromU128(xxh3.Hash128(b))
}

// Snapshot is the key of the snapshot of a host's partial state taken
// where block k ends: derived from k in a domain of its own, so that no
// chain of tokens ever hashes to it and a lookup never takes it for a
// block.
func Snapshot(k BlockKey) BlockKey {
	var b [len(snapshotMagic) + 16]byte
	copy(b[:], snapshotMagic)
	copy(b[len(snapshotMagic):], k[:])
	return FromU128(xxh3.Hash128(b[:]))
}

// TokenBytes returns tokens as little-endian int32 bytes.
func TokenBytes(tokens []int32) []byte {
	b := make([]byte, 4*len(tokens))
	putTokens(b, tokens)
	return b
}

func putTokens(dst []byte, tokens []int32) {
	if littleEndian {
		copy(dst, unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(tokens))), 4*len(tokens)))
		return
	}
	for i, t := range tokens {
		binary.LittleEndian.PutUint32(dst[4*i:], uint32(t))
	}
}

var littleEndian = func() bool {
	x := uint16(1)
	return *(*byte)(unsafe.Pointer(&x)) == 1
}()

func appendStr(b []byte, s string) []byte {
	b = binary.LittleEndian.AppendUint32(b, uint32(len(s)))
	return append(b, s...)
}

func appendU32s(b []byte, v []uint32) []byte {
	b = binary.LittleEndian.AppendUint32(b, uint32(len(v)))
	for _, x := range v {
		b = binary.LittleEndian.AppendUint32(b, x)
	}
	return b
}

func appendBool(b []byte, v bool) []byte {
	if v {
		return append(b, 1)
	}
	return append(b, 0)
}
