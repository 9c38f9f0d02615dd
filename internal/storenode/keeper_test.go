package storenode

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/logs"
)

// fakeStore holds the blocks in has, answers Exist from it (or fails with
// down), and records what the keeper asks and hands it.
type fakeStore struct {
	has     map[key.BlockKey]bool
	down    error
	asked   [][]key.BlockKey
	adopted []directory.Entry
	lost    []directory.Entry
}

func (s *fakeStore) Names(loc directory.Location) bool { return loc.Segment == "store" }

func (s *fakeStore) Exist(keys []key.BlockKey) ([]bool, error) {
	s.asked = append(s.asked, keys)
	if s.down != nil {
		return nil, s.down
	}
	out := make([]bool, len(keys))
	for i, k := range keys {
		out[i] = s.has[k]
	}
	return out, nil
}

func (s *fakeStore) Adopt(held []directory.Entry) { s.adopted = append(s.adopted, held...) }
func (s *fakeStore) Lost(lost []directory.Entry)  { s.lost = append(s.lost, lost...) }
func (s *fakeStore) Audited()                     {}
func entry(k byte, segment, owner string) directory.Entry {
	return directory.Entry{Key: key.BlockKey{k}, Loc: directory.Location{Segment: segment, Owner: owner}}
}

func newTestKeeper(s *fakeStore) *Keeper { return NewKeeper(s, time.Hour, logs.Default()) }

// An entry in the store that leaves the directory is adopted while the
// store holds its block; a delete of another owner's entry, a pool
// entry's, or one the store lost adopts nothing.
func TestKeeperAdopts(t *testing.T) {
	s := &fakeStore{has: map[key.BlockKey]bool{{1}: true, {3}: true}}
	k := newTestKeeper(s)
	held, lost, pool := entry(1, "store", "w"), entry(2, "store", "w"), entry(3, "pool-a", "a")
	for _, e := range []directory.Entry{held, lost, pool} {
		k.Observe(directory.Event{Kind: directory.Put, Entry: e})
	}
	k.Observe(directory.Event{Kind: directory.Delete, Entry: entry(1, "", "someone else")})
	k.adopt()
	require.Empty(t, s.adopted, "another owner's delete leaves the entry")
	require.Empty(t, s.asked, "nothing left the directory")
	for _, e := range []directory.Entry{held, lost, pool} {
		k.Observe(directory.Event{Kind: directory.Delete, Entry: e})
	}
	k.adopt()
	require.Equal(t, [][]key.BlockKey{{{1}, {2}}}, s.asked, "the store entries that left, in one ask")
	require.Equal(t, []directory.Entry{held}, s.adopted)
	k.adopt()
	require.Len(t, s.asked, 1, "each is asked about once")
}

// An audit hands the entries whose blocks the store lost to Lost, once;
// one that cannot ask the store drops nothing; with nothing known it still
// asks, so that it learns whether the master answers.
func TestKeeperAudits(t *testing.T) {
	s := &fakeStore{has: map[key.BlockKey]bool{}}
	k := newTestKeeper(s)
	k.audit()
	require.Equal(t, [][]key.BlockKey{nil}, s.asked, "the probe")
	var want []directory.Entry
	for i := range 2*maxExistKeys + 1 {
		e := directory.Entry{Key: key.BlockKey{byte(i), byte(i >> 8)}, Loc: directory.Location{Segment: "store"}}
		k.Observe(directory.Event{Kind: directory.Put, Entry: e})
		if i%2 == 0 {
			s.has[e.Key] = true
		} else {
			want = append(want, e)
		}
	}
	s.asked, s.down = nil, errors.New("master unreachable")
	k.audit()
	require.Len(t, s.asked, 3, "%d entries in asks of %d", 2*maxExistKeys+1, maxExistKeys)
	require.Empty(t, s.lost, "a store that cannot be asked loses nothing")
	s.asked, s.down = nil, nil
	k.audit()
	require.Len(t, s.asked, 3)
	require.ElementsMatch(t, want, s.lost)
	s.asked, s.lost = nil, nil
	k.audit()
	require.Len(t, s.asked, 2, "the lost entries are forgotten")
	require.Empty(t, s.lost)
}
