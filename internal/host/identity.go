package host

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"

	"github.com/zeebo/xxh3"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/gguf"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout"
	"github.com/mcbridge/mcbridge/internal/llamastate"
	"github.com/mcbridge/mcbridge/internal/mem"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/status"
)

// probeTokens is the fixed prompt whose KV identifies a node's model and
// numerics. Ids every vocabulary has; eight positions are enough for every
// rope setting to show (position 0 is never rotated).
var probeTokens = []int32{1, 2, 3, 5, 8, 13, 21, 34}

// ProbeTokens returns the probe prompt: a host decodes it from position 0
// into an empty sequence and hands that sequence's KV to Register.
func ProbeTokens() []int32 { return append([]int32(nil), probeTokens...) }

// Identity is what a host says about its model. The rest of the fingerprint
// (weights digest, architecture, the probe) is derived here, the same way
// for every host.
type Identity struct {
	// LlamaVersion is the tag the host was built from; empty for hosts that
	// only exchange state blobs, whose parse checks the format instead.
	LlamaVersion string
	GGUFPath     string
	BlockTokens  int // 0: the bridge's configured default
	// Extra names what changes KV bytes that the probe cannot see. The
	// hosts in this repository pass none: what they apply server-wide
	// (adapters, control vectors, rope overrides) changes the probe's KV.
	Extra string
	// Partial describes the host's partial state (key.Model.Partial);
	// empty when its KV rows are its whole state.
	Partial string
	// PartialKVStreams is, for a partial state that is a KV cache's (a
	// sliding-window memory's window cache), the KV streams of the host's
	// context, which llama.cpp frames such a state by (Model.Snapshot); 0
	// for another partial state. It is no part of the fingerprint: hosts of
	// any stream count share the snapshots.
	PartialKVStreams int
	// StateSnapshots says that a host registering with RegisterState takes
	// snapshots of a partial state from its states (Model.SaveStateSnapshot)
	// and restores them (Model.RestoreState): without it, the states of a
	// sliding-window or hybrid memory are refused.
	StateSnapshots bool
	Format         Format
}

// Model is a registered model with the format its hosts exchange.
type Model struct {
	*bridge.Model
	Format Format
	// pos2D says that, in a format with cell extensions, a cell's 2-D
	// position is its token's position (M-RoPE), not zero.
	pos2D bool
	// tail is what the model's states carry after the attention layers'
	// KV, for a model registered from a state with snapshots; window is
	// its sliding window, as the model file names it; recurrentBytes is the
	// length of the recurrent state an indexedRecurrentTail starts with.
	tail           stateTail
	window         int
	recurrentBytes int
	// partialKVStreams is Identity.PartialKVStreams of a host with tensors.
	partialKVStreams int
}

// stateTail is what a memory's states carry after its attention layers'
// KV cache: for a state host, the partial state of docs/design.md §5.9.
type stateTail int

const (
	noTail        stateTail = iota
	windowTail              // a sliding-window memory's window cache: a KV cache's state
	recurrentTail           // a hybrid memory's recurrent state
	// a hybrid memory's recurrent state, then its indexer cache's state
	// (llama_memory_hybrid_idx), whose snapshot carries the indexer's rows
	// of every position before it
	indexedRecurrentTail
	// the whole memory state of a model without KV layers
	// (registerWholeState)
	wholeTail
)

// textExt is the extension llama.cpp gives the cell of position pos when it
// computes text token tok there (llama_kv_cache::apply_ubatch): a text
// prompt broadcasts its position to M-RoPE's spatial axes.
func (m *Model) textExt(pos, tok int32) llamastate.CellExt {
	if m.pos2D {
		return llamastate.CellExt{X: pos, Y: pos, Tok: tok}
	}
	return llamastate.CellExt{Tok: tok}
}

