package main

// Go mirrors of the structs in include/mcbridge.h. Pointer fields are
// uintptr: they point into the host's memory, which the collector must
// neither scan nor keep alive. Their sizes and offsets are asserted against
// the same numbers in C (mcbridge.c) and in Go (mirror_test.go).

type cModelParams struct {
	LlamaVersion     uintptr
	GGUFPath         uintptr
	BlockTokens      uint32
	_                [4]byte
	Extra            uintptr
	PartialState     uintptr
	PartialKVStreams uint32
	_                [4]byte
}

type cKVFormat struct {
	NLayer    uint32
	_         [4]byte
	NEmbdKGQA uintptr
	NEmbdVGQA uintptr
	KRowBytes uintptr
	VRowBytes uintptr
	TypeK     int32
	TypeV     int32
	VTrans    bool
	_         [7]byte
}

type cAdapter struct {
	Path  uintptr
	Scale float32
	_     [4]byte
}

type cScope struct {
	TenantSalt    uintptr
	TenantSaltLen uint64
	Adapters      uintptr
	NAdapters     uint64
}

type cKVLayer struct {
	K, V    uintptr
	KStride uint64
	VStride uint64
}

type cKVLayout struct {
	NLayer   uint32
	NCells   uint32
	VTrans   bool
	_        [7]byte
	Location uintptr
	Layers   uintptr
}

type cLookupResult struct {
	NBlockTokens   uint32
	NMatchedBlocks uint32
	NRestoreTokens uint32
	Reason         int32
	EstRestoreMS   float64
	EstRecomputeMS float64
	EstTotalMS     float64
	Plan           uint64
}

type cLoadResult struct {
	NBlocks    uint32
	NBlocksOK  uint32
	NTokensOK  uint32
	FirstError int32
	NBytes     uint64
}

type cSaveResult struct {
	NBlocks  uint32
	NKnown   uint32
	NWritten uint32
	NQueued  uint32
}

type cStats struct {
	Lookups, Hits, Misses, DecidedRestore, DecidedRecompute, DecidedLocal uint64
	Loads, LoadFailures, RestoredTokens, RestoredBytes                    uint64
	Saves, SaveFailures, SavedBlocks, DedupedBlocks                       uint64
	Evictions, DirectoryErrors, TornReads                                 uint64
	ResidentBlocks, ResidentBytes, PoolBytes                              uint64
}
