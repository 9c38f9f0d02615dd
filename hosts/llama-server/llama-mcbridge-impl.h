// Shared between the files of csrc/llama that are compiled into libllama; not used by
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

// The bridge's view of the K and V tensors of seq_id's stream (learned from a
// state_write of the sequence, which names them). Throws when they are not in host
// memory.
std::vector<mcb_kv_layer> seq_layers(llama_kv_cache * kv, llama_seq_id seq_id, bool v_trans);

} // namespace mcb_llama
