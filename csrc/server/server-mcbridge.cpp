// llama-server's use of the bridge. See server-mcbridge.h.
#include "server-mcbridge.h"

#include "llama-mcbridge.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>

namespace mcb_server {

namespace {

// A slot's restore, from its start to the prompt that uses it (docs/llama.md,
// "Asynchronous restores"): loading while the load runs, then done once it is ended,
// until the slot's prompt starts with what it restored.
struct slot_restore {
    enum phase_t { LOADING, DONE } phase = LOADING;
    int                    task_id = -1;   // the task it restores for
    uint8_t                scope[16] = {}; // the request's scope id: the restored cells'
    mcb_llama::restore_op  op;             // LOADING: the load into the slot's sequence
    mcb_llama::restore_op  dft_op;         // LOADING: the draft's load of its own blocks, if it restores
    int64_t                t_begin_us = 0;
    int32_t                n_prompt   = 0; // for the log
};

// The server's one target context, when the bridge serves it. Written by attach and
// detach, read by the update loop (the same thread) and by /metrics (any thread, through
// mcb_llama::bridge()). The restores are the update loop's alone.
struct server_state {
    bool                  on  = false;
    llama_context *       ctx = nullptr;
    llama_context *       dft = nullptr; // the draft model's context (-md, draft-simple), if any
    mcb_llama::attachment att;
    // The draft's own registration, when the bridge serves its context too: its blocks
    // are saved beside the target's and restore with them.
    bool                  dft_on = false;
    mcb_llama::attachment dft_att;
    std::string           why_off; // with a configuration given: why the bridge does not serve ctx
    int32_t               n_swa = 0; // the window llama-server checks a slot's cache against (0: none, or --swa-full)
    std::map<int32_t, slot_restore> restores; // by sequence (slot) id
};

server_state & state() {
    static server_state s;
    return s;
}

// The bridge's /metrics text from the moment the context was last detached. While
// the server sleeps (--sleep-idle-seconds: the model is unloaded, the context
// detached) llama-server serves /metrics from a snapshot taken on entering sleep, so
// the bridge's series are the ones it had then too; attach (waking up) clears it.
// Written by detach and attach on the update loop, read by /metrics on any thread.
struct sleep_snapshot {
    std::mutex  mu;
    bool        taken = false;
    std::string text;
};

sleep_snapshot & snapshot() {
    static sleep_snapshot s;
    return s;
}

// The bridge's series as they are now: the open bridge's, or why it is off.
std::string metrics_text(const server_state & s) {
    const mcb_bridge b = s.on ? mcb_llama::bridge() : 0;
    const char * off = s.on ? nullptr : s.why_off.c_str();
    std::string text(4096, '\0');
    size_t n = mcb_metrics_text(b, off, text.data(), text.size());
    if (n >= text.size()) {
        text.assign(n + 1, '\0');
        n = std::min(mcb_metrics_text(b, off, text.data(), text.size()), text.size() - 1);
    }
    text.resize(n);
    return text;
}

int64_t now_us() {
    return ggml_time_us();
}

// The key space of a request: its tenant (or the server's) and its adapters, as the
// library canonicalizes them (adapters by file digest and scale, in any order).
struct request_scope {
    std::string               tenant;
    std::vector<mcb_adapter>  adapters;
    mcb_scope                 scope = {};
    uint8_t                   id[16] = {};
    mcb_status                status = MCB_STATUS_OK; // of mcb_scope_id: an unreadable adapter file

    request_scope(const task_params & params, const std::vector<common_adapter_lora_info> & lora) {
        tenant = params.mcb.has_tenant ? params.mcb.tenant : mcb_llama::default_tenant();
        for (const auto & a : lora) {
            adapters.push_back(mcb_adapter{a.path.c_str(), a.scale});
        }
        scope.tenant_salt     = reinterpret_cast<const uint8_t *>(tenant.data());
        scope.tenant_salt_len = tenant.size();
        scope.adapters        = adapters.empty() ? nullptr : adapters.data();
        scope.n_adapters      = adapters.size();
        status = mcb_scope_id(&scope, id);
    }
    request_scope(const request_scope &) = delete; // scope points into the members

