// server-mcbridge-types.h: the per-request data llama-server carries for mcbridge.
// Plain structs, so that server-common.h and server-task.h can hold them as members
// (llama-patches/0004-mcbridge-server-request-fields.patch) without pulling the bridge's
// headers into every server file.
#pragma once

#include <cstdint>
#include <string>

// What a request asks of the bridge (task_params::mcb).
struct mcb_request_params {
    bool        has_tenant = false;
    std::string tenant; // "mcb_tenant": separates this request's KV from other tenants'
};

// What the bridge did for one prompt (server_slot_stats::mcb), reported in the
// response's "mcbridge" object.
struct mcb_request_stats {
    bool        on = false;       // the bridge serves this server's context
    std::string decision;         // restore, recompute, miss, local, failed, skip
    std::string reason;           // the arbiter's reason, or why the bridge was skipped
    std::string error;            // why a restore failed
    int32_t     n_matched      = 0; // leading prompt tokens found in the cache
    int32_t     n_restored     = 0; // leading prompt tokens restored
    uint64_t    restored_bytes = 0;
    uint64_t    restored_snapshot_bytes = 0; // of them, the snapshot's
    double      lookup_ms      = 0.0;
    double      restore_ms     = 0.0;
    double      est_restore_ms   = 0.0;
    double      est_recompute_ms = 0.0;
    uint32_t    saved_blocks     = 0; // blocks this prompt copied into the pool
    uint32_t    snapshots        = 0; // partial states it snapshotted (sliding-window, hybrid)
    uint32_t    published_blocks = 0;
    double      save_ms          = 0.0;
    // with a draft model: the prompt tokens its context computed during the restore,
    // and those it restored from its own blocks beside the target's
    int32_t     n_draft_prefilled = 0;
    double      draft_prefill_ms  = 0.0;
    int32_t     n_draft_restored  = 0;

    // where the computed remainder of the prompt starts, for the arbiter's calibration
    int32_t     n_compute_start    = 0;
    int64_t     t_compute_start_us = 0;
};
