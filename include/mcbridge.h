/*
 * mcbridge.h - a global KV cache for llama.cpp.
 *
 * libmcbridge.a gives a llama.cpp process KV blocks that any process of the
 * swarm computed: the host asks how much of a prompt to restore (lookup),
 * restores those blocks layer by layer straight into its KV tensors (load),
 * and hands over the blocks it computed (save), which every other process
 * can then restore. Hosts that see KV only as llama.cpp state blobs
 * (llama_state_seq_get_data / set_data) use the mcb_state_ calls instead.
 *
 * Everything that decides whether two processes share blocks lives in the
 * library, the same for every host: the model's identity (the GGUF's
 * digest, the KV format, the digest of the KV a fixed probe prompt
 * produces), the canonical scope of a request (tenant, adapters), the
 * restore-or-recompute decision and the metric names.
 *
 * Ownership
 *   - Pointer arguments are borrowed for the duration of the call; the
 *     library keeps none of them after it returns, except KV memory.
 *   - KV memory described by a struct mcb_kv_layout is borrowed from
 *     mcb_load_begin / mcb_save_begin until the matching _end returns. For a
 *     save the host must not change the rows of layer il while
 *     mcb_save_layer(il) runs.
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
 * Threads: every function may be called from any thread. One plan, load or
 * save handle is driven by one thread at a time. No call waits on the
 * directory: saves and evictions are published by the library's own
 * thread. Only a load waits on the network, on the library's threads: its
 * transfers get the deadline the arbiter gave the restore (a few times its
 * estimated time, never more than the compute it saves, plus a margin),
 * at most transfer_timeout_ms. mcb_load_begin never waits on a peer, and
 * mcb_load_poll lets a host go on with other work while a load runs.
 *
 * Failures: every call returns a status. A load fills only the cells it is
 * given, which must hold nothing another sequence reads; after a load,
 * positions [0, n_tokens_ok) are verified, byte for byte, and the cells of
 * every later position hold unspecified bytes: the host removes them from
 * the sequence (llama.cpp's own restore does) and recomputes from
 * n_tokens_ok. No verified position is ever wrong, and once mcb_load_end
 * returns nothing the load started writes into the cells again, even a
 * transfer from a peer that answers after the deadline.
 *
 * Configuration: mcb_bridge_open takes a JSON document; NULL or "" reads
 * the MCB_CONFIG environment variable (inline JSON, or a file path) and,
 * without it, uses defaults: an in-process pool, the memory directory and
 * the in-process transport. docs/design.md lists every key.
 *
 * Logging: what no caller can hear (a directory that cannot be reached, a
 * lease lost, an entry that does not decode) goes to stderr, rate-limited;
 * MCB_LOG=debug|info|warn|error|off sets the level.
 */
#ifndef MCBRIDGE_H
#define MCBRIDGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* MCB_API marks every function of the library. It exports them with
 * default visibility, so that a host built with -fvisibility=hidden that
 * links libmcbridge.a into a shared library (libllama) still exports them
 * to its programs. A host may define MCB_API itself before including this
 * file. */
#ifndef MCB_API
#if defined(__GNUC__) || defined(__clang__)
#define MCB_API __attribute__((visibility("default")))
#else
#define MCB_API
#endif
#endif

#define MCB_ABI_VERSION 6

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

/* Why a lookup decided as it did. */
typedef enum mcb_reason {
    MCB_REASON_NO_MATCH          = 0, /* no leading block of the prompt is cached */
    MCB_REASON_TOO_SHORT         = 1, /* no whole block fits before the token that must be computed */
    MCB_REASON_RESTORE           = 2, /* restoring is estimated faster */
    MCB_REASON_RECOMPUTE_CHEAPER = 3, /* recomputing is estimated faster */
    /* 4 is not used: it named split plans (compute the head while the tail
     * is restored), which no host can place. */
    MCB_REASON_POLICY_FORCED     = 5, /* the configured policy chose, not the cost model */
    MCB_REASON_INVALID_INPUT     = 6, /* the input could not describe a prompt */
    MCB_REASON_LOCAL             = 7, /* the host's own cache holds as much, or computing the rest is cheaper */
} mcb_reason;

