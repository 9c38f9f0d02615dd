package residency

import (
	"math"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

var (
	rootA = testKey('r', 1)
	rootB = testKey('r', 2)
)

// keys returns n distinct block keys tagged tag.
func keys(tag byte, n int) []key.BlockKey {
	out := make([]key.BlockKey, n)
	for i := range out {
		out[i] = testKey(tag, uint32(i))
	}
	return out
}

// blocks makes a block of size bytes per key, with value i and cost i+1.
func blocks(ks []key.BlockKey, size int64) []Block[int] {
	out := make([]Block[int], len(ks))
	for i, k := range ks {
		out[i] = Block[int]{Key: k, Value: i, Bytes: size, Cost: float64(i + 1)}
	}
	return out
}

func cat(parts ...[]key.BlockKey) []key.BlockKey { return slices.Concat(parts...) }

func newTree(t *testing.T, cfg Config) *Tree[int] {
	t.Helper()
	tr, err := New[int](cfg)
	require.NoError(t, err)
	return tr
}

func mustInsert(t *testing.T, tr *Tree[int], root key.Hash, bs []Block[int]) {
	t.Helper()
	_, err := tr.InsertChain(root, bs)
	require.NoError(t, err)
}

func mustPin(t *testing.T, tr *Tree[int], ks ...key.BlockKey) {
	t.Helper()
	for _, k := range ks {
		require.NoError(t, tr.Pin(k))
	}
}

func snapshot(tr *Tree[int]) []Entry[int] {
	var out []Entry[int]
	tr.Walk(func(e Entry[int]) bool {
		out = append(out, e)
		return true
	})
	return out
}

// withoutUses drops the use counts, which a block found again counts up.
func withoutUses(es []Entry[int]) []Entry[int] {
	out := slices.Clone(es)
	for i := range out {
		out[i].Uses = 0
	}
	return out
}

func evictedKeys(t *testing.T, tr *Tree[int], need int64) []key.BlockKey {
	t.Helper()
	es, err := tr.Evict(need)
	require.NoError(t, err)
	return entryKeys(es)
}

func TestNew(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
		want status.Code
	}{
		{"unbounded lru", Config{}, status.OK},
		{"bounded cost-aware", Config{BudgetBytes: 1 << 30, Policy: CostAware}, status.OK},
		{"negative budget", Config{BudgetBytes: -1}, status.Config},
		{"bounded frequency", Config{BudgetBytes: 1 << 30, Policy: Frequency}, status.OK},
		{"unknown policy", Config{Policy: Frequency + 1}, status.Config},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr, err := New[int](tc.cfg)
			require.Equal(t, tc.want, status.Of(err), "New(%+v) = %v", tc.cfg, err)
			if err == nil {
				require.Zero(t, tr.Len(), "blocks in a new tree")
				require.Zero(t, tr.Bytes(), "bytes in a new tree")
			}
		})
	}
}

