package bridge

import (
	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
)

// mirror is a model's copy of the directory's entries. A lookup of a long
// prompt visits one entry per block, each the child of the one before: a
// map probe per block, into a table of 100k entries of about 130 bytes,
// missed the cache on most of them. So the map holds only slot numbers,
// the entries sit in a slice in the order they arrived (a prompt's blocks,
// published together, are neighbours), and every slot remembers the last
// child put under it. A walk follows that link and checks that the child
// is live and has the key it wants: a live slot with that key is the one
// the map names, so a stale link makes a walk slower, never wrong. The map
// is asked when the link does not hold.
type mirror struct {
	at      map[key.BlockKey]int32
	entries []directory.Entry
	child   []int32 // per slot, the slot last put under its key, -1, or freed
	free    []int32 // slots of deleted entries, reused first
}

// freed marks a slot in child that holds no entry.
const freed = -2

func newMirror() mirror {
	return mirror{at: map[key.BlockKey]int32{}}
}

// get returns the entry under k. The pointer is valid until the next put
// or delete.
func (mr *mirror) get(k key.BlockKey) (*directory.Entry, bool) {
	e, _, ok := mr.next(-1, k)
	return e, ok
}

// next returns the entry under k, a child of the entry in slot prev (-1
// for none), and its slot.
func (mr *mirror) next(prev int32, k key.BlockKey) (*directory.Entry, int32, bool) {
	if prev >= 0 {
		if c := mr.child[prev]; c >= 0 && mr.child[c] != freed && mr.entries[c].Key == k {
			return &mr.entries[c], c, true
		}
	}
	i, ok := mr.at[k]
	if !ok {
		return nil, -1, false
	}
	return &mr.entries[i], i, true
}

func (mr *mirror) put(e directory.Entry) {
	i, ok := mr.at[e.Key]
	switch {
	case ok:
	case len(mr.free) > 0:
		i = mr.free[len(mr.free)-1]
		mr.free = mr.free[:len(mr.free)-1]
		mr.child[i] = -1
	default:
		i = int32(len(mr.entries))
		mr.entries = append(mr.entries, directory.Entry{})
		mr.child = append(mr.child, -1)
	}
	mr.entries[i] = e
	mr.at[e.Key] = i
	if p, ok := mr.at[e.Parent]; ok {
		mr.child[p] = i
	}
}

func (mr *mirror) delete(k key.BlockKey) {
	i, ok := mr.at[k]
	if !ok {
		return
	}
	delete(mr.at, k)
	mr.entries[i] = directory.Entry{} // its strings go to the collector
	mr.child[i] = freed
	mr.free = append(mr.free, i)
}

func (mr *mirror) len() int { return len(mr.at) }
