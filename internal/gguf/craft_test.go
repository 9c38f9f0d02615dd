package gguf

import (
	"encoding/binary"
	"math"
)

// craft builds GGUF bytes field by field, for files the writer would never produce.
type craft struct{ b []byte }

func (c *craft) u32(v uint32) *craft  { c.b = binary.LittleEndian.AppendUint32(c.b, v); return c }
func (c *craft) u64(v uint64) *craft  { c.b = binary.LittleEndian.AppendUint64(c.b, v); return c }
func (c *craft) raw(b ...byte) *craft { c.b = append(c.b, b...); return c }
func (c *craft) str(s string) *craft  { c.u64(uint64(len(s))); c.b = append(c.b, s...); return c }

// header starts a file with the magic, a version and the counts.
func header(version uint32, nTensors, nKV uint64) *craft {
	c := &craft{b: []byte(Magic)}
	return c.u32(version).u64(nTensors).u64(nKV)
}

// kvU32 appends a u32 entry.
func (c *craft) kvU32(key string, v uint32) *craft {
	return c.str(key).u32(uint32(TypeUint32)).u32(v)
}

// tensorInfo appends a directory entry.
func (c *craft) tensorInfo(name string, typ TensorType, offset uint64, shape ...uint64) *craft {
	c.str(name).u32(uint32(len(shape)))
	for _, d := range shape {
		c.u64(d)
	}
	return c.u32(uint32(typ)).u64(offset)
}

// f16ToF32 decodes IEEE half precision.
func f16ToF32(h uint16) float32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1f
	mant := uint32(h & 0x3ff)
	switch {
	case exp == 0x1f:
		return math.Float32frombits(sign | 0x7f800000 | mant<<13)
	case exp == 0:
		v := float32(mant) / (1 << 24)
		if sign != 0 {
			v = -v
		}
		return v
	}
	return math.Float32frombits(sign | (exp+127-15)<<23 | mant<<13)
}
