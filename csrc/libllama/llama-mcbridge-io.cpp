// Stage 2 (docs/design.md §5.1): a restore runs llama.cpp's own machinery,
// llama_kv_cache::state_read_sinfo -> state_read_meta (the checks, apply_ubatch) ->
// state_read_data (layer count, V layout, types and row sizes, one read per contiguous
// run of cells), with a reader whose header is synthesized (P cells at positions
// 0..P-1) and whose tensor reads are checked against a bridge load into the KV tensors.
// The cells are chosen first, by llama.cpp's find_slot, and handed to state_read_sinfo,
// so that the load's transfers run while llama.cpp does its bookkeeping for them.
// A check that fails throws inside state_read_data, where llama.cpp rolls the sequence
// back. The load itself is over later (seq_restore_end): the server decodes other
// sequences meanwhile, and only then does the sequence keep its verified prefix.
// The save is the mirror: the cells and tensors of the sequence, handed to the bridge.
// KV in device memory goes through host staging (llama-mcbridge-device.cpp): the load
// lands there and each layer is uploaded once the bridge has verified it.
#include "llama-mcbridge-impl.h"

#include "llama-batch.h"
#include "llama-context.h"
#include "llama-impl.h"
#include "llama-io.h"
#include "llama-kv-cache.h"
#include "llama-model.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

