package gguf

import (
	"bytes"
	"io"
	"math"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/status"
)

// oneKV is a file with a single metadata entry whose type and value bytes are given.
func oneKV(key string, typ Type, value ...byte) []byte {
	return header(3, 0, 1).str(key).u32(uint32(typ)).raw(value...).b
}

func TestValueAccessors(t *testing.T) {
	tests := []struct {
		name    string
		file    []byte
		uint    uint64
		uintOK  bool
		int     int64
		intOK   bool
		float   float64
		floatOK bool
		str     string
		text    string
	}{
		{name: "u8", file: oneKV("k", TypeUint8, 200), uint: 200, uintOK: true, int: 200, intOK: true, text: "200"},
		{name: "i8 negative", file: oneKV("k", TypeInt8, 0xff), int: -1, intOK: true, text: "-1"},
		{name: "u16", file: oneKV("k", TypeUint16, 0x34, 0x12), uint: 0x1234, uintOK: true, int: 0x1234, intOK: true, text: "4660"},
		{name: "i16", file: oneKV("k", TypeInt16, 0xfe, 0xff), int: -2, intOK: true, text: "-2"},
		{name: "i32", file: oneKV("k", TypeInt32, 5, 0, 0, 0), uint: 5, uintOK: true, int: 5, intOK: true, text: "5"},
		{name: "u64 max", file: oneKV("k", TypeUint64, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff), uint: math.MaxUint64, uintOK: true, text: "18446744073709551615"},
		{name: "i64", file: oneKV("k", TypeInt64, 0xfd, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff), int: -3, intOK: true, text: "-3"},
		{name: "f64", file: oneKV("k", TypeFloat64, 0, 0, 0, 0, 0, 0, 0xf8, 0x3f), float: 1.5, floatOK: true, text: "1.5"},
		{name: "f32", file: header(3, 0, 1).str("k").u32(uint32(TypeFloat32)).u32(math.Float32bits(0.25)).b, float: 0.25, floatOK: true, text: "0.25"},
		{name: "bool", file: oneKV("k", TypeBool, 2), text: "true"},
		{name: "string", file: header(3, 0, 1).str("k").u32(uint32(TypeString)).str("hé").b, str: "hé", text: `"hé"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f, err := Read(bytes.NewReader(tt.file))
			require.NoError(t, err)
			v, ok := f.Lookup("k")
			require.True(t, ok, "key missing")
			u, ok := v.Uint()
			assert.Equal(t, tt.uint, u, "Uint")
			assert.Equal(t, tt.uintOK, ok, "Uint ok")
			i, ok := v.Int()
			assert.Equal(t, tt.int, i, "Int")
			assert.Equal(t, tt.intOK, ok, "Int ok")
			x, ok := v.Float()
			assert.Equal(t, tt.float, x, "Float")
			assert.Equal(t, tt.floatOK, ok, "Float ok")
			s, ok := v.Str()
			assert.Equal(t, tt.str, s, "Str")
			assert.Equal(t, tt.str != "", ok, "Str ok")
			_, ok = v.Strings()
			assert.False(t, ok, "a scalar passed as a string array")
			_, ok = v.Ints()
			assert.False(t, ok, "a scalar passed as an integer array")
			assert.Equal(t, tt.text, v.String(), "String")
			assert.Equal(t, uint64(1), v.Len(), "Len")
		})
	}
}

func TestArrays(t *testing.T) {
	f, err := Read(bytes.NewReader(header(3, 0, 4).
		str("strs").u32(uint32(TypeArray)).u32(uint32(TypeString)).u64(5).str("a").str("").str("c").str("d").str("e").
		str("i16").u32(uint32(TypeArray)).u32(uint32(TypeInt16)).u64(2).raw(0xff, 0xff, 1, 0).
		str("u64").u32(uint32(TypeArray)).u32(uint32(TypeUint64)).u64(1).u64(math.MaxUint64).
		str("empty").u32(uint32(TypeArray)).u32(uint32(TypeFloat32)).u64(0).b))
	require.NoError(t, err)
	strs, _ := f.Lookup("strs")
	s, ok := strs.Strings()
	assert.True(t, ok, "Strings ok")
	assert.Equal(t, "a,,c,d,e", strings.Join(s, ","), "Strings")
	assert.Equal(t, uint64(5), strs.Len(), "Len")
	assert.Equal(t, TypeString, strs.Elem(), "Elem")
	assert.Equal(t, `[str x 5: "a" "" "c" "d" ...]`, strs.String(), "String")
	i16, _ := f.Lookup("i16")
	v, ok := i16.Ints()
	assert.True(t, ok, "Ints ok")
	assert.Equal(t, []int64{-1, 1}, v, "Ints")
	_, ok = i16.Uint()
	assert.False(t, ok, "an array passed as a scalar")
	u64, _ := f.Lookup("u64")
	_, ok = u64.Ints()
	assert.False(t, ok, "u64 above MaxInt64 passed as int64")
	empty, _ := f.Lookup("empty")
	assert.Zero(t, empty.Len(), "empty array: %s", empty)
	assert.Equal(t, TypeArray, empty.Type(), "empty array: %s", empty)
	assert.Equal(t, "[f32 x 0:]", empty.String(), "empty array")
	assert.True(t, Int32s(nil).Equal(Value{typ: TypeArray, elem: TypeInt32}), "Equal of empty int32 arrays")
	assert.False(t, Int32s([]int32{1}).Equal(Int32s([]int32{2})), "Equal of different int32 arrays")
}

func TestReadTensors(t *testing.T) {
	// A q4_0 tensor of 64x2 (4 blocks of 18 bytes = 72, padded to 96), then an f32.
	file := header(3, 2, 1).kvU32("general.alignment", 32).
		tensorInfo("a", 2, 0, 64, 2).
		tensorInfo("b", TensorF32, 96, 3).b
	f, err := Read(bytes.NewReader(file))
	require.NoError(t, err)
	assert.Equal(t, alignUp(uint64(len(file)), 32), f.DataOffset, "data offset")
	assert.Equal(t, uint64(96+32), f.DataSize, "data size")
	a := f.Tensors[0]
	assert.Equal(t, uint64(72), a.Size, "tensor a: %+v", a)
	assert.Equal(t, "q4_0", a.Type.String(), "tensor a: %+v", a)
	assert.Len(t, a.Shape, 2, "tensor a: %+v", a)
	assert.Equal(t, "ggml_type(4)", TensorType(4).String(), "names of unknown types")
	assert.Equal(t, "type(99)", Type(99).String(), "names of unknown types")
	// Alignment 64 moves both the data section and the second offset.
	file = header(3, 2, 1).kvU32("general.alignment", 64).
		tensorInfo("a", 2, 0, 64, 2).
		tensorInfo("b", TensorF32, 128, 3).b
	f, err = Read(bytes.NewReader(file))
	if assert.NoError(t, err, "alignment 64") {
		assert.Zero(t, f.DataOffset%64, "alignment 64: %+v", f)
		assert.Equal(t, uint64(64), f.Alignment, "alignment 64: %+v", f)
		assert.Equal(t, uint64(128+64), f.DataSize, "alignment 64: %+v", f)
	}
	// Zero-element tensors are legal, whatever their other dimensions.
	file = header(3, 1, 0).tensorInfo("z", TensorF16, 0, 0, 1<<62, 1<<62).b
	f, err = Read(bytes.NewReader(file))
	if assert.NoError(t, err, "empty tensor") {
		assert.Zero(t, f.Tensors[0].Size, "empty tensor")
	}
}

func TestReadRejects(t *testing.T) {
	long := strings.Repeat("x", maxNameLen)
	tests := []struct {
		name string
		file []byte
		want string
	}{
		{"empty", nil, "truncated"},
		{"bad magic", append([]byte("GGUG"), header(3, 0, 0).b[4:]...), "bad magic"},
		{"version 1", header(1, 0, 0).b, "version 1"},
		{"version 4", header(4, 0, 0).b, "version 4"},
		{"negative tensor count", header(3, 1<<63, 0).b, "negative count"},
		{"negative key count", header(3, 0, math.MaxUint64).b, "negative count"},
		{"empty key", header(3, 0, 1).kvU32("", 1).b, "empty key"},
		{"duplicate key", header(3, 0, 2).kvU32("a", 1).kvU32("a", 2).b, "duplicate key"},
		{"unknown type", oneKV("k", 13), "invalid value type"},
		{"nested array", header(3, 0, 1).str("k").u32(uint32(TypeArray)).u32(uint32(TypeArray)).u64(1).b, "invalid value type"},
		{"huge string", header(3, 0, 1).str("k").u32(uint32(TypeString)).u64(1 << 40).b, "exceeds the header limit"},
		{"huge array", header(3, 0, 1).str("k").u32(uint32(TypeArray)).u32(uint32(TypeUint64)).u64(1 << 62).b, "overflows"},
		{"array longer than file", header(3, 0, 1).str("k").u32(uint32(TypeArray)).u32(uint32(TypeUint32)).u64(1 << 20).b, "truncated"},
		{"string array longer than file", header(3, 0, 1).str("k").u32(uint32(TypeArray)).u32(uint32(TypeString)).u64(1 << 60).b, "truncated"},
		{"alignment type", header(3, 0, 1).str("general.alignment").u32(uint32(TypeUint64)).u64(32).b, "not u32"},
		{"alignment zero", header(3, 0, 1).kvU32("general.alignment", 0).b, "not a power of 2"},
		{"alignment 48", header(3, 0, 1).kvU32("general.alignment", 48).b, "not a power of 2"},
		{"long tensor name", header(3, 1, 0).tensorInfo(long, TensorF32, 0, 1).b, "limit is 63"},
		{"duplicate tensor", header(3, 2, 0).tensorInfo("a", TensorF32, 0, 1).tensorInfo("a", TensorF32, 32, 1).b, "duplicate tensor"},
		{"five dimensions", header(3, 1, 0).tensorInfo("a", TensorF32, 0, 1, 1, 1, 1, 1).b, "5 dimensions"},
		{"negative dimension", header(3, 1, 0).tensorInfo("a", TensorF32, 0, 1<<63).b, "negative dimension"},
		{"element overflow", header(3, 1, 0).tensorInfo("a", TensorF32, 0, 1<<40, 1<<40).b, "element count overflows"},
		{"size overflow", header(3, 1, 0).tensorInfo("a", tensorF64, 0, 1<<62).b, "size overflows"},
		{"removed type", header(3, 1, 0).tensorInfo("a", 4, 0, 32).b, "unknown type 4"},
		{"partial block", header(3, 1, 0).tensorInfo("a", 2, 0, 16).b, "not whole q4_0 blocks"},
		{"scalar of a block type", header(3, 1, 0).tensorInfo("a", 2, 0).b, "row of 1 elements"},
		{"first offset", header(3, 1, 0).tensorInfo("a", TensorF32, 32, 1).b, "offset 32, expected 0"},
		{"unaligned second", header(3, 2, 0).tensorInfo("a", TensorF32, 0, 1).tensorInfo("b", TensorF32, 4, 1).b, "offset 4, expected 32"},
		{"data section overflow", header(3, 2, 0).tensorInfo("a", tensorF64, 0, 1<<60-1).tensorInfo("b", tensorF64, alignUp(8*(1<<60-1), 32), 1<<60-1).b, "overflows"},
		{"truncated tensor info", header(3, 1, 0).str("a").u32(2).u64(4).b, "truncated"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Read(bytes.NewReader(tt.file))
			require.Equal(t, status.InvalidArg, status.Of(err), "err = %v", err)
			require.ErrorContains(t, err, tt.want)
		})
	}
}

// Every proper prefix of a valid file is an error, never a panic or a partial File.
func TestReadTruncated(t *testing.T) {
	data := header(3, 2, 4).
		str("general.architecture").u32(uint32(TypeString)).str("llama").
		str("tokens").u32(uint32(TypeArray)).u32(uint32(TypeString)).u64(3).str("a").str("bc").str("").
		str("types").u32(uint32(TypeArray)).u32(uint32(TypeInt32)).u64(3).u32(1).u32(3).u32(1).
		kvU32("general.alignment", 32).
		tensorInfo("token_embd.weight", TensorF16, 0, 4, 3).
		tensorInfo("output_norm.weight", TensorF32, 32, 4).b
	data = append(data, make([]byte, alignUp(uint64(len(data)), 32)-uint64(len(data)))...)
	f, err := Read(bytes.NewReader(data))
	require.NoError(t, err)
	for n := range int(f.DataOffset) {
		// Read stops after the tensor directory: only the padding after it may be cut.
		if _, err := Read(bytes.NewReader(data[:n])); err == nil {
			require.True(t, allZero(data[n:f.DataOffset]), "prefix of %d bytes parsed", n)
		}
	}
}

func allZero(b []byte) bool { return bytes.Count(b, []byte{0}) == len(b) }

func TestHeaderLimit(t *testing.T) {
	// Each string is within the limit on its own; the header as a whole is not.
	const first = MaxHeaderBytes - 100
	r := io.MultiReader(
		bytes.NewReader(header(3, 0, 2).str("a").u32(uint32(TypeString)).u64(first).b),
		io.LimitReader(zeros{}, first),
		bytes.NewReader((&craft{}).str("b").u32(uint32(TypeString)).u64(1000).b),
		zeros{})
	_, err := Read(r)
	require.Equal(t, status.InvalidArg, status.Of(err), "err = %v", err)
	require.ErrorContains(t, err, "header longer")
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }

const tensorF64 TensorType = 28
