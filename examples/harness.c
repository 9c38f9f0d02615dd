/*
 * A C host that behaves like llama.cpp towards libmcbridge: it owns per-layer
 * K and V tensors, "computes" a prompt by filling them with deterministic
 * bytes, saves the prompt's blocks, and restores the prefix into a second,
 * empty set of tensors, checking every byte. Then it shows misuse being
 * refused, each with its own status, leaving the tensors untouched.
 *
 * Usage: harness [--vtrans] [--config JSON]
 * Exit status 0 when every check passes.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mcbridge.h"

#define N_LAYER 4
#define N_CELLS 512
#define BLOCK 16
#define N_EMBD_K 64 /* f16 elements per token row */
#define N_EMBD_V 64
#define ELEM 2
#define SCRIBBLE 0xee

struct host {
    int vtrans;
    uint8_t *k[N_LAYER];
    uint8_t *v[N_LAYER];
    struct mcb_kv_layer layers[N_LAYER];
    struct mcb_kv_layout layout;
};

static int failures;

#define CHECK(cond, ...)                                              \
    do {                                                              \
        if (!(cond)) {                                                \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);      \
            fprintf(stderr, __VA_ARGS__);                             \
            fprintf(stderr, " (last error: %s)\n", mcb_last_error()); \
            failures++;                                               \
        }                                                             \
    } while (0)

