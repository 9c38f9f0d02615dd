package key

import (
	"encoding/binary"
	"encoding/hex"
	"math/rand"
	"reflect"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/zeebo/xxh3"
)

func baseModel() Model {
	return Model{
		LlamaVersion: "b5000",
		Arch:         "llama",
		ContentHash:  Hash{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16},
		NLayer:       2,
		NEmbdKGQA:    []uint32{512, 512},
		NEmbdVGQA:    []uint32{512, 256},
		TypeK:        1,
		TypeV:        8,
		VTrans:       true,
		KVProbe:      Hash{0xaa, 0xbb},
		BlockTokens:  256,
		Extra:        "",
	}
}

// modelMutations changes one field of Model each. Every exported field must
// appear here (TestFingerprintCoversEveryField checks it through reflection),
// so a field added to Model but not to Encode fails the test.
var modelMutations = []struct {
	field  string
	mutate func(m *Model)
}{
	{"LlamaVersion", func(m *Model) { m.LlamaVersion = "b5001" }},
	{"Arch", func(m *Model) { m.Arch = "qwen2" }},
	{"ContentHash", func(m *Model) { m.ContentHash[15] ^= 1 }},
	{"NLayer", func(m *Model) { m.NLayer++ }},
	{"NEmbdKGQA", func(m *Model) { m.NEmbdKGQA = []uint32{512, 513} }},
	{"NEmbdKGQA", func(m *Model) { m.NEmbdKGQA = append(m.NEmbdKGQA, 0) }},
	{"NEmbdVGQA", func(m *Model) { m.NEmbdVGQA = []uint32{256, 512} }},
	{"NEmbdVGQA", func(m *Model) { m.NEmbdVGQA = m.NEmbdVGQA[:1] }},
	{"TypeK", func(m *Model) { m.TypeK = 0 }},
	{"TypeV", func(m *Model) { m.TypeV = -1 }},
	{"VTrans", func(m *Model) { m.VTrans = false }},
	{"KVProbe", func(m *Model) { m.KVProbe[0] ^= 0x80 }},
	{"BlockTokens", func(m *Model) { m.BlockTokens = 128 }},
	{"Extra", func(m *Model) { m.Extra = "x" }},
	{"Partial", func(m *Model) { m.Partial = "window 4" }},
}

func TestFingerprintCoversEveryField(t *testing.T) {
	covered := map[string]bool{}
	base := baseModel()
	fp := base.Fingerprint()
	for _, mu := range modelMutations {
		covered[mu.field] = true
		m := baseModel()
		before := reflect.ValueOf(m).FieldByName(mu.field).Interface()
		mu.mutate(&m)
		require.NotEqual(t, before, reflect.ValueOf(m).FieldByName(mu.field).Interface(), "mutation of %s left it unchanged", mu.field)
		assert.NotEqual(t, fp, m.Fingerprint(), "changing %s does not change the fingerprint", mu.field)
	}
	typ := reflect.TypeOf(Model{})
	for i := 0; i < typ.NumField(); i++ {
		if f := typ.Field(i); f.IsExported() {
			assert.True(t, covered[f.Name], "field Model.%s has no mutation: add one so the fingerprint is proven to cover it", f.Name)
		}
	}
	for name := range covered {
		_, ok := typ.FieldByName(name)
		assert.True(t, ok, "mutation names %s, which Model does not have", name)
	}
}

// Variable-length fields must be framed, or moving bytes from one field to
// its neighbour would give two different models one fingerprint.
func TestFingerprintFramesFields(t *testing.T) {
	for _, tc := range []struct {
		name string
		a, b func(m *Model)
	}{
		{"strings", func(m *Model) { m.LlamaVersion, m.Arch = "ab", "c" }, func(m *Model) { m.LlamaVersion, m.Arch = "a", "bc" }},
		{"slices", func(m *Model) { m.NEmbdKGQA, m.NEmbdVGQA = []uint32{1, 2}, []uint32{3} }, func(m *Model) { m.NEmbdKGQA, m.NEmbdVGQA = []uint32{1}, []uint32{2, 3} }},
	} {
		ma, mb := baseModel(), baseModel()
		tc.a(&ma)
		tc.b(&mb)
		assert.NotEqual(t, ma.Fingerprint(), mb.Fingerprint(), "%s: shifting a value across a field boundary keeps the fingerprint", tc.name)
	}
}

