package gguf

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"math"
	"math/bits"
	"slices"

	"github.com/mcbridge/mcbridge/internal/status"
)

// MaxHeaderBytes bounds what Read consumes before the tensor data. Real models stay
// far below it (a 256k-token vocabulary with merges is about 10 MiB); the bound is
// what keeps a hostile file from making Read allocate without limit.
const MaxHeaderBytes = 64 << 20

// Read parses a GGUF file's header, metadata and tensor directory, and checks them as
// llama.cpp does (ggml/src/gguf.cpp): version 2 or 3, unique non-empty keys, no
// nested arrays, general.alignment a u32 power of two, unique tensor names shorter
// than 64 bytes, at most 4 dimensions, known types, rows made of whole blocks, sizes
// that fit 64 bits and data offsets laid out back to back at the alignment. It stops
// at the start of the tensor data and does not read it.
//
// Memory use is proportional to the bytes read, never to the counts a file declares.
func Read(r io.Reader) (*File, error) {
	d := &decoder{r: bufio.NewReader(io.LimitReader(r, MaxHeaderBytes+1))}
	f, err := d.file()
	if err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			if d.off > MaxHeaderBytes {
				return nil, status.Errorf(status.InvalidArg, "gguf: header longer than %d bytes", MaxHeaderBytes)
			}
			return nil, status.Errorf(status.InvalidArg, "gguf: truncated at byte %d", d.off)
		}
		return nil, err
	}
	return f, nil
}

type decoder struct {
	r   *bufio.Reader
	off uint64
	buf [8]byte
}

func malformed(format string, args ...any) error {
	return status.Errorf(status.InvalidArg, "gguf: "+format, args...)
}

func (d *decoder) fixed(n int) ([]byte, error) {
	b := d.buf[:n]
	if _, err := io.ReadFull(d.r, b); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	d.off += uint64(n)
	return b, nil
}

func (d *decoder) u32() (uint32, error) {
	b, err := d.fixed(4)
	if err != nil {
		return 0, err
	}
	return binary.LittleEndian.Uint32(b), nil
}

func (d *decoder) u64() (uint64, error) {
	b, err := d.fixed(8)
	if err != nil {
		return 0, err
	}
	return binary.LittleEndian.Uint64(b), nil
}

// bytes reads n bytes; the buffer grows with what arrives, so a huge declared n on a
// short input costs no more than the input.
func (d *decoder) bytes(n uint64) ([]byte, error) {
	if n > MaxHeaderBytes {
		return nil, malformed("a value of %d bytes at byte %d exceeds the header limit", n, d.off)
	}
	var b bytes.Buffer
	got, err := io.CopyN(&b, d.r, int64(n))
	d.off += uint64(got)
	if err != nil {
		return nil, io.ErrUnexpectedEOF
	}
	return b.Bytes(), nil
}

func (d *decoder) str() (string, error) {
	n, err := d.u64()
	if err != nil {
		return "", err
	}
	b, err := d.bytes(n)
	return string(b), err
}

func (d *decoder) file() (*File, error) {
	magic, err := d.fixed(4)
	if err != nil {
		return nil, err
	}
	if string(magic) != Magic {
		return nil, malformed("bad magic %q", magic)
	}
	f := &File{Alignment: DefaultAlignment}
	if f.Version, err = d.u32(); err != nil {
		return nil, err
	}
	if f.Version != 2 && f.Version != 3 {
		return nil, malformed("unsupported version %d", f.Version)
	}
	nTensors, err := d.u64()
	if err != nil {
		return nil, err
	}
	nKV, err := d.u64()
	if err != nil {
		return nil, err
	}
	if int64(nTensors) < 0 || int64(nKV) < 0 {
		return nil, malformed("negative count: %d tensors, %d keys", int64(nTensors), int64(nKV))
	}

	seen := map[string]bool{}
	// Counts come from the file: the loops end on EOF, slices grow with what was read.
	for i := uint64(0); i < nKV; i++ {
		kv, err := d.kv()
		if err != nil {
			return nil, err
		}
		if seen[kv.Key] {
			return nil, malformed("duplicate key %q", kv.Key)
		}
		seen[kv.Key] = true
		f.Metadata = append(f.Metadata, kv)
	}
	if v, ok := f.Lookup("general.alignment"); ok {
		if v.Type() != TypeUint32 {
			return nil, malformed("general.alignment is %s, not u32", v.Type())
		}
		a, _ := v.Uint()
		if a == 0 || a&(a-1) != 0 {
			return nil, malformed("alignment %d is not a power of 2", a)
		}
		f.Alignment = a
	}

	names := map[string]bool{}
	for i := uint64(0); i < nTensors; i++ {
		t, err := d.tensorInfo()
		if err != nil {
			return nil, err
		}
		if names[t.Name] {
			return nil, malformed("duplicate tensor %q", t.Name)
		}
		names[t.Name] = true
		f.Tensors = append(f.Tensors, t)
	}

	f.DataOffset = d.off
	if nTensors > 0 {
		f.DataOffset = alignUp(d.off, f.Alignment)
	}
	for _, t := range f.Tensors {
		if t.Offset != f.DataSize {
			return nil, malformed("tensor %q at offset %d, expected %d", t.Name, t.Offset, f.DataSize)
		}
		padded := alignUp(t.Size, f.Alignment)
		if padded < t.Size || f.DataSize+padded < f.DataSize {
			return nil, malformed("tensor %q: data section size overflows", t.Name)
		}
		f.DataSize += padded
	}
	return f, nil
}

