// libllama_test - libmcb_libllama against a real llama.cpp v0.5.0 context.
//
//   libllama_test MODEL OTHER_MODEL TE_MOCK    every in-process case (below); the
//                                              mock Transfer Engine injects faults
//   libllama_test xsave MODEL CONFIG READY     process A of the two-process case:
//                                              prefill, save, write the saved KV
//                                              to READY, serve the pool until
//                                              stdin closes
//   libllama_test xrestore MODEL CONFIG READY  process B: restore, compare the KV
//                                              with A's and the logits with a
//                                              full prefill's
//   libllama_test xoff MODEL                   a model whose state the library
//                                              does not serve: refused, the
//                                              context computing as before
//   libllama_test testdata MODEL DIR           writes the state blobs and slot
//                                              files of internal/llamastate/testdata
//
// MODEL is the tiny preset of internal/gguf; OTHER_MODEL the same with another
// seed. The two-process case and xoff also take test-llama-archs' models
// (vocabulary of 128). "Identical" always means memcmp-identical: logits of the token after
// a restored prefix must be the bits a context computing the prompt itself
// gets. Exit status 0 when every check passed.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kv_blob.hpp"
#include "mcb_libllama.h"

namespace {

int failures;
int checks;

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        checks++;                                                          \
        if (!(cond)) {                                                     \
            failures++;                                                    \
            std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);      \
            std::fprintf(stderr, __VA_ARGS__);                             \
            std::fprintf(stderr, " [libllama: %s] [bridge: %s]\n", mcb_libllama_last_error(), mcb_last_error()); \
        }                                                                  \
    } while (0)

#define EXPECT(call, want)                                                                                   \
    do {                                                                                                     \
        mcb_status got_ = (call);                                                                            \
        CHECK(got_ == (want), "%s = %s, want %s", #call, mcb_status_str(got_), mcb_status_str(want));        \
    } while (0)

constexpr uint32_t kBlock = 16;
constexpr int kPrompt = 100; // 6 blocks restorable, 4 tokens computed
constexpr int kFiller = 200; // leaves 56 of 256 cells

std::vector<llama_token> token_run(int n, int mul, int add) {
    std::vector<llama_token> t(n);
    for (int i = 0; i < n; i++) t[i] = (i * mul + add) % 256;
    return t;
}

const std::vector<llama_token> kTokens = token_run(kPrompt, 7, 3);
const std::vector<llama_token> kFillerTokens = token_run(240, 13, 5);

// kTokens in m's vocabulary: the same when it has 256 tokens or more (the
// tiny preset), else each modulo its size.
std::vector<llama_token> prompt_for(const llama_model *m) {
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(m));
    std::vector<llama_token> t = kTokens;
    if (n_vocab < 256)
        for (llama_token &x : t) x %= n_vocab;
    return t;
}

struct CtxOpts {
    uint32_t n_ctx = 512;
    bool fa = true;
    ggml_type type_k = GGML_TYPE_F16;
    uint32_t n_seq_max = 1;
    bool unified = true;
};

llama_context *new_ctx(llama_model *m, const CtxOpts &o) {
    llama_context_params p = llama_context_default_params();
    p.n_ctx = o.n_ctx;
    p.n_batch = 512;
    p.n_ubatch = 512;
    p.n_seq_max = o.n_seq_max;
    p.kv_unified = o.unified;
    p.n_threads = 2;
    p.n_threads_batch = 2;
    p.flash_attn_type = o.fa ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    p.type_k = o.type_k;
    p.type_v = GGML_TYPE_F16;
    p.no_perf = true;
    llama_context *ctx = llama_init_from_model(m, p);
    if (!ctx) {
        std::fprintf(stderr, "llama_init_from_model failed\n");
        std::exit(2);
    }
    return ctx;
}

// Decodes tokens[from, to) of seq at positions from..to-1 in one batch and
// returns the last token's logits.
std::vector<float> decode(llama_context *ctx, llama_seq_id seq, const std::vector<llama_token> &tokens, size_t from,
                          size_t to) {
    const int n = static_cast<int>(to - from);
    llama_batch b = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        b.token[i] = tokens[from + i];
        b.pos[i] = static_cast<llama_pos>(from + i);
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = seq;
        b.logits[i] = i == n - 1;
    }
    b.n_tokens = n;
    const int rc = llama_decode(ctx, b);
    llama_batch_free(b);
    if (rc != 0) {
        std::fprintf(stderr, "llama_decode = %d\n", rc);
        std::exit(2);
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
    const float *l = llama_get_logits_ith(ctx, -1);
    return std::vector<float>(l, l + n_vocab);
}