namespace mcb_llama {

namespace {

struct cell_run {
    uint32_t from; // first cell
    uint32_t n;    // cells
};

// Groups position-ordered cells into runs of consecutive cells, as state_read_data does.
std::vector<cell_run> runs_of(const std::vector<uint32_t> & cells) {
    std::vector<cell_run> runs;
    for (uint32_t c : cells) {
        if (!runs.empty() && runs.back().from + runs.back().n == c) {
            runs.back().n++;
        } else {
            runs.push_back({c, 1});
        }
    }
    return runs;
}

// The extension a text token of prompt position pos gives its cell, in a cache whose
// cells carry one (M-RoPE, per-layer embeddings: llama_kv_cache::has_cell_ext).
llama_kv_cell_ext text_cell_ext(const llama_hparams & hp, llama_pos pos, llama_token tok) {
    llama_kv_cell_ext ext;
    // apply_ubatch: a text ubatch broadcasts each token's position to every M-RoPE
    // section, and the cell keeps the spatial ones (llama_ubatch::is_pos_2d).
    if (hp.n_pos_per_embd() >= 3) {
        ext.x = pos;
        ext.y = pos;
    }
    ext.tok = tok;
    return ext;
}

} // namespace

std::vector<uint32_t> seq_cells(const llama_kv_cache * kv, llama_seq_id seq_id, int32_t n) {
    std::vector<uint32_t> cell(n, UINT32_MAX);
    const llama_kv_cells & cells = kv->get_cells(seq_id);
    for (uint32_t i = 0; i < cells.size(); i++) {
        if (cells.is_empty(i) || !cells.seq_has(i, seq_id)) {
            continue;
        }
        const llama_pos p = cells.pos_get(i);
        if (p >= 0 && p < n) {
            cell[p] = i;
        }
    }
    auto hole = std::find(cell.begin(), cell.end(), UINT32_MAX);
    cell.erase(hole, cell.end());
    return cell;
}

uint32_t seq_stream(const llama_kv_cache * kv, llama_seq_id seq_id) {
    // get_cells hands out one element of the cache's vector of streams, and sequence 0
    // is always in stream 0.
    const std::ptrdiff_t strm = &kv->get_cells(seq_id) - &kv->get_cells(0);
    if (strm < 0 || (uint32_t) strm >= kv->get_n_stream()) {
        throw std::runtime_error("sequence " + std::to_string(seq_id) + " maps to no stream of the cache");
    }
    return (uint32_t) strm;
}

std::vector<mcb_kv_layer> stream_layers(const kv_storage & st, uint32_t n_cells, bool v_trans, uint32_t strm) {
    std::vector<mcb_kv_layer> layers(st.k.size());
    for (size_t l = 0; l < st.k.size(); l++) {
        const ggml_tensor * k = st.k[l];
        const ggml_tensor * v = st.v[l];
        layers[l].k        = static_cast<uint8_t *>(k->data) + strm * k->nb[2];
        layers[l].k_stride = k->nb[1];
        if (v == nullptr) {
            continue; // a K-only cache: the layer's V is null, of stride 0
        }
        layers[l].v        = static_cast<uint8_t *>(v->data) + strm * v->nb[2];
        layers[l].v_stride = v_trans ? (uint64_t) n_cells * ggml_element_size(v) : v->nb[1];
    }
    return layers;
}

namespace {

// The stage-2 reader. Its byte stream is the state blob of a sequence that holds
// positions 0..P-1 (llama-patches/README.md, "Sequence-state blob"), minus the tensor
// bytes. The load already runs into the cells find_slot chose; each tensor read must be
// the next one of those cells' runs, in the tensor the load writes. It copies nothing:
// the load writes the cells, and seq_restore_end waits for it.
class bridge_reader : public llama_io_read_i {
public:
    // The reader of cache kv, whose layers are storage layers [first, first + count)
    // (an indexed memory's companion cache has layers of its own after the attention
    // cache's), each read into layers[first + l].
    bridge_reader(llama_kv_cache * kv, const llama_hparams & hp, const attachment & att, size_t first, size_t count,
                  llama_seq_id seq_id, const llama_token * tokens, const std::vector<uint32_t> & cells,
                  const std::vector<mcb_kv_layer> & layers) :
        kv(kv), att(att), seq_id(seq_id), n_tokens((int32_t) cells.size()), cells(cells),
        runs(runs_of(cells)), layers(layers.begin() + first, layers.begin() + first + count),
        ks(att.storage.k.begin() + first, att.storage.k.begin() + first + count),
        vs(att.storage.v.begin() + first, att.storage.v.begin() + first + count),
        k_only(vs.empty() || vs[0] == nullptr) {
        put<uint32_t>(kv->get_n_stream());
        // The cells go in the first stream section; state_read places a single-sequence
        // blob in the destination's own stream whichever section carries it.
        put<uint32_t>((uint32_t) n_tokens);
        const bool ext = kv->has_cell_ext();
        for (int32_t i = 0; i < n_tokens; i++) {
            put<int32_t>(i);       // pos
            put<uint32_t>(1);      // n_seq_id
            if (ext) {
                // What computing the prompt's token there gives the cell; seq_save
                // publishes only cells that hold it.
                put(text_cell_ext(hp, i, tokens[i]));
            }
            put<int32_t>(seq_id);  // discarded: the destination is used
        }
        put<uint32_t>(att.v_trans ? 1 : 0);
        put<uint32_t>((uint32_t) ks.size());
        // The widths are the tensors' (kv_format_rows), which the cache made from its
        // own hyperparameters.
        for (const ggml_tensor * k : ks) {
            put<int32_t>((int32_t) k->type);
            put<uint64_t>(k->nb[1]);
        }
        // state_read_data skips every layer whose V is null: a K-only cache's state
        // has no V section.
        if (!k_only) {
            for (const ggml_tensor * v : vs) {
                put<int32_t>((int32_t) v->type);
                if (!att.v_trans) {
                    put<uint64_t>(v->nb[1]);
                } else {
                    put<uint32_t>((uint32_t) ggml_type_size(v->type));
                    put<uint32_t>((uint32_t) v->ne[0]);
                }
            }
        }
        for (uint32_t s = 1; s < kv->get_n_stream(); s++) {
            put<uint32_t>(0);
        }
        n_reads_total = ks.size() * runs.size();
        for (const ggml_tensor * v : vs) {
            n_reads_total += k_only ? 0 : runs.size() * (att.v_trans ? (size_t) v->ne[0] : 1);
        }
    }

    void read(void * dst, size_t size) override {
        if (size > stream.size() - cur) {
            throw std::runtime_error("mcbridge: llama.cpp read past the synthesized state header");
        }
        memcpy(dst, stream.data() + cur, size);
        cur += size;
    }

    void read_tensor(ggml_tensor * t, size_t offset, size_t size) override {
        try {
            if (n_reads == 0 && seq_cells(kv, seq_id, n_tokens) != cells) {
                throw std::runtime_error("mcbridge: llama.cpp placed the sequence in other cells than the load's");
            }
            expect(t, offset, size);
            n_reads++;
        } catch (const std::exception & e) {
            error = e.what(); // state_read_data swallows the exception itself
            throw;
        }
    }

