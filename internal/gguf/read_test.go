package gguf

import (
	"bytes"
	"io"
	"math"
	"strings"
	"testing"

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
			if err != nil {
				t.Fatal(err)
			}
			v, ok := f.Lookup("k")
			if !ok {
				t.Fatal("key missing")
			}
			if u, ok := v.Uint(); u != tt.uint || ok != tt.uintOK {
				t.Errorf("Uint = %d, %v", u, ok)
			}
			if i, ok := v.Int(); i != tt.int || ok != tt.intOK {
				t.Errorf("Int = %d, %v", i, ok)
			}
			if x, ok := v.Float(); x != tt.float || ok != tt.floatOK {
				t.Errorf("Float = %g, %v", x, ok)
			}
			if s, ok := v.Str(); s != tt.str || ok != (tt.str != "") {
				t.Errorf("Str = %q, %v", s, ok)
			}
			if _, ok := v.Strings(); ok {
				t.Error("a scalar passed as a string array")
			}
			if _, ok := v.Ints(); ok {
				t.Error("a scalar passed as an integer array")
			}
			if v.String() != tt.text || v.Len() != 1 {
				t.Errorf("String = %s, Len = %d", v, v.Len())
			}
		})
	}
}

func TestArrays(t *testing.T) {
	f, err := Read(bytes.NewReader(header(3, 0, 4).
		str("strs").u32(uint32(TypeArray)).u32(uint32(TypeString)).u64(5).str("a").str("").str("c").str("d").str("e").
		str("i16").u32(uint32(TypeArray)).u32(uint32(TypeInt16)).u64(2).raw(0xff, 0xff, 1, 0).
		str("u64").u32(uint32(TypeArray)).u32(uint32(TypeUint64)).u64(1).u64(math.MaxUint64).
		str("empty").u32(uint32(TypeArray)).u32(uint32(TypeFloat32)).u64(0).b))
	if err != nil {
		t.Fatal(err)
	}
	strs, _ := f.Lookup("strs")
	if s, ok := strs.Strings(); !ok || strings.Join(s, ",") != "a,,c,d,e" || strs.Len() != 5 || strs.Elem() != TypeString {
		t.Errorf("strings %v %v", s, ok)
	}
	if got := strs.String(); got != `[str x 5: "a" "" "c" "d" ...]` {
		t.Errorf("String = %s", got)
	}
	i16, _ := f.Lookup("i16")
	if v, ok := i16.Ints(); !ok || len(v) != 2 || v[0] != -1 || v[1] != 1 {
		t.Errorf("Ints = %v, %v", v, ok)
	}
	if _, ok := i16.Uint(); ok {
		t.Error("an array passed as a scalar")
	}
	u64, _ := f.Lookup("u64")
	if _, ok := u64.Ints(); ok {
		t.Error("u64 above MaxInt64 passed as int64")
	}
	empty, _ := f.Lookup("empty")
	if empty.Len() != 0 || empty.Type() != TypeArray || empty.String() != "[f32 x 0:]" {
		t.Errorf("empty array: %s", empty)
	}
	if !Int32s(nil).Equal(Value{typ: TypeArray, elem: TypeInt32}) || Int32s([]int32{1}).Equal(Int32s([]int32{2})) {
		t.Error("Equal")
	}
}

func TestReadTensors(t *testing.T) {
	// A q4_0 tensor of 64x2 (4 blocks of 18 bytes = 72, padded to 96), then an f32.
	file := header(3, 2, 1).kvU32("general.alignment", 32).
		tensorInfo("a", 2, 0, 64, 2).
		tensorInfo("b", TensorF32, 96, 3).b
	f, err := Read(bytes.NewReader(file))
	if err != nil {
		t.Fatal(err)
	}
	if f.DataOffset != alignUp(uint64(len(file)), 32) || f.DataSize != 96+32 {
		t.Errorf("data at %d size %d", f.DataOffset, f.DataSize)
	}
	if a := f.Tensors[0]; a.Size != 72 || a.Type.String() != "q4_0" || len(a.Shape) != 2 {
		t.Errorf("tensor a: %+v", a)
	}
	if TensorType(4).String() != "ggml_type(4)" || Type(99).String() != "type(99)" {
		t.Error("names of unknown types")
	}
	// Alignment 64 moves both the data section and the second offset.
	file = header(3, 2, 1).kvU32("general.alignment", 64).
		tensorInfo("a", 2, 0, 64, 2).
		tensorInfo("b", TensorF32, 128, 3).b
	if f, err = Read(bytes.NewReader(file)); err != nil || f.DataOffset%64 != 0 || f.Alignment != 64 || f.DataSize != 128+64 {
		t.Errorf("alignment 64: %v %+v", err, f)
	}
	// Zero-element tensors are legal, whatever their other dimensions.
	file = header(3, 1, 0).tensorInfo("z", TensorF16, 0, 0, 1<<62, 1<<62).b
	if f, err = Read(bytes.NewReader(file)); err != nil || f.Tensors[0].Size != 0 {
		t.Errorf("empty tensor: %v", err)
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
			if status.Of(err) != status.InvalidArg || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want InvalidArg containing %q", err, tt.want)
			}
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
	if err != nil {
		t.Fatal(err)
	}
	for n := range int(f.DataOffset) {
		// Read stops after the tensor directory: only the padding after it may be cut.
		if _, err := Read(bytes.NewReader(data[:n])); err == nil && !allZero(data[n:f.DataOffset]) {
			t.Fatalf("prefix of %d bytes parsed", n)
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
	if status.Of(err) != status.InvalidArg || !strings.Contains(err.Error(), "header longer") {
		t.Fatalf("err = %v", err)
	}
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }

const tensorF64 TensorType = 28