func TestInsertChain(t *testing.T) {
	a, b, c := keys('a', 4), keys('b', 2), keys('c', 2)
	withBlock := func(ks []key.BlockKey, i int, edit func(*Block[int])) []Block[int] {
		bs := blocks(ks, 4)
		edit(&bs[i])
		return bs
	}
	type chain struct {
		root key.Hash
		bs   []Block[int]
	}
	for _, tc := range []struct {
		name      string
		budget    int64
		setup     []chain
		root      key.Hash
		bs        []Block[int]
		wantAdded int
		wantCode  status.Code
		wantLen   int
		wantBytes int64
	}{
		{"new chain", 0, nil, rootA, blocks(a, 4), 4, status.OK, 4, 16},
		{"empty chain", 0, nil, rootA, nil, 0, status.OK, 0, 0},
		{"indexed chain keeps its blocks", 0, []chain{{rootA, blocks(a, 4)}}, rootA, blocks(a, 9), 0, status.OK, 4, 16},
		{"extends a shared prefix", 0, []chain{{rootA, blocks(a, 4)}}, rootA, blocks(cat(a[:2], b), 4), 2, status.OK, 6, 24},
		{"extends a whole chain", 0, []chain{{rootA, blocks(a[:2], 4)}}, rootA, blocks(a, 4), 2, status.OK, 4, 16},
		{"same first key under another root", 0, []chain{{rootA, blocks(a, 4)}}, rootB, blocks(a[:1], 4), 0, status.InvalidArg, 4, 16},
		{"key under another parent", 0, []chain{{rootA, blocks(a, 4)}}, rootA, blocks([]key.BlockKey{a[0], a[2]}, 4), 0, status.InvalidArg, 4, 16},
		{"new key indexed elsewhere", 0, []chain{{rootA, blocks(a, 4)}}, rootA, blocks(cat(b, a[1:2]), 4), 0, status.InvalidArg, 4, 16},
		{"key repeated in the chain", 0, nil, rootA, blocks(cat(b, c, b[:1]), 4), 0, status.InvalidArg, 0, 0},
		{"zero size", 0, nil, rootA, withBlock(a, 2, func(b *Block[int]) { b.Bytes = 0 }), 0, status.InvalidArg, 0, 0},
		{"negative size", 0, nil, rootA, withBlock(a, 0, func(b *Block[int]) { b.Bytes = -4 }), 0, status.InvalidArg, 0, 0},
		{"negative cost", 0, nil, rootA, withBlock(a, 3, func(b *Block[int]) { b.Cost = -1 }), 0, status.InvalidArg, 0, 0},
		{"NaN cost", 0, nil, rootA, withBlock(a, 1, func(b *Block[int]) { b.Cost = math.NaN() }), 0, status.InvalidArg, 0, 0},
		{"infinite cost", 0, nil, rootA, withBlock(a, 1, func(b *Block[int]) { b.Cost = math.Inf(1) }), 0, status.InvalidArg, 0, 0},
		{"sizes overflow", 0, nil, rootA, withBlock(a[:2], 1, func(b *Block[int]) { b.Bytes = math.MaxInt64 }), 0, status.InvalidArg, 0, 0},
		{"fills the budget", 16, nil, rootA, blocks(a, 4), 4, status.OK, 4, 16},
		{"over budget", 15, nil, rootA, blocks(a, 4), 0, status.PoolFull, 0, 0},
		{"over budget counts new blocks only", 16, []chain{{rootA, blocks(a[:3], 4)}}, rootA, blocks(a, 4), 1, status.OK, 4, 16},
		{"full budget takes no new block", 16, []chain{{rootA, blocks(a, 4)}}, rootA, blocks(cat(a[:1], b[:1]), 4), 0, status.PoolFull, 4, 16},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := newTree(t, Config{BudgetBytes: tc.budget})
			for _, s := range tc.setup {
				mustInsert(t, tr, s.root, s.bs)
			}
			before := snapshot(tr)
			added, err := tr.InsertChain(tc.root, tc.bs)
			require.Equal(t, tc.wantCode, status.Of(err), "InsertChain: %v", err)
			require.Equal(t, tc.wantAdded, added, "blocks InsertChain added")
			require.Equal(t, tc.wantLen, tr.Len(), "blocks after")
			require.Equal(t, tc.wantBytes, tr.Bytes(), "bytes after")
			if err != nil {
				require.Equal(t, before, snapshot(tr), "failed InsertChain changed the tree")
			}
			require.NoError(t, tr.check())
		})
	}
}

func TestInsertChainKeepsExistingPayload(t *testing.T) {
	a := keys('a', 2)
	tr := newTree(t, Config{})
	mustInsert(t, tr, rootA, blocks(a, 4))
	again := blocks(a, 8)
	again[1].Value = 99
	mustInsert(t, tr, rootA, again)
	v, ok := tr.Get(a[1])
	require.True(t, ok, "Get")
	require.Equal(t, 1, v, "Get must return the first insert's value")
}

func TestInsert(t *testing.T) {
	a, b := keys('a', 3), keys('b', 2)
	for _, tc := range []struct {
		name      string
		budget    int64
		parent    key.BlockKey
		b         Block[int]
		wantAdded bool
		wantCode  status.Code
	}{
		{"missing parent", 0, b[0], blocks(b[1:], 4)[0], false, status.NotFound},
		{"new child", 0, a[2], blocks(b[:1], 4)[0], true, status.OK},
		{"new sibling", 0, a[0], blocks(b[:1], 4)[0], true, status.OK},
		{"existing child", 0, a[1], blocks(a[2:], 4)[0], false, status.OK},
		{"key under another parent", 0, a[0], blocks(a[2:], 4)[0], false, status.InvalidArg},
		{"first block as child", 0, a[2], blocks(a[:1], 4)[0], false, status.InvalidArg},
		{"bad size", 0, a[2], Block[int]{Key: b[0]}, false, status.InvalidArg},
		{"over budget", 12, a[2], blocks(b[:1], 4)[0], false, status.PoolFull},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := newTree(t, Config{BudgetBytes: tc.budget})
			mustInsert(t, tr, rootA, blocks(a, 4))
			before := snapshot(tr)
			added, err := tr.Insert(tc.parent, tc.b)
			require.Equal(t, tc.wantCode, status.Of(err), "Insert: %v", err)
			require.Equal(t, tc.wantAdded, added, "Insert added")
			if added {
				n := tr.Match(rootA, cat(a[:slices.Index(a, tc.parent)+1], []key.BlockKey{tc.b.Key}))
				require.Equal(t, 4, tr.Len(), "blocks after Insert")
				require.Equal(t, slices.Index(a, tc.parent)+2, n, "depth the new block matched at")
			} else {
				require.Equal(t, withoutUses(before), withoutUses(snapshot(tr)), "Insert that added nothing changed the tree beyond counting a use")
			}
		})
	}
}

