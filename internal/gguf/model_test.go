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
	if err := Write(&buf, cfg); err != nil {
		t.Fatalf("Write: %v", err)
	}
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
			if err != nil {
				t.Fatalf("Read: %v", err)
			}
			want := tt.cfg.metadata(newVocab(tt.cfg.VocabSize))
			if len(f.Metadata) != len(want) {
				t.Fatalf("%d keys, want %d", len(f.Metadata), len(want))
			}
			for i, kv := range f.Metadata {
				if kv.Key != want[i].Key || !kv.Value.Equal(want[i].Value) {
					t.Errorf("key %d: %s = %v, want %s = %v", i, kv.Key, kv.Value, want[i].Key, want[i].Value)
				}
			}
			ts := tt.cfg.tensors()
			if len(f.Tensors) != len(ts) || len(ts) != 3+9*tt.cfg.BlockCount {
				t.Fatalf("%d tensors, want %d", len(f.Tensors), len(ts))
			}
			if f.DataOffset%DefaultAlignment != 0 || f.DataOffset+f.DataSize != uint64(len(data)) {
				t.Fatalf("data at %d size %d, file %d bytes", f.DataOffset, f.DataSize, len(data))
			}
			for i, got := range f.Tensors {
				w := ts[i]
				if got.Name != w.name || got.Type != w.typ || !equalU64(got.Shape, w.shape) || got.Size != w.size() {
					t.Errorf("tensor %d: %+v, want %s %s %v", i, got, w.name, w.typ, w.shape)
				}
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
			if v := math.Float32frombits(binary.LittleEndian.Uint32(data[i:])); v != 1 {
				t.Fatalf("%s[%d] = %g, want 1", ti.Name, i/4, v)
			}
		}
	case TensorF16:
		bound := float32(math.Sqrt(3/float64(ti.Shape[0]))) * (1 + 1.0/1024)
		first := binary.LittleEndian.Uint16(data)
		constant := true
		for i := 0; i < len(data); i += 2 {
			h := binary.LittleEndian.Uint16(data[i:])
			v := f16ToF32(h)
			if v != v || v > bound || v < -bound {
				t.Fatalf("%s[%d] = %g, bound %g", ti.Name, i/2, v, bound)
			}
			constant = constant && h == first
		}
		if constant {
			t.Fatalf("%s is constant", ti.Name)
		}
	default:
		t.Fatalf("%s has type %s", ti.Name, ti.Type)
	}
}

func TestDeterminism(t *testing.T) {
	base := write(t, Presets["tiny"])
	if again := write(t, Presets["tiny"]); !bytes.Equal(base, again) {
		t.Fatal("same config wrote different bytes")
	}
	f, err := Read(bytes.NewReader(base))
	if err != nil {
		t.Fatal(err)
	}
	header := base[:f.DataOffset]

	reseeded := write(t, tinyWith(func(c *Config) { c.Seed = 2 }))
	if !bytes.Equal(reseeded[:f.DataOffset], header) {
		t.Error("another seed changed the header")
	}
	// Every matrix differs, not just some bytes: the streams are per tensor.
	g, _ := Read(bytes.NewReader(reseeded))
	for _, ti := range g.Tensors {
		a := base[f.DataOffset+ti.Offset:][:ti.Size]
		b := reseeded[f.DataOffset+ti.Offset:][:ti.Size]
		if bytes.Equal(a, b) != (ti.Type == TensorF32) {
			t.Errorf("%s: equal=%v across seeds", ti.Name, bytes.Equal(a, b))
		}
	}

	deeper := write(t, tinyWith(func(c *Config) { c.BlockCount = 3 }))
	if sha256.Sum256(deeper) == sha256.Sum256(base) {
		t.Error("another layer count wrote the same bytes")
	}
	h, err := Read(bytes.NewReader(deeper))
	if err != nil {
		t.Fatal(err)
	}
	if v, _ := h.Lookup("llama.block_count"); func() uint64 { n, _ := v.Uint(); return n }() != 3 {
		t.Errorf("block_count = %v, want 3", v)
	}
}

// The bench model is 170 MB: read its header through a pipe and stop the writer there.
func TestBenchHeader(t *testing.T) {
	cfg := Presets["bench"]
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() { done <- Write(pw, cfg) }()
	f, err := Read(pr)
	pr.CloseWithError(errors.New("header read"))
	if err != nil {
		t.Fatal(err)
	}
	if werr := <-done; werr == nil {
		t.Fatal("Write finished into a closed pipe")
	}
	var size uint64
	for _, ti := range f.Tensors {
		size += ti.Size
	}
	if len(f.Tensors) != 3+9*12 || size < 160e6 || size > 170e6 {
		t.Errorf("%d tensors, %d bytes", len(f.Tensors), size)
	}
	if got := cfg.KVBytesPerToken(); got != 12<<10 {
		t.Errorf("KV bytes per token %d, want 12 KiB (DESIGN.md section 5)", got)
	}
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
			if err := cfg.Validate(); status.Of(err) != status.InvalidArg {
				t.Fatalf("Validate = %v, want InvalidArg", err)
			}
			if err := Write(io.Discard, cfg); status.Of(err) != status.InvalidArg {
				t.Fatalf("Write = %v, want InvalidArg", err)
			}
		})
	}
	for name, cfg := range Presets {
		if err := cfg.Validate(); err != nil {
			t.Errorf("preset %s: %v", name, err)
		}
	}
}

func TestWriteFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "tiny.gguf")
	if err := WriteFile(path, Presets["tiny"]); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, write(t, Presets["tiny"])) {
		t.Error("file differs from Write's output")
	}
	if err := WriteFile(filepath.Join(dir, "bad.gguf"), tinyWith(func(c *Config) { c.BlockCount = 0 })); err == nil {
		t.Error("WriteFile accepted an invalid config")
	}
	if err := WriteFile(filepath.Join(dir, "missing", "x.gguf"), Presets["tiny"]); err == nil {
		t.Error("WriteFile into a missing directory succeeded")
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Errorf("directory holds %d entries, want only tiny.gguf", len(entries))
	}
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
		if err == nil || err.Error() != "disk full" {
			t.Errorf("fail at %d: err %v", at, err)
		}
	}
}

func BenchmarkWrite(b *testing.B) {
	for _, name := range []string{"tiny", "bench"} {
		b.Run(name, func(b *testing.B) {
			cfg := Presets[name]
			var n countWriter
			if err := Write(&n, cfg); err != nil {
				b.Fatal(err)
			}
			b.SetBytes(int64(n))
			b.ResetTimer()
			for b.Loop() {
				if err := Write(io.Discard, cfg); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

type countWriter int

func (c *countWriter) Write(p []byte) (int, error) { *c += countWriter(len(p)); return len(p), nil }
