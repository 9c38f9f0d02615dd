#include "mcb_stage1.h"

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "ggml.h"
#include "seq_state.hpp"

using mcb_seqstate::KVFormat;
using mcb_seqstate::LayerFormat;
using mcb_seqstate::LayerSpan;
using mcb_seqstate::SeqState;

struct mcb_stage1 {
    llama_context *ctx = nullptr;
    uint32_t n_stream = 0;
    KVFormat format;       // what every blob of this context must say
    uint8_t kv_probe[16] = {};

    // Storage behind the pointers of the mcb_model_params handed out.
    std::string arch;
    std::string gguf_path;
    std::vector<uint32_t> n_embd_k, n_embd_v, k_row, v_row;

    std::vector<mcb_model> models; // registered through mcb_stage1_register
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

// The probe's tokens: small ids that every vocabulary has (taken modulo its
// size); fixed, because kv_probe digests the KV they produce.
const llama_token kProbeTokens[MCB_STAGE1_PROBE_TOKENS] = {1, 2, 3, 5, 8, 13, 21, 34};

// FNV-1a, 128 bits: kv_probe only compares the KV of honest nodes, and
// the probe is a few KiB, so a simple standard hash is enough.
struct Fnv128 {
    unsigned __int128 h = (static_cast<unsigned __int128>(0x6c62272e07bb0142ull) << 64) | 0x62b821756295c58dull;
    void add(const void *p, size_t n) {
        const unsigned __int128 prime = (static_cast<unsigned __int128>(1) << 88) | 0x13b;
        for (size_t i = 0; i < n; i++) {
            h ^= static_cast<const uint8_t *>(p)[i];
            h *= prime;
        }
    }
    void out(uint8_t d[16]) const {
        for (int i = 0; i < 16; i++) d[i] = static_cast<uint8_t>(h >> (8 * i));
    }
};

bool valid_seq(llama_context *ctx, llama_seq_id seq) {
    // llama.cpp asserts (aborts) on sequence ids past n_seq_max.
    return seq >= 0 && static_cast<uint32_t>(seq) < llama_n_seq_max(ctx);
}

bool seq_empty(llama_context *ctx, llama_seq_id seq) {
    return llama_memory_seq_pos_max(llama_get_memory(ctx), seq) < 0;
}

// Reads seq's state blob (flags 0: every byte on the host) and parses it.
mcb_status read_state(llama_context *ctx, llama_seq_id seq, std::vector<uint8_t> *blob, SeqState *st) {
    const size_t size = llama_state_seq_get_size_ext(ctx, seq, 0);
    if (size == 0) return fail(MCB_STATUS_INTERNAL, "llama_state_seq_get_size_ext(seq %d) failed", seq);
    blob->assign(size, 0);
    const size_t got = llama_state_seq_get_data_ext(ctx, blob->data(), size, seq, 0);
    if (got != size) return fail(MCB_STATUS_INTERNAL, "llama_state_seq_get_data_ext wrote %zu of %zu bytes", got, size);
    std::string err;
    if (!mcb_seqstate::parse_seq_state(blob->data(), size, st, &err))
        return fail(MCB_STATUS_UNSUPPORTED, "sequence %d state: %s", seq, err.c_str());
    if (st->seq_id != seq) return fail(MCB_STATUS_INTERNAL, "state of sequence %d says sequence %d", seq, st->seq_id);
    return MCB_STATUS_OK;
}

// Elements of a row of `bytes` bytes of a ggml type, 0 when the bytes are
// not whole rows of that type.
uint32_t row_elements(int32_t type, uint64_t bytes) {
    if (type < 0 || type >= GGML_TYPE_COUNT) return 0;
    const auto t = static_cast<ggml_type>(type);
    const uint64_t ts = ggml_type_size(t), bs = static_cast<uint64_t>(ggml_blck_size(t));
    if (ts == 0 || bs == 0 || bytes % ts != 0 || bytes / ts * bs > UINT32_MAX) return 0;
    const uint64_t n = bytes / ts * bs;
    return ggml_row_size(t, static_cast<int64_t>(n)) == bytes ? static_cast<uint32_t>(n) : 0;
}

// Checks the probe's format against ggml's type table and fills the
// per-layer geometry that struct mcb_model_params wants.
mcb_status learn_format(mcb_stage1 *s) {
    const KVFormat &f = s->format;
    const size_t n = f.layers.size();
    s->n_embd_k.resize(n);
    s->n_embd_v.resize(n);
    s->k_row.resize(n);
    s->v_row.resize(n);
    for (size_t l = 0; l < n; l++) {
        const LayerFormat &lf = f.layers[l];
        if (lf.k_type != f.layers[0].k_type || lf.v_type != f.layers[0].v_type)
            return fail(MCB_STATUS_UNSUPPORTED, "layer %zu: K/V types differ from layer 0's", l);
        if (lf.k_row > UINT32_MAX || lf.v_row > UINT32_MAX)
            return fail(MCB_STATUS_UNSUPPORTED, "layer %zu: rows over 4 GiB", l);
        s->k_row[l] = static_cast<uint32_t>(lf.k_row);
        s->v_row[l] = static_cast<uint32_t>(lf.v_row);
        s->n_embd_k[l] = row_elements(lf.k_type, lf.k_row);
        if (s->n_embd_k[l] == 0) return fail(MCB_STATUS_UNSUPPORTED, "layer %zu: K row of %llu bytes is not whole rows of type %d", l, (unsigned long long)lf.k_row, lf.k_type);
        if (f.v_trans) {
            // Transposed V is one element per cell and column: never a
            // quantized block type.
            if (lf.v_type < 0 || lf.v_type >= GGML_TYPE_COUNT || ggml_blck_size(static_cast<ggml_type>(lf.v_type)) != 1 ||
                ggml_type_size(static_cast<ggml_type>(lf.v_type)) != lf.v_el)
                return fail(MCB_STATUS_UNSUPPORTED, "layer %zu: transposed V of type %d in %u-byte elements", l, lf.v_type, lf.v_el);
            s->n_embd_v[l] = lf.n_embd_v;
        } else {
            s->n_embd_v[l] = row_elements(lf.v_type, lf.v_row);
            if (s->n_embd_v[l] == 0) return fail(MCB_STATUS_UNSUPPORTED, "layer %zu: V row of %llu bytes is not whole rows of type %d", l, (unsigned long long)lf.v_row, lf.v_type);
        }
    }
    return MCB_STATUS_OK;
}

mcb_status probe(mcb_stage1 *s, llama_seq_id seq) {
    llama_context *ctx = s->ctx;
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
    if (n_vocab <= 0) return fail(MCB_STATUS_UNSUPPORTED, "model without a vocabulary");
    llama_batch batch = llama_batch_init(MCB_STAGE1_PROBE_TOKENS, 0, 1);
    for (int i = 0; i < MCB_STAGE1_PROBE_TOKENS; i++) {
        batch.token[i] = kProbeTokens[i] % n_vocab;
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = seq;
        batch.logits[i] = i == MCB_STAGE1_PROBE_TOKENS - 1;
    }
    batch.n_tokens = MCB_STAGE1_PROBE_TOKENS;
    const int32_t rc = llama_decode(ctx, batch);
    llama_batch_free(batch);
    if (rc != 0) return fail(MCB_STATUS_INTERNAL, "probe decode failed (llama_decode %d)", rc);

    std::vector<uint8_t> blob;
    SeqState st;
    mcb_status r = read_state(ctx, seq, &blob, &st);
    if (r != MCB_STATUS_OK) return r;
    std::vector<uint32_t> cells;
    std::string err;
    if (st.n_cells() != MCB_STAGE1_PROBE_TOKENS || !mcb_seqstate::position_cells(st, &cells, &err))
        return fail(MCB_STATUS_UNSUPPORTED, "probe state: %u cells, not positions 0..%d %s", st.n_cells(),
                    MCB_STAGE1_PROBE_TOKENS - 1, err.c_str());
    s->n_stream = st.n_stream;
    s->format = st.format;

    // The probe's cells are in the order find_slot gave them; hash the KV in
    // position order so that where the context put them does not matter.
    Fnv128 h;
    const char domain[] = "mcbridge stage1 kv probe v1 " MCB_STAGE1_LLAMA_VERSION;
    h.add(domain, sizeof domain);
    h.add(kProbeTokens, sizeof kProbeTokens);
    const uint32_t v_trans = st.format.v_trans;
    h.add(&v_trans, sizeof v_trans);
    for (size_t l = 0; l < st.format.layers.size(); l++) {
        const LayerFormat &f = st.format.layers[l];
        h.add(&f.k_type, sizeof f.k_type);
        h.add(&f.v_type, sizeof f.v_type);
        for (uint32_t c : cells) h.add(blob.data() + st.spans[l].k + c * f.k_row, f.k_row);
        if (!st.format.v_trans) {
            for (uint32_t c : cells) h.add(blob.data() + st.spans[l].v + c * f.v_row, f.v_row);
            continue;
        }
        for (uint32_t c : cells)
            for (uint32_t j = 0; j < f.n_embd_v; j++)
                h.add(blob.data() + st.spans[l].v + (uint64_t(j) * st.n_cells() + c) * f.v_el, f.v_el);
    }
    h.out(s->kv_probe);
    return learn_format(s);
}

std::string meta(const llama_model *model, const std::string &key) {
    char buf[256];
    return llama_model_meta_val_str(model, key.c_str(), buf, sizeof buf) >= 0 ? std::string(buf) : std::string();
}

// The Hadamard rotation rule of llama_kv_cache's constructor
// (llama-kv-cache.cpp, v0.5.0 l.312-342): quantized K/V whose head size is
// a multiple of 64, unless LLAMA_ATTN_ROT_DISABLE is set. Rotated bytes
// also change the probe digest, which is what really keeps them apart.
bool attn_rot(int32_t type, int64_t head_dim) {
    const char *off = std::getenv("LLAMA_ATTN_ROT_DISABLE");
    if (off && std::atoi(off)) return false;
    return type >= 0 && type < GGML_TYPE_COUNT && ggml_is_quantized(static_cast<ggml_type>(type)) && head_dim > 0 &&
           head_dim % 64 == 0;
}

// Handles are never reused by the bridge, so a stale one cannot alias.
bool bound(const mcb_stage1 *s, mcb_model m) {
    for (mcb_model x : s->models)
        if (x == m) return true;
    return false;
}

// A restore's blob: one stream of n cells at positions 0..n-1.
struct Assembly {
    std::vector<uint8_t> blob;
    std::vector<LayerSpan> spans;
    uint32_t n = 0;
};

mcb_status assemble(const mcb_stage1 *s, llama_seq_id seq, uint32_t n, Assembly *a) {
    // Which stream the section is written as does not matter to llama.cpp
    // (it restores into the destination's stream); write the one seq maps to.
    const uint32_t stream = s->n_stream == 1 ? 0 : static_cast<uint32_t>(seq);
    std::string err;
    if (!mcb_seqstate::build_seq_state(seq, s->n_stream, stream, s->format, n, &a->blob, &a->spans, &err))
        return fail(MCB_STATUS_INVALID_ARG, "restore blob: %s", err.c_str());
    a->n = n;
    return MCB_STATUS_OK;
}

// The bridge's view of a blob's rows: cell c of layer l at spans[l].
void blob_layout(const mcb_stage1 *s, uint8_t *blob, const std::vector<LayerSpan> &spans, uint32_t n_cells,
                 std::vector<mcb_kv_layer> *layers, mcb_kv_layout *lo) {
    const KVFormat &f = s->format;
    layers->resize(f.layers.size());
    for (size_t l = 0; l < f.layers.size(); l++) {
        mcb_kv_layer &ly = (*layers)[l];
        ly.k = blob + spans[l].k;
        ly.v = blob + spans[l].v;
        ly.k_stride = f.layers[l].k_row;
        ly.v_stride = f.v_trans ? uint64_t(n_cells) * f.layers[l].v_el : f.layers[l].v_row;
    }
    lo->n_layer = static_cast<uint32_t>(f.layers.size());
    lo->n_cells = n_cells;
    lo->v_trans = f.v_trans;
    lo->location = "cpu:0";
    lo->layers = layers->data();
}

} // namespace

