// The libllama host: llama.cpp's public sequence-state API on one side, the
// library's mcb_state_ calls on the other. See mcb_libllama.h.
#include "mcb_libllama.h"

#include <cstdarg>
#include <cstdio>
#include <new>
#include <string>
#include <vector>

struct mcb_libllama {
    llama_context *ctx = nullptr;
    mcb_model model = 0;
};

namespace {

thread_local std::string last_error;

mcb_status fail(mcb_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

mcb_status fail(mcb_status st, const char *fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    last_error = buf;
    return st;
}

mcb_status ok() {
    last_error.clear();
    return MCB_STATUS_OK;
}

bool valid_seq(llama_context *ctx, llama_seq_id seq) {
    // llama.cpp asserts (aborts) on sequence ids past n_seq_max.
    return seq >= 0 && static_cast<uint32_t>(seq) < llama_n_seq_max(ctx);
}

bool seq_empty(llama_context *ctx, llama_seq_id seq) {
    return llama_memory_seq_pos_max(llama_get_memory(ctx), seq) < 0;
}

// Reads seq's state blob; every byte is on the host (flags 0).
mcb_status read_state(llama_context *ctx, llama_seq_id seq, std::vector<uint8_t> *blob) {
    const size_t size = llama_state_seq_get_size_ext(ctx, seq, 0);
    if (size == 0) return fail(MCB_STATUS_INTERNAL, "llama_state_seq_get_size_ext(seq %d) failed", seq);
    blob->assign(size, 0);
    const size_t got = llama_state_seq_get_data_ext(ctx, blob->data(), size, seq, 0);
    if (got != size) return fail(MCB_STATUS_INTERNAL, "llama_state_seq_get_data_ext wrote %zu of %zu bytes", got, size);
    return MCB_STATUS_OK;
}

mcb_status decode_probe(llama_context *ctx, llama_seq_id seq) {
    std::vector<int32_t> toks(mcb_probe_tokens(nullptr, 0));
    mcb_probe_tokens(toks.data(), toks.size());
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
    llama_batch batch = llama_batch_init(static_cast<int32_t>(toks.size()), 0, 1);
    for (size_t i = 0; i < toks.size(); i++) {
        if (toks[i] >= n_vocab) {
            llama_batch_free(batch);
            return fail(MCB_STATUS_UNSUPPORTED, "the vocabulary has %d tokens; the probe needs %d", n_vocab, toks[i] + 1);
        }
        batch.token[i] = toks[i];
        batch.pos[i] = static_cast<llama_pos>(i);
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = seq;
        batch.logits[i] = i + 1 == toks.size();
    }
    batch.n_tokens = static_cast<int32_t>(toks.size());
    const int32_t rc = llama_decode(ctx, batch);
    llama_batch_free(batch);
    return rc == 0 ? MCB_STATUS_OK : fail(MCB_STATUS_INTERNAL, "probe decode failed (llama_decode %d)", rc);
}

} // namespace

extern "C" {

mcb_status mcb_libllama_open(llama_context *ctx, mcb_bridge bridge, const char *gguf_path, uint32_t block_tokens,
                             llama_seq_id probe_seq, mcb_libllama **out) {
    if (ctx == nullptr || out == nullptr || gguf_path == nullptr) return fail(MCB_STATUS_INVALID_ARG, "NULL context, model path or output");
    const llama_model *model = llama_get_model(ctx);
    const llama_rope_type rope = llama_model_rope_type(model);
    if (llama_get_memory(ctx) == nullptr) return fail(MCB_STATUS_UNSUPPORTED, "context without a KV cache");
    // llama.h names recurrent and hybrid models. A recurrent state is one cell
    // per sequence (its last position) and no per-token rows, so no prefix can
    // be cut from it; a hybrid's follows its KV cache's. Their states fail to
    // read, as malformed blobs would, so the reason is given here.
    if (llama_model_is_recurrent(model) || llama_model_is_hybrid(model))
        return fail(MCB_STATUS_UNSUPPORTED, "recurrent and hybrid models keep state other than a KV cache");
    // Sliding-window attention is not decided here: llama_model_n_swa names a
    // window that a model may not run (EXAONE 4 but its 32B has one plain
    // cache), and llama.h does not say which memory the context has. A
    // memory of several caches writes their states one after the other;
    // mcb_model_register_state below serves two KV caches that keep every
    // position (MLA with an indexer) and refuses an iSWA memory's, whose
    // window cache is written without the cells the window has passed, as
    // MCB_STATUS_UNSUPPORTED.
    if (llama_model_has_encoder(model)) return fail(MCB_STATUS_UNSUPPORTED, "encoder-decoder models");
    if (rope == LLAMA_ROPE_TYPE_MROPE || rope == LLAMA_ROPE_TYPE_IMROPE || rope == LLAMA_ROPE_TYPE_VISION)
        return fail(MCB_STATUS_UNSUPPORTED, "M-RoPE cells carry 2-D positions");
    if (!valid_seq(ctx, probe_seq))
        return fail(MCB_STATUS_INVALID_ARG, "probe sequence %d outside [0, %u)", probe_seq, llama_n_seq_max(ctx));
    if (!seq_empty(ctx, probe_seq)) return fail(MCB_STATUS_STATE, "probe sequence %d is not empty", probe_seq);

    mcb_status r = decode_probe(ctx, probe_seq);
    std::vector<uint8_t> blob;
    if (r == MCB_STATUS_OK) r = read_state(ctx, probe_seq, &blob);
    llama_memory_seq_rm(llama_get_memory(ctx), probe_seq, -1, -1);
    if (r != MCB_STATUS_OK) return r;

    mcb_model_params p = {};
    p.llama_version = mcb_llama_version();
    p.gguf_path = gguf_path;
    p.block_tokens = block_tokens;
    mcb_model m = 0;
    r = mcb_model_register_state(bridge, &p, blob.data(), blob.size(), &m);
    if (r != MCB_STATUS_OK) return fail(r, "mcb_model_register_state: %s", mcb_last_error());
    mcb_libllama *s = new (std::nothrow) mcb_libllama;
    if (s == nullptr) {
        mcb_model_unregister(m);
        return fail(MCB_STATUS_INTERNAL, "out of memory");
    }
    s->ctx = ctx;
    s->model = m;
    *out = s;
    return ok();
}

void mcb_libllama_close(mcb_libllama *s) {
    if (s == nullptr) return;
    mcb_model_unregister(s->model);
    delete s;
}

mcb_model mcb_libllama_model(const mcb_libllama *s) { return s ? s->model : 0; }

mcb_status mcb_libllama_save(mcb_libllama *s, llama_seq_id seq, const mcb_scope *scope, const llama_token *tokens,
                             size_t n_tokens, mcb_save_result *out) {
    if (s == nullptr || tokens == nullptr || n_tokens == 0) return fail(MCB_STATUS_INVALID_ARG, "NULL handle or no tokens");
    if (!valid_seq(s->ctx, seq)) return fail(MCB_STATUS_INVALID_ARG, "sequence %d outside [0, %u)", seq, llama_n_seq_max(s->ctx));
    std::vector<uint8_t> blob;
    mcb_status r = read_state(s->ctx, seq, &blob);
    if (r != MCB_STATUS_OK) return r;
    mcb_save_result res = {};
    r = mcb_state_save(s->model, scope, blob.data(), blob.size(), tokens, n_tokens, &res);
    if (r != MCB_STATUS_OK) return fail(r, "mcb_state_save: %s", mcb_last_error());
    if (out) *out = res;
    return ok();
}

mcb_status mcb_libllama_restore(mcb_libllama *s, llama_seq_id seq, const mcb_scope *scope, const llama_token *tokens,
                                size_t n_tokens, size_t *n_restored) {
    if (n_restored) *n_restored = 0;
    if (s == nullptr || tokens == nullptr || n_tokens == 0 || n_restored == nullptr)
        return fail(MCB_STATUS_INVALID_ARG, "NULL handle, tokens or output");
    if (!valid_seq(s->ctx, seq)) return fail(MCB_STATUS_INVALID_ARG, "sequence %d outside [0, %u)", seq, llama_n_seq_max(s->ctx));
    if (!seq_empty(s->ctx, seq)) return fail(MCB_STATUS_STATE, "sequence %d is not empty", seq);

    mcb_lookup_result lk = {};
    mcb_status r = mcb_lookup(s->model, scope, tokens, n_tokens, 0, &lk);
    if (r != MCB_STATUS_OK) return fail(r, "mcb_lookup: %s", mcb_last_error());
    if (lk.plan == 0) return ok();

    uint8_t *blob = nullptr;
    size_t size = 0;
    mcb_load_result lr = {};
    r = mcb_state_restore(lk.plan, &blob, &size, &lr);
    if (blob == nullptr) {
        // Evicted since the lookup, or nothing verified: compute it all.
        return r == MCB_STATUS_NOT_FOUND ? ok() : fail(r, "mcb_state_restore: %s", mcb_last_error());
    }
    const std::string load_note = r == MCB_STATUS_OK ? "" : mcb_last_error();
    const size_t read = llama_state_seq_set_data_ext(s->ctx, blob, size, seq, 0);
    mcb_state_free(blob);
    llama_memory_t mem = llama_get_memory(s->ctx);
    if (read != size || llama_memory_seq_pos_min(mem, seq) != 0 ||
        llama_memory_seq_pos_max(mem, seq) != static_cast<llama_pos>(lr.n_tokens_ok) - 1) {
        // llama.cpp rolls a refused restore back itself; make sure.
        llama_memory_seq_rm(mem, seq, -1, -1);
        return fail(MCB_STATUS_LAYOUT, "llama_state_seq_set_data_ext took %zu of %zu bytes (no free cells, or another format)",
                    read, size);
    }
    *n_restored = lr.n_tokens_ok;
    if (lr.n_tokens_ok < lk.n_restore_tokens) {
        fail(static_cast<mcb_status>(lr.first_error), "kept %u of %u tokens: %s", lr.n_tokens_ok, lk.n_restore_tokens,
             load_note.c_str());
        return MCB_STATUS_OK;
    }
    return ok();
}

const char *mcb_libllama_last_error(void) { return last_error.c_str(); }

} // extern "C"
