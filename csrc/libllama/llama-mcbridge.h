// llama-mcbridge.h: the mcbridge side of a patched libllama (llama.cpp v0.5.0).
//
// Compiled into libllama only when llama.cpp is configured with -DMCBRIDGE_ROOT (see
// mcbridge.cmake); the patches in llama-patches/ call into it and nothing else. It
// owns three things:
//
//   - the process's bridge (opened once, from --mcb-config or MCB_CONFIG) and the
//     registration of each llama_context's KV format with it,
//   - stage 2: restoring positions [0, P) of a sequence through llama.cpp's own
//     restore machinery (llama_kv_cache::state_read) with a reader whose tensor reads
//     become one bridge load into the KV tensors, and the mirror for saves
//     (docs/design.md, "llama.cpp integration"),
//   - the origin of every sequence: the clean mark, the position below which its KV
//     was computed from position 0 over exactly its tokens (shifts and mid-sequence
//     removals lower it), and the scope (tenant, adapters) it was computed under; only
//     KV below the mark is ever published, and only under that scope. State that
//     llama.cpp saves and loads again keeps its scope.
//
// Everything here runs on the thread that drives the llama_context (the server's
// update loop); the bridge's own calls are thread-safe.
#pragma once

#include "llama.h"
#include "mcbridge.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

class llama_kv_cache;
class llama_memory_recurrent;