func TestMatch(t *testing.T) {
	a, b, c := keys('a', 4), keys('b', 2), keys('c', 2)
	tr := newTree(t, Config{})
	mustInsert(t, tr, rootA, blocks(a, 4))
	mustInsert(t, tr, rootA, blocks(cat(a[:2], b), 4))
	mustInsert(t, tr, rootB, blocks(c, 4))
	for _, tc := range []struct {
		name  string
		root  key.Hash
		chain []key.BlockKey
		want  int
	}{
		{"whole chain", rootA, a, 4},
		{"branch", rootA, cat(a[:2], b), 4},
		{"prefix", rootA, a[:2], 2},
		{"longer than indexed", rootA, cat(a, keys('z', 3)), 4},
		{"diverges", rootA, cat(a[:2], keys('z', 1), a[2:]), 2},
		{"key present under another parent", rootA, cat(a[:3], b[1:]), 3},
		{"other root", rootB, a, 0},
		{"second scope", rootB, c, 2},
		{"starts mid-chain", rootA, a[1:], 0},
		{"absent first block", rootA, keys('z', 2), 0},
		{"empty", rootA, nil, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, tr.Match(tc.root, tc.chain), "Match")
		})
	}
}

// TestRecency checks which calls count as a use: the LRU victim among two
// one-block chains is the one not used since.
func TestRecency(t *testing.T) {
	a, b := keys('a', 1), keys('b', 1)
	for _, tc := range []struct {
		name string
		use  func(tr *Tree[int])
		want key.BlockKey // evicted first
	}{
		{"untouched", func(*Tree[int]) {}, a[0]},
		{"Touch", func(tr *Tree[int]) { tr.Touch(a[0]) }, b[0]},
		{"re-insert", func(tr *Tree[int]) { tr.InsertChain(rootA, blocks(a, 4)) }, b[0]},
		{"Match is not a use", func(tr *Tree[int]) { tr.Match(rootA, a) }, a[0]},
		{"Get is not a use", func(tr *Tree[int]) { tr.Get(a[0]) }, a[0]},
		{"Walk is not a use", func(tr *Tree[int]) { snapshot(tr) }, a[0]},
		{"Pin and Unpin are not uses", func(tr *Tree[int]) { tr.Pin(a[0]); tr.Unpin(a[0]) }, a[0]},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := newTree(t, Config{BudgetBytes: 8})
			mustInsert(t, tr, rootA, blocks(a, 4))
			mustInsert(t, tr, rootB, blocks(b, 4))
			tc.use(tr)
			require.Equal(t, []key.BlockKey{tc.want}, evictedKeys(t, tr, 4), "evicted")
		})
	}
}

func TestTouch(t *testing.T) {
	a := keys('a', 3)
	tr := newTree(t, Config{BudgetBytes: 12})
	mustInsert(t, tr, rootA, blocks(a[:2], 4))
	mustInsert(t, tr, rootA, blocks(cat(a[:1], a[2:]), 4))
	require.Equal(t, 2, tr.Touch(a[1], keys('z', 1)[0], a[1]), "Touch must skip absent keys")
	require.Equal(t, a[2:], evictedKeys(t, tr, 4), "evicted")
}

func TestGet(t *testing.T) {
	a := keys('a', 2)
	tr := newTree(t, Config{})
	mustInsert(t, tr, rootA, blocks(a, 4))
	for _, tc := range []struct {
		k      key.BlockKey
		want   int
		wantOK bool
	}{{a[0], 0, true}, {a[1], 1, true}, {keys('z', 1)[0], 0, false}} {
		v, ok := tr.Get(tc.k)
		assert.Equal(t, tc.want, v, "Get(%s)", tc.k)
		assert.Equal(t, tc.wantOK, ok, "Get(%s) ok", tc.k)
	}
}