#define EXPECT(call, want)                                                                   \
    do {                                                                                     \
        mcb_status got_ = (call);                                                            \
        CHECK(got_ == (want), "%s = %s, want %s", #call, mcb_status_str(got_), mcb_status_str(want)); \
    } while (0)

static size_t krow(void) { return N_EMBD_K * ELEM; }
static size_t vrow(void) { return N_EMBD_V * ELEM; }

static void host_init(struct host *h, int vtrans) {
    memset(h, 0, sizeof *h);
    h->vtrans = vtrans;
    for (int l = 0; l < N_LAYER; l++) {
        h->k[l] = malloc(N_CELLS * krow());
        h->v[l] = malloc(N_CELLS * vrow());
        if (!h->k[l] || !h->v[l]) {
            perror("malloc");
            exit(2);
        }
        h->layers[l].k = h->k[l];
        h->layers[l].v = h->v[l];
        h->layers[l].k_stride = krow();
        h->layers[l].v_stride = vtrans ? (uint64_t)N_CELLS * ELEM : vrow();
    }
    h->layout.n_layer = N_LAYER;
    h->layout.n_cells = N_CELLS;
    h->layout.v_trans = vtrans;
    h->layout.location = "cpu:0";
    h->layout.layers = h->layers;
}

static void host_free(struct host *h) {
    for (int l = 0; l < N_LAYER; l++) {
        free(h->k[l]);
        free(h->v[l]);
    }
}

static void host_scribble(struct host *h) {
    for (int l = 0; l < N_LAYER; l++) {
        memset(h->k[l], SCRIBBLE, N_CELLS * krow());
        memset(h->v[l], SCRIBBLE, N_CELLS * vrow());
    }
}

static uint8_t value(int32_t tok, int pos, int l, int kv, size_t i) {
    return (uint8_t)(tok * 31 + pos * 7 + l * 13 + kv * 101 + (int)i * 3);
}

static uint8_t *v_at(struct host *h, int l, uint32_t cell, size_t i) {
    if (!h->vtrans) return h->v[l] + cell * vrow() + i;
    return h->v[l] + (i / ELEM) * (N_CELLS * ELEM) + cell * ELEM + i % ELEM;
}

static void host_compute(struct host *h, const int32_t *tokens, const uint32_t *cells, int n) {
    for (int p = 0; p < n; p++)
        for (int l = 0; l < N_LAYER; l++) {
            for (size_t i = 0; i < krow(); i++) h->k[l][cells[p] * krow() + i] = value(tokens[p], p, l, 0, i);
            for (size_t i = 0; i < vrow(); i++) *v_at(h, l, cells[p], i) = value(tokens[p], p, l, 1, i);
        }
}

/* Counts bytes that differ from what positions [0, good) should hold, and
 * from the scribble byte everywhere else (untouched). */
static long host_diff(struct host *h, const int32_t *tokens, const uint32_t *cells, int n, int good) {
    long bad = 0;
    for (int p = 0; p < n; p++)
        for (int l = 0; l < N_LAYER; l++) {
            for (size_t i = 0; i < krow(); i++) {
                uint8_t want = p < good ? value(tokens[p], p, l, 0, i) : SCRIBBLE;
                bad += h->k[l][cells[p] * krow() + i] != want;
            }
            for (size_t i = 0; i < vrow(); i++) {
                uint8_t want = p < good ? value(tokens[p], p, l, 1, i) : SCRIBBLE;
                bad += *v_at(h, l, cells[p], i) != want;
            }
        }
    return bad;
}

static long host_touched(struct host *h) {
    long n = 0;
    for (int l = 0; l < N_LAYER; l++) {
        for (size_t i = 0; i < N_CELLS * krow(); i++) n += h->k[l][i] != SCRIBBLE;
        for (size_t i = 0; i < N_CELLS * vrow(); i++) n += h->v[l][i] != SCRIBBLE;
    }
    return n;
}

static void model_params(struct mcb_model_params *p, int vtrans, uint32_t n_layer, uint32_t block,
                         uint32_t *ek, uint32_t *ev, uint32_t *kr, uint32_t *vr) {
    for (uint32_t l = 0; l < n_layer; l++) {
        ek[l] = N_EMBD_K;
        ev[l] = N_EMBD_V;
        kr[l] = (uint32_t)krow();
        vr[l] = (uint32_t)vrow();
    }
    memset(p, 0, sizeof *p);
    p->llama_version = "harness";
    p->arch = "llama";
    p->n_layer = n_layer;
    p->block_tokens = block;
    p->n_embd_k_gqa = ek;
    p->n_embd_v_gqa = ev;
    p->k_row_bytes = kr;
    p->v_row_bytes = vr;
    p->type_k = 1; /* GGML_TYPE_F16 */
    p->type_v = 1;
    p->v_trans = vtrans;
    p->rope_freq_base = 10000.0f;
    p->rope_freq_scale = 1.0f;
}

static int run(const char *config, int vtrans) {
    mcb_bridge bridge = 0;
    EXPECT(mcb_bridge_open(config, &bridge), MCB_STATUS_OK);
    if (!bridge) return 1;

    uint32_t ek[N_LAYER], ev[N_LAYER], kr[N_LAYER], vr[N_LAYER];
    struct mcb_model_params params;
    model_params(&params, vtrans, N_LAYER, BLOCK, ek, ev, kr, vr);
    mcb_model model = 0;
    EXPECT(mcb_model_register(bridge, &params, &model), MCB_STATUS_OK);

    /* A prompt of 7 full blocks and 5 more tokens, in cells that wrap
     * around holes as llama.cpp's find_slot leaves them. */
    enum { N = 7 * BLOCK + 5 };
    int32_t tokens[N];
    uint32_t cells[N];
    for (int i = 0; i < N; i++) {
        tokens[i] = (int32_t)((i * 7919 + 13) % 32000);
        cells[i] = (uint32_t)((i < 40) ? 300 + i : i - 40);
    }
    struct host src, dst;
    host_init(&src, vtrans);
    host_init(&dst, vtrans);
    host_scribble(&src);
    host_compute(&src, tokens, cells, N);

    struct mcb_lookup_result lk;
    EXPECT(mcb_lookup(model, NULL, tokens, N, &lk), MCB_STATUS_OK);
    CHECK(lk.n_matched_blocks == 0 && lk.n_restore_tokens == 0 && lk.reason == MCB_REASON_NO_MATCH,
          "cold lookup matched %u blocks", lk.n_matched_blocks);

    /* Save layer by layer, as a host does when each layer's KV is final. */
    mcb_save save = 0;
    EXPECT(mcb_save_begin(model, NULL, &src.layout, tokens, N, cells, &save), MCB_STATUS_OK);
    for (uint32_t l = 0; l < N_LAYER; l++) EXPECT(mcb_save_layer(save, l), MCB_STATUS_OK);
    struct mcb_save_result sr;
    EXPECT(mcb_save_end(save, &sr), MCB_STATUS_OK);
    CHECK(sr.n_blocks == 7 && sr.n_published == 7, "saved %u/%u blocks", sr.n_published, sr.n_blocks);

    EXPECT(mcb_lookup(model, NULL, tokens, N, &lk), MCB_STATUS_OK);
    CHECK(lk.n_matched_blocks == 7 && lk.n_restore_tokens == 7 * BLOCK,
          "lookup: %u blocks, restore %u tokens (%s)", lk.n_matched_blocks, lk.n_restore_tokens,
          mcb_reason_str((mcb_reason)lk.reason));
    printf("lookup: %u of %u tokens cached, restore %u: %s (est %.3f ms vs recompute %.3f ms)\n",
           lk.n_matched_blocks * lk.n_block_tokens, N, lk.n_restore_tokens, mcb_reason_str((mcb_reason)lk.reason),
           lk.est_total_ms, lk.est_recompute_ms);

    /* Restore into empty tensors at other cells, layer by layer. */
    uint32_t dcells[N];
    for (int i = 0; i < N; i++) dcells[i] = (uint32_t)(N_CELLS - 1 - i);
    host_scribble(&dst);
    mcb_load load = 0;
    uint32_t n_restore = lk.n_restore_tokens;
    EXPECT(mcb_load_begin(model, NULL, &dst.layout, tokens, n_restore, dcells, &load), MCB_STATUS_OK);
    for (uint32_t l = 0; l < N_LAYER; l++) {
        uint32_t ok = 0;
        EXPECT(mcb_load_wait_layer(load, l, &ok), MCB_STATUS_OK);
        CHECK(ok == n_restore, "layer %u: %u tokens good", l, ok);
    }
    struct mcb_load_result lr;
    EXPECT(mcb_load_end(load, &lr), MCB_STATUS_OK);
    CHECK(lr.n_tokens_ok == n_restore && lr.first_error == MCB_STATUS_OK, "load: %u tokens", lr.n_tokens_ok);
    long bad = host_diff(&dst, tokens, dcells, N, (int)n_restore);
    CHECK(bad == 0, "%ld restored bytes differ", bad);
    printf("restored %u tokens (%" PRIu64 " bytes) into %s tensors: every byte checked\n", lr.n_tokens_ok,
           lr.n_bytes, vtrans ? "transposed-V" : "row-major");

    /* A second bridge (another pool, another transfer engine) finds the
     * blocks through the shared directory and reads them through the
     * transport: with a Mooncake config, purego calls into the TE library
     * from inside this C program. */
    {
        mcb_bridge peer = 0;
        mcb_model pm = 0;
        EXPECT(mcb_bridge_open(config, &peer), MCB_STATUS_OK);
        EXPECT(mcb_model_register(peer, &params, &pm), MCB_STATUS_OK);
        EXPECT(mcb_lookup(pm, NULL, tokens, N, &lk), MCB_STATUS_OK);
        CHECK(lk.n_restore_tokens == 7 * BLOCK, "peer lookup: restore %u tokens", lk.n_restore_tokens);
        host_scribble(&dst);
        EXPECT(mcb_load_begin(pm, NULL, &dst.layout, tokens, 7 * BLOCK, dcells, &load), MCB_STATUS_OK);
        EXPECT(mcb_load_end(load, &lr), MCB_STATUS_OK);
        bad = host_diff(&dst, tokens, dcells, N, 7 * BLOCK);
        CHECK(lr.n_tokens_ok == 7 * BLOCK && bad == 0, "peer restore: %u tokens, %ld bytes differ", lr.n_tokens_ok, bad);
        printf("a second bridge restored %u tokens through the transport\n", lr.n_tokens_ok);
        EXPECT(mcb_bridge_close(peer), MCB_STATUS_OK);
    }

    /* Misuse: each refused with its own status, nothing touched. */
    host_scribble(&dst);
    mcb_load bogus = 0;
    EXPECT(mcb_load_begin(12345, NULL, &dst.layout, tokens, BLOCK, NULL, &bogus), MCB_STATUS_BAD_HANDLE);
    EXPECT(mcb_load_begin(bridge, NULL, &dst.layout, tokens, BLOCK, NULL, &bogus), MCB_STATUS_BAD_HANDLE);
    EXPECT(mcb_load_begin(model, NULL, NULL, tokens, BLOCK, NULL, &bogus), MCB_STATUS_INVALID_ARG);
    EXPECT(mcb_load_begin(model, NULL, &dst.layout, NULL, BLOCK, NULL, &bogus), MCB_STATUS_INVALID_ARG);
    EXPECT(mcb_load_begin(model, NULL, &dst.layout, tokens, BLOCK, NULL, NULL), MCB_STATUS_INVALID_ARG);
    EXPECT(mcb_load_begin(model, NULL, &dst.layout, tokens, BLOCK - 3, NULL, &bogus), MCB_STATUS_INVALID_ARG);
    EXPECT(mcb_lookup(model, NULL, tokens, 0, &lk), MCB_STATUS_INVALID_ARG);
    EXPECT(mcb_lookup(model, NULL, tokens + 1, N - 1, NULL), MCB_STATUS_INVALID_ARG);
    EXPECT(mcb_load_wait_layer(777, 0, &n_restore), MCB_STATUS_BAD_HANDLE);
    EXPECT(mcb_load_end(load, &lr), MCB_STATUS_BAD_HANDLE); /* ended above */
    EXPECT(mcb_save_layer(0, 0), MCB_STATUS_BAD_HANDLE);
    {
        uint32_t far[BLOCK];
        for (int i = 0; i < BLOCK; i++) far[i] = N_CELLS + (uint32_t)i; /* beyond the tensors */
        EXPECT(mcb_load_begin(model, NULL, &dst.layout, tokens, BLOCK, far, &bogus), MCB_STATUS_LAYOUT);
        struct mcb_kv_layer thin[N_LAYER];
        memcpy(thin, dst.layers, sizeof thin);
        thin[2].k_stride = krow() - 1; /* rows that overlap */
        struct mcb_kv_layout lo = dst.layout;
        lo.layers = thin;
        EXPECT(mcb_load_begin(model, NULL, &lo, tokens, BLOCK, NULL, &bogus), MCB_STATUS_LAYOUT);
        lo = dst.layout;
        lo.n_layer = N_LAYER - 1; /* a layout for another model */
        EXPECT(mcb_load_begin(model, NULL, &lo, tokens, BLOCK, NULL, &bogus), MCB_STATUS_LAYOUT);
        lo = dst.layout;
        lo.location = "cuda:0"; /* device memory is not moved by this build */
        EXPECT(mcb_load_begin(model, NULL, &lo, tokens, BLOCK, NULL, &bogus), MCB_STATUS_UNSUPPORTED);
    }
    {
        /* Another model (one layer less) and another block size: their keys
         * differ, so they find nothing. */
        struct mcb_model_params other;
        model_params(&other, vtrans, N_LAYER - 1, BLOCK, ek, ev, kr, vr);
        mcb_model m2 = 0;
        EXPECT(mcb_model_register(bridge, &other, &m2), MCB_STATUS_OK);
        EXPECT(mcb_lookup(m2, NULL, tokens, N, &lk), MCB_STATUS_OK);
        CHECK(lk.n_matched_blocks == 0, "other model matched %u blocks", lk.n_matched_blocks);
        EXPECT(mcb_load_begin(m2, NULL, &dst.layout, tokens, BLOCK, NULL, &bogus), MCB_STATUS_LAYOUT);
        EXPECT(mcb_model_unregister(m2), MCB_STATUS_OK);
        EXPECT(mcb_model_unregister(m2), MCB_STATUS_BAD_HANDLE);

        model_params(&other, vtrans, N_LAYER, 2 * BLOCK, ek, ev, kr, vr);
        EXPECT(mcb_model_register(bridge, &other, &m2), MCB_STATUS_OK);
        EXPECT(mcb_lookup(m2, NULL, tokens, N, &lk), MCB_STATUS_OK);
        CHECK(lk.n_matched_blocks == 0, "other block size matched %u blocks", lk.n_matched_blocks);
        EXPECT(mcb_load_begin(m2, NULL, &dst.layout, tokens, BLOCK, NULL, &bogus), MCB_STATUS_INVALID_ARG);
        EXPECT(mcb_model_unregister(m2), MCB_STATUS_OK);

        struct mcb_scope tenant = {(const uint8_t *)"tenant-b", 8, NULL};
        EXPECT(mcb_lookup(model, &tenant, tokens, N, &lk), MCB_STATUS_OK);
        CHECK(lk.n_matched_blocks == 0, "another tenant matched %u blocks", lk.n_matched_blocks);
        EXPECT(mcb_load_begin(model, &tenant, &dst.layout, tokens, BLOCK, NULL, &bogus), MCB_STATUS_NOT_FOUND);

        model_params(&other, vtrans, N_LAYER, BLOCK, ek, ev, kr, vr);
        other.n_embd_k_gqa = NULL;
        EXPECT(mcb_model_register(bridge, &other, &m2), MCB_STATUS_INVALID_ARG);
        EXPECT(mcb_model_register(bridge, NULL, &m2), MCB_STATUS_INVALID_ARG);
    }
    CHECK(host_touched(&dst) == 0, "a refused load touched %ld bytes", host_touched(&dst));
    CHECK(strlen(mcb_status_str(MCB_STATUS_CORRUPT)) > 0 && strcmp(mcb_status_str((mcb_status)99), "unknown status") == 0,
          "status strings");

    /* Close with a save open is refused; after ending it, close works. */
    EXPECT(mcb_save_begin(model, NULL, &src.layout, tokens, N, cells, &save), MCB_STATUS_OK);
    EXPECT(mcb_bridge_close(bridge), MCB_STATUS_STATE);
    for (uint32_t l = 0; l < N_LAYER; l++) EXPECT(mcb_save_layer(save, l), MCB_STATUS_OK);
    EXPECT(mcb_save_layer(save, 0), MCB_STATUS_STATE);
    EXPECT(mcb_save_end(save, &sr), MCB_STATUS_OK);
    CHECK(sr.n_known == 7 && sr.n_written == 0, "second save wrote %u blocks", sr.n_written);

    struct mcb_stats st;
    EXPECT(mcb_bridge_stats(bridge, &st), MCB_STATUS_OK);
    CHECK(st.restored_tokens == 7 * BLOCK && st.saved_blocks == 7 && st.resident_blocks == 7,
          "stats: restored %" PRIu64 " saved %" PRIu64 " resident %" PRIu64, st.restored_tokens, st.saved_blocks,
          st.resident_blocks);

    EXPECT(mcb_bridge_close(bridge), MCB_STATUS_OK);
    EXPECT(mcb_bridge_close(bridge), MCB_STATUS_BAD_HANDLE);
    EXPECT(mcb_lookup(model, NULL, tokens, N, &lk), MCB_STATUS_BAD_HANDLE);
    CHECK(mcb_handles_open() == 0, "%zu handles left open", mcb_handles_open());

    host_free(&src);
    host_free(&dst);
    return failures;
}

int main(int argc, char **argv) {
    const char *config = NULL;
    int vtrans = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--vtrans") == 0) {
            vtrans = 1;
        } else if (strcmp(argv[i], "--config") == 0 && i + 1 < argc) {
            config = argv[++i];
        } else {
            fprintf(stderr, "usage: %s [--vtrans] [--config JSON]\n", argv[0]);
            return 2;
        }
    }
    CHECK(mcb_abi_version() == MCB_ABI_VERSION, "ABI version %u", mcb_abi_version());
    int rc = run(config, vtrans);
    if (rc) {
        fprintf(stderr, "harness: %d checks failed\n", rc);
        return 1;
    }
    printf("harness: all checks passed (%s)\n", vtrans ? "V transposed" : "V row-major");
    return 0;
}
