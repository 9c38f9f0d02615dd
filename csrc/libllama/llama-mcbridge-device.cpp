// KV in memory the CPU cannot address (a GPU, an RPC server): staged through host
// memory, layer by layer, with ggml's backend API (docs/design.md §5.7).
//
// The bridge's loads and saves move rows between its pool and a host layout. When any
// KV tensor of a context is not host memory, that layout is a staging buffer of ours,
// one per load or save in flight: position i of a restore or save in staging row i
// (cells 0..n-1), every layer, so one load or save covers the whole cache whatever
// each layer's placement (partial offload, several devices). A restore uploads layer l
// from its staging as soon as the bridge reports it verified, while the bridge's
// transfers of later layers go on and the server decodes other slots; a save
// downloads every layer first (asynchronously where the backend can) and hands each
// to the bridge as soon as its download is done.
#include "llama-mcbridge-impl.h"

#include "llama-context.h"
#include "llama-kv-cache.h"

#include "ggml-backend.h"

#include <algorithm>
#include <set>
#include <stdexcept>

namespace mcb_llama {

namespace {

// Staging buffers hold this many positions, or a power of two times it, so that a few
// sizes serve every restore and save and idle buffers are reused.
constexpr uint32_t k_min_cells = 512;

// The backend of ctx that computes on buf's device, nullptr for host memory or when
// none does (then the synchronous tensor_set/get is used).
ggml_backend_t backend_of(llama_context * ctx, ggml_backend_buffer_t buf) {
    if (ggml_backend_buffer_is_host(buf)) {
        return nullptr;
    }
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(buf));
    ggml_backend_sched_t sched = ctx->get_sched();
    for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); i++) {
        ggml_backend_t b = ggml_backend_sched_get_backend(sched, i);
        if (ggml_backend_get_device(b) == dev) {
            return b;
        }
    }
    return nullptr;
}

} // namespace

std::shared_ptr<kv_stage> kv_stage::make(llama_context * ctx, const llama_kv_cache * kv, const kv_storage & st,
                                         bool v_trans) {
    // A K-only cache (MLA) has no V tensors: st.v[l] is null, and so are its backend,
    // row and element size, and its pieces.
    bool device = false;
    for (size_t l = 0; l < st.k.size(); l++) {
        device = device || !ggml_backend_buffer_is_host(st.k[l]->buffer) ||
                 (st.v[l] != nullptr && !ggml_backend_buffer_is_host(st.v[l]->buffer));
    }
    if (!device) {
        return nullptr;
    }
    auto s = std::shared_ptr<kv_stage>(new kv_stage());
    s->st      = st;
    s->v_trans = v_trans;
    s->n_cells = kv->get_size();
    std::set<std::string> names;
    for (size_t l = 0; l < st.k.size(); l++) {
        ggml_tensor * v = st.v[l];
        s->kb.push_back(backend_of(ctx, st.k[l]->buffer));
        s->vb.push_back(v != nullptr ? backend_of(ctx, v->buffer) : nullptr);
        s->krow.push_back(st.k[l]->nb[1]);
        s->vrow.push_back(v != nullptr ? v->nb[1] : 0);
        s->vel.push_back(v != nullptr ? ggml_element_size(v) : 0);
        s->vdim.push_back(v != nullptr ? (uint32_t) v->ne[0] : 0);
        for (ggml_tensor * t : {st.k[l], v}) {
            if (t == nullptr) {
                continue;
            }
            ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(t->buffer));
            if (!ggml_backend_buffer_is_host(t->buffer)) {
                s->n_device++;
                names.insert(dev != nullptr ? ggml_backend_dev_name(dev) : ggml_backend_buffer_name(t->buffer));
                if (s->host_buft == nullptr && dev != nullptr) {
                    s->host_buft = ggml_backend_dev_host_buffer_type(dev); // pinned, where the device has it
                }
            }
        }
    }
    if (s->host_buft == nullptr) {
        s->host_buft = ggml_backend_cpu_buffer_type();
    }
    for (ggml_backend_t b : s->kb) {
        if (b != nullptr) {
            s->backends.insert(b);
        }
    }
    for (ggml_backend_t b : s->vb) {
        if (b != nullptr) {
            s->backends.insert(b);
        }
    }
    // One event a layer and backend where the backend has events: a save waits for one
    // layer's downloads while later layers' run.
    for (size_t l = 0; l < st.k.size(); l++) {
        std::vector<ggml_backend_event_t> evs;
        for (ggml_backend_t b : {s->kb[l], s->vb[l]}) {
            if (b != nullptr) {
                evs.push_back(ggml_backend_event_new(ggml_backend_get_device(b)));
            }
        }
        s->events.push_back(evs);
    }
    std::string d;
    for (const std::string & n : names) {
        d += (d.empty() ? "" : ", ") + n;
    }
    s->where = d;
    return s;
}

kv_stage::~kv_stage() {
    for (auto & evs : events) {
        for (ggml_backend_event_t e : evs) {
            if (e != nullptr) {
                ggml_backend_event_free(e);
            }
        }
    }
    for (auto & b : bufs) {
        ggml_backend_buffer_free(b->buf);
    }
}

size_t kv_stage::bytes_for(uint32_t n) const {
    size_t size = 0;
    for (size_t l = 0; l < krow.size(); l++) {
        size += (size_t) n * (krow[l] + vrow[l]);
    }
    return size;
}