typedef uint64_t mcb_bridge; /* an open bridge */
typedef uint64_t mcb_model;  /* a model registered with a bridge */
typedef uint64_t mcb_plan;   /* a lookup's decision to restore, until loaded or dropped */
typedef uint64_t mcb_load;   /* a restore in progress */
typedef uint64_t mcb_save;   /* a save in progress */

/* What names a model, for every host. The rest of its identity (the
 * architecture, the digest of the file, the KV probe) the library derives. */
struct mcb_model_params {
    const char *llama_version;  /* the llama.cpp tag the host is built from; must be mcb_llama_version() */
    const char *gguf_path;      /* the model file: read for general.architecture and digested
                                   (cached by path, size and mtime) */
    uint32_t block_tokens;      /* tokens per block; 0 takes the configured default */
    const char *extra;          /* what changes KV bytes that the probe cannot see; NULL for none.
                                   Server-wide adapters, control vectors and rope overrides change
                                   the probe's KV, so llama-server passes none. */
    const char *partial_state;  /* NULL when the KV rows are the host's whole state. Else what the
                                   rest of it is (llama.cpp's PARTIAL_ONLY state: a sliding-window
                                   cache, a recurrent state), which joins the fingerprint: the host
                                   then snapshots it every mcb_model_snapshot_tokens tokens
                                   (mcb_snapshot_save), restores end only where a snapshot was
                                   taken, and each load hands its snapshot back
                                   (mcb_load_snapshot). mcb_model_register takes one, and so does
                                   mcb_model_register_state for a model without KV rows. */
    uint32_t partial_kv_streams; /* 0 unless the partial state is a KV cache's (a sliding-window
                                   memory's window cache). Then the KV streams of the host's context
                                   (llama_kv_cache::get_n_stream: 1 when unified, else one per
                                   sequence), which llama.cpp frames such a state by and refuses a
                                   state of another count: mcb_load_snapshot frames a snapshot that a
                                   context of another count took for this one. */
};

/* A KV cache's shape, for hosts that hand over tensors. Arrays hold n_layer
 * entries. A layer without a V tensor (every layer of an MLA cache, where
 * attention reads V out of K's latent; an indexer cache's layers after an
 * attention cache's with V) has n_embd_v_gqa and v_row_bytes 0, and its
 * layouts' layer a NULL v; type_v does not key it (hosts that see only
 * states, which name no V type there, key it with type_k). */
struct mcb_kv_format {
    uint32_t n_layer;              /* layers that hold KV */
    const uint32_t *n_embd_k_gqa;  /* per layer */
    const uint32_t *n_embd_v_gqa;  /* per layer */
    const uint32_t *k_row_bytes;   /* bytes of one token's K row, per layer (ggml_row_size) */
    const uint32_t *v_row_bytes;   /* bytes of one token's V row, per layer */
    int32_t type_k;                /* enum ggml_type of K */
    int32_t type_v;                /* enum ggml_type of V */
    bool v_trans;                  /* V stored transposed (flash attention off) */
};

/* A LoRA adapter a request runs with. Adapters are named by the digest of
 * their file, so the same adapter loaded from another path shares KV;
 * scale 0 is no adapter. */
struct mcb_adapter {
    const char *path;
    float scale;
};

/* Separates key spaces within a model: a tenant salt and the adapter set.
 * NULL means no salt, base model. The order of adapters does not matter. */
struct mcb_scope {
    const uint8_t *tenant_salt;         /* may be NULL when tenant_salt_len is 0 */
    size_t tenant_salt_len;
    const struct mcb_adapter *adapters; /* may be NULL when n_adapters is 0 */
    size_t n_adapters;
};

