// llama-mcbridge-test MODEL OTHER_MODEL: stage 2 inside one process, against real
// llama_contexts of the patched libllama sharing one bridge (in-process directory and
// transport). Run by tests/e2e (TestStage2Contexts); exit status 0 when every check passes.
//
//   - a save from one context and a restore into another with the same KV format
//     places byte-identical K and V at every restored position, into cells that
//     find_slot scattered around another sequence's cells, and into the second stream
//     of a cache with a stream a sequence, with V row-major (flash attention on) and
//     transposed (off);
//   - another model, another K type and another V layout find nothing and restore
//     nothing, and a failed restore leaves every other sequence's KV untouched;
//   - a restore that cannot fit rolls back;
//   - a shifted or holed sequence publishes only its clean prefix, and a cut below the
//     hole makes it clean again;
//   - a memory without KV layers (Mamba) restores from a snapshot alone, byte-identical
//     to the state it was taken from, and its clean marks follow the recurrent memory's
//     edits.
#include "kv_blob.hpp"
#include "llama-mcbridge.h"
#include "llama.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

namespace {

int g_failures = 0;

void check(bool ok, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, ok ? "ok   " : "FAIL ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    g_failures += ok ? 0 : 1;
}

constexpr uint32_t k_block = 32;

struct kv_format {
    const char * name;
    bool         flash_attn;
    ggml_type    type_k;
    ggml_type    type_v = GGML_TYPE_F16;
};

struct model_file {
    const char *  path;
    llama_model * model;
};

struct context {
    llama_context *        ctx = nullptr;
    mcb_llama::attachment att;

    context(const model_file & m, const kv_format & f, uint32_t n_ctx, uint32_t n_seq, bool unified) {
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx           = n_ctx;
        cp.n_batch         = 64;
        cp.n_ubatch        = 64;
        cp.n_seq_max       = n_seq;
        cp.kv_unified      = unified;
        cp.n_threads       = 2;
        cp.n_threads_batch = 2;
        cp.flash_attn_type = f.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
        cp.type_k          = f.type_k;
        cp.type_v          = f.type_v;
        cp.no_perf         = true;
        ctx = llama_init_from_model(m.model, cp);
        if (ctx == nullptr) {
            fprintf(stderr, "llama_init_from_model failed (%s)\n", f.name);
            exit(2);
        }
        std::string why;
        if (!mcb_llama::attach(ctx, m.path, att, why)) {
            fprintf(stderr, "attach failed (%s): %s\n", f.name, why.c_str());
            exit(2);
        }
    }
    ~context() {
        mcb_llama::detach(ctx);
        llama_free(ctx);
    }
    context(const context &) = delete;

    llama_memory_t mem() const { return llama_get_memory(ctx); }

    // Decodes tokens at positions [p0, p0 + n) of seq in batches of at most 64.
    void decode(llama_seq_id seq, const std::vector<llama_token> & toks, llama_pos p0) const {
        for (size_t i = 0; i < toks.size(); i += 64) {
            const size_t n = std::min<size_t>(64, toks.size() - i);
            llama_batch b = llama_batch_init((int32_t) n, 0, 1);
            for (size_t j = 0; j < n; j++) {
                b.token[j]     = toks[i + j];
                b.pos[j]       = p0 + (llama_pos) (i + j);
                b.n_seq_id[j]  = 1;
                b.seq_id[j][0] = seq;
                b.logits[j]    = i + j + 1 == toks.size();
            }
            b.n_tokens = (int32_t) n;
            if (llama_decode(ctx, b) != 0) {
                fprintf(stderr, "llama_decode failed\n");
                exit(2);
            }
            llama_batch_free(b);
        }
        llama_synchronize(ctx);
    }

    mcb_llama::save_result save(llama_seq_id seq, const std::vector<llama_token> & toks) const {
        return mcb_llama::seq_save(ctx, att, nullptr, seq, toks.data(), (int32_t) toks.size());
    }

