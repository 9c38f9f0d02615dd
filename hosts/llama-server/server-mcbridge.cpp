// llama-server's use of the bridge. See server-mcbridge.h.
#include "server-mcbridge.h"

#include "llama-mcbridge.h"

#include <algorithm>
#include <cstdio>
#include <string>

namespace mcb_server {

namespace {

// The server's one target context, when the bridge serves it. Written by attach and
// detach, read by the update loop (the same thread) and by /metrics (any thread, through
// mcb_llama::bridge()).
struct server_state {
    bool                  on  = false;
    llama_context *       ctx = nullptr;
    mcb_llama::attachment att;
};

server_state & state() {
    static server_state s;
    return s;
}

int64_t now_us() {
    return ggml_time_us();
}

// The key space of a request: its tenant (or the server's) and its adapters. The
// adapter set is canonical (sorted "path@scale", zero scales left out) so that the same
// set in another order, or on another server, names the same KV.
struct request_scope {
    std::string tenant;
    std::string adapters;
    mcb_scope   scope = {};

    request_scope(const task_params & params, const std::vector<common_adapter_lora_info> & lora) {
        tenant = params.mcb.has_tenant ? params.mcb.tenant : mcb_llama::default_tenant();
        std::vector<std::string> parts;
        for (const auto & a : lora) {
            if (a.scale != 0.0f) {
                char scale[32];
                snprintf(scale, sizeof scale, "%.9g", a.scale);
                parts.push_back(a.path + "@" + scale);
            }
        }
        std::sort(parts.begin(), parts.end());
        for (const auto & p : parts) {
            adapters += (adapters.empty() ? "" : ";") + p;
        }
        scope.tenant_salt     = reinterpret_cast<const uint8_t *>(tenant.data());
        scope.tenant_salt_len = tenant.size();
        scope.adapters        = adapters.empty() ? nullptr : adapters.c_str();
    }
    request_scope(const request_scope &) = delete; // scope points into the strings
};

bool has_media(const server_tokens & tokens) {
    const llama_tokens & t = tokens.get_tokens();
    return std::find(t.begin(), t.end(), LLAMA_TOKEN_NULL) != t.end();
}

// A restore replaces the slot's own prefix [0, n_past) with [0, p): worth it only when
// computing [n_past, p) here costs more than restoring p tokens. The lookup estimates the
// whole prompt (est_recompute_ms) and the plan that restores p (est_restore_ms, which
// includes computing [p, n)); per-token costs taken from them are linear, which is
// enough to see that a few missing tokens are cheaper to compute than a long restore.
bool local_is_cheaper(const mcb_lookup_result & lr, int32_t n, int32_t p, int32_t n_past) {
    if (n_past <= 0 || lr.est_recompute_ms <= 0.0) {
        return false;
    }
    const double per_token  = lr.est_recompute_ms / n;
    const double restore_ms = lr.est_restore_ms - per_token * (n - p);
    return per_token * (p - n_past) < restore_ms;
}

double ms_between(int64_t t0_us, int64_t t1_us) {
    return (t1_us - t0_us) / 1000.0;
}

} // namespace

void attach(llama_context * ctx_tgt, bool has_draft, const common_params & params) {
    server_state & s = state();
    s = server_state{};

    std::string why;
    if (has_draft) {
        // The draft context would need the same prefix in its own cache.
        why = "a draft model is in use";
    } else {
        // Server-wide settings that change the KV bytes of every request; per-request
        // LoRA scales go into each request's scope instead.
        std::string extra;
        for (const auto & cv : params.control_vectors) {
            char strength[32];
            snprintf(strength, sizeof strength, "%.9g", cv.strength);
            extra += "cvec=" + cv.fname + "@" + strength + ";";
        }
        if (!params.control_vectors.empty()) {
            extra += "cvec_layers=" + std::to_string(params.control_vector_layer_start) + ".." +
                     std::to_string(params.control_vector_layer_end);
        }
        if (mcb_llama::attach(ctx_tgt, params.model.path.c_str(), extra, s.att, why)) {
            s.on  = true;
            s.ctx = ctx_tgt;
        }
    }
    if (!s.on) {
        SRV_INF("mcbridge: off: %s\n", why.c_str());
        return;
    }
    SRV_INF("mcbridge: on: %s\n", s.att.describe.c_str());
    if (params.cache_ram_mib != 0) {
        SRV_WRN("%s\n", "mcbridge: the prompt cache (--cache-ram) keeps every prefix a second time; "
                        "--cache-ram 0 leaves that to the bridge");
    }
}

void detach(llama_context * ctx_tgt) {
    server_state & s = state();
    if (s.on && s.ctx == ctx_tgt) {
        mcb_llama::detach(ctx_tgt);
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
    st    = mcb_request_stats{};
    st.on = true;
    auto computing_from = [&](int32_t n) {
        st.n_compute_start    = n;
        st.t_compute_start_us = now_us();
        return n;
    };
    auto skip = [&](const char * why) {
        st.decision = "skip";
        st.reason   = why;
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

    const int64_t t0 = now_us();
    mcb_lookup_result lr = {};
    const mcb_status st_lookup = mcb_lookup(s.att.model, &rs.scope, tokens.data(), (size_t) n, &lr);
    st.lookup_ms = ms_between(t0, now_us());
    if (st_lookup != MCB_STATUS_OK) {
        st.decision = "failed";
        st.error    = std::string("mcb_lookup: ") + mcb_status_str(st_lookup) + ": " + mcb_last_error();
        return computing_from(n_past);
    }
    st.n_matched        = (int32_t) (lr.n_matched_blocks * lr.n_block_tokens);
    st.reason           = mcb_reason_str((mcb_reason) lr.reason);
    st.est_restore_ms   = lr.est_restore_ms;
    st.est_recompute_ms = lr.est_recompute_ms;

    // The last prompt token is always computed: its logits start the generation.
    int32_t p = std::min<int32_t>((int32_t) lr.n_restore_tokens, n - 1);
    if (lr.n_block_tokens > 0) {
        p -= p % (int32_t) lr.n_block_tokens;
    }
    if (p <= 0) {
        st.decision = lr.n_matched_blocks > 0 ? "recompute" : "miss";
        return computing_from(n_past);
    }
    if (p <= n_past || local_is_cheaper(lr, n, p, n_past)) {
        st.decision = "local"; // the slot's own cache holds as much, or nearly
        return computing_from(n_past);
    }

    const int64_t t1 = now_us();
    const mcb_llama::restore_result r = mcb_llama::seq_restore(ctx, s.att, &rs.scope, seq_id, tokens.data(), p);
    st.restore_ms = ms_between(t1, now_us());
    if (r.n_tokens <= 0) {
        st.decision = "failed";
        st.error    = r.error;
        SRV_WRN("mcbridge: restore of %d tokens into seq %d failed after %.2f ms, computing instead: %s\n",
                p, seq_id, st.restore_ms, r.error.c_str());
        if (r.seq_cleared) {
            cached.keep_first(0);
            return computing_from(0);
        }
        return computing_from(n_past);
    }
    // The sequence now holds exactly input[0, r.n_tokens).
    cached.keep_first(0);
    for (int32_t i = 0; i < r.n_tokens; i++) {
        cached.push_back(tokens[i]);
    }
    st.decision       = "restore";
    st.n_restored     = r.n_tokens;
    st.restored_bytes = r.n_bytes;
    SRV_INF("mcbridge: seq %d restored %d of %d prompt tokens (%.1f MiB) in %.2f ms (lookup %.3f ms, %s)\n",
            seq_id, r.n_tokens, n, r.n_bytes / 1048576.0, st.restore_ms, st.lookup_ms, st.reason.c_str());
    return computing_from(r.n_tokens);
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
    const mcb_llama::save_result r = mcb_llama::seq_save(ctx, s.att, &rs.scope, seq_id, tokens.get_tokens().data(), n);
    st.save_ms          = ms_between(t0, now_us());
    st.saved_blocks     = r.blocks.n_written;
    st.published_blocks = r.blocks.n_published;
    if (r.status != MCB_STATUS_OK) {
        SRV_WRN("mcbridge: save of seq %d failed: %s\n", seq_id, r.error.c_str());
    } else if (r.blocks.n_written > 0) {
        SRV_INF("mcbridge: seq %d saved %u new blocks (%u published, %u known) of %d clean tokens in %.2f ms\n",
                seq_id, r.blocks.n_written, r.blocks.n_published, r.blocks.n_known, r.n_tokens, st.save_ms);
    }
}

void add_timings(const mcb_request_stats & st, json & timings) {
    if (!st.on) {
        return;
    }
    timings["mcb_decision"]         = st.decision;
    timings["mcb_reason"]           = st.reason;
    timings["mcb_matched_n"]        = st.n_matched;
    timings["mcb_restored_n"]       = st.n_restored;
    timings["mcb_restored_bytes"]   = st.restored_bytes;
    timings["mcb_lookup_ms"]        = st.lookup_ms;
    timings["mcb_restore_ms"]       = st.restore_ms;
    timings["mcb_est_restore_ms"]   = st.est_restore_ms;
    timings["mcb_est_recompute_ms"] = st.est_recompute_ms;
    timings["mcb_saved_blocks"]     = st.saved_blocks;
    timings["mcb_save_ms"]          = st.save_ms;
    if (!st.error.empty()) {
        timings["mcb_error"] = st.error;
    }
}

void add_metrics(std::ostream & out) {
    const mcb_bridge b = mcb_llama::bridge();
    mcb_stats st = {};
    if (b == 0 || mcb_bridge_stats(b, &st) != MCB_STATUS_OK) {
        return;
    }
    struct item {
        const char * name;
        const char * type;
        const char * help;
        uint64_t     value;
    };
    const item items[] = {
        {"lookups_total",           "counter", "Prompt lookups",                                   st.lookups},
        {"hits_total",              "counter", "Lookups that matched at least one block",          st.hits},
        {"misses_total",            "counter", "Lookups that matched nothing",                     st.misses},
        {"decided_restore_total",   "counter", "Lookups the arbiter decided to restore",           st.decided_restore},
        {"decided_recompute_total", "counter", "Matched lookups the arbiter decided to recompute",  st.decided_recompute},
        {"loads_total",             "counter", "Restores started",                                 st.loads},
        {"load_failures_total",     "counter", "Restores that failed, in part or in whole",        st.load_failures},
        {"restored_tokens_total",   "counter", "Prompt tokens restored",                           st.restored_tokens},
        {"restored_bytes_total",    "counter", "KV bytes restored",                                st.restored_bytes},
        {"saves_total",             "counter", "Saves",                                            st.saves},
        {"save_failures_total",     "counter", "Saves that failed",                                st.save_failures},
        {"saved_blocks_total",      "counter", "Blocks copied into the pool",                      st.saved_blocks},
        {"deduped_blocks_total",    "counter", "Saved blocks another process published first",     st.deduped_blocks},
        {"evictions_total",         "counter", "Blocks evicted from the pool",                     st.evictions},
        {"directory_errors_total",  "counter", "Failed directory calls",                           st.directory_errors},
        {"torn_reads_total",        "counter", "Block reads that changed under the reader",        st.torn_reads},
        {"resident_blocks",         "gauge",   "Blocks this process holds",                        st.resident_blocks},
        {"resident_bytes",          "gauge",   "Bytes of the blocks this process holds",           st.resident_bytes},
        {"pool_bytes",              "gauge",   "Size of this process's block pool",                st.pool_bytes},
    };
    for (const item & it : items) {
        out << "# HELP mcbridge_" << it.name << " " << it.help << "\n"
            << "# TYPE mcbridge_" << it.name << " " << it.type << "\n"
            << "mcbridge_" << it.name << " " << it.value << "\n";
    }
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