bool same_bits(const std::vector<float> &a, const std::vector<float> &b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

llama_pos pos_max(llama_context *ctx, llama_seq_id seq) { return llama_memory_seq_pos_max(llama_get_memory(ctx), seq); }

std::vector<uint8_t> state_blob(llama_context *ctx, llama_seq_id seq) {
    std::vector<uint8_t> blob(llama_state_seq_get_size_ext(ctx, seq, 0));
    const size_t got = llama_state_seq_get_data_ext(ctx, blob.data(), blob.size(), seq, 0);
    if (got != blob.size()) {
        std::fprintf(stderr, "llama_state_seq_get_data_ext: %zu of %zu bytes\n", got, blob.size());
        std::exit(2);
    }
    return blob;
}

// The KV bytes of positions [0, n) of seq, per layer K then V, in position
// order: comparable between contexts whatever cells and V strides they use.
std::vector<uint8_t> kv_by_position(llama_context *ctx, llama_seq_id seq, uint32_t n) {
    const auto rows = mcb_test::kv_by_pos(state_blob(ctx, seq));
    std::vector<uint8_t> out;
    for (uint32_t p = 0; p < n; p++) {
        auto it = rows.find(static_cast<llama_pos>(p));
        if (it == rows.end()) {
            std::fprintf(stderr, "kv_by_position: position %u is not in sequence %d\n", p, seq);
            return {};
        }
        out.insert(out.end(), it->second.begin(), it->second.end());
    }
    return out;
}

std::string bridge_config(const std::string &directory) {
    // Restore whenever cached (the tiny model's prefill is too cheap for the
    // cost model to pick restoring) and a small pool per bridge.
    return "{\"directory\":{\"name\":\"" + directory +
           "\"},\"arbiter\":{\"policy\":\"always-restore\"},\"pool_bytes\":16777216}";
}

mcb_bridge open_bridge(const std::string &config) {
    mcb_bridge b = 0;
    const mcb_status st = mcb_bridge_open(config.c_str(), &b);
    if (st != MCB_STATUS_OK) {
        std::fprintf(stderr, "mcb_bridge_open(%s): %s: %s\n", config.c_str(), mcb_status_str(st), mcb_last_error());
        std::exit(2);
    }
    return b;
}

// A context with its libllama handle, its model registered on a bridge.
struct Host {
    llama_context *ctx = nullptr;
    mcb_libllama *s = nullptr;
    const std::vector<llama_token> tokens; // the prompt (prompt_for)

    Host(llama_model *m, const char *gguf, const CtxOpts &o, mcb_bridge bridge) : tokens(prompt_for(m)) {
        ctx = new_ctx(m, o);
        const mcb_status st = mcb_libllama_open(ctx, bridge, gguf, kBlock, 0, &s);
        if (st != MCB_STATUS_OK) {
            std::fprintf(stderr, "host setup: %s: %s / %s\n", mcb_status_str(st), mcb_libllama_last_error(), mcb_last_error());
            std::exit(2);
        }
    }
    ~Host() {
        mcb_libllama_close(s);
        llama_free(ctx);
    }
    Host(const Host &) = delete;
    Host &operator=(const Host &) = delete;

    mcb_model model() const { return mcb_libllama_model(s); }

    // Blocks of the prompt the model's mirror shows. Publishing is the
    // bridge's own thread's: another bridge sees a save a moment later, so
    // this waits (bounded) for at least `want` of them.
    uint32_t matched(uint32_t want) const {
        mcb_lookup_result lk{};
        for (int i = 0; i < 200; i++) {
            lk = mcb_lookup_result{};
            if (mcb_lookup(model(), nullptr, tokens.data(), tokens.size(), 0, &lk) != MCB_STATUS_OK) return 0;
            mcb_plan_drop(lk.plan);
            if (lk.n_matched_blocks >= want) break;
            usleep(20 * 1000);
        }
        return lk.n_matched_blocks;
    }
};

// Logits of a context that computes the whole prompt itself: in one batch,
// or split at `split` as a restore of `split` tokens splits it.
std::vector<float> reference(llama_model *m, const CtxOpts &o, llama_seq_id seq, size_t split = 0) {
    const std::vector<llama_token> tokens = prompt_for(m);
    llama_context *ctx = new_ctx(m, o);
    if (split) decode(ctx, seq, tokens, 0, split);
    std::vector<float> l = decode(ctx, seq, tokens, split, tokens.size());
    llama_free(ctx);
    return l;
}

// Fills seq 0 of a unified 256-cell context so that the prompt's cells are
// out of position order: the filler (seq 1) takes the first 200 free cells,
// the first 40 prompt tokens the next ones, and once the filler is gone the
// other 60 go into the lowest free cells, before the first 40.
void prefill_scattered(llama_context *ctx) {
    decode(ctx, 1, kFillerTokens, 0, kFiller);
    decode(ctx, 0, kTokens, 0, 40);
    llama_memory_seq_rm(llama_get_memory(ctx), 1, -1, -1);
    decode(ctx, 0, kTokens, 40, kTokens.size());
}

// Save in one context, restore into another of another shape. The restored
// KV must be the saved KV byte for byte; when the saver computed the prompt
// as a reference context does (one batch, cells in position order), the
// logits after the restore must be the reference's bits too. Scattered cells
// change the attention's summation order, so their KV is not a contiguous
// prefill's: there the byte comparison with the saver is the check.
void case_roundtrip(llama_model *model, const char *gguf, bool fa, bool scattered) {
    const std::string name = std::string("roundtrip fa=") + (fa ? "on" : "off") + (scattered ? " scattered" : "");
    const int before = failures;
    const std::string cfg = bridge_config("libllama-" + name);
    mcb_bridge ba = open_bridge(cfg), bb = open_bridge(cfg);
    {
        // A: one stream of 256 cells; B: two streams of 512 cells, restoring
        // into seq 1. Only n_ctx/n_stream differ, which changes neither KV
        // bytes nor the key, but does change transposed V's stride and the
        // blob's stream list.
        CtxOpts oa{256, fa, GGML_TYPE_F16, 2, true};
        CtxOpts ob{1024, fa, GGML_TYPE_F16, 2, false};
        Host a(model, gguf, oa, ba);
        Host b(model, gguf, ob, bb);

        if (scattered) {
            prefill_scattered(a.ctx);
            const auto first = mcb_test::first_cell_pos(state_blob(a.ctx, 0));
            CHECK(first != 0, "%s: prompt not scattered (first cell at pos %d)", name.c_str(), first);
        } else {
            decode(a.ctx, 0, kTokens, 0, kTokens.size());
        }
        mcb_save_result sr{};
        EXPECT(mcb_libllama_save(a.s, 0, nullptr, kTokens.data(), kTokens.size(), &sr), MCB_STATUS_OK);
        CHECK(sr.n_blocks == kPrompt / kBlock && sr.n_queued == sr.n_blocks, "%s: queued %u of %u blocks",
              name.c_str(), sr.n_queued, sr.n_blocks);
        // Both contexts' probes give one model, whatever their sizes: B sees A's blocks.
        CHECK(b.matched(kPrompt / kBlock) == kPrompt / kBlock, "%s: B does not see A's blocks", name.c_str());

        size_t n = 0;
        EXPECT(mcb_libllama_restore(b.s, 1, nullptr, kTokens.data(), kTokens.size(), &n), MCB_STATUS_OK);
        CHECK(n == kPrompt / kBlock * kBlock, "%s: restored %zu tokens", name.c_str(), n);
        CHECK(pos_max(b.ctx, 1) == static_cast<llama_pos>(n) - 1, "%s: seq 1 ends at %d", name.c_str(), pos_max(b.ctx, 1));
        const std::vector<uint8_t> saved = kv_by_position(a.ctx, 0, static_cast<uint32_t>(n));
        const std::vector<uint8_t> restored = kv_by_position(b.ctx, 1, static_cast<uint32_t>(n));
        CHECK(!saved.empty() && saved == restored, "%s: restored KV differs from the saved KV (%zu vs %zu bytes)",
              name.c_str(), restored.size(), saved.size());

        const std::vector<float> logits = decode(b.ctx, 1, kTokens, n, kTokens.size());
        if (!scattered) {
            CHECK(same_bits(logits, reference(model, ob, 1, n)), "%s: logits after the restore differ from a full prefill",
                  name.c_str());
            // Without flash attention a one-batch prefill gives the same
            // bits too. With it, ggml-cpu's kernel rounds differently for a
            // 4-row and a 100-row query batch, restore or not: informational.
            const bool one_batch = same_bits(logits, reference(model, ob, 1));
            if (!fa) CHECK(one_batch, "%s: logits differ from a one-batch full prefill", name.c_str());
            std::printf("  %s: against a one-batch prefill the logits are %s\n", name.c_str(),
                        one_batch ? "identical" : "not identical (flash attention's rounding depends on the batch)");
        }

        mcb_stats st{};
        mcb_bridge_stats(bb, &st);
        CHECK(st.restored_tokens == n, "%s: bridge B counted %" PRIu64 " restored tokens", name.c_str(), st.restored_tokens);
    }
    EXPECT(mcb_bridge_close(ba), MCB_STATUS_OK);
    EXPECT(mcb_bridge_close(bb), MCB_STATUS_OK);
    std::printf("%s %s: %u of %d tokens restored into another context shape, KV byte-identical%s\n",
                failures == before ? "PASS" : "FAIL", name.c_str(), kPrompt / kBlock * kBlock, kPrompt,
                scattered ? " (cells out of position order)" : ", next-token logits bit-identical to a full prefill");
}

// After a restore that gave nothing, the sequence is empty and a full
// prefill gives the reference logits.
void expect_clean_miss(const char *name, Host &h, llama_model *model, const CtxOpts &o, size_t n) {
    CHECK(n == 0, "%s: restored %zu tokens", name, n);
    CHECK(pos_max(h.ctx, 0) == -1, "%s: sequence not empty (ends at %d)", name, pos_max(h.ctx, 0));
    const std::vector<float> logits = decode(h.ctx, 0, kTokens, 0, kTokens.size());
    CHECK(same_bits(logits, reference(model, o, 0)), "%s: prefill after the miss differs from a fresh context", name);
}

// Contexts whose KV differs find nothing, and are left as they were.
void case_mismatch(llama_model *model, const char *gguf, llama_model *other, const char *other_gguf) {
    const int before = failures;
    const std::string cfg = bridge_config("libllama-mismatch");
    mcb_bridge ba = open_bridge(cfg), bb = open_bridge(cfg);
    {
        CtxOpts base{512, true, GGML_TYPE_F16, 1, true};
        Host a(model, gguf, base, ba);
        decode(a.ctx, 0, kTokens, 0, kTokens.size());
        mcb_save_result sr{};
        EXPECT(mcb_libllama_save(a.s, 0, nullptr, kTokens.data(), kTokens.size(), &sr), MCB_STATUS_OK);
        CHECK(sr.n_queued == kPrompt / kBlock, "mismatch: queued %u blocks", sr.n_queued);
        {
            Host same(model, gguf, base, bb);
            CHECK(same.matched(kPrompt / kBlock) == kPrompt / kBlock, "mismatch: the same format does not see the blocks");
        }

        struct Variant {
            const char *name;
            llama_model *m;
            const char *gguf;
            CtxOpts o;
        } variants[] = {
            {"other GGUF (seed 2)", other, other_gguf, base},
            {"K type bf16", model, gguf, CtxOpts{512, true, GGML_TYPE_BF16, 1, true}},
            {"flash attention off", model, gguf, CtxOpts{512, false, GGML_TYPE_F16, 1, true}},
        };
        for (Variant &v : variants) {
            Host h(v.m, v.gguf, v.o, bb);
            CHECK(h.matched(0) == 0, "%s: blocks of another format matched", v.name);
            size_t n = 1;
            EXPECT(mcb_libllama_restore(h.s, 0, nullptr, kTokens.data(), kTokens.size(), &n), MCB_STATUS_OK);
            expect_clean_miss(v.name, h, v.m, v.o, n);
            std::printf("  %s: nothing restored, prefill identical\n", v.name);
        }
    }
    EXPECT(mcb_bridge_close(ba), MCB_STATUS_OK);
    EXPECT(mcb_bridge_close(bb), MCB_STATUS_OK);
    std::printf("%s mismatch: other GGUF, K type, flash attention restore nothing\n",
                failures == before ? "PASS" : "FAIL");
}

// A restore llama.cpp refuses (no free cells for the prefix) leaves the
// sequence empty and the rest of the context untouched.
void case_refused(llama_model *model, const char *gguf) {
    const int before = failures;
    const std::string cfg = bridge_config("libllama-refused");
    mcb_bridge ba = open_bridge(cfg), bb = open_bridge(cfg);
    {
        CtxOpts small{256, true, GGML_TYPE_F16, 2, true};
        Host a(model, gguf, small, ba);
        decode(a.ctx, 0, kTokens, 0, kTokens.size());
        EXPECT(mcb_libllama_save(a.s, 0, nullptr, kTokens.data(), kTokens.size(), nullptr), MCB_STATUS_OK);

        Host b(model, gguf, small, bb);
        CHECK(b.matched(kPrompt / kBlock) == kPrompt / kBlock, "refused: B does not see A's blocks");
        decode(b.ctx, 1, kFillerTokens, 0, kFiller); // 56 cells left for a 96-token prefix
        size_t n = 1;
        EXPECT(mcb_libllama_restore(b.s, 0, nullptr, kTokens.data(), kTokens.size(), &n), MCB_STATUS_LAYOUT);
        CHECK(n == 0, "refused: restored %zu", n);
        CHECK(pos_max(b.ctx, 0) == -1, "refused: sequence 0 ends at %d", pos_max(b.ctx, 0));
        CHECK(pos_max(b.ctx, 1) == kFiller - 1, "refused: the filler sequence ends at %d", pos_max(b.ctx, 1));
        llama_memory_seq_rm(llama_get_memory(b.ctx), 1, -1, -1);
        expect_clean_miss("refused", b, model, small, n);

        // Misuse is refused before anything happens.
        decode(b.ctx, 1, kTokens, 0, 4);
        EXPECT(mcb_libllama_restore(b.s, 1, nullptr, kTokens.data(), kTokens.size(), &n), MCB_STATUS_STATE);
        EXPECT(mcb_libllama_restore(b.s, 2, nullptr, kTokens.data(), kTokens.size(), &n), MCB_STATUS_INVALID_ARG);
        EXPECT(mcb_libllama_restore(b.s, -1, nullptr, kTokens.data(), kTokens.size(), &n), MCB_STATUS_INVALID_ARG);
        EXPECT(mcb_libllama_save(b.s, 1, nullptr, kTokens.data(), kTokens.size(), nullptr), MCB_STATUS_INVALID_ARG);
        EXPECT(mcb_libllama_save(b.s, 1, nullptr, nullptr, 4, nullptr), MCB_STATUS_INVALID_ARG);
        CHECK(pos_max(b.ctx, 1) == 3, "misuse changed sequence 1 (ends at %d)", pos_max(b.ctx, 1));
        mcb_libllama *s2 = nullptr;
        EXPECT(mcb_libllama_open(b.ctx, bb, gguf, kBlock, 1, &s2), MCB_STATUS_STATE); // the probe needs an empty sequence
        CHECK(s2 == nullptr && pos_max(b.ctx, 1) == 3, "a refused probe touched sequence 1");
    }
    EXPECT(mcb_bridge_close(ba), MCB_STATUS_OK);
    EXPECT(mcb_bridge_close(bb), MCB_STATUS_OK);
    std::printf("%s refused: llama.cpp refusing the blob leaves the sequence empty, the context usable\n",
                failures == before ? "PASS" : "FAIL");
}

// A load that verifies only some blocks restores exactly those. The mock
// Transfer Engine (MCB_TE_MOCK_LIB) fails B's transfers on purpose: blocks 0
// and 1 are in B's own pool (B saved them first), blocks 2-5 only in A's, so
// a failing or corrupting transport leaves exactly two good leading blocks.
void case_partial(llama_model *model, const char *gguf, const char *te_lib) {
    const int before = failures;
    CtxOpts o{512, false, GGML_TYPE_F16, 1, true};
    struct Fault {
        const char *env, *value;
        bool local_head;
        size_t want;
        mcb_status status;
    } faults[] = {
        {"MOCK_TE_FAIL_AFTER", "0", true, 2 * kBlock, MCB_STATUS_OK},
        {"MOCK_TE_CORRUPT", "1000", true, 2 * kBlock, MCB_STATUS_OK},
        {"MOCK_TE_CORRUPT", "1000", false, 0, MCB_STATUS_CORRUPT},
    };
    int i = 0;
    for (const Fault &f : faults) {
        std::string cfg = bridge_config("libllama-partial-" + std::to_string(i++));
        cfg.insert(cfg.size() - 1, std::string(",\"transfer_timeout_ms\":500,\"transport\":{\"kind\":\"mooncake\",\"lib\":\"") +
                                       te_lib + "\"}");
        mcb_bridge ba = open_bridge(cfg);
        // The mock reads its faults when an engine is created; B's engine
        // is the one that reads.
        setenv(f.env, f.value, 1);
        mcb_bridge bb = open_bridge(cfg);
        unsetenv(f.env);
        {
            Host b(model, gguf, o, bb);
            Host a(model, gguf, o, ba);
            if (f.local_head) {
                decode(b.ctx, 0, kTokens, 0, 2 * kBlock);
                EXPECT(mcb_libllama_save(b.s, 0, nullptr, kTokens.data(), 2 * kBlock, nullptr), MCB_STATUS_OK);
                llama_memory_seq_rm(llama_get_memory(b.ctx), 0, -1, -1);
                CHECK(a.matched(2) == 2, "partial: A does not see B's blocks");
            }
            decode(a.ctx, 0, kTokens, 0, kTokens.size());
            mcb_save_result sr{};
            EXPECT(mcb_libllama_save(a.s, 0, nullptr, kTokens.data(), kTokens.size(), &sr), MCB_STATUS_OK);
            CHECK(sr.n_known == (f.local_head ? 2u : 0u), "partial: A found %u blocks known", sr.n_known);
            CHECK(b.matched(kPrompt / kBlock) == kPrompt / kBlock, "partial: B does not see A's blocks");

            size_t n = 1;
            EXPECT(mcb_libllama_restore(b.s, 0, nullptr, kTokens.data(), kTokens.size(), &n), f.status);
            CHECK(n == f.want, "%s=%s: restored %zu tokens, want %zu", f.env, f.value, n, f.want);
            CHECK(pos_max(b.ctx, 0) == static_cast<llama_pos>(n) - 1, "%s: sequence ends at %d", f.env, pos_max(b.ctx, 0));
            const std::string why = mcb_libllama_last_error();
            const std::vector<float> logits = decode(b.ctx, 0, kTokens, n, kTokens.size());
            CHECK(same_bits(logits, reference(model, o, 0, n)), "%s: logits differ from a full prefill", f.env);
            std::printf("  %s=%s%s: %zu tokens kept (%s)\n", f.env, f.value, f.local_head ? ", blocks 0-1 local" : "", n,
                        why.c_str());
        }
        EXPECT(mcb_bridge_close(bb), MCB_STATUS_OK);
        EXPECT(mcb_bridge_close(ba), MCB_STATUS_OK);
    }
    std::printf("%s partial: failed or corrupt transfers keep only the verified leading blocks; logits identical\n",
                failures == before ? "PASS" : "FAIL");
}

void quiet_log(ggml_log_level level, const char *text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR && std::getenv("MCB_TEST_LLAMA_LOG")) std::fputs(text, stderr);
    if (level != GGML_LOG_LEVEL_ERROR && level != GGML_LOG_LEVEL_CONT && std::getenv("MCB_TEST_LLAMA_LOG_ALL"))
        std::fputs(text, stderr);
}