func (d *decoder) kv() (KV, error) {
	key, err := d.str()
	if err != nil {
		return KV{}, err
	}
	if key == "" {
		return KV{}, malformed("empty key")
	}
	t, err := d.u32()
	if err != nil {
		return KV{}, err
	}
	v := Value{typ: Type(t)}
	switch {
	case v.typ == TypeArray:
		elem, err := d.u32()
		if err != nil {
			return KV{}, err
		}
		v.elem = Type(elem)
		if v.n, err = d.u64(); err != nil {
			return KV{}, err
		}
		err = d.elems(&v, v.elem, v.n)
		if err != nil {
			return KV{}, wrapKey(key, err)
		}
	default:
		if err := d.elems(&v, v.typ, 1); err != nil {
			return KV{}, wrapKey(key, err)
		}
	}
	return KV{Key: key, Value: v}, nil
}

func wrapKey(key string, err error) error {
	if status.Of(err) == status.InvalidArg {
		return malformed("key %q: %v", key, err)
	}
	return err
}

// elems reads n values of type t into v.
func (d *decoder) elems(v *Value, t Type, n uint64) error {
	switch {
	case t == TypeString:
		for range n {
			s, err := d.str()
			if err != nil {
				return err
			}
			v.strs = append(v.strs, s)
		}
	case t.size() > 0:
		hi, lo := bits.Mul64(n, uint64(t.size()))
		if hi != 0 {
			return malformed("array of %d %s overflows", n, t)
		}
		raw, err := d.bytes(lo)
		if err != nil {
			return err
		}
		if lo > 0 {
			v.raw = raw
		}
	default:
		return malformed("invalid value type %s", t)
	}
	return nil
}

func (d *decoder) tensorInfo() (TensorInfo, error) {
	var t TensorInfo
	var err error
	if t.Name, err = d.str(); err != nil {
		return t, err
	}
	if len(t.Name) >= maxNameLen {
		return t, malformed("tensor name %q is %d bytes, the limit is %d", t.Name, len(t.Name), maxNameLen-1)
	}
	nDims, err := d.u32()
	if err != nil {
		return t, err
	}
	if nDims > maxDims {
		return t, malformed("tensor %q has %d dimensions", t.Name, nDims)
	}
	elems := uint64(1)
	overflow := false
	for range nDims {
		ne, err := d.u64()
		if err != nil {
			return t, err
		}
		if int64(ne) < 0 {
			return t, malformed("tensor %q has a negative dimension", t.Name)
		}
		hi, lo := bits.Mul64(elems, ne)
		overflow = overflow || hi != 0 || lo > math.MaxInt64
		elems = lo
		t.Shape = append(t.Shape, ne)
	}
	// ggml rejects only non-empty tensors whose element count overflows.
	if overflow && !slices.Contains(t.Shape, 0) {
		return t, malformed("tensor %q: element count overflows", t.Name)
	}

	typ, err := d.u32()
	if err != nil {
		return t, err
	}
	t.Type = TensorType(typ)
	info, ok := tensorTypes[t.Type]
	if !ok {
		return t, malformed("tensor %q has unknown type %d", t.Name, typ)
	}
	rowLen := uint64(1) // ggml pads missing dimensions with 1
	if len(t.Shape) > 0 {
		rowLen = t.Shape[0]
	}
	if rowLen%info.blockSize != 0 {
		return t, malformed("tensor %q: row of %d elements is not whole %s blocks", t.Name, rowLen, t.Type)
	}
	hi, size := bits.Mul64(elems/info.blockSize, info.typeSize)
	if hi != 0 {
		return t, malformed("tensor %q: size overflows", t.Name)
	}
	t.Size = size
	if t.Offset, err = d.u64(); err != nil {
		return t, err
	}
	return t, nil
}