// Register registers id's model with b. probe and cells locate the KV of
// the probe prompt, positions 0..len(ProbeTokens())-1, in the host's
// memory; only those rows are read.
func Register(b *bridge.Bridge, id Identity, probe kvlayout.Layout, cells []uint32) (*Model, error) {
	if id.LlamaVersion != "" && id.LlamaVersion != LlamaVersion {
		return nil, status.Errorf(status.ModelMismatch, "the host is llama.cpp %s; this library reads the state format of %s", id.LlamaVersion, LlamaVersion)
	}
	shapes, err := id.Format.shapes()
	if err != nil {
		return nil, err
	}
	arch, content, err := modelFile(id.GGUFPath)
	if err != nil {
		return nil, err
	}
	digest, err := probeDigest(id.Format.VTrans, shapes, probe, cells)
	if err != nil {
		return nil, err
	}
	n := len(shapes)
	p := key.Model{
		LlamaVersion: LlamaVersion,
		Arch:         arch,
		ContentHash:  content,
		NLayer:       uint32(n),
		TypeK:        id.Format.Layers[0].KType,
		TypeV:        id.Format.Layers[0].VType,
		VTrans:       id.Format.VTrans,
		KVProbe:      digest,
		BlockTokens:  uint32(max(id.BlockTokens, 0)),
		Extra:        id.Extra,
		Partial:      id.Partial,
	}
	if k := id.Format.SecondLayers; k > 0 {
		// Which layers each cache holds changes no row, but a state of two
		// caches is framed by it.
		p.Extra = strings.TrimPrefix(fmt.Sprintf("%s;caches %d+%d", id.Extra, n-k, k), ";")
	}
	spec := bridge.ModelSpec{KRow: make([]int, n), VRow: make([]int, n), VElem: make([]int, n)}
	for l, s := range shapes {
		p.NEmbdKGQA = append(p.NEmbdKGQA, s.nEmbdK)
		p.NEmbdVGQA = append(p.NEmbdVGQA, s.nEmbdV)
		spec.KRow[l], spec.VRow[l], spec.VElem[l] = s.kRow, s.vRow, s.vElem
	}
	spec.Params = p
	spec.Name = strings.TrimSuffix(filepath.Base(id.GGUFPath), ".gguf")
	m, err := b.RegisterModel(spec)
	if err != nil {
		return nil, err
	}
	return &Model{Model: m, Format: id.Format, partialKVStreams: id.PartialKVStreams}, nil
}

// Snapshot is the snapshot of ld, a load of m, as the host's context reads
// it: a window cache's state (llama_state_seq_get_data's, PARTIAL_ONLY) is
// framed for the context's KV streams, whatever the stream count of the
// context that took it (llama.cpp's state_read refuses a state of another
// count); any other partial state comes as it was taken. nil for a model
// without a partial state. The bytes are valid until the load ends.
func (m *Model) Snapshot(ld *bridge.Load) ([]byte, error) {
	snap, err := ld.Snapshot()
	if err != nil || snap == nil || m.partialKVStreams == 0 {
		return snap, err
	}
	out, err := llamastate.ReframeSeqState(snap, m.partialKVStreams)
	if err != nil {
		return nil, status.Wrap(status.Corrupt, err, "the snapshot is no window cache's state")
	}
	return out, nil
}

