#include "seq_state.hpp"

#include <cstdio>
#include <cstring>
#include <limits>

namespace mcb_seqstate {
namespace {

// Reads little-endian fields with bounds checks; every count read from the
// blob is checked against the bytes left before anything is sized by it.
class Reader {
  public:
    Reader(const uint8_t *p, size_t n) : p_(p), n_(n) {}

    size_t off() const { return off_; }
    size_t left() const { return n_ - off_; }

    template <typename T> bool get(T *v) {
        if (left() < sizeof(T)) return false;
        std::memcpy(v, p_ + off_, sizeof(T));
        off_ += sizeof(T);
        return true;
    }
    bool skip(size_t n) {
        if (left() < n) return false;
        off_ += n;
        return true;
    }

  private:
    const uint8_t *p_;
    size_t n_;
    size_t off_ = 0;
};

bool fail(std::string *err, const char *fmt, unsigned long long a = 0, unsigned long long b = 0) {
    if (err) {
        char buf[192];
        std::snprintf(buf, sizeof buf, fmt, a, b);
        *err = buf;
    }
    return false;
}

bool mul(uint64_t a, uint64_t b, uint64_t *out) { return !__builtin_mul_overflow(a, b, out); }
bool add(uint64_t a, uint64_t b, uint64_t *out) { return !__builtin_add_overflow(a, b, out); }

template <typename T> void put(uint8_t *&p, T v) {
    std::memcpy(p, &v, sizeof v);
    p += sizeof v;
}

bool parse_data(Reader &r, uint32_t n_cells, SeqState *st, std::string *err) {
    uint32_t v_trans = 0, n_layer = 0;
    if (!r.get(&v_trans) || !r.get(&n_layer)) return fail(err, "truncated before the layer count");
    if (v_trans > 1) return fail(err, "v_trans %llu is neither 0 nor 1", v_trans);
    // Each layer takes at least a 12-byte K header: a bigger count is a lie.
    if (n_layer == 0 || n_layer > r.left() / 12) return fail(err, "n_layer %llu does not fit in %llu bytes", n_layer, r.left());
    st->format.v_trans = v_trans != 0;
    st->format.layers.assign(n_layer, LayerFormat{});
    st->spans.assign(n_layer, LayerSpan{});
    for (uint32_t l = 0; l < n_layer; l++) {
        LayerFormat &f = st->format.layers[l];
        uint64_t bytes = 0;
        if (!r.get(&f.k_type) || !r.get(&f.k_row)) return fail(err, "layer %llu: truncated K header", l);
        if (f.k_row == 0 || !mul(f.k_row, n_cells, &bytes) || bytes > r.left())
            return fail(err, "layer %llu: K rows of %llu bytes do not fit", l, f.k_row);
        st->spans[l].k = r.off();
        r.skip(bytes);
    }
    // Layers without V (MLA) are skipped by the writer, which would make the
    // V sections ambiguous; llama-architecture caches have V on every layer.
    for (uint32_t l = 0; l < n_layer; l++) {
        LayerFormat &f = st->format.layers[l];
        uint64_t bytes = 0;
        if (!r.get(&f.v_type)) return fail(err, "layer %llu: truncated V header", l);
        if (st->format.v_trans) {
            if (!r.get(&f.v_el) || !r.get(&f.n_embd_v)) return fail(err, "layer %llu: truncated V header", l);
            if (f.v_el == 0 || f.n_embd_v == 0 || !mul(f.v_el, f.n_embd_v, &f.v_row))
                return fail(err, "layer %llu: V of %llu-byte elements", l, f.v_el);
        } else if (!r.get(&f.v_row) || f.v_row == 0) {
            return fail(err, "layer %llu: truncated or empty V header", l);
        }
        if (!mul(f.v_row, n_cells, &bytes) || bytes > r.left())
            return fail(err, "layer %llu: V of %llu bytes per cell does not fit", l, f.v_row);
        st->spans[l].v = r.off();
        r.skip(bytes);
    }
    return true;
}

} // namespace

bool parse_seq_state(const uint8_t *blob, size_t size, SeqState *out, std::string *err) {
    if (blob == nullptr && size != 0) return fail(err, "NULL blob");
    Reader r(blob, size);
    SeqState st;
    uint32_t magic = 0;
    if (!r.get(&magic) || !r.get(&st.seq_id) || !r.get(&st.n_stream)) return fail(err, "truncated header (%llu bytes)", size);
    if (magic != kSeqStateMagic) return fail(err, "magic %#llx: not a llama.cpp v0.5.0 sequence state", magic);
    if (st.n_stream == 0 || st.n_stream > r.left() / 4) return fail(err, "n_stream %llu does not fit", st.n_stream);
    bool found = false;
    for (uint32_t s = 0; s < st.n_stream; s++) {
        uint32_t n_cells = 0;
        if (!r.get(&n_cells)) return fail(err, "stream %llu: truncated cell count", s);
        if (n_cells == 0) continue;
        if (found) return fail(err, "streams %llu and %llu both hold cells", st.stream, s);
        found = true;
        st.stream = s;
        // A cell is at least 12 bytes (pos, n_seq_id, one seq id).
        if (n_cells > r.left() / 12) return fail(err, "stream %llu: %llu cells do not fit", s, n_cells);
        st.pos.resize(n_cells);
        for (uint32_t c = 0; c < n_cells; c++) {
            uint32_t n_seq = 0;
            int32_t seq = 0;
            if (!r.get(&st.pos[c]) || !r.get(&n_seq)) return fail(err, "cell %llu: truncated", c);
            // One sequence per cell, and no cell extension: an M-RoPE or PLE
            // cell would put its x/y/token where the seq id is expected.
            if (n_seq != 1) return fail(err, "cell %llu: %llu sequence ids (one expected)", c, n_seq);
            if (!r.get(&seq)) return fail(err, "cell %llu: truncated", c);
            if (seq != st.seq_id) return fail(err, "cell %llu: sequence %llu, not the blob's", c, static_cast<uint32_t>(seq));
        }
        st.data = r.off();
        if (!parse_data(r, n_cells, &st, err)) return false;
    }
    if (r.left() != 0) return fail(err, "%llu bytes after the last stream", r.left());
    st.end = r.off();
    *out = std::move(st);
    return true;
}

bool position_cells(const SeqState &st, std::vector<uint32_t> *cells, std::string *err) {
    const uint32_t n = st.n_cells();
    std::vector<uint32_t> at(n, std::numeric_limits<uint32_t>::max());
    for (uint32_t c = 0; c < n; c++) {
        const int32_t p = st.pos[c];
        if (p < 0 || static_cast<uint32_t>(p) >= n)
            return fail(err, "cell %llu holds position %llu, outside [0, cell count)", c, static_cast<uint32_t>(p));
        if (at[p] != std::numeric_limits<uint32_t>::max()) return fail(err, "position %llu is in two cells", p);
        at[p] = c;
    }
    *cells = std::move(at);
    return true;
}

bool data_size(const KVFormat &fmt, uint32_t n_cells, size_t *out) {
    uint64_t total = 8, rows = 0;
    for (const LayerFormat &f : fmt.layers) {
        // Both headers are 12 bytes: i32 type + u64 row size, and for V
        // either the same or (transposed) i32 type + u32 el + u32 columns.
        if (!mul(f.k_row, n_cells, &rows) || !add(total, 12 + rows, &total)) return false;
        if (!mul(f.v_row, n_cells, &rows) || !add(total, 12 + rows, &total)) return false;
    }
    if (total > std::numeric_limits<size_t>::max()) return false;
    *out = static_cast<size_t>(total);
    return true;
}

bool build_seq_state(int32_t seq_id, uint32_t n_stream, uint32_t stream, const KVFormat &fmt, uint32_t n_cells,
                     std::vector<uint8_t> *blob, std::vector<LayerSpan> *spans, std::string *err) {
    if (n_stream == 0 || stream >= n_stream) return fail(err, "stream %llu of %llu", stream, n_stream);
    if (n_cells == 0 || fmt.layers.empty()) return fail(err, "a blob of %llu cells, %llu layers", n_cells, fmt.layers.size());
    size_t data = 0;
    uint64_t total = 0;
    if (!data_size(fmt, n_cells, &data) || !add(12 + 4ull * n_stream, 12ull * n_cells, &total) ||
        !add(total, data, &total) || total > std::numeric_limits<size_t>::max())
        return fail(err, "a blob of %llu cells overflows", n_cells);
    blob->assign(static_cast<size_t>(total), 0);
    spans->assign(fmt.layers.size(), LayerSpan{});
    uint8_t *p = blob->data();
    put(p, kSeqStateMagic);
    put(p, seq_id);
    put(p, n_stream);
    for (uint32_t s = 0; s < n_stream; s++) {
        if (s != stream) {
            put(p, uint32_t{0});
            continue;
        }
        put(p, n_cells);
        for (uint32_t c = 0; c < n_cells; c++) {
            put(p, static_cast<int32_t>(c));
            put(p, uint32_t{1});
            put(p, seq_id);
        }
        put(p, static_cast<uint32_t>(fmt.v_trans));
        put(p, static_cast<uint32_t>(fmt.layers.size()));
        for (size_t l = 0; l < fmt.layers.size(); l++) {
            put(p, fmt.layers[l].k_type);
            put(p, fmt.layers[l].k_row);
            (*spans)[l].k = static_cast<size_t>(p - blob->data());
            p += fmt.layers[l].k_row * n_cells;
        }
        for (size_t l = 0; l < fmt.layers.size(); l++) {
            const LayerFormat &f = fmt.layers[l];
            put(p, f.v_type);
            if (fmt.v_trans) {
                put(p, f.v_el);
                put(p, f.n_embd_v);
            } else {
                put(p, f.v_row);
            }
            (*spans)[l].v = static_cast<size_t>(p - blob->data());
            p += f.v_row * n_cells;
        }
    }
    return true;
}

void copy_prefix(const KVFormat &fmt, const uint8_t *src, const std::vector<LayerSpan> &src_spans, uint32_t src_cells,
                 uint8_t *dst, const std::vector<LayerSpan> &dst_spans, uint32_t dst_cells, uint32_t n) {
    for (size_t l = 0; l < fmt.layers.size(); l++) {
        const LayerFormat &f = fmt.layers[l];
        std::memcpy(dst + dst_spans[l].k, src + src_spans[l].k, f.k_row * n);
        if (!fmt.v_trans) {
            std::memcpy(dst + dst_spans[l].v, src + src_spans[l].v, f.v_row * n);
            continue;
        }
        // A transposed column is as long as its blob has cells.
        for (uint32_t j = 0; j < f.n_embd_v; j++)
            std::memcpy(dst + dst_spans[l].v + uint64_t(j) * dst_cells * f.v_el,
                        src + src_spans[l].v + uint64_t(j) * src_cells * f.v_el, uint64_t(f.v_el) * n);
    }
}

} // namespace mcb_seqstate