llama_model *load_model(const char *path) {
    llama_model_params mp = llama_model_default_params();
    llama_model *m = llama_model_load_from_file(path, mp);
    if (!m) {
        std::fprintf(stderr, "cannot load %s\n", path);
        std::exit(2);
    }
    return m;
}

int finish(const char *what) {
    std::printf("%s: %d checks, %d failed\n", what, checks, failures);
    return failures ? 1 : 0;
}

int run_all(const char *gguf, const char *other_gguf, const char *te_mock) {
    llama_model *model = load_model(gguf), *other = load_model(other_gguf);
    for (bool fa : {true, false})
        for (bool scattered : {false, true}) case_roundtrip(model, gguf, fa, scattered);
    case_mismatch(model, gguf, other, other_gguf);
    case_refused(model, gguf);
    case_partial(model, gguf, te_mock);
    llama_model_free(model);
    llama_model_free(other);
    CHECK(mcb_handles_open() == 0, "%zu bridge handles left open", mcb_handles_open());
    return finish("libllama_test");
}

void write_file(const std::string &path, const std::vector<uint8_t> &b) {
    FILE *f = std::fopen(path.c_str(), "wb");
    if (!f || std::fwrite(b.data(), 1, b.size(), f) != b.size() || std::fclose(f) != 0) {
        std::fprintf(stderr, "writing %s: %s\n", path.c_str(), std::strerror(errno));
        std::exit(2);
    }
    std::printf("  %s (%zu bytes)\n", path.c_str(), b.size());
}