// RegisterState registers a model from a state of the probe sequence, for
// hosts that see KV only as llama.cpp states: the format is the state's,
// that of one KV cache or of two (Format.SecondLayers), or, for a
// sliding-window or hybrid memory registered with id.StateSnapshots, that
// of its attention layers' cache, which its partial state follows. It returns the
// number of streams the state was written with, which states restored into
// the same context must carry. The state of other memories (several caches
// that are not two KV caches) fails with Parse's *llamastate.CachesError.
func RegisterState(b *bridge.Bridge, id Identity, probeState []byte) (*Model, int, error) {
	st, err := llamastate.Parse(probeState)
	tail, window, recBytes := noTail, 0, 0
	if err != nil {
		mem, merr := memoryOf(id.GGUFPath)
		if merr != nil {
			return nil, 0, merr
		}
		window = int(mem.window)
		if why := mem.notKV(); why != "" {
			if !id.StateSnapshots {
				return nil, 0, status.Wrap(status.Unsupported, err, why)
			}
			if slices.Contains(recurrentArchs, mem.arch) {
				return registerRecurrent(b, id, probeState)
			}
			if slices.Contains(wholeStateArchs, mem.arch) {
				return registerWholeState(b, id, probeState)
			}
			if st, tail, id.Partial, recBytes, err = partialProbe(mem, probeState); err != nil {
				return nil, 0, status.Wrap(status.Unsupported, err, why)
			}
		}
		if ce := (*llamastate.CachesError)(nil); errors.As(err, &ce) {
			if two, err2 := llamastate.ParseTwoCaches(probeState); err2 == nil {
				st, err = two, nil
			}
		}
	}
	if err != nil {
		return nil, 0, err
	}
	f, si, err := FormatOf(st)
	if err != nil {
		return nil, 0, err
	}
	cells, err := st.PositionCells(len(probeTokens))
	if err != nil {
		return nil, 0, status.Wrap(status.InvalidArg, err, "the probe state")
	}
	// The rows must be the probe's: a state of other tokens would pass the
	// digest off as this node's.
	if st.Kind == llamastate.SlotFile {
		toks, err := st.PromptTokens()
		if err != nil {
			return nil, 0, err
		}
		if len(toks) < len(probeTokens) || !equalTokens(toks[:len(probeTokens)], probeTokens) {
			return nil, 0, status.Errorf(status.InvalidArg, "the probe state holds other tokens")
		}
	}
	pos2D, err := probeExt(st, si, cells)
	if err != nil {
		return nil, 0, err
	}
	id.Format = f
	rows := st
	if st.Second != nil {
		// One layout of every layer's rows, in cells 0..n-1.
		if rows, err = st.Merge(len(probeTokens)); err != nil {
			return nil, 0, err
		}
		for i := range cells {
			cells[i] = i
		}
	}
	lo := StateLayout(&rows.Streams[si])
	cs := make([]uint32, len(cells))
	for i, c := range cells {
		cs[i] = uint32(c)
	}
	m, err := Register(b, id, lo, cs)
	runtime.KeepAlive(rows)
	if err != nil {
		return nil, 0, err
	}
	m.pos2D = pos2D
	m.tail, m.recurrentBytes = tail, recBytes
	if tail == windowTail {
		m.window = window
	}
	return m, len(st.Streams), nil
}

// registerRecurrent registers, from the probe's state, a memory that is
// one recurrent state (Mamba): a model without KV layers
// (bridge.Model.SnapshotOnly), whose states are snapshots alone. Its probe
// digest is of the probe's recurrent state, which the weights and numerics
// fix as they fix a KV probe's rows; its partial state is named by the
// architecture and the state's size, which its shapes and types fix.
func registerRecurrent(b *bridge.Bridge, id Identity, probe []byte) (*Model, int, error) {
	st, rec, err := llamastate.ParseRecurrent(probe)
	if err != nil {
		return nil, 0, status.Wrap(status.Unsupported, err, "a recurrent memory's probe state")
	}
	if pos, _ := llamastate.RecurrentPos(rec); int(pos) != len(probeTokens)-1 {
		return nil, 0, status.Errorf(status.InvalidArg, "the probe state is at position %d, the probe ends at %d", pos, len(probeTokens)-1)
	}
	if err := slotListsTokens(st, probeTokens); err != nil {
		return nil, 0, err
	}
	m, err := registerStateOnly(b, id, rec, func(arch string) string {
		return fmt.Sprintf("state recurrent %s bytes %d", arch, len(rec))
	})
	if err != nil {
		return nil, 0, err
	}
	return &Model{Model: m, tail: recurrentTail}, 1, nil
}

// registerWholeState registers, from the probe's state, a memory whose
// state this package reads no part of (wholeStateArchs) as a model without
// KV layers whose snapshots are its whole state after the framing: only
// llama.cpp reads it. The probe digest is of those bytes, which the
// weights, the numerics and the context's KV streams (which frame its
// caches' states) fix, so that only contexts of one stream count share.
func registerWholeState(b *bridge.Bridge, id Identity, probe []byte) (*Model, int, error) {
	st, mem, err := llamastate.ParseFramed(probe)
	if err != nil {
		return nil, 0, status.Wrap(status.Unsupported, err, "the probe state")
	}
	if err := slotListsTokens(st, probeTokens); err != nil {
		return nil, 0, err
	}
	m, err := registerStateOnly(b, id, mem, func(arch string) string { return "state whole " + arch })
	if err != nil {
		return nil, 0, err
	}
	return &Model{Model: m, tail: wholeTail}, 1, nil
}