    // Starts restoring what a lookup of toks plans, as llama-server does (op.load is 0
    // when it did not start).
    mcb_llama::restore_result restore_begin(llama_seq_id seq, const std::vector<llama_token> & toks,
                                            mcb_llama::restore_op & op) const {
        mcb_lookup_result lr = {};
        mcb_llama::restore_result r;
        r.status = mcb_lookup(att.model, nullptr, toks.data(), toks.size(), 0, &lr);
        if (r.status != MCB_STATUS_OK || lr.plan == 0) {
            r.error = "nothing to restore";
            return r;
        }
        return mcb_llama::seq_restore_begin(ctx, att, lr.plan, seq, toks.data(), (int32_t) lr.n_restore_tokens, op);
    }

    // Restores what a lookup of toks plans (the policy restores every usable block),
    // waiting for the load.
    mcb_llama::restore_result restore(llama_seq_id seq, const std::vector<llama_token> & toks) const {
        mcb_llama::restore_op op;
        const mcb_llama::restore_result r = restore_begin(seq, toks, op);
        return op.load == 0 ? r : mcb_llama::seq_restore_end(op);
    }

    int32_t matched(const std::vector<llama_token> & toks) const {
        mcb_lookup_result lr = {};
        if (mcb_lookup(att.model, nullptr, toks.data(), toks.size(), 0, &lr) != MCB_STATUS_OK) {
            return -1;
        }
        mcb_plan_drop(lr.plan);
        return (int32_t) (lr.n_matched_blocks * lr.n_block_tokens);
    }

    llama_pos clean_end(llama_seq_id seq) const { return mcb_llama::seq_get_origin(ctx, seq).clean_end; }

    // The state of seq that a snapshot holds, as llama.cpp writes it: the partial state
    // (a recurrent state, a window cache), or the whole state (DeepSeek V4's).
    std::vector<uint8_t> snapshot_state(llama_seq_id seq) const { return mcb_llama::seq_state(ctx, seq, att.snapshot_flags); }

    std::vector<uint8_t> blob(llama_seq_id seq) const {
        std::vector<uint8_t> b(llama_state_seq_get_size(ctx, seq));
        b.resize(llama_state_seq_get_data(ctx, b.data(), b.size(), seq));
        return b;
    }

