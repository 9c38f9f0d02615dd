/*
 * Controls that only the mock Transfer Engine exports, next to the ABI of
 * transfer_engine_c.h. Bindings resolve them as optional symbols: a real
 * libtransfer_engine.so has none of them.
 *
 * Environment variables read by createTransferEngine (a malformed value makes
 * it fail):
 *   MOCK_TE_PATH=auto|tcp|vm     data path, as mock_te_set_path
 *   MOCK_TE_WORKERS=N            worker threads per engine (1..64, default 2)
 *   MOCK_TE_TIMEOUT_MS=N         a task running longer ends as TIMEOUT (0: never)
 *   MOCK_TE_IO_TIMEOUT_MS=N      deadline of a status frame (default 30000);
 *                                a streaming payload has none, as in the
 *                                real TCP transport
 *   MOCK_TE_FAIL_AFTER=N         as MOCK_TE_FAULT_FAIL_AFTER
 *   MOCK_TE_DELAY_US=N           as MOCK_TE_FAULT_DELAY_US
 *   MOCK_TE_CORRUPT=N            as MOCK_TE_FAULT_CORRUPT
 *   MOCK_TE_LINK_MBPS=N          shape the engine's transfers as one link of
 *                                N MB/s (10^6 bytes): benchmarks at a line
 *                                rate on one host (default: unshaped)
 *   MOCK_TE_DROP=0|1             as MOCK_TE_FAULT_DROP
 *   MOCK_TE_VM_EPERM=0|1         as MOCK_TE_FAULT_VM_EPERM
 *   MOCK_TE_VERBOSE=1            log refused calls on stderr
 */
#ifndef MCB_MOCK_TE_H
#define MCB_MOCK_TE_H

#include <stddef.h>
#include <stdint.h>

#include "../include/transfer_engine_c.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Fault kinds for mock_te_set_fault. Faults act on transfers the engine
 * initiates, except DROP, which also closes and refuses its server's
 * connections. A negative arg switches a kind off; MOCK_TE_FAULT_NONE switches
 * every kind off.
 */
enum mock_te_fault {
    MOCK_TE_FAULT_NONE = 0,
    MOCK_TE_FAULT_FAIL_AFTER = 1,  /* arg bytes more succeed, then tasks FAIL */
    MOCK_TE_FAULT_DELAY_US = 2,    /* sleep arg us before every slice */
    MOCK_TE_FAULT_CORRUPT = 3,     /* flip one byte in the next arg tasks */
    MOCK_TE_FAULT_DROP = 4,        /* arg 1: drop every peer connection */
    MOCK_TE_FAULT_STALL_AFTER = 5, /* hold workers once arg more bytes moved */
    MOCK_TE_FAULT_VM_EPERM = 6,    /* arg 1: same-host calls fail as EPERM */
};

/* Data paths for mock_te_set_path. */
enum mock_te_path {
    MOCK_TE_PATH_AUTO = 0, /* same host: process_vm_*, EPERM: TCP */
    MOCK_TE_PATH_TCP = 1,  /* always TCP */
    MOCK_TE_PATH_VM = 2,   /* process_vm_* only; no fallback */
};

struct mock_te_stats {
    uint64_t vm_bytes;            /* moved with process_vm_readv/writev */
    uint64_t tcp_bytes;           /* moved over the TCP path */
    uint64_t vm_fallbacks;        /* peers switched to TCP after EPERM */
    uint64_t tasks_completed;
    uint64_t tasks_failed;        /* FAILED, TIMEOUT or CANCELED */
    uint64_t invalid_batch_calls; /* calls naming an unknown batch id */
    uint64_t frames_served;       /* requests this engine's server answered */
    uint64_t frames_rejected;     /* malformed or refused server requests */
};

/* 0 on success, -1 for an unknown engine, kind or arg. */
int mock_te_set_fault(transfer_engine_t engine, int kind, int64_t arg);
int mock_te_set_path(transfer_engine_t engine, int path);
/*
 * Stops the batch's tasks: once it returns, no task submitted to the batch so
 * far reads or writes its local memory again, and those still running end as
 * CANCELED (a worker waiting on a peer ends when the wait does, touching
 * nothing). It waits at most for one slice being copied. The real engine has
 * no such call, so a buffer its transfers target cannot be reused at a
 * deadline; with this one a caller can land transfers in memory it must get
 * back at once. 0, or -1 for an unknown engine or batch.
 */
int mock_te_abort_batch(transfer_engine_t engine, batch_id_t batch_id);
/* Copies min(size, sizeof(struct mock_te_stats)) bytes of counters. */
int mock_te_get_stats(transfer_engine_t engine, struct mock_te_stats *out,
                      size_t size);

#ifdef __cplusplus
}
#endif

#endif
