// Package disk is a store node's second tier: blocks kept in files, one per
// block, under a directory, within a byte budget. It never serves a block
// it cannot prove whole: a file is checked (its header, the sum of its
// stored bytes, the block's own header and layer sums) when the tier opens
// and again on every read, and one that fails is deleted and counted. The
// store node reads blocks back into its pool before anyone restores them,
// so a damaged file costs a recompute, never a wrong block.
//
// Files are named by block key; a restart rebuilds the index from them.
// The index is a residency tree over the files, so the budget evicts as
// the pool does (leaves first, by the configured policy).
package disk

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/zeebo/xxh3"

	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/residency"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Config configures a Tier.
type Config struct {
	// Dir holds the tier's files (in a subdirectory of its own).
	Dir string
	// Bytes bounds the files' total size.
	Bytes  int64
	Codec  Codec
	Policy residency.Policy
	// Log hears what no caller can (a file dropped, a full filesystem).
	Log *slog.Logger
}

// Stats are the tier's counters since Open and its size now.
type Stats struct {
	Files, Bytes, Budget int64
	Written              int64 // blocks written
	WriteErrors          int64 // writes that failed (disk full, directory unwritable)
	Read                 int64 // blocks read back and verified
	Dropped              int64 // files deleted because they were torn, truncated or changed
	Evicted              int64 // files deleted to stay within the budget
	RawBytes             int64 // block bytes written, before the codec
	StoredBytes          int64 // file bytes written
}

// Tier is a directory of block files. Safe for concurrent use.
type Tier struct {
	cfg Config
	dir string
	log *slog.Logger

	mu    sync.Mutex
	index *residency.Tree[Meta]

	written, writeErrors, read, dropped, evicted, rawBytes, storedBytes atomic.Int64
}

// subdir is where a tier keeps its files under Config.Dir, named by the
// file format so that another format never reads them.
const subdir = "mcbridge-blocks-v1"

const tmpSuffix = ".tmp"

// Open opens or creates the tier in cfg.Dir and indexes the files there.
// Files that are torn, truncated or damaged are deleted and counted in
// Stats().Dropped; a directory that cannot be written is refused.
func Open(cfg Config) (*Tier, error) {
	if cfg.Dir == "" {
		return nil, status.Errorf(status.Config, "disk tier: no directory")
	}
	if cfg.Bytes <= 0 {
		return nil, status.Errorf(status.Config, "disk tier: budget of %d bytes", cfg.Bytes)
	}
	if cfg.Codec != Raw && cfg.Codec != Zstd {
		return nil, status.Errorf(status.Config, "disk tier: codec %d", cfg.Codec)
	}
	index, err := residency.New[Meta](residency.Config{BudgetBytes: cfg.Bytes, Policy: cfg.Policy})
	if err != nil {
		return nil, err
	}
	t := &Tier{cfg: cfg, dir: filepath.Join(cfg.Dir, subdir), log: cfg.Log, index: index}
	if t.log == nil {
		t.log = slog.Default()
	}
	if err := os.MkdirAll(t.dir, 0o755); err != nil {
		return nil, status.Wrap(status.Config, err, "disk tier: creating "+t.dir)
	}
	if err := t.probe(); err != nil {
		return nil, err
	}
	if err := t.rebuild(); err != nil {
		return nil, err
	}
	return t, nil
}

// probe writes and removes a file, so that a directory the process cannot
// write is refused at start rather than at the first spill.
func (t *Tier) probe() error {
	f, err := os.CreateTemp(t.dir, "probe-*"+tmpSuffix)
	if err != nil {
		return status.Wrap(status.Config, err, "disk tier: "+t.dir+" is not writable")
	}
	name := f.Name()
	f.Close()
	return os.Remove(name)
}

