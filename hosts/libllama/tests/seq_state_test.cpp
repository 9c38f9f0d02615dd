// seq_state_test - the v0.5.0 sequence-state parser and builder on
// synthetic blobs, and on real ones given as arguments (the in-memory blobs
// of internal/llamastate/testdata, which llama.cpp wrote).
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "seq_state.hpp"

using namespace mcb_seqstate;

namespace {

int failures, checks;

#define CHECK(cond, ...)                                              \
    do {                                                              \
        checks++;                                                     \
        if (!(cond)) {                                                \
            failures++;                                               \
            std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
            std::fprintf(stderr, __VA_ARGS__);                        \
            std::fputc('\n', stderr);                                 \
        }                                                             \
    } while (0)

KVFormat format(bool v_trans, int n_layer) {
    KVFormat f;
    f.v_trans = v_trans;
    for (int l = 0; l < n_layer; l++) {
        LayerFormat lf;
        lf.k_type = 8; // q8_0: 34-byte rows, not a multiple of anything useful
        lf.k_row = 34;
        lf.v_type = 1;
        if (v_trans) {
            lf.v_el = 2;
            lf.n_embd_v = 24 + l;
            lf.v_row = 2 * lf.n_embd_v;
        } else {
            lf.v_row = 48 + 2 * l;
        }
        f.layers.push_back(lf);
    }
    return f;
}

// A byte that says which layer, position and offset it belongs to.
uint8_t mark(size_t l, uint32_t pos, size_t i, bool v) { return static_cast<uint8_t>(l * 31 + pos * 7 + i * 3 + (v ? 101 : 0)); }

void fill(const KVFormat &f, std::vector<uint8_t> &blob, const std::vector<LayerSpan> &spans, uint32_t n) {
    for (size_t l = 0; l < f.layers.size(); l++) {
        const LayerFormat &lf = f.layers[l];
        for (uint32_t p = 0; p < n; p++) {
            for (size_t i = 0; i < lf.k_row; i++) blob[spans[l].k + p * lf.k_row + i] = mark(l, p, i, false);
            for (size_t i = 0; i < lf.v_row; i++) {
                const size_t off = f.v_trans ? (i / lf.v_el * n + p) * lf.v_el + i % lf.v_el : p * lf.v_row + i;
                blob[spans[l].v + off] = mark(l, p, i, true);
            }
        }
    }
}

long mismatches(const KVFormat &f, const std::vector<uint8_t> &blob, const std::vector<LayerSpan> &spans, uint32_t n) {
    long bad = 0;
    for (size_t l = 0; l < f.layers.size(); l++) {
        const LayerFormat &lf = f.layers[l];
        for (uint32_t p = 0; p < n; p++) {
            for (size_t i = 0; i < lf.k_row; i++) bad += blob[spans[l].k + p * lf.k_row + i] != mark(l, p, i, false);
            for (size_t i = 0; i < lf.v_row; i++) {
                const size_t off = f.v_trans ? (i / lf.v_el * n + p) * lf.v_el + i % lf.v_el : p * lf.v_row + i;
                bad += blob[spans[l].v + off] != mark(l, p, i, true);
            }
        }
    }
    return bad;
}

void test_build_parse() {
    for (bool v_trans : {false, true}) {
        for (uint32_t n_stream : {1u, 3u}) {
            const KVFormat f = format(v_trans, 3);
            const uint32_t stream = n_stream - 1, n = 10;
            std::vector<uint8_t> blob;
            std::vector<LayerSpan> spans;
            std::string err;
            CHECK(build_seq_state(5, n_stream, stream, f, n, &blob, &spans, &err), "build: %s", err.c_str());
            fill(f, blob, spans, n);
            SeqState st;
            CHECK(parse_seq_state(blob.data(), blob.size(), &st, &err), "parse: %s", err.c_str());
            CHECK(st.seq_id == 5 && st.n_stream == n_stream && st.stream == stream && st.n_cells() == n, "header");
            CHECK(st.format == f, "format differs after a round trip (v_trans %d)", v_trans);
            CHECK(st.end == blob.size(), "parsed %zu of %zu bytes", st.end, blob.size());
            for (size_t l = 0; l < spans.size(); l++)
                CHECK(st.spans[l].k == spans[l].k && st.spans[l].v == spans[l].v, "layer %zu spans", l);
            std::vector<uint32_t> cells;
            CHECK(position_cells(st, &cells, &err) && cells.size() == n && cells[3] == 3, "positions: %s", err.c_str());

            // Every truncation and any trailing byte is refused, cleanly.
            int accepted = 0;
            for (size_t cut = 0; cut < blob.size(); cut++) accepted += parse_seq_state(blob.data(), cut, &st, &err);
            CHECK(accepted == 0, "%d truncated blobs parsed", accepted);
            blob.push_back(0);
            CHECK(!parse_seq_state(blob.data(), blob.size(), &st, &err), "a trailing byte parsed");
            blob.pop_back();

            // A prefix copied into a smaller blob keeps every byte of its
            // positions, transposed columns included.
            std::vector<uint8_t> small;
            std::vector<LayerSpan> small_spans;
            CHECK(build_seq_state(5, n_stream, stream, f, 4, &small, &small_spans, &err), "build: %s", err.c_str());
            copy_prefix(f, blob.data(), spans, n, small.data(), small_spans, 4, 4);
            CHECK(mismatches(f, small, small_spans, 4) == 0, "copy_prefix (v_trans %d)", v_trans);
        }
    }
}

void put32(std::vector<uint8_t> &b, size_t off, uint32_t v) { std::memcpy(b.data() + off, &v, 4); }

void test_refusals() {
    const KVFormat f = format(false, 2);
    std::vector<uint8_t> blob;
    std::vector<LayerSpan> spans;
    std::string err;
    build_seq_state(0, 1, 0, f, 3, &blob, &spans, &err);
    SeqState st;
    const size_t cell0 = 16; // magic, seq, n_stream, cell_count

    struct Edit {
        const char *what;
        size_t off;
        uint32_t v;
    } edits[] = {
        {"other magic", 0, 0x67677371},
        {"no streams", 8, 0},
        {"a billion streams", 8, 1u << 30},
        {"4 billion cells", 12, 0xffffffffu},
        {"two sequences in a cell", cell0 + 4, 2},
        {"a cell of another sequence", cell0 + 8, 7},
        {"v_trans 2", cell0 + 36, 2},
        {"no layers", cell0 + 40, 0},
        {"4 billion layers", cell0 + 40, 0xffffffffu},
        {"K rows of 4 GiB", cell0 + 48, 0xffffffffu},
    };
    for (const Edit &e : edits) {
        std::vector<uint8_t> b = blob;
        put32(b, e.off, e.v);
        CHECK(!parse_seq_state(b.data(), b.size(), &st, &err), "%s parsed", e.what);
    }

    // Positions that are not exactly 0..n-1 parse, but map to no cells.
    for (uint32_t bad : {3u, 0xffffffffu, 0u}) {
        std::vector<uint8_t> b = blob;
        put32(b, cell0 + 12, bad); // the second cell's position
        std::vector<uint32_t> cells;
        CHECK(parse_seq_state(b.data(), b.size(), &st, &err), "parse: %s", err.c_str());
        CHECK(!position_cells(st, &cells, &err), "position %d of 3 cells mapped", static_cast<int>(bad));
    }

    // Two streams with cells: a blob of the whole context, not one sequence.
    std::vector<uint8_t> one;
    build_seq_state(0, 1, 0, f, 1, &one, &spans, &err);
    std::vector<uint8_t> two(one.begin(), one.begin() + 8);
    const uint32_t n_stream = 2;
    two.insert(two.end(), reinterpret_cast<const uint8_t *>(&n_stream), reinterpret_cast<const uint8_t *>(&n_stream) + 4);
    two.insert(two.end(), one.begin() + 12, one.end());
    two.insert(two.end(), one.begin() + 12, one.end());
    CHECK(!parse_seq_state(two.data(), two.size(), &st, &err), "two non-empty streams parsed");
    CHECK(err.find("both hold cells") != std::string::npos, "error: %s", err.c_str());

    // An empty sequence is a valid blob with no cells.
    std::vector<uint8_t> empty(20, 0);
    put32(empty, 0, kSeqStateMagic);
    put32(empty, 8, 2);
    CHECK(parse_seq_state(empty.data(), empty.size(), &st, &err) && st.n_cells() == 0, "empty: %s", err.c_str());
}

bool read_file(const char *path, std::vector<uint8_t> *out) {
    FILE *f = std::fopen(path, "rb");
    if (!f) return false;
    uint8_t buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out->insert(out->end(), buf, buf + n);
    std::fclose(f);
    return true;
}

void test_real(const char *path) {
    std::vector<uint8_t> blob;
    CHECK(read_file(path, &blob), "reading %s", path);
    SeqState st;
    std::vector<uint32_t> cells;
    std::string err;
    CHECK(parse_seq_state(blob.data(), blob.size(), &st, &err), "%s: %s", path, err.c_str());
    CHECK(position_cells(st, &cells, &err), "%s: %s", path, err.c_str());
    // Rebuilt in position order, every row lands where the parse says.
    std::vector<uint8_t> re;
    std::vector<LayerSpan> spans;
    CHECK(build_seq_state(st.seq_id, st.n_stream, st.stream, st.format, st.n_cells(), &re, &spans, &err), "%s", err.c_str());
    CHECK(re.size() == blob.size(), "%s: rebuilt %zu bytes of %zu", path, re.size(), blob.size());
    std::printf("  %s: %u cells, stream %u of %u, v_trans %d, %zu layers\n", path, st.n_cells(), st.stream, st.n_stream,
                st.format.v_trans, st.format.layers.size());
}

} // namespace

int main(int argc, char **argv) {
    test_build_parse();
    test_refusals();
    for (int i = 1; i < argc; i++) test_real(argv[i]);
    std::printf("seq_state_test: %d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