/* Where one layer's K and V tensors live (v NULL in a cache without V). */
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
    uint32_t n_restore_tokens;  /* leading tokens to restore; 0: compute on from what the host holds */
    int32_t reason;             /* enum mcb_reason */
    double est_restore_ms;      /* estimated time to first token restoring every usable block */
    double est_recompute_ms;    /* estimated time to first token computing the whole prompt */
    double est_total_ms;        /* estimated time to first token of the chosen plan */
    mcb_plan plan;              /* set when n_restore_tokens > 0, else 0 */
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
    uint32_t n_written;    /* copied into the pool and sealed: this process restores them at once */
    uint32_t n_queued;     /* handed to the publisher (new blocks and earlier unpublished ones) */
};

struct mcb_stats {
    uint64_t lookups;
    uint64_t hits;              /* lookups that matched at least one block */
    uint64_t misses;
    uint64_t decided_restore;
    uint64_t decided_recompute; /* matched, but recomputing was cheaper */
    uint64_t decided_local;     /* matched, but the host's own cache held as much or nearly */
    uint64_t loads;
    uint64_t load_failures;
    uint64_t restored_tokens;
    uint64_t restored_bytes;
    uint64_t saves;
    uint64_t save_failures;
    uint64_t saved_blocks;      /* published by this process */
    uint64_t deduped_blocks;    /* sealed, but another process published the block first */
    uint64_t evictions;
    uint64_t directory_errors;
    uint64_t torn_reads;
    uint64_t resident_blocks;   /* blocks this process holds in its pool */
    uint64_t resident_bytes;
    uint64_t pool_bytes;
};

/*
 * Every function below returns a status or says what it returns instead.
 * Returns: lists the statuses a call gives and what each means for that
 * call. Any call that returns an mcb_status may also give
 * MCB_STATUS_INTERNAL: a bug inside the library, caught; the call had no
 * effect. mcb_last_error says more about every status but MCB_STATUS_OK.
 */

/* The ABI version the library was built with.
 * Returns: MCB_ABI_VERSION of the header the library was built with. */
MCB_API uint32_t mcb_abi_version(void);

/* The llama.cpp tag whose state format the library reads and writes.
 * Returns: a static string, e.g. "v0.5.0". */
MCB_API const char *mcb_llama_version(void);

/* A description of a status or a reason.
 * Returns: a static string; "unknown status" or "unknown reason" for a
 * value the enum does not name. */
MCB_API const char *mcb_status_str(mcb_status status);
MCB_API const char *mcb_reason_str(mcb_reason reason);

/* The message of the last failed call on this thread.
 * Returns: a thread-local string, "" after a success; valid until the
 * next mcb_ call on the same thread. */
MCB_API const char *mcb_last_error(void);

/* Opens a bridge. config_json may be NULL or "" (see the top of this file).
 * A refused configuration is remembered for mcb_metrics_text.
 * Returns:
 *   MCB_STATUS_OK           *out is the new bridge.
 *   MCB_STATUS_INVALID_ARG  out is NULL or misaligned, or config_json is
 *                           not terminated within the size limit.
 *   MCB_STATUS_CONFIG       the configuration does not parse, or names
 *                           what cannot be used (a library that does not
 *                           load, an unknown policy).
 *   MCB_STATUS_POOL_FULL    the pool cannot be mapped.
 *   MCB_STATUS_TRANSFER     the transport cannot start or register the
 *                           pool.
 *   MCB_STATUS_DIRECTORY    the directory cannot be opened.
 *   MCB_STATUS_UNSUPPORTED  the configuration asks for what this build
 *                           lacks. */
MCB_API mcb_status mcb_bridge_open(const char *config_json, mcb_bridge *out);

/* Closes a bridge: hands the directory what the publisher still holds,
 * unpublishes its blocks and releases its pool. Model and plan handles of
 * the bridge become invalid.
 * Returns:
 *   MCB_STATUS_OK           closed.
 *   MCB_STATUS_BAD_HANDLE   bridge is not an open bridge.
 *   MCB_STATUS_STATE        a load or save of the bridge is not ended:
 *                           nothing was closed, the bridge stays usable.
 *   MCB_STATUS_TIMEOUT, MCB_STATUS_DIRECTORY, MCB_STATUS_TRANSFER
 *                           closed, but the directory or a transfer did
 *                           not finish in time: entries it could not
 *                           remove expire with this process's lease. */
