package gguf

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"io"
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/status"
)

func tinyWith(change func(*Config)) Config {
	c := Presets["tiny"]
	change(&c)
	return c
}

func write(t testing.TB, cfg Config) []byte {
	t.Helper()
	var buf bytes.Buffer
	require.NoError(t, Write(&buf, cfg), "Write")
	return buf.Bytes()
}

func TestRoundTrip(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
	}{
		{"tiny", Presets["tiny"]},
		{"three layers", tinyWith(func(c *Config) { c.BlockCount = 3 })},
		{"smallest vocab", tinyWith(func(c *Config) { c.VocabSize = minVocab })},
		{"multi-query", tinyWith(func(c *Config) { c.HeadCountKV = 1 })},
		{"odd sizes", tinyWith(func(c *Config) { c.EmbeddingLength, c.HeadCount, c.HeadCountKV, c.FeedForwardLength = 36, 3, 3, 50 })},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			data := write(t, tt.cfg)
			f, err := Read(bytes.NewReader(data))
			require.NoError(t, err, "Read")
			want := tt.cfg.metadata(newVocab(tt.cfg.VocabSize))
			require.Equal(t, len(want), len(f.Metadata), "metadata keys")
			for i, kv := range f.Metadata {
				assert.Equal(t, want[i].Key, kv.Key, "key %d", i)
				assert.True(t, kv.Value.Equal(want[i].Value), "key %d: %s = %v, want %v", i, kv.Key, kv.Value, want[i].Value)
			}
			ts := tt.cfg.tensors()
			require.Len(t, f.Tensors, len(ts), "tensors")
			require.Len(t, ts, 3+9*tt.cfg.BlockCount, "tensors")
			require.Zero(t, f.DataOffset%DefaultAlignment, "data at %d is unaligned", f.DataOffset)
			require.Equal(t, uint64(len(data)), f.DataOffset+f.DataSize, "data at %d size %d against the file's size", f.DataOffset, f.DataSize)
			for i, got := range f.Tensors {
				w := ts[i]
				assert.Equal(t, w.name, got.Name, "tensor %d name", i)
				assert.Equal(t, w.typ, got.Type, "tensor %d type", i)
				assert.True(t, equalU64(got.Shape, w.shape), "tensor %d shape %v, want %v", i, got.Shape, w.shape)
				assert.Equal(t, w.size(), got.Size, "tensor %d size", i)
				checkWeights(t, got, data[f.DataOffset+got.Offset:][:got.Size])
			}
		})
	}
}

func equalU64(a, b []uint64) bool { return string(u64bytes(a)) == string(u64bytes(b)) }

func u64bytes(v []uint64) []byte {
	var b []byte
	for _, x := range v {
		b = binary.LittleEndian.AppendUint64(b, x)
	}
	return b
}

// checkWeights: norms are ones; matrices are finite, within their bound, not constant.
func checkWeights(t *testing.T, ti TensorInfo, data []byte) {
	t.Helper()
	switch ti.Type {
	case TensorF32:
		for i := 0; i < len(data); i += 4 {
			v := math.Float32frombits(binary.LittleEndian.Uint32(data[i:]))
			require.True(t, v == 1, "%s[%d] = %g, want 1", ti.Name, i/4, v)
		}
	case TensorF16:
		bound := float32(math.Sqrt(3/float64(ti.Shape[0]))) * (1 + 1.0/1024)
		first := binary.LittleEndian.Uint16(data)
		constant := true
		for i := 0; i < len(data); i += 2 {
			h := binary.LittleEndian.Uint16(data[i:])
			v := f16ToF32(h)
			require.False(t, v != v || v > bound || v < -bound, "%s[%d] = %g, bound %g", ti.Name, i/2, v, bound)
			constant = constant && h == first
		}
		require.False(t, constant, "%s is constant", ti.Name)
	default:
		require.FailNowf(t, "unexpected tensor type", "%s has type %s", ti.Name, ti.Type)
	}
}

func TestDeterminism(t *testing.T) {
	base := write(t, Presets["tiny"])
	require.True(t, bytes.Equal(base, write(t, Presets["tiny"])), "same config wrote different bytes")
	f, err := Read(bytes.NewReader(base))
	require.NoError(t, err)
	header := base[:f.DataOffset]

	reseeded := write(t, tinyWith(func(c *Config) { c.Seed = 2 }))
	assert.True(t, bytes.Equal(reseeded[:f.DataOffset], header), "another seed changed the header")
	// Every matrix differs, not just some bytes: the streams are per tensor.
	g, _ := Read(bytes.NewReader(reseeded))
	for _, ti := range g.Tensors {
		a := base[f.DataOffset+ti.Offset:][:ti.Size]
		b := reseeded[f.DataOffset+ti.Offset:][:ti.Size]
		assert.Equal(t, ti.Type == TensorF32, bytes.Equal(a, b), "%s: equal across seeds", ti.Name)
	}

	deeper := write(t, tinyWith(func(c *Config) { c.BlockCount = 3 }))
	assert.NotEqual(t, sha256.Sum256(base), sha256.Sum256(deeper), "another layer count wrote the same bytes")
	h, err := Read(bytes.NewReader(deeper))
	require.NoError(t, err)
	v, _ := h.Lookup("llama.block_count")
	n, _ := v.Uint()
	assert.Equal(t, uint64(3), n, "block_count = %v", v)
}

