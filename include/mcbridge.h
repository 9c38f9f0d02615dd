/*
 * mcbridge.h - a global KV cache for llama.cpp.
 *
 * libmcbridge.a gives a llama.cpp process KV blocks that any process of the
 * swarm computed: the host asks how much of a prompt is cached (lookup),
 * restores those blocks layer by layer straight into its KV tensors (load),
 * and hands back the blocks it computed (save), which every other process
 * can then restore.
 *
 * Ownership
 *   - Pointer arguments are borrowed for the duration of the call; the
 *     library keeps none of them after it returns, except KV memory.
 *   - KV memory described by a struct mcb_kv_layout is borrowed from
 *     mcb_load_begin / mcb_save_begin until the matching _end returns. For a
 *     load the host must not treat rows as valid KV before
 *     mcb_load_wait_layer or mcb_load_end says they are; for a save it must
 *     not change the rows of layer il while mcb_save_layer(il) runs.
 *   - Outputs are caller-allocated: the caller passes a pointer to the
 *     handle or struct that the library fills. On failure outputs are left
 *     as they were unless stated otherwise.
 *   - Handles are integers from a table inside the library, never pointers.
 *     0 is never a valid handle and a handle is never reused, so a stale
 *     one cannot reach a newer object; an unknown, closed or wrong-kind
 *     handle gives MCB_STATUS_BAD_HANDLE and nothing else happens.
 *   - mcb_status_str and mcb_reason_str return static strings.
 *     mcb_last_error returns a thread-local string that stays valid until
 *     the next mcb_ call on the same thread.
 *
 * Threads: every function may be called from any thread. One load or save
 * handle is driven by one thread at a time.
 *
 * Failures: every call returns a status. A failed load never leaves
 * unverified bytes in the host's tensors: after a failure the rows of the
 * blocks past the good prefix hold either their previous bytes or verified
 * bytes of that block, and the host recomputes from the first failed block.
 *
 * Configuration: mcb_bridge_open takes a JSON document; NULL or "" reads
 * the MCB_CONFIG environment variable (inline JSON, or a file path) and,
 * without it, uses defaults: an in-process pool, the memory directory and
 * the in-process transport. See README.md for every key.
 */
#ifndef MCBRIDGE_H
#define MCBRIDGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MCB_ABI_VERSION 1

/* Status codes. The values are stable. */
typedef enum mcb_status {
    MCB_STATUS_OK             = 0,
    MCB_STATUS_INVALID_ARG    = 1,  /* a NULL, out-of-range or malformed argument */
    MCB_STATUS_BAD_HANDLE     = 2,  /* an unknown, closed or wrong-kind handle */
    MCB_STATUS_CONFIG         = 3,  /* the configuration cannot be parsed or used */
    MCB_STATUS_MODEL_MISMATCH = 4,  /* the model or its KV format differs */
    MCB_STATUS_LAYOUT         = 5,  /* a KV layout that does not fit the model or the cells */
    MCB_STATUS_STATE          = 6,  /* a call out of order: wait after end, close with work open */
    MCB_STATUS_NOT_FOUND      = 7,  /* nothing to restore for these tokens */
    MCB_STATUS_TRANSFER       = 8,  /* the transport failed: peer gone, request failed */
    MCB_STATUS_CORRUPT        = 9,  /* a block failed verification: checksum, key, tokens, generation */
    MCB_STATUS_TIMEOUT        = 10, /* a transfer or directory call ran past its deadline */
    MCB_STATUS_POOL_FULL      = 11, /* no room in the pool, even after eviction */
    MCB_STATUS_DIRECTORY      = 12, /* the directory is unreachable or refused the call */
    MCB_STATUS_UNSUPPORTED    = 13, /* valid, but not supported by this build or transport */
    MCB_STATUS_INTERNAL       = 14, /* a bug inside the library; the call had no effect */
} mcb_status;

/* Why the arbiter chose what it chose. */
typedef enum mcb_reason {
    MCB_REASON_NO_MATCH          = 0, /* no leading block of the prompt is cached */
    MCB_REASON_TOO_SHORT         = 1, /* no whole block fits before the token that must be computed */
    MCB_REASON_RESTORE           = 2, /* restoring is estimated faster */
    MCB_REASON_RECOMPUTE_CHEAPER = 3, /* recomputing is estimated faster */
    MCB_REASON_SPLIT             = 4, /* computing the head while restoring the tail is fastest */
    MCB_REASON_POLICY_FORCED     = 5, /* the configured policy chose, not the cost model */
    MCB_REASON_INVALID_INPUT     = 6, /* the input could not describe a prompt */
} mcb_reason;