// registerStateOnly registers a model without KV layers whose probe state
// is probe: its digest names the weights and numerics as a probe's KV rows
// do. partial names the state, given the model file's architecture.
func registerStateOnly(b *bridge.Bridge, id Identity, probe []byte, partial func(arch string) string) (*bridge.Model, error) {
	arch, content, err := modelFile(id.GGUFPath)
	if err != nil {
		return nil, err
	}
	h := xxh3.New()
	_, _ = h.Write(probeDomain)
	_, _ = h.Write(key.TokenBytes(probeTokens))
	_, _ = h.Write(probe)
	p := key.Model{
		LlamaVersion: LlamaVersion,
		Arch:         arch,
		ContentHash:  content,
		KVProbe:      key.FromU128(h.Sum128()),
		BlockTokens:  uint32(max(id.BlockTokens, 0)),
		Extra:        id.Extra,
		Partial:      partial(arch),
	}
	return b.RegisterModel(bridge.ModelSpec{Params: p, Name: strings.TrimSuffix(filepath.Base(id.GGUFPath), ".gguf")})
}

// RegisterPartialOnly registers, for a host that hands over tensors, a
// model without KV rows: a memory whose whole state is its partial state
// (id.Partial), one recurrent state (Mamba) or a window cache beside one
// (LFM2 whose attention layers all have a window). probe is that partial
// state of the probe sequence, as llama.cpp writes it (PARTIAL_ONLY), and
// its digest names the weights and numerics as a probe's KV rows do; the
// model is bridge.Model.SnapshotOnly, and its host snapshots the state
// and loads snapshots alone.
func RegisterPartialOnly(b *bridge.Bridge, id Identity, probe []byte) (*Model, error) {
	if id.LlamaVersion != LlamaVersion {
		return nil, status.Errorf(status.ModelMismatch, "the host is llama.cpp %s; this library reads the state format of %s", id.LlamaVersion, LlamaVersion)
	}
	switch {
	case id.Partial == "":
		return nil, status.Errorf(status.InvalidArg, "a model without KV layers needs a partial_state")
	case len(probe) == 0:
		return nil, status.Errorf(status.InvalidArg, "an empty probe state")
	case id.PartialKVStreams != 0:
		// Its snapshot is not a window cache's state alone, which is all
		// Model.Snapshot frames again.
		return nil, status.Errorf(status.InvalidArg, "partial_kv_streams %d for a model without KV layers: its host names its streams in partial_state", id.PartialKVStreams)
	}
	m, err := registerStateOnly(b, id, probe, func(string) string { return id.Partial })
	if err != nil {
		return nil, err
	}
	return &Model{Model: m}, nil
}