func TestPinUnpin(t *testing.T) {
	a := keys('a', 2)
	absent := keys('z', 1)[0]
	type call struct {
		unpin bool
		k     key.BlockKey
		want  status.Code
	}
	for _, tc := range []struct {
		name  string
		calls []call
		// pinned reports whether a[1] is still pinned afterwards.
		pinned bool
	}{
		{"pin absent", []call{{false, absent, status.NotFound}}, false},
		{"unpin absent", []call{{true, absent, status.NotFound}}, false},
		{"unpin unpinned", []call{{true, a[1], status.State}}, false},
		{"pin then unpin", []call{{false, a[1], status.OK}, {true, a[1], status.OK}}, false},
		{"pins count", []call{{false, a[1], status.OK}, {false, a[1], status.OK}, {true, a[1], status.OK}}, true},
		{"unpin once too often", []call{{false, a[1], status.OK}, {true, a[1], status.OK}, {true, a[1], status.State}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := newTree(t, Config{BudgetBytes: 8})
			mustInsert(t, tr, rootA, blocks(a, 4))
			for i, c := range tc.calls {
				f, name := tr.Pin, "Pin"
				if c.unpin {
					f, name = tr.Unpin, "Unpin"
				}
				err := f(c.k)
				require.Equal(t, c.want, status.Of(err), "call %d: %s(%s) = %v", i, name, c.k, err)
			}
			require.NoError(t, tr.check())
			_, err := tr.Evict(8)
			require.Equal(t, tc.pinned, status.Of(err) == status.PoolFull, "Evict(8) = %v; whether a[1] is pinned", err)
		})
	}
}

func TestRemove(t *testing.T) {
	a, b, c := keys('a', 4), keys('b', 2), keys('c', 1)
	for _, tc := range []struct {
		name       string
		pin        []key.BlockKey
		k          key.BlockKey
		wantCode   status.Code
		wantNamed  key.BlockKey // the pinned key the error names
		wantGone   []key.BlockKey
		wantLeafOf key.BlockKey // a block that Remove turns into an evictable leaf
	}{
		{name: "absent", k: keys('z', 1)[0], wantCode: status.NotFound},
		{name: "leaf", k: a[3], wantGone: a[3:], wantLeafOf: a[2]},
		{name: "subtree", k: a[1], wantGone: cat(a[1:], b), wantLeafOf: a[0]},
		{name: "first block", k: a[0], wantGone: cat(a, b)},
		{name: "pinned block", pin: a[1:2], k: a[1], wantCode: status.State, wantNamed: a[1]},
		{name: "pinned descendant", pin: b[1:], k: a[0], wantCode: status.State, wantNamed: b[1]},
		{name: "pinned elsewhere", pin: c, k: a[2], wantGone: a[2:]},
		{name: "pinned ancestor", pin: a[:1], k: a[1], wantGone: cat(a[1:], b)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := newTree(t, Config{BudgetBytes: 64})
			mustInsert(t, tr, rootA, blocks(a, 4))
			mustInsert(t, tr, rootA, blocks(cat(a[:2], b), 4))
			mustInsert(t, tr, rootB, blocks(c, 4))
			mustPin(t, tr, tc.pin...)
			before := snapshot(tr)
			got, err := tr.Remove(tc.k)
			require.Equal(t, tc.wantCode, status.Of(err), "Remove = %v", err)
			if err != nil {
				if tc.wantCode == status.State {
					require.ErrorContains(t, err, tc.wantNamed.String(), "the error must name the pinned block")
				}
				require.Equal(t, before, snapshot(tr), "failed Remove changed the tree")
				return
			}
			gone := entryKeys(got)
			pos := map[key.BlockKey]int{}
			for i, e := range got {
				pos[e.Key] = i
				_, ok := tr.Get(e.Key)
				require.False(t, ok, "%s still indexed", e.Key)
			}
			for i, e := range got {
				if j, ok := pos[e.Parent]; ok {
					require.GreaterOrEqual(t, j, i, "removed %s before its child %s", e.Parent, e.Key)
				}
			}
			slices.SortFunc(gone, compareKeys)
			want := slices.SortedFunc(slices.Values(tc.wantGone), compareKeys)
			require.Equal(t, want, gone, "removed")
			require.Equal(t, len(before)-len(want), tr.Len(), "blocks after")
			require.Equal(t, 4*int64(tr.Len()), tr.Bytes(), "bytes after")
			require.NoError(t, tr.check())
			if tc.wantLeafOf != (key.BlockKey{}) {
				require.GreaterOrEqual(t, tr.nodes[tr.ids[tc.wantLeafOf]].heapPos, int32(0), "%s is a leaf now but not an eviction candidate", tc.wantLeafOf)
			}
		})
	}
}

