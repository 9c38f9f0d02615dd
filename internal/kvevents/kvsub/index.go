package kvsub

import (
	"encoding/binary"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"

	"github.com/zeebo/xxh3"
)

// SeqHashes is Mooncake's standard rolling block hash, as a router computes
// it from a prompt: local = XXH3-64(block tokens as u32 LE, seed), seq[0] =
// local[0], seq[i] = XXH3-64(seq[i-1] LE || local[i] LE, seed).
func SeqHashes(tokens []uint32, blockSize int, seed uint64, parent *uint64) []uint64 {
	var out []uint64
	buf := make([]byte, 4*blockSize)
	prev, hasPrev := uint64(0), parent != nil
	if hasPrev {
		prev = *parent
	}
	for i := 0; i+blockSize <= len(tokens); i += blockSize {
		for j, t := range tokens[i : i+blockSize] {
			binary.LittleEndian.PutUint32(buf[4*j:], t)
		}
		h := xxh3.HashSeed(buf, seed)
		if hasPrev {
			var pair [16]byte
			binary.LittleEndian.PutUint64(pair[:8], prev)
			binary.LittleEndian.PutUint64(pair[8:], h)
			h = xxh3.HashSeed(pair[:], seed)
		}
		out = append(out, h)
		prev, hasPrev = h, true
	}
	return out
}

// Index is what the consumer knows: which pod holds which block, per
// model, from the topics kv@<pod>@<model>.
type Index struct {
	seed uint64

	mu     sync.Mutex
	blocks map[string]map[uint64]map[string]bool // model -> hash -> pods
	// Mismatches counts stored blocks whose hash is not the standard hash
	// of their tokens under their parent.
	mismatches int
	errors     []string
}

// NewIndex returns an empty index that checks hashes under seed.
func NewIndex(seed uint64) *Index {
	return &Index{seed: seed, blocks: map[string]map[uint64]map[string]bool{}}
}

// ParseTopic splits kv@<pod>@<model>.
func ParseTopic(topic string) (pod, model string, err error) {
	parts := strings.Split(topic, "@")
	if len(parts) != 3 || parts[0] != "kv" || parts[1] == "" || parts[2] == "" {
		return "", "", fmt.Errorf("topic %q is not kv@<pod>@<model>", topic)
	}
	return parts[1], parts[2], nil
}

// Apply digests one batch published on topic.
func (x *Index) Apply(topic string, b *Batch) error {
	pod, model, err := ParseTopic(topic)
	if err != nil {
		return err
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	m := x.blocks[model]
	if m == nil {
		m = map[uint64]map[string]bool{}
		x.blocks[model] = m
	}
	for _, ev := range b.Events {
		switch ev.Tag {
		case "BlockStored":
			if want := SeqHashes(ev.Tokens, ev.BlockSize, x.seed, ev.Parent); !slices.Equal(want, ev.Hashes) {
				x.mismatches++
				x.errors = append(x.errors, fmt.Sprintf("%s: stored hashes %x, tokens hash to %x", topic, ev.Hashes, want))
				continue
			}
			for _, h := range ev.Hashes {
				if m[h] == nil {
					m[h] = map[string]bool{}
				}
				m[h][pod] = true
			}
		case "BlockRemoved":
			for _, h := range ev.Hashes {
				delete(m[h], pod)
			}
		case "AllBlocksCleared":
			for _, pods := range m {
				delete(pods, pod)
			}
		}
	}
	return nil
}

// Score is a pod's match for a prompt: the blocks of its longest prefix
// the pod holds.
type Score struct {
	Pod    string
	Blocks int
}

// Rank orders the pods holding a prefix of tokens, longest first (ties by
// name), as a prefix-cache scorer does.
func (x *Index) Rank(model string, tokens []int32, blockSize int) []Score {
	ids := make([]uint32, len(tokens))
	for i, t := range tokens {
		ids[i] = uint32(t)
	}
	hs := SeqHashes(ids, blockSize, x.seed, nil)
	x.mu.Lock()
	defer x.mu.Unlock()
	got := map[string]int{}
	live := map[string]bool{}
	for i, h := range hs {
		pods := x.blocks[model][h]
		if i == 0 {
			for p := range pods {
				live[p] = true
			}
		}
		for p := range live {
			if pods[p] {
				got[p] = i + 1
			} else {
				delete(live, p)
			}
		}
	}
	var out []Score
	for p, n := range got {
		out = append(out, Score{Pod: p, Blocks: n})
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Blocks != out[j].Blocks {
			return out[i].Blocks > out[j].Blocks
		}
		return out[i].Pod < out[j].Pod
	})
	return out
}

// Held is how many blocks of model the index says pod holds.
func (x *Index) Held(model, pod string) int {
	x.mu.Lock()
	defer x.mu.Unlock()
	n := 0
	for _, pods := range x.blocks[model] {
		if pods[pod] {
			n++
		}
	}
	return n
}

// Mismatches returns the stored blocks whose hashes were wrong.
func (x *Index) Mismatches() (int, []string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.mismatches, append([]string(nil), x.errors...)
}