MCB_API mcb_status mcb_bridge_close(mcb_bridge bridge);

/* Counters since open.
 * Returns:
 *   MCB_STATUS_OK           *out is filled.
 *   MCB_STATUS_BAD_HANDLE   bridge is not an open bridge.
 *   MCB_STATUS_INVALID_ARG  out is NULL or misaligned. */
MCB_API mcb_status mcb_bridge_stats(mcb_bridge bridge, struct mcb_stats *out);

/* Waits until the blocks this bridge saved before the call are named by
 * the directory, for at most timeout_ms. A host whose process may be
 * killed as soon as an answer is out (Ollama unloads a runner with SIGKILL
 * when keep_alive is 0) calls it before the answer's last byte, off its
 * decode thread, so that a store node hears of the answer's blocks first.
 * A directory failing now is not waited on.
 * Returns:
 *   MCB_STATUS_OK           nothing was queued, or all of it is published
 *                           (or was found published by another process).
 *   MCB_STATUS_TIMEOUT      not in time: the blocks stay queued and
 *                           restorable in this process.
 *   MCB_STATUS_DIRECTORY    the directory refuses or does not answer now.
 *   MCB_STATUS_BAD_HANDLE   bridge is not an open bridge. */
MCB_API mcb_status mcb_bridge_wait_published(mcb_bridge bridge, uint32_t timeout_ms);

/* Writes the bridge's metrics in the Prometheus text format into buf
 * (NUL-terminated, truncated to cap - 1 bytes). Every host exposes the
 * same mcbridge_* series. bridge may be 0 (not open, or its configuration
 * refused): the text then says mcbridge_up 0 and why. off_reason, when not
 * NULL, is why the host does not use the bridge (a draft model, say):
 * mcbridge_up is then 0 with that reason.
 * Returns: the length of the whole text, so a host can retry with a larger
 * buffer; 0 when the text cannot be produced. */
MCB_API size_t mcb_metrics_text(mcb_bridge bridge, const char *off_reason, char *buf, size_t cap);

/* The probe prompt: a host decodes these tokens from position 0 into an
 * empty sequence, then registers the model with that sequence's KV. Writes
 * at most cap tokens to out (nothing when out is NULL or misaligned).
 * Returns: how many tokens the probe has. */
MCB_API size_t mcb_probe_tokens(int32_t *out, size_t cap);

/* Registers a model. probe_kv and probe_cells locate the KV of the probe
 * prompt, position i in cell probe_cells[i]; only those rows are read, and
 * only during the call. Registering the same model twice gives a second
 * handle on it.
 * Returns:
 *   MCB_STATUS_OK              *out is the new model.
 *   MCB_STATUS_BAD_HANDLE      bridge is not an open bridge.
 *   MCB_STATUS_INVALID_ARG     a NULL or malformed argument, or a
 *                              gguf_path that is not a readable GGUF.
 *   MCB_STATUS_MODEL_MISMATCH  llama_version is not mcb_llama_version().
 *   MCB_STATUS_LAYOUT          probe_kv does not fit format or the cells.
 *   MCB_STATUS_UNSUPPORTED     a KV format the library cannot store
 *                              (rows that are not whole ggml rows, K and V
 *                              types that differ between layers). */
MCB_API mcb_status mcb_model_register(mcb_bridge bridge, const struct mcb_model_params *params,
                                      const struct mcb_kv_format *format,
                                      const struct mcb_kv_layout *probe_kv, const uint32_t *probe_cells,
                                      mcb_model *out);