stage_buf * kv_stage::acquire(uint32_t n) {
    stage_buf * best = nullptr;
    for (auto & b : bufs) {
        if (!b->lent && b->cap >= n && (best == nullptr || b->cap < best->cap)) {
            best = b.get();
        }
    }
    if (best == nullptr) {
        uint32_t c = k_min_cells;
        while (c < n) {
            c *= 2;
        }
        c = std::min(c, std::max(n, n_cells));
        const size_t size = bytes_for(c);
        // Loads in flight place into distinct cells, so together they stage at most one
        // stream's worth, and a save at most one more: idle buffers go before that
        // budget is exceeded.
        const size_t budget = 2 * bytes_for(n_cells);
        for (auto it = bufs.begin(); it != bufs.end() && allocated + size > budget;) {
            if ((*it)->lent) {
                ++it;
                continue;
            }
            allocated -= (*it)->bytes;
            ggml_backend_buffer_free((*it)->buf);
            it = bufs.erase(it);
        }
        if (allocated + size > budget) {
            throw std::runtime_error("mcbridge: host staging is lent to other loads (" + std::to_string(allocated) +
                                     " of " + std::to_string(budget) + " bytes)");
        }
        ggml_backend_buffer_t nb = ggml_backend_buft_alloc_buffer(host_buft, size);
        if (nb == nullptr) {
            throw std::runtime_error("mcbridge: cannot allocate " + std::to_string(size) + " bytes of host staging");
        }
        auto b   = std::make_unique<stage_buf>();
        b->buf   = nb;
        b->cap   = c;
        b->bytes = size;
        uint8_t * base = static_cast<uint8_t *>(ggml_backend_buffer_get_base(nb));
        b->rows.assign(krow.size(), {});
        for (size_t l = 0; l < krow.size(); l++) {
            b->rows[l].k        = base;
            b->rows[l].k_stride = krow[l];
            base += (size_t) c * krow[l];
            if (st.v[l] == nullptr) {
                continue; // no V: null, of stride 0
            }
            b->rows[l].v        = base;
            b->rows[l].v_stride = v_trans ? (uint64_t) c * vel[l] : vrow[l];
            base += (size_t) c * vrow[l];
        }
        allocated += size;
        best = b.get();
        bufs.push_back(std::move(b));
    }
    best->lent = true;
    return best;
}

void kv_stage::release(stage_buf * b) {
    b->lent = false;
}

mcb_kv_layout kv_stage::layout(const stage_buf & b) const {
    mcb_kv_layout lo = {};
    lo.n_layer  = (uint32_t) b.rows.size();
    lo.n_cells  = b.cap;
    lo.v_trans  = v_trans;
    lo.location = "cpu:0";
    lo.layers   = b.rows.data();
    return lo;
}

// Calls fn(staging, tensor, offset, size) for every contiguous piece of layer l's K
// and V that positions [0, n) occupy in cells (of stream strm): one a run of cells,
// or, with V transposed, one a run and dimension.
template <typename F>
void kv_stage::pieces(const stage_buf & b, uint32_t l, uint32_t strm, const std::vector<uint32_t> & cells, uint32_t n,
                      F && fn) const {
    ggml_tensor * k = st.k[l];
    ggml_tensor * v = st.v[l];
    uint8_t * sk = static_cast<uint8_t *>(b.rows[l].k);
    uint8_t * sv = static_cast<uint8_t *>(b.rows[l].v);
    const size_t cap = b.cap;
    for (uint32_t p0 = 0; p0 < n;) {
        uint32_t len = 1;
        while (p0 + len < n && cells[p0 + len] == cells[p0] + len) {
            len++;
        }
        const size_t c0 = cells[p0];
        fn(kb[l], k, sk + p0 * krow[l], strm * k->nb[2] + c0 * krow[l], (size_t) len * krow[l]);
        if (v != nullptr && !v_trans) {
            fn(vb[l], v, sv + p0 * vrow[l], strm * v->nb[2] + c0 * vrow[l], (size_t) len * vrow[l]);
        } else if (v != nullptr) {
            for (size_t j = 0; j < vdim[l]; j++) {
                fn(vb[l], v, sv + (j * cap + p0) * vel[l], strm * v->nb[2] + (j * n_cells + c0) * vel[l],
                   (size_t) len * vel[l]);
            }
        }
        p0 += len;
    }
}

void kv_stage::upload(const stage_buf & b, uint32_t l, uint32_t strm, const std::vector<uint32_t> & cells, uint32_t n) {
    pieces(b, l, strm, cells, n, [](ggml_backend_t b, ggml_tensor * t, const uint8_t * src, size_t off, size_t size) {
        if (b != nullptr) {
            ggml_backend_tensor_set_async(b, t, src, off, size);
        } else {
            ggml_backend_tensor_set(t, src, off, size);
        }
    });
}

void kv_stage::download(const stage_buf & b, uint32_t l, uint32_t strm, const std::vector<uint32_t> & cells) {
    pieces(b, l, strm, cells, (uint32_t) cells.size(), [](ggml_backend_t b, ggml_tensor * t, uint8_t * dst, size_t off, size_t size) {
        if (b != nullptr) {
            ggml_backend_tensor_get_async(b, t, dst, off, size);
        } else {
            ggml_backend_tensor_get(t, dst, off, size);
        }
    });
    size_t i = 0;
    for (ggml_backend_t be : {kb[l], vb[l]}) {
        if (be != nullptr) {
            if (events[l][i] != nullptr) {
                ggml_backend_event_record(events[l][i], be);
            } else {
                ggml_backend_synchronize(be);
            }
            i++;
        }
    }
}

void kv_stage::wait_download(uint32_t l) {
    for (ggml_backend_event_t e : events[l]) {
        if (e != nullptr) {
            ggml_backend_event_synchronize(e);
        }
    }
}

void kv_stage::sync() {
    for (ggml_backend_t b : backends) {
        ggml_backend_synchronize(b);
    }
}

} // namespace mcb_llama