func TestFingerprintFormat(t *testing.T) {
	m := baseModel()
	enc := m.Encode()
	require.Equal(t, "MCBFP\x02", string(enc[:len(fingerprintMagic)]), "encoding magic")
	require.Equal(t, canonical128(xxh3.Hash128(enc)), m.Fingerprint(), "fingerprint is not XXH3-128 of the encoding in canonical byte order")
	m2 := baseModel()
	require.Equal(t, m.Fingerprint(), m2.Fingerprint(), "equal models, different fingerprints")
}

// canonical128 writes a 128-bit digest as XXH128's canonical form: the high
// half then the low half, each big-endian.
func canonical128(u xxh3.Uint128) Hash {
	var h Hash
	binary.BigEndian.PutUint64(h[:8], u.Hi)
	binary.BigEndian.PutUint64(h[8:], u.Lo)
	return h
}

func TestRoot(t *testing.T) {
	m := baseModel()
	fp := m.Fingerprint()
	other := fp
	other[0] ^= 1
	base := Root(fp, Scope{})
	distinct := map[Hash]string{base: "base"}
	for name, h := range map[string]Hash{
		"other model":   Root(other, Scope{}),
		"salt":          Root(fp, Scope{TenantSalt: []byte("tenant-a")}),
		"another salt":  Root(fp, Scope{TenantSalt: []byte("tenant-b")}),
		"adapters":      Root(fp, Scope{Adapters: "lora@1.0"}),
		"adapter scale": Root(fp, Scope{Adapters: "lora@0.5"}),
		"salt|adapters": Root(fp, Scope{TenantSalt: []byte("a"), Adapters: "b"}),
		"salt+adapters": Root(fp, Scope{TenantSalt: []byte("ab")}),
		"adapters only": Root(fp, Scope{Adapters: "ab"}),
	} {
		prev, dup := distinct[h]
		assert.False(t, dup, "root of %q equals root of %q", name, prev)
		distinct[h] = name
	}
	assert.Equal(t, base, Root(fp, Scope{TenantSalt: []byte{}}), "an empty salt and no salt differ")
	assert.NotEqual(t, fp, base, "the root equals the fingerprint")
	// The documented preimage: magic, fingerprint, then framed salt and adapters.
	s := Scope{TenantSalt: []byte("salt"), Adapters: "ad"}
	pre := append([]byte("MCBRT\x01"), fp[:]...)
	pre = append(pre, 4, 0, 0, 0, 's', 'a', 'l', 't', 2, 0, 0, 0, 'a', 'd')
	assert.Equal(t, canonical128(xxh3.Hash128(pre)), Root(fp, s), "root does not follow the documented format")
}

func seqTokens(n int, seed int64) []int32 {
	r := rand.New(rand.NewSource(seed))
	t := make([]int32, n)
	for i := range t {
		t[i] = int32(r.Uint32())
	}
	return t
}

func TestChainBlocks(t *testing.T) {
	root := Hash{9}
	for _, tc := range []struct {
		tokens, block, want int
	}{
		{0, 4, 0},
		{3, 4, 0},
		{4, 4, 1},
		{11, 4, 2},
		{12, 4, 3},
		{12, 1, 12},
		{12, 0, 0},
		{12, -4, 0},
	} {
		got := Chain(root, seqTokens(tc.tokens, 1), tc.block)
		assert.Len(t, got, tc.want, "Chain of %d tokens in blocks of %d", tc.tokens, tc.block)
	}
}

func TestChainLinksParents(t *testing.T) {
	root := Hash{1}
	tokens := seqTokens(40, 2)
	keys := Chain(root, tokens, 8)
	parent := root
	for i, k := range keys {
		require.Equal(t, BlockHash(parent, tokens[i*8:(i+1)*8], nil), k, "key %d is not the hash of its parent and its tokens", i)
		// Documented preimage: parent || tokens as LE int32.
		require.Equal(t, canonical128(xxh3.Hash128(append(parent[:], TokenBytes(tokens[i*8:(i+1)*8])...))), k, "key %d does not follow the documented format", i)
		parent = k
	}

	// The same block under different parents has different keys.
	same := append(append([]int32{}, tokens[:8]...), tokens[:8]...)
	two := Chain(root, same, 8)
	require.NotEqual(t, two[0], two[1], "equal block tokens at depth 0 and 1 share a key")
	require.NotEqual(t, keys[0], Chain(Hash{2}, tokens, 8)[0], "another root gives the same first key")

	// A change in block j changes keys j.. and nothing before.
	changed := append([]int32{}, tokens...)
	changed[2*8+3]++
	ck := Chain(root, changed, 8)
	for i := range keys {
		require.Equal(t, i < 2, ck[i] == keys[i], "after changing block 2, key %d equal", i)
	}
}