    // Every position's K and V bytes, read from llama.cpp's own state blob, so that
    // the comparison does not trust the library's parser.
    std::map<llama_pos, std::vector<uint8_t>> kv_by_pos(llama_seq_id seq) const { return mcb_test::kv_by_pos(blob(seq)); }
};

// The tokens every model of the run has (test-llama-archs' random models have 128).
int g_vocab = 256;

std::vector<llama_token> tokens(size_t n, int mul, int off) {
    std::vector<llama_token> t(n);
    for (size_t i = 0; i < n; i++) {
        t[i] = (llama_token) ((i * mul + off) % g_vocab);
    }
    return t;
}

// Positions [0, n) of seq_a in a hold the same KV bytes as those of seq_b in b, which
// holds nothing else.
bool same_kv(const context & a, llama_seq_id seq_a, const context & b, llama_seq_id seq_b, int32_t n) {
    const auto ka = a.kv_by_pos(seq_a);
    const auto kb = b.kv_by_pos(seq_b);
    for (llama_pos p = 0; p < n; p++) {
        auto ia = ka.find(p);
        auto ib = kb.find(p);
        if (ia == ka.end() || ib == kb.end() || ia->second != ib->second) {
            fprintf(stderr, "  position %d differs\n", p);
            return false;
        }
    }
    return kb.size() == (size_t) n;
}

// Saves a prompt from one context and restores it into another of the same format,
// around a holed sequence so that find_slot scatters the restored cells.
void round_trip(const model_file & model, const kv_format & f) {
    const std::vector<llama_token> prompt = tokens(200, 7, 3);
    const int32_t want = 200 / k_block * k_block;

    context src(model, f, 1024, 2, true);
    src.decode(0, prompt, 0);
    const auto sv = src.save(0, prompt);
    check(sv.status == MCB_STATUS_OK && sv.blocks.n_blocks == 200 / k_block,
          "%s: save of 200 tokens: %u full blocks, status %s %s", f.name, sv.blocks.n_blocks,
          mcb_status_str(sv.status), sv.error.c_str());

    context dst(model, f, 1024, 2, true);
    dst.decode(1, tokens(100, 5, 1), 0);
    llama_memory_seq_rm(dst.mem(), 1, 20, 60); // a hole of 40 cells in the middle of seq 1
    const auto before = dst.blob(1);
    check(dst.matched(prompt) == want, "%s: lookup finds %d tokens", f.name, dst.matched(prompt));
    const auto r = dst.restore(0, prompt);
    check(r.n_tokens == want && r.status == MCB_STATUS_OK, "%s: restored %d of %d tokens (%llu bytes) %s", f.name,
          r.n_tokens, want, (unsigned long long) r.n_bytes, r.error.c_str());
    check(llama_memory_seq_pos_max(dst.mem(), 0) == want - 1, "%s: seq 0 ends at %d", f.name,
          llama_memory_seq_pos_max(dst.mem(), 0));
    llama_memory_seq_rm(src.mem(), 0, want, -1);
    check(same_kv(src, 0, dst, 0, want), "%s: restored K and V are byte-identical to the computed ones", f.name);
    check(dst.blob(1) == before, "%s: the other sequence is untouched", f.name);
    check(dst.clean_end(0) > want, "%s: a restored sequence is clean", f.name);

    // A cache of one stream a sequence, as llama-server makes with -np N: seq 1's load
    // goes into stream 1 and stream 0 keeps its own KV.
    context streams(model, f, 1024, 2, false);
    streams.decode(0, tokens(100, 5, 1), 0);
    const auto before_stream0 = streams.blob(0);
    const auto rs = streams.restore(1, prompt);
    check(rs.n_tokens == want && rs.status == MCB_STATUS_OK, "%s: restored %d of %d tokens into stream 1 %s", f.name,
          rs.n_tokens, want, rs.error.c_str());
    check(same_kv(src, 0, streams, 1, want), "%s: stream 1's K and V are byte-identical to the computed ones", f.name);
    check(streams.blob(0) == before_stream0, "%s: stream 0 is untouched", f.name);

    // Nothing fits: a one-sequence cache full of seq 0 cannot take seq 1's 192 cells.
    context full(model, f, 256, 2, true);
    full.decode(0, tokens(250, 3, 2), 0);
    const auto before_full = full.blob(0);
    const auto rf = full.restore(1, prompt);
    check(rf.n_tokens == 0 && llama_memory_seq_pos_max(full.mem(), 1) == -1 && full.blob(0) == before_full,
          "%s: a restore without room restores nothing and leaves the cache as it was (%s)", f.name, rf.error.c_str());
}

// llama-server's restore runs while other sequences are decoded (docs/llama.md,
// "Asynchronous restores"): a sequence decoded between the restore's start and end, in
// the same unified cache, gets the KV it gets when decoded after a restore that waited
// (the same cells: its numerics may depend on where the other sequence's cells are),
// the restore's K and V are byte-identical, and a restore abandoned midway leaves its
// sequence empty.
void in_flight(const model_file & model, const kv_format & f) {
    const std::vector<llama_token> prompt = tokens(200, 11, 5);
    const std::vector<llama_token> other  = tokens(100, 5, 1);
    const int32_t want = 200 / k_block * k_block;

    context src(model, f, 1024, 2, true);
    src.decode(0, prompt, 0);
    check(src.save(0, prompt).status == MCB_STATUS_OK, "%s: in flight: the prompt is saved", f.name);
    llama_memory_seq_rm(src.mem(), 0, want, -1);
    context after(model, f, 1024, 2, true);
    check(after.restore(0, prompt).n_tokens == want, "%s: in flight: the reference restore", f.name);
    after.decode(1, other, 0);

    context dst(model, f, 1024, 2, true);
    mcb_llama::restore_op op;
    const auto rb = dst.restore_begin(0, prompt, op);
    check(op.load != 0, "%s: the restore starts (%s)", f.name, rb.error.c_str());
    dst.decode(1, other, 0);
    check(mcb_llama::seq_restore_poll(op, 60u * 1000 * 1000), "%s: the restore is over within a minute", f.name);
    const auto r = mcb_llama::seq_restore_end(op);
    check(r.n_tokens == want && r.status == MCB_STATUS_OK, "%s: restored %d of %d tokens while seq 1 was decoded %s",
          f.name, r.n_tokens, want, r.error.c_str());
    check(same_kv(src, 0, dst, 0, want), "%s: the restore's K and V are byte-identical to the computed ones", f.name);
    check(same_kv(after, 1, dst, 1, (int32_t) other.size()), "%s: seq 1, decoded meanwhile, holds what it holds decoded after", f.name);
    check(dst.clean_end(0) > want, "%s: the restored sequence is clean", f.name);

    context cancelled(model, f, 1024, 2, true);
    cancelled.decode(1, other, 0);
    const auto before = cancelled.blob(1);
    mcb_llama::restore_op op2;
    cancelled.restore_begin(0, prompt, op2);
    check(op2.load != 0, "%s: the second restore starts", f.name);
    mcb_llama::seq_restore_cancel(op2);
    check(op2.load == 0 && llama_memory_seq_pos_max(cancelled.mem(), 0) == -1 && cancelled.blob(1) == before,
          "%s: an abandoned restore leaves its sequence empty and the other as it was", f.name);
}

void mismatches(const model_file & model, const model_file & other, const kv_format & saved, const std::vector<kv_format> & others) {
    // A prompt no other check saves: only the saving format has it.
    const std::vector<llama_token> prompt = tokens(200, 17, 5);
    {
        context src(model, saved, 1024, 1, true);
        src.decode(0, prompt, 0);
        src.save(0, prompt);
    }
    auto expect_nothing = [&](const model_file & m, const kv_format & f, const std::string & what) {
        context dst(m, f, 1024, 2, true);
        dst.decode(1, tokens(60, 5, 1), 0);
        const auto before = dst.blob(1);
        check(dst.matched(prompt) == 0, "%s: lookup finds nothing", what.c_str());
        const auto r = dst.restore(0, prompt);
        check(r.n_tokens == 0 && llama_memory_seq_pos_max(dst.mem(), 0) == -1 && dst.blob(1) == before,
              "%s: restore gives nothing and leaves the cache as it was (%s: %s)", what.c_str(), mcb_status_str(r.status),
              r.error.c_str());
    };
    for (const auto & f : others) {
        expect_nothing(model, f, std::string("saved ") + saved.name + ", context " + f.name);
    }
    expect_nothing(other, saved, "another model (other weights)");
    {
        context same(model, saved, 1024, 1, true);
        check(same.matched(prompt) == 192, "the saving format still finds its 192 tokens");
    }
}

void clean_marks(const model_file & model, const kv_format & f) {
    const std::vector<llama_token> prompt = tokens(200, 11, 4);
    context c(model, f, 1024, 1, true);
    c.decode(0, prompt, 0);
    // What context shift does: drop [50, 60) and slide the rest down.
    llama_memory_seq_rm(c.mem(), 0, 50, 60);
    llama_memory_seq_add(c.mem(), 0, 60, -1, -10);
    check(c.clean_end(0) == 50, "a shift lowers the clean mark to 50 (%d)", c.clean_end(0));
    std::vector<llama_token> shifted(prompt.begin(), prompt.begin() + 50);
    shifted.insert(shifted.end(), prompt.begin() + 60, prompt.end());
    const auto s1 = c.save(0, shifted);
    check(s1.n_tokens == 50 && s1.blocks.n_blocks == 50 / k_block, "a shifted sequence saves its clean 50 tokens (%d, %u blocks)",
          s1.n_tokens, s1.blocks.n_blocks);
    context probe(model, f, 1024, 1, true);
    check(probe.matched(shifted) == 32, "only the clean block is published (%d)", probe.matched(shifted));

    // Cut below the mark: what is left is clean, and so is what is computed on it.
    llama_memory_seq_rm(c.mem(), 0, 40, -1);
    std::vector<llama_token> again(prompt.begin(), prompt.begin() + 40);
    const auto tail = tokens(120, 13, 9);
    c.decode(0, tail, 40);
    again.insert(again.end(), tail.begin(), tail.end());
    check(c.clean_end(0) > 160, "a cut below the mark makes the sequence clean");
    const auto s2 = c.save(0, again);
    check(s2.n_tokens == 160 && s2.blocks.n_blocks == 5, "then all 160 tokens are saved (%d, %u blocks)", s2.n_tokens,
          s2.blocks.n_blocks);
}

// A memory without KV layers: its snapshots are its state (its partial state, or
// DeepSeek V4's whole state). One taken after 128 tokens restores into another
// context's sequence beside a sequence of its own, byte for byte the state it was
// taken from; another model finds nothing; the marks follow the memory's edits.
void snapshots_alone(const model_file & model, const model_file & other, const kv_format & f) {
    const std::vector<llama_token> prompt = tokens(200, 7, 3);
    context src(model, f, 1024, 2, true);
    const int32_t every = (int32_t) src.att.snapshot_tokens;
    check(src.att.n_layer == 0 && every > 0 && every <= 128 && 128 % every == 0,
          "no KV layers, snapshots every %d tokens (%s)", every, src.att.describe.c_str());
    const std::vector<llama_token> head(prompt.begin(), prompt.begin() + 128);
    src.decode(0, head, 0);
    const auto at128 = src.snapshot_state(0);
    std::string err;
    check(mcb_llama::seq_snapshot(src.ctx, src.att, nullptr, 0, head.data(), 128, err) == MCB_STATUS_OK,
          "the state after 128 tokens is snapshotted %s", err.c_str());
    src.decode(0, std::vector<llama_token>(prompt.begin() + 128, prompt.end()), 128);
    const auto sv = src.save(0, prompt);
    check(sv.status == MCB_STATUS_OK && sv.blocks.n_blocks == 0, "a save publishes no block: the snapshots are the state");

    context dst(model, f, 1024, 2, true);
    dst.decode(1, tokens(100, 5, 1), 0);
    const auto before = dst.blob(1);
    check(dst.matched(prompt) == 128, "lookup finds the snapshot's 128 tokens (%d)", dst.matched(prompt));
    const auto r = dst.restore(0, prompt);
    check(r.n_tokens == 128 && r.status == MCB_STATUS_OK, "restored %d of 128 tokens (%llu bytes) %s", r.n_tokens,
          (unsigned long long) r.n_bytes, r.error.c_str());
    check(llama_memory_seq_pos_max(dst.mem(), 0) == 127, "seq 0 is at position %d", llama_memory_seq_pos_max(dst.mem(), 0));
    check(dst.snapshot_state(0) == at128, "the restored state is byte-identical to the one computed");
    check(dst.blob(1) == before, "the other sequence is untouched");
    check(dst.clean_end(0) > 128, "a restored sequence is clean");

    {
        context foreign(other, f, 1024, 1, true);
        check(foreign.matched(prompt) == 0, "another model finds nothing");
    }

    // The marks: a shift leaves the history in doubt from where it moved; a copy into
    // an empty sequence shares the source's mark; a removal of the whole state cleans
    // it.
    const bool whole = dst.att.snapshot_flags != LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY;
    if (!whole) { // DeepSeek V4 is never shifted: it says it cannot be (get_can_shift)
        llama_memory_seq_add(dst.mem(), 0, 60, -1, -10);
        check(dst.clean_end(0) == 50, "a shift lowers the clean mark to 50 (%d)", dst.clean_end(0));
    }
    const llama_pos mark = dst.clean_end(0);
    const uint8_t scope[16] = {7};
    mcb_llama::seq_set_scope(dst.ctx, 0, scope, true);
    llama_memory_seq_rm(dst.mem(), 1, -1, -1);
    llama_memory_seq_cp(dst.mem(), 0, 1, -1, -1);
    check(dst.clean_end(1) == mark, "a copy has its source's mark (%d)", dst.clean_end(1));
    llama_memory_seq_rm(dst.mem(), 0, -1, -1);
    check(dst.clean_end(0) > 128, "removing the whole state makes the sequence clean");
    dst.decode(0, head, 0);
    const bool kept = !llama_memory_seq_rm(dst.mem(), 0, 100, -1);
    if (!whole) {
        // A recurrent state's cut is seen before the memory refuses it (no room to roll
        // back) or rolls back.
        check(dst.clean_end(0) == 100, "a cut inside the history leaves what follows it in doubt (%d)", dst.clean_end(0));
    } else {
        // DeepSeek V4 refuses such a cut before it edits any cache: nothing changed.
        check(kept && dst.clean_end(0) > 128, "a refused cut leaves the sequence clean (%d)", dst.clean_end(0));
    }
    llama_memory_clear(dst.mem(), true);
    check(dst.clean_end(0) > 128 && dst.clean_end(1) > 128, "a clear makes every sequence clean");
}

} // namespace