/* Registers a model for a host that sees KV as state blobs: the format and
 * the probe's KV are read from probe_state, a llama_state_seq_get_data blob
 * of a sequence that holds exactly the probe prompt.
 * With params->partial_state, it registers instead a model that has no KV
 * rows for a host that hands over tensors: a memory whose whole state is
 * its partial state (one recurrent state, as Mamba's; a window cache and a
 * recurrent state, as LFM2's when every attention layer has a window).
 * probe_state is then that state of the probe sequence
 * (llama_state_seq_get_data_ext with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY),
 * whose bytes name the weights and numerics as a probe's KV rows do;
 * partial_kv_streams must be 0 (partial_state names the streams the state
 * is framed by). The host saves snapshots alone (mcb_snapshot_save), and
 * loads them with mcb_load_begin and mcb_load_snapshot.
 * Returns:
 *   MCB_STATUS_OK              *out is the new model.
 *   MCB_STATUS_BAD_HANDLE      bridge is not an open bridge.
 *   MCB_STATUS_INVALID_ARG     a NULL or malformed argument, or a
 *                              gguf_path that is not a readable GGUF.
 *   MCB_STATUS_MODEL_MISMATCH  llama_version is not mcb_llama_version(), or
 *                              the blob does not hold the probe prompt.
 *   MCB_STATUS_UNSUPPORTED     a blob this llama.cpp version does not
 *                              write, the state of a memory of several
 *                              KV caches (one cache's state after the
 *                              other's: sliding-window attention, MLA with
 *                              an indexer), or a KV format the library
 *                              cannot store. */
MCB_API mcb_status mcb_model_register_state(mcb_bridge bridge, const struct mcb_model_params *params,
                                            const uint8_t *probe_state, size_t n_bytes, mcb_model *out);

/* Drops a model handle.
 * Returns:
 *   MCB_STATUS_OK          dropped.
 *   MCB_STATUS_BAD_HANDLE  model is not an open model. */
MCB_API mcb_status mcb_model_unregister(mcb_model model);

/* Feeds the cost model a measured prefill of positions [pos_start, pos_end).
 * Returns:
 *   MCB_STATUS_OK           taken.
 *   MCB_STATUS_BAD_HANDLE   model is not an open model.
 *   MCB_STATUS_INVALID_ARG  an empty range, or seconds not positive and
 *                           finite. */
MCB_API mcb_status mcb_model_observe_prefill(mcb_model model, uint32_t pos_start, uint32_t pos_end, double seconds);

/* A digest naming a scope: a host keeps it with cells it computed, and
 * compares it with a request's, to know whether those cells hold that
 * request's KV.
 * Returns:
 *   MCB_STATUS_OK           out holds the digest.
 *   MCB_STATUS_INVALID_ARG  out is NULL, or a malformed scope. */
MCB_API mcb_status mcb_scope_id(const struct mcb_scope *scope, uint8_t out[16]);

/* Decides how many leading tokens of a prompt to restore. n_cached is how
 * many leading tokens the host already holds for this prompt under the
 * same scope: a restore replaces them, so it is chosen only when it goes
 * past them and beats computing the rest. The answer is final. When it
 * restores, out->plan is set: load it (mcb_load_begin, mcb_state_restore)
 * or drop it. Local only: it never waits on the network.
 * Returns:
 *   MCB_STATUS_OK           *out is the decision (out->reason says why).
 *   MCB_STATUS_BAD_HANDLE   model is not an open model.
 *   MCB_STATUS_INVALID_ARG  a NULL or malformed argument (tokens, scope,
 *                           n_cached past n_tokens). */
MCB_API mcb_status mcb_lookup(mcb_model model, const struct mcb_scope *scope,
                              const int32_t *tokens, size_t n_tokens, size_t n_cached,
                              struct mcb_lookup_result *out);

/* Drops a plan that will not be loaded.
 * Returns:
 *   MCB_STATUS_OK          dropped.
 *   MCB_STATUS_BAD_HANDLE  plan is not an open plan. */
MCB_API mcb_status mcb_plan_drop(mcb_plan plan);

