// kv_blob.hpp - test code only: reads a llama_state_seq_get_data blob of llama.cpp
// v0.5.0 (llama-patches/README.md, "Sequence-state blob") on its own, so that the
// hosts' tests compare KV bytes without trusting the library's parser.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <vector>

namespace mcb_test {

class blob_reader {
public:
    // fatal: a read past the end exits; otherwise it marks the reader bad
    // and reads zeros, and the caller checks bad().
    blob_reader(const std::vector<uint8_t> & b, bool fatal = true) : b(b), fatal(fatal) {}
    const uint8_t * take(size_t n) {
        if (failed || n > b.size() - off) {
            if (fatal) {
                std::fprintf(stderr, "state blob ends early (%zu + %zu of %zu bytes)\n", off, n, b.size());
                std::exit(2);
            }
            failed = true;
            return nullptr;
        }
        const uint8_t * p = b.data() + off;
        off += n;
        return p;
    }
    uint32_t u32() { uint32_t v = 0; if (const uint8_t * p = take(4)) std::memcpy(&v, p, 4); return v; }
    uint64_t u64() { uint64_t v = 0; if (const uint8_t * p = take(8)) std::memcpy(&v, p, 8); return v; }
    bool bad() const { return failed; }
    size_t left() const { return b.size() - off; }

private:
    const std::vector<uint8_t> & b;
    size_t off = 0;
    bool fatal;
    bool failed = false;
};

// Reads one KV cache's section (its stream count, then each stream's cells and
// layers) and appends each position's rows to out[pos]: false when it is cut short.
inline bool read_cache(blob_reader & r, bool with_v, std::map<int32_t, std::vector<uint8_t>> & out) {
    const uint32_t n_stream = r.u32();
    for (uint32_t s = 0; s < n_stream && !r.bad(); s++) {
        const uint32_t n = r.u32();
        if (n == 0) {
            continue;
        }
        if (n > r.left() / 8) {
            return false;
        }
        std::vector<int32_t> pos(n);
        for (uint32_t i = 0; i < n; i++) {
            pos[i] = (int32_t) r.u32();
            r.take(4 * (size_t) r.u32());
        }
        std::vector<std::vector<uint8_t>> row(n);
        const uint32_t v_trans = r.u32();
        const uint32_t n_layer = r.u32();
        for (uint32_t l = 0; l < n_layer && !r.bad(); l++) {
            r.u32();
            const uint64_t sz = r.u64();
            for (uint32_t i = 0; i < n && !r.bad(); i++) {
                const uint8_t * p = r.take(sz);
                if (p) row[i].insert(row[i].end(), p, p + sz);
            }
        }
        for (uint32_t l = 0; with_v && l < n_layer && !r.bad(); l++) {
            r.u32();
            if (!v_trans) {
                const uint64_t sz = r.u64();
                for (uint32_t i = 0; i < n && !r.bad(); i++) {
                    const uint8_t * p = r.take(sz);
                    if (p) row[i].insert(row[i].end(), p, p + sz);
                }
                continue;
            }
            const uint32_t el   = r.u32();
            const uint32_t dims = r.u32();
            if (r.bad() || el == 0 || dims > r.left() / el / n) {
                return false;
            }
            std::vector<std::vector<uint8_t>> v(n);
            for (uint32_t j = 0; j < dims; j++) {
                for (uint32_t i = 0; i < n; i++) {
                    const uint8_t * p = r.take(el);
                    v[i].insert(v[i].end(), p, p + el);
                }
            }
            for (uint32_t i = 0; i < n; i++) {
                row[i].insert(row[i].end(), v[i].begin(), v[i].end());
            }
        }
        for (uint32_t i = 0; i < n; i++) {
            std::vector<uint8_t> & at = out[pos[i]];
            at.insert(at.end(), row[i].begin(), row[i].end());
        }
    }
    return !r.bad();
}

// kv_by_pos's reading with or without V sections: false when the blob does not
// read so to its last byte. A memory of several KV caches (an MLA cache and its
// indexer's, llama_kv_cache_dsa) writes each cache's section after the other's.
inline bool kv_by_pos_as(const std::vector<uint8_t> & blob, bool with_v, std::map<int32_t, std::vector<uint8_t>> & out) {
    blob_reader r(blob, false);
    out.clear();
    r.take(8); // magic, seq id
    do {
        if (!read_cache(r, with_v, out)) {
            return false;
        }
    } while (r.left() > 0);
    return true;
}

// Every position's K and V bytes, per cache and layer K then V, V by token
// whatever its layout. An MLA cache has no V, and its state no V sections (K only): a blob
// that does not read with V to its last byte is read without.
inline std::map<int32_t, std::vector<uint8_t>> kv_by_pos(const std::vector<uint8_t> & blob) {
    std::map<int32_t, std::vector<uint8_t>> out;
    if (kv_by_pos_as(blob, true, out) || kv_by_pos_as(blob, false, out)) {
        return out;
    }
    std::fprintf(stderr, "a state blob of %zu bytes reads neither with V nor K-only\n", blob.size());
    std::exit(2);
}

// The position of the first cell the blob lists (cell order), -1 when it has none.
inline int32_t first_cell_pos(const std::vector<uint8_t> & blob) {
    blob_reader r(blob);
    r.take(8);
    const uint32_t n_stream = r.u32();
    for (uint32_t s = 0; s < n_stream; s++) {
        if (r.u32() > 0) {
            return (int32_t) r.u32();
        }
    }
    return -1;
}

} // namespace mcb_test
