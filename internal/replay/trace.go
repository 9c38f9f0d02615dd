package replay

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"os"
	"strconv"

	"github.com/mcbridge/mcbridge/internal/arbiter"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Request is one line of a Mooncake trace.
type Request struct {
	// Timestamp is when the request arrived, in milliseconds.
	Timestamp int64 `json:"timestamp"`
	// InputLength and OutputLength count tokens.
	InputLength  int `json:"input_length"`
	OutputLength int `json:"output_length"`
	// HashIDs names the prompt's blocks in order: equal ids are equal
	// blocks, and an id depends on every block before it, so requests that
	// share a prefix share a leading run of ids.
	HashIDs []int64 `json:"hash_ids"`
}

// Limits on a trace line. Beyond them a line describes no prompt that a
// llama.cpp context holds.
const (
	maxLineBytes = 16 << 20
	maxHashIDs   = 1 << 16
	maxHashID    = 1 << 53 // exact in the float64 of other tools' JSON
)

// ReadTrace parses a trace: one JSON object per line, blank lines skipped,
// fields other than Request's ignored. It checks each line on its own;
// Check compares the lines with each other.
func ReadTrace(r io.Reader) ([]Request, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), maxLineBytes)
	var out []Request
	for line := 1; sc.Scan(); line++ {
		b := bytes.TrimSpace(sc.Bytes())
		if len(b) == 0 {
			continue
		}
		var req Request
		if err := json.Unmarshal(b, &req); err != nil {
			return nil, status.Wrap(status.InvalidArg, err, lineMsg(line))
		}
		if err := req.validate(); err != nil {
			return nil, status.Wrap(status.InvalidArg, err, lineMsg(line))
		}
		out = append(out, req)
	}
	if err := sc.Err(); err != nil {
		return nil, status.Wrap(status.InvalidArg, err, "reading the trace")
	}
	return out, nil
}

// LoadTrace reads the trace file at path.
func LoadTrace(path string) ([]Request, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, status.Wrap(status.NotFound, err, "opening the trace")
	}
	defer f.Close()
	return ReadTrace(f)
}

func lineMsg(line int) string { return "trace line " + strconv.Itoa(line) }

func (r *Request) validate() error {
	switch {
	case r.Timestamp < 0:
		return status.Errorf(status.InvalidArg, "negative timestamp %d", r.Timestamp)
	case r.InputLength < 1 || r.InputLength > arbiter.MaxPromptTokens:
		return status.Errorf(status.InvalidArg, "input_length %d (1..%d)", r.InputLength, arbiter.MaxPromptTokens)
	case r.OutputLength < 0:
		return status.Errorf(status.InvalidArg, "negative output_length %d", r.OutputLength)
	case len(r.HashIDs) == 0 || len(r.HashIDs) > maxHashIDs:
		return status.Errorf(status.InvalidArg, "%d hash_ids (1..%d)", len(r.HashIDs), maxHashIDs)
	}
	for _, id := range r.HashIDs {
		if id < 0 || id >= maxHashID {
			return status.Errorf(status.InvalidArg, "hash id %d out of [0, 2^53)", id)
		}
	}
	return nil
}

// Check verifies that the trace fits blocks of blockTokens tokens (each
// request has exactly the ids its input length needs, the last one possibly
// partial) and that ids name whole prefixes: an id always follows the same
// id, or always comes first. The replay gives each id fixed tokens, so an
// id reached from two different prefixes would make unequal prompts share
// tokens and the hit ratio would mean nothing.
func Check(trace []Request, blockTokens int) error {
	if blockTokens < 1 {
		return status.Errorf(status.InvalidArg, "block of %d tokens", blockTokens)
	}
	const first = -1
	parent := map[int64]int64{}
	for i, r := range trace {
		if want := (r.InputLength + blockTokens - 1) / blockTokens; len(r.HashIDs) != want {
			return status.Errorf(status.InvalidArg, "request %d: %d tokens need %d ids of %d-token blocks, the trace has %d",
				i, r.InputLength, want, blockTokens, len(r.HashIDs))
		}
		prev := int64(first)
		for _, id := range r.HashIDs {
			if p, seen := parent[id]; !seen {
				parent[id] = prev
			} else if p != prev {
				return status.Errorf(status.InvalidArg, "request %d: hash id %d follows %d here but %d earlier: ids must name whole prefixes", i, id, prev, p)
			}
			prev = id
		}
	}
	return nil
}

// IdealHitTokens is what an unbounded cache could reuse: for each request,
// the tokens of its leading blocks that an earlier request already had (at
// any position, a partial last block included), and the input tokens.
func IdealHitTokens(trace []Request, blockTokens int) (hit, total int64) {
	seen := map[int64]struct{}{}
	for _, r := range trace {
		n := 0
		for _, id := range r.HashIDs {
			if _, ok := seen[id]; !ok {
				break
			}
			n++
		}
		hit += int64(min(n*blockTokens, r.InputLength))
		total += int64(r.InputLength)
		for _, id := range r.HashIDs {
			seen[id] = struct{}{}
		}
	}
	return hit, total
}
