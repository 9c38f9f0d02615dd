/*
 * mcb_libllama.h - the bridge for a program that links an unpatched libllama
 * (llama.cpp v0.5.0): node-llama-cpp, llama-cpp-python, any embedder.
 *
 * It moves KV through llama.cpp's public sequence-state API
 * (llama_state_seq_get_data / llama_state_seq_set_data) and the library's
 * mcb_state_ calls, which read and write those blobs: the KV format, the
 * probe's digest, the block layout and every check are the library's, the
 * same as for the patched llama-server and the proxy, so all of them share
 * blocks. The KV is copied once more than in a patched build, in exchange
 * for no patch at all.
 *
 * Supported: contexts whose memory is one KV cache (MLA caches, which hold
 * K only, included), of models without M-RoPE or per-layer embeddings, any
 * n_stream, flash attention on or off, any K/V type. Anything else is
 * refused with MCB_STATUS_UNSUPPORTED: recurrent and hybrid models by
 * llama.h, and the rest by the probe's state, since llama.h does not say
 * which memory a context has: a sliding-window memory (llama_kv_cache_iswa),
 * whose states hold only the window cache's last window, and memories of more
 * than two caches. A memory of two KV caches that keep every position (MLA
 * with an indexer, llama_kv_cache_dsa) is served, both restored whole. A model that names a window but runs one plain
 * cache (EXAONE 4 but its 32B) is served. A plain cache that masks by a
 * window (in v0.5.0 only MTP draft contexts have one) leaves the cells it
 * left behind out of its states: saving positions it no longer holds is
 * refused, and a restored prefix holds cells its mask ignores.
 *
 * Threads: a struct mcb_libllama is used by one thread at a time, like the
 * llama_context it wraps.
 */
#ifndef MCB_LIBLLAMA_H
#define MCB_LIBLLAMA_H

#include <stddef.h>

#include "llama.h"
#include "mcbridge.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A llama_context and its model's registration with a bridge. */
struct mcb_libllama;

/* Registers ctx's model with bridge. It decodes the probe prompt
 * (mcb_probe_tokens) into sequence probe_seq, which must be empty and is
 * empty again afterwards (the decode overwrites the context's logits), and
 * hands that sequence's state to mcb_model_register_state. gguf_path is the
 * file ctx's model was loaded from. The context and the bridge must outlive
 * the handle. */
mcb_status mcb_libllama_open(struct llama_context *ctx, mcb_bridge bridge, const char *gguf_path,
                             uint32_t block_tokens, llama_seq_id probe_seq, struct mcb_libllama **out);

/* Unregisters the model and frees the handle. NULL is a no-op. */
void mcb_libllama_close(struct mcb_libllama *s);

/* The registered model, for mcb_lookup and the other mcb_ calls. */
mcb_model mcb_libllama_model(const struct mcb_libllama *s);

/* Saves the full blocks of tokens[0, n_tokens): sequence seq must hold
 * them at positions 0 .. n_tokens-1, computed from position 0 under scope
 * (no context shift, no cache-reuse holes). Copies before it returns: the
 * context may change the sequence at once. out may be NULL. */
mcb_status mcb_libllama_save(struct mcb_libllama *s, llama_seq_id seq, const struct mcb_scope *scope,
                             const llama_token *tokens, size_t n_tokens, struct mcb_save_result *out);

/* Restores what the library decides to of tokens' leading blocks (leaving
 * at least the last token to compute) into sequence seq, which must be
 * empty. *n_restored receives the positions now in the sequence (0 .. n-1);
 * decode the rest of the prompt from position *n_restored on. Only verified
 * blocks are restored. When nothing is restored the sequence stays empty;
 * the status is MCB_STATUS_OK when nothing was cached or computing was
 * cheaper. *n_restored is always written. */
mcb_status mcb_libllama_restore(struct mcb_libllama *s, llama_seq_id seq, const struct mcb_scope *scope,
                                const llama_token *tokens, size_t n_tokens, size_t *n_restored);

/* The message of the last mcb_libllama_ call on this thread that did not
 * fully succeed, "" otherwise. Valid until the next such call. */
const char *mcb_libllama_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* MCB_LIBLLAMA_H */
