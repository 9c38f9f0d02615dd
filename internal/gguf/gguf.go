// Package gguf writes llama-architecture GGUF models with random weights, for tests
// and benchmarks that need a model llama.cpp loads (no model can be downloaded here),
// and reads the metadata and tensor directory of any GGUF file.
//
// The format is GGUF v3 as read by ggml/src/gguf.cpp in the pinned llama.cpp
// (internal/llamapin/PIN): little-endian header, metadata key/value pairs, tensor infos,
// then the tensor data, each tensor starting at a multiple of the alignment.
package gguf

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"strings"
)

// Magic opens every GGUF file.
const Magic = "GGUF"

// Version is the GGUF version this package writes.
const Version = 3

// DefaultAlignment applies when general.alignment is absent.
const DefaultAlignment = 32

// maxNameLen is GGML_MAX_NAME: a tensor name must be shorter.
const maxNameLen = 64

// maxDims is GGML_MAX_DIMS.
const maxDims = 4

// Type is the type of a metadata value (enum gguf_type).
type Type uint32

// Metadata value types. The values are the file format's.
const (
	TypeUint8 Type = iota
	TypeInt8
	TypeUint16
	TypeInt16
	TypeUint32
	TypeInt32
	TypeFloat32
	TypeBool
	TypeString
	TypeArray
	TypeUint64
	TypeInt64
	TypeFloat64
	typeCount
)

