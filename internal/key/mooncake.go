package key

import (
	"encoding/binary"

	"github.com/zeebo/xxh3"
)

// MooncakeHashes returns the rolling sequence hashes that Mooncake's KV
// events and conductor indexer use, so that KV-aware routers can route to
// the holders of a prefix: local[i] = XXH3-64(block i's tokens as LE u32,
// seed), seq[0] = local[0], seq[i] = XXH3-64(seq[i-1] LE || local[i] LE, seed).
// Only full blocks are hashed.
func MooncakeHashes(tokens []int32, blockTokens int, seed uint64) []uint64 {
	if blockTokens <= 0 {
		return nil
	}
	n := len(tokens) / blockTokens
	out := make([]uint64, 0, n)
	buf := make([]byte, 4*blockTokens)
	var pair [16]byte
	for i := 0; i < n; i++ {
		putTokens(buf, tokens[i*blockTokens:(i+1)*blockTokens])
		local := xxh3.HashSeed(buf, seed)
		if i == 0 {
			out = append(out, local)
			continue
		}
		binary.LittleEndian.PutUint64(pair[0:8], out[i-1])
		binary.LittleEndian.PutUint64(pair[8:16], local)
		out = append(out, xxh3.HashSeed(pair[:], seed))
	}
	return out
}