std::vector<uint8_t> read_file(const std::string &path) {
    std::vector<uint8_t> b;
    FILE *f = std::fopen(path.c_str(), "rb");
    if (!f) {
        std::fprintf(stderr, "reading %s: %s\n", path.c_str(), std::strerror(errno));
        std::exit(2);
    }
    uint8_t buf[65536];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) b.insert(b.end(), buf, buf + n);
    std::fclose(f);
    return b;
}

// Two processes: A saves and serves its pool, B restores from it. A writes
// the KV of the positions it saved to READY (renamed into place, so that B
// never reads half of it), which B's restored KV must be byte for byte.
int run_xsave(const char *gguf, const char *config, const char *ready) {
    llama_model *model = load_model(gguf);
    mcb_bridge br = open_bridge(config);
    {
        CtxOpts o;
        Host a(model, gguf, o, br);
        decode(a.ctx, 0, a.tokens, 0, a.tokens.size());
        mcb_save_result sr{};
        EXPECT(mcb_libllama_save(a.s, 0, nullptr, a.tokens.data(), a.tokens.size(), &sr), MCB_STATUS_OK);
        CHECK(sr.n_queued == kPrompt / kBlock, "xsave: queued %u blocks", sr.n_queued);
        std::printf("xsave: pid %d queued %u blocks\n", static_cast<int>(getpid()), sr.n_queued);
        const std::string tmp = std::string(ready) + ".tmp";
        write_file(tmp, kv_by_position(a.ctx, 0, kPrompt / kBlock * kBlock));
        CHECK(std::rename(tmp.c_str(), ready) == 0, "renaming %s: %s", tmp.c_str(), std::strerror(errno));
        std::fflush(stdout);
        char buf[64];
        while (std::fread(buf, 1, sizeof buf, stdin) > 0) {
        }
    }
    EXPECT(mcb_bridge_close(br), MCB_STATUS_OK);
    llama_model_free(model);
    return finish("xsave");
}