    size_t n_bytes() override { return cur; }

    // Whether llama.cpp read every run of every layer: the whole sequence is placed.
    bool complete() const { return n_reads == n_reads_total; }

    std::string error;

private:
    template <typename T> void put(T v) {
        const auto * p = reinterpret_cast<const uint8_t *>(&v);
        stream.insert(stream.end(), p, p + sizeof(T));
    }

    // The read that state_read_data issues next, by its index: K of every layer, then V
    // of every layer (by row j when transposed; none in a K-only cache), one per run.
    void expect(ggml_tensor * t, size_t offset, size_t size) {
        const size_t R = runs.size();
        const size_t L = ks.size();
        size_t i = n_reads;
        size_t want_off, want_size;
        const void * want_data;
        if (i < L * R) {
            const size_t l = i / R;
            const cell_run & r = runs[i % R];
            const size_t row = ks[l]->nb[1];
            want_off  = r.from * row;
            want_size = r.n * row;
            want_data = layers[l].k;
        } else {
            if (k_only) {
                throw std::runtime_error("mcbridge: llama.cpp read V of a cache without V");
            }
            i -= L * R;
            size_t l = 0;
            for (; l < L; l++) {
                const size_t per = R * (att.v_trans ? (size_t) vs[l]->ne[0] : 1);
                if (i < per) {
                    break;
                }
                i -= per;
            }
            if (l == L) {
                throw std::runtime_error("mcbridge: more tensor reads than the cells need");
            }
            const cell_run & r = runs[i % R];
            if (!att.v_trans) {
                const size_t row = vs[l]->nb[1];
                want_off  = r.from * row;
                want_size = r.n * row;
            } else {
                const size_t el = ggml_type_size(vs[l]->type);
                const size_t j  = i / R;
                want_off  = (r.from + j * kv->get_size()) * el;
                want_size = r.n * el;
            }
            want_data = layers[l].v;
        }
        if (offset != want_off || size != want_size || t->data != want_data) {
            throw std::runtime_error("mcbridge: llama.cpp read tensor " + std::string(t->name) + " at " +
                                     std::to_string(offset) + "+" + std::to_string(size) + ", expected " +
                                     std::to_string(want_off) + "+" + std::to_string(want_size) +
                                     " of the tensor the load writes");
        }
    }

    llama_kv_cache *      kv;
    const attachment &    att;
    const llama_seq_id    seq_id;
    const int32_t         n_tokens;
    const std::vector<uint32_t>      cells;
    const std::vector<cell_run>      runs;
    const std::vector<mcb_kv_layer>  layers; // the cache's, from the load's layout
    const std::vector<ggml_tensor *> ks, vs; // the cache's K and V tensors (V null without V)
    // The cache has no V tensors: an MLA cache, an indexer's (which may have none
    // where the attention cache has V).
    const bool k_only;

    std::vector<uint8_t> stream;
    size_t cur = 0;

    size_t n_reads = 0;
    size_t n_reads_total = 0;
};

// Learns which tensors hold a sequence's K and V from a state_write of it: each layer's
// writes come together, K of every layer first, then V (of a cache that has V). Copies
// nothing.
class tensor_capture : public llama_io_write_i {
public:
    void write(const void * /*src*/, size_t size) override { n += size; }
    void write_tensor(ggml_tensor * t, size_t /*offset*/, size_t size) override {
        if (order.empty() || order.back() != t) {
            order.push_back(t);
        }
        n += size;
    }
    size_t n_bytes() override { return n; }

