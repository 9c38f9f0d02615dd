/*
 * The public functions of include/mcbridge.h, as shims over the Go exports
 * of this package (declared in the cgo-generated _cgo_export.h). The shims
 * own what Go cannot express: const-correct prototypes, enums, static
 * strings, and a thread-local error buffer each call fills.
 *
 * cgo compiles this file, beside the exports it calls, into libmcbridge.a.
 */
#include <stddef.h>
#include <stdint.h>

#include "mcbridge.h"
#include "_cgo_export.h"

/* The Go mirrors in bridge/mirror.go assume these layouts;
 * mirror_test.go asserts the same numbers on the Go side. */
_Static_assert(sizeof(struct mcb_model_params) == 48, "mcb_model_params size");
_Static_assert(offsetof(struct mcb_model_params, block_tokens) == 16, "mcb_model_params.block_tokens");
_Static_assert(offsetof(struct mcb_model_params, extra) == 24, "mcb_model_params.extra");
_Static_assert(offsetof(struct mcb_model_params, partial_state) == 32, "mcb_model_params.partial_state");
_Static_assert(offsetof(struct mcb_model_params, partial_kv_streams) == 40, "mcb_model_params.partial_kv_streams");
_Static_assert(sizeof(struct mcb_kv_format) == 56, "mcb_kv_format size");
_Static_assert(offsetof(struct mcb_kv_format, n_embd_k_gqa) == 8, "mcb_kv_format.n_embd_k_gqa");
_Static_assert(offsetof(struct mcb_kv_format, type_k) == 40, "mcb_kv_format.type_k");
_Static_assert(offsetof(struct mcb_kv_format, v_trans) == 48, "mcb_kv_format.v_trans");
_Static_assert(sizeof(struct mcb_adapter) == 16, "mcb_adapter size");
_Static_assert(offsetof(struct mcb_adapter, scale) == 8, "mcb_adapter.scale");
_Static_assert(sizeof(struct mcb_scope) == 32, "mcb_scope size");
_Static_assert(offsetof(struct mcb_scope, n_adapters) == 24, "mcb_scope.n_adapters");
_Static_assert(sizeof(struct mcb_kv_layer) == 32, "mcb_kv_layer size");
_Static_assert(sizeof(struct mcb_kv_layout) == 32, "mcb_kv_layout size");
_Static_assert(offsetof(struct mcb_kv_layout, location) == 16, "mcb_kv_layout.location");
_Static_assert(offsetof(struct mcb_kv_layout, layers) == 24, "mcb_kv_layout.layers");
_Static_assert(sizeof(struct mcb_lookup_result) == 48, "mcb_lookup_result size");
_Static_assert(offsetof(struct mcb_lookup_result, plan) == 40, "mcb_lookup_result.plan");
_Static_assert(sizeof(struct mcb_load_result) == 24, "mcb_load_result size");
_Static_assert(sizeof(struct mcb_save_result) == 16, "mcb_save_result size");
_Static_assert(sizeof(struct mcb_stats) == 20 * 8, "mcb_stats size");

static _Thread_local char mcb_error[1024];

#define ERR mcb_error, (GoUint64)sizeof mcb_error

uint32_t mcb_abi_version(void) { return MCB_ABI_VERSION; }

const char *mcb_llama_version(void) { return mcbgo_llama_version(); }

const char *mcb_status_str(mcb_status status) {
    switch (status) {
    case MCB_STATUS_OK:             return "ok";
    case MCB_STATUS_INVALID_ARG:    return "invalid argument";
    case MCB_STATUS_BAD_HANDLE:     return "bad handle";
    case MCB_STATUS_CONFIG:         return "bad configuration";
    case MCB_STATUS_MODEL_MISMATCH: return "model mismatch";
    case MCB_STATUS_LAYOUT:         return "bad KV layout";
    case MCB_STATUS_STATE:          return "call out of order";
    case MCB_STATUS_NOT_FOUND:      return "not found";
    case MCB_STATUS_TRANSFER:       return "transfer failed";
    case MCB_STATUS_CORRUPT:        return "block failed verification";
    case MCB_STATUS_TIMEOUT:        return "timed out";
    case MCB_STATUS_POOL_FULL:      return "pool full";
    case MCB_STATUS_DIRECTORY:      return "directory unavailable";
    case MCB_STATUS_UNSUPPORTED:    return "unsupported";
    case MCB_STATUS_INTERNAL:       return "internal error";
    }
    return "unknown status";
}

const char *mcb_reason_str(mcb_reason reason) {
    switch (reason) {
    case MCB_REASON_NO_MATCH:          return "no match";
    case MCB_REASON_TOO_SHORT:         return "too short";
    case MCB_REASON_RESTORE:           return "restore";
    case MCB_REASON_RECOMPUTE_CHEAPER: return "recompute cheaper";
    case MCB_REASON_POLICY_FORCED:     return "policy forced";
    case MCB_REASON_INVALID_INPUT:     return "invalid input";
    case MCB_REASON_LOCAL:             return "local";
    }
    return "unknown reason";
}

const char *mcb_last_error(void) { return mcb_error; }

mcb_status mcb_bridge_open(const char *config_json, mcb_bridge *out) {
    return (mcb_status)mcbgo_bridge_open((void *)config_json, out, ERR);
}

mcb_status mcb_bridge_close(mcb_bridge bridge) {
    return (mcb_status)mcbgo_bridge_close(bridge, ERR);
}

mcb_status mcb_bridge_stats(mcb_bridge bridge, struct mcb_stats *out) {
    return (mcb_status)mcbgo_bridge_stats(bridge, out, ERR);
}

mcb_status mcb_bridge_wait_published(mcb_bridge bridge, uint32_t timeout_ms) {
    return (mcb_status)mcbgo_bridge_wait_published(bridge, timeout_ms, ERR);
}