int run_xrestore(const char *gguf, const char *config, const char *saved_kv) {
    llama_model *model = load_model(gguf);
    mcb_bridge br = open_bridge(config);
    {
        CtxOpts o{1024, true, GGML_TYPE_F16, 1, true};
        Host b(model, gguf, o, br);
        // The local index learns of A's blocks from the directory's watch,
        // asynchronously: wait (bounded) until it has all of them.
        const uint32_t seen = b.matched(kPrompt / kBlock);
        CHECK(seen == kPrompt / kBlock, "xrestore: the directory shows %u of A's blocks", seen);
        size_t n = 0;
        EXPECT(mcb_libllama_restore(b.s, 0, nullptr, b.tokens.data(), b.tokens.size(), &n), MCB_STATUS_OK);
        CHECK(n == kPrompt / kBlock * kBlock, "xrestore: restored %zu tokens", n);
        const std::vector<uint8_t> restored = kv_by_position(b.ctx, 0, static_cast<uint32_t>(n));
        const std::vector<uint8_t> saved = read_file(saved_kv);
        CHECK(!saved.empty() && restored == saved, "xrestore: restored KV differs from A's (%zu vs %zu bytes)",
              restored.size(), saved.size());
        const std::vector<float> logits = decode(b.ctx, 0, b.tokens, n, b.tokens.size());
        CHECK(same_bits(logits, reference(model, o, 0, n)), "xrestore: logits differ from a full prefill");
        std::printf("%s two processes: pid %d restored %zu tokens from another process, %zu KV bytes identical, "
                    "logits bit-identical\n",
                    failures ? "FAIL" : "PASS", static_cast<int>(getpid()), n, saved.size());
    }
    EXPECT(mcb_bridge_close(br), MCB_STATUS_OK);
    llama_model_free(model);
    return finish("xrestore");
}

