package gguf

import (
	"bytes"
	"encoding/binary"
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// WriteModelFile writes the metadata as given plus the alignment, and each tensor
// with its shape, the type its Init implies and the data that Init describes.
func TestWriteModelFile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "m.gguf")
	kvs := []KV{{"general.architecture", String("bert")}, {"bert.block_count", Uint32(2)}}
	specs := []TensorSpec{
		{"token_embd.weight", []uint64{8, 100}, Random},
		{"blk.0.ffn_up_exps.weight", []uint64{8, 16, 4}, Random},
		{"token_embd_norm.weight", []uint64{8}, Ones},
		{"token_embd_norm.bias", []uint64{8}, Zeros},
		{"token_types.weight", []uint64{8, 2}, RandomF32},
	}
	require.NoError(t, WriteModelFile(p, kvs, specs, 7))

	b, err := os.ReadFile(p)
	require.NoError(t, err)
	f, err := Read(bytes.NewReader(b))
	require.NoError(t, err)
	require.Len(t, f.Metadata, 3)
	assert.Equal(t, "bert.block_count", f.Metadata[1].Key)
	al, _ := f.Lookup("general.alignment")
	assert.Equal(t, "32", al.String())
	require.Len(t, f.Tensors, 5)
	wantTypes := []TensorType{TensorF16, TensorF16, TensorF32, TensorF32, TensorF32}
	for i, s := range specs {
		assert.Equal(t, s.Name, f.Tensors[i].Name)
		assert.Equal(t, s.Shape, f.Tensors[i].Shape)
		assert.Equal(t, wantTypes[i], f.Tensors[i].Type, s.Name)
	}
	data := func(i int) []byte {
		ti := f.Tensors[i]
		return b[f.DataOffset+ti.Offset : f.DataOffset+ti.Offset+ti.Size]
	}
	for i := 0; i < 8; i++ {
		assert.Equal(t, float32(1), math.Float32frombits(binary.LittleEndian.Uint32(data(2)[4*i:])))
		assert.Equal(t, float32(0), math.Float32frombits(binary.LittleEndian.Uint32(data(3)[4*i:])))
	}
	// Random: uniform in ±sqrt(3/fan-in), not all equal.
	bound := math.Sqrt(3.0 / 8)
	seen := map[uint16]bool{}
	for i := 0; i+1 < len(data(0)); i += 2 {
		h := binary.LittleEndian.Uint16(data(0)[i:])
		seen[h] = true
		assert.LessOrEqual(t, math.Abs(float64(f16ToF32(h))), bound+1e-3)
	}
	assert.Greater(t, len(seen), 100)
	distinct := map[uint32]bool{}
	for i := 0; i+3 < len(data(4)); i += 4 {
		v := binary.LittleEndian.Uint32(data(4)[i:])
		distinct[v] = true
		assert.LessOrEqual(t, math.Abs(float64(math.Float32frombits(v))), bound)
	}
	assert.Len(t, distinct, 16)

	// A tensor's data depends on its name and the seed only.
	p2 := filepath.Join(t.TempDir(), "m2.gguf")
	require.NoError(t, WriteModelFile(p2, kvs[:1], specs[:1], 7))
	b2, err := os.ReadFile(p2)
	require.NoError(t, err)
	f2, err := Read(bytes.NewReader(b2))
	require.NoError(t, err)
	t2 := f2.Tensors[0]
	assert.Equal(t, data(0), b2[f2.DataOffset+t2.Offset:f2.DataOffset+t2.Offset+t2.Size])
}

func TestWriteModelFileRefuses(t *testing.T) {
	p := filepath.Join(t.TempDir(), "m.gguf")
	ok := []KV{{"general.architecture", String("llama")}}
	for name, c := range map[string]struct {
		kvs   []KV
		specs []TensorSpec
	}{
		"repeated key":    {[]KV{ok[0], ok[0]}, nil},
		"alignment given": {[]KV{{"general.alignment", Uint32(64)}}, nil},
		"repeated tensor": {ok, []TensorSpec{{"a", []uint64{1}, Ones}, {"a", []uint64{1}, Ones}}},
		"no dimension":    {ok, []TensorSpec{{"a", nil, Ones}}},
		"five dimensions": {ok, []TensorSpec{{"a", []uint64{1, 1, 1, 1, 1}, Ones}}},
		"zero dimension":  {ok, []TensorSpec{{"a", []uint64{4, 0}, Random}}},
		"name too long":   {ok, []TensorSpec{{string(make([]byte, maxNameLen)), []uint64{1}, Ones}}},
		"unknown init":    {ok, []TensorSpec{{"a", []uint64{1}, Init(9)}}},
	} {
		require.Error(t, WriteModelFile(p, c.kvs, c.specs, 1), name)
		_, err := os.Stat(p)
		require.True(t, os.IsNotExist(err), "%s: nothing written", name)
	}
}