func TestChainPrefixOfLongerPrompt(t *testing.T) {
	root := Hash{3}
	long := seqTokens(1000, 3)
	lk := Chain(root, long, 16)
	for _, n := range []int{16, 17, 500, 511, 512} {
		sk := Chain(root, long[:n], 16)
		require.Len(t, sk, n/16, "%d tokens", n)
		for i := range sk {
			require.Equal(t, lk[i], sk[i], "prompt of %d tokens: key %d differs from the longer prompt's", n, i)
		}
	}
}

func TestAppendChainEqualsChain(t *testing.T) {
	root := Hash{4}
	// 2048 exceeds AppendChain's stack scratch: the allocating path must agree.
	for _, block := range []int{1, 7, 256, 1024, 2048} {
		tokens := seqTokens(3*block+1, int64(block))
		want := Chain(root, tokens, block)
		prefix := []BlockKey{{0xee}}
		got := AppendChain(prefix, root, tokens, block)
		assert.Equal(t, BlockKey{0xee}, got[0], "block %d: AppendChain clobbers dst", block)
		assert.Equal(t, want, got[1:], "block %d: AppendChain differs from Chain", block)
		if n := testing.AllocsPerRun(5, func() { got = AppendChain(got[:0], root, tokens, block) }); block <= 1024 {
			assert.Zero(t, n, "block %d: AppendChain into a long enough dst allocates", block)
		}
	}
}

// Golden values computed with the C xxHash library (python3-xxhash), an
// implementation independent of the one the package uses.
func TestChainGolden(t *testing.T) {
	tokens := []int32{1, 2, 3, 4, -1, 0x7fffffff, -0x80000000, 100000, 5, 6, 7, 8, 9}
	var root Hash
	for i := range root {
		root[i] = byte(i)
	}
	want := []string{
		"4c54e37fc7943ca3082d6b4fe9c74494",
		"d3c8c7e1ae91e2b96db845ba86586c9b",
		"e53f9ac48678cfe7506cfead560d69e3",
	}
	checkGolden(t, Chain(root, tokens, 4), want)

	// 1 KiB blocks take xxh3's long-input path.
	long := goldenLongTokens(3*256 + 5)
	checkGolden(t, Chain(Hash{}, long, 256), []string{
		"63854f8f7450df825ae72352b4d9c5a3",
		"6148f545b082171e8b4b30b023a1e708",
		"72a2a84f5661a5f8b9c88f0775f3b9b4",
	})
}

func checkGolden(t *testing.T, got []BlockKey, want []string) {
	t.Helper()
	require.Len(t, got, len(want))
	for i := range want {
		assert.Equal(t, want[i], got[i].String(), "key %d", i)
	}
}

func goldenLongTokens(n int) []int32 {
	t := make([]int32, n)
	for i := range t {
		t[i] = int32(uint32(i) * 2654435761)
	}
	return t
}

func TestTokenBytes(t *testing.T) {
	got := TokenBytes([]int32{1, -1, 0x01020304})
	want := []byte{1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 4, 3, 2, 1}
	require.Equal(t, want, got, "TokenBytes")
}

func TestHashString(t *testing.T) {
	h := Hash{0x01, 0xab}
	require.Equal(t, "01ab"+hex.EncodeToString(make([]byte, 14)), h.String())
	require.False(t, h.IsZero(), "IsZero of a non-zero hash")
	require.True(t, (Hash{}).IsZero(), "IsZero of the zero hash")
}