var typeNames = [typeCount]string{"u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "str", "arr", "u64", "i64", "f64"}

func (t Type) String() string {
	if t < typeCount {
		return typeNames[t]
	}
	return fmt.Sprintf("type(%d)", uint32(t))
}

// size is the encoded size of a fixed-size type, 0 for strings and arrays.
func (t Type) size() int {
	switch t {
	case TypeUint8, TypeInt8, TypeBool:
		return 1
	case TypeUint16, TypeInt16:
		return 2
	case TypeUint32, TypeInt32, TypeFloat32:
		return 4
	case TypeUint64, TypeInt64, TypeFloat64:
		return 8
	}
	return 0
}

func (t Type) signed() bool {
	return t == TypeInt8 || t == TypeInt16 || t == TypeInt32 || t == TypeInt64
}

// Value is a metadata value: a scalar or a flat array (GGUF has no nested arrays).
// Fixed-size values keep their little-endian bytes as in the file, so a value costs
// memory in proportion to the bytes it was read from.
type Value struct {
	typ  Type
	elem Type     // element type of an array
	n    uint64   // element count of an array
	raw  []byte   // fixed-size scalar or array elements
	strs []string // string scalar (one element) or string array
}

// KV is one metadata entry.
type KV struct {
	Key   string
	Value Value
}

// String returns a string value.
func String(s string) Value { return Value{typ: TypeString, strs: []string{s}} }

// Uint32 returns a u32 value.
func Uint32(v uint32) Value {
	return Value{typ: TypeUint32, raw: binary.LittleEndian.AppendUint32(nil, v)}
}

// Float32 returns an f32 value.
func Float32(v float32) Value {
	return Value{typ: TypeFloat32, raw: binary.LittleEndian.AppendUint32(nil, math.Float32bits(v))}
}

// Bool returns a bool value.
func Bool(v bool) Value {
	b := byte(0)
	if v {
		b = 1
	}
	return Value{typ: TypeBool, raw: []byte{b}}
}

// Strings returns an array of strings.
func Strings(s []string) Value {
	return Value{typ: TypeArray, elem: TypeString, n: uint64(len(s)), strs: slices.Clone(s)}
}

// Int32s returns an array of i32.
func Int32s(v []int32) Value {
	var raw []byte
	for _, x := range v {
		raw = binary.LittleEndian.AppendUint32(raw, uint32(x))
	}
	return Value{typ: TypeArray, elem: TypeInt32, n: uint64(len(v)), raw: raw}
}

// Type is the value's type; TypeArray for arrays.
func (v Value) Type() Type { return v.typ }

// Elem is the element type of an array.
func (v Value) Elem() Type { return v.elem }

// Len is the number of elements of an array, 1 for a scalar.
func (v Value) Len() uint64 {
	if v.typ == TypeArray {
		return v.n
	}
	return 1
}

// Equal reports whether two values have the same type and contents.
func (v Value) Equal(o Value) bool {
	return v.typ == o.typ && v.elem == o.elem && v.n == o.n &&
		slices.Equal(v.raw, o.raw) && slices.Equal(v.strs, o.strs)
}

// elemBits decodes a fixed-size element at index i of raw, sign-extending signed types.
func elemBits(t Type, raw []byte, i int) uint64 {
	switch sz := t.size(); sz {
	case 1:
		if t.signed() {
			return uint64(int64(int8(raw[i])))
		}
		return uint64(raw[i])
	case 2:
		u := binary.LittleEndian.Uint16(raw[2*i:])
		if t.signed() {
			return uint64(int64(int16(u)))
		}
		return uint64(u)
	case 4:
		u := binary.LittleEndian.Uint32(raw[4*i:])
		if t.signed() {
			return uint64(int64(int32(u)))
		}
		return uint64(u)
	default:
		return binary.LittleEndian.Uint64(raw[8*i:])
	}
}

func isInteger(t Type) bool {
	return t.size() > 0 && t != TypeBool && t != TypeFloat32 && t != TypeFloat64
}

// Uint returns an integer scalar that is not negative.
func (v Value) Uint() (uint64, bool) {
	if !isInteger(v.typ) {
		return 0, false
	}
	u := elemBits(v.typ, v.raw, 0)
	if v.typ.signed() && int64(u) < 0 {
		return 0, false
	}
	return u, true
}

// Int returns an integer scalar that fits an int64.
func (v Value) Int() (int64, bool) {
	if !isInteger(v.typ) {
		return 0, false
	}
	u := elemBits(v.typ, v.raw, 0)
	if v.typ == TypeUint64 && u > math.MaxInt64 {
		return 0, false
	}
	return int64(u), true
}

// Float returns an f32 or f64 scalar.
func (v Value) Float() (float64, bool) {
	switch v.typ {
	case TypeFloat32:
		return float64(math.Float32frombits(binary.LittleEndian.Uint32(v.raw))), true
	case TypeFloat64:
		return math.Float64frombits(binary.LittleEndian.Uint64(v.raw)), true
	}
	return 0, false
}

// Bool returns a bool scalar; like llama.cpp, any non-zero byte is true.
func (v Value) Bool() (bool, bool) {
	if v.typ != TypeBool {
		return false, false
	}
	return v.raw[0] != 0, true
}

// Str returns a string scalar.
func (v Value) Str() (string, bool) {
	if v.typ != TypeString {
		return "", false
	}
	return v.strs[0], true
}

// Strings returns the elements of a string array.
func (v Value) Strings() ([]string, bool) {
	if v.typ != TypeArray || v.elem != TypeString {
		return nil, false
	}
	return slices.Clone(v.strs), true
}

// Ints returns the elements of an integer array; u64 elements above MaxInt64 fail.
func (v Value) Ints() ([]int64, bool) {
	if v.typ != TypeArray || !isInteger(v.elem) {
		return nil, false
	}
	out := make([]int64, v.n)
	for i := range out {
		u := elemBits(v.elem, v.raw, i)
		if v.elem == TypeUint64 && u > math.MaxInt64 {
			return nil, false
		}
		out[i] = int64(u)
	}
	return out, true
}

// String formats the value for humans; arrays show their first elements only.
func (v Value) String() string {
	if v.typ != TypeArray {
		return v.scalarString(0)
	}
	const show = 4
	var b strings.Builder
	fmt.Fprintf(&b, "[%s x %d:", v.elem, v.n)
	elem := Value{typ: v.elem, raw: v.raw, strs: v.strs}
	for i := 0; i < int(min(v.n, show)); i++ {
		b.WriteString(" " + elem.scalarString(i))
	}
	if v.n > show {
		b.WriteString(" ...")
	}
	b.WriteString("]")
	return b.String()
}

func (v Value) scalarString(i int) string {
	switch {
	case v.typ == TypeString:
		return fmt.Sprintf("%q", v.strs[i])
	case v.typ == TypeBool:
		return fmt.Sprint(v.raw[i] != 0)
	case v.typ == TypeFloat32:
		return fmt.Sprint(math.Float32frombits(binary.LittleEndian.Uint32(v.raw[4*i:])))
	case v.typ == TypeFloat64:
		return fmt.Sprint(math.Float64frombits(binary.LittleEndian.Uint64(v.raw[8*i:])))
	case v.typ.signed():
		return fmt.Sprint(int64(elemBits(v.typ, v.raw, i)))
	}
	return fmt.Sprint(elemBits(v.typ, v.raw, i))
}

// TensorType is a ggml tensor type (enum ggml_type).
type TensorType uint32

// The tensor types this package writes; Read accepts every type of the pinned ggml.
const (
	TensorF32 TensorType = 0
	TensorF16 TensorType = 1
)

type tensorTypeInfo struct {
	name      string
	blockSize uint64 // elements per block
	typeSize  uint64 // bytes per block
}

// tensorTypes is ggml_type_name, ggml_blck_size and ggml_type_size for every type
// of the pinned ggml (printed from its libggml-base); gaps are removed types.
var tensorTypes = map[TensorType]tensorTypeInfo{
	0: {"f32", 1, 4}, 1: {"f16", 1, 2}, 2: {"q4_0", 32, 18}, 3: {"q4_1", 32, 20},
	6: {"q5_0", 32, 22}, 7: {"q5_1", 32, 24}, 8: {"q8_0", 32, 34}, 9: {"q8_1", 32, 36},
	10: {"q2_K", 256, 84}, 11: {"q3_K", 256, 110}, 12: {"q4_K", 256, 144}, 13: {"q5_K", 256, 176},
	14: {"q6_K", 256, 210}, 15: {"q8_K", 256, 292}, 16: {"iq2_xxs", 256, 66}, 17: {"iq2_xs", 256, 74},
	18: {"iq3_xxs", 256, 98}, 19: {"iq1_s", 256, 50}, 20: {"iq4_nl", 32, 18}, 21: {"iq3_s", 256, 110},
	22: {"iq2_s", 256, 82}, 23: {"iq4_xs", 256, 136}, 24: {"i8", 1, 1}, 25: {"i16", 1, 2},
	26: {"i32", 1, 4}, 27: {"i64", 1, 8}, 28: {"f64", 1, 8}, 29: {"iq1_m", 256, 56},
	30: {"bf16", 1, 2}, 34: {"tq1_0", 256, 54}, 35: {"tq2_0", 256, 66}, 39: {"mxfp4", 32, 17},
	40: {"nvfp4", 64, 36}, 41: {"q1_0", 128, 18}, 42: {"q2_0", 64, 18},
}

func (t TensorType) String() string {
	if info, ok := tensorTypes[t]; ok {
		return info.name
	}
	return fmt.Sprintf("ggml_type(%d)", uint32(t))
}

// TensorInfo is one entry of the tensor directory.
type TensorInfo struct {
	Name   string
	Type   TensorType
	Shape  []uint64 // ne[0] (the contiguous dimension) first
	Offset uint64   // from the start of the data section
	Size   uint64   // bytes of data, without padding
}

// File is what Read returns: everything before the tensor data.
type File struct {
	Version    uint32
	Metadata   []KV // in file order
	Tensors    []TensorInfo
	Alignment  uint64
	DataOffset uint64 // file offset of the data section
	DataSize   uint64 // bytes of the data section, padding between tensors included
}

// Lookup returns the value of a metadata key.
func (f *File) Lookup(key string) (Value, bool) {
	for _, kv := range f.Metadata {
		if kv.Key == key {
			return kv.Value, true
		}
	}
	return Value{}, false
}

func alignUp(n, align uint64) uint64 { return (n + align - 1) &^ (align - 1) }