// A model whose context the library does not serve: mcb_libllama_open
// refuses it as unsupported, says why, and leaves the context as a fresh
// one, which then computes the prompt to a fresh context's bits.
int run_xoff(const char *gguf) {
    llama_model *model = load_model(gguf);
    mcb_bridge br = open_bridge(bridge_config("libllama-off"));
    {
        CtxOpts o;
        llama_context *ctx = new_ctx(model, o);
        mcb_libllama *s = nullptr;
        EXPECT(mcb_libllama_open(ctx, br, gguf, kBlock, 0, &s), MCB_STATUS_UNSUPPORTED);
        const std::string why = mcb_libllama_last_error();
        CHECK(s == nullptr && pos_max(ctx, 0) == -1, "xoff: a refused open left a handle or sequence 0 ending at %d",
              pos_max(ctx, 0));
        CHECK(mcb_handles_open() == 1, "xoff: %zu handles open, the bridge's only expected", mcb_handles_open());
        const std::vector<llama_token> tokens = prompt_for(model);
        const std::vector<float> logits = decode(ctx, 0, tokens, 0, tokens.size());
        CHECK(same_bits(logits, reference(model, o, 0)), "xoff: the refused context computes other logits");
        std::printf("%s off: %s\n", failures ? "FAIL" : "PASS", why.c_str());
        mcb_libllama_close(s);
        llama_free(ctx);
    }
    EXPECT(mcb_bridge_close(br), MCB_STATUS_OK);
    llama_model_free(model);
    return finish("xoff");
}

