package gguf

import (
	"bufio"
	"encoding/binary"
	"io"
	"os"
	"path/filepath"
)

// Write writes the model cfg describes as GGUF v3. Same Config, same bytes.
func Write(w io.Writer, cfg Config) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	return encode(w, func(e *encoder) { e.write(cfg.header(), cfg.tensors(), cfg.Seed) })
}

func encode(w io.Writer, body func(*encoder)) error {
	e := &encoder{w: bufio.NewWriterSize(w, 1<<20)}
	body(e)
	if e.err == nil {
		e.err = e.w.Flush()
	}
	return e.err
}

// WriteFile writes the model to path through a temporary file in the same directory,
// so that a reader (a llama-server started by a test) never sees half a model.
func WriteFile(path string, cfg Config) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	return writeAtomic(path, func(e *encoder) { e.write(cfg.header(), cfg.tensors(), cfg.Seed) })
}

func writeAtomic(path string, body func(*encoder)) (err error) {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			os.Remove(f.Name())
		}
	}()
	// CreateTemp makes the file private; a model is not a secret.
	if err := f.Chmod(0o644); err != nil {
		f.Close()
		return err
	}
	if err := encode(f, body); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), path)
}

// encoder writes GGUF; the first error sticks and later writes do nothing.
type encoder struct {
	w   *bufio.Writer
	off uint64
	err error
	buf []byte
}

func (e *encoder) bytes(b []byte) {
	if e.err != nil {
		return
	}
	var n int
	n, e.err = e.w.Write(b)
	e.off += uint64(n)
}

func (e *encoder) u32(v uint32) { e.bytes(binary.LittleEndian.AppendUint32(e.buf[:0], v)) }
func (e *encoder) u64(v uint64) { e.bytes(binary.LittleEndian.AppendUint64(e.buf[:0], v)) }

func (e *encoder) str(s string) {
	e.u64(uint64(len(s)))
	e.bytes([]byte(s))
}

func (e *encoder) pad(align uint64) {
	e.bytes(make([]byte, alignUp(e.off, align)-e.off))
}

func (e *encoder) value(v Value) {
	e.u32(uint32(v.typ))
	if v.typ == TypeArray {
		e.u32(uint32(v.elem))
		e.u64(v.n)
	}
	if v.typ == TypeString || v.elem == TypeString {
		for _, s := range v.strs {
			e.str(s)
		}
		return
	}
	e.bytes(v.raw)
}

func (e *encoder) write(kvs []KV, ts []tensor, seed uint64) {
	e.buf = make([]byte, 0, 1<<20)
	e.bytes([]byte(Magic))
	e.u32(Version)
	e.u64(uint64(len(ts)))
	e.u64(uint64(len(kvs)))
	for _, kv := range kvs {
		e.str(kv.Key)
		e.value(kv.Value)
	}
	var offset uint64
	for _, t := range ts {
		e.str(t.name)
		e.u32(uint32(len(t.shape)))
		for _, d := range t.shape {
			e.u64(d)
		}
		e.u32(uint32(t.typ))
		e.u64(offset)
		offset += alignUp(t.size(), DefaultAlignment)
	}
	e.pad(DefaultAlignment)
	for _, t := range ts {
		e.tensorData(t, seed)
		e.pad(DefaultAlignment)
	}
}

// tensorData generates a tensor's bytes a buffer at a time: the bench model is 170 MB.
func (e *encoder) tensorData(t tensor, seed uint64) {
	rng := tensorRand(seed, t.name)
	chunk := e.buf[:cap(e.buf)]
	for left := t.size(); left > 0 && e.err == nil; {
		n := min(left, uint64(len(chunk)))
		t.fill(chunk[:n], rng)
		e.bytes(chunk[:n])
		left -= n
	}
}
