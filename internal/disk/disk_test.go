package disk

import (
	"bytes"
	"math/rand"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/zeebo/xxh3"

	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/residency"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

var model = key.Hash{0xfe, 0xed}

// block builds a valid pool block of the given chain position, with
// f16-like payload bytes (a narrow exponent range, noisy mantissas).
func block(t testing.TB, seed int64, parent key.Hash, depth uint32) ([]byte, Meta) {
	t.Helper()
	g := pool.Geometry{BlockTokens: 16, KRow: []int{64, 64}, VRow: []int{64, 64}}
	b := make([]byte, g.Size())
	r := rand.New(rand.NewSource(seed))
	for i := g.HeaderSize(); i < len(b); i += 2 {
		b[i] = byte(r.Intn(256))
		b[i+1] = byte(0x38 + r.Intn(4))
	}
	var k key.Hash
	r.Read(k[:])
	h := pool.Header{Key: k, Parent: parent, Model: model, Depth: depth, Tokens: make([]int32, g.BlockTokens), LayerSums: make([]uint64, g.Layers())}
	for l := range h.LayerSums {
		off := g.LayerOffset(l)
		h.LayerSums[l] = pool.Sum(b[off : off+g.LayerSize(l)])
	}
	require.NoError(t, pool.EncodeHeader(b, &g, &h))
	pool.EndWrite(b, 42)
	return b, Meta{Key: k, Parent: parent, Model: model, Depth: depth}
}

func open(t testing.TB, dir string, bytes int64, c Codec) *Tier {
	t.Helper()
	tr, err := Open(Config{Dir: dir, Bytes: bytes, Codec: c, Policy: residency.LRU})
	require.NoError(t, err)
	return tr
}

func TestCodecRoundTrip(t *testing.T) {
	b, _ := block(t, 1, key.Hash{1}, 0)
	for _, c := range []Codec{Raw, Zstd} {
		stored, err := Encode(c, nil, b, nil)
		require.NoError(t, err, c)
		got := make([]byte, len(b))
		require.NoError(t, Decode(c, got, stored, nil), c)
		require.Equal(t, b, got, c)
		if c == Zstd {
			assert.Less(t, len(stored), len(b), "zstd on byte planes with a narrow exponent range")
		}
		require.Equal(t, status.Corrupt, status.Of(Decode(c, make([]byte, len(b)-2), stored, nil)), "%s: wrong size", c)
	}
	src := []byte{1, 2, 3, 4, 5, 6}
	planes := make([]byte, 6)
	Shuffle(planes, src)
	require.Equal(t, []byte{1, 3, 5, 2, 4, 6}, planes)
	back := make([]byte, 6)
	Unshuffle(back, planes)
	require.Equal(t, src, back)
	// The word-wide steps agree with the definition at every length.
	r := rand.New(rand.NewSource(3))
	for n := 0; n <= 40; n += 2 {
		src := make([]byte, n)
		r.Read(src)
		planes, back := make([]byte, n), make([]byte, n)
		Shuffle(planes, src)
		for i := 0; i < n/2; i++ {
			require.Equal(t, src[2*i], planes[i], "n=%d low byte %d", n, i)
			require.Equal(t, src[2*i+1], planes[n/2+i], "n=%d high byte %d", n, i)
		}
		Unshuffle(back, planes)
		require.Equal(t, src, back, "n=%d", n)
	}
	_, err := Encode(Zstd, nil, []byte{1, 2, 3}, nil)
	require.Equal(t, status.InvalidArg, status.Of(err), "odd length")
	for name, c := range map[string]Codec{"raw": Raw, "zstd": Zstd} {
		got, err := ParseCodec(name)
		require.NoError(t, err)
		require.Equal(t, c, got)
		require.Equal(t, name, c.String())
	}
	_, err = ParseCodec("lz4")
	require.Equal(t, status.Config, status.Of(err))
}

func TestPutGetReopen(t *testing.T) {
	for _, c := range []Codec{Raw, Zstd} {
		t.Run(c.String(), func(t *testing.T) {
			dir := t.TempDir()
			tr := open(t, dir, 1<<20, c)
			root := key.Hash{9}
			b0, m0 := block(t, 1, root, 0)
			b1, m1 := block(t, 2, m0.Key, 1)
			m0.Uses = 3
			require.NoError(t, tr.Put(b0, m0))
			require.NoError(t, tr.Put(b1, m1))
			require.NoError(t, tr.Put(b1, m1), "a second put of a held block")
			st := tr.Stats()
			require.Equal(t, int64(2), st.Files)
			require.Equal(t, int64(2), st.Written)
			got := make([]byte, len(b1))
			_, err := tr.Get(m1.Key, got)
			require.NoError(t, err)
			require.Equal(t, b1, got)

			// Reopened, the index is the files: parents first, uses kept.
			again := open(t, dir, 1<<20, Raw)
			blocks := again.Blocks()
			require.Len(t, blocks, 2)
			require.Equal(t, m0.Key, blocks[0].Key)
			require.Equal(t, uint32(3), blocks[0].Uses)
			require.Equal(t, c, blocks[1].Codec, "each file names its codec")
			_, err = again.Get(m0.Key, got[:len(b0)])
			require.NoError(t, err)
			require.Equal(t, b0, got[:len(b0)])
			require.Zero(t, again.Stats().Dropped)
		})
	}
}

// Torn, truncated, renamed and unfinished files are dropped at open and
// counted; whole ones stay.
func TestOpenDropsDamagedFiles(t *testing.T) {
	dir := t.TempDir()
	tr := open(t, dir, 1<<20, Raw)
	var metas []Meta
	for i := range 5 {
		b, m := block(t, int64(i), key.Hash{byte(i + 1)}, 0)
		require.NoError(t, tr.Put(b, m))
		metas = append(metas, m)
	}
	path := func(i int) string { return tr.path(metas[i].Key) }
	require.NoError(t, os.Truncate(path(0), 1000))                                                     // truncated
	require.NoError(t, os.Truncate(path(1), 100))                                                      // torn inside the header
	flip(t, path(2), HeaderSize+500)                                                                   // a payload byte changed
	require.NoError(t, os.Rename(path(3), filepath.Join(filepath.Dir(path(3)), key.Hash{7}.String()))) // misnamed
	require.NoError(t, os.WriteFile(path(4)+".123"+tmpSuffix, []byte("half a write"), 0o644))          // unfinished

	again := open(t, dir, 1<<20, Raw)
	st := again.Stats()
	assert.Equal(t, int64(1), st.Files, "only the whole, well-named file")
	assert.Equal(t, int64(5), st.Dropped, "truncated, torn, changed, misnamed, unfinished")
	assert.True(t, again.Has(metas[4].Key))
	for i := range 4 {
		_, err := os.Stat(path(i))
		assert.True(t, os.IsNotExist(err), "file %d left behind", i)
	}
}

func flip(t *testing.T, path string, at int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	require.NoError(t, err)
	defer f.Close()
	var b [1]byte
	_, err = f.ReadAt(b[:], at)
	require.NoError(t, err)
	b[0] ^= 0x20
	_, err = f.WriteAt(b[:], at)
	require.NoError(t, err)
}

// A file changed on disk while the tier runs is found on the read, which
// fails with CORRUPT, deletes it (and what hangs under it) and counts it.
func TestChangedFileIsNeverServed(t *testing.T) {
	for _, tc := range []struct {
		name   string
		damage func(t *testing.T, path string)
	}{
		{"payload byte", func(t *testing.T, p string) { flip(t, p, HeaderSize+3000) }},
		{"file header byte", func(t *testing.T, p string) { flip(t, p, 40) }},
		{"truncated", func(t *testing.T, p string) { require.NoError(t, os.Truncate(p, HeaderSize+10)) }},
		{"replaced by another block", func(t *testing.T, p string) {
			other, om := block(t, 99, key.Hash{1}, 0)
			buf := make([]byte, HeaderSize, HeaderSize+len(other))
			buf = append(buf, other...)
			om.Codec, om.RawLen, om.StoredLen, om.HeaderSum = Raw, int64(len(other)), int64(len(other)), pool.HeaderSum(other)
			om.StoredSum = xxh3Sum(other)
			encodeHeader(buf, &om)
			require.NoError(t, os.WriteFile(p, buf, 0o644))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := open(t, t.TempDir(), 1<<20, Zstd)
			b0, m0 := block(t, 1, key.Hash{1}, 0)
			b1, m1 := block(t, 2, m0.Key, 1)
			require.NoError(t, tr.Put(b0, m0))
			require.NoError(t, tr.Put(b1, m1))
			tc.damage(t, tr.path(m0.Key))
			dst := make([]byte, len(b0))
			_, err := tr.Get(m0.Key, dst)
			require.Equal(t, status.Corrupt, status.Of(err), "%v", err)
			assert.Contains(t, err.Error(), "recomputed")
			assert.False(t, tr.Has(m0.Key))
			assert.False(t, tr.Has(m1.Key), "a child no prefix reaches")
			assert.Equal(t, int64(1), tr.Stats().Dropped)
			_, err = os.Stat(tr.path(m0.Key))
			assert.True(t, os.IsNotExist(err))
			_, err = tr.Get(m0.Key, dst)
			assert.Equal(t, status.NotFound, status.Of(err))
		})
	}
	tr := open(t, t.TempDir(), 1<<20, Raw)
	b, m := block(t, 1, key.Hash{1}, 0)
	require.NoError(t, tr.Put(b, m))
	require.NoError(t, os.Remove(tr.path(m.Key)))
	_, err := tr.Get(m.Key, make([]byte, len(b)))
	assert.Equal(t, status.NotFound, status.Of(err), "a file deleted behind the tier")
}

func TestBudgetEvicts(t *testing.T) {
	b, _ := block(t, 0, key.Hash{}, 0)
	per := int64(HeaderSize + len(b))
	tr := open(t, t.TempDir(), 3*per, Raw)
	var keys []key.BlockKey
	for i := range 5 {
		bi, m := block(t, int64(i), key.Hash{byte(i + 1)}, 0)
		require.NoError(t, tr.Put(bi, m))
		keys = append(keys, m.Key)
	}
	st := tr.Stats()
	assert.Equal(t, int64(3), st.Files)
	assert.Equal(t, int64(2), st.Evicted)
	assert.False(t, tr.Has(keys[0]))
	assert.True(t, tr.Has(keys[4]))
	// Reopened with a smaller budget, it keeps what fits.
	small := open(t, tr.cfg.Dir, 2*per, Raw)
	assert.Equal(t, int64(2), small.Stats().Files)
	entries, err := os.ReadDir(filepath.Join(small.Dir(), keys[4].String()[:2]))
	require.NoError(t, err)
	assert.NotEmpty(t, entries)
}

// Under pressure the tier keeps chains whole from their first block: a
// block does not push out its own prefix, and one whose prefix is not on
// the disk pushes out nothing.
func TestBudgetKeepsChainsWhole(t *testing.T) {
	b, _ := block(t, 0, key.Hash{}, 0)
	per := int64(HeaderSize + len(b))
	tr := open(t, t.TempDir(), 3*per, Raw)
	parent := key.Hash{1}
	var chain []Meta
	for i := range 5 {
		bi, m := block(t, int64(i), parent, uint32(i))
		err := tr.Put(bi, m)
		if i < 3 {
			require.NoError(t, err, "block %d", i)
		} else {
			require.Equal(t, status.PoolFull, status.Of(err), "block %d: %v", i, err)
		}
		chain = append(chain, m)
		parent = m.Key
	}
	for i, m := range chain {
		assert.Equal(t, i < 3, tr.Has(m.Key), "block %d", i)
	}
	// Another chain's first block takes the place of this one's leaf.
	other, om := block(t, 9, key.Hash{2}, 0)
	require.NoError(t, tr.Put(other, om))
	assert.False(t, tr.Has(chain[2].Key))
	assert.True(t, tr.Has(chain[1].Key))
}

// A filesystem smaller than the budget: a write that finds it full lowers
// the budget to what the tier holds, evicts and writes; nothing half
// written stays, and every block read back is whole.
func TestDiskFull(t *testing.T) {
	dir := testenv.TmpFS(t, "64k")
	tr := open(t, dir, 1<<30, Raw)
	var held []Meta
	blocks := map[key.BlockKey][]byte{}
	for i := range 12 {
		b, m := block(t, int64(i), key.Hash{byte(i + 1)}, 0)
		require.NoError(t, tr.Put(b, m), "block %d", i)
		held = append(held, m)
		blocks[m.Key] = b
	}
	st := tr.Stats()
	assert.Less(t, st.Budget, int64(1<<30), "the budget follows the filesystem")
	assert.Positive(t, st.Evicted)
	assert.True(t, tr.Has(held[11].Key), "the last block was written")
	for _, m := range tr.Blocks() {
		dst := make([]byte, len(blocks[m.Key]))
		_, err := tr.Get(m.Key, dst)
		require.NoError(t, err)
		require.True(t, bytes.Equal(blocks[m.Key], dst))
	}
	tmp, err := filepath.Glob(filepath.Join(tr.Dir(), "*", "*"+tmpSuffix))
	require.NoError(t, err)
	assert.Empty(t, tmp, "temporary files left by failed writes")
	// A block larger than the whole filesystem fails with a clear error.
	big := make([]byte, 128<<10)
	copy(big, blocks[held[11].Key])
	err = tr.Put(big, Meta{Key: key.Hash{0xbb}, Parent: key.Hash{1}, Model: model})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "disk tier")
	assert.Positive(t, tr.Stats().WriteErrors)
}