typedef uint64_t mcb_bridge; /* an open bridge */
typedef uint64_t mcb_model;  /* a model registered with a bridge */
typedef uint64_t mcb_load;   /* a restore in progress */
typedef uint64_t mcb_save;   /* a save in progress */

/*
 * Everything that changes the bytes of a KV cache. Two registrations whose
 * fields differ never share blocks. Arrays hold n_layer entries.
 */
struct mcb_model_params {
    const char *llama_version;     /* llama.cpp release, e.g. "b6000"; the state format is keyed on it */
    const char *arch;              /* general.architecture */
    const char *gguf_path;         /* when not NULL, the library digests the file (cached by path, size, mtime) */
    uint8_t content_hash[16];      /* used when gguf_path is NULL: a digest of the model's weights */
    uint8_t kv_probe[16];          /* digest of the KV a fixed token sequence gives on this node; zeros if unknown */
    uint32_t n_layer;              /* layers that hold KV */
    uint32_t block_tokens;         /* tokens per block; 0 takes the configured default */
    const uint32_t *n_embd_k_gqa;  /* per layer */
    const uint32_t *n_embd_v_gqa;  /* per layer */
    const uint32_t *k_row_bytes;   /* bytes of one token's K row, per layer (ggml_row_size) */
    const uint32_t *v_row_bytes;   /* bytes of one token's V row, per layer */
    int32_t type_k;                /* enum ggml_type of K */
    int32_t type_v;                /* enum ggml_type of V */
    int32_t rope_type;
    float rope_freq_base;
    float rope_freq_scale;
    uint32_t n_ctx_orig;
    bool v_trans;                  /* V stored transposed (flash attention off) */
    bool attn_rot_k;               /* Hadamard rotation of quantized K */
    bool attn_rot_v;
    const char *extra;             /* anything else that changes KV bytes; may be NULL */
};

/* Separates key spaces within a model. NULL means no salt, base model. */
struct mcb_scope {
    const uint8_t *tenant_salt;    /* may be NULL when tenant_salt_len is 0 */
    size_t tenant_salt_len;
    const char *adapters;          /* canonical adapter set, e.g. "name@scale;..."; NULL for none */
};

/* Where one layer's K and V tensors live. */
struct mcb_kv_layer {
    void *k;
    void *v;
    uint64_t k_stride; /* bytes between the K rows of consecutive cells */
    uint64_t v_stride; /* bytes between V rows of consecutive cells, or, when V is
                          transposed, between the rows of consecutive dimensions */
};

/* A host's KV memory. The rows of cell c of layer l are at
 * layers[l].k + c * k_stride and layers[l].v + c * v_stride (or, transposed,
 * dimension d of cell c at layers[l].v + d * v_stride + c * element size). */
struct mcb_kv_layout {
    uint32_t n_layer;
    uint32_t n_cells;                   /* cells in every tensor */
    bool v_trans;
    const char *location;               /* "cpu:0" (NULL means cpu:0) */
    const struct mcb_kv_layer *layers;  /* n_layer entries */
};

struct mcb_lookup_result {
    uint32_t n_block_tokens;    /* the model's block size */
    uint32_t n_matched_blocks;  /* leading blocks of the prompt that are cached */
    uint32_t n_restore_tokens;  /* leading tokens to restore; 0 means compute everything */
    int32_t reason;             /* enum mcb_reason */
    double est_restore_ms;      /* estimated time to first token restoring every usable block */
    double est_recompute_ms;    /* estimated time to first token computing the whole prompt */
    double est_total_ms;        /* estimated time to first token of the chosen plan */
};

struct mcb_load_result {
    uint32_t n_blocks;     /* blocks the load started with */
    uint32_t n_blocks_ok;  /* leading blocks restored and verified */
    uint32_t n_tokens_ok;  /* n_blocks_ok * block size: positions [0, n_tokens_ok) are valid */
    int32_t first_error;   /* enum mcb_status of the first failed block, MCB_STATUS_OK if none */
    uint64_t n_bytes;      /* KV bytes placed */
};

struct mcb_save_result {
    uint32_t n_blocks;     /* full blocks in the tokens */
    uint32_t n_known;      /* already in the directory: skipped */
    uint32_t n_written;    /* copied into the pool */
    uint32_t n_published;  /* published by this save */
    uint32_t n_deduped;    /* written, but another process published the block first */
};

