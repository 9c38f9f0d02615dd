/*
 * A C host that behaves like llama.cpp towards libmcbridge: it owns per-layer
 * K and V tensors, "computes" a prompt by filling them with deterministic
 * bytes, registers its model with the KV of the probe prompt, saves the
 * prompt's blocks, and restores the plan a lookup gives into a second,
 * empty set of tensors, checking every byte of them. A second bridge
 * restores the same blocks once the publisher has shown them to it, and a
 * state host (llama_state_seq_get_data blobs) shares them with the tensor
 * host. Then it shows misuse being refused, each with its own status,
 * leaving the tensors untouched, and leaks no handle.
 *
 * Usage: harness --model GGUF [--vtrans] [--config JSON]
 * Exit status 0 when every check passes.
 */
#define _POSIX_C_SOURCE 200809L

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mcbridge.h"

#define N_LAYER 4
#define N_CELLS 512
#define BLOCK 16
#define N_EMBD_K 64 /* f16 elements per token row */
#define N_EMBD_V 64
#define ELEM 2
#define TYPE_F16 1 /* GGML_TYPE_F16 */
#define SCRIBBLE 0xee
#define PROBE_CELL 400     /* where the probe prompt's KV sits */
#define PUBLISH_WAIT_MS 10000 /* bound on waiting for the publisher */

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

static void *xmalloc(size_t n) {
    void *p = malloc(n);
    if (!p) {
        perror("malloc");
        exit(2);
    }
    return p;
}

static void host_init(struct host *h, int vtrans) {
    memset(h, 0, sizeof *h);
    h->vtrans = vtrans;
    for (int l = 0; l < N_LAYER; l++) {
        h->k[l] = xmalloc(N_CELLS * krow());
        h->v[l] = xmalloc(N_CELLS * vrow());
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

/* Counts the bytes of the tensors that differ from what they must hold
 * after a restore of positions [0, good) into cells: those positions' rows
 * their values, every other byte of every tensor the scribble it had. */
static long host_check(struct host *h, const int32_t *tokens, const uint32_t *cells, int good) {
    static int pos_of[N_CELLS];
    for (int c = 0; c < N_CELLS; c++) pos_of[c] = -1;
    for (int p = 0; p < good; p++) pos_of[cells[p]] = p;
    long bad = 0;
    for (int l = 0; l < N_LAYER; l++)
        for (uint32_t c = 0; c < N_CELLS; c++) {
            int p = pos_of[c];
            for (size_t i = 0; i < krow(); i++)
                bad += h->k[l][c * krow() + i] != (p >= 0 ? value(tokens[p], p, l, 0, i) : SCRIBBLE);
            for (size_t i = 0; i < vrow(); i++)
                bad += *v_at(h, l, c, i) != (p >= 0 ? value(tokens[p], p, l, 1, i) : SCRIBBLE);
        }
    return bad;
}

/* The model's KV shape: every layer alike. */
struct shape {
    uint32_t ek[N_LAYER], ev[N_LAYER], kr[N_LAYER], vr[N_LAYER];
};

static void kv_format(struct mcb_kv_format *f, struct shape *s, int vtrans, uint32_t n_layer) {
    for (uint32_t l = 0; l < N_LAYER; l++) {
        s->ek[l] = N_EMBD_K;
        s->ev[l] = N_EMBD_V;
        s->kr[l] = (uint32_t)krow();
        s->vr[l] = (uint32_t)vrow();
    }
    memset(f, 0, sizeof *f);
    f->n_layer = n_layer;
    f->n_embd_k_gqa = s->ek;
    f->n_embd_v_gqa = s->ev;
    f->k_row_bytes = s->kr;
    f->v_row_bytes = s->vr;
    f->type_k = TYPE_F16;
    f->type_v = TYPE_F16;
    f->v_trans = vtrans;
}

static void model_params(struct mcb_model_params *p, const char *gguf, uint32_t block) {
    memset(p, 0, sizeof *p);
    p->llama_version = mcb_llama_version();
    p->gguf_path = gguf;
    p->block_tokens = block;
}

/* The probe prompt, decoded into cells PROBE_CELL.. of a host's tensors. */
static int32_t probe[64];
static uint32_t probe_cells[64];
static int n_probe;

static void host_probe(struct host *h) {
    host_compute(h, probe, probe_cells, n_probe);
}

/* Writes the llama_state_seq_get_data blob of sequence 0 holding
 * positions [0, n) of tokens in cells 0..n-1 (llama.cpp v0.5.0's format:
 * llama-patches/README.md), as this host's tensors would hold them.
 * Returns its size; out may be NULL to ask for it. */
static size_t state_blob(uint8_t *out, const int32_t *tokens, int n, int vtrans) {
    size_t off = 0;
#define PUT(v, type)                                         \
    do {                                                     \
        type x_ = (type)(v);                                 \
        if (out) memcpy(out + off, &x_, sizeof x_);          \
        off += sizeof x_;                                    \
    } while (0)
    PUT(0xaf143cd8u, uint32_t); /* magic */
    PUT(0, int32_t);            /* the source sequence */
    PUT(1, uint32_t);           /* streams */
    PUT(n, uint32_t);
    for (int p = 0; p < n; p++) {
        PUT(p, int32_t);  /* position */
        PUT(1, uint32_t); /* one sequence */
        PUT(0, int32_t);
    }
    PUT(vtrans, uint32_t);
    PUT(N_LAYER, uint32_t);
    for (int l = 0; l < N_LAYER; l++) {
        PUT(TYPE_F16, int32_t);
        PUT(krow(), uint64_t);
        for (int p = 0; p < n; p++)
            for (size_t i = 0; i < krow(); i++) PUT(value(tokens[p], p, l, 0, i), uint8_t);
    }
    for (int l = 0; l < N_LAYER; l++) {
        PUT(TYPE_F16, int32_t);
        if (!vtrans) {
            PUT(vrow(), uint64_t);
            for (int p = 0; p < n; p++)
                for (size_t i = 0; i < vrow(); i++) PUT(value(tokens[p], p, l, 1, i), uint8_t);
            continue;
        }
        PUT(ELEM, uint32_t);
        PUT(N_EMBD_V, uint32_t);
        for (size_t d = 0; d < N_EMBD_V; d++)
            for (int p = 0; p < n; p++)
                for (size_t b = 0; b < ELEM; b++) PUT(value(tokens[p], p, l, 1, d * ELEM + b), uint8_t);
    }
#undef PUT
    return off;
}

static uint8_t *new_state_blob(const int32_t *tokens, int n, int vtrans, size_t *size) {
    *size = state_blob(NULL, tokens, n, vtrans);
    uint8_t *b = xmalloc(*size);
    state_blob(b, tokens, n, vtrans);
    return b;
}

static long elapsed_ms(const struct timespec *since) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - since->tv_sec) * 1000 + (now.tv_nsec - since->tv_nsec) / 1000000;
}

