/*
 * mcb_stage1.h - libmcbridge for an unpatched llama.cpp v0.5.0.
 *
 * Stage 1 of the llama.cpp integration: save and restore a sequence's KV
 * through llama.cpp's public sequence-state API only
 * (llama_state_seq_get_data_ext / llama_state_seq_set_data_ext, flags 0).
 * A save reads the sequence's state blob, finds the cell of each position
 * and hands the bridge a struct mcb_kv_layout that points into the blob; a
 * restore asks the bridge which leading blocks are cached, loads them into a
 * blob it assembles, verified, and gives that blob to llama.cpp. The KV is
 * copied once more than a patched build needs (stage 2), in exchange for no
 * patch at all.
 *
 * What the public API cannot tell - the K/V types, whether V is transposed
 * (flash attention), the row sizes, rope overrides of the context, the
 * Hadamard rotation of quantized K/V - is learned once per context by a
 * probe: mcb_stage1_open decodes a fixed 8-token sequence into an empty
 * sequence, reads its state blob and removes it again. The probe's blob
 * gives the per-layer types and row sizes (to fill struct mcb_model_params,
 * to check every later blob against, and to assemble restore blobs), and a
 * digest of its KV bytes becomes kv_probe: anything that changes KV bytes
 * (weights, rope scaling passed to the context, rotation, numerics of the
 * build) changes the digest, so incompatible contexts never share blocks.
 *
 * Supported: plain KV caches of models without sliding windows, M-RoPE or
 * per-layer embeddings, any n_stream (kv_unified or not), flash attention on
 * or off, any K/V type. Anything else is refused with MCB_STATUS_UNSUPPORTED.
 *
 * Threads: a struct mcb_stage1 is used by one thread at a time, like the
 * llama_context it wraps.
 */
#ifndef MCB_STAGE1_H
#define MCB_STAGE1_H

#include <stddef.h>

#include "llama.h"
#include "mcbridge.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The llama.cpp release whose state format this library parses; also the
 * llama_version of the model parameters it fills. */
#define MCB_STAGE1_LLAMA_VERSION "v0.5.0"

/* Tokens the probe decodes (see above). */
#define MCB_STAGE1_PROBE_TOKENS 8

/* A llama_context and the state format its KV cache writes. */
struct mcb_stage1;

/* Probes ctx through sequence probe_seq, which must be empty (it is empty
 * again afterwards, also on failure; the probe's decode overwrites the
 * context's logits). The context must outlive the handle.
 * On success *out is a new handle; free it with mcb_stage1_close. */
mcb_status mcb_stage1_open(struct llama_context *ctx, llama_seq_id probe_seq, struct mcb_stage1 **out);

void mcb_stage1_close(struct mcb_stage1 *s);

/* Fills the parameters to register the context's model with
 * (mcb_model_register): geometry, types, v_trans and rotation from the
 * probe, the architecture and rope settings from the model, kv_probe from
 * the probe's KV, llama_version MCB_STAGE1_LLAMA_VERSION. gguf_path is the
 * model file the bridge digests (it must be the file ctx's model was loaded
 * from; NULL leaves content_hash zero for the caller to fill). The arrays
 * and strings in *out belong to s and live until mcb_stage1_close. */
mcb_status mcb_stage1_model_params(struct mcb_stage1 *s, const char *gguf_path, uint32_t block_tokens,
                                   struct mcb_model_params *out);

/* Registers the context's model with a bridge and binds the handle to s:
 * save and restore take only handles registered here, since a handle of
 * another context would move rows of another size or type. params usually
 * come from mcb_stage1_model_params, possibly with block_tokens, extra or
 * content_hash changed; fields that describe the KV bytes (llama_version,
 * geometry, row sizes, types, v_trans, kv_probe) must be s's, else
 * MCB_STATUS_MODEL_MISMATCH. Unregister with mcb_model_unregister. */
mcb_status mcb_stage1_register(struct mcb_stage1 *s, mcb_bridge bridge, const struct mcb_model_params *params,
                               mcb_model *out);

/* Saves the full blocks of tokens[0, n_tokens), which must be the tokens at
 * positions 0 .. n_tokens-1 of sequence seq. The sequence must hold exactly
 * positions 0 .. n-1 for some n >= n_tokens, all in one stream (no context
 * shift, no cache-reuse holes). Copies synchronously: the context may change
 * the sequence as soon as this returns. model must come from
 * mcb_stage1_register on s. out may be NULL. */
mcb_status mcb_stage1_save(struct mcb_stage1 *s, llama_seq_id seq, mcb_model model, const struct mcb_scope *scope,
                           const llama_token *tokens, size_t n_tokens, struct mcb_save_result *out);

/* Restores the longest cached prefix of tokens (whole blocks, leaving at
 * least the last token to compute) into sequence seq, which must be empty.
 * *n_restored receives the positions now in the sequence (0 .. n-1); decode
 * the remaining tokens from position *n_restored on. Only verified blocks are
 * restored: after a partial load, the verified leading blocks. When nothing
 * is restored the sequence is left empty and the status says why
 * (MCB_STATUS_OK when nothing was cached or the arbiter chose to recompute).
 * *n_restored is always written. */
mcb_status mcb_stage1_restore(struct mcb_stage1 *s, llama_seq_id seq, mcb_model model, const struct mcb_scope *scope,
                              const llama_token *tokens, size_t n_tokens, size_t *n_restored);

/* The message of the last mcb_stage1_ call on this thread that did not fully
 * succeed (a failure, or a restore that kept only part of what it loaded),
 * "" otherwise. Valid until the next mcb_stage1_ call on the thread. */
const char *mcb_stage1_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* MCB_STAGE1_H */