// The bench model is 170 MB: read its header through a pipe and stop the writer there.
func TestBenchHeader(t *testing.T) {
	cfg := Presets["bench"]
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() { done <- Write(pw, cfg) }()
	f, err := Read(pr)
	pr.CloseWithError(errors.New("header read"))
	require.NoError(t, err)
	require.Error(t, <-done, "Write finished into a closed pipe")
	var size uint64
	for _, ti := range f.Tensors {
		size += ti.Size
	}
	assert.Len(t, f.Tensors, 3+9*12, "tensors")
	assert.GreaterOrEqual(t, size, uint64(160e6), "bytes of tensors")
	assert.LessOrEqual(t, size, uint64(170e6), "bytes of tensors")
	assert.Equal(t, 12<<10, cfg.KVBytesPerToken(), "KV bytes per token, want 12 KiB (docs/design.md §15)")
}

func TestValidate(t *testing.T) {
	tests := []struct {
		name   string
		change func(*Config)
	}{
		{"no name", func(c *Config) { c.Name = "" }},
		{"zero layers", func(c *Config) { c.BlockCount = 0 }},
		{"negative ff", func(c *Config) { c.FeedForwardLength = -1 }},
		{"huge embedding", func(c *Config) { c.EmbeddingLength = maxDim * 2 }},
		{"zero context", func(c *Config) { c.ContextLength = 0 }},
		{"heads do not divide embedding", func(c *Config) { c.HeadCount = 5 }},
		{"kv heads do not divide heads", func(c *Config) { c.HeadCountKV = 3 }},
		{"odd head size", func(c *Config) { c.EmbeddingLength, c.HeadCount, c.HeadCountKV = 60, 4, 2 }},
		{"zero epsilon", func(c *Config) { c.RMSNormEpsilon = 0 }},
		{"NaN epsilon", func(c *Config) { c.RMSNormEpsilon = float32(math.NaN()) }},
		{"infinite rope base", func(c *Config) { c.RopeFreqBase = float32(math.Inf(1)) }},
		{"vocab without a merge", func(c *Config) { c.VocabSize = minVocab - 1 }},
		{"vocab beyond pairs", func(c *Config) { c.VocabSize = maxVocab + 1 }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := tinyWith(tt.change)
			err := cfg.Validate()
			require.Equal(t, status.InvalidArg, status.Of(err), "Validate = %v", err)
			err = Write(io.Discard, cfg)
			require.Equal(t, status.InvalidArg, status.Of(err), "Write = %v", err)
		})
	}
	for name, cfg := range Presets {
		assert.NoError(t, cfg.Validate(), "preset %s", name)
	}
}

func TestWriteFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "tiny.gguf")
	require.NoError(t, WriteFile(path, Presets["tiny"]))
	got, err := os.ReadFile(path)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(got, write(t, Presets["tiny"])), "file differs from Write's output")
	assert.Error(t, WriteFile(filepath.Join(dir, "bad.gguf"), tinyWith(func(c *Config) { c.BlockCount = 0 })), "WriteFile accepted an invalid config")
	assert.Error(t, WriteFile(filepath.Join(dir, "missing", "x.gguf"), Presets["tiny"]), "WriteFile into a missing directory succeeded")
	entries, _ := os.ReadDir(dir)
	assert.Len(t, entries, 1, "the directory must hold only tiny.gguf")
}

type failWriter struct{ left int }

func (w *failWriter) Write(p []byte) (int, error) {
	if len(p) > w.left {
		n := w.left
		w.left = 0
		return n, errors.New("disk full")
	}
	w.left -= len(p)
	return len(p), nil
}

func TestWriteError(t *testing.T) {
	size := len(write(t, Presets["tiny"]))
	for _, at := range []int{0, 100, size / 2, size - 1} {
		err := Write(&failWriter{left: at}, Presets["tiny"])
		assert.EqualError(t, err, "disk full", "fail at %d", at)
	}
}

func BenchmarkWrite(b *testing.B) {
	for _, name := range []string{"tiny", "bench"} {
		b.Run(name, func(b *testing.B) {
			cfg := Presets[name]
			var n countWriter
			require.NoError(b, Write(&n, cfg))
			b.SetBytes(int64(n))
			b.ResetTimer()
			for b.Loop() {
				require.NoError(b, Write(io.Discard, cfg))
			}
		})
	}
}

type countWriter int

func (c *countWriter) Write(p []byte) (int, error) { *c += countWriter(len(p)); return len(p), nil }
