// The process's bridge, the registration of each context's KV format, and the clean
// marks. See llama-mcbridge.h.
#include "llama-mcbridge.h"
#include "llama-mcbridge-impl.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-io.h"
#include "llama-kv-cache-dsa-iswa.h"
#include "llama-kv-cache-dsa.h"
#include "llama-kv-cache-dsv4.h"
#include "llama-kv-cache-iswa.h"
#include "llama-kv-cache-msa.h"
#include "llama-kv-cache.h"
#include "llama-memory-hybrid-idx.h"
#include "llama-memory-hybrid-iswa.h"
#include "llama-memory-hybrid.h"
#include "llama-memory-recurrent.h"
#include "llama-model.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <vector>

#include <sys/stat.h>

#ifndef MCB_LLAMA_TAG
#error "MCB_LLAMA_TAG (the pinned llama.cpp tag) is set by mcbridge.cmake"
#endif

namespace mcb_llama {

namespace {

constexpr llama_pos k_all_clean = std::numeric_limits<llama_pos>::max();

// Clean marks of one cache. A sequence without an entry has the default mark: after
// clear() every sequence is empty and so clean; after a whole-cache state load nothing
// is known about any of them. The scope a sequence was computed under is recorded by
// the server for each request (seq_set_scope); cells whose computation the bridge did
// not see have no known scope.
struct kv_marks {
    llama_pos                        dflt = k_all_clean;
    std::map<llama_seq_id, llama_pos> seq;
    std::map<llama_seq_id, std::array<uint8_t, 16>> scope; // absent: unknown

    llama_pos get(llama_seq_id s) const {
        auto it = seq.find(s);
        return it == seq.end() ? dflt : it->second;
    }
    void lower(llama_seq_id s, llama_pos p) { seq[s] = std::min(get(s), std::max<llama_pos>(p, 0)); }
};

using scope_id = std::array<uint8_t, 16>;

// The scopes the latest state writes were made under, by key (a blob's digest, a
// file's identity); the oldest are forgotten first, and what is forgotten loads as
// of no known scope.
template <typename K>
struct recent_scopes {
    static constexpr size_t k_max = 4096;
    std::map<K, scope_id> by_key;
    std::deque<K>         order;

    void put(const K & k, const scope_id & scope) {
        if (by_key.insert_or_assign(k, scope).second) {
            order.push_back(k);
        }
        while (order.size() > k_max) {
            by_key.erase(order.front());
            order.pop_front();
        }
    }
    const scope_id * get(const K & k) const {
        auto it = by_key.find(k);
        return it == by_key.end() ? nullptr : &it->second;
    }
};

// 128 bits of a state blob: four xxHash64-style lanes over 32-byte strides, fast
// enough for every blob the prompt cache keeps. The blobs are KV llama.cpp computed,
// not chosen by anyone, so a non-cryptographic digest names them.
using blob_digest = std::array<uint64_t, 2>;

// A file as the kernel names it; a file rewritten in place gets another mtime.
using file_identity = std::array<int64_t, 4>; // device, inode, size, mtime (ns)

struct process_state {
    std::recursive_mutex mu; // recursive: the KV probe edits a cache while attach holds it
    std::string config; // --mcb-config
    std::string tenant; // --mcb-tenant
    bool        opened = false; // the bridge was tried (it is opened at most once)
    std::string open_error;     // why it did not open
    mcb_bridge  bridge = 0;
    std::unordered_map<const llama_context *, attachment>  contexts;
    // Keyed by the memory whose edits they follow (marked_memory): caches and recurrent
    // memories of attached contexts only.
    std::unordered_map<const void *, kv_marks>  marks;
    recent_scopes<blob_digest>   saved_blobs; // state blobs written by attached contexts
    recent_scopes<file_identity> saved_files; // sequence state files written by them

    ~process_state() {
        // Closing unpublishes this process's blocks at once instead of leaving peers to
        // find them gone when their holder's lease runs out. The bridge refuses while a
        // load or save is open, and then the lease does it.
        if (bridge != 0) {
            mcb_bridge_close(bridge);
        }
    }
};

process_state & state() {
    static process_state s;
    return s;
}

// Marks are kept only while some context is attached; the kv hooks test this first
// so that a server with the bridge off pays one atomic load per cache edit.
std::atomic<bool> g_tracking{false};

// The format of the layers of a storage, read off its tensors (each [n_embd, kv_size,
// n_stream], rows of nb[1] bytes), so that a companion cache's layers, whose widths
// its own hyperparameters give, are described as the attention cache's are. Every
// layer must have the types of the first.
struct kv_format_rows {
    std::vector<uint32_t> ek, ev, kr, vr;
    ggml_type tk, tv;

    explicit kv_format_rows(const kv_storage & st) {
        tk = st.k.at(0)->type;
        // An MLA cache's format has V rows of 0 bytes and type_v the K type: no V type
        // is written anywhere (include/mcbridge.h). The attention cache's layers come
        // first, so layer 0 has V wherever any layer does.
        tv = st.v.at(0) != nullptr ? st.v[0]->type : tk;
        for (size_t l = 0; l < st.k.size(); l++) {
            const ggml_tensor * k = st.k[l];
            const ggml_tensor * v = st.v[l];
            if (k->type != tk || (v != nullptr && v->type != tv)) {
                throw std::runtime_error("KV layer " + std::to_string(l) + " is of other types than layer 0");
            }
            ek.push_back((uint32_t) k->ne[0]);
            kr.push_back((uint32_t) ggml_row_size(tk, k->ne[0]));
            ev.push_back(v != nullptr ? (uint32_t) v->ne[0] : 0);
            vr.push_back(v != nullptr ? (uint32_t) ggml_row_size(tv, v->ne[0]) : 0);
        }
    }

