// Shared between the files of csrc/llama that are compiled into libllama; not used by
// the patches.
#pragma once

#include "llama-mcbridge.h"

#include <string>

namespace mcb_llama {

// ctx's memory when it is a plain llama_kv_cache (not iSWA, hybrid or recurrent).
llama_kv_cache * plain_kv(llama_context * ctx);

// A status with the bridge's last error message of this thread.
std::string status_message(mcb_status st);

// Raises the clean mark of a sequence that stage 2 has just filled from the bridge.
void mark_restored(llama_kv_cache * kv, llama_seq_id seq_id);

} // namespace mcb_llama