namespace mcb_llama {

class kv_stage;
struct stage_buf;

// Configuration, given before any context attaches. An empty config falls back to
// the MCB_CONFIG environment variable; neither set means the bridge stays off.
void set_config(const std::string & json_or_path);
// The tenant salt used when a request names none (--mcb-tenant).
void set_tenant(const std::string & tenant);
const std::string & default_tenant();

// The K and V tensors of every KV layer of a cache, each [n_embd, kv_size, n_stream]:
// stream s of layer l starts s * nb[2] bytes into k[l] and v[l]. A K-only cache
// (MLA: attention reads V out of K's latent) has no V tensors: every v[l] is null.
// An indexed memory's layers are its attention cache's, then its indexer cache's.
struct kv_storage {
    std::vector<ggml_tensor *> k;
    std::vector<ggml_tensor *> v;
};

// A context the bridge serves: its registration and what the server reports.
struct attachment {
    mcb_model   model   = 0;
    uint32_t    n_layer = 0; // 0: the memory has no KV layers, its snapshots are its state
    bool        v_trans = false;
    bool        k_only  = false; // no V tensors (MLA): the format's V rows are 0 bytes
    kv_storage  storage; // learned from the probe's sequence, which names its stream's views
    // Where some K or V tensor is not host memory (a GPU, an RPC server): the host
    // staging every load and save of the context goes through; nullptr otherwise.
    std::shared_ptr<kv_stage> stage;
    // With a partial state: how many tokens apart it is snapshotted, where restores end,
    // and what a snapshot holds (llama.cpp's state flags): the partial state, or the
    // whole state of a memory whose caches blocks cannot carry (DeepSeek V4's).
    uint32_t              snapshot_tokens = 0;
    llama_state_seq_flags snapshot_flags  = LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY;
    // What llama.cpp writes a snapshot into before the bridge copies it, kept from one
    // snapshot to the next (shared by the attachment's copies; the context's thread uses
    // it). A partial state is about the same size each time, and memory never written
    // costs a page fault every 4 KiB: a fresh 64 MiB vector took 180 ms on this
    // project's 2-core VM, a reused one 3 ms. One partial state stays allocated, as one
    // of llama-server's context checkpoints does.
    std::shared_ptr<std::vector<uint8_t>> snapshot_buf = std::make_shared<std::vector<uint8_t>>();
    std::string describe; // one line for the log: types, layers, layout
};

// Why the bridge cannot serve ctx (not a target context, non-causal, a memory it
// cannot restore exactly), or "" when it can: a plain KV cache, or a sliding-window or
// hybrid memory, whose attention cache blocks restore and whose partial state
// snapshots do, or a recurrent one, which snapshots alone restore (docs/design.md
// §5.9). attach refuses such a context.
std::string why_not_served(llama_context * ctx);
// Why ctx's memory is not one plain, causal KV cache, or "". llama-server asks it of a
// draft context, which a restore leaves to recompute its prefix in its own cache.
std::string why_not_plain(llama_context * ctx);
// What ctx's memory holds besides its attention cache, for a sequence (llama.cpp's
// PARTIAL_ONLY state: the window cache of an iSWA memory, the recurrent state of a
// hybrid one), described as the fingerprint needs it; "" for a plain cache.
std::string partial_state_of(llama_context * ctx);

// Registers ctx's KV format with the process's bridge (opening it on first use):
// the probe prompt is decoded into sequence 0 of the empty cache and its KV handed
// over, so that the library derives the model's identity as for any other host; a
// memory without KV layers hands over the probe's partial state instead.
// Returns false, with why_off set, when the bridge is off or cannot serve this
// context (draft, non-causal, a memory it cannot restore exactly).
bool attach(llama_context * ctx, const char * gguf_path, attachment & out, std::string & why_off);
void detach(llama_context * ctx);

// The process's bridge, 0 when off. For statistics.
mcb_bridge bridge();
// Whether a configuration was given (--mcb-config or MCB_CONFIG).
bool configured();

struct restore_result {
    int32_t    n_tokens = 0;        // positions [0, n_tokens) of the sequence are restored
    uint64_t   n_bytes  = 0;        // KV bytes placed
    uint64_t   n_snapshot_bytes = 0; // of them, the snapshot's (a memory with a partial state)
    mcb_status status   = MCB_STATUS_OK;
    bool       seq_cleared = false; // the sequence lost its previous cells (any attempt that got as far as llama.cpp's restore)
    std::string error;
    // With a partial state: the sequence's partial state (PARTIAL_ONLY) once restored,
    // which the host may keep as its own checkpoint of position n_tokens.
    std::vector<uint8_t> partial;
};

// A stage-2 restore in flight: seq_id holds positions [0, n_tokens) in cells the load
// is writing. Until seq_restore_end or seq_restore_cancel, no batch may hold seq_id and
// nothing may edit it; other sequences are decoded meanwhile (their tokens do not
// attend to its cells). load is 0 when no restore is in flight.
struct restore_op {
    llama_context * ctx      = nullptr;
    llama_seq_id    seq_id   = -1;
    int32_t         n_tokens = 0;
    uint32_t        n_layer  = 0;
    bool            partial  = false; // the memory keeps a partial state: the load brings its snapshot
    llama_state_seq_flags snapshot_flags = LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY; // what it holds
    mcb_load        load     = 0;
    // KV on a device: the load lands in staging, lent to op until it ends, and each
    // verified layer is uploaded into the cells as the polls find it.
    std::shared_ptr<kv_stage> stage;
    stage_buf *               staging    = nullptr;
    std::vector<uint32_t>     cells;          // where position i goes
    uint32_t                  strm       = 0; // their stream
    uint32_t                  n_uploaded = 0; // leading layers queued for upload
    uint32_t                  n_ok       = 0; // the verified prefix they were uploaded with
};

// Stage 2: starts restoring a lookup's plan (positions [0, n_tokens) of tokens, whole
// blocks) into seq_id; the plan is consumed. The sequence's previous cells are removed first
// (llama.cpp's restore always starts with seq_rm(seq, -1, -1)). Waits on no peer: on
// return op.load is set and the restore runs, or the result says why it did not start
// (the sequence is then empty, n_tokens 0).
restore_result seq_restore_begin(llama_context * ctx, const attachment & att, mcb_plan plan,
                                 llama_seq_id seq_id, const llama_token * tokens, int32_t n_tokens, restore_op & op);
// Waits at most timeout_us (0: not at all) for op's load to be over, verified or failed
// (its deadline included), and says whether it is: seq_restore_end then waits on no peer.
// With KV on a device it first queues the upload of every layer verified since the
// last poll.
bool seq_restore_poll(restore_op & op, uint32_t timeout_us);
// Ends op: the sequence keeps the verified prefix of the restore (n_tokens), the rest of
// its cells are removed; on failure it is left empty and n_tokens is 0, so the caller
// recomputes from position 0.
restore_result seq_restore_end(restore_op & op);
// Abandons op: its transfers stop and its cells leave the sequence, which is empty.
void seq_restore_cancel(restore_op & op);

struct save_result {
    int32_t         n_tokens = 0; // clean, contiguous positions handed to the bridge
    mcb_save_result blocks   = {};
    mcb_status      status   = MCB_STATUS_OK;
    std::string     error;
};

// The mirror for saves: hands the bridge the KV of positions [0, n) of seq_id, where n
// is the clean prefix of tokens[0, n_tokens) that the cache holds; the bridge keeps its
// full blocks. The rows are copied before this returns; publishing is the bridge's. A
// context without KV layers saves nothing here: its snapshots are all its state.
save_result seq_save(llama_context * ctx, const attachment & att, const mcb_scope * scope,
                     llama_seq_id seq_id, const llama_token * tokens, int32_t n_tokens);

// llama.cpp's own state of seq_id (flags: LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY, or 0 for
// the whole state), which reads device tensors through the backend; empty when it
// wrote none.
std::vector<uint8_t> seq_state(llama_context * ctx, llama_seq_id seq_id, llama_state_seq_flags flags);
// seq_state into buf, which it grows and never shrinks; returns the bytes written.
size_t seq_state_into(llama_context * ctx, llama_seq_id seq_id, llama_state_seq_flags flags, std::vector<uint8_t> & buf);

// Snapshots the state of seq_id a snapshot holds (att.snapshot_flags: the partial state, or
// the whole state), whose positions [0, n_tokens) hold tokens,
// computed from position 0 under scope (n_tokens a multiple of att.snapshot_tokens),
// into the bridge. Returns MCB_STATUS_OK or why not; the bridge publishes it.
mcb_status seq_snapshot(llama_context * ctx, const attachment & att, const mcb_scope * scope,
                        llama_seq_id seq_id, const llama_token * tokens, int32_t n_tokens, std::string & error);

// What a sequence's cells were computed under: the clean mark (KV at positions below
// it may be published) and the scope (mcb_scope_id) of the requests that computed
// them. known is false when nothing is known of the scope: cells loaded from outside,
// or computed by a request the bridge did not see.
struct seq_origin {
    llama_pos clean_end = 0;
    bool      known     = false;
    uint8_t   scope[16] = {};
};
seq_origin seq_get_origin(llama_context * ctx, llama_seq_id seq_id);
// Records the scope the sequence's cells are being computed under; with known false,
// also lowers the clean mark to 0, as nothing in it may be published.
void seq_set_scope(llama_context * ctx, llama_seq_id seq_id, const uint8_t scope[16], bool known);

// Called by llama_kv_cache (llama-patches/0002-mcbridge-kv-cache-clean-marks.patch)
// before it edits its cells, so that the clean marks follow every edit, whoever makes it.
void kv_seq_rm  (const llama_kv_cache * kv, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
void kv_seq_cp  (const llama_kv_cache * kv, llama_seq_id src, llama_seq_id dst, llama_pos p0, llama_pos p1);
void kv_seq_keep(const llama_kv_cache * kv, llama_seq_id seq_id);
void kv_seq_add (const llama_kv_cache * kv, llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos shift);
void kv_seq_div (const llama_kv_cache * kv, llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d);
void kv_clear   (const llama_kv_cache * kv);
// After a successful state_read: the loaded KV came from elsewhere.
void kv_state_read(const llama_kv_cache * kv, llama_seq_id seq_id);

// Called by llama_memory_recurrent (llama-patches/0007-mcbridge-recurrent-clean-marks.patch)
// likewise: the marks of a context whose memory has no KV layers, whose whole state is
// its recurrent state (Mamba) or a window cache beside one (LFM2 with a window), follow
// that memory's edits. Its state is one per sequence, of the whole history, so an edit
// that leaves the history in doubt makes every later state unclean.
void rs_seq_rm  (const llama_memory_recurrent * rs, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
void rs_seq_cp  (const llama_memory_recurrent * rs, llama_seq_id src, llama_seq_id dst, llama_pos p0, llama_pos p1);
void rs_seq_keep(const llama_memory_recurrent * rs, llama_seq_id seq_id);
void rs_seq_add (const llama_memory_recurrent * rs, llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos shift);
void rs_seq_div (const llama_memory_recurrent * rs, llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d);
void rs_clear   (const llama_memory_recurrent * rs);
void rs_state_read(const llama_memory_recurrent * rs, llama_seq_id seq_id);

// Sequence state llama.cpp writes out and reads back itself (POST /slots/N?action=save
// and restore, the prompt cache, context checkpoints) keeps the scope it was saved
// under. Each write of a sequence whose scope is known records that scope by the
// digest of the blob (by the identity of the file: device, inode, size, mtime); a read
// of the same bytes (the same file) into a sequence of an attached context gives that
// sequence the scope again. What was not seen written stays of no known scope, and
// ON_DEVICE state (a blob without the KV) records nothing. Called by llama-patches/0006
// after llama.cpp's own call, with its result n (0: it failed).
void seq_state_written(llama_context * ctx, llama_seq_id seq_id, llama_state_seq_flags flags,
                       const uint8_t * data, size_t n);
void seq_state_read(llama_context * ctx, llama_seq_id seq_id, llama_state_seq_flags flags,
                    const uint8_t * data, size_t n);
void seq_file_written(llama_context * ctx, llama_seq_id seq_id, const char * path, size_t n);
// read_state: the call read the sequence's state, not only the file's token count.
void seq_file_read(llama_context * ctx, llama_seq_id seq_id, const char * path, size_t n, bool read_state);

} // namespace mcb_llama