static void nap(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

/* Looks tokens up until at least blocks of them match, for a bridge that
 * learns of another's blocks when the publisher has shown them, dropping
 * the plans that fall short. The last lookup's plan is the caller's. */
static int await_match(mcb_model model, const struct mcb_scope *scope, const int32_t *tokens, size_t n, uint32_t blocks,
                       struct mcb_lookup_result *lk) {
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (long wait = 1;; wait = wait < 50 ? 2 * wait : 50) {
        if (mcb_lookup(model, scope, tokens, n, 0, lk) != MCB_STATUS_OK) return 0;
        if (lk->n_matched_blocks >= blocks) return 1;
        if (lk->plan) mcb_plan_drop(lk->plan);
        lk->plan = 0;
        if (elapsed_ms(&start) > PUBLISH_WAIT_MS) return 0;
        nap(wait);
    }
}

/* Waits until the bridge's publisher has settled n blocks with the
 * directory: the counters say so, and its own lookups stay steady. */
static int await_published(mcb_bridge bridge, uint64_t n) {
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (long wait = 1;; wait = wait < 50 ? 2 * wait : 50) {
        struct mcb_stats st;
        if (mcb_bridge_stats(bridge, &st) != MCB_STATUS_OK) return 0;
        if (st.saved_blocks + st.deduped_blocks >= n) return 1;
        if (elapsed_ms(&start) > PUBLISH_WAIT_MS) return 0;
        nap(wait);
    }
}

/* Restores a plan into h layer by layer and checks every byte of h. */
static void load_plan(mcb_plan plan, struct host *h, const int32_t *tokens, const uint32_t *cells, uint32_t n,
                      struct mcb_load_result *lr) {
    mcb_load load = 0;
    memset(lr, 0, sizeof *lr);
    EXPECT(mcb_load_begin(plan, &h->layout, cells, &load), MCB_STATUS_OK);
    if (!load) return;
    for (uint32_t l = 0; l < N_LAYER; l++) {
        uint32_t ok = 0;
        EXPECT(mcb_load_wait_layer(load, l, &ok), MCB_STATUS_OK);
        CHECK(ok == n, "layer %u: %u tokens good of %u", l, ok, n);
    }
    EXPECT(mcb_load_end(load, lr), MCB_STATUS_OK);
    CHECK(lr->n_tokens_ok == n && lr->first_error == MCB_STATUS_OK && lr->n_bytes == (uint64_t)n * N_LAYER * (krow() + vrow()),
          "load: %u tokens, %" PRIu64 " bytes", lr->n_tokens_ok, lr->n_bytes);
    long bad = host_check(h, tokens, cells, (int)lr->n_tokens_ok);
    CHECK(bad == 0, "%ld bytes of the tensors differ from the restore's", bad);
}

/* A lookup's plan for tokens, which the caller loads or drops. */
static mcb_plan fresh_plan(mcb_model model, const int32_t *tokens, size_t n) {
    struct mcb_lookup_result lk;
    EXPECT(mcb_lookup(model, NULL, tokens, n, 0, &lk), MCB_STATUS_OK);
    CHECK(lk.plan != 0, "no plan for %zu cached tokens", n);
    return lk.plan;
}

static void check_metrics(mcb_bridge bridge) {
    size_t n = mcb_metrics_text(bridge, NULL, NULL, 0);
    char *text = xmalloc(n + 1);
    CHECK(mcb_metrics_text(bridge, NULL, text, n + 1) == n && text[n] == 0 && strlen(text) == n, "metrics of %zu bytes", n);
    CHECK(strstr(text, "\nmcbridge_up 1\n") != NULL, "an open bridge is up");
    CHECK(strstr(text, "\nmcbridge_saves_total 3\n") != NULL && strstr(text, "\nmcbridge_decided_local_total 1\n") != NULL,
          "the counters");
    char small[16];
    memset(small, 'Z', sizeof small);
    CHECK(mcb_metrics_text(bridge, NULL, small, 8) == n && small[7] == 0 && strncmp(small, text, 7) == 0 && small[8] == 'Z',
          "metrics truncated to 8 bytes");
    free(text);

    n = mcb_metrics_text(0, "draft model", NULL, 0);
    text = xmalloc(n + 1);
    mcb_metrics_text(0, "draft model", text, n + 1);
    CHECK(strstr(text, "mcbridge_up{reason=\"") && strstr(text, "draft model\"} 0\n"), "a host's bridge that is off");
    free(text);
}

static int run(const char *config, const char *gguf, const char *other_file, int vtrans) {
    mcb_bridge bridge = 0;
    EXPECT(mcb_bridge_open(config, &bridge), MCB_STATUS_OK);
    if (!bridge) return 1;

    n_probe = (int)mcb_probe_tokens(probe, sizeof probe / sizeof probe[0]);
    CHECK(n_probe > 0 && n_probe <= 64, "%d probe tokens", n_probe);
    for (int i = 0; i < n_probe; i++) probe_cells[i] = PROBE_CELL + (uint32_t)i;

    struct shape shape;
    struct mcb_kv_format format;
    kv_format(&format, &shape, vtrans, N_LAYER);
    struct mcb_model_params params;
    model_params(&params, gguf, BLOCK);

    /* A prompt of 7 full blocks and 5 more tokens, in cells that wrap
     * around holes as llama.cpp's find_slot leaves them. */
    enum { N = 7 * BLOCK + 5, R = 7 * BLOCK };
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
    host_probe(&src); /* the host decodes the probe into an empty sequence first */
    mcb_model model = 0;
    EXPECT(mcb_model_register(bridge, &params, &format, &src.layout, probe_cells, &model), MCB_STATUS_OK);
    host_compute(&src, tokens, cells, N);

    struct mcb_lookup_result lk;
    EXPECT(mcb_lookup(model, NULL, tokens, N, 0, &lk), MCB_STATUS_OK);
    CHECK(lk.n_matched_blocks == 0 && lk.n_restore_tokens == 0 && lk.reason == MCB_REASON_NO_MATCH && lk.plan == 0,
          "cold lookup matched %u blocks", lk.n_matched_blocks);

    /* Save layer by layer, as a host does when each layer's KV is final. */
    mcb_save save = 0;
    EXPECT(mcb_save_begin(model, NULL, &src.layout, tokens, N, cells, &save), MCB_STATUS_OK);
    for (uint32_t l = 0; l < N_LAYER; l++) EXPECT(mcb_save_layer(save, l), MCB_STATUS_OK);
    struct mcb_save_result sr;
    EXPECT(mcb_save_end(save, &sr), MCB_STATUS_OK);
    CHECK(sr.n_blocks == 7 && sr.n_written == 7 && sr.n_queued == 7 && sr.n_known == 0, "saved %u/%u blocks, %u queued", sr.n_written,
          sr.n_blocks, sr.n_queued);
    CHECK(await_published(bridge, 7), "the publisher did not settle the 7 blocks");

    EXPECT(mcb_lookup(model, NULL, tokens, N, 0, &lk), MCB_STATUS_OK);
    CHECK(lk.n_matched_blocks == 7 && lk.n_restore_tokens == R && lk.plan != 0, "lookup: %u blocks, restore %u tokens (%s)",
          lk.n_matched_blocks, lk.n_restore_tokens, mcb_reason_str((mcb_reason)lk.reason));
    printf("lookup: %u of %u tokens cached, restore %u: %s (est %.3f ms vs recompute %.3f ms)\n",
           lk.n_matched_blocks * lk.n_block_tokens, N, lk.n_restore_tokens, mcb_reason_str((mcb_reason)lk.reason),
           lk.est_total_ms, lk.est_recompute_ms);

    /* Restore into empty tensors at other cells, layer by layer. */
    uint32_t dcells[N];
    for (int i = 0; i < N; i++) dcells[i] = (uint32_t)(N_CELLS - 1 - i);
    host_scribble(&dst);
    struct mcb_load_result lr;
    load_plan(lk.plan, &dst, tokens, dcells, R, &lr);
    printf("restored %u tokens (%" PRIu64 " bytes) into %s tensors: every byte checked\n", lr.n_tokens_ok, lr.n_bytes,
           vtrans ? "transposed-V" : "row-major");

    /* Holding the restored prefix, the host computes on: no plan. */
    EXPECT(mcb_lookup(model, NULL, tokens, N, R, &lk), MCB_STATUS_OK);
    CHECK(lk.n_matched_blocks == 7 && lk.n_restore_tokens == 0 && lk.plan == 0 && lk.reason == MCB_REASON_LOCAL,
          "lookup holding the prefix: restore %u (%s)", lk.n_restore_tokens, mcb_reason_str((mcb_reason)lk.reason));

    /* A second bridge (another pool, another transfer engine) finds the
     * blocks through the shared directory once the publisher has shown
     * them to it, and reads them through the transport: with a Mooncake
     * config, purego calls into the TE library from inside this C
     * program. */
    {
        mcb_bridge peer = 0;
        mcb_model pm = 0;
        struct host probe_host;
        host_init(&probe_host, vtrans);
        host_scribble(&probe_host);
        host_probe(&probe_host);
        EXPECT(mcb_bridge_open(config, &peer), MCB_STATUS_OK);
        EXPECT(mcb_model_register(peer, &params, &format, &probe_host.layout, probe_cells, &pm), MCB_STATUS_OK);
        host_free(&probe_host);
        CHECK(await_match(pm, NULL, tokens, N, 7, &lk), "the peer never saw the 7 blocks (%u)", lk.n_matched_blocks);
        CHECK(lk.n_restore_tokens == R, "peer lookup: restore %u tokens", lk.n_restore_tokens);
        host_scribble(&dst);
        if (lk.plan) load_plan(lk.plan, &dst, tokens, dcells, R, &lr);
        printf("a second bridge restored %u tokens through the transport\n", lr.n_tokens_ok);
        EXPECT(mcb_bridge_close(peer), MCB_STATUS_OK);
    }

    /* A state host of the same model, registered from a state of the
     * probe, shares the tensor host's blocks: restored into a state they
     * are byte for byte the state llama.cpp writes for the prefix. */
    {
        size_t probe_size, want_size;
        uint8_t *probe_state = new_state_blob(probe, n_probe, vtrans, &probe_size);
        uint8_t *want = new_state_blob(tokens, R, vtrans, &want_size);
        mcb_model sm = 0;
        EXPECT(mcb_model_register_state(bridge, &params, probe_state, probe_size, &sm), MCB_STATUS_OK);
        EXPECT(mcb_lookup(sm, NULL, tokens, N, 0, &lk), MCB_STATUS_OK);
        CHECK(lk.n_restore_tokens == R, "state host lookup: restore %u tokens", lk.n_restore_tokens);
        uint8_t *state = NULL;
        size_t n_state = 0;
        EXPECT(mcb_state_restore(lk.plan, &state, &n_state, &lr), MCB_STATUS_OK);
        CHECK(state && n_state == want_size && memcmp(state, want, want_size) == 0 && lr.n_tokens_ok == R,
              "the restored state: %zu bytes of %zu, %u tokens", n_state, want_size, lr.n_tokens_ok);
        mcb_state_free(state);
        mcb_state_free(NULL);
        EXPECT(mcb_state_restore(lk.plan, &state, &n_state, &lr), MCB_STATUS_BAD_HANDLE); /* consumed */

        /* Its own save of another prompt restores into the tensors. */
        int32_t other[2 * BLOCK];
        uint32_t ocells[2 * BLOCK];
        for (int i = 0; i < 2 * BLOCK; i++) {
            other[i] = (int32_t)((i * 104729 + 7) % 32000);
            ocells[i] = 100 + (uint32_t)i;
        }
        size_t other_size;
        uint8_t *other_state = new_state_blob(other, 2 * BLOCK, vtrans, &other_size);
        EXPECT(mcb_state_save(sm, NULL, other_state, other_size, other, 2 * BLOCK, &sr), MCB_STATUS_OK);
        CHECK(sr.n_blocks == 2 && sr.n_written == 2, "state save: %u of %u blocks", sr.n_written, sr.n_blocks);
        CHECK(await_published(bridge, 9), "the publisher did not settle the state's blocks");
        EXPECT(mcb_lookup(model, NULL, other, 2 * BLOCK, 0, &lk), MCB_STATUS_OK);
        CHECK(lk.n_restore_tokens == BLOCK, "tensor host lookup of the state's blocks: restore %u", lk.n_restore_tokens);
        host_scribble(&dst);
        if (lk.plan) load_plan(lk.plan, &dst, other, ocells, BLOCK, &lr);
        EXPECT(mcb_state_save(sm, NULL, other_state, other_size - 1, other, 2 * BLOCK, &sr), MCB_STATUS_INVALID_ARG);
        EXPECT(mcb_state_save(model, NULL, NULL, other_size, other, 2 * BLOCK, &sr), MCB_STATUS_INVALID_ARG);
        EXPECT(mcb_model_register_state(bridge, &params, probe_state, probe_size / 2, &sm), MCB_STATUS_INVALID_ARG);
        {
            /* Three caches' streams after one header: a memory the library
             * does not serve, not a malformed blob. (Two KV caches, as an MLA
             * cache and its indexer's write them, are served.) */
            const size_t n3 = 3 * probe_size - 16;
            uint8_t *three = xmalloc(n3);
            memcpy(three, probe_state, probe_size);
            memcpy(three + probe_size, probe_state + 8, probe_size - 8);
            memcpy(three + 2 * probe_size - 8, probe_state + 8, probe_size - 8);
            mcb_model none = 0;
            EXPECT(mcb_model_register_state(bridge, &params, three, n3, &none), MCB_STATUS_UNSUPPORTED);
            CHECK(none == 0 && strstr(mcb_last_error(), "bytes after the last stream") != NULL,
                  "a state of three caches: model %llu, %s", (unsigned long long)none, mcb_last_error());
            free(three);
        }
        EXPECT(mcb_model_unregister(sm), MCB_STATUS_OK);
        free(other_state);
        free(probe_state);
        free(want);
        printf("a state host shared the blocks: state restored byte for byte\n");
    }

    /* Misuse: each refused with its own status, nothing touched. */
    host_scribble(&dst);
    mcb_load bogus = 0;
    EXPECT(mcb_load_begin(12345, &dst.layout, NULL, &bogus), MCB_STATUS_BAD_HANDLE);
    EXPECT(mcb_load_begin(bridge, &dst.layout, NULL, &bogus), MCB_STATUS_BAD_HANDLE);
    EXPECT(mcb_load_begin(model, &dst.layout, NULL, &bogus), MCB_STATUS_BAD_HANDLE);
    {
        /* A refused load consumes its plan. */
        mcb_plan plan = fresh_plan(model, tokens, N);
        EXPECT(mcb_load_begin(plan, NULL, NULL, &bogus), MCB_STATUS_INVALID_ARG);
        EXPECT(mcb_plan_drop(plan), MCB_STATUS_BAD_HANDLE);
        EXPECT(mcb_load_begin(fresh_plan(model, tokens, N), &dst.layout, NULL, NULL), MCB_STATUS_INVALID_ARG);
        uint32_t far[R];
        for (int i = 0; i < R; i++) far[i] = dcells[i];
        far[R - 1] = N_CELLS; /* beyond the tensors */
        EXPECT(mcb_load_begin(fresh_plan(model, tokens, N), &dst.layout, far, &bogus), MCB_STATUS_LAYOUT);
        struct mcb_kv_layer thin[N_LAYER];
        memcpy(thin, dst.layers, sizeof thin);
        thin[2].k_stride = krow() - 1; /* rows that overlap */
        struct mcb_kv_layout lo = dst.layout;
        lo.layers = thin;
        EXPECT(mcb_load_begin(fresh_plan(model, tokens, N), &lo, dcells, &bogus), MCB_STATUS_LAYOUT);
        lo = dst.layout;
        lo.n_layer = N_LAYER - 1; /* a layout for another model */
        EXPECT(mcb_load_begin(fresh_plan(model, tokens, N), &lo, dcells, &bogus), MCB_STATUS_LAYOUT);
        lo = dst.layout;
        lo.location = "cuda:0"; /* device memory is not moved by this build */
        EXPECT(mcb_load_begin(fresh_plan(model, tokens, N), &lo, dcells, &bogus), MCB_STATUS_UNSUPPORTED);
        uint8_t *state = NULL;
        size_t n_state = 0;
        EXPECT(mcb_state_restore(fresh_plan(model, tokens, N), &state, &n_state, &lr), MCB_STATUS_UNSUPPORTED);
        CHECK(state == NULL && n_state == 0, "a refused state restore set its blob");
        plan = fresh_plan(model, tokens, N);
        EXPECT(mcb_plan_drop(plan), MCB_STATUS_OK);
        EXPECT(mcb_plan_drop(plan), MCB_STATUS_BAD_HANDLE);
        EXPECT(mcb_plan_drop(model), MCB_STATUS_BAD_HANDLE);
        EXPECT(mcb_plan_drop(0), MCB_STATUS_BAD_HANDLE);
    }
    /* What the host measures feeds the cost model; nonsense is refused. */
    EXPECT(mcb_model_observe_prefill(model, R, N, 0.1), MCB_STATUS_OK);
    EXPECT(mcb_model_observe_prefill(model, N, R, 0.1), MCB_STATUS_INVALID_ARG);
    EXPECT(mcb_model_observe_prefill(model, 0, N, 0.0), MCB_STATUS_INVALID_ARG);
    EXPECT(mcb_model_observe_prefill(bridge, 0, N, 0.1), MCB_STATUS_BAD_HANDLE);
    EXPECT(mcb_lookup(model, NULL, tokens, 0, 0, &lk), MCB_STATUS_INVALID_ARG);
    EXPECT(mcb_lookup(model, NULL, tokens + 1, N - 1, 0, NULL), MCB_STATUS_INVALID_ARG);
    EXPECT(mcb_lookup(model, NULL, tokens, N, N + 1, &lk), MCB_STATUS_INVALID_ARG);
    uint32_t n_ok = 0;
    EXPECT(mcb_load_wait_layer(777, 0, &n_ok), MCB_STATUS_BAD_HANDLE);
    EXPECT(mcb_save_layer(0, 0), MCB_STATUS_BAD_HANDLE);
    {
        /* Another model (one layer less) and another block size: their keys
         * differ, so they find nothing. */
        struct mcb_kv_format fewer = format;
        fewer.n_layer = N_LAYER - 1;
        struct mcb_kv_layout probe_lo = src.layout;
        probe_lo.n_layer = N_LAYER - 1;
        mcb_model m2 = 0;
        EXPECT(mcb_model_register(bridge, &params, &fewer, &probe_lo, probe_cells, &m2), MCB_STATUS_OK);
        EXPECT(mcb_lookup(m2, NULL, tokens, N, 0, &lk), MCB_STATUS_OK);
        CHECK(lk.n_matched_blocks == 0 && lk.plan == 0, "other model matched %u blocks", lk.n_matched_blocks);
        EXPECT(mcb_model_unregister(m2), MCB_STATUS_OK);
        EXPECT(mcb_model_unregister(m2), MCB_STATUS_BAD_HANDLE);

        struct mcb_model_params other = params;
        other.block_tokens = 2 * BLOCK;
        EXPECT(mcb_model_register(bridge, &other, &format, &src.layout, probe_cells, &m2), MCB_STATUS_OK);
        EXPECT(mcb_lookup(m2, NULL, tokens, N, 0, &lk), MCB_STATUS_OK);
        CHECK(lk.n_matched_blocks == 0, "other block size matched %u blocks", lk.n_matched_blocks);
        EXPECT(mcb_model_unregister(m2), MCB_STATUS_OK);

        /* Other probe KV is another model too. */
        uint8_t keep = src.k[1][probe_cells[2] * krow() + 5];
        src.k[1][probe_cells[2] * krow() + 5] ^= 1;
        EXPECT(mcb_model_register(bridge, &params, &format, &src.layout, probe_cells, &m2), MCB_STATUS_OK);
        src.k[1][probe_cells[2] * krow() + 5] = keep;
        EXPECT(mcb_lookup(m2, NULL, tokens, N, 0, &lk), MCB_STATUS_OK);
        CHECK(lk.n_matched_blocks == 0, "a model of other probe KV matched %u blocks", lk.n_matched_blocks);
        EXPECT(mcb_model_unregister(m2), MCB_STATUS_OK);

        /* Scopes: a tenant, an adapter, the adapter at scale 0. */
        struct mcb_scope tenant = {(const uint8_t *)"tenant-b", 8, NULL, 0};
        EXPECT(mcb_lookup(model, &tenant, tokens, N, 0, &lk), MCB_STATUS_OK);
        CHECK(lk.n_matched_blocks == 0, "another tenant matched %u blocks", lk.n_matched_blocks);
        struct mcb_adapter lora[2] = {{gguf, 0.5f}, {other_file, 1.0f}};
        struct mcb_scope with_lora = {NULL, 0, lora, 1};
        EXPECT(mcb_lookup(model, &with_lora, tokens, N, 0, &lk), MCB_STATUS_OK);
        CHECK(lk.n_matched_blocks == 0, "an adapter's scope matched %u blocks", lk.n_matched_blocks);
        lora[0].scale = 0.0f;
        EXPECT(mcb_lookup(model, &with_lora, tokens, N, 0, &lk), MCB_STATUS_OK);
        CHECK(lk.n_matched_blocks == 7, "an adapter at scale 0 is none: matched %u blocks", lk.n_matched_blocks);
        if (lk.plan) EXPECT(mcb_plan_drop(lk.plan), MCB_STATUS_OK);

        /* Scope ids: adapters in any order name the same scope. */
        uint8_t id1[16], id2[16], id3[16];
        struct mcb_adapter ab[2] = {{gguf, 0.5f}, {other_file, 1.0f}}, ba[2] = {{other_file, 1.0f}, {gguf, 0.5f}};
        struct mcb_scope s_ab = {(const uint8_t *)"t", 1, ab, 2}, s_ba = {(const uint8_t *)"t", 1, ba, 2};
        struct mcb_scope s_u = {(const uint8_t *)"u", 1, ab, 2};
        EXPECT(mcb_scope_id(&s_ab, id1), MCB_STATUS_OK);
        EXPECT(mcb_scope_id(&s_ba, id2), MCB_STATUS_OK);
        EXPECT(mcb_scope_id(&s_u, id3), MCB_STATUS_OK);
        CHECK(memcmp(id1, id2, 16) == 0 && memcmp(id1, id3, 16) != 0, "scope ids");
        struct mcb_adapter missing = {"/nonexistent/lora.gguf", 1.0f};
        struct mcb_scope s_missing = {NULL, 0, &missing, 1};
        EXPECT(mcb_scope_id(&s_missing, id3), MCB_STATUS_INVALID_ARG);
        EXPECT(mcb_lookup(model, &s_missing, tokens, N, 0, &lk), MCB_STATUS_INVALID_ARG);

        /* Registrations the library refuses. */
        fewer = format;
        fewer.n_embd_k_gqa = NULL;
        EXPECT(mcb_model_register(bridge, &params, &fewer, &src.layout, probe_cells, &m2), MCB_STATUS_INVALID_ARG);
        EXPECT(mcb_model_register(bridge, NULL, &format, &src.layout, probe_cells, &m2), MCB_STATUS_INVALID_ARG);
        EXPECT(mcb_model_register(bridge, &params, &format, &src.layout, NULL, &m2), MCB_STATUS_INVALID_ARG);
        other = params;
        other.llama_version = "b6000";
        EXPECT(mcb_model_register(bridge, &other, &format, &src.layout, probe_cells, &m2), MCB_STATUS_MODEL_MISMATCH);
        other = params;
        other.gguf_path = "/nonexistent/model.gguf";
        EXPECT(mcb_model_register(bridge, &other, &format, &src.layout, probe_cells, &m2), MCB_STATUS_INVALID_ARG);
        other.gguf_path = other_file; /* not a GGUF */
        EXPECT(mcb_model_register(bridge, &other, &format, &src.layout, probe_cells, &m2), MCB_STATUS_INVALID_ARG);
    }
    long touched = host_check(&dst, tokens, dcells, 0);
    CHECK(touched == 0, "a refused call touched %ld bytes", touched);
    CHECK(strlen(mcb_status_str(MCB_STATUS_CORRUPT)) > 0 && strcmp(mcb_status_str((mcb_status)99), "unknown status") == 0 &&
              strcmp(mcb_reason_str(MCB_REASON_LOCAL), "local") == 0,
          "status strings");

    /* Close with a save open is refused; after ending it, close works. */
    EXPECT(mcb_save_begin(model, NULL, &src.layout, tokens, N, cells, &save), MCB_STATUS_OK);
    EXPECT(mcb_bridge_close(bridge), MCB_STATUS_STATE);
    for (uint32_t l = 0; l < N_LAYER; l++) EXPECT(mcb_save_layer(save, l), MCB_STATUS_OK);
    EXPECT(mcb_save_layer(save, 0), MCB_STATUS_STATE);
    EXPECT(mcb_save_end(save, &sr), MCB_STATUS_OK);
    CHECK(sr.n_known == 7 && sr.n_written == 0 && sr.n_queued == 0, "second save wrote %u blocks", sr.n_written);

    struct mcb_stats st;
    EXPECT(mcb_bridge_stats(bridge, &st), MCB_STATUS_OK);
    CHECK(st.restored_tokens == 2 * R + BLOCK && st.saved_blocks == 9 && st.resident_blocks == 9 && st.decided_local == 1,
          "stats: restored %" PRIu64 " saved %" PRIu64 " resident %" PRIu64 " local %" PRIu64, st.restored_tokens, st.saved_blocks,
          st.resident_blocks, st.decided_local);
    check_metrics(bridge);

    /* Plans go with their bridge. */
    mcb_plan open_plan = fresh_plan(model, tokens, N);
    size_t handles = mcb_handles_open();
    EXPECT(mcb_bridge_close(bridge), MCB_STATUS_OK);
    CHECK(mcb_handles_open() + 3 == handles, "closing left %zu of %zu handles", mcb_handles_open(), handles);
    EXPECT(mcb_plan_drop(open_plan), MCB_STATUS_BAD_HANDLE);
    EXPECT(mcb_bridge_close(bridge), MCB_STATUS_BAD_HANDLE);
    EXPECT(mcb_lookup(model, NULL, tokens, N, 0, &lk), MCB_STATUS_BAD_HANDLE);
    CHECK(mcb_handles_open() == 0, "%zu handles left open", mcb_handles_open());

    host_free(&src);
    host_free(&dst);
    return failures;
}

int main(int argc, char **argv) {
    const char *config = NULL, *gguf = NULL;
    int vtrans = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--vtrans") == 0) {
            vtrans = 1;
        } else if (strcmp(argv[i], "--config") == 0 && i + 1 < argc) {
            config = argv[++i];
        } else if (strcmp(argv[i], "--model") == 0 && i + 1 < argc) {
            gguf = argv[++i];
        } else {
            gguf = NULL;
            break;
        }
    }
    if (!gguf) {
        fprintf(stderr, "usage: %s --model GGUF [--vtrans] [--config JSON]\n", argv[0]);
        return 2;
    }
    CHECK(mcb_abi_version() == MCB_ABI_VERSION, "ABI version %u", mcb_abi_version());
    /* Adapters are named by their bytes: this program's own file is one. */
    int rc = run(config, gguf, "/proc/self/exe", vtrans);
    if (rc) {
        fprintf(stderr, "harness: %d checks failed\n", rc);
        return 1;
    }
    printf("harness: all checks passed (%s)\n", vtrans ? "V transposed" : "V row-major");
    return 0;
}
