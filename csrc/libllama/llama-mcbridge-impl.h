// Shared between the files of csrc/libllama, which are compiled into libllama; not used by
// the patches.
#pragma once

#include "llama-mcbridge.h"

#include "ggml-backend.h"

#include <memory>
#include <set>
#include <string>
#include <vector>

namespace mcb_llama {

// The KV cache of ctx's attention layers that blocks restore and save: the memory
// itself when it is one plain llama_kv_cache, the full-attention cache of a
// sliding-window memory (iSWA, DSA-iSWA), the attention cache of a hybrid one or of an
// indexed one (DSA, MSA); nullptr for any other memory. What the memory holds besides it is its partial state
// (partial_state_of).
llama_kv_cache * attn_kv(llama_context * ctx);

// The cache an indexed memory keeps beside attn_kv (llama_kv_cache_dsa's indexer keys,
// llama_kv_cache_msa's and llama_memory_hybrid_idx's indexer caches), nullptr for any
// other memory. The memory edits
// both alike and both hold a sequence in the same cells; blocks carry its layers after
// the attention cache's.
llama_kv_cache * companion_kv(llama_context * ctx);

// A status with the bridge's last error message of this thread.
std::string status_message(mcb_status st);

// Raises the clean mark of a sequence that stage 2 has just filled from the bridge.
void mark_restored(llama_context * ctx, llama_seq_id seq_id);

// The cells holding positions [0, n) of seq_id, in position order; stops at the first
// position the sequence does not hold.
std::vector<uint32_t> seq_cells(const llama_kv_cache * kv, llama_seq_id seq_id, int32_t n);

// The stream that holds seq_id's cells.
uint32_t seq_stream(const llama_kv_cache * kv, llama_seq_id seq_id);

// The cache's K and V tensors, learned from a state_write of seq_id, which names its
// stream's views of them (the sequence must hold cells): K and V of every layer, or K
// alone (a cache without V: its v are null). Throws when they are not laid out as the
// pinned llama.cpp lays them out. They may be in device memory.
kv_storage capture_storage(llama_kv_cache * kv, llama_seq_id seq_id);

// The bridge's view of stream strm of the storage: rows of cell c at k + c * k_stride,
// or, with V transposed, dimension j of cell c at v + (j * n_cells + c) * element size;
// v null where the cache has no V tensors.
// For tensors in device memory the addresses are the device's: they name the tensors
// (stage-2 checks llama.cpp's reads against them), the bridge never gets them.
std::vector<mcb_kv_layer> stream_layers(const kv_storage & st, uint32_t n_cells, bool v_trans, uint32_t strm);

// The layout the bridge takes for layers of kv; it points into layers.
mcb_kv_layout layout_of(const llama_kv_cache * kv, bool v_trans, const std::vector<mcb_kv_layer> & layers);

// KV in memory the CPU cannot address (a GPU, an RPC server), staged through host
// buffers (llama-mcbridge-device.cpp, docs/design.md §5.7): the bridge's loads and
// saves use a staging layout, position i in staging row i, and the rows move between
// staging and the tensors through ggml's backend API. Used only on the thread driving
// the context.
//
// Each load or save has a staging buffer of its own for as long as it runs, so a
// restore stays in flight across the server's loop iterations while other slots
// decode and save. kv_stage owns every buffer; a buffer is idle or lent (acquire ->
// release), and idle ones are kept for the next load, since allocating pinned memory
// and registering it with the transport cost more than the copy.
struct stage_buf {
    ggml_backend_buffer_t     buf   = nullptr;
    uint32_t                  cap   = 0;     // positions it holds
    size_t                    bytes = 0;
    bool                      lent  = false; // between acquire and release
    std::vector<mcb_kv_layer> rows;          // per layer
};

class kv_stage {
public:
    // nullptr when every K and V tensor of st is host memory.
    static std::shared_ptr<kv_stage> make(llama_context * ctx, const llama_kv_cache * kv, const kv_storage & st,
                                          bool v_trans);
    ~kv_stage();
    kv_stage(const kv_stage &) = delete;
    kv_stage & operator=(const kv_stage &) = delete;

    // A buffer of at least n positions, lent until release. Throws when the staging
    // budget (twice one stream's cells) is lent to other loads, or memory runs out.
    stage_buf * acquire(uint32_t n);
    void        release(stage_buf * b);
    // b's host layout (cells 0..cap-1).
    mcb_kv_layout layout(const stage_buf & b) const;
    // Layer l of positions [0, n) from b into their cells (of stream strm), on the
    // layer's backend, asynchronously where it can; sync() waits for it.
    void upload(const stage_buf & b, uint32_t l, uint32_t strm, const std::vector<uint32_t> & cells, uint32_t n);
    // Layer l of the positions held in cells into b; wait_download(l) waits for it.
    // One save downloads at a time: the events are per layer.
    void download(const stage_buf & b, uint32_t l, uint32_t strm, const std::vector<uint32_t> & cells);
    void wait_download(uint32_t l);
    // Waits for every upload and download issued.
    void sync();

    std::string where;    // the devices the KV is on, for the log
    size_t      n_device = 0; // K and V tensors not in host memory

private:
    kv_stage() = default;
    size_t bytes_for(uint32_t n) const;
    template <typename F>
    void pieces(const stage_buf & b, uint32_t l, uint32_t strm, const std::vector<uint32_t> & cells, uint32_t n,
                F && fn) const;

    kv_storage st;
    bool       v_trans = false;
    uint32_t   n_cells = 0; // cells in each stream of the cache
    std::vector<ggml_backend_t> kb, vb;  // per layer: the backend of K's and V's device, nullptr for host memory
    std::vector<size_t>   krow, vrow, vel;
    std::vector<uint32_t> vdim;
    std::set<ggml_backend_t> backends;
    std::vector<std::vector<ggml_backend_event_t>> events; // per layer, per backend of kb/vb; nullptr where none
    ggml_backend_buffer_type_t host_buft = nullptr;
    std::vector<std::unique_ptr<stage_buf>> bufs;
    size_t                                  allocated = 0; // bytes of bufs
};

} // namespace mcb_llama