// partialProbe reads the probe state of a memory with a partial state: its
// attention layers' KV cache (with the indexer's as State.Second where a
// window memory has one), then the partial state, a window cache's state
// (a sliding-window memory) or a recurrent state (a hybrid one), and the
// indexer cache's state after it (a hybrid one with an indexer,
// llama_memory_hybrid_idx, whose recurrent state's length it returns). It
// returns the first, what follows it, and the partial state's name for the
// fingerprint (key.Model.Partial): the window and the architecture from the
// model file, the window cache's layers and types, or the recurrent
// state's size (which its shapes and types fix) and the indexer's layers,
// from the probe's state.
// (Recurrent-only memories, which have no KV cache, are registerRecurrent's.)
// A hybrid memory with a sliding window carries both a window cache and a
// recurrent state: a state host restores it not (stock llama-server
// computes a prompt again after loading such a state, its recurrent state
// being past the window's threshold).
func partialProbe(mem memory, probe []byte) (*llamastate.State, stateTail, string, int, error) {
	tail := windowTail
	switch {
	case slices.Contains(hybridArchs, mem.arch) && mem.window > 0:
		return nil, noTail, "", 0, status.Errorf(status.Unsupported, "a hybrid memory with a sliding window: stock llama-server computes a prompt again after a slot restore of its state (its recurrent state is past the window's threshold, pos_min_thold)")
	case slices.Contains(indexedHybridArchs, mem.arch):
		tail = indexedRecurrentTail
	case slices.Contains(hybridArchs, mem.arch):
		tail = recurrentTail
	}
	st, n, err := llamastate.ParseLeading(probe)
	if err != nil {
		return nil, noTail, "", 0, err
	}
	if n == 0 {
		return nil, noTail, "", 0, status.Errorf(status.InvalidArg, "the state carries nothing after its KV cache")
	}
	rest := probe[len(probe)-n:]
	switch tail {
	case recurrentTail:
		return st, tail, fmt.Sprintf("state recurrent %s bytes %d", mem.arch, n), 0, nil
	case indexedRecurrentTail:
		rec, idx, err := indexerAfter(rest, st, len(probeTokens))
		if err != nil {
			return nil, noTail, "", 0, err
		}
		d := fmt.Sprintf("state recurrent %s bytes %d indexer layers %d", mem.arch, rec, len(idx.Layers))
		for _, l := range idx.Layers {
			d += fmt.Sprintf(" K %d row %d", l.KType, l.KRowSize)
		}
		return st, tail, d, rec, nil
	}
	ss, err := llamastate.ParseCache(rest, st.CellExt, st.KOnly)
	if err != nil {
		// A sliding-window memory with an indexer cache (dots3,
		// llama_kv_cache_dsa_iswa) writes its indexer's state, which keeps
		// every position as the first cache does, before the window cache's.
		second, n, err2 := llamastate.ParseCacheLeading(rest, st.CellExt, st.KOnly)
		if err2 != nil || n == 0 || len(second) != len(st.Streams) {
			return nil, noTail, "", 0, status.Wrap(status.InvalidArg, err, "the window cache's state")
		}
		if ss, err2 = llamastate.ParseCache(rest[len(rest)-n:], st.CellExt, st.KOnly); err2 != nil {
			return nil, noTail, "", 0, status.Wrap(status.InvalidArg, err, "the window cache's state")
		}
		st.Second = second
	}
	si, err := (&llamastate.State{Streams: ss}).Sequence()
	if err != nil {
		return nil, noTail, "", 0, status.Wrap(status.InvalidArg, err, "the window cache's state")
	}
	d := fmt.Sprintf("state window %d layers %d", mem.window, len(ss[si].Layers))
	for _, l := range ss[si].Layers {
		d += fmt.Sprintf(" K %d V %d", l.KType, l.VType)
	}
	return st, tail, d, 0, nil
}

// indexerAfter finds, in rest, what a llama_memory_hybrid_idx's state holds
// after its attention cache's (st's), the indexer cache's state after the
// recurrent state, whose length nothing in it says (it writes sections of
// its non-null layers only): the first offset from which rest reads to its
// end as a K-only cache state of st's streams and cell format holding
// exactly positions [0, n), with a recurrent state at position n-1 before
// it. It returns that offset, the recurrent state's length, and the
// indexer's stream.
func indexerAfter(rest []byte, st *llamastate.State, n int) (int, *llamastate.Stream, error) {
	if pos, err := llamastate.RecurrentPos(rest); err != nil || int(pos) != n-1 {
		return 0, nil, status.Errorf(status.InvalidArg, "the state after the attention cache is no recurrent state at position %d", n-1)
	}
	for o := 4; o+4 <= len(rest); o++ {
		if int(binary.LittleEndian.Uint32(rest[o:])) != len(st.Streams) {
			continue
		}
		ss, err := llamastate.ParseCache(rest[o:], st.CellExt, true)
		if err != nil {
			continue
		}
		idx := &llamastate.State{Streams: ss, CellExt: st.CellExt, KOnly: true}
		si, err := idx.Sequence()
		if err != nil || len(ss[si].Cells) != n {
			continue
		}
		if _, err := idx.PositionCells(n); err == nil {
			return o, &ss[si], nil
		}
	}
	return 0, nil, status.Errorf(status.InvalidArg, "no indexer cache's state after the recurrent state")
}