// Real blobs and slot files for internal/llamastate's tests: each prompt
// state also comes with the state of its first 16 tokens computed alone,
// which slicing the full one must reproduce byte for byte.
int run_testdata(const char *gguf, const char *dir) {
    llama_model *model = load_model(gguf);
    const uint32_t n = 24, prefix = 16;
    struct Blob {
        const char *name;
        CtxOpts o;
        llama_seq_id seq;
        bool scattered;
    } blobs[] = {
        {"fa-on", CtxOpts{256, true, GGML_TYPE_F16, 1, true}, 0, false},
        {"fa-off", CtxOpts{256, false, GGML_TYPE_F16, 1, true}, 0, false},
        {"f32k", CtxOpts{256, true, GGML_TYPE_F32, 1, true}, 0, false},
        {"two-streams-fa-off", CtxOpts{512, false, GGML_TYPE_F16, 2, false}, 1, false},
        {"scattered-fa-off", CtxOpts{256, false, GGML_TYPE_F16, 2, true}, 0, true},
    };
    mkdir(dir, 0755);
    for (const Blob &b : blobs) {
        llama_context *ctx = new_ctx(model, b.o);
        if (b.scattered) {
            // As prefill_scattered, scaled to 24 tokens: positions 0..7 in
            // cells 240..247, 8..23 in cells 0..15.
            decode(ctx, 1, kFillerTokens, 0, 240);
            decode(ctx, 0, kTokens, 0, 8);
            llama_memory_seq_rm(llama_get_memory(ctx), 1, -1, -1);
            decode(ctx, 0, kTokens, 8, n);
        } else {
            decode(ctx, b.seq, kTokens, 0, n);
        }
        write_file(std::string(dir) + "/seq-" + b.name + ".bin", state_blob(ctx, b.seq));
        llama_free(ctx);

        ctx = new_ctx(model, b.o);
        decode(ctx, b.seq, kTokens, 0, prefix);
        write_file(std::string(dir) + "/seq-" + b.name + "-prefix16.bin", state_blob(ctx, b.seq));
        llama_free(ctx);
    }
    // Slot files as llama-server writes them (server_tokens::serialize:
    // -1 marker, version 1, n and the tokens, no media), and with a plain
    // token list as older servers did.
    for (bool fa : {true, false}) {
        llama_context *ctx = new_ctx(model, CtxOpts{256, fa, GGML_TYPE_F16, 1, true});
        decode(ctx, 0, kTokens, 0, n);
        std::vector<llama_token> words;
        if (fa) {
            words = {-1, 1, static_cast<llama_token>(n)};
            words.insert(words.end(), kTokens.begin(), kTokens.begin() + n);
            words.push_back(0);
        } else {
            words.assign(kTokens.begin(), kTokens.begin() + n);
        }
        const std::string path = std::string(dir) + "/slot-" + (fa ? "fa-on" : "plain-fa-off") + ".bin";
        CHECK(llama_state_seq_save_file(ctx, path.c_str(), 0, words.data(), words.size()) > 0, "saving %s", path.c_str());
        std::printf("  %s\n", path.c_str());
        llama_free(ctx);
    }
    llama_model_free(model);
    return finish("testdata");
}

} // namespace

int main(int argc, char **argv) {
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    int rc = 2;
    if (argc == 5 && std::strcmp(argv[1], "xsave") == 0) {
        rc = run_xsave(argv[2], argv[3], argv[4]);
    } else if (argc == 5 && std::strcmp(argv[1], "xrestore") == 0) {
        rc = run_xrestore(argv[2], argv[3], argv[4]);
    } else if (argc == 3 && std::strcmp(argv[1], "xoff") == 0) {
        rc = run_xoff(argv[2]);
    } else if (argc == 4 && std::strcmp(argv[1], "testdata") == 0) {
        rc = run_testdata(argv[2], argv[3]);
    } else if (argc == 4) {
        rc = run_all(argv[1], argv[2], argv[3]);
    } else {
        std::fprintf(stderr,
                     "usage: %s MODEL OTHER_MODEL TE_MOCK_LIB\n"
                     "       %s xsave MODEL CONFIG READY_FILE\n"
                     "       %s xrestore MODEL CONFIG READY_FILE\n"
                     "       %s xoff MODEL\n"
                     "       %s testdata MODEL DIR\n",
                     argv[0], argv[0], argv[0], argv[0], argv[0]);
    }
    llama_backend_free();
    return rc;
}