// Whether llama.cpp makes a context of f for m.
bool takes(const model_file & m, const kv_format & f) {
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx           = 256;
    cp.flash_attn_type = f.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k          = f.type_k;
    cp.type_v          = f.type_v;
    llama_context * ctx = llama_init_from_model(m.model, cp);
    llama_free(ctx);
    return ctx != nullptr;
}

int main(int argc, char ** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s MODEL.gguf OTHER_MODEL.gguf\n", argv[0]);
        return 2;
    }
    llama_log_set([](ggml_log_level level, const char * text, void *) {
        if (level >= GGML_LOG_LEVEL_WARN) {
            fputs(text, stderr);
        }
    }, nullptr);
    llama_backend_init();
    mcb_llama::set_config("{\"block_tokens\": " + std::to_string(k_block) + ", \"arbiter\": {\"policy\": \"always-restore\"}}");

    llama_model_params mp = llama_model_default_params();
    const model_file model = {argv[1], llama_model_load_from_file(argv[1], mp)};
    const model_file other = {argv[2], llama_model_load_from_file(argv[2], mp)};
    if (model.model == nullptr || other.model == nullptr) {
        fprintf(stderr, "cannot load the models\n");
        return 2;
    }

    for (const llama_model * m : {model.model, other.model}) {
        g_vocab = std::min(g_vocab, llama_vocab_n_tokens(llama_model_get_vocab(m)));
    }

    const kv_format fa_on  = {"fa-on-f16", true, GGML_TYPE_F16};
    const kv_format fa_off = {"fa-off-f16", false, GGML_TYPE_F16};
    // Another K type; an MLA cache, whose V is a view of K, takes only K and V of one.
    kv_format bf16k = {"fa-on-k-bf16", true, GGML_TYPE_BF16};
    if (!takes(model, bf16k)) {
        bf16k = {"fa-on-bf16", true, GGML_TYPE_BF16, GGML_TYPE_BF16};
    }

    bool snapshot_only = false;
    {
        context probe(model, fa_on, 256, 1, true);
        snapshot_only = probe.att.n_layer == 0;
    }
    if (snapshot_only) {
        snapshots_alone(model, other, fa_on);
    } else {
        round_trip(model, fa_on);
        round_trip(model, fa_off);
        round_trip(model, bf16k);
        in_flight(model, fa_on);
        in_flight(model, fa_off);
        mismatches(model, other, fa_on, {fa_off, bf16k});
        clean_marks(model, fa_on);
    }

    llama_model_free(model.model);
    llama_model_free(other.model);
    check(mcb_handles_open() <= 1, "no load or save handle left open (%zu handles, the bridge included)", mcb_handles_open());
    if (g_failures > 0) {
        fprintf(stderr, "llama-mcbridge-test: %d checks failed\n", g_failures);
        return 1;
    }
    fprintf(stderr, "llama-mcbridge-test: all checks passed\n");
    return 0;
}