// mooncakeReference follows the conductor-indexer spec literally:
// local = XXH3-64(tokens as LE u32, seed); seq[0] = local[0];
// seq[i] = XXH3-64(LE(seq[i-1]) || LE(local[i]), seed).
func mooncakeReference(tokens []int32, block int, seed uint64) []uint64 {
	var seq []uint64
	for i := 0; (i+1)*block <= len(tokens); i++ {
		var raw []byte
		for _, t := range tokens[i*block : (i+1)*block] {
			raw = binary.LittleEndian.AppendUint32(raw, uint32(t))
		}
		local := xxh3.HashSeed(raw, seed)
		if i == 0 {
			seq = append(seq, local)
			continue
		}
		var pair []byte
		pair = binary.LittleEndian.AppendUint64(pair, seq[i-1])
		pair = binary.LittleEndian.AppendUint64(pair, local)
		seq = append(seq, xxh3.HashSeed(pair, seed))
	}
	return seq
}

func TestMooncakeHashesMatchSpec(t *testing.T) {
	for _, tc := range []struct {
		n, block int
		seed     uint64
	}{
		{0, 4, 0}, {3, 4, 0}, {4, 4, 1}, {37, 4, 0x5eed}, {1000, 64, 0}, {2000, 256, 1 << 63}, {50, 1, 7},
	} {
		tokens := seqTokens(tc.n, int64(tc.n))
		got := MooncakeHashes(tokens, tc.block, tc.seed)
		want := mooncakeReference(tokens, tc.block, tc.seed)
		require.Len(t, got, len(want), "%+v: hashes against the reference", tc)
		require.Len(t, got, tc.n/tc.block, "%+v", tc)
		for i := range want {
			require.Equal(t, want[i], got[i], "%+v: hash %d against the reference", tc, i)
		}
	}
	require.Nil(t, MooncakeHashes(seqTokens(8, 1), 0, 0), "block size 0 gives hashes")
}

// Golden values from the C xxHash library (python3-xxhash).
func TestMooncakeHashesGolden(t *testing.T) {
	tokens := []int32{1, 2, 3, 4, -1, 0x7fffffff, -0x80000000, 100000, 5, 6, 7, 8, 9}
	for _, tc := range []struct {
		seed   uint64
		tokens []int32
		block  int
		want   []uint64
	}{
		{0x5eed, tokens, 4, []uint64{0xa301127d2b4164db, 0xd10cad7f1afa82ad, 0xfeaa2ff1ea2b8e75}},
		{0, tokens, 4, []uint64{0x6fc1ebd4f4d6ea31, 0x24f053a1fb9a501e, 0x4827805690609694}},
		{7, goldenLongTokens(3*256 + 5), 256, []uint64{0x66d410f05e64b0c9, 0x47134437bfe15d3d, 0x5ed4f6718960220a}},
	} {
		assert.Equal(t, tc.want, MooncakeHashes(tc.tokens, tc.block, tc.seed), "seed %#x", tc.seed)
	}
}

func BenchmarkChain128k(b *testing.B) {
	const n, block = 131072, 256
	tokens := seqTokens(n, 1)
	root := Hash{1}
	var keys []BlockKey
	b.SetBytes(4 * n)
	b.ReportAllocs()
	for b.Loop() {
		keys = Chain(root, tokens, block)
	}
	require.Len(b, keys, n/block)
}

func BenchmarkMooncakeHashes128k(b *testing.B) {
	const n, block = 131072, 256
	tokens := seqTokens(n, 1)
	b.SetBytes(4 * n)
	b.ReportAllocs()
	for b.Loop() {
		MooncakeHashes(tokens, block, 0)
	}
}

func TestScopeID(t *testing.T) {
	ids := map[Hash]string{}
	for name, s := range map[string]Scope{
		"base":                {},
		"salt":                {TenantSalt: []byte("a")},
		"adapters":            {Adapters: "a"},
		"salt and adapters":   {TenantSalt: []byte("a"), Adapters: "b"},
		"boundary moved":      {TenantSalt: []byte("ab")},
		"boundary moved back": {Adapters: "ab"},
	} {
		id := s.ID()
		require.NotContains(t, ids, id, "%s has the ID of %s", name, ids[id])
		ids[id] = name
		require.Equal(t, id, Scope{TenantSalt: append([]byte(nil), s.TenantSalt...), Adapters: s.Adapters}.ID(), "%s: equal scopes, other IDs", name)
		require.NotEqual(t, id, Root(Hash{}, s), "%s: a scope's ID is its root under the zero fingerprint", name)
	}
}