/* Starts restoring a plan's tokens into layout, position i into cell
 * cells[i] (cells NULL means cell i). A model registered without KV rows
 * (mcb_model_register_state with a partial_state) takes layout and cells
 * NULL: the load fetches its snapshot alone. The plan is consumed, also on
 * failure. Everything is checked before any byte moves: a refused load
 * leaves the tensors untouched.
 * Returns:
 *   MCB_STATUS_OK           *out is the load.
 *   MCB_STATUS_BAD_HANDLE   plan is not an open plan.
 *   MCB_STATUS_INVALID_ARG  out is NULL or misaligned, or cells malformed.
 *   MCB_STATUS_LAYOUT       layout does not fit the model or the cells.
 *   MCB_STATUS_NOT_FOUND    every block of the plan left the cache since
 *                           the lookup (fewer leaving shortens the load).
 *   MCB_STATUS_STATE        the bridge is closing. */
MCB_API mcb_status mcb_load_begin(mcb_plan plan, const struct mcb_kv_layout *layout,
                                  const uint32_t *cells, mcb_load *out);

/* Waits until layer il (and every layer below it) is verified and in
 * place; *n_tokens_ok receives the good prefix so far (it only shrinks).
 * Returns:
 *   MCB_STATUS_OK           *n_tokens_ok is set.
 *   MCB_STATUS_BAD_HANDLE   load is not an open load.
 *   MCB_STATUS_INVALID_ARG  il is not a layer, or n_tokens_ok is NULL or
 *                           misaligned.
 *   MCB_STATUS_STATE        the load has ended.
 *   MCB_STATUS_CORRUPT, MCB_STATUS_TRANSFER, MCB_STATUS_TIMEOUT
 *                           a block failed: *n_tokens_ok is the prefix
 *                           before it, still good. */
MCB_API mcb_status mcb_load_wait_layer(mcb_load load, uint32_t il, uint32_t *n_tokens_ok);

/* Says, without waiting, how far the load is: *n_layers receives how many
 * leading layers are verified and in place (as mcb_load_wait_layer would
 * find them), *n_tokens_ok the good prefix so far (it only shrinks). A host
 * that moves each layer on as soon as it is in place (an upload into device
 * memory) asks between its other work and then waits on no peer.
 * Returns:
 *   MCB_STATUS_OK           both are set.
 *   MCB_STATUS_BAD_HANDLE   load is not an open load.
 *   MCB_STATUS_INVALID_ARG  n_layers or n_tokens_ok is NULL or misaligned.
 *   MCB_STATUS_STATE        the load has ended. */
MCB_API mcb_status mcb_load_progress(mcb_load load, uint32_t *n_layers, uint32_t *n_tokens_ok);

/* Waits at most timeout_us microseconds (0: not at all) for the load to be
 * over: every layer verified and in place, or failed, its deadline
 * included. *done says whether it is; mcb_load_end then waits on no peer.
 * Returns:
 *   MCB_STATUS_OK           *done is set.
 *   MCB_STATUS_BAD_HANDLE   load is not an open load.
 *   MCB_STATUS_INVALID_ARG  done is NULL. */
MCB_API mcb_status mcb_load_poll(mcb_load load, uint32_t timeout_us, bool *done);

/* Abandons a load the host no longer wants (its request went away): the
 * transfers still running are stopped, no peer is blamed for them, and
 * only blocks already whole and verified count, which are none unless
 * every layer was in. End it with mcb_load_end, which then waits on no
 * peer and reports MCB_STATUS_STATE; once the load is over, a cancel
 * changes nothing.
 * Returns:
 *   MCB_STATUS_OK           the load is being stopped.
 *   MCB_STATUS_BAD_HANDLE   load is not an open load. */
MCB_API mcb_status mcb_load_cancel(mcb_load load);