    // Points into this.
    mcb_kv_format format(bool v_trans) const {
        mcb_kv_format f = {};
        f.n_layer      = (uint32_t) ek.size();
        f.n_embd_k_gqa = ek.data();
        f.n_embd_v_gqa = ev.data();
        f.k_row_bytes  = kr.data();
        f.v_row_bytes  = vr.data();
        f.type_k       = (int32_t) tk;
        f.type_v       = (int32_t) tv;
        f.v_trans      = v_trans;
        return f;
    }
};

// Decodes the probe prompt into sequence 0 of the empty memory; the caller empties it
// again whatever it returns.
mcb_status decode_probe(llama_context * ctx, std::vector<llama_token> & toks, std::string & why) {
    if (llama_memory_seq_pos_max(llama_get_memory(ctx), 0) >= 0) {
        why = "sequence 0 is not empty";
        return MCB_STATUS_STATE;
    }
    toks.resize(mcb_probe_tokens(nullptr, 0));
    mcb_probe_tokens(toks.data(), toks.size());
    const llama_vocab * vocab = llama_model_get_vocab(llama_get_model(ctx));
    for (llama_token t : toks) {
        if (t >= llama_vocab_n_tokens(vocab)) {
            why = "the vocabulary has fewer tokens than the probe needs";
            return MCB_STATUS_UNSUPPORTED;
        }
    }
    // The probe is the base model's KV: LoRA adapters are per request, and a request's
    // scope names them. llama-server sets each batch's adapters itself.
    llama_set_adapters_lora(ctx, nullptr, 0, nullptr);
    llama_batch batch = llama_batch_get_one(toks.data(), (int32_t) toks.size());
    const int32_t rc = llama_decode(ctx, batch);
    llama_synchronize(ctx);
    if (rc != 0) {
        why = "llama_decode returned " + std::to_string(rc);
        return MCB_STATUS_INTERNAL;
    }
    return MCB_STATUS_OK;
}

// Decodes the probe prompt and registers the model with the KV it produced, learning
// where the cache's tensors are; the sequence is emptied again either way.
mcb_status register_with_probe(llama_context * ctx, llama_kv_cache * kv, const mcb_model_params & params,
                               bool v_trans, bool k_only, mcb_model & out, kv_storage & storage,
                               std::shared_ptr<kv_stage> & stage, std::string & why) {
    std::vector<llama_token> toks;
    mcb_status st = decode_probe(ctx, toks, why);
    if (st == MCB_STATUS_OK) {
        st = MCB_STATUS_INTERNAL;
        try {
            const std::vector<uint32_t> cells = seq_cells(kv, 0, (int32_t) toks.size());
            if (cells.size() != toks.size()) {
                throw std::runtime_error("the probe's positions are not all in the cache");
            }
            storage = capture_storage(kv, 0);
            if ((storage.v.at(0) == nullptr) != k_only) {
                throw std::runtime_error(k_only ? "the MLA cache has V tensors" : "the attention cache has no V tensors");
            }
            if (llama_kv_cache * kv2 = companion_kv(ctx)) {
                // Its cells are the attention cache's: the memory edits both alike, and
                // find_slot, given the same edits, picks the same cells in both.
                if (seq_cells(kv2, 0, (int32_t) toks.size()) != cells) {
                    throw std::runtime_error("the indexer cache holds the probe in other cells than the attention cache");
                }
                // Of its own kind: without V where the attention cache has it (a hybrid
                // model's indexer), and the format's V rows 0 bytes there.
                const kv_storage more = capture_storage(kv2, 0);
                storage.k.insert(storage.k.end(), more.k.begin(), more.k.end());
                storage.v.insert(storage.v.end(), more.v.begin(), more.v.end());
            }
            const kv_format_rows rows(storage);
            const mcb_kv_format format = rows.format(v_trans);
            stage   = kv_stage::make(ctx, kv, storage, v_trans);
            const std::vector<mcb_kv_layer> layers = stream_layers(storage, kv->get_size(), v_trans, 0);
            mcb_kv_layout layout = layout_of(kv, v_trans, layers);
            std::vector<uint32_t> at = cells;
            stage_buf * probe_rows = nullptr;
            if (stage) {
                // The probe's rows, downloaded into staging rows 0..7.
                probe_rows = stage->acquire((uint32_t) cells.size());
                layout     = stage->layout(*probe_rows);
                for (uint32_t l = 0; l < layout.n_layer; l++) {
                    stage->download(*probe_rows, l, 0, cells);
                }
                stage->sync();
                for (uint32_t i = 0; i < at.size(); i++) {
                    at[i] = i;
                }
            }
            st = mcb_model_register(state().bridge, &params, &format, &layout, at.data(), &out);
            if (probe_rows != nullptr) {
                stage->release(probe_rows);
            }
            if (st != MCB_STATUS_OK) {
                why = "mcb_model_register: " + status_message(st);
            }
        } catch (const std::exception & e) {
            why = e.what();
        }
    }
    // The partial state too (a window cache, a recurrent state).
    llama_memory_seq_rm(llama_get_memory(ctx), 0, -1, -1);
    return st;
}

// Decodes the probe prompt and registers a model without KV layers with the state of
// flags it produced (the partial state, or the whole state); the sequence is emptied
// again either way.
mcb_status register_partial_only(llama_context * ctx, const mcb_model_params & params, llama_state_seq_flags flags,
                                 mcb_model & out, std::string & why) {
    std::vector<llama_token> toks;
    mcb_status st = decode_probe(ctx, toks, why);
    if (st == MCB_STATUS_OK) {
        const std::vector<uint8_t> buf = seq_state(ctx, 0, flags);
        if (buf.empty()) {
            why = "llama.cpp wrote no state of the probe";
            st  = MCB_STATUS_INTERNAL;
        } else if ((st = mcb_model_register_state(state().bridge, &params, buf.data(), buf.size(), &out)) != MCB_STATUS_OK) {
            why = "mcb_model_register_state: " + status_message(st);
        }
    }
    llama_memory_seq_rm(llama_get_memory(ctx), 0, -1, -1);
    return st;
}

// The configuration the bridge opens with: --mcb-config, else MCB_CONFIG.
std::string config_doc(const process_state & s) {
    if (!s.config.empty()) {
        return s.config;
    }
    const char * env = getenv("MCB_CONFIG");
    return env != nullptr ? env : "";
}


// Opens the process's bridge on first use; true when it is open.
bool ensure_bridge(process_state & s, std::string & why) {
    if (s.opened) {
        if (s.bridge == 0) {
            why = s.open_error;
        }
        return s.bridge != 0;
    }
    const std::string cfg = config_doc(s);
    if (cfg.empty()) {
        why = "not configured (--mcb-config or MCB_CONFIG)"; // "" would open the defaults
        return false;
    }
    s.opened = true;
    if (mcb_abi_version() != MCB_ABI_VERSION) {
        why = s.open_error = "libmcbridge ABI " + std::to_string(mcb_abi_version()) + ", built against " +
                             std::to_string(MCB_ABI_VERSION);
        return false;
    }
    const mcb_status st = mcb_bridge_open(cfg.c_str(), &s.bridge);
    if (st != MCB_STATUS_OK) {
        s.bridge = 0;
        why = s.open_error = "mcb_bridge_open: " + status_message(st);
        return false;
    }
    return true;
}

} // namespace

void set_config(const std::string & json_or_path) {
    std::lock_guard<std::recursive_mutex> lk(state().mu);
    state().config = json_or_path;
}

void set_tenant(const std::string & tenant) {
    std::lock_guard<std::recursive_mutex> lk(state().mu);
    state().tenant = tenant;
}

const std::string & default_tenant() {
    return state().tenant;
}

bool configured() {
    std::lock_guard<std::recursive_mutex> lk(state().mu);
    return !config_doc(state()).empty();
}

mcb_bridge bridge() {
    std::lock_guard<std::recursive_mutex> lk(state().mu);
    return state().bridge;
}

std::string status_message(mcb_status st) {
    std::string msg = mcb_status_str(st);
    const char * detail = mcb_last_error();
    if (detail != nullptr && detail[0] != '\0') {
        msg += ": ";
        msg += detail;
    }
    return msg;
}

llama_kv_cache * attn_kv(llama_context * ctx) {
    llama_memory_i * mem = llama_get_memory(ctx);
    if (auto * kv = dynamic_cast<llama_kv_cache *>(mem)) {
        return kv;
    }
    if (auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(mem)) {
        return iswa->get_base();
    }
    if (auto * hybrid_iswa = dynamic_cast<llama_memory_hybrid_iswa *>(mem)) {
        return hybrid_iswa->get_mem_attn()->get_base(); // of no layers where every one has a window (LFM2)
    }
    if (auto * dsa_iswa = dynamic_cast<llama_kv_cache_dsa_iswa *>(mem)) {
        return dsa_iswa->get_dsa()->get_mla();
    }
    if (auto * hybrid = dynamic_cast<llama_memory_hybrid *>(mem)) {
        return hybrid->get_mem_attn(); // and, of llama_memory_hybrid_idx, the indexer's beside it
    }
    if (auto * dsa = dynamic_cast<llama_kv_cache_dsa *>(mem)) {
        return dsa->get_mla();
    }
    if (auto * msa = dynamic_cast<llama_kv_cache_msa *>(mem)) {
        return msa->get_base();
    }
    return nullptr;
}

llama_kv_cache * companion_kv(llama_context * ctx) {
    llama_memory_i * mem = llama_get_memory(ctx);
    if (auto * dsa_iswa = dynamic_cast<llama_kv_cache_dsa_iswa *>(mem)) {
        return dsa_iswa->get_dsa()->get_lid();
    }
    if (auto * dsa = dynamic_cast<llama_kv_cache_dsa *>(mem)) {
        return dsa->get_lid();
    }
    if (auto * msa = dynamic_cast<llama_kv_cache_msa *>(mem)) {
        return msa->get_idx();
    }
    if (auto * hybrid_idx = dynamic_cast<llama_memory_hybrid_idx *>(mem)) {
        return hybrid_idx->get_mem_idx(); // nullptr for a model without an indexer
    }
    return nullptr;
}

namespace {

// Which layers of n a predicate holds for, as a string of 0s and 1s.
template <typename F>
std::string layer_pattern(uint32_t n, F && is) {
    std::string out(n, '0');
    for (uint32_t il = 0; il < n; il++) {
        if (is(il)) {
            out[il] = '1';
        }
    }
    return out;
}

// The window cache of a sliding-window memory (llama_kv_cache_iswa, the DSA one whose
// full-attention part has an indexer cache, the hybrid one beside a recurrent state),
// nullptr for any other memory: what its PARTIAL_ONLY state holds.
const llama_kv_cache * window_kv(llama_context * ctx) {
    llama_memory_i * mem = llama_get_memory(ctx);
    if (auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(mem)) {
        return iswa->get_swa();
    }
    if (auto * dsa_iswa = dynamic_cast<llama_kv_cache_dsa_iswa *>(mem)) {
        return dsa_iswa->get_swa();
    }
    if (auto * hybrid_iswa = dynamic_cast<llama_memory_hybrid_iswa *>(mem)) {
        return hybrid_iswa->get_mem_attn()->get_swa();
    }
    return nullptr;
}

// The recurrent state of ctx's memory, alone (Mamba) or beside attention caches (a
// hybrid memory, llama_memory_hybrid_idx among them); nullptr for none.
const llama_memory_recurrent * recurrent_of(llama_context * ctx) {
    llama_memory_i * mem = llama_get_memory(ctx);
    if (auto * recr = dynamic_cast<llama_memory_recurrent *>(mem)) {
        return recr;
    }
    if (auto * hybrid = dynamic_cast<llama_memory_hybrid *>(mem)) {
        return hybrid->get_mem_recr();
    }
    if (auto * hybrid_iswa = dynamic_cast<llama_memory_hybrid_iswa *>(mem)) {
        return hybrid_iswa->get_mem_recr();
    }
    return nullptr;
}

// DeepSeek V4's memory, nullptr for another: a token cache (iSWA) beside compressed
// caches of every ratio'th position and their rolling states, which no block can carry.
// Snapshots of its whole state restore it.
const llama_kv_cache_dsv4 * dsv4_of(llama_context * ctx) {
    return dynamic_cast<const llama_kv_cache_dsv4 *>(llama_get_memory(ctx));
}

// Whether ctx's memory has no KV layers for blocks to carry: a snapshot is its whole
// state (attach registers it with that state's probe).
bool partial_only(llama_context * ctx) {
    const llama_kv_cache * kv = attn_kv(ctx);
    return kv == nullptr || kv->get_layer_ids().empty();
}

// The memory whose edits the clean marks of ctx's sequences follow: the attention
// cache; of a context without KV layers, the recurrent memory, which its window
// cache's edits go along with, or DeepSeek V4's token cache, which every edit of its
// memory goes through.
const void * marked_memory(llama_context * ctx) {
    if (!partial_only(ctx)) {
        return attn_kv(ctx);
    }
    if (const llama_kv_cache_dsv4 * dsv4 = dsv4_of(ctx)) {
        return dsv4->get_raw()->get_base();
    }
    return recurrent_of(ctx);
}

} // namespace

std::string partial_state_of(llama_context * ctx) {
    const llama_hparams & hp = llama_get_model(ctx)->hparams;
    const llama_memory_recurrent * recr = recurrent_of(ctx);
    std::ostringstream d;
    if (const llama_kv_cache_dsv4 * dsv4 = dsv4_of(ctx)) {
        // Its whole state: the token cache's K type (of its part that has layers; its
        // latent K has no V), its window, and the streams that frame it. The probe's
        // state, whose digest names the model, has every cache's types and widths.
        const llama_kv_cache * raw = dsv4->get_raw()->get_base();
        if (raw->get_layer_ids().empty()) {
            raw = dsv4->get_raw()->get_swa();
        }
        d << "whole state dsv4 window " << hp.n_swa << " K " << ggml_type_name(raw->type_k()) << " streams "
          << raw->get_n_stream();
        return d.str();
    }
    if (const llama_kv_cache * swa = window_kv(ctx)) {
        // The window cache's state: which layers it holds, the window and its kind
        // (chunked attention is one); its rows are in the types the blocks are keyed by.
        d << "iswa window " << hp.n_swa << " type " << (int) hp.swa_type << " layers "
          << layer_pattern(hp.n_layer(), [&](uint32_t il) { return hp.is_swa(il); })
          << " K " << ggml_type_name(swa->type_k());
        // An MLA cache has no V tensor for type_v to read (dots3's window cache).
        if (hp.is_mla()) {
            d << " no V";
        } else {
            d << " V " << ggml_type_name(swa->type_v());
        }
        if (recr == nullptr) {
            return d.str();
        }
        // A recurrent state follows (LFM2). llama.cpp frames the window cache's state by
        // the context's KV streams, which the bridge frames again only for a window
        // state alone (partial_kv_streams): the count names the state instead.
        d << " streams " << swa->get_n_stream() << "; ";
    }
    if (recr != nullptr) {
        // The recurrent state: its layers and the widths and types of its two tensors.
        d << "recurrent layers " << layer_pattern(hp.n_layer(), [&](uint32_t il) { return hp.is_recr(il); })
          << " r " << hp.n_embd_r() << " s " << hp.n_embd_s();
        for (size_t il = 0; il < recr->r_l.size(); il++) {
            if (recr->r_l[il] != nullptr && recr->s_l[il] != nullptr) {
                d << " types " << ggml_type_name(recr->r_l[il]->type) << " " << ggml_type_name(recr->s_l[il]->type);
                break;
            }
        }
        return d.str();
    }
    return "";
}

std::string why_not_plain(llama_context * ctx) {
    const std::string why = why_not_served(ctx);
    if (!why.empty()) {
        return why;
    }
    return partial_state_of(ctx).empty() ? "" : "its memory keeps a partial state (sliding-window or recurrent)";
}

std::string why_not_served(llama_context * ctx) {
    const llama_model & model = *llama_get_model(ctx);
    const llama_hparams & hp = model.hparams;
    const llama_cparams & cp = ctx->get_cparams();

    // What the bridge cannot describe or restore exactly turns it off (docs/design.md §5.5).
    if (cp.ctx_type != LLAMA_CONTEXT_TYPE_DEFAULT) {
        return "not a target context (MTP/draft)";
    }
    // Blocks restore an attention cache; a memory without one restores from a snapshot
    // alone where its state is a recurrent one (Mamba; LFM2 with a window, whose
    // attention layers are all in the window cache), or DeepSeek V4's whole state (§5.9).
    if (attn_kv(ctx) == nullptr && recurrent_of(ctx) == nullptr && dsv4_of(ctx) == nullptr) {
        return "the context's memory is not a KV cache the bridge knows";
    }
    if (window_kv(ctx) == nullptr && hp.swa_type != LLAMA_SWA_TYPE_NONE && dsv4_of(ctx) == nullptr) {
        // A cache outside a sliding-window memory masks by the model's window whenever
        // it has one (every plain cache llama_model::create_memory makes gets
        // hparams.swa_type, and so do both caches of an indexed memory): it reuses the
        // cells of positions left behind and its state leaves them out, so positions
        // [0, P) are not what it holds. None of the pinned release's target contexts
        // has one; an MTP draft's does, and it is refused above.
        return "sliding-window attention in a cache without a window cache";
    }
    if (!cp.causal_attn) {
        return "non-causal attention";
    }
    return "";
}

namespace {

// Starts the clean marks of an attached ctx. Whatever its memory holds now was not
// computed under our watch.
void track(llama_context * ctx, const attachment & a) {
    process_state & s = state();
    kv_marks & km = s.marks[marked_memory(ctx)];
    km = kv_marks{};
    for (uint32_t seq = 0; seq < llama_n_seq_max(ctx); seq++) {
        if (llama_memory_seq_pos_max(llama_get_memory(ctx), (llama_seq_id) seq) >= 0) {
            km.seq[(llama_seq_id) seq] = 0;
        }
    }
    s.contexts[ctx] = a;
    g_tracking.store(true, std::memory_order_release);
}

// attach of a context whose memory has no KV layers: a snapshot of its partial state
// (of its whole state, DeepSeek V4's) is all a restore places, so the model is named by
// the probe's.
bool attach_partial_only(llama_context * ctx, const mcb_model_params & p, attachment & out, std::string & why_off) {
    const llama_state_seq_flags flags = dsv4_of(ctx) != nullptr ? 0 : LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY;
    mcb_model m = 0;
    std::string why_probe;
    if (register_partial_only(ctx, p, flags, m, why_probe) != MCB_STATUS_OK) {
        why_off = "registering the model: " + why_probe;
        return false;
    }
    attachment a;
    a.model = m;
    a.snapshot_tokens = mcb_model_snapshot_tokens(m);
    a.snapshot_flags  = flags;
    std::ostringstream d;
    d << llama_get_model(ctx)->arch_name() << ", no KV layers; " << p.partial_state << ", snapshotted every "
      << a.snapshot_tokens << " tokens, restored from a snapshot alone";
    a.describe = d.str();
    track(ctx, a);
    out = a;
    return true;
}

} // namespace

bool attach(llama_context * ctx, const char * gguf_path, attachment & out, std::string & why_off) {
    const llama_model & model = *llama_get_model(ctx);
    const llama_hparams & hp = model.hparams;
    const llama_cparams & cp = ctx->get_cparams();
    llama_kv_cache * kv = attn_kv(ctx);

    why_off = configured() ? why_not_served(ctx) : "not configured (--mcb-config or MCB_CONFIG)";
    if (!why_off.empty()) {
        return false;
    }

    process_state & s = state();
    std::lock_guard<std::recursive_mutex> lk(s.mu);
    if (!ensure_bridge(s, why_off)) {
        return false;
    }

    const bool v_trans = !cp.flash_attn;
    // An MLA cache allocates no V tensor in any layer (llama_kv_cache: has_v = !is_mla)
    // and its state has no V sections; hp.n_embd_v_gqa is the attention's V width, not
    // the cache's.
    const bool k_only = hp.is_mla();

    const std::string partial = partial_state_of(ctx);
    mcb_model_params p = {};
    p.llama_version = MCB_LLAMA_TAG;
    p.gguf_path     = gguf_path;
    p.partial_state = partial.empty() ? nullptr : partial.c_str();
    const llama_kv_cache * swa = window_kv(ctx);
    if (swa != nullptr && recurrent_of(ctx) == nullptr) {
        // The window cache's state is framed by this context's streams (one a slot
        // with -np N, one when unified): the bridge frames other contexts' snapshots
        // for them.
        p.partial_kv_streams = swa->get_n_stream();
    }

    if (partial_only(ctx)) {
        return attach_partial_only(ctx, p, out, why_off);
    }

    mcb_model m = 0;
    kv_storage storage;
    std::shared_ptr<kv_stage> stage;
    std::string why_probe;
    if (register_with_probe(ctx, kv, p, v_trans, k_only, m, storage, stage, why_probe) != MCB_STATUS_OK) {
        why_off = "registering the model: " + why_probe;
        return false;
    }
    const uint32_t n_layer   = (uint32_t) storage.k.size();
    const uint32_t n_indexer = n_layer - (uint32_t) kv->get_layer_ids().size();

    attachment a;
    a.model   = m;
    a.n_layer = n_layer;
    a.v_trans = v_trans;
    a.k_only  = k_only;
    a.storage = storage;
    a.stage   = stage;
    a.snapshot_tokens = mcb_model_snapshot_tokens(m);
    std::ostringstream d;
    d << model.arch_name() << ", " << n_layer << " KV layers";
    if (n_indexer > 0) {
        d << " (" << n_indexer << " of them an indexer cache's)";
    }
    d << ", K " << ggml_type_name(kv->type_k());
    if (k_only) {
        d << ", no V (MLA)";
    } else {
        d << " V " << ggml_type_name(kv->type_v()) << (v_trans ? " (V transposed)" : "");
    }
    d << ", " << kv->get_n_stream() << " stream(s) of " << kv->get_size() << " cells";
    if (a.snapshot_tokens > 0) {
        d << "; " << partial << ", snapshotted every " << a.snapshot_tokens << " tokens";
    }
    if (stage) {
        const size_t n_tensors =
            storage.k.size() + (size_t) std::count_if(storage.v.begin(), storage.v.end(), [](const ggml_tensor * v) { return v != nullptr; });
        d << ", KV on " << stage->where << " (" << stage->n_device << " of " << n_tensors
          << " tensors, staged through host memory)";
    }
    a.describe = d.str();

    track(ctx, a);
    out = a;
    return true;
}

void detach(llama_context * ctx) {
    process_state & s = state();
    std::lock_guard<std::recursive_mutex> lk(s.mu);
    auto it = s.contexts.find(ctx);
    if (it == s.contexts.end()) {
        return;
    }
    mcb_model_unregister(it->second.model);
    s.contexts.erase(it);
    s.marks.erase(marked_memory(ctx));
    g_tracking.store(!s.contexts.empty(), std::memory_order_release);
}

seq_origin seq_get_origin(llama_context * ctx, llama_seq_id seq_id) {
    process_state & s = state();
    std::lock_guard<std::recursive_mutex> lk(s.mu);
    seq_origin o;
    auto it = s.marks.find(marked_memory(ctx));
    if (it == s.marks.end()) {
        return o;
    }
    o.clean_end = it->second.get(seq_id);
    auto sc = it->second.scope.find(seq_id);
    if (sc != it->second.scope.end()) {
        o.known = true;
        std::copy(sc->second.begin(), sc->second.end(), o.scope);
    }
    return o;
}

void seq_set_scope(llama_context * ctx, llama_seq_id seq_id, const uint8_t scope[16], bool known) {
    process_state & s = state();
    std::lock_guard<std::recursive_mutex> lk(s.mu);
    auto it = s.marks.find(marked_memory(ctx));
    if (it == s.marks.end()) {
        return;
    }
    kv_marks & m = it->second;
    if (!known) {
        m.scope.erase(seq_id);
        m.seq[seq_id] = 0;
        return;
    }
    std::array<uint8_t, 16> id;
    std::copy(scope, scope + 16, id.begin());
    m.scope[seq_id] = id;
}

void mark_restored(llama_context * ctx, llama_seq_id seq_id) {
    process_state & s = state();
    std::lock_guard<std::recursive_mutex> lk(s.mu);
    auto it = s.marks.find(marked_memory(ctx));
    if (it != s.marks.end()) {
        // Published blocks are clean by construction: the sequence holds nothing else.
        it->second.seq[seq_id] = k_all_clean;
    }
}

//
// clean marks (docs/design.md §5.4)
//

namespace {

// Runs fn on the marks of mem when an attached context's marks follow its edits.
template <typename F>
void with_marks(const void * mem, F && fn) {
    if (!g_tracking.load(std::memory_order_acquire)) {
        return;
    }
    process_state & s = state();
    std::lock_guard<std::recursive_mutex> lk(s.mu);
    auto it = s.marks.find(mem);
    if (it != s.marks.end()) {
        fn(it->second);
    }
}

void rm_one(const llama_kv_cache * kv, kv_marks & m, llama_seq_id seq, llama_pos p0, llama_pos p1) {
    const llama_pos pos_max = kv->seq_pos_max(seq);
    if (pos_max < 0) {
        return; // nothing to remove
    }
    p0 = std::max<llama_pos>(p0, 0);
    const bool to_end = p1 < 0 || p1 > pos_max;
    if (!to_end && p1 <= p0) {
        return;
    }
    if (to_end) {
        // A tail cut: what stays was computed before what goes, so it stays as clean
        // as it was; a cut at or below the mark removes every unclean cell.
        if (p0 <= m.get(seq)) {
            m.seq[seq] = k_all_clean;
        }
        return;
    }
    // A hole in the middle: cells after it were computed over tokens that are gone.
    m.lower(seq, p0);
}

// The edits whose effect on the marks is the same in a KV cache and a recurrent
// memory (mem is either).

void marks_keep(const void * mem, llama_seq_id seq_id) {
    with_marks(mem, [&](kv_marks & m) {
        const llama_pos keep = m.get(seq_id);
        auto sc = m.scope.find(seq_id);
        kv_marks kept;
        kept.seq[seq_id] = keep;
        if (sc != m.scope.end()) {
            kept.scope[seq_id] = sc->second;
        }
        m = kept;
    });
}

void marks_shift(const void * mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos shift) {
    if (shift == 0 || (p0 >= 0 && p0 == p1)) {
        return;
    }
    with_marks(mem, [&](kv_marks & m) {
        p0 = std::max<llama_pos>(p0, 0);
        // Cells (a recurrent state) from p0 on move; from the lower of the old and new
        // start, positions hold what was computed at other positions.
        m.lower(seq_id, std::min(p0, p0 + shift));
    });
}

void marks_div(const void * mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d) {
    if (d == 1 || (p0 >= 0 && p0 == p1)) {
        return;
    }
    with_marks(mem, [&](kv_marks & m) { m.lower(seq_id, std::max<llama_pos>(p0, 0)); });
}

void marks_clear(const void * mem) {
    with_marks(mem, [&](kv_marks & m) { m = kv_marks{}; });
}

// After a successful state_read: the loaded state came from elsewhere.
void marks_state_read(const void * mem, llama_seq_id seq_id) {
    with_marks(mem, [&](kv_marks & m) {
        if (seq_id < 0) {
            m = kv_marks{};
            m.dflt = 0;
        } else {
            m.seq[seq_id] = 0;
            m.scope.erase(seq_id);
        }
    });
}

} // namespace

void kv_seq_rm(const llama_kv_cache * kv, llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    with_marks(kv, [&](kv_marks & m) {
        if (seq_id >= 0) {
            rm_one(kv, m, seq_id, p0, p1);
            return;
        }
        // Every sequence: the ones with their own mark, and the default for the rest.
        for (auto & [seq, _] : m.seq) {
            rm_one(kv, m, seq, p0, p1);
        }
        if (p0 <= 0 && p1 < 0) {
            m = kv_marks{};
        }
    });
}

void kv_seq_cp(const llama_kv_cache * kv, llama_seq_id src, llama_seq_id dst, llama_pos p0, llama_pos p1) {
    (void) p1; // a copy of [0, p1) is a prefix of src and as clean as src is
    if (src == dst) {
        return;
    }
    with_marks(kv, [&](kv_marks & m) {
        const bool dst_empty = kv->seq_pos_max(dst) < 0;
        const bool cross_stream = &kv->get_cells(src) != &kv->get_cells(dst); // the copy replaces dst's stream
        auto sc = m.scope.find(src);
        if ((dst_empty || cross_stream) && p0 <= 0 && sc != m.scope.end()) {
            m.seq[dst]   = m.get(src);
            m.scope[dst] = sc->second;
        } else {
            m.seq[dst] = 0; // two histories mixed in one sequence, or an unknown one
            m.scope.erase(dst);
        }
    });
}

void kv_seq_keep(const llama_kv_cache * kv, llama_seq_id seq_id) {
    marks_keep(kv, seq_id);
}

void kv_seq_add(const llama_kv_cache * kv, llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos shift) {
    marks_shift(kv, seq_id, p0, p1, shift);
}

void kv_seq_div(const llama_kv_cache * kv, llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d) {
    marks_div(kv, seq_id, p0, p1, d);
}

void kv_clear(const llama_kv_cache * kv) {
    marks_clear(kv);
}

void kv_state_read(const llama_kv_cache * kv, llama_seq_id seq_id) {
    marks_state_read(kv, seq_id);
}

void rs_seq_rm(const llama_memory_recurrent * rs, llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    with_marks(rs, [&](kv_marks & m) {
        p0 = std::max<llama_pos>(p0, 0);
        if (seq_id < 0) {
            if (p0 == 0 && p1 < 0) {
                m = kv_marks{}; // every state goes; a narrower range removes nothing
            }
            return;
        }
        const llama_pos pos_max = rs->seq_pos_max(seq_id);
        if (pos_max < 0 || p0 > pos_max || (p1 >= 0 && p1 <= pos_max)) {
            return; // the state is not in the range: it stays as it is
        }
        if (p0 == 0) {
            m.seq[seq_id] = k_all_clean; // the state goes
            return;
        }
        // A cut inside the history either rolls the state back to p0 (the per-token
        // snapshots of speculative decoding) or is refused and leaves it: which, the
        // memory decides after this call. The history past p0 is in doubt either way.
        m.lower(seq_id, p0);
    });
}

void rs_seq_cp(const llama_memory_recurrent * rs, llama_seq_id src, llama_seq_id dst, llama_pos p0, llama_pos p1) {
    (void) p0; // the copy shares src's one state, whatever the range
    (void) p1;
    if (src == dst) {
        return;
    }
    with_marks(rs, [&](kv_marks & m) {
        // dst's state is replaced by src's, history and all.
        auto sc = m.scope.find(src);
        if (rs->seq_pos_max(src) >= 0 && sc != m.scope.end()) {
            m.seq[dst]   = m.get(src);
            m.scope[dst] = sc->second;
        } else {
            m.seq[dst] = rs->seq_pos_max(src) < 0 ? k_all_clean : 0;
            m.scope.erase(dst);
        }
    });
}

void rs_seq_keep(const llama_memory_recurrent * rs, llama_seq_id seq_id) {
    marks_keep(rs, seq_id);
}

void rs_seq_add(const llama_memory_recurrent * rs, llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos shift) {
    marks_shift(rs, seq_id, p0, p1, shift);
}

void rs_seq_div(const llama_memory_recurrent * rs, llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d) {
    marks_div(rs, seq_id, p0, p1, d);
}

void rs_clear(const llama_memory_recurrent * rs) {
    marks_clear(rs);
}

void rs_state_read(const llama_memory_recurrent * rs, llama_seq_id seq_id) {
    marks_state_read(rs, seq_id);
}

//
// provenance of the state llama.cpp saves and loads
//

namespace {

blob_digest digest_of(const uint8_t * p, size_t n) {
    constexpr uint64_t p1 = 0x9e3779b185ebca87ull, p2 = 0xc2b2ae3d27d4eb4full, p3 = 0x165667b19e3779f9ull;
    auto rotl  = [](uint64_t x, int r) { return (x << r) | (x >> (64 - r)); };
    auto round = [&](uint64_t acc, uint64_t w) { return rotl(acc + w * p2, 31) * p1; };
    auto avalanche = [&](uint64_t x) {
        x ^= x >> 33;
        x *= p2;
        x ^= x >> 29;
        x *= p3;
        return x ^ (x >> 32);
    };
    uint64_t lane[4] = {p1 + p2, p2, 0, 0 - p1};
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        for (int l = 0; l < 4; l++) {
            uint64_t w;
            std::memcpy(&w, p + i + 8 * l, sizeof(w));
            lane[l] = round(lane[l], w);
        }
    }
    uint64_t rest[4] = {};
    std::memcpy(rest, p + i, n - i);
    for (int l = 0; l < 4; l++) {
        lane[l] = round(lane[l], rest[l]);
    }
    const uint64_t len = (uint64_t) n;
    return {avalanche(rotl(lane[0], 1) + rotl(lane[1], 7) + len),
            avalanche(rotl(lane[2], 12) + rotl(lane[3], 18) + len * p3)};
}

bool identify(const char * path, file_identity & out) {
    struct stat st;
    if (path == nullptr || stat(path, &st) != 0) {
        return false;
    }
    out = {(int64_t) st.st_dev, (int64_t) st.st_ino, (int64_t) st.st_size,
           (int64_t) st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec};
    return true;
}

// The scope of seq_id when ctx is attached and the scope is known.
bool known_scope(llama_context * ctx, llama_seq_id seq_id, scope_id & out) {
    const seq_origin o = seq_get_origin(ctx, seq_id);
    if (o.known) {
        std::copy(o.scope, o.scope + 16, out.begin());
    }
    return o.known;
}

// Gives seq_id of an attached ctx the scope a write recorded, if one did.
template <typename K>
void restore_scope(llama_context * ctx, llama_seq_id seq_id, const recent_scopes<K> process_state::*saved, const K & key) {
    process_state & s = state();
    std::lock_guard<std::recursive_mutex> lk(s.mu);
    auto it = s.marks.find(marked_memory(ctx));
    const scope_id * scope = (s.*saved).get(key);
    if (it != s.marks.end() && scope != nullptr) {
        it->second.scope[seq_id] = *scope;
    }
}

} // namespace

