package kvsub

import (
	"encoding/hex"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/kvevents"
)

func u64(v uint64) *uint64 { return &v }

// Both of vLLM's event encodings decode to the same batch.
func TestDecodeBothEncodings(t *testing.T) {
	b := kvevents.Batch{TS: 12.25, Events: []kvevents.Event{
		{Tag: kvevents.TagStored, Hashes: []uint64{1, 1<<64 - 1}, Tokens: []int32{5, 70000}, BlockSize: 1, Medium: "CPU"},
		{Tag: kvevents.TagStored, Hashes: []uint64{3}, Parent: u64(1<<64 - 1), Tokens: []int32{0}, BlockSize: 1, Medium: "CPU"},
		{Tag: kvevents.TagRemoved, Hashes: []uint64{3}, Medium: "CPU"},
		{Tag: kvevents.TagCleared},
	}}
	want := &Batch{TS: 12.25, Rank: new(int64), Events: []Event{
		{Tag: "BlockStored", Hashes: []uint64{1, 1<<64 - 1}, Tokens: []uint32{5, 70000}, BlockSize: 1, Medium: "CPU"},
		{Tag: "BlockStored", Hashes: []uint64{3}, Parent: u64(1<<64 - 1), Tokens: []uint32{0}, BlockSize: 1, Medium: "CPU"},
		{Tag: "BlockRemoved", Hashes: []uint64{3}, Medium: "CPU"},
		{Tag: "AllBlocksCleared"},
	}}
	for _, m := range []bool{false, true} {
		p, err := kvevents.Encode(&b, m)
		require.NoError(t, err)
		got, err := Decode(p)
		require.NoError(t, err, "map %v", m)
		require.Equal(t, want, got, "map %v", m)
	}
}

// The first vLLM releases sent [ts, events] and five-field BlockStored
// arrays; newer ones append fields. Both decode.
func TestDecodeShorterAndLongerForms(t *testing.T) {
	// [1.0, [["BlockStored", [7], nil, [1, 2], 2, nil], ["BlockRemoved", [7]]]]
	old, err := hex.DecodeString("92cb3ff0000000000000" + "92" + "96ab426c6f636b53746f726564" + "9107" + "c0" + "920102" + "02" + "c0" +
		"92ac426c6f636b52656d6f766564" + "9107")
	require.NoError(t, err)
	got, err := Decode(old)
	require.NoError(t, err)
	require.Nil(t, got.Rank)
	require.Equal(t, []Event{{Tag: "BlockStored", Hashes: []uint64{7}, Tokens: []uint32{1, 2}, BlockSize: 2}, {Tag: "BlockRemoved", Hashes: []uint64{7}}}, got.Events)
	// ["AllBlocksCleared", "extension"] in a batch with a rank of 3.
	newer, err := hex.DecodeString("93cb3ff0000000000000" + "91" + "92b0416c6c426c6f636b73436c6561726564a9657874656e73696f6e" + "03")
	require.NoError(t, err)
	got, err = Decode(newer)
	require.NoError(t, err)
	require.Equal(t, int64(3), *got.Rank)
	require.Equal(t, []Event{{Tag: "AllBlocksCleared"}}, got.Events)
}

func TestDecodeRejects(t *testing.T) {
	for name, h := range map[string]string{
		"not msgpack":        "c1",
		"not an array":       "a3616263",
		"no events":          "91cb3ff0000000000000",
		"string ts":          "92a13190",
		"unknown tag":        "92cb3ff00000000000009191a3466f6f",
		"tokens short":       "92cb3ff00000000000009196ab426c6f636b53746f726564910790c00102c0",
		"string hash":        "92cb3ff00000000000009192ac426c6f636b52656d6f76656491a178",
		"map without a type": "92cb3ff00000000000009181a178a179",
	} {
		b, err := hex.DecodeString(h)
		require.NoError(t, err, name)
		_, err = Decode(b)
		require.Error(t, err, name)
	}
}

// FuzzDecode: any payload decodes or fails cleanly, and what decodes
// survives a trip through the publisher's encoder unchanged.
func FuzzDecode(f *testing.F) {
	for _, m := range []bool{false, true} {
		p, err := kvevents.Encode(&kvevents.Batch{TS: 1, Events: []kvevents.Event{
			{Tag: kvevents.TagStored, Hashes: []uint64{1, 2}, Parent: u64(9), Tokens: []int32{1, 2, 3, 4}, BlockSize: 2, Medium: "CPU"},
			{Tag: kvevents.TagRemoved, Hashes: []uint64{1}, Medium: "DISK"},
			{Tag: kvevents.TagCleared},
		}}, m)
		require.NoError(f, err)
		f.Add(p)
	}
	f.Fuzz(func(t *testing.T, payload []byte) {
		b, err := Decode(payload)
		if err != nil {
			return
		}
		back := kvevents.Batch{TS: b.TS}
		for _, e := range b.Events {
			ev := kvevents.Event{Tag: e.Tag, Hashes: e.Hashes, Parent: e.Parent, BlockSize: e.BlockSize, Medium: e.Medium}
			for _, tk := range e.Tokens {
				if tk > math.MaxInt32 {
					return // beyond what a llama.cpp token id can be
				}
				ev.Tokens = append(ev.Tokens, int32(tk))
			}
			back.Events = append(back.Events, ev)
		}
		if b.Rank != nil {
			back.Rank = int(*b.Rank)
		} else {
			b.Rank = new(int64) // the publisher always stamps a rank
		}
		for _, m := range []bool{false, true} {
			p, err := kvevents.Encode(&back, m)
			require.NoError(t, err)
			again, err := Decode(p)
			require.NoError(t, err)
			if int64(back.Rank) != *b.Rank {
				return // a rank past int
			}
			require.Equal(t, b, again, "map %v", m)
		}
	})
}