// rebuild indexes every whole file, parents before children, and deletes
// the rest.
func (t *Tier) rebuild() error {
	var metas []Meta
	err := filepath.WalkDir(t.dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			return nil
		}
		if strings.HasSuffix(path, tmpSuffix) {
			// A write that never reached its rename: a crash or a kill.
			t.drop(path, "an unfinished write")
			return nil
		}
		m, err := t.check(path)
		if err != nil {
			t.drop(path, err.Error())
			return nil
		}
		metas = append(metas, m)
		return nil
	})
	if err != nil {
		return status.Wrap(status.Config, err, "disk tier: reading "+t.dir)
	}
	// Parents first, so chains link up; the most used first within a
	// depth, so a budget lowered since the files were written keeps them.
	sort.Slice(metas, func(i, j int) bool {
		if metas[i].Depth != metas[j].Depth {
			return metas[i].Depth < metas[j].Depth
		}
		return metas[i].Uses > metas[j].Uses
	})
	for _, m := range metas {
		t.mu.Lock()
		err := t.insertLocked(m)
		t.mu.Unlock()
		switch {
		case status.Of(err) == status.PoolFull:
			t.evicted.Add(1)
			t.log.Warn("mcbridge: disk tier: over its budget at open; removing a block file", "file", t.path(m.Key))
			_ = os.Remove(t.path(m.Key))
		case err != nil:
			t.drop(t.path(m.Key), err.Error())
		}
	}
	return nil
}

// check reads a whole file and verifies it is a block file this package
// wrote, named for its key, with its stored bytes intact.
func (t *Tier) check(path string) (Meta, error) {
	f, err := os.Open(path)
	if err != nil {
		return Meta{}, err
	}
	defer f.Close()
	var hdr [HeaderSize]byte
	if _, err := io.ReadFull(f, hdr[:]); err != nil {
		return Meta{}, status.Errorf(status.Corrupt, "truncated header: %v", err)
	}
	m, err := decodeHeader(hdr[:])
	if err != nil {
		return m, err
	}
	if filepath.Base(path) != m.Key.String() {
		return m, status.Errorf(status.Corrupt, "holds block %s", m.Key)
	}
	st, err := f.Stat()
	if err != nil {
		return m, err
	}
	if st.Size() != m.FileSize() {
		return m, status.Errorf(status.Corrupt, "%d bytes, its header says %d: truncated or torn", st.Size(), m.FileSize())
	}
	h := xxh3.New()
	if _, err := io.Copy(h, f); err != nil {
		return m, err
	}
	if h.Sum64() != m.StoredSum {
		return m, status.Errorf(status.Corrupt, "stored bytes do not match their checksum")
	}
	return m, nil
}

// drop deletes a file that cannot be served.
func (t *Tier) drop(path, why string) {
	t.dropped.Add(1)
	t.log.Warn("mcbridge: disk tier: dropping a block file", "file", path, "why", why)
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.log.Error("mcbridge: disk tier: removing a block file", "file", path, "err", err)
	}
}

func (t *Tier) path(k key.BlockKey) string {
	s := k.String()
	return filepath.Join(t.dir, s[:2], s)
}

// insertLocked indexes m under its parent, or under the parent's key as a
// root when the parent has no file here. t.mu is held.
func (t *Tier) insertLocked(m Meta) error {
	b := residency.Block[Meta]{Key: m.Key, Value: m, Bytes: m.FileSize(), Cost: float64(m.Depth + 1), Uses: m.Uses}
	if _, ok := t.index.Get(m.Parent); ok {
		_, err := t.index.Insert(m.Parent, b)
		return err
	}
	_, err := t.index.InsertChain(m.Parent, []residency.Block[Meta]{b})
	return err
}

// Has reports whether the tier holds a file for k.
func (t *Tier) Has(k key.BlockKey) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	_, ok := t.index.Get(k)
	return ok
}

// Touch counts a use of the blocks (their ranking in the budget).
func (t *Tier) Touch(keys ...key.BlockKey) {
	t.mu.Lock()
	t.index.Touch(keys...)
	t.mu.Unlock()
}

