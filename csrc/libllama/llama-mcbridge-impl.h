// Shared between the files of csrc/libllama, which are compiled into libllama; not used by
// the patches.
#pragma once

#include "llama-mcbridge.h"

#include <string>
#include <vector>

namespace mcb_llama {

// ctx's memory when it is a plain llama_kv_cache (not iSWA, hybrid or recurrent).
llama_kv_cache * plain_kv(llama_context * ctx);

// A status with the bridge's last error message of this thread.
std::string status_message(mcb_status st);

// Raises the clean mark of a sequence that stage 2 has just filled from the bridge.
void mark_restored(llama_kv_cache * kv, llama_seq_id seq_id);

// The cells holding positions [0, n) of seq_id, in position order; stops at the first
// position the sequence does not hold.
std::vector<uint32_t> seq_cells(const llama_kv_cache * kv, llama_seq_id seq_id, int32_t n);

// The stream that holds seq_id's cells.
uint32_t seq_stream(const llama_kv_cache * kv, llama_seq_id seq_id);

// The cache's K and V tensors, learned from a state_write of seq_id, which names its
// stream's views of them (the sequence must hold cells). Throws when they are not in
// host memory or not laid out as the pinned llama.cpp lays them out.
kv_storage capture_storage(llama_kv_cache * kv, llama_seq_id seq_id);

// The bridge's view of stream strm of the storage: rows of cell c at k + c * k_stride,
// or, with V transposed, dimension j of cell c at v + (j * n_cells + c) * element size.
std::vector<mcb_kv_layer> stream_layers(const kv_storage & st, uint32_t n_cells, bool v_trans, uint32_t strm);

// The layout the bridge takes for layers of kv; it points into layers.
mcb_kv_layout layout_of(const llama_kv_cache * kv, bool v_trans, const std::vector<mcb_kv_layer> & layers);

} // namespace mcb_llama
