package gguf

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"
)

// FuzzRead: no input panics Read, and what Read accepts is self-consistent.
func FuzzRead(f *testing.F) {
	f.Add(write(f, tinyWith(func(c *Config) { c.VocabSize = minVocab; c.BlockCount = 1 })))
	f.Add(header(3, 0, 0).b)
	f.Add(header(2, 2, 1).kvU32("general.alignment", 64).tensorInfo("a", 2, 0, 64, 2).tensorInfo("b", TensorF32, 128, 3).b)
	f.Add(header(3, 0, 2).
		str("s").u32(uint32(TypeArray)).u32(uint32(TypeString)).u64(2).str("x").str("y").
		str("f").u32(uint32(TypeArray)).u32(uint32(TypeFloat64)).u64(1).u64(0).b)
	f.Add(header(3, 1, 0).tensorInfo("z", TensorF16, 0, 0, 1<<62, 1<<62).b)
	f.Fuzz(func(t *testing.T, data []byte) {
		g, err := Read(bytes.NewReader(data))
		if err != nil {
			return
		}
		require.NotZero(t, g.Alignment, "alignment")
		require.Zero(t, g.Alignment&(g.Alignment-1), "alignment %d is not a power of 2", g.Alignment)
		if len(g.Tensors) > 0 {
			require.Zero(t, g.DataOffset%g.Alignment, "data offset %d is unaligned", g.DataOffset)
			require.LessOrEqual(t, g.DataOffset, uint64(len(data))+g.Alignment, "data offset in a %d-byte input", len(data))
		}
		keys := map[string]bool{}
		for _, kv := range g.Metadata {
			require.NotEmpty(t, kv.Key, "empty key accepted")
			require.False(t, keys[kv.Key], "key %q accepted twice", kv.Key)
			keys[kv.Key] = true
			v := kv.Value
			_ = v.String()
			v.Uint()
			v.Int()
			v.Float()
			v.Bool()
			v.Str()
			v.Strings()
			v.Ints()
		}
		var next uint64
		for _, ti := range g.Tensors {
			require.Equal(t, next, ti.Offset, "tensor %+v accepted at another offset", ti)
			require.Less(t, len(ti.Name), maxNameLen, "tensor %+v accepted", ti)
			require.LessOrEqual(t, len(ti.Shape), maxDims, "tensor %+v accepted", ti)
			next += alignUp(ti.Size, g.Alignment)
		}
		require.Equal(t, next, g.DataSize, "data size against the tensors' end")
	})
}