// Put writes a block of the pool (verified by the caller) under m's key,
// parent, model, depth and uses; the rest of m is filled in here. A block
// the tier holds already is left as it is. Disk full: the tier lowers its
// budget to what fits, evicts, and tries once more; the error says what
// happened.
func (t *Tier) Put(block []byte, m Meta) error {
	if t.Has(m.Key) {
		return nil
	}
	m.Codec = t.cfg.Codec
	m.RawLen = int64(len(block))
	m.HeaderSum = pool.HeaderSum(block)
	buf := make([]byte, HeaderSize, HeaderSize+len(block))
	buf, err := Encode(m.Codec, buf, block, nil)
	if err != nil {
		return err
	}
	stored := buf[HeaderSize:]
	m.StoredLen = int64(len(stored))
	m.StoredSum = xxh3.Hash(stored)
	encodeHeader(buf, &m)
	if err := t.make(&m); err != nil {
		t.writeErrors.Add(1)
		return err
	}
	err = t.write(m.Key, buf)
	if isNoSpace(err) {
		// The filesystem holds less than the budget: keep what fits.
		t.mu.Lock()
		have := t.index.Bytes()
		t.mu.Unlock()
		t.shrink(have)
		t.log.Warn("mcbridge: disk tier: the filesystem is full; the tier keeps at most what it held", "dir", t.dir, "bytes", have)
		if err = t.make(&m); err == nil {
			err = t.write(m.Key, buf)
		}
	}
	if err != nil {
		t.writeErrors.Add(1)
		code := status.Internal
		switch {
		case isNoSpace(err):
			code = status.PoolFull
		case errors.Is(err, fs.ErrPermission):
			code = status.Config
		}
		return status.Wrap(code, err, fmt.Sprintf("disk tier: writing block %s", m.Key))
	}
	t.mu.Lock()
	err = t.insertLocked(m)
	t.mu.Unlock()
	if err != nil {
		// Another writer indexed it meanwhile, or the budget shrank.
		if !t.Has(m.Key) {
			_ = os.Remove(t.path(m.Key))
		}
		return nil
	}
	t.written.Add(1)
	t.rawBytes.Add(m.RawLen)
	t.storedBytes.Add(m.FileSize())
	return nil
}

func isNoSpace(err error) bool {
	return errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT)
}

// write writes a file under a temporary name and renames it.
func (t *Tier) write(k key.BlockKey, buf []byte) error {
	final := t.path(k)
	if err := os.MkdirAll(filepath.Dir(final), 0o755); err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(final), filepath.Base(final)+".*"+tmpSuffix)
	if err != nil {
		return err
	}
	_, err = f.Write(buf)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), final)
	}
	if err != nil {
		_ = os.Remove(f.Name())
	}
	return err
}

// make evicts files until m's fits the budget. Under pressure the tier
// keeps chains whole from their first block: m's parent (and so its whole
// prefix) is kept while files go for it, and a block whose parent has no
// file here (no reader reaches it from the disk alone) is not worth
// evicting anything for.
func (t *Tier) make(m *Meta) error {
	n := m.FileSize()
	t.mu.Lock()
	if t.index.Bytes()+n <= t.cfg.Bytes {
		t.mu.Unlock()
		return nil
	}
	_, parentHeld := t.index.Get(m.Parent)
	if !parentHeld && m.Depth > 0 {
		t.mu.Unlock()
		return status.Errorf(status.PoolFull, "disk tier full: block %s is not written, its prefix is not on the disk", m.Key)
	}
	if parentHeld {
		_ = t.index.Pin(m.Parent)
	}
	gone, err := t.index.Evict(n)
	if parentHeld {
		_ = t.index.Unpin(m.Parent)
	}
	t.mu.Unlock()
	if err != nil {
		return status.Wrap(status.PoolFull, err, "disk tier full: block "+m.Key.String()+" is not written")
	}
	t.unlink(gone, &t.evicted)
	return nil
}

// shrink lowers the budget to n bytes.
func (t *Tier) shrink(n int64) {
	t.mu.Lock()
	old := t.index
	t.cfg.Bytes = max(n, 1)
	fresh, err := residency.New[Meta](residency.Config{BudgetBytes: t.cfg.Bytes, Policy: t.cfg.Policy})
	if err != nil {
		t.mu.Unlock()
		return
	}
	var keep []Meta
	old.Walk(func(e residency.Entry[Meta]) bool {
		keep = append(keep, e.Value)
		return true
	})
	t.index = fresh
	var over []Meta
	for _, m := range keep {
		if t.insertLocked(m) != nil {
			over = append(over, m)
		}
	}
	t.mu.Unlock()
	for _, m := range over {
		t.evicted.Add(1)
		_ = os.Remove(t.path(m.Key))
	}
}

func (t *Tier) unlink(es []residency.Entry[Meta], n *atomic.Int64) {
	for _, e := range es {
		n.Add(1)
		if err := os.Remove(t.path(e.Key)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			t.log.Error("mcbridge: disk tier: removing a block file", "file", t.path(e.Key), "err", err)
		}
	}
}

