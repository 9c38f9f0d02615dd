// Package kvevents publishes which KV blocks a process holds in the format
// vLLM defined for KV-aware routers (vllm/distributed/kv_events.py) and
// llm-d, NVIDIA Dynamo and Mooncake's Conductor read: a ZMQ PUB socket
// sending [topic, sequence number as u64 big-endian, msgpack KVEventBatch],
// and a ROUTER socket that replays buffered batches from a sequence number.
//
// A KVEventBatch is msgspec's encoding of
//
//	EventBatch(array_like=True, omit_defaults=True): ts float, events list, data_parallel_rank int|None = None
//	BlockStored(tag=True):  block_hashes list[int], parent_block_hash int|None, token_ids list[int],
//	                        block_size int, lora_id int|None, medium str|None, lora_name str|None
//	BlockRemoved(tag=True): block_hashes list[int], medium str|None
//	AllBlocksCleared(tag=True)
//
// The batch is always an array. Events are tagged arrays, the tag (the class
// name) first, as vLLM sends them with array_like=True ("array"), or tagged
// maps with the tag under "type", as vLLM sends them since it dropped
// array_like from events ("map"). msgspec omits trailing fields that hold
// their defaults (extra_keys, group_idx, ... of newer vLLM), and so does
// this encoder; fields without a default are always written, nil included.
package kvevents

import (
	"bytes"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/mcbridge/mcbridge/internal/status"
)

// Event tags: msgspec tags a tagged struct with its class name.
const (
	TagStored  = "BlockStored"
	TagRemoved = "BlockRemoved"
	TagCleared = "AllBlocksCleared"
)

// Event is one BlockStored, BlockRemoved or AllBlocksCleared.
type Event struct {
	Tag string
	// Hashes are the blocks' hashes (BlockStored, BlockRemoved).
	Hashes []uint64
	// Parent is the hash of the block before Hashes[0]; nil for a chain
	// that starts at position 0 (BlockStored).
	Parent *uint64
	// Tokens are the token ids of every block in Hashes, in order
	// (BlockStored).
	Tokens    []int32
	BlockSize int
	Medium    string
}

// Batch is one KVEventBatch: the events of one publishing step.
type Batch struct {
	TS     float64 // seconds since the epoch
	Events []Event
	// Rank is the data-parallel rank vLLM stamps on every batch (0 for an
	// engine without data parallelism).
	Rank int
}

// Encode writes b in msgspec's encoding; mapEvents selects tagged maps for
// the events instead of tagged arrays.
func Encode(b *Batch, mapEvents bool) ([]byte, error) {
	var buf bytes.Buffer
	e := msgpack.NewEncoder(&buf)
	err := firstErr(e.EncodeArrayLen(3), e.EncodeFloat64(b.TS), e.EncodeArrayLen(len(b.Events)))
	for i := range b.Events {
		if err != nil {
			break
		}
		err = encodeEvent(e, &b.Events[i], mapEvents)
	}
	if err == nil {
		err = e.EncodeInt(int64(b.Rank))
	}
	if err != nil {
		return nil, status.Wrap(status.Internal, err, "encoding a KV event batch")
	}
	return buf.Bytes(), nil
}

// field is one struct field: its name in the map form and how to write it.
type field struct {
	name  string
	write func(*msgpack.Encoder) error
}

func encodeEvent(e *msgpack.Encoder, ev *Event, mapEvents bool) error {
	var fields []field
	switch ev.Tag {
	case TagStored:
		fields = []field{
			{"block_hashes", func(e *msgpack.Encoder) error { return encodeHashes(e, ev.Hashes) }},
			{"parent_block_hash", func(e *msgpack.Encoder) error {
				if ev.Parent == nil {
					return e.EncodeNil()
				}
				return e.EncodeUint(*ev.Parent)
			}},
			{"token_ids", func(e *msgpack.Encoder) error {
				if err := e.EncodeArrayLen(len(ev.Tokens)); err != nil {
					return err
				}
				for _, t := range ev.Tokens {
					if err := e.EncodeInt(int64(t)); err != nil {
						return err
					}
				}
				return nil
			}},
			{"block_size", func(e *msgpack.Encoder) error { return e.EncodeInt(int64(ev.BlockSize)) }},
			// Adapters are not announced (docs/kvevents.md), so there is no
			// LoRA to name.
			{"lora_id", (*msgpack.Encoder).EncodeNil},
			{"medium", func(e *msgpack.Encoder) error { return e.EncodeString(ev.Medium) }},
			{"lora_name", (*msgpack.Encoder).EncodeNil},
		}
	case TagRemoved:
		fields = []field{
			{"block_hashes", func(e *msgpack.Encoder) error { return encodeHashes(e, ev.Hashes) }},
			{"medium", func(e *msgpack.Encoder) error { return e.EncodeString(ev.Medium) }},
		}
	case TagCleared:
	default:
		return status.Errorf(status.Internal, "KV event tag %q", ev.Tag)
	}
	if mapEvents {
		if err := firstErr(e.EncodeMapLen(1+len(fields)), e.EncodeString("type"), e.EncodeString(ev.Tag)); err != nil {
			return err
		}
	} else if err := firstErr(e.EncodeArrayLen(1+len(fields)), e.EncodeString(ev.Tag)); err != nil {
		return err
	}
	for _, f := range fields {
		if mapEvents {
			if err := e.EncodeString(f.name); err != nil {
				return err
			}
		}
		if err := f.write(e); err != nil {
			return err
		}
	}
	return nil
}

func encodeHashes(e *msgpack.Encoder, hs []uint64) error {
	if err := e.EncodeArrayLen(len(hs)); err != nil {
		return err
	}
	for _, h := range hs {
		if err := e.EncodeUint(h); err != nil {
			return err
		}
	}
	return nil
}

func firstErr(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}
