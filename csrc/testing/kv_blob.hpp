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
    explicit blob_reader(const std::vector<uint8_t> & b) : b(b) {}
    const uint8_t * take(size_t n) {
        if (off + n > b.size()) {
            std::fprintf(stderr, "state blob ends early (%zu + %zu of %zu bytes)\n", off, n, b.size());
            std::exit(2);
        }
        const uint8_t * p = b.data() + off;
        off += n;
        return p;
    }
    uint32_t u32() { uint32_t v; std::memcpy(&v, take(4), 4); return v; }
    uint64_t u64() { uint64_t v; std::memcpy(&v, take(8), 8); return v; }

private:
    const std::vector<uint8_t> & b;
    size_t off = 0;
};

// Every position's K and V bytes, per layer K then V, V by token whatever its layout.
inline std::map<int32_t, std::vector<uint8_t>> kv_by_pos(const std::vector<uint8_t> & blob) {
    blob_reader r(blob);
    std::map<int32_t, std::vector<uint8_t>> out;
    r.take(8); // magic, seq id
    const uint32_t n_stream = r.u32();
    for (uint32_t s = 0; s < n_stream; s++) {
        const uint32_t n = r.u32();
        if (n == 0) {
            continue;
        }
        std::vector<int32_t> pos(n);
        for (uint32_t i = 0; i < n; i++) {
            pos[i] = (int32_t) r.u32();
            r.take(4 * (size_t) r.u32());
        }
        std::vector<std::vector<uint8_t>> row(n);
        const uint32_t v_trans = r.u32();
        const uint32_t n_layer = r.u32();
        for (uint32_t l = 0; l < n_layer; l++) {
            r.u32();
            const uint64_t sz = r.u64();
            for (uint32_t i = 0; i < n; i++) {
                const uint8_t * p = r.take(sz);
                row[i].insert(row[i].end(), p, p + sz);
            }
        }
        for (uint32_t l = 0; l < n_layer; l++) {
            r.u32();
            if (!v_trans) {
                const uint64_t sz = r.u64();
                for (uint32_t i = 0; i < n; i++) {
                    const uint8_t * p = r.take(sz);
                    row[i].insert(row[i].end(), p, p + sz);
                }
                continue;
            }
            const uint32_t el   = r.u32();
            const uint32_t dims = r.u32();
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
            out[pos[i]] = row[i];
        }
    }
    return out;
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