// Get reads block k into dst, which must be its raw size, and verifies it:
// the file, then the block's header (key, parent, model, depth) and every
// layer's sum. A file that fails is deleted (with its descendants, which
// no prefix reaches without it) and the error is status.Corrupt; a file
// gone from the disk is status.NotFound.
func (t *Tier) Get(k key.BlockKey, dst []byte) (Meta, error) {
	t.mu.Lock()
	m, ok := t.index.Get(k)
	t.mu.Unlock()
	if !ok {
		return m, status.Errorf(status.NotFound, "disk tier: no block %s", k)
	}
	if int64(len(dst)) != m.RawLen {
		return m, status.Errorf(status.InvalidArg, "disk tier: block %s is %d bytes, buffer %d", k, m.RawLen, len(dst))
	}
	err := t.readInto(m, dst)
	if err == nil {
		t.read.Add(1)
		return m, nil
	}
	t.forget(k)
	if errors.Is(err, fs.ErrNotExist) {
		t.dropped.Add(1)
		t.log.Warn("mcbridge: disk tier: a block file disappeared", "file", t.path(k))
		return m, status.Wrap(status.NotFound, err, "disk tier: block "+k.String())
	}
	t.drop(t.path(k), err.Error())
	return m, status.Wrap(status.Corrupt, err, fmt.Sprintf("disk tier: block %s in %s (dropped; it will be recomputed)", k, t.path(k)))
}

func (t *Tier) readInto(m Meta, dst []byte) error {
	buf, err := os.ReadFile(t.path(m.Key))
	if err != nil {
		return err
	}
	got, err := decodeHeader(buf)
	switch {
	case err != nil:
		return err
	case got != m:
		return status.Errorf(status.Corrupt, "header changed since the tier indexed it")
	case int64(len(buf)) != m.FileSize():
		return status.Errorf(status.Corrupt, "%d bytes, its header says %d: truncated", len(buf), m.FileSize())
	case xxh3.Hash(buf[HeaderSize:]) != m.StoredSum:
		return status.Errorf(status.Corrupt, "stored bytes do not match their checksum")
	}
	if err := Decode(m.Codec, dst, buf[HeaderSize:], nil); err != nil {
		return err
	}
	_, h, err := pool.VerifyBlock(dst, &pool.Expect{Key: m.Key, Parent: m.Parent, Model: m.Model, Generation: pool.Generation(dst)})
	switch {
	case err != nil:
		return err
	case h.Depth != m.Depth || pool.HeaderSum(dst) != m.HeaderSum:
		return status.Errorf(status.Corrupt, "the block differs from what its file header says")
	}
	return nil
}

// forget unindexes k and what hangs under it; their files go except k's,
// which the caller handles.
func (t *Tier) forget(k key.BlockKey) {
	t.mu.Lock()
	gone, _ := t.index.Remove(k)
	t.mu.Unlock()
	var under []residency.Entry[Meta]
	for _, e := range gone {
		if e.Key != k {
			under = append(under, e)
		}
	}
	t.unlink(under, &t.evicted)
}

// Remove deletes k's file and its descendants'.
func (t *Tier) Remove(k key.BlockKey) {
	if !t.Has(k) {
		return
	}
	t.forget(k)
	_ = os.Remove(t.path(k))
	t.evicted.Add(1)
}

// Blocks lists what the tier holds, each parent before its children.
func (t *Tier) Blocks() []Meta {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []Meta
	t.index.Walk(func(e residency.Entry[Meta]) bool {
		m := e.Value
		m.Uses = e.Uses
		out = append(out, m)
		return true
	})
	return out
}

// Stats returns the counters and the tier's size.
func (t *Tier) Stats() Stats {
	t.mu.Lock()
	files, bytes, budget := int64(t.index.Len()), t.index.Bytes(), t.cfg.Bytes
	t.mu.Unlock()
	return Stats{
		Files: files, Bytes: bytes, Budget: budget,
		Written: t.written.Load(), WriteErrors: t.writeErrors.Load(), Read: t.read.Load(),
		Dropped: t.dropped.Load(), Evicted: t.evicted.Load(),
		RawBytes: t.rawBytes.Load(), StoredBytes: t.storedBytes.Load(),
	}
}

// Dir is where the files are.
func (t *Tier) Dir() string { return t.dir }

// Meta returns what the tier holds for k.
func (t *Tier) Meta(k key.BlockKey) (Meta, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	m, ok := t.index.Get(k)
	return m, ok
}