func TestEvict(t *testing.T) {
	a, b, c := keys('a', 3), keys('b', 2), keys('c', 2)
	// Six 4-byte blocks, 24 bytes: a[0..2], b[0] under a[0], c[0..1], used in
	// that order. Costs per byte: a 0.25, 0.5, 0.75; b[0] 0.75; c 0.25, 0.5.
	fill := func(t *testing.T, tr *Tree[int]) {
		mustInsert(t, tr, rootA, blocks(a, 4))
		mustInsert(t, tr, rootA, []Block[int]{{Key: a[0], Bytes: 4, Cost: 1}, {Key: b[0], Bytes: 4, Cost: 3}})
		mustInsert(t, tr, rootB, blocks(c, 4))
	}
	for _, tc := range []struct {
		name     string
		cfg      Config
		pin      []key.BlockKey
		need     int64
		want     []key.BlockKey
		wantCode status.Code
	}{
		{name: "negative need", cfg: Config{BudgetBytes: 24}, need: -1, wantCode: status.InvalidArg},
		{name: "unbounded", cfg: Config{}, need: 1 << 40},
		{name: "already fits", cfg: Config{BudgetBytes: 32}, need: 4},
		{name: "need above budget", cfg: Config{BudgetBytes: 24}, need: 25, wantCode: status.PoolFull},
		{name: "lru one block", cfg: Config{BudgetBytes: 24}, need: 1, want: a[2:]},
		{name: "lru frees up the chain", cfg: Config{BudgetBytes: 24}, need: 12, want: []key.BlockKey{a[2], a[1], b[0]}},
		{name: "lru empties the tree", cfg: Config{BudgetBytes: 24}, need: 24, want: []key.BlockKey{a[2], a[1], b[0], a[0], c[1], c[0]}},
		{name: "lru skips pinned leaf and its prefix", cfg: Config{BudgetBytes: 24}, pin: a[2:], need: 12, want: []key.BlockKey{b[0], c[1], c[0]}},
		{name: "pinned prefix keeps the blocks below", cfg: Config{BudgetBytes: 24}, pin: a[:1], need: 20, want: []key.BlockKey{a[2], a[1], b[0], c[1], c[0]}},
		{name: "everything pinned", cfg: Config{BudgetBytes: 24}, pin: cat(a[2:], b[:1], c[1:]), need: 4, wantCode: status.PoolFull},
		{name: "pinned one byte beyond need", cfg: Config{BudgetBytes: 24}, pin: a[2:], need: 13, wantCode: status.PoolFull},
		{name: "cost-aware cheapest per byte first", cfg: Config{BudgetBytes: 24, Policy: CostAware}, need: 8, want: []key.BlockKey{c[1], c[0]}},
		{name: "cost-aware ties go least recent first", cfg: Config{BudgetBytes: 24, Policy: CostAware}, need: 24, want: []key.BlockKey{c[1], c[0], a[2], a[1], b[0], a[0]}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := newTree(t, tc.cfg)
			fill(t, tr)
			mustPin(t, tr, tc.pin...)
			before := snapshot(tr)
			got, err := tr.Evict(tc.need)
			require.Equal(t, tc.wantCode, status.Of(err), "Evict(%d) = %v", tc.need, err)
			require.Equal(t, tc.want, entryKeys(got), "Evict(%d)", tc.need)
			if err != nil {
				require.Equal(t, before, snapshot(tr), "failed Evict changed the tree")
			}
			if tc.cfg.BudgetBytes > 0 && err == nil {
				require.LessOrEqual(t, tr.Bytes()+tc.need, tc.cfg.BudgetBytes, "after Evict(%d): bytes plus need in the budget", tc.need)
			}
			require.NoError(t, tr.check())
		})
	}
}