size_t mcb_metrics_text(mcb_bridge bridge, const char *off_reason, char *buf, size_t cap) {
    return (size_t)mcbgo_metrics_text(bridge, (void *)off_reason, buf, cap);
}

size_t mcb_probe_tokens(int32_t *out, size_t cap) {
    return (size_t)mcbgo_probe_tokens(out, cap);
}

mcb_status mcb_model_register(mcb_bridge bridge, const struct mcb_model_params *params,
                              const struct mcb_kv_format *format,
                              const struct mcb_kv_layout *probe_kv, const uint32_t *probe_cells,
                              mcb_model *out) {
    return (mcb_status)mcbgo_model_register(bridge, (void *)params, (void *)format, (void *)probe_kv,
                                            (void *)probe_cells, out, ERR);
}

mcb_status mcb_model_register_state(mcb_bridge bridge, const struct mcb_model_params *params,
                                    const uint8_t *probe_state, size_t n_bytes, mcb_model *out) {
    return (mcb_status)mcbgo_model_register_state(bridge, (void *)params, (void *)probe_state, n_bytes, out, ERR);
}

mcb_status mcb_model_unregister(mcb_model model) {
    return (mcb_status)mcbgo_model_unregister(model, ERR);
}

mcb_status mcb_model_observe_prefill(mcb_model model, uint32_t pos_start, uint32_t pos_end, double seconds) {
    return (mcb_status)mcbgo_model_observe_prefill(model, pos_start, pos_end, seconds, ERR);
}

mcb_status mcb_scope_id(const struct mcb_scope *scope, uint8_t out[16]) {
    return (mcb_status)mcbgo_scope_id((void *)scope, out, ERR);
}

mcb_status mcb_lookup(mcb_model model, const struct mcb_scope *scope,
                      const int32_t *tokens, size_t n_tokens, size_t n_cached,
                      struct mcb_lookup_result *out) {
    return (mcb_status)mcbgo_lookup(model, (void *)scope, (void *)tokens, n_tokens, n_cached, out, ERR);
}

mcb_status mcb_plan_drop(mcb_plan plan) {
    return (mcb_status)mcbgo_plan_drop(plan, ERR);
}

mcb_status mcb_load_begin(mcb_plan plan, const struct mcb_kv_layout *layout,
                          const uint32_t *cells, mcb_load *out) {
    return (mcb_status)mcbgo_load_begin(plan, (void *)layout, (void *)cells, out, ERR);
}

mcb_status mcb_load_wait_layer(mcb_load load, uint32_t il, uint32_t *n_tokens_ok) {
    return (mcb_status)mcbgo_load_wait_layer(load, il, n_tokens_ok, ERR);
}

mcb_status mcb_load_progress(mcb_load load, uint32_t *n_layers, uint32_t *n_tokens_ok) {
    return (mcb_status)mcbgo_load_progress(load, n_layers, n_tokens_ok, ERR);
}

mcb_status mcb_load_poll(mcb_load load, uint32_t timeout_us, bool *done) {
    return (mcb_status)mcbgo_load_poll(load, timeout_us, done, ERR);
}

mcb_status mcb_load_cancel(mcb_load load) {
    return (mcb_status)mcbgo_load_cancel(load, ERR);
}

mcb_status mcb_load_end(mcb_load load, struct mcb_load_result *out) {
    return (mcb_status)mcbgo_load_end(load, out, ERR);
}

mcb_status mcb_save_begin(mcb_model model, const struct mcb_scope *scope,
                          const struct mcb_kv_layout *layout,
                          const int32_t *tokens, size_t n_tokens,
                          const uint32_t *cells, mcb_save *out) {
    return (mcb_status)mcbgo_save_begin(model, (void *)scope, (void *)layout, (void *)tokens, n_tokens,
                                        (void *)cells, out, ERR);
}

mcb_status mcb_save_layer(mcb_save save, uint32_t il) {
    return (mcb_status)mcbgo_save_layer(save, il, ERR);
}

mcb_status mcb_save_end(mcb_save save, struct mcb_save_result *out) {
    return (mcb_status)mcbgo_save_end(save, out, ERR);
}

mcb_status mcb_state_restore(mcb_plan plan, uint8_t **state, size_t *n_bytes, struct mcb_load_result *out) {
    return (mcb_status)mcbgo_state_restore(plan, state, n_bytes, out, ERR);
}

void mcb_state_free(uint8_t *state) {
    if (state != NULL) {
        mcbgo_state_free(state);
    }
}

mcb_status mcb_state_save(mcb_model model, const struct mcb_scope *scope,
                          const uint8_t *state, size_t n_bytes,
                          const int32_t *tokens, size_t n_tokens,
                          struct mcb_save_result *out) {
    return (mcb_status)mcbgo_state_save(model, (void *)scope, (void *)state, n_bytes, (void *)tokens, n_tokens, out, ERR);
}

uint32_t mcb_model_snapshot_tokens(mcb_model model) { return mcbgo_model_snapshot_tokens(model); }

mcb_status mcb_snapshot_save(mcb_model model, const struct mcb_scope *scope,
                             const int32_t *tokens, size_t n_tokens,
                             const uint8_t *state, size_t n_bytes) {
    return (mcb_status)mcbgo_snapshot_save(model, (void *)scope, (void *)tokens, n_tokens, (void *)state, n_bytes, ERR);
}

mcb_status mcb_load_snapshot(mcb_load load, uint8_t **state, size_t *n_bytes) {
    return (mcb_status)mcbgo_load_snapshot(load, state, n_bytes, ERR);
}

size_t mcb_handles_open(void) { return (size_t)mcbgo_handles_open(); }