// probeExt checks the probe's cell extensions, when its state has them,
// against a text prompt's and says whether they carry 2-D positions.
func probeExt(st *llamastate.State, si int, cells []int) (pos2D bool, err error) {
	if !st.CellExt {
		return false, nil
	}
	s := &st.Streams[si]
	pos2D = s.Cells[cells[1]].Ext.X == 1
	probe := &Model{pos2D: pos2D}
	for p, c := range cells {
		if got, want := s.Cells[c].Ext, probe.textExt(int32(p), probeTokens[p]); got != want {
			return false, status.Errorf(status.Unsupported, "the probe's cell at %d carries %+v, a text prompt's %+v", p, got, want)
		}
	}
	return pos2D, nil
}

func equalTokens(a, b []int32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// modelHeader reads a GGUF's metadata.
func modelHeader(path string) (*gguf.File, error) {
	if path == "" {
		return nil, status.Errorf(status.InvalidArg, "no model file: the fingerprint digests the GGUF")
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, status.Wrap(status.InvalidArg, err, "opening the model file")
	}
	defer f.Close()
	g, err := gguf.Read(f)
	if err != nil {
		return nil, status.Wrap(status.InvalidArg, err, "reading the model file "+path)
	}
	return g, nil
}

// modelFile reads a GGUF's architecture and digests its bytes (cached by
// path, size and mtime).
func modelFile(path string) (string, key.Hash, error) {
	g, err := modelHeader(path)
	if err != nil {
		return "", key.Hash{}, err
	}
	v, ok := g.Lookup("general.architecture")
	arch, isStr := v.Str()
	if !ok || !isStr || arch == "" {
		return "", key.Hash{}, status.Errorf(status.InvalidArg, "%s has no general.architecture", path)
	}
	content, err := key.FileDigest(path)
	if err != nil {
		return "", key.Hash{}, status.Wrap(status.InvalidArg, err, "digesting the model file")
	}
	return arch, content, nil
}

// memory is what a model file says of the memory llama.cpp gives it.
type memory struct {
	arch   string
	window uint64 // <arch>.attention.sliding_window, 0 when it names none
}

// The architectures whose memory holds a recurrent state, alone or beside a
// KV cache, in the pinned release (llama-arch.cpp: llm_arch_is_recurrent,
// llm_arch_is_hybrid).
var (
	recurrentArchs = []string{"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"}
	hybridArchs    = []string{"jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h",
		"nemotron_h_moe", "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "qwen35", "qwen35moe", "qwen4exp",
		"deepseek4", "minimax-01"}
	// The hybrid architectures whose memory has an indexer cache besides
	// (llama_memory_hybrid_idx: llama_model::create_memory's needs_mem_idx).
	indexedHybridArchs = []string{"qwen4exp"}
	// The architectures whose memory this package reads no part of:
	// DeepSeek V4's (llama_kv_cache_dsv4: a token cache beside caches of
	// every ratio'th position, compressed, and their rolling states). A state
	// host with snapshots snapshots its whole state (registerWholeState).
	wholeStateArchs = []string{"deepseek4"}
)

// notKV says why the model's states hold something other than rows by
// position for every position of the prompt, "" when they do not: a
// recurrent state is one per sequence, for the position it is at, and
// llama_kv_cache::state_write leaves out the window cells a window has moved
// past, swa_full or not. Either restores only with a snapshot of that state
// at a block boundary (docs/design.md §5.9).
func (m memory) notKV() string {
	switch {
	case slices.Contains(recurrentArchs, m.arch):
		return fmt.Sprintf("a recurrent memory (%s): its states hold one recurrent state for the position the sequence is at, no rows by position", m.arch)
	case slices.Contains(wholeStateArchs, m.arch):
		return fmt.Sprintf("a memory of compressed caches (%s): its states hold caches of every few positions and their rolling states", m.arch)
	case slices.Contains(hybridArchs, m.arch):
		return fmt.Sprintf("a hybrid memory (%s): its states hold a recurrent state for the position the sequence is at beside the attention layers' KV", m.arch)
	case m.window > 0:
		return fmt.Sprintf("a sliding-window memory (window %d): its states keep only the last window of the window layers", m.window)
	}
	return ""
}

// memoryOf reads what the model file at path says of its memory.
func memoryOf(path string) (memory, error) {
	g, err := modelHeader(path)
	if err != nil {
		return memory{}, err
	}
	v, _ := g.Lookup("general.architecture")
	arch, _ := v.Str()
	m := memory{arch: arch}
	if v, ok := g.Lookup(arch + ".attention.sliding_window"); ok {
		m.window, _ = v.Uint()
	}
	return m, nil
}

// probeDomain separates probe digests from every other hash of KV bytes.
var probeDomain = []byte("mcbridge kv probe v2 " + LlamaVersion + "\x00")

// probeDigest hashes the probe's KV: per layer the K and V types and row
// sizes, then its K rows and V rows in position order, V by token whatever
// the host's layout. Where the host put the cells, how many streams or
// cells its cache has and whether it handed over tensors or a state do not
// change it; any difference in the bytes does.
func probeDigest(vTrans bool, shapes []layerShape, probe kvlayout.Layout, cells []uint32) (key.Hash, error) {
	n := len(probeTokens)
	if len(cells) != n {
		return key.Hash{}, status.Errorf(status.InvalidArg, "probe KV of %d positions, want %d", len(cells), n)
	}
	g := pool.Geometry{BlockTokens: n, KRow: make([]int, len(shapes)), VRow: make([]int, len(shapes))}
	shape := kvlayout.Shape{Geometry: &g, VElem: make([]int, len(shapes))}
	for l, s := range shapes {
		g.KRow[l], g.VRow[l], shape.VElem[l] = s.kRow, s.vRow, s.vElem
	}
	if err := g.Validate(); err != nil {
		return key.Hash{}, err
	}
	if probe.VTrans != vTrans {
		return key.Hash{}, status.Errorf(status.Layout, "probe KV with V transposed %v in a format with V transposed %v", probe.VTrans, vTrans)
	}
	if err := probe.Validate(&shape); err != nil {
		return key.Hash{}, err
	}
	if err := probe.CheckCells(cells); err != nil {
		return key.Hash{}, err
	}
	h := xxh3.New()
	_, _ = h.Write(probeDomain)
	_, _ = h.Write(key.TokenBytes(probeTokens))
	runs := kvlayout.Runs(cells)
	for l := range shapes {
		payload := make([]byte, g.LayerSize(l))
		probe.Gather(&shape, l, payload, runs)
		_, _ = h.Write(key.TokenBytes([]int32{int32(g.KRow[l]), int32(g.VRow[l])}))
		_, _ = h.Write(payload)
	}
	return key.FromU128(h.Sum128()), nil
}

// StateLayout points the bridge at a parsed state's rows, in place: cell c
// of layer l is K row c and V row c, or element c of each V column. The
// layers of a K-only state have no V. The caller keeps the state's buffer
// alive while the layout is in use.
func StateLayout(s *llamastate.Stream) kvlayout.Layout {
	lo := kvlayout.Layout{Cells: uint32(len(s.Cells)), VTrans: s.VTrans, Location: "cpu:0", Layers: make([]kvlayout.Layer, len(s.Layers))}
	for l, ly := range s.Layers {
		lo.Layers[l] = kvlayout.Layer{K: mem.Addr(ly.K), KStride: ly.KRowSize}
		if ly.VRowSize == 0 {
			continue
		}
		lo.Layers[l].V, lo.Layers[l].VStride = mem.Addr(ly.V), ly.VRowSize
		if s.VTrans {
			lo.Layers[l].VStride = uint64(len(s.Cells)) * uint64(ly.VElSize)
		}
	}
	return lo
}