// A directory that cannot be written is refused at open with a clear
// error; one that becomes read-only later fails each write, clearly, and
// the blocks already there stay readable.
func TestUnwritableDirectory(t *testing.T) {
	ro := testenv.TmpFS(t, "1m")
	testenv.ReadOnly(t, ro)
	_, err := Open(Config{Dir: ro, Bytes: 1 << 20})
	require.Equal(t, status.Config, status.Of(err), "%v", err)
	assert.Contains(t, err.Error(), "disk tier")

	dir := testenv.TmpFS(t, "1m")
	tr := open(t, dir, 1<<20, Raw)
	b, m := block(t, 1, key.Hash{1}, 0)
	require.NoError(t, tr.Put(b, m))
	testenv.ReadOnly(t, dir)
	b2, m2 := block(t, 2, key.Hash{2}, 0)
	err = tr.Put(b2, m2)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "disk tier: writing block")
	assert.False(t, tr.Has(m2.Key))
	got := make([]byte, len(b))
	_, err = tr.Get(m.Key, got)
	require.NoError(t, err)
	assert.Equal(t, b, got)
}

func TestOpenRefuses(t *testing.T) {
	for _, cfg := range []Config{{}, {Dir: t.TempDir()}, {Dir: t.TempDir(), Bytes: 1, Codec: 7}} {
		_, err := Open(cfg)
		assert.Equal(t, status.Config, status.Of(err), "%+v: %v", cfg, err)
	}
	file := filepath.Join(t.TempDir(), "file")
	require.NoError(t, os.WriteFile(file, nil, 0o644))
	_, err := Open(Config{Dir: file, Bytes: 1 << 20})
	assert.Equal(t, status.Config, status.Of(err), "a file as directory: %v", err)
}