    bool same(const mcb_llama::seq_origin & o) const {
        return o.known && std::equal(id, id + 16, o.scope);
    }
};

bool has_media(const server_tokens & tokens) {
    const llama_tokens & t = tokens.get_tokens();
    return std::find(t.begin(), t.end(), LLAMA_TOKEN_NULL) != t.end();
}

double ms_between(int64_t t0_us, int64_t t1_us) {
    return (t1_us - t0_us) / 1000.0;
}

// Why the bridge cannot serve a server with this draft context, or "". A separate draft
// model (draft-simple) reads only tokens: for a restored prefix its cache is that prefix
// decoded again, which prompt_restore does while the target's load runs. MTP, EAGLE3,
// DFlash and DSpark drafts read the target's hidden states of each token, which a
// restore does not bring.
std::string why_draft_off(const common_params & params, llama_context * dft) {
    for (const common_speculative_type t : params.speculative.types) {
        if (t == COMMON_SPECULATIVE_TYPE_DRAFT_MTP || t == COMMON_SPECULATIVE_TYPE_DRAFT_EAGLE3 ||
            t == COMMON_SPECULATIVE_TYPE_DRAFT_DFLASH || t == COMMON_SPECULATIVE_TYPE_DRAFT_DSPARK) {
            return "the draft reads the target's hidden states (MTP, EAGLE3, DFlash): a restore brings none";
        }
    }
    const std::string why = mcb_llama::why_not_plain(dft);
    return why.empty() ? "" : "the draft context: " + why;
}

// Decodes tokens[from, to) into seq_id of the draft context, in batches of its n_batch
// and without logits, as common_speculative_process decodes the target's prompt batches
// into it: the draft's cache then holds what stock's holds for those positions. Returns
// "" or why it failed.
std::string draft_prefill(llama_context * dft, int32_t seq_id, const llama_tokens & tokens, int32_t from, int32_t to) {
    const int32_t n_batch = (int32_t) llama_n_batch(dft);
    llama_batch batch = llama_batch_init(n_batch, 0, 1);
    std::string err;
    for (int32_t i = from; i < to && err.empty(); i += n_batch) {
        common_batch_clear(batch);
        for (int32_t j = i; j < std::min(to, i + n_batch); j++) {
            common_batch_add(batch, tokens[j], j, { seq_id }, false);
        }
        const int ret = llama_decode(dft, batch);
        if (ret != 0) {
            err = "llama_decode of the draft returned " + std::to_string(ret);
        }
    }
    llama_batch_free(batch);
    return err;
}

// Records the scope of a slot's sequence in the target's context and the draft's,
// which hold the same tokens.
void set_scope(const server_state & s, llama_context * ctx, int32_t seq_id, const uint8_t scope[16], bool known) {
    mcb_llama::seq_set_scope(ctx, seq_id, scope, known);
    if (s.dft_on) {
        mcb_llama::seq_set_scope(s.dft, seq_id, scope, known);
    }
}

// Starts restoring the draft's own blocks of tokens[0, p) into seq_id, beside the
// target's load, when its model is registered and its lookup restores all p of them
// (its arbiter weighs its own prefill). Returns whether the load runs; otherwise
// draft_from says from where the draft holds nothing of the prompt (0 where a start
// that failed removed its cells).
bool draft_restore_begin(server_state & s, int32_t seq_id, const request_scope & rs, const llama_tokens & tokens,
                         int32_t p, mcb_llama::restore_op & op, int32_t & draft_from) {
    if (!s.dft_on) {
        return false;
    }
    // The prompt up to p and one token more: a lookup restores whole blocks short of
    // its last token.
    mcb_lookup_result lr = {};
    if (mcb_lookup(s.dft_att.model, &rs.scope, tokens.data(), (size_t) p + 1, 0, &lr) != MCB_STATUS_OK) {
        return false;
    }
    if ((int32_t) lr.n_restore_tokens != p) {
        mcb_plan_drop(lr.plan);
        return false;
    }
    const mcb_llama::restore_result r = mcb_llama::seq_restore_begin(s.dft, s.dft_att, lr.plan, seq_id, tokens.data(), p, op);
    if (op.load == 0 && r.seq_cleared) {
        draft_from = 0;
    }
    return op.load != 0;
}

// Ends a draft's load beside the target's, which restored n of the prompt's tokens:
// the draft must hold them too, so it computes those its load did not bring. Returns
// "" or why it could not.
std::string draft_restore_end(server_state & s, int32_t seq_id, mcb_llama::restore_op & op, const llama_tokens & tokens,
                              int32_t n, mcb_request_stats & st) {
    // Positions past n that the draft's load brought go with the slot's own cut when
    // its prompt starts, as the target's unverified ones do.
    const int32_t held = std::min(mcb_llama::seq_restore_end(op).n_tokens, n);
    st.n_draft_restored = held;
    if (held >= n) {
        return "";
    }
    const int64_t t0 = now_us();
    const std::string err = draft_prefill(s.dft, seq_id, tokens, held, n);
    st.draft_prefill_ms = ms_between(t0, now_us());
    if (err.empty()) {
        st.n_draft_prefilled = n - held;
    }
    return err;
}

} // namespace

void attach(llama_context * ctx_tgt, bool has_draft, const common_params & params) {
    server_state & s = state();
    s = server_state{};
    {
        std::lock_guard<std::mutex> lk(snapshot().mu);
        snapshot().taken = false;
    }

    if (!mcb_llama::configured()) {
        return; // a stock server
    }
    // has_draft: load_model kept a draft context, the one it gave the speculative
    // decoding in params.speculative.draft.ctx_dft.
    llama_context * dft = has_draft ? params.speculative.draft.ctx_dft : nullptr;
    if (dft != nullptr) {
        s.why_off = why_draft_off(params, dft);
    }
    if (s.why_off.empty() && mcb_llama::attach(ctx_tgt, params.model.path.c_str(), s.att, s.why_off)) {
        s.on    = true;
        s.ctx   = ctx_tgt;
        s.dft   = dft;
        s.n_swa = params.swa_full ? 0 : llama_model_n_swa(llama_get_model(ctx_tgt));
    }
    if (!s.on) {
        SRV_WRN("mcbridge: off: %s\n", s.why_off.c_str());
        return;
    }
    std::string draft_note;
    if (s.dft != nullptr) {
        // The draft's KV is shared as the target's, under its own model: a restore brings
        // the draft's blocks beside the target's where they are, and the draft computes
        // what they do not cover.
        std::string why_dft;
        s.dft_on   = mcb_llama::attach(s.dft, params.speculative.draft.mparams.path.c_str(), s.dft_att, why_dft);
        draft_note = s.dft_on ? "; the draft context (" + s.dft_att.describe + ") restores its own blocks beside the target's, or computes them"
                              : "; the draft context computes what the target restores (" + why_dft + ")";
    }
    SRV_INF("mcbridge: on: %s%s\n", s.att.describe.c_str(), draft_note.c_str());
    if (params.cache_ram_mib != 0) {
        SRV_WRN("%s\n", "mcbridge: the prompt cache (--cache-ram) keeps every prefix a second time; "
                        "--cache-ram 0 (LLAMA_ARG_CACHE_RAM=0) leaves that to the bridge");
    }
}

void detach(llama_context * ctx_tgt) {
    server_state & s = state();
    if (mcb_llama::configured()) {
        std::string text = metrics_text(s);
        std::lock_guard<std::mutex> lk(snapshot().mu);
        snapshot().taken = true;
        snapshot().text  = std::move(text);
    }
    if (s.on && s.ctx == ctx_tgt) {
        // Nothing the bridge started may write into the cache once it is freed.
        for (auto & [seq_id, r] : s.restores) {
            mcb_llama::seq_restore_cancel(r.op);
            mcb_llama::seq_restore_cancel(r.dft_op);
        }
        mcb_llama::detach(ctx_tgt);
        if (s.dft_on) {
            mcb_llama::detach(s.dft);
        }
    }
    s = server_state{};
}

int32_t prompt_restore(llama_context * ctx, int32_t seq_id, const server_task & task,
                       const std::vector<common_adapter_lora_info> & lora, bool alora,
                       const server_tokens & input, server_tokens & cached, int32_t n_past,
                       mcb_request_stats & st) {
    server_state & s = state();
    if (!s.on || s.ctx != ctx) {
        return n_past;
    }
    auto computing_from = [&](int32_t n) {
        st.n_compute_start    = n;
        st.t_compute_start_us = now_us();
        return n;
    };
    // The prompt starts again after its restore (restore_pending ended it and made the
    // restored tokens the slot's cache, which the slot's own reuse found): st has it all.
    if (auto it = s.restores.find(seq_id); it != s.restores.end() && it->second.phase == slot_restore::DONE) {
        s.restores.erase(it);
        return computing_from(n_past);
    }
    st    = mcb_request_stats{};
    st.on = true;
    // Cells the bridge cannot vouch for: nothing of this sequence is published until a
    // request recomputes it from position 0.
    auto skip = [&](const char * why) {
        st.decision = "skip";
        st.reason   = why;
        set_scope(s, ctx, seq_id, nullptr, false);
        return computing_from(n_past);
    };
    if (task.type != SERVER_TASK_TYPE_COMPLETION && task.type != SERVER_TASK_TYPE_INFILL) {
        return skip("not a completion");
    }
    if (!task.params.cache_prompt) {
        return skip("cache_prompt is off");
    }
    if (alora) {
        return skip("aLoRA request");
    }
    if (has_media(input)) {
        return skip("multimodal prompt");
    }

    const int32_t n = (int32_t) input.size();
    const llama_tokens & tokens = input.get_tokens();
    const request_scope rs(task.params, lora);
    if (rs.status != MCB_STATUS_OK) {
        st.error = std::string("mcb_scope_id: ") + mcb_status_str(rs.status) + ": " + mcb_last_error();
        return skip("the request's scope cannot be keyed");
    }

    // Cells computed under another scope (a LoRA request before a base one, another
    // tenant) hold other KV: llama-server would reuse them; the bridge recomputes or
    // restores this request's own.
    // Cells llama.cpp loaded itself (a slot file, the prompt cache, a checkpoint) carry
    // the scope they were saved under (mcb_llama::seq_state_read); cells of no known
    // scope count as another scope's.
    const mcb_llama::seq_origin origin = mcb_llama::seq_get_origin(ctx, seq_id);
    int32_t n_own = n_past;
    const char * scope_rule = nullptr; // why the slot's own cells were not reused
    if (n_past > 0 && !rs.same(origin)) {
        n_own = 0;
        scope_rule = origin.known ? "the slot's cells were computed under another scope"
                                  : "the slot's cells are of no known scope";
    }
    set_scope(s, ctx, seq_id, rs.id, true);
    auto keep_own = [&]() {
        if (n_own < n_past) {
            cached.keep_first(n_own);
        }
        return computing_from(n_own);
    };

    const int64_t t0 = now_us();
    mcb_lookup_result lr = {};
    const mcb_status st_lookup = mcb_lookup(s.att.model, &rs.scope, tokens.data(), (size_t) n, (size_t) n_own, &lr);
    st.lookup_ms = ms_between(t0, now_us());
    if (st_lookup != MCB_STATUS_OK) {
        st.decision = "failed";
        st.reason   = scope_rule != nullptr ? scope_rule : "";
        st.error    = std::string("mcb_lookup: ") + mcb_status_str(st_lookup) + ": " + mcb_last_error();
        return keep_own();
    }
    st.n_matched        = (int32_t) (lr.n_matched_blocks * lr.n_block_tokens);
    // The rule that decided: the arbiter's, unless the slot's own cells were set aside
    // and nothing was restored in their place.
    st.reason = scope_rule != nullptr && lr.n_restore_tokens == 0 ? scope_rule : mcb_reason_str((mcb_reason) lr.reason);
    st.est_restore_ms   = lr.est_restore_ms;
    st.est_recompute_ms = lr.est_recompute_ms;
    const int32_t p = (int32_t) lr.n_restore_tokens;
    if (p == 0) {
        st.decision = lr.reason == MCB_REASON_LOCAL ? "local" : lr.n_matched_blocks > 0 ? "recompute" : "miss";
        return keep_own();
    }

    slot_restore sr;
    sr.task_id    = task.id;
    sr.t_begin_us = now_us();
    sr.n_prompt   = n;
    std::copy(rs.id, rs.id + 16, sr.scope);
    const mcb_llama::restore_result r = mcb_llama::seq_restore_begin(ctx, s.att, lr.plan, seq_id, tokens.data(), p, sr.op);
    if (sr.op.load == 0) {
        st.restore_ms = ms_between(sr.t_begin_us, now_us());
        st.decision   = "failed";
        st.error      = r.error;
        SRV_WRN("mcbridge: restore of %d tokens into seq %d could not start, computing instead: %s\n",
                p, seq_id, r.error.c_str());
        if (r.seq_cleared) {
            cached.keep_first(0);
            return computing_from(0);
        }
        return keep_own();
    }
    int32_t draft_from = n_own;
    if (s.dft != nullptr && !draft_restore_begin(s, seq_id, rs, tokens, p, sr.dft_op, draft_from)) {
        // The draft computes [draft_from, p) while the target's load runs; its cells
        // past draft_from are another prompt's. Positions the load does not verify the
        // slot's own seq_rm takes from both contexts when its prompt starts.
        const int64_t t_dft = now_us();
        std::string err = llama_memory_seq_rm(llama_get_memory(s.dft), seq_id, draft_from, -1)
                              ? draft_prefill(s.dft, seq_id, tokens, draft_from, p)
                              : "the draft's cells past its own prefix cannot be removed";
        st.draft_prefill_ms = ms_between(t_dft, now_us());
        if (err.empty() && s.dft_on && p > draft_from) {
            mcb_model_observe_prefill(s.dft_att.model, (uint32_t) draft_from, (uint32_t) p, st.draft_prefill_ms / 1000.0);
        }
        if (!err.empty()) {
            mcb_llama::seq_restore_cancel(sr.op);
            st.restore_ms = ms_between(sr.t_begin_us, now_us());
            st.decision   = "failed";
            st.error      = "draft: " + err;
            SRV_WRN("mcbridge: the draft of seq %d could not compute the restored prefix, computing instead: %s\n",
                    seq_id, err.c_str());
            cached.keep_first(0); // the load's cancel left the target's sequence empty
            return computing_from(0);
        }
        st.n_draft_prefilled = p - draft_from;
    }
    // The sequence holds the load's cells and nothing else; the slot waits for them.
    cached.keep_first(0);
    s.restores.insert_or_assign(seq_id, std::move(sr));
    return RESTORING;
}

bool restore_pending(llama_context * ctx, int32_t seq_id, const server_task & task,
                     const server_tokens & input, server_tokens & cached,
                     std::list<common_prompt_checkpoint> & checkpoints, mcb_request_stats & st) {
    server_state & s = state();
    auto it = s.restores.find(seq_id);
    if (!s.on || s.ctx != ctx || it == s.restores.end() || it->second.phase != slot_restore::LOADING) {
        return false;
    }
    slot_restore & sr = it->second;
    if (sr.task_id != task.id) {
        // The slot went on to another task without a release; never seen, but its
        // sequence must not keep a load's cells.
        mcb_llama::seq_restore_cancel(sr.op);
        mcb_llama::seq_restore_cancel(sr.dft_op);
        cached.keep_first(0);
        s.restores.erase(it);
        return false;
    }
    if (!mcb_llama::seq_restore_poll(sr.op, 0) || !mcb_llama::seq_restore_poll(sr.dft_op, 0)) {
        return true;
    }
    mcb_llama::restore_result r = mcb_llama::seq_restore_end(sr.op);
    const llama_tokens & tokens = input.get_tokens();
    if (sr.dft_op.load != 0) {
        // The draft must hold what the target holds.
        const std::string err = draft_restore_end(s, seq_id, sr.dft_op, tokens, std::max(r.n_tokens, 0), st);
        if (!err.empty() && r.n_tokens > 0) {
            llama_memory_seq_rm(llama_get_memory(ctx), seq_id, -1, -1);
            r.n_tokens = 0;
            r.error    = "draft: " + err;
        }
    }
    sr.phase      = slot_restore::DONE;
    st.restore_ms = ms_between(sr.t_begin_us, now_us());
    cached.keep_first(0);
    if (r.n_tokens <= 0) {
        st.decision = "failed";
        st.error    = r.error;
        SRV_WRN("mcbridge: restore of seq %d failed after %.2f ms, computing instead: %s\n",
                seq_id, st.restore_ms, r.error.c_str());
        return false;
    }
    // The sequence now holds exactly input[0, r.n_tokens), computed under its scope.
    set_scope(s, ctx, seq_id, sr.scope, true);
    for (int32_t i = 0; i < r.n_tokens; i++) {
        cached.push_back(tokens[i]);
    }
    if (!r.partial.empty()) {
        // The state at P = r.n_tokens as a context checkpoint, for llama-server's check of
        // a window that follows: a window state holds the last n_swa positions, and the
        // check asks for a checkpoint unless the cache holds one more. It takes one whose
        // pos_min is 0 (a restored prefix covers every position from 0) and goes on from
        // max(pos_min + 1, pos_max). Stock, from its own cache at P, goes on from P, but
        // from P - 1 where the window covers the whole prefix (the check's threshold is
        // then 0, which no cache passes, and its own checkpoint of P resumes at P - 1):
        // the restore goes on where stock would. Checkpoints past it were another prompt's.
        const llama_pos resume = r.n_tokens > s.n_swa ? r.n_tokens : r.n_tokens - 1;
        checkpoints.remove_if([&](const common_prompt_checkpoint & c) { return c.pos_max >= resume; });
        common_prompt_checkpoint & c = checkpoints.emplace_back();
        c.id_task  = task.id;
        c.update_pos(r.n_tokens, 0, resume);
        c.data_tgt = std::move(r.partial);
    }
    st.decision       = "restore";
    st.n_restored     = r.n_tokens;
    st.restored_bytes = r.n_bytes;
    st.restored_snapshot_bytes = r.n_snapshot_bytes;
    SRV_INF("mcbridge: seq %d restored %d of %d prompt tokens (%.1f MiB) in %.2f ms (lookup %.3f ms, %s)\n",
            seq_id, r.n_tokens, sr.n_prompt, r.n_bytes / 1048576.0, st.restore_ms, st.lookup_ms, st.reason.c_str());
    return false;
}

void slot_released(int32_t seq_id) {
    server_state & s = state();
    auto it = s.restores.find(seq_id);
    if (it == s.restores.end()) {
        return;
    }
    mcb_llama::seq_restore_cancel(it->second.op); // a no-op once the load has ended
    mcb_llama::seq_restore_cancel(it->second.dft_op);
    s.restores.erase(it);
}

void restores_wait() {
    // A restore's layers are verified within its deadline, tens of milliseconds at
    // most by default; 2 ms keeps a new request's wait for the loop as short.
    constexpr uint32_t k_wait_us = 2000;
    for (auto & [seq_id, r] : state().restores) {
        if (r.phase == slot_restore::LOADING) {
            mcb_llama::seq_restore_poll(r.op, k_wait_us);
            return;
        }
    }
}

namespace {

// Whether the slot's memory holds the state after its first n tokens, computed by this
// prompt from position 0 under its scope, at a snapshot point the prompt computed up to
// (a restore's end is one the swarm has already).
bool snapshot_due(const server_state & s, llama_context * ctx, int32_t n, const mcb_request_stats & st) {
    const uint32_t every = s.att.snapshot_tokens;
    return s.on && s.ctx == ctx && every > 0 && st.on && st.decision != "skip" && n > st.n_compute_start &&
           n % (int32_t) every == 0;
}

// Snapshots the slot's partial state after its first n tokens.
void snapshot(server_state & s, llama_context * ctx, int32_t seq_id, const server_task & task,
              const std::vector<common_adapter_lora_info> & lora, const server_tokens & tokens, int32_t n,
              mcb_request_stats & st) {
    const request_scope rs(task.params, lora);
    const mcb_llama::seq_origin origin = mcb_llama::seq_get_origin(ctx, seq_id);
    if (rs.status != MCB_STATUS_OK || !rs.same(origin) || origin.clean_end < n || (int32_t) tokens.size() < n) {
        return; // not this request's scope's clean KV: nothing to publish under it
    }
    std::string err;
    if (mcb_llama::seq_snapshot(ctx, s.att, &rs.scope, seq_id, tokens.get_tokens().data(), n, err) != MCB_STATUS_OK) {
        SRV_WRN("mcbridge: snapshot of seq %d after %d tokens failed: %s\n", seq_id, n, err.c_str());
        return;
    }
    st.snapshots++;
}

} // namespace

bool cut_batch(llama_context * ctx, int32_t n_cached, int32_t n_prompt, const mcb_request_stats & st) {
    return n_cached < n_prompt && snapshot_due(state(), ctx, n_cached, st);
}

void prompt_batched(llama_context * ctx, int32_t seq_id, const server_task & task,
                    const std::vector<common_adapter_lora_info> & lora, const server_tokens & tokens,
                    int32_t n_start, mcb_request_stats & st) {
    server_state & s = state();
    if (snapshot_due(s, ctx, n_start, st)) {
        snapshot(s, ctx, seq_id, task, lora, tokens, n_start, st);
    }
}

void prompt_save(llama_context * ctx, int32_t seq_id, const server_task & task,
                 const std::vector<common_adapter_lora_info> & lora, const server_tokens & tokens,
                 mcb_request_stats & st) {
    server_state & s = state();
    if (!s.on || s.ctx != ctx || !st.on || st.decision == "skip") {
        return;
    }
    const int32_t n = (int32_t) tokens.size();
    const int64_t t0 = now_us();
    if (n > st.n_compute_start && st.t_compute_start_us > 0) {
        mcb_model_observe_prefill(s.att.model, (uint32_t) st.n_compute_start, (uint32_t) n,
                                  (t0 - st.t_compute_start_us) / 1e6);
    }
    const request_scope rs(task.params, lora);
    if (rs.status != MCB_STATUS_OK || !rs.same(mcb_llama::seq_get_origin(ctx, seq_id))) {
        return; // the cells are not this request's scope's: nothing to publish under it
    }
    if (snapshot_due(s, ctx, n, st)) {
        snapshot(s, ctx, seq_id, task, lora, tokens, n, st);
    }
    const mcb_llama::save_result r = mcb_llama::seq_save(ctx, s.att, &rs.scope, seq_id, tokens.get_tokens().data(), n);
    if (s.dft_on && rs.same(mcb_llama::seq_get_origin(s.dft, seq_id))) {
        // The draft's sequence holds the same prompt: llama-server decodes each batch of
        // the target's into it (its clean mark says how much of it).
        const mcb_llama::save_result rd = mcb_llama::seq_save(s.dft, s.dft_att, &rs.scope, seq_id, tokens.get_tokens().data(), n);
        if (rd.status != MCB_STATUS_OK) {
            SRV_WRN("mcbridge: save of the draft's seq %d failed: %s\n", seq_id, rd.error.c_str());
        }
    }
    st.save_ms      = ms_between(t0, now_us());
    st.saved_blocks = r.blocks.n_written;
    if (r.status != MCB_STATUS_OK) {
        SRV_WRN("mcbridge: save of seq %d failed: %s\n", seq_id, r.error.c_str());
    } else if (r.blocks.n_written > 0) {
        SRV_INF("mcbridge: seq %d saved %u new blocks (%u queued for the directory, %u known) of %d clean tokens in %.2f ms\n",
                seq_id, r.blocks.n_written, r.blocks.n_queued, r.blocks.n_known, r.n_tokens, st.save_ms);
    }
}

void answer_ready(const mcb_request_stats & st) {
    // An etcd put takes about a millisecond; a directory slower than this is failing,
    // and the answer does not wait on it.
    constexpr uint32_t k_wait_ms = 50;
    if (!st.on || (st.saved_blocks == 0 && st.snapshots == 0)) {
        return;
    }
    const mcb_status s = mcb_bridge_wait_published(mcb_llama::bridge(), k_wait_ms);
    if (s != MCB_STATUS_OK) {
        SRV_DBG("mcbridge: answer sent before its blocks were published: %s\n", mcb_last_error());
    }
}

void add_outcome(const mcb_request_stats & st, json & res) {
    if (!st.on) {
        return;
    }
    json o = {
        {"decision",         st.decision},
        {"reason",           st.reason},
        {"matched_n",        st.n_matched},
        {"restored_n",       st.n_restored},
        {"restored_bytes",   st.restored_bytes},
        {"lookup_ms",        st.lookup_ms},
        {"restore_ms",       st.restore_ms},
        {"est_restore_ms",   st.est_restore_ms},
        {"est_recompute_ms", st.est_recompute_ms},
        {"saved_blocks",     st.saved_blocks},
        {"save_ms",          st.save_ms},
    };
    if (st.snapshots > 0) {
        o["snapshots"] = st.snapshots;
    }
    if (st.restored_snapshot_bytes > 0) {
        o["restored_snapshot_bytes"] = st.restored_snapshot_bytes;
    }
    if (st.n_draft_prefilled > 0) {
        o["draft_prefilled_n"] = st.n_draft_prefilled;
        o["draft_prefill_ms"]  = st.draft_prefill_ms;
    }
    if (st.n_draft_restored > 0) {
        o["draft_restored_n"] = st.n_draft_restored;
    }
    if (!st.error.empty()) {
        o["error"] = st.error;
    }
    res["mcbridge"] = std::move(o);
}

void add_metrics(std::ostream & out) {
    if (!mcb_llama::configured()) {
        return; // a stock server
    }
    {
        std::lock_guard<std::mutex> lk(snapshot().mu);
        if (snapshot().taken) {
            out << snapshot().text;
            return;
        }
    }
    out << metrics_text(state());
}

server_schema::field * tenant_field() {
    return (new server_schema::field_str("mcb_tenant"))
        ->set_desc("mcbridge: tenant salt of this request's KV blocks; requests of different tenants never share them")
        ->set_handler([](server_schema::field_eval_context & ctx, const json & data) {
            ctx.params.mcb.tenant     = data.at("mcb_tenant").get<std::string>();
            ctx.params.mcb.has_tenant = true;
        });
}

} // namespace mcb_server