extern "C" {

mcb_status mcb_stage1_open(llama_context *ctx, llama_seq_id probe_seq, mcb_stage1 **out) {
    if (ctx == nullptr || out == nullptr) return fail(MCB_STATUS_INVALID_ARG, "NULL context or output");
    const llama_model *model = llama_get_model(ctx);
    const llama_rope_type rope = llama_model_rope_type(model);
    if (llama_get_memory(ctx) == nullptr) return fail(MCB_STATUS_UNSUPPORTED, "context without a KV cache");
    if (llama_model_is_recurrent(model) || llama_model_is_hybrid(model))
        return fail(MCB_STATUS_UNSUPPORTED, "recurrent and hybrid models keep state other than a KV cache");
    if (llama_model_n_swa(model) > 0)
        return fail(MCB_STATUS_UNSUPPORTED, "sliding-window models write two caches per sequence");
    if (llama_model_has_encoder(model)) return fail(MCB_STATUS_UNSUPPORTED, "encoder-decoder models");
    if (rope == LLAMA_ROPE_TYPE_MROPE || rope == LLAMA_ROPE_TYPE_IMROPE || rope == LLAMA_ROPE_TYPE_VISION)
        return fail(MCB_STATUS_UNSUPPORTED, "M-RoPE cells carry 2-D positions");
    if (!valid_seq(ctx, probe_seq))
        return fail(MCB_STATUS_INVALID_ARG, "probe sequence %d outside [0, %u)", probe_seq, llama_n_seq_max(ctx));
    if (!seq_empty(ctx, probe_seq)) return fail(MCB_STATUS_STATE, "probe sequence %d is not empty", probe_seq);

    mcb_stage1 *s = new (std::nothrow) mcb_stage1;
    if (s == nullptr) return fail(MCB_STATUS_INTERNAL, "out of memory");
    s->ctx = ctx;
    const mcb_status r = probe(s, probe_seq);
    llama_memory_seq_rm(llama_get_memory(ctx), probe_seq, -1, -1);
    if (r != MCB_STATUS_OK) {
        delete s;
        return r;
    }
    s->arch = meta(model, "general.architecture");
    *out = s;
    return ok();
}

void mcb_stage1_close(mcb_stage1 *s) { delete s; }

mcb_status mcb_stage1_model_params(mcb_stage1 *s, const char *gguf_path, uint32_t block_tokens, mcb_model_params *out) {
    if (s == nullptr || out == nullptr) return fail(MCB_STATUS_INVALID_ARG, "NULL handle or output");
    const llama_model *model = llama_get_model(s->ctx);
    s->gguf_path = gguf_path ? gguf_path : "";
    mcb_model_params p;
    std::memset(&p, 0, sizeof p);
    p.llama_version = MCB_STAGE1_LLAMA_VERSION;
    p.arch = s->arch.c_str();
    p.gguf_path = gguf_path ? s->gguf_path.c_str() : nullptr;
    std::memcpy(p.kv_probe, s->kv_probe, sizeof p.kv_probe);
    p.n_layer = static_cast<uint32_t>(s->format.layers.size());
    p.block_tokens = block_tokens;
    p.n_embd_k_gqa = s->n_embd_k.data();
    p.n_embd_v_gqa = s->n_embd_v.data();
    p.k_row_bytes = s->k_row.data();
    p.v_row_bytes = s->v_row.data();
    p.type_k = s->format.layers[0].k_type;
    p.type_v = s->format.layers[0].v_type;
    p.v_trans = s->format.v_trans;

    // The model's own rope settings; a context's overrides
    // (llama_context_params.rope_freq_*, yarn_*) are not readable back, and
    // reach the key through kv_probe, since roped K differs.
    p.rope_type = llama_model_rope_type(model);
    p.rope_freq_base = std::strtof(meta(model, s->arch + ".rope.freq_base").c_str(), nullptr);
    p.rope_freq_scale = llama_model_rope_freq_scale_train(model);
    const std::string orig = meta(model, s->arch + ".rope.scaling.original_context_length");
    p.n_ctx_orig = orig.empty() ? static_cast<uint32_t>(llama_model_n_ctx_train(model))
                                : static_cast<uint32_t>(std::strtoul(orig.c_str(), nullptr, 10));

    const int64_t n_head = llama_model_n_head(model);
    const int64_t head = n_head > 0 ? llama_model_n_embd(model) / n_head : 0;
    const std::string kl = meta(model, s->arch + ".attention.key_length");
    const std::string vl = meta(model, s->arch + ".attention.value_length");
    p.attn_rot_k = attn_rot(p.type_k, kl.empty() ? head : std::strtoll(kl.c_str(), nullptr, 10));
    p.attn_rot_v = attn_rot(p.type_v, vl.empty() ? head : std::strtoll(vl.c_str(), nullptr, 10));
    *out = p;
    return ok();
}

mcb_status mcb_stage1_register(mcb_stage1 *s, mcb_bridge bridge, const mcb_model_params *p, mcb_model *out) {
    if (s == nullptr || p == nullptr || out == nullptr) return fail(MCB_STATUS_INVALID_ARG, "NULL handle, params or output");
    const size_t n = s->format.layers.size();
    const auto same = [n](const uint32_t *a, const std::vector<uint32_t> &b) {
        return a != nullptr && std::memcmp(a, b.data(), n * sizeof(uint32_t)) == 0;
    };
    if (p->llama_version == nullptr || std::strcmp(p->llama_version, MCB_STAGE1_LLAMA_VERSION) != 0 || p->n_layer != n ||
        !same(p->n_embd_k_gqa, s->n_embd_k) || !same(p->n_embd_v_gqa, s->n_embd_v) || !same(p->k_row_bytes, s->k_row) ||
        !same(p->v_row_bytes, s->v_row) || p->type_k != s->format.layers[0].k_type ||
        p->type_v != s->format.layers[0].v_type || p->v_trans != s->format.v_trans ||
        std::memcmp(p->kv_probe, s->kv_probe, sizeof p->kv_probe) != 0)
        return fail(MCB_STATUS_MODEL_MISMATCH, "model parameters describe another context's KV");
    mcb_model m = 0;
    const mcb_status r = mcb_model_register(bridge, p, &m);
    if (r != MCB_STATUS_OK) return fail(r, "mcb_model_register: %s", mcb_last_error());
    s->models.push_back(m);
    *out = m;
    return ok();
}

mcb_status mcb_stage1_save(mcb_stage1 *s, llama_seq_id seq, mcb_model model, const mcb_scope *scope,
                           const llama_token *tokens, size_t n_tokens, mcb_save_result *out) {
    if (s == nullptr || tokens == nullptr || n_tokens == 0) return fail(MCB_STATUS_INVALID_ARG, "NULL handle or no tokens");
    if (!valid_seq(s->ctx, seq)) return fail(MCB_STATUS_INVALID_ARG, "sequence %d outside [0, %u)", seq, llama_n_seq_max(s->ctx));
    if (!bound(s, model)) return fail(MCB_STATUS_MODEL_MISMATCH, "model %llu was not registered for this context", (unsigned long long)model);
    std::vector<uint8_t> blob;
    SeqState st;
    mcb_status r = read_state(s->ctx, seq, &blob, &st);
    if (r != MCB_STATUS_OK) return r;
    if (st.n_cells() < n_tokens)
        return fail(MCB_STATUS_INVALID_ARG, "sequence %d holds %u positions, %zu tokens given", seq, st.n_cells(), n_tokens);
    if (st.n_stream != s->n_stream || st.format != s->format)
        return fail(MCB_STATUS_MODEL_MISMATCH, "sequence %d state differs from the probe's format", seq);
    std::vector<uint32_t> cells;
    std::string err;
    if (!mcb_seqstate::position_cells(st, &cells, &err))
        return fail(MCB_STATUS_UNSUPPORTED, "sequence %d is not positions 0..n-1: %s", seq, err.c_str());
    cells.resize(n_tokens);

    std::vector<mcb_kv_layer> layers;
    mcb_kv_layout lo;
    blob_layout(s, blob.data(), st.spans, st.n_cells(), &layers, &lo);
    mcb_save h = 0;
    r = mcb_save_begin(model, scope, &lo, tokens, n_tokens, cells.data(), &h);
    if (r != MCB_STATUS_OK) return fail(r, "mcb_save_begin: %s", mcb_last_error());
    std::string layer_err;
    for (uint32_t l = 0; l < lo.n_layer && r == MCB_STATUS_OK; l++) {
        r = mcb_save_layer(h, l);
        if (r != MCB_STATUS_OK) layer_err = mcb_last_error();
    }
    // End in every case: it releases the handle and the borrowed blob.
    mcb_save_result res;
    std::memset(&res, 0, sizeof res);
    const mcb_status end = mcb_save_end(h, &res);
    if (r != MCB_STATUS_OK) return fail(r, "mcb_save_layer: %s", layer_err.c_str());
    if (end != MCB_STATUS_OK) return fail(end, "mcb_save_end: %s", mcb_last_error());
    if (out) *out = res;
    return ok();
}

mcb_status mcb_stage1_restore(mcb_stage1 *s, llama_seq_id seq, mcb_model model, const mcb_scope *scope,
                              const llama_token *tokens, size_t n_tokens, size_t *n_restored) {
    if (n_restored) *n_restored = 0;
    if (s == nullptr || tokens == nullptr || n_tokens == 0 || n_restored == nullptr)
        return fail(MCB_STATUS_INVALID_ARG, "NULL handle, tokens or output");
    if (!valid_seq(s->ctx, seq)) return fail(MCB_STATUS_INVALID_ARG, "sequence %d outside [0, %u)", seq, llama_n_seq_max(s->ctx));
    if (!bound(s, model)) return fail(MCB_STATUS_MODEL_MISMATCH, "model %llu was not registered for this context", (unsigned long long)model);
    if (!seq_empty(s->ctx, seq)) return fail(MCB_STATUS_STATE, "sequence %d is not empty", seq);

    mcb_lookup_result lk;
    mcb_status r = mcb_lookup(model, scope, tokens, n_tokens, &lk);
    if (r != MCB_STATUS_OK) return fail(r, "mcb_lookup: %s", mcb_last_error());
    // State carries no logits: the last token is always computed.
    const size_t block = lk.n_block_tokens ? lk.n_block_tokens : 1;
    size_t want = (n_tokens - 1) / block * block;
    if (lk.n_restore_tokens < want) want = lk.n_restore_tokens;
    if (want == 0 || want > UINT32_MAX) return ok();

    Assembly a;
    if ((r = assemble(s, seq, static_cast<uint32_t>(want), &a)) != MCB_STATUS_OK) return r;
    std::vector<mcb_kv_layer> layers;
    mcb_kv_layout lo;
    blob_layout(s, a.blob.data(), a.spans, a.n, &layers, &lo);
    mcb_load h = 0;
    r = mcb_load_begin(model, scope, &lo, tokens, want, nullptr, &h);
    if (r == MCB_STATUS_NOT_FOUND) return ok(); // evicted since the lookup
    if (r != MCB_STATUS_OK) return fail(r, "mcb_load_begin: %s", mcb_last_error());
    std::string load_err;
    for (uint32_t l = 0; l < lo.n_layer; l++) {
        uint32_t so_far = 0;
        if ((r = mcb_load_wait_layer(h, l, &so_far)) != MCB_STATUS_OK) {
            load_err = mcb_last_error();
            break;
        }
    }
    mcb_load_result lr;
    std::memset(&lr, 0, sizeof lr);
    const mcb_status end = mcb_load_end(h, &lr);
    if (load_err.empty() && end != MCB_STATUS_OK) load_err = mcb_last_error();
    // The result, not the waits, says what is verified.
    uint32_t good = lr.n_tokens_ok < a.n ? lr.n_tokens_ok : a.n;
    if (r == MCB_STATUS_OK && end != MCB_STATUS_OK) r = end;
    if (good == 0)
        return fail(r != MCB_STATUS_OK ? r : MCB_STATUS_INTERNAL, "load gave no verified block: %s", load_err.c_str());

    if (good < a.n) {
        // Keep the verified leading blocks: a blob of `good` cells.
        Assembly b;
        mcb_status rb = assemble(s, seq, good, &b);
        if (rb != MCB_STATUS_OK) return rb;
        mcb_seqstate::copy_prefix(s->format, a.blob.data(), a.spans, a.n, b.blob.data(), b.spans, b.n, good);
        a = std::move(b);
    }
    const size_t read = llama_state_seq_set_data_ext(s->ctx, a.blob.data(), a.blob.size(), seq, 0);
    llama_memory_t mem = llama_get_memory(s->ctx);
    if (read != a.blob.size() || llama_memory_seq_pos_min(mem, seq) != 0 ||
        llama_memory_seq_pos_max(mem, seq) != static_cast<llama_pos>(good) - 1) {
        // llama.cpp rolls a refused restore back itself; make sure.
        llama_memory_seq_rm(mem, seq, -1, -1);
        return fail(MCB_STATUS_LAYOUT, "llama_state_seq_set_data_ext took %zu of %zu bytes (no free cells, or another format)",
                    read, a.blob.size());
    }
    *n_restored = good;
    if (good < want) {
        fail(r, "kept %u of %zu tokens: %s", good, want, load_err.c_str());
        return MCB_STATUS_OK;
    }
    return ok();
}

const char *mcb_stage1_last_error(void) { return last_error.c_str(); }

} // extern "C"
