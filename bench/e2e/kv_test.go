package e2e

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/gguf"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/llamastate"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// kvModels are the models whose real KV the disk benchmarks store: the
// bench model, and two layers shaped as Llama 3 8B's (32 heads of 128, 8
// of them KV heads), random weights both, as every model here is.
var kvModels = map[string]gguf.Config{
	"bench": gguf.Presets["bench"],
	"llama3-8b-layers": {
		Name: "mcbridge-llama3-8b-layers", Seed: 3,
		ContextLength: 8192, EmbeddingLength: 4096, BlockCount: 2, FeedForwardLength: 1024,
		HeadCount: 32, HeadCountKV: 8, VocabSize: 4096,
		RMSNormEpsilon: 1e-5, RopeFreqBase: 500000,
	},
}

// realBlocks runs a stock llama-server on the model, prefills tokens of a
// prompt, saves the slot and cuts its KV into pool blocks of blockTokens:
// the bytes a store node would hold for that prompt. prefillMS is what the
// server took to compute them: the recompute a restore saves.
func realBlocks(tb testing.TB, name string, tokens, blockTokens int) (blocks [][]byte, prefillMS float64) {
	tb.Helper()
	cfg := kvModels[name]
	path := filepath.Join(tb.TempDir(), name+".gguf")
	require.NoError(tb, gguf.WriteFile(path, cfg))
	slots := testenv.SlotDir(tb, name)
	s := testenv.StartLlama(tb, "kv-"+name, testenv.StockServer(tb),
		append(testenv.BenchServerArgs(path, tokens+64, 1, "on"), "--slot-save-path", slots))
	prompt := testenv.Tokens(tokens+1, 7, 3)
	prefillMS = s.Complete(tb, testenv.Request{Prompt: prompt, Slot: 0, NPredict: 1}).Timings.PromptMS
	testenv.Post(tb, s.URL+"/slots/0?action=save", map[string]string{"filename": "kv.bin"}, nil)
	s.Stop()
	raw, err := os.ReadFile(filepath.Join(slots, "kv.bin"))
	require.NoError(tb, err)
	st, err := llamastate.Parse(raw)
	require.NoError(tb, err)
	var stream *llamastate.Stream
	for i := range st.Streams {
		if len(st.Streams[i].Cells) > 0 {
			stream = &st.Streams[i]
		}
	}
	require.NotNil(tb, stream, "the slot file holds no cells")
	require.False(tb, stream.VTrans, "flash attention on: V by rows")
	for i, c := range stream.Cells {
		require.Equal(tb, int32(i), c.Pos, "a fresh slot holds position i in its cell i")
	}
	g := pool.Geometry{BlockTokens: blockTokens}
	for _, l := range stream.Layers {
		g.KRow = append(g.KRow, int(l.KRowSize))
		g.VRow = append(g.VRow, int(l.VRowSize))
	}
	parent := key.Hash{1}
	for blk := 0; (blk+1)*blockTokens <= len(stream.Cells); blk++ {
		b := make([]byte, g.Size())
		h := pool.Header{Key: key.Hash{2, byte(blk)}, Parent: parent, Model: key.Hash{3}, Depth: uint32(blk),
			Tokens: prompt[blk*blockTokens : (blk+1)*blockTokens], LayerSums: make([]uint64, g.Layers())}
		for il, l := range stream.Layers {
			off := g.LayerOffset(il)
			k, v := g.KRow[il]*blockTokens, g.VRow[il]*blockTokens
			copy(b[off:off+k], l.K[blk*k:(blk+1)*k])
			copy(b[off+k:off+k+v], l.V[blk*v:(blk+1)*v])
			h.LayerSums[il] = pool.Sum(b[off : off+k+v])
		}
		require.NoError(tb, pool.EncodeHeader(b, &g, &h))
		pool.EndWrite(b, 2)
		blocks = append(blocks, b)
		parent = h.Key
	}
	require.NotEmpty(tb, blocks)
	return blocks, prefillMS
}
