// server-mcbridge.h: llama-server's use of the bridge (compiled into server-context when
// llama.cpp is configured with -DMCBRIDGE_ROOT). The patches call these at the hook
// points llama-patches/README.md names; with the bridge off every one of them returns
// at once and the server behaves as stock.
#pragma once

#include "server-common.h"
#include "server-schema.h"
#include "server-task.h"

#include <list>
#include <ostream>
#include <vector>

namespace mcb_server {

// End of load_model: registers the target context with the bridge, or logs why the
// bridge stays off (not configured, a draft reading the target's hidden states,
// unsupported memory, ...). A draft model's context (-md) recomputes what a restore
// brings the target.
void attach(llama_context * ctx_tgt, bool has_draft, const common_params & params);
// destroy(): the context is about to be freed.
void detach(llama_context * ctx_tgt);

// prompt_restore's answer when it started a restore: the slot waits for it.
constexpr int32_t RESTORING = -1;

// Just before [TAG_PROMPT_LOGITS]: after the slot's own cache reuse has set n_past,
// looks the prompt up and, when the arbiter says so, starts restoring a longer prefix
// from the bridge. Then cached is emptied (the sequence is) and RESTORING is returned:
// the slot goes back to SLOT_STATE_STARTED, and restore_pending holds it there while
// the loop decodes the other slots. When the slot's prompt starts again, with the
// restored prefix as its cache, this returns n_past. Otherwise it returns n_past (0
// when the restore could not start and emptied the sequence). At least one prompt
// token is always left to compute.
int32_t prompt_restore(llama_context * ctx, int32_t seq_id, const server_task & task,
                       const std::vector<common_adapter_lora_info> & lora, bool alora,
                       const server_tokens & input, server_tokens & cached, int32_t n_past,
                       mcb_request_stats & st);

// At the start of SLOT_STATE_STARTED: true while the slot's restore is in flight (the
// slot waits, nothing edits its sequence). Once the load is over (its layers verified,
// or its deadline passed) it ends the restore, makes cached input[0, P) for the P
// tokens restored (none after a failure), and returns false: the slot's prompt starts.
// A restore of a memory with a partial state also leaves its snapshot in checkpoints,
// as a context checkpoint of the restored position: llama-server's own check of a
// sliding window asks for one there (a window state holds the last n_swa positions,
// one fewer than the check wants without a checkpoint).
bool restore_pending(llama_context * ctx, int32_t seq_id, const server_task & task,
                     const server_tokens & input, server_tokens & cached,
                     std::list<common_prompt_checkpoint> & checkpoints, mcb_request_stats & st);

// The slot is released (done, cancelled, failed): a restore still in flight into its
// sequence is abandoned and its cells removed, before anything else uses the slot.
void slot_released(int32_t seq_id);

// The loop has nothing to decode: waits a little for a restore in flight, instead of
// spinning through empty iterations until it is over.
void restores_wait();

// In the prompt's batch loop, once the token that makes n_cached tokens of the slot's
// prompt is in the batch: true when the batch must end there, so that the decode ends
// where the bridge snapshots the model's partial state (docs/design.md §5.9), as
// llama-server cuts its batches for its own context checkpoints.
bool cut_batch(llama_context * ctx, int32_t n_cached, int32_t n_prompt, const mcb_request_stats & st);

// After the slot's prompt batch is built, before it is decoded: the slot's memory holds
// the state after its first n_start tokens. When n_start is a snapshot point that this
// prompt computed up to, the partial state is snapshotted there.
void prompt_batched(llama_context * ctx, int32_t seq_id, const server_task & task,
                    const std::vector<common_adapter_lora_info> & lora, const server_tokens & tokens,
                    int32_t n_start, mcb_request_stats & st);

// post_decode at SLOT_STATE_DONE_PROMPT: the prompt's KV is computed and synchronized;
// hands its new full blocks to the bridge (and the partial state, when the prompt ends
// at a snapshot point) and feeds the arbiter the prefill time.
void prompt_save(llama_context * ctx, int32_t seq_id, const server_task & task,
                 const std::vector<common_adapter_lora_info> & lora, const server_tokens & tokens,
                 mcb_request_stats & st);

// On the HTTP thread, before a request's last result goes out (llama-patches/0008): when
// the request saved blocks, waits until the directory names them, 50 ms at most, so that
// a runner killed as soon as its answer is out (Ollama, keep_alive 0) has its blocks
// known to the store node first. Requests that saved nothing, and the decode loop,
// never wait.
void answer_ready(const mcb_request_stats & st);

// Wherever a response carries "timings" (llama-patches/0004): what the bridge did for
// the prompt, as an object of its own, "mcbridge", next to it. "timings" stays
// llama-server's, every value a number.
void add_outcome(const mcb_request_stats & st, json & res);

// /metrics: the bridge's counters as mcbridge_* series.
void add_metrics(std::ostream & out);

// The request fields the bridge reads ("mcb_tenant").
server_schema::field * tenant_field();

} // namespace mcb_server