struct mcb_stats {
    uint64_t lookups;
    uint64_t hits;              /* lookups that matched at least one block */
    uint64_t misses;
    uint64_t decided_restore;
    uint64_t decided_recompute; /* matched, but recomputing was cheaper */
    uint64_t loads;
    uint64_t load_failures;
    uint64_t restored_tokens;
    uint64_t restored_bytes;
    uint64_t saves;
    uint64_t save_failures;
    uint64_t saved_blocks;
    uint64_t deduped_blocks;
    uint64_t evictions;
    uint64_t directory_errors;
    uint64_t torn_reads;
    uint64_t resident_blocks;   /* blocks this process holds in its pool */
    uint64_t resident_bytes;
    uint64_t pool_bytes;
};

/* The ABI version the library was built with (MCB_ABI_VERSION). */
uint32_t mcb_abi_version(void);

/* A static description of a status or a reason. */
const char *mcb_status_str(mcb_status status);
const char *mcb_reason_str(mcb_reason reason);

/* The message of the last failed call on this thread, "" after a success. */
const char *mcb_last_error(void);

/* Opens a bridge. config_json may be NULL or "" (see the top of this file). */
mcb_status mcb_bridge_open(const char *config_json, mcb_bridge *out);

/* Closes a bridge: unpublishes its blocks and releases its pool. Refused
 * with MCB_STATUS_STATE while a load or save of it is not ended. Model
 * handles of the bridge become invalid. */
mcb_status mcb_bridge_close(mcb_bridge bridge);

/* Counters since open. */
mcb_status mcb_bridge_stats(mcb_bridge bridge, struct mcb_stats *out);

/* Registers a model; registering the same parameters twice gives a second
 * handle on the same model. */
mcb_status mcb_model_register(mcb_bridge bridge, const struct mcb_model_params *params, mcb_model *out);

/* Drops a model handle. */
mcb_status mcb_model_unregister(mcb_model model);

/* Feeds the arbiter a measured prefill of positions [pos_start, pos_end). */
mcb_status mcb_model_observe_prefill(mcb_model model, uint32_t pos_start, uint32_t pos_end, double seconds);

/* Looks up how many leading tokens of a prompt to restore. Local only: it
 * never waits on the network and changes nothing. */
mcb_status mcb_lookup(mcb_model model, const struct mcb_scope *scope,
                      const int32_t *tokens, size_t n_tokens,
                      struct mcb_lookup_result *out);

/* Starts restoring positions [0, n_tokens) (whole blocks) into layout,
 * position i into cell cells[i] (cells NULL means cell i). Everything is
 * checked before any byte moves: a refused load leaves the tensors untouched.
 * Fewer blocks than asked may be found; none gives MCB_STATUS_NOT_FOUND. */
mcb_status mcb_load_begin(mcb_model model, const struct mcb_scope *scope,
                          const struct mcb_kv_layout *layout,
                          const int32_t *tokens, size_t n_tokens,
                          const uint32_t *cells, mcb_load *out);

/* Waits until layer il (and every layer below it) is verified and in
 * place; *n_tokens_ok receives the good prefix so far (it only shrinks). */
mcb_status mcb_load_wait_layer(mcb_load load, uint32_t il, uint32_t *n_tokens_ok);

/* Finishes a load; the handle is gone afterwards, also on failure. The
 * result is filled in either case; the status is the first failure's. */
mcb_status mcb_load_end(mcb_load load, struct mcb_load_result *out);

/* Starts saving the full blocks of tokens from layout (cells as for
 * mcb_load_begin). A trailing partial block is ignored. */
mcb_status mcb_save_begin(mcb_model model, const struct mcb_scope *scope,
                          const struct mcb_kv_layout *layout,
                          const int32_t *tokens, size_t n_tokens,
                          const uint32_t *cells, mcb_save *out);

/* Copies layer il's rows of the new blocks; call once per layer, as soon as
 * the layer's KV is final. */
mcb_status mcb_save_layer(mcb_save save, uint32_t il);

/* Seals and publishes the saved blocks; the handle is gone afterwards. */
mcb_status mcb_save_end(mcb_save save, struct mcb_save_result *out);

/* Handles currently open, of every kind: a host can check for leaks at exit. */
size_t mcb_handles_open(void);

#ifdef __cplusplus
}
#endif

#endif /* MCBRIDGE_H */