void seq_state_written(llama_context * ctx, llama_seq_id seq_id, llama_state_seq_flags flags,
                       const uint8_t * data, size_t n) {
    scope_id scope;
    if (n == 0 || (flags & LLAMA_STATE_SEQ_FLAGS_ON_DEVICE) || !g_tracking.load(std::memory_order_acquire) ||
        !known_scope(ctx, seq_id, scope)) {
        return;
    }
    const blob_digest d = digest_of(data, n);
    process_state & s = state();
    std::lock_guard<std::recursive_mutex> lk(s.mu);
    s.saved_blobs.put(d, scope);
}

void seq_state_read(llama_context * ctx, llama_seq_id seq_id, llama_state_seq_flags flags,
                    const uint8_t * data, size_t n) {
    if (n == 0 || (flags & LLAMA_STATE_SEQ_FLAGS_ON_DEVICE) || !g_tracking.load(std::memory_order_acquire)) {
        return;
    }
    restore_scope(ctx, seq_id, &process_state::saved_blobs, digest_of(data, n));
}

void seq_file_written(llama_context * ctx, llama_seq_id seq_id, const char * path, size_t n) {
    scope_id      scope;
    file_identity id;
    if (n == 0 || !g_tracking.load(std::memory_order_acquire) || !known_scope(ctx, seq_id, scope) || !identify(path, id)) {
        return;
    }
    process_state & s = state();
    std::lock_guard<std::recursive_mutex> lk(s.mu);
    s.saved_files.put(id, scope);
}

void seq_file_read(llama_context * ctx, llama_seq_id seq_id, const char * path, size_t n, bool read_state) {
    file_identity id;
    if (n == 0 || !read_state || !g_tracking.load(std::memory_order_acquire) || !identify(path, id)) {
        return;
    }
    restore_scope(ctx, seq_id, &process_state::saved_files, id);
}

} // namespace mcb_llama
