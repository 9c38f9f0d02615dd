package gguf

import (
	"bytes"
	"testing"
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
		if g.Alignment == 0 || g.Alignment&(g.Alignment-1) != 0 {
			t.Fatalf("alignment %d", g.Alignment)
		}
		if len(g.Tensors) > 0 && (g.DataOffset%g.Alignment != 0 || g.DataOffset > uint64(len(data))+g.Alignment) {
			t.Fatalf("data offset %d in a %d-byte input", g.DataOffset, len(data))
		}
		keys := map[string]bool{}
		for _, kv := range g.Metadata {
			if kv.Key == "" || keys[kv.Key] {
				t.Fatalf("key %q accepted twice or empty", kv.Key)
			}
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
			if ti.Offset != next || len(ti.Name) >= maxNameLen || len(ti.Shape) > maxDims {
				t.Fatalf("tensor %+v accepted, expected offset %d", ti, next)
			}
			next += alignUp(ti.Size, g.Alignment)
		}
		if next != g.DataSize {
			t.Fatalf("data size %d, tensors end at %d", g.DataSize, next)
		}
	})
}