// FuzzDecodeHeader: any 128 bytes decode to an error or to a header that
// encodes back to the same bytes.
func FuzzDecodeHeader(f *testing.F) {
	b, m := block(f, 1, key.Hash{1}, 3)
	m.Codec, m.RawLen, m.StoredLen, m.StoredSum, m.HeaderSum = Raw, int64(len(b)), int64(len(b)), 5, 6
	var hdr [HeaderSize]byte
	encodeHeader(hdr[:], &m)
	f.Add(hdr[:])
	f.Add(make([]byte, HeaderSize))
	f.Fuzz(func(t *testing.T, data []byte) {
		got, err := decodeHeader(data)
		if err != nil {
			require.Equal(t, status.Corrupt, status.Of(err))
			return
		}
		var again [HeaderSize]byte
		encodeHeader(again[:], &got)
		require.Equal(t, data[:HeaderSize], again[:])
	})
}

// FuzzDecode: stored bytes of any shape decode to exactly the block's size
// or fail with CORRUPT, never panic.
func FuzzDecode(f *testing.F) {
	b, _ := block(f, 1, key.Hash{1}, 0)
	z, err := Encode(Zstd, nil, b, nil)
	require.NoError(f, err)
	f.Add(uint16(Zstd), z)
	f.Add(uint16(Raw), b[:100])
	f.Fuzz(func(t *testing.T, c uint16, stored []byte) {
		dst := make([]byte, 512)
		if err := Decode(Codec(c), dst, stored, nil); err != nil {
			require.Equal(t, status.Corrupt, status.Of(err))
		}
	})
}

func xxh3Sum(b []byte) uint64 { return xxh3.Hash(b) }

func BenchmarkShuffle(b *testing.B) {
	src := make([]byte, 3<<20)
	rand.New(rand.NewSource(1)).Read(src)
	dst := make([]byte, len(src))
	b.SetBytes(int64(len(src)))
	for b.Loop() {
		Shuffle(dst, src)
		Unshuffle(src, dst)
	}
}