/* Finishes a load, waiting until it is over; the handle is gone afterwards,
 * also on failure. The result is filled in either case.
 * Returns:
 *   MCB_STATUS_OK           every block arrived intact.
 *   MCB_STATUS_BAD_HANDLE   load is not an open load.
 *   MCB_STATUS_INVALID_ARG  out is NULL or misaligned.
 *   MCB_STATUS_CORRUPT, MCB_STATUS_TRANSFER, MCB_STATUS_TIMEOUT
 *                           the first failed block's status:
 *                           out->n_tokens_ok says what is good.
 *   MCB_STATUS_STATE        the load was cancelled before it was over. */
MCB_API mcb_status mcb_load_end(mcb_load load, struct mcb_load_result *out);

/* Starts saving the full blocks of tokens from layout (cells as for
 * mcb_load_begin). The KV must have been computed from position 0 over
 * exactly these tokens, under scope. A trailing partial block is ignored.
 * Returns:
 *   MCB_STATUS_OK           *out is the save.
 *   MCB_STATUS_BAD_HANDLE   model is not an open model.
 *   MCB_STATUS_INVALID_ARG  a NULL or malformed argument, or no full
 *                           block in the tokens.
 *   MCB_STATUS_LAYOUT       layout does not fit the model or the cells.
 *   MCB_STATUS_POOL_FULL    no room for any new block, even after
 *                           eviction.
 *   MCB_STATUS_STATE        the bridge is closing. */
MCB_API mcb_status mcb_save_begin(mcb_model model, const struct mcb_scope *scope,
                                  const struct mcb_kv_layout *layout,
                                  const int32_t *tokens, size_t n_tokens,
                                  const uint32_t *cells, mcb_save *out);

/* Copies layer il's rows of the new blocks; call once per layer, as soon as
 * the layer's KV is final.
 * Returns:
 *   MCB_STATUS_OK           copied.
 *   MCB_STATUS_BAD_HANDLE   save is not an open save.
 *   MCB_STATUS_INVALID_ARG  il is not a layer.
 *   MCB_STATUS_STATE        the layer was saved already, or the save
 *                           ended. */
MCB_API mcb_status mcb_save_layer(mcb_save save, uint32_t il);

/* Seals the saved blocks and queues them for publishing; it does not wait
 * for the directory. The handle is gone afterwards.
 * Returns:
 *   MCB_STATUS_OK           *out says what was stored.
 *   MCB_STATUS_BAD_HANDLE   save is not an open save.
 *   MCB_STATUS_INVALID_ARG  out is NULL or misaligned.
 *   MCB_STATUS_STATE        a layer was never saved: nothing is sealed.
 *   MCB_STATUS_POOL_FULL    the pool filled before every block was
 *                           written: *out counts the ones that were. */
MCB_API mcb_status mcb_save_end(mcb_save save, struct mcb_save_result *out);

/* Restores a plan of a model registered with mcb_model_register_state into
 * a new state blob for llama_state_seq_set_data: it holds positions
 * [0, out->n_tokens_ok). The plan is consumed. Whenever a block verified,
 * *state and *n_bytes are set, also when the status is the failure that
 * cut the load short (a partial restore); free the blob with
 * mcb_state_free. out is filled once the load started, its first_error
 * saying what cut it short.
 * Returns:
 *   MCB_STATUS_OK           *state holds every planned block.
 *   MCB_STATUS_BAD_HANDLE   plan is not an open plan.
 *   MCB_STATUS_INVALID_ARG  a NULL or misaligned output.
 *   MCB_STATUS_UNSUPPORTED  the model was registered with tensors:
 *                           restore with mcb_load_begin.
 *   MCB_STATUS_NOT_FOUND    every block of the plan left the cache since
 *                           the lookup.
 *   MCB_STATUS_CORRUPT, MCB_STATUS_TRANSFER, MCB_STATUS_TIMEOUT
 *                           a block failed; *state holds the blocks
 *                           before it, if any verified.
 *   MCB_STATUS_STATE        the bridge is closing. */
MCB_API mcb_status mcb_state_restore(mcb_plan plan, uint8_t **state, size_t *n_bytes, struct mcb_load_result *out);

/* Frees a blob from mcb_state_restore. NULL is a no-op.
 * Returns: nothing. */