    std::vector<ggml_tensor *> order;

private:
    size_t n = 0;
};

} // namespace

kv_storage capture_storage(llama_kv_cache * kv, llama_seq_id seq_id) {
    tensor_capture cap;
    kv->state_write(cap, seq_id);
    const size_t L = kv->get_layer_ids().size();
    if (cap.order.size() != L && cap.order.size() != 2 * L) {
        throw std::runtime_error("state_write named " + std::to_string(cap.order.size()) + " tensors for " +
                                 std::to_string(L) + " layers");
    }
    const bool k_only = cap.order.size() == L;
    // Each named tensor is the sequence's stream's view of a layer's K or V: a view at
    // stream * nb[2] of the whole tensor, with its rows.
    const uint32_t strm = seq_stream(kv, seq_id);
    kv_storage st;
    for (size_t i = 0; i < cap.order.size(); i++) {
        ggml_tensor * view = cap.order[i];
        ggml_tensor * whole = view->view_src != nullptr ? view->view_src : view;
        if (whole->buffer == nullptr || whole->data == nullptr) {
            throw std::runtime_error(std::string("KV tensor ") + whole->name + " is not allocated");
        }
        if (whole->ne[2] != (int64_t) kv->get_n_stream() || view->nb[1] != whole->nb[1] ||
            view->data != static_cast<uint8_t *>(whole->data) + strm * whole->nb[2]) {
            throw std::runtime_error(std::string("KV tensor ") + whole->name + " is not laid out by stream");
        }
        (i < L ? st.k : st.v).push_back(whole);
    }
    if (k_only) {
        st.v.assign(L, nullptr);
    }
    return st;
}

mcb_kv_layout layout_of(const llama_kv_cache * kv, bool v_trans, const std::vector<mcb_kv_layer> & layers) {
    mcb_kv_layout layout = {};
    layout.n_layer  = (uint32_t) layers.size();
    layout.n_cells  = kv->get_size();
    layout.v_trans  = v_trans;
    layout.location = "cpu:0";
    layout.layers   = layers.data();
    return layout;
}

namespace {

// The cells llama.cpp's restore of positions [0, n) into the empty seq_id would take:
// find_slot over the ubatch state_read_meta builds for it. Empty when they do not fit.
llama_kv_cache::slot_info place(const llama_kv_cache * kv, const llama_hparams & hp, llama_seq_id seq_id, int32_t n) {
    llama_batch_allocr balloc(hp.n_pos_per_embd());
    llama_ubatch ub = balloc.ubatch_reserve((uint32_t) n, 1);
    ub.seq_id_unq[0] = seq_id;
    for (int32_t i = 0; i < n; i++) {
        for (uint32_t d = 0; d < hp.n_pos_per_embd(); d++) {
            ub.pos[i + d * n] = i; // a text token's position in every M-RoPE section
        }
        ub.n_seq_id[i] = 1;
        ub.seq_id[i]   = &seq_id;
    }
    return kv->find_slot(ub, false);
}

} // namespace

restore_result seq_restore_begin(llama_context * ctx, const attachment & att, mcb_plan plan,
                                 llama_seq_id seq_id, const llama_token * tokens, int32_t n_tokens, restore_op & op) {
    restore_result out;
    op = restore_op{};
    llama_kv_cache * kv = attn_kv(ctx);
    if ((kv == nullptr && att.n_layer > 0) || n_tokens <= 0 || tokens == nullptr) {
        mcb_plan_drop(plan);
        out.status = MCB_STATUS_INVALID_ARG;
        out.error  = "no plain KV cache or no tokens";
        return out;
    }
    // No compute may be writing the cache while the bridge does.
    llama_synchronize(ctx);

    // llama.cpp's restore begins so; the cells it frees may take the load. The partial
    // state goes too: until the restore ends, the sequence holds only the load's cells.
    llama_memory_seq_rm(llama_get_memory(ctx), seq_id, -1, -1);
    out.seq_cleared = true;
    if (att.n_layer == 0) {
        // A memory without KV layers: the load fetches the snapshot, which
        // seq_restore_end reads into the sequence.
        mcb_load load = 0;
        out.status = mcb_load_begin(plan, nullptr, nullptr, &load);
        if (out.status != MCB_STATUS_OK) {
            out.error = "mcb_load_begin: " + status_message(out.status);
            return out;
        }
        op.ctx      = ctx;
        op.seq_id   = seq_id;
        op.n_tokens = n_tokens;
        op.partial  = true;
        op.snapshot_flags = att.snapshot_flags;
        op.load     = load;
        return out;
    }
    const llama_hparams & hp = llama_get_model(ctx)->hparams;
    const llama_kv_cache::slot_info sinfo = place(kv, hp, seq_id, n_tokens);
    if (sinfo.empty()) {
        mcb_plan_drop(plan);
        out.status = MCB_STATUS_LAYOUT;
        out.error  = "no room in the cache for " + std::to_string(n_tokens) + " cells";
        return out;
    }
    // An indexed memory's companion cache takes the same cells (register_with_probe):
    // the load writes both caches' rows at them.
    llama_kv_cache * kv2 = companion_kv(ctx);
    if (kv2 != nullptr) {
        const llama_kv_cache::slot_info sinfo2 = place(kv2, hp, seq_id, n_tokens);
        if (sinfo2.idxs != sinfo.idxs || sinfo2.strm != sinfo.strm) {
            mcb_plan_drop(plan);
            out.status = MCB_STATUS_LAYOUT;
            out.error  = "the indexer cache has other cells free than the attention cache";
            return out;
        }
    }
    // The load starts now, into cells that belong to no sequence yet (nothing reads
    // them), and runs while llama.cpp allocates them to seq_id, and after: until
    // seq_restore_end, no batch holds seq_id, and no other sequence attends to its cells.
    const std::vector<uint32_t> & cells = sinfo.idxs[0];
    const std::vector<mcb_kv_layer> layers = stream_layers(att.storage, kv->get_size(), att.v_trans, sinfo.strm[0]);
    mcb_kv_layout layout = layout_of(kv, att.v_trans, layers);
    std::vector<uint32_t> at = cells; // where the load puts position i
    stage_buf * staging = nullptr;
    if (att.stage) {
        try {
            staging = att.stage->acquire((uint32_t) n_tokens);
        } catch (const std::exception & e) {
            mcb_plan_drop(plan);
            out.status = MCB_STATUS_LAYOUT; // no room for the staging, as for the cells
            out.error  = e.what();
            return out;
        }
        layout = att.stage->layout(*staging);
        for (int32_t i = 0; i < n_tokens; i++) {
            at[i] = (uint32_t) i;
        }
    }
    mcb_load load = 0;
    out.status = mcb_load_begin(plan, &layout, at.data(), &load);
    if (out.status != MCB_STATUS_OK) {
        out.error = "mcb_load_begin: " + status_message(out.status);
        if (staging != nullptr) {
            att.stage->release(staging);
        }
        return out;
    }

    const size_t n_main = kv->get_layer_ids().size();
    bridge_reader reader(kv, hp, att, 0, n_main, seq_id, tokens, cells, layers);
    std::unique_ptr<bridge_reader> reader2;
    if (kv2 != nullptr) {
        reader2 = std::make_unique<bridge_reader>(kv2, hp, att, n_main, layers.size() - n_main, seq_id, tokens, cells,
                                                  layers);
    }
    llama_kv_cache::slot_info_vec_t placed(kv->get_n_stream());
    placed[0] = sinfo; // the blob's first section carries the cells
    try {
        kv->state_read_sinfo(reader, seq_id, 0, nullptr, &placed);
        if (!reader.complete()) {
            throw std::runtime_error("mcbridge: llama.cpp did not read the restore to its end");
        }
        if (reader2) {
            llama_kv_cache::slot_info_vec_t placed2 = placed;
            kv2->state_read_sinfo(*reader2, seq_id, 0, nullptr, &placed2);
            if (!reader2->complete()) {
                throw std::runtime_error("mcbridge: llama.cpp did not read the indexer cache's restore to its end");
            }
        }
    } catch (const std::exception & e) {
        // A check failed: llama.cpp refused the cells (and removed the sequence), or
        // placed them otherwise than the load writes them. Nothing the load started
        // may write once the cells are free again.
        mcb_load_cancel(load);
        mcb_load_result res = {};
        mcb_load_end(load, &res);
        if (staging != nullptr) {
            att.stage->release(staging); // nothing was uploaded from it
        }
        out.status = MCB_STATUS_LAYOUT;
        out.error = !reader.error.empty()             ? reader.error
                    : reader2 && !reader2->error.empty() ? reader2->error
                                                         : e.what();
        llama_memory_seq_rm(llama_get_memory(ctx), seq_id, -1, -1);
        return out;
    }
    op.ctx      = ctx;
    op.seq_id   = seq_id;
    op.n_tokens = n_tokens;
    op.n_layer  = att.n_layer;
    op.partial  = att.snapshot_tokens > 0;
    op.load     = load;
    if (staging != nullptr) {
        // The restore stays in flight in its own staging: the polls upload each layer
        // once the bridge has it verified, while the bridge moves the next and the
        // server decodes other slots (docs/design.md §5.7).
        op.stage   = att.stage;
        op.staging = staging;
        op.cells   = cells;
        op.strm    = sinfo.strm[0];
        op.n_ok    = (uint32_t) n_tokens;
    }
    return out;
}

namespace {

// Queues the upload of op's layers from op.n_uploaded on: those the bridge reports
// verified and in staging, or, with wait, every layer, waiting for each (bounded by
// the load's deadline). Only the prefix verified so far is uploaded; it only shrinks,
// and seq_restore_end removes the cells past the final one.
void upload_verified(restore_op & op, bool wait) {
    while (op.n_uploaded < op.n_layer) {
        const uint32_t l = op.n_uploaded;
        if (!wait) {
            uint32_t placed = 0, ok = 0;
            if (mcb_load_progress(op.load, &placed, &ok) != MCB_STATUS_OK || placed <= l) {
                return;
            }
        }
        uint32_t ok_l = 0;
        const mcb_status st = mcb_load_wait_layer(op.load, l, &ok_l);
        op.n_ok = std::min(op.n_ok, st == MCB_STATUS_OK ? ok_l : 0u);
        if (op.n_ok > 0) {
            op.stage->upload(*op.staging, l, op.strm, op.cells, op.n_ok);
        }
        op.n_uploaded++;
    }
}

// Waits for op's uploads and gives its staging back: before its cells change owner or
// go back to llama.cpp, nothing may still be writing them.
void return_staging(restore_op & op) {
    if (op.staging == nullptr) {
        return;
    }
    op.stage->sync();
    op.stage->release(op.staging);
    op.staging = nullptr;
    op.stage.reset();
}

} // namespace

bool seq_restore_poll(restore_op & op, uint32_t timeout_us) {
    if (op.load == 0) {
        return true;
    }
    if (op.staging != nullptr) {
        upload_verified(op, false);
    }
    bool done = true;
    if (mcb_load_poll(op.load, timeout_us, &done) != MCB_STATUS_OK) {
        return true; // seq_restore_end reports why
    }
    return done;
}

restore_result seq_restore_end(restore_op & op) {
    restore_result out;
    out.seq_cleared = true;
    if (op.load == 0) {
        out.status = MCB_STATUS_STATE;
        out.error  = "no restore in flight";
        return out;
    }
    if (op.staging != nullptr) {
        upload_verified(op, true);
        return_staging(op);
    }
    // Every layer, each verified before it is reported, so no compute ever sees
    // unverified rows (docs/design.md §5.2). After a poll that said done, nothing waits.
    uint32_t ok = (uint32_t) op.n_tokens;
    for (uint32_t l = 0; l < op.n_layer; l++) {
        uint32_t ok_l = 0;
        const mcb_status st = mcb_load_wait_layer(op.load, l, &ok_l);
        if (st != MCB_STATUS_OK && out.status == MCB_STATUS_OK) {
            out.status = st;
        }
        ok = std::min(ok, st == MCB_STATUS_OK ? ok_l : 0u);
    }
    // A memory with a partial state goes on from the snapshot the blocks end at, which
    // the load read and verified beside them; without it the blocks are no state.
    uint8_t * snap   = nullptr;
    size_t    n_snap = 0;
    if (op.partial) {
        const mcb_status st = mcb_load_snapshot(op.load, &snap, &n_snap);
        if (st != MCB_STATUS_OK && out.status == MCB_STATUS_OK) {
            out.status = st;
        }
    }
    mcb_load_result res = {};
    const mcb_status st_end = mcb_load_end(op.load, &res);
    op.load = 0;
    if (st_end != MCB_STATUS_OK && out.status == MCB_STATUS_OK) {
        out.status = st_end;
    }
    out.n_tokens = (int32_t) std::min(ok, res.n_tokens_ok);
    out.n_bytes  = res.n_bytes + n_snap;
    out.n_snapshot_bytes = n_snap;
    if (op.partial && (snap == nullptr || out.n_tokens < op.n_tokens)) {
        out.n_tokens = 0;
    }

    llama_kv_cache * kv = attn_kv(op.ctx);
    llama_memory_t mem = llama_get_memory(op.ctx);
    // The loop may have a batch of other sequences in flight; the cells change owner now.
    llama_synchronize(op.ctx);
    if (out.n_tokens > 0 && snap != nullptr) {
        // llama.cpp's own read of a partial state, as llama-server loads its context
        // checkpoints: the window cache or the recurrent state of the sequence, at the
        // position the blocks end (or, of DeepSeek V4, its whole state, as a slot file's).
        size_t read = 0;
        try {
            read = llama_state_seq_set_data_ext(op.ctx, snap, n_snap, op.seq_id, op.snapshot_flags);
        } catch (const std::exception & e) {
            out.error = e.what();
        }
        if (read != n_snap) {
            out.n_tokens = 0;
            out.status   = MCB_STATUS_CORRUPT;
            if (out.error.empty()) {
                out.error = "llama.cpp read " + std::to_string(read) + " of the snapshot's " + std::to_string(n_snap) + " bytes";
            }
        } else if (op.snapshot_flags == LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) {
            out.partial.assign(snap, snap + n_snap);
        } else {
            out.partial = seq_state(op.ctx, op.seq_id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
        }
    }
    mcb_state_free(snap);
    if (out.n_tokens == 0) {
        if (out.error.empty()) {
            out.error = "mcbridge: no block restored (" + status_message(out.status) + ")";
        }
        llama_memory_seq_rm(mem, op.seq_id, -1, -1);
        return out;
    }
    if (out.n_tokens < op.n_tokens) {
        // A partial load: keep the verified prefix; the cells past it hold unverified
        // bytes and leave the sequence (of the companion cache too, which holds the
        // same positions). A load with a snapshot is whole or nothing.
        kv->seq_rm(op.seq_id, out.n_tokens, -1);
        if (llama_kv_cache * kv2 = companion_kv(op.ctx)) {
            kv2->seq_rm(op.seq_id, out.n_tokens, -1);
        }
    }
    mark_restored(op.ctx, op.seq_id);
    return out;
}

void seq_restore_cancel(restore_op & op) {
    if (op.load == 0) {
        return;
    }
    mcb_load_cancel(op.load);
    mcb_load_result res = {};
    mcb_load_end(op.load, &res);
    op.load = 0;
    return_staging(op);
    // The cells hold whatever the load had written: they leave the sequence.
    llama_memory_seq_rm(llama_get_memory(op.ctx), op.seq_id, -1, -1);
}

size_t seq_state_into(llama_context * ctx, llama_seq_id seq_id, llama_state_seq_flags flags, std::vector<uint8_t> & buf) {
    const size_t size = llama_state_seq_get_size_ext(ctx, seq_id, flags);
    if (buf.size() < size) {
        buf.resize(size);
    }
    return size == 0 ? 0 : llama_state_seq_get_data_ext(ctx, buf.data(), size, seq_id, flags);
}

std::vector<uint8_t> seq_state(llama_context * ctx, llama_seq_id seq_id, llama_state_seq_flags flags) {
    std::vector<uint8_t> buf;
    buf.resize(seq_state_into(ctx, seq_id, flags, buf));
    return buf;
}

mcb_status seq_snapshot(llama_context * ctx, const attachment & att, const mcb_scope * scope,
                        llama_seq_id seq_id, const llama_token * tokens, int32_t n_tokens, std::string & error) {
    if (att.snapshot_tokens == 0 || n_tokens <= 0 || tokens == nullptr) {
        error = "no partial state or no tokens";
        return MCB_STATUS_INVALID_ARG;
    }
    // llama.cpp's own writer of the partial state (as llama-server's checkpoints take
    // it), or of the whole state.
    std::vector<uint8_t> & buf = *att.snapshot_buf;
    const size_t           n   = seq_state_into(ctx, seq_id, att.snapshot_flags, buf);
    if (n == 0) {
        error = "llama.cpp wrote no state of sequence " + std::to_string(seq_id);
        return MCB_STATUS_STATE;
    }
    const mcb_status st = mcb_snapshot_save(att.model, scope, tokens, (size_t) n_tokens, buf.data(), n);
    if (st != MCB_STATUS_OK) {
        error = "mcb_snapshot_save: " + status_message(st);
    }
    return st;
}

save_result seq_save(llama_context * ctx, const attachment & att, const mcb_scope * scope,
                     llama_seq_id seq_id, const llama_token * tokens, int32_t n_tokens) {
    save_result out;
    if (att.n_layer == 0) {
        return out; // no rows: the snapshots (seq_snapshot) are what it publishes
    }
    llama_kv_cache * kv = attn_kv(ctx);
    if (kv == nullptr || n_tokens <= 0 || tokens == nullptr) {
        out.status = MCB_STATUS_INVALID_ARG;
        out.error  = "no plain KV cache or no tokens";
        return out;
    }
    llama_synchronize(ctx);

    const int32_t clean = (int32_t) std::min<llama_pos>(n_tokens, seq_get_origin(ctx, seq_id).clean_end);
    std::vector<uint32_t> cells = seq_cells(kv, seq_id, clean);
    if (kv->has_cell_ext()) {
        // A restore gives every cell a text token's extension (bridge_reader), so only
        // the cells that carry one are published: not those of an image's embeddings.
        const llama_kv_cells & kc = kv->get_cells(seq_id);
        const llama_hparams & hp = llama_get_model(ctx)->hparams;
        for (size_t p = 0; p < cells.size(); p++) {
            const llama_kv_cell_ext got  = kc.ext_get(cells[p]);
            const llama_kv_cell_ext want = text_cell_ext(hp, (llama_pos) p, tokens[p]);
            if (got.x != want.x || got.y != want.y || got.tok != want.tok) {
                cells.resize(p);
                break;
            }
        }
    }
    if (llama_kv_cache * kv2 = companion_kv(ctx)) {
        // The layout reads both caches' rows at the attention cache's cells: only the
        // positions the companion holds in the same cells are published.
        const std::vector<uint32_t> cells2 = seq_cells(kv2, seq_id, (int32_t) cells.size());
        cells.resize(std::mismatch(cells.begin(), cells.end(), cells2.begin(), cells2.end()).first - cells.begin());
    }
    const int32_t n = (int32_t) cells.size();
    if (n == 0) {
        return out;
    }

    std::vector<mcb_kv_layer> layers;
    uint32_t strm = 0;
    mcb_kv_layout layout = {};
    std::vector<uint32_t> at = cells; // where the save reads position i
    stage_buf * staging = nullptr;
    try {
        strm   = seq_stream(kv, seq_id);
        layers = stream_layers(att.storage, kv->get_size(), att.v_trans, strm);
        layout = layout_of(kv, att.v_trans, layers);
        if (att.stage) {
            staging = att.stage->acquire((uint32_t) n);
            layout  = att.stage->layout(*staging);
            for (int32_t i = 0; i < n; i++) {
                at[i] = (uint32_t) i;
            }
        }
    } catch (const std::exception & e) {
        out.status = MCB_STATUS_UNSUPPORTED;
        out.error  = e.what();
        return out;
    }
    // The staging is given back once nothing writes it any more.
    auto give_back = [&]() {
        if (staging != nullptr) {
            att.stage->sync();
            att.stage->release(staging);
        }
    };
    if (staging != nullptr) {
        // Every layer's download is queued at once; the bridge copies layer l while the
        // device sends the later ones (§5.7).
        for (uint32_t l = 0; l < layout.n_layer; l++) {
            att.stage->download(*staging, l, strm, cells);
        }
    }

    mcb_save h = 0;
    out.status = mcb_save_begin(att.model, scope, &layout, tokens, (size_t) n, at.data(), &h);
    if (out.status != MCB_STATUS_OK) {
        out.error = "mcb_save_begin: " + status_message(out.status);
        give_back();
        return out;
    }
    for (uint32_t l = 0; l < layout.n_layer; l++) {
        if (staging != nullptr) {
            att.stage->wait_download(l);
        }
        const mcb_status st = mcb_save_layer(h, l);
        if (st != MCB_STATUS_OK) {
            out.status = st;
            out.error  = "mcb_save_layer: " + status_message(st);
            break;
        }
    }
    const mcb_status st_end = mcb_save_end(h, &out.blocks);
    give_back(); // the save has copied the rows it takes
    if (st_end != MCB_STATUS_OK && out.status == MCB_STATUS_OK) {
        out.status = st_end;
        out.error  = "mcb_save_end: " + status_message(st_end);
    }
    out.n_tokens = out.status == MCB_STATUS_OK ? n : 0;
    return out;
}

} // namespace mcb_llama