// TestCostAwareAging checks GreedyDual-Size's aging: a block ten times as
// expensive per byte as a stream of fresh, cheap blocks survives while the
// inflation catches up with it, then goes, least recent first on the tie.
// LRU lets it go at once.
func TestCostAwareAging(t *testing.T) {
	for _, tc := range []struct {
		policy Policy
		rounds int
	}{{LRU, 1}, {CostAware, 10}} {
		t.Run(tc.policy.String(), func(t *testing.T) {
			tr := newTree(t, Config{BudgetBytes: 2, Policy: tc.policy})
			old := testKey('x', 0)
			mustInsert(t, tr, rootA, []Block[int]{{Key: old, Bytes: 1, Cost: 10}})
			for round := 1; round <= 100; round++ {
				mustInsert(t, tr, rootB, []Block[int]{{Key: testKey('y', uint32(round)), Bytes: 1, Cost: 1}})
				es := evictedKeys(t, tr, 1)
				if slices.Contains(es, old) {
					require.Equal(t, tc.rounds, round, "round the expensive block was evicted in")
					return
				}
			}
			require.FailNow(t, "expensive block never evicted")
		})
	}
}

// TestFrequencyKeepsWhatIsUsed: a block used ten times outlives a stream
// of eight blocks used once that cost three times as much to recompute
// (deeper ones), where cost-aware eviction lets it go first and LRU as
// soon as the stream passes its last use. (Its own aging retires it after
// about twelve.)
func TestFrequencyKeepsWhatIsUsed(t *testing.T) {
	for _, tc := range []struct {
		policy Policy
		kept   bool
	}{{LRU, false}, {CostAware, false}, {Frequency, true}} {
		t.Run(tc.policy.String(), func(t *testing.T) {
			tr := newTree(t, Config{BudgetBytes: 4, Policy: tc.policy})
			hot := testKey('h', 0)
			mustInsert(t, tr, rootA, []Block[int]{{Key: hot, Bytes: 1, Cost: 1}})
			for range 9 {
				require.Equal(t, 1, tr.Touch(hot))
			}
			evicted := false
			for round := 1; round <= 8; round++ {
				mustInsert(t, tr, rootB, []Block[int]{{Key: testKey('c', uint32(round)), Bytes: 1, Cost: 3}})
				if slices.Contains(evictedKeys(t, tr, 1), hot) {
					evicted = true
				}
			}
			require.Equal(t, !tc.kept, evicted, "the hot block evicted by a stream of 8 blocks used once")
		})
	}
}

// A block inserted with earlier uses (read back from a disk tier) ranks
// as one used that often.
func TestFrequencyCountsInsertedUses(t *testing.T) {
	tr := newTree(t, Config{BudgetBytes: 2, Policy: Frequency})
	mustInsert(t, tr, rootA, []Block[int]{{Key: testKey('a', 0), Bytes: 1, Cost: 1, Uses: 5}})
	mustInsert(t, tr, rootB, []Block[int]{{Key: testKey('b', 0), Bytes: 1, Cost: 1}})
	require.Equal(t, []key.BlockKey{testKey('b', 0)}, evictedKeys(t, tr, 1))
	es := snapshot(tr)
	require.Len(t, es, 1)
	require.Equal(t, uint32(5), es[0].Uses)
}

func TestWalk(t *testing.T) {
	a, b, c := keys('a', 3), keys('b', 2), keys('c', 2)
	tr := newTree(t, Config{})
	mustInsert(t, tr, rootA, blocks(a, 4))
	mustInsert(t, tr, rootA, blocks(cat(a[:1], b), 4))
	mustInsert(t, tr, rootB, blocks(c, 4))
	seen := map[key.Hash]bool{rootA: true, rootB: true}
	for _, e := range snapshot(tr) {
		require.True(t, seen[e.Parent], "%s visited before its parent %s", e.Key, e.Parent)
		seen[e.Key] = true
	}
	require.Equal(t, 2+tr.Len(), len(seen), "roots and blocks Walk visited")
	visits := 0
	tr.Walk(func(Entry[int]) bool {
		visits++
		return visits < 3
	})
	require.Equal(t, 3, visits, "Walk must stop when fn returns false at 3")
}

func TestPolicyString(t *testing.T) {
	for p, want := range map[Policy]string{LRU: "lru", CostAware: "cost-aware", Frequency: "frequency", 9: "policy(9)"} {
		assert.Equal(t, want, p.String(), "%d.String()", p)
	}
}

func TestPolicyNamed(t *testing.T) {
	for name, want := range map[string]Policy{"lru": LRU, "cost": CostAware, "frequency": Frequency} {
		p, ok := PolicyNamed(name)
		assert.True(t, ok, name)
		assert.Equal(t, want, p, name)
	}
	_, ok := PolicyNamed("fifo")
	assert.False(t, ok)
}
