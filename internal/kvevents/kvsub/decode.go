// Package kvsub is a KV events consumer written from vLLM's published
// format, independent of the publisher's encoder: it decodes payloads
// generically, reads events as tagged arrays or tagged maps, recomputes
// every stored block's hash from its tokens by Mooncake's standard
// (XXH3-64 rolling, little-endian u32 tokens) and ranks the publishers that
// hold a prompt's prefix, as llm-d's indexer and Dynamo's router do. It
// recovers from sequence gaps through the replay socket. The tests use it
// as the router a real deployment would run.
package kvsub

import (
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
)

// Event is one decoded event.
type Event struct {
	Tag       string // BlockStored, BlockRemoved, AllBlocksCleared
	Hashes    []uint64
	Parent    *uint64
	Tokens    []uint32
	BlockSize int
	Medium    string
}

// Batch is one decoded KVEventBatch.
type Batch struct {
	TS     float64
	Events []Event
	Rank   *int64
}

// Decode reads a KVEventBatch: [ts, [event...], data_parallel_rank?], each
// event a tagged array [tag, fields...] or a tagged map {"type": tag, ...}.
// Fields a newer publisher appends are ignored, as msgspec ignores them.
func Decode(payload []byte) (*Batch, error) {
	var v any
	if err := msgpack.Unmarshal(payload, &v); err != nil {
		return nil, fmt.Errorf("payload: %w", err)
	}
	arr, ok := v.([]any)
	if !ok || len(arr) < 2 {
		return nil, fmt.Errorf("batch is %T of %d, not [ts, events, ...]", v, lenOf(v))
	}
	b := &Batch{}
	switch ts := arr[0].(type) {
	case float64:
		b.TS = ts
	case float32:
		b.TS = float64(ts)
	default:
		return nil, fmt.Errorf("batch ts is %T", arr[0])
	}
	if len(arr) > 2 && arr[2] != nil {
		r, err := integer(arr[2])
		if err != nil {
			return nil, fmt.Errorf("data_parallel_rank: %w", err)
		}
		b.Rank = &r
	}
	evs, ok := arr[1].([]any)
	if !ok {
		return nil, fmt.Errorf("batch events is %T", arr[1])
	}
	for i, raw := range evs {
		ev, err := decodeEvent(raw)
		if err != nil {
			return nil, fmt.Errorf("event %d: %w", i, err)
		}
		b.Events = append(b.Events, ev)
	}
	return b, nil
}

// positions of each event's fields after the tag, in vLLM's declaration
// order.
var fieldOrder = map[string][]string{
	"BlockStored":      {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"},
	"BlockRemoved":     {"block_hashes", "medium"},
	"AllBlocksCleared": {},
}

func decodeEvent(raw any) (Event, error) {
	fields := map[string]any{}
	var tag string
	switch v := raw.(type) {
	case []any:
		if len(v) == 0 {
			return Event{}, fmt.Errorf("empty tagged array")
		}
		t, ok := v[0].(string)
		if !ok {
			return Event{}, fmt.Errorf("tag is %T", v[0])
		}
		tag = t
		order, ok := fieldOrder[tag]
		if !ok {
			return Event{}, fmt.Errorf("unknown tag %q", tag)
		}
		for i, name := range order {
			if i+1 < len(v) {
				fields[name] = v[i+1]
			}
		}
	case map[string]any:
		t, ok := v["type"].(string)
		if !ok {
			return Event{}, fmt.Errorf("tagged map without a string type")
		}
		tag = t
		if _, ok := fieldOrder[tag]; !ok {
			return Event{}, fmt.Errorf("unknown tag %q", tag)
		}
		fields = v
	default:
		return Event{}, fmt.Errorf("event is %T", raw)
	}
	ev := Event{Tag: tag}
	if tag == "AllBlocksCleared" {
		return ev, nil
	}
	hs, err := integers(fields["block_hashes"])
	if err != nil {
		return ev, fmt.Errorf("block_hashes: %w", err)
	}
	for _, h := range hs {
		ev.Hashes = append(ev.Hashes, uint64(h))
	}
	if m, ok := fields["medium"].(string); ok {
		ev.Medium = m
	}
	if tag == "BlockRemoved" {
		return ev, nil
	}
	if p := fields["parent_block_hash"]; p != nil {
		h, err := integer(p)
		if err != nil {
			return ev, fmt.Errorf("parent_block_hash: %w", err)
		}
		u := uint64(h)
		ev.Parent = &u
	}
	toks, err := integers(fields["token_ids"])
	if err != nil {
		return ev, fmt.Errorf("token_ids: %w", err)
	}
	for _, t := range toks {
		if t < 0 || t > 1<<32-1 {
			return ev, fmt.Errorf("token id %d", t)
		}
		ev.Tokens = append(ev.Tokens, uint32(t))
	}
	bs, err := integer(fields["block_size"])
	if err != nil {
		return ev, fmt.Errorf("block_size: %w", err)
	}
	if bs <= 0 || len(ev.Tokens) != int(bs)*len(ev.Hashes) {
		return ev, fmt.Errorf("%d tokens for %d blocks of %d", len(ev.Tokens), len(ev.Hashes), bs)
	}
	ev.BlockSize = int(bs)
	return ev, nil
}

// integer reads any msgpack integer; a uint64 past int64 keeps its bits,
// as block hashes do.
func integer(v any) (int64, error) {
	switch n := v.(type) {
	case int8:
		return int64(n), nil
	case int16:
		return int64(n), nil
	case int32:
		return int64(n), nil
	case int64:
		return n, nil
	case uint8:
		return int64(n), nil
	case uint16:
		return int64(n), nil
	case uint32:
		return int64(n), nil
	case uint64:
		return int64(n), nil
	}
	return 0, fmt.Errorf("%T is not an integer", v)
}

func integers(v any) ([]int64, error) {
	arr, ok := v.([]any)
	if !ok {
		return nil, fmt.Errorf("%T is not a list", v)
	}
	out := make([]int64, len(arr))
	for i, x := range arr {
		n, err := integer(x)
		if err != nil {
			return nil, err
		}
		out[i] = n
	}
	return out, nil
}

func lenOf(v any) int {
	if a, ok := v.([]any); ok {
		return len(a)
	}
	return 0
}
