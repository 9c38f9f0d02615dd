// seq_state.hpp - the llama.cpp v0.5.0 sequence-state blob, as
// llama_state_seq_get_data_ext writes it for one sequence of a plain KV cache
// (llama-patches/README.md, "Sequence-state blob"):
//
//   u32 magic 0xaf143cd8, i32 seq_id, u32 n_stream, then per stream
//   u32 cell_count and, when it is not 0, cell_count cells
//   (i32 pos, u32 n_seq_id = 1, i32 seq_id), u32 v_trans, u32 n_layer,
//   per layer i32 k_type, u64 k_row, K rows; per layer V either
//   i32 v_type, u64 v_row, V rows or (transposed) i32 v_type, u32 v_el,
//   u32 n_embd_v, then n_embd_v columns of cell_count elements.
//
// Only what stage 1 can move is accepted: one non-empty stream, no cell
// extension (M-RoPE, PLE), one sequence per cell and V for every layer. The
// parser is pure format: it knows nothing of ggml types beyond the sizes the
// blob states, so it can be fuzzed and mirrored (internal/llamastate) exactly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mcb_seqstate {

constexpr uint32_t kSeqStateMagic = 0xaf143cd8u;

// How one layer's K and V are stored in a blob.
struct LayerFormat {
    int32_t k_type = 0;
    uint64_t k_row = 0;   // bytes of one cell's K row
    int32_t v_type = 0;
    uint64_t v_row = 0;   // bytes of one cell's V row (transposed: n_embd_v * v_el)
    uint32_t v_el = 0;    // transposed only: bytes of one V element
    uint32_t n_embd_v = 0;// transposed only: V columns

    bool operator==(const LayerFormat &o) const {
        return k_type == o.k_type && k_row == o.k_row && v_type == o.v_type && v_row == o.v_row &&
               v_el == o.v_el && n_embd_v == o.n_embd_v;
    }
    bool operator!=(const LayerFormat &o) const { return !(*this == o); }
};

// Everything but the cells: what a context's KV cache writes per stream.
struct KVFormat {
    bool v_trans = false;
    std::vector<LayerFormat> layers;

    bool operator==(const KVFormat &o) const { return v_trans == o.v_trans && layers == o.layers; }
    bool operator!=(const KVFormat &o) const { return !(*this == o); }
};

// Where a layer's bytes are, as offsets into the blob.
struct LayerSpan {
    size_t k = 0; // first K row
    size_t v = 0; // first V row, or the first element of V column 0
};

// A parsed blob. Offsets index the buffer that was parsed.
struct SeqState {
    int32_t seq_id = 0;
    uint32_t n_stream = 0;
    uint32_t stream = 0;         // the stream holding the cells
    std::vector<int32_t> pos;    // per cell, in cell order (the blob's order)
    KVFormat format;
    std::vector<LayerSpan> spans;
    size_t data = 0;             // offset of v_trans: the per-stream data section
    size_t end = 0;              // bytes parsed

    uint32_t n_cells() const { return static_cast<uint32_t>(pos.size()); }
};

// Parses blob[0, size). An empty sequence (every cell_count 0) parses with
// no cells and an empty format. On failure returns false with a message.
bool parse_seq_state(const uint8_t *blob, size_t size, SeqState *out, std::string *err);

// cells[i] = the cell (index in blob order) holding position i, for
// i < n_positions; false when the cells' positions are not exactly
// 0 .. n_cells-1.
bool position_cells(const SeqState &st, std::vector<uint32_t> *cells, std::string *err);

// Bytes of one stream's data section for n_cells cells.
bool data_size(const KVFormat &fmt, uint32_t n_cells, size_t *out);

// A blob for seq_id holding positions 0 .. n_cells-1 in cells 0 .. n_cells-1
// of stream `stream` (the others empty), K and V zeroed; spans say where
// each layer's rows go. Fails only on sizes that overflow.
bool build_seq_state(int32_t seq_id, uint32_t n_stream, uint32_t stream, const KVFormat &fmt, uint32_t n_cells,
                     std::vector<uint8_t> *blob, std::vector<LayerSpan> *spans, std::string *err);

// Copies positions [0, n) from a blob laid out by build_seq_state with
// src_cells cells into one with dst_cells cells (n <= both): K and V rows,
// or, transposed, the first n elements of every V column.
void copy_prefix(const KVFormat &fmt, const uint8_t *src, const std::vector<LayerSpan> &src_spans, uint32_t src_cells,
                 uint8_t *dst, const std::vector<LayerSpan> &dst_spans, uint32_t dst_cells, uint32_t n);

} // namespace mcb_seqstate