MCB_API void mcb_state_free(uint8_t *state);

/* Saves the full blocks of a state blob (llama_state_seq_get_data of a
 * sequence whose positions [0, n_tokens) hold tokens, computed from position
 * 0 under scope), as mcb_save_begin .. mcb_save_end do. A failure after
 * some blocks were saved still fills out with what was.
 * Returns:
 *   MCB_STATUS_OK              *out says what was stored.
 *   MCB_STATUS_BAD_HANDLE      model is not an open model.
 *   MCB_STATUS_INVALID_ARG     a NULL or malformed argument, or no full
 *                              block in the tokens.
 *   MCB_STATUS_MODEL_MISMATCH  the blob's KV format is not the model's.
 *   MCB_STATUS_UNSUPPORTED     a blob this llama.cpp version does not
 *                              write, or cells it cannot read as one
 *                              sequence.
 *   MCB_STATUS_POOL_FULL       the pool filled: *out counts what was
 *                              stored.
 *   MCB_STATUS_STATE           the bridge is closing. */
MCB_API mcb_status mcb_state_save(mcb_model model, const struct mcb_scope *scope,
                                  const uint8_t *state, size_t n_bytes,
                                  const int32_t *tokens, size_t n_tokens,
                                  struct mcb_save_result *out);

/* How many tokens apart the host snapshots a model's partial state: the
 * model's block size times the bridge's snapshot_blocks.
 * Returns: the spacing, 0 for a model registered without a partial state
 * or a handle that is not an open model. */
MCB_API uint32_t mcb_model_snapshot_tokens(mcb_model model);

/* Stores state, the host's partial state once positions [0, n_tokens) were
 * computed from position 0 over exactly tokens under scope (a sliding-window
 * cache's or a recurrent memory's llama_state_seq_get_data_ext with
 * LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY), and queues it for publishing; it does
 * not wait for the directory. A snapshot stored here or published already
 * is not stored again.
 * Returns:
 *   MCB_STATUS_OK           stored, or known already.
 *   MCB_STATUS_BAD_HANDLE   model is not an open model.
 *   MCB_STATUS_INVALID_ARG  a NULL or malformed argument, n_tokens not a
 *                           positive multiple of the block size, or an
 *                           empty state.
 *   MCB_STATUS_UNSUPPORTED  the model was registered without a partial
 *                           state.
 *   MCB_STATUS_POOL_FULL    no room for it, even after eviction.
 *   MCB_STATUS_STATE        the bridge is closing. */
MCB_API mcb_status mcb_snapshot_save(mcb_model model, const struct mcb_scope *scope,
                                     const int32_t *tokens, size_t n_tokens,
                                     const uint8_t *state, size_t n_bytes);

/* Waits until a load is over and copies out the snapshot of the partial
 * state its tokens end at, verified, for llama_state_seq_set_data_ext with
 * LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY once the blocks are in; free it with
 * mcb_state_free. Call it before mcb_load_end. A load whose snapshot fails
 * restores nothing: mcb_load_end reports n_tokens_ok 0.
 * Returns:
 *   MCB_STATUS_OK           *state and *n_bytes are set (NULL and 0 for a
 *                           model without a partial state).
 *   MCB_STATUS_BAD_HANDLE   load is not an open load.
 *   MCB_STATUS_INVALID_ARG  state or n_bytes is NULL or misaligned.
 *   MCB_STATUS_CORRUPT, MCB_STATUS_TRANSFER, MCB_STATUS_TIMEOUT,
 *   MCB_STATUS_NOT_FOUND    the snapshot did not arrive intact.
 *   MCB_STATUS_STATE        the load has ended. */
MCB_API mcb_status mcb_load_snapshot(mcb_load load, uint8_t **state, size_t *n_bytes);

/* Handles currently open, of every kind: a host can check for leaks at exit.
 * Returns: the count. */
MCB_API size_t mcb_handles_open(void);

#ifdef __cplusplus
}
#endif

#endif /* MCBRIDGE_H */
