package kvevents

import (
	"encoding/hex"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func u64(v uint64) *uint64 { return &v }

// goldenBatch exercises every field: a chain of two blocks of one token
// with a hash past int64, a removal and a clear.
var goldenBatch = Batch{TS: 1.5, Events: []Event{
	{Tag: TagStored, Hashes: []uint64{1, 1<<63 + 5}, Tokens: []int32{1, 300}, BlockSize: 1, Medium: "CPU"},
	{Tag: TagStored, Hashes: []uint64{9}, Parent: u64(1<<63 + 5), Tokens: []int32{2}, BlockSize: 1, Medium: "CPU"},
	{Tag: TagRemoved, Hashes: []uint64{7}, Medium: "CPU"},
	{Tag: TagCleared},
}}

// str is msgpack's fixstr of s, as hex.
func str(s string) string {
	return hex.EncodeToString([]byte{0xa0 | byte(len(s))}) + hex.EncodeToString([]byte(s))
}

func join(parts ...string) string { return strings.Join(parts, "") }

// The expected bytes are written from the msgpack spec and msgspec's rules
// for vLLM's structs (the smallest integer form, floats as float64, nil for
// None, fields without defaults always present), not from the encoder.
func TestEncodeArrayGolden(t *testing.T) {
	want := join(
		"93", "cb3ff8000000000000", "94", // [ts=1.5, [4 events], ...
		"98", str("BlockStored"), "92", "01", "cf8000000000000005", "c0", "92", "01", "cd012c", "01", "c0", str("CPU"), "c0",
		"98", str("BlockStored"), "91", "09", "cf8000000000000005", "91", "02", "01", "c0", str("CPU"), "c0",
		"93", str("BlockRemoved"), "91", "07", str("CPU"),
		"91", str("AllBlocksCleared"),
		"00", // data_parallel_rank 0
	)
	got, err := Encode(&goldenBatch, false)
	require.NoError(t, err)
	require.Equal(t, want, hex.EncodeToString(got))
}

func TestEncodeMapGolden(t *testing.T) {
	want := join(
		"93", "cb3ff8000000000000", "94",
		"88", str("type"), str("BlockStored"), str("block_hashes"), "92", "01", "cf8000000000000005",
		"b1", hex.EncodeToString([]byte("parent_block_hash")), "c0", str("token_ids"), "92", "01", "cd012c",
		str("block_size"), "01", str("lora_id"), "c0", str("medium"), str("CPU"), str("lora_name"), "c0",
		"88", str("type"), str("BlockStored"), str("block_hashes"), "91", "09",
		"b1", hex.EncodeToString([]byte("parent_block_hash")), "cf8000000000000005", str("token_ids"), "91", "02",
		str("block_size"), "01", str("lora_id"), "c0", str("medium"), str("CPU"), str("lora_name"), "c0",
		"83", str("type"), str("BlockRemoved"), str("block_hashes"), "91", "07", str("medium"), str("CPU"),
		"81", str("type"), str("AllBlocksCleared"),
		"00",
	)
	got, err := Encode(&goldenBatch, true)
	require.NoError(t, err)
	require.Equal(t, want, hex.EncodeToString(got))
}

func TestEncodeRefusesUnknownTags(t *testing.T) {
	_, err := Encode(&Batch{Events: []Event{{Tag: "BlockMoved"}}}, false)
	require.ErrorContains(t, err, "BlockMoved")
}
