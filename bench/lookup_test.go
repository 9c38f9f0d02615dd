package bench

import (
	"context"
	"encoding/binary"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
)

// lookupRig is a bridge whose mirror holds a saved 128k-token prompt among
// background blocks of other prompts, as a busy swarm's mirror does.
type lookupRig struct {
	model  *bridge.Model
	tokens []int32
}

func lookupSizes() []int {
	if quick() {
		return []int{1 << 10, 16 << 10}
	}
	return []int{1 << 10, 4 << 10, 16 << 10, 64 << 10, 128 << 10}
}

func newLookupRig(tb testing.TB, maxTokens, background int) *lookupRig {
	tb.Helper()
	dir := newDir(tb)
	h := newHost(tb, geoTiny, maxTokens)
	br := openBridge(tb, dir, "lookup", geoTiny, int64(maxTokens/blockTokens)+2, linkLocal)
	r := &lookupRig{model: register(tb, br, h, "lookup"), tokens: promptTokens(maxTokens+1, 3)}
	h.Compute(r.tokens, 0, maxTokens)
	saveAndPublish(tb, r.model, h, key.Scope{}, r.tokens[:maxTokens])
	// Background entries go straight into the directory: the mirror only
	// needs their keys, not their bytes.
	d := directory.OpenMemory(dir)
	defer d.Close()
	entries := make([]directory.Entry, 0, 4096)
	for i := range background {
		var k key.BlockKey
		binary.LittleEndian.PutUint64(k[:], uint64(i)*0x9e3779b97f4a7c15+1)
		binary.LittleEndian.PutUint64(k[8:], uint64(i))
		entries = append(entries, directory.Entry{Model: r.model.Fingerprint(), Key: k, Parent: k,
			Loc: directory.Location{Segment: "elsewhere", Owner: "elsewhere", Length: 1}})
		if len(entries) == cap(entries) || i == background-1 {
			_, err := d.Publish(context.Background(), entries)
			require.NoError(tb, err)
			entries = entries[:0]
		}
	}
	require.Equal(tb, maxTokens/blockTokens+background, r.model.Mirrored(), "blocks the mirror holds")
	return r
}

// lookup looks up the first n tokens' blocks plus one token, the one that
// is always computed, and checks that every block matched.
func (r *lookupRig) lookup(n int) error {
	res, err := r.model.Lookup(key.Scope{}, r.tokens[:n+1], 0)
	if err == nil && res.MatchedBlocks != n/blockTokens {
		err = fmt.Errorf("matched %d of %d blocks", res.MatchedBlocks, n/blockTokens)
	}
	return err
}

// BenchmarkKeyLookup times Lookup of a prompt whose blocks are all cached
// (the most work a lookup does: hash every block, match every one, decide)
// against a mirror that also holds 100k other blocks.
func BenchmarkKeyLookup(b *testing.B) {
	sizes := lookupSizes()
	background := 100_000
	if quick() {
		background = 1000
	}
	r := newLookupRig(b, sizes[len(sizes)-1], background)
	for _, n := range sizes {
		b.Run(fmt.Sprintf("tokens=%d", n), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				require.NoError(b, r.lookup(n))
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/1e3, "us/lookup")
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/token")
		})
	}
}
