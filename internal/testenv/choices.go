package testenv

import "math/rand"

// Choices yields the choices a model-based test's op sequence is made of:
// a seeded generator in a property test, a fuzz target's bytes in a fuzz
// test, so that both drive the same harness.
type Choices interface {
	// Intn is a choice in [0, n).
	Intn(n int) int
	// Done reports that the choices ran out (fuzz bytes only).
	Done() bool
}

// Seeded is an endless sequence of choices from seed.
func Seeded(seed int64) Choices { return seeded{rand.New(rand.NewSource(seed))} }

type seeded struct{ r *rand.Rand }

func (s seeded) Intn(n int) int { return s.r.Intn(n) }
func (s seeded) Done() bool     { return false }

// FuzzBytes is the choices data makes, one byte each; once they run out,
// every choice is 0 and Done reports true.
func FuzzBytes(data []byte) Choices { return &fuzzBytes{data: data} }

type fuzzBytes struct {
	data      []byte
	exhausted bool
}

func (s *fuzzBytes) Intn(n int) int {
	if len(s.data) == 0 {
		s.exhausted = true
		return 0
	}
	v := int(s.data[0]) % n
	s.data = s.data[1:]
	return v
}

func (s *fuzzBytes) Done() bool { return s.exhausted }
