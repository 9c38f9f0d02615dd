/*
 * mcbridge's own declarations of the Mooncake Transfer Engine C ABI.
 *
 * Written from the documented interface of kvcache-ai/Mooncake
 * (mooncake-transfer-engine/include/transfer_engine_c.h) so that the mock
 * engine and the Go binding agree with libtransfer_engine.so on every symbol,
 * constant and struct layout the bridge relies on. Layouts are pinned by
 * test/abi_test.c and by the Go layout tests; change neither side alone.
 *
 * Error conventions. The real library has two, and the bridge must tell them
 * apart per function:
 *
 *   Status calls (submitTransfer, submitTransferWithNotify, getTransferStatus,
 *   freeBatchID) return a non-negative Status code: 0 on success, otherwise
 *   one of the TE_* codes below (TE_NOT_IMPLEMENTED is 999 here).
 *
 *   Plain int calls (registration, openSegment, closeSegment, notify, ...)
 *   return 0 (or a segment id >= 0) on success and a negative code on
 *   failure: the negated TE_* code, except that "not implemented" is -303.
 *   Many of them return a bare -1 for any failure.
 *
 *   allocateBatchID returns INVALID_BATCH (or, in some releases, a small
 *   negative code cast to uint64) on failure; createTransferEngine and
 *   installTransport return NULL.
 *
 * Hazards for an in-process host such as llama.cpp (none of them apply to the
 * mock, all of them to the real library):
 *   - a batch id is the address of the engine's batch object, and a freed
 *     batch's address is handed out again by a later allocateBatchID: a
 *     stale id is a dangling pointer (a poll of a freed batch crashes);
 *   - C++ exceptions are not caught at this boundary;
 *   - an unknown metadata scheme in createTransferEngine ends the process;
 *   - loading the library sets SIGPIPE to ignored; createTransferEngine
 *     raises RLIMIT_NOFILE to its hard limit and starts threads; glog writes
 *     to stderr (MC_LOG_LEVEL and MC_LOG_DIR, read once per process, quiet
 *     or route it);
 *   - calls that reach a peer block inside the library: openSegment for up
 *     to a minute against a peer that accepts but does not answer; a
 *     transfer's status frame has a deadline (30 s on TCP,
 *     MC_TCP_STATUS_TIMEOUT_SEC), its payload none: a transfer whose peer
 *     stops mid-payload stays WAITING until the peer resumes, and lands;
 *   - enableGracefulShutdown installs process-wide SIGINT/SIGTERM handlers.
 *     It is deliberately not declared here: the bridge must never call it.
 *
 * Strings passed in are copied before the call returns.
 */
#ifndef MCB_MOONCAKE_TRANSFER_ENGINE_C_H
#define MCB_MOONCAKE_TRANSFER_ENGINE_C_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef int32_t segment_id_t;
typedef int32_t segment_handle_t;
typedef uint64_t batch_id_t;
typedef void *transfer_engine_t;
typedef void *transport_t;

/* The engine's own segment: openSegment(own name) returns it. */
#define LOCAL_SEGMENT 0
#define INVALID_BATCH UINT64_MAX

/* Metadata string that needs no service: the segment name becomes ip:port. */
#define P2PHANDSHAKE "P2PHANDSHAKE"

#define OPCODE_READ 0  /* target segment -> source buffer */
#define OPCODE_WRITE 1 /* source buffer -> target segment */

/* Task states reported by getTransferStatus. */
#define STATUS_WAITING 0
#define STATUS_PENDING 1
#define STATUS_INVALID 2
#define STATUS_CANCELED 3
#define STATUS_COMPLETED 4
#define STATUS_TIMEOUT 5
#define STATUS_FAILED 6

/* Result codes, positive as Status calls return them (see above). */
enum te_code {
    TE_OK = 0,
    TE_INVALID_ARGUMENT = 1,
    TE_TOO_MANY_REQUESTS = 2, /* batch capacity exceeded */
    TE_ADDRESS_NOT_REGISTERED = 3,
    TE_BATCH_BUSY = 4, /* a task is not yet seen finished by getTransferStatus */
    TE_DEVICE_NOT_FOUND = 6,
    TE_ADDRESS_OVERLAPPED = 7,
    TE_NOT_SUPPORTED_TRANSPORT = 8,
    TE_DNS = 101,
    TE_SOCKET = 102,
    TE_MALFORMED_JSON = 103,
    TE_REJECT_HANDSHAKE = 104,
    TE_METADATA = 200,
    TE_ENDPOINT = 201,
    TE_CONTEXT = 202,
    TE_NUMA = 300,
    TE_CLOCK = 301,
    TE_MEMORY = 302,
    TE_NOT_IMPLEMENTED = 999,
};
/* How plain int calls spell "not implemented". */
#define TE_ERR_NOT_IMPLEMENTED (-303)

/*
 * One transfer. For memory segments target_offset is the peer's virtual
 * address. The 32-bit hole after target_id held a file id in older releases;
 * keep it zero.
 */
struct transfer_request {
    int opcode;
    void *source;
    segment_id_t target_id;
    uint32_t reserved;
    uint64_t target_offset;
    uint64_t length;
};
typedef struct transfer_request transfer_request_t;

struct transfer_status {
    int status; /* STATUS_* */
    uint64_t transferred_bytes;
};
typedef struct transfer_status transfer_status_t;

struct buffer_entry {
    void *addr;
    size_t length;
};
typedef struct buffer_entry buffer_entry_t;

/* Passed by value; arrays returned by getNotifsFromEngine are malloc'd. */
struct notify_msg {
    char *name;
    char *msg;
};
typedef struct notify_msg notify_msg_t;

struct nic_load_stat {
    char device_name[64];
    uint64_t inflight_bytes;
    double ewma_bandwidth_bps;
};
typedef struct nic_load_stat nic_load_stat_t;

/* Engine lifecycle. NULL on failure. */
transfer_engine_t createTransferEngine(const char *metadata_conn_string,
                                       const char *local_server_name,
                                       const char *ip_or_host_name,
                                       uint64_t rpc_port, int auto_discover);
void destroyTransferEngine(transfer_engine_t engine);

/* "ip:port" of the engine's RPC listener, NUL-terminated, truncated to fit. */
int getLocalIpAndPort(transfer_engine_t engine, char *buf_out, size_t buf_len);

/* proto is "tcp" or "rdma"; args is a NULL-terminated, protocol-specific list. */
transport_t installTransport(transfer_engine_t engine, const char *proto,
                             void **args);
int uninstallTransport(transfer_engine_t engine, const char *proto);

/*
 * Segments: ids >= 1 for peers, LOCAL_SEGMENT for the engine's own name, -1
 * on failure (no transport installed, nobody listening, empty name). Ids are
 * cached by name: opening again returns the same id, also after the peer
 * died. closeSegment and uninstallTransport return 0 and change nothing.
 */
segment_id_t openSegment(transfer_engine_t engine, const char *segment_name);
segment_id_t openSegmentNoCache(transfer_engine_t engine,
                                const char *segment_name);
int closeSegment(transfer_engine_t engine, segment_id_t segment_id);
int removeLocalSegment(transfer_engine_t engine, const char *segment_name);
int syncSegmentCache(transfer_engine_t engine);

/*
 * Memory registration. location is "cpu:N", "cuda:N" or "*"; a build without
 * CUDA does not look at it, and the TCP transport serves every registered
 * range to peers whatever remote_accessible says. Overlapping an existing
 * region fails with -TE_ADDRESS_OVERLAPPED, a zero length with
 * -TE_INVALID_ARGUMENT. The batch form registers all or none. Unregistering
 * a start that is not registered fails with -TE_ADDRESS_NOT_REGISTERED; the
 * batch form still removes the starts it knows.
 */
int registerLocalMemory(transfer_engine_t engine, void *addr, size_t length,
                        const char *location, int remote_accessible);
int unregisterLocalMemory(transfer_engine_t engine, void *addr);
int registerLocalMemoryBatch(transfer_engine_t engine,
                             buffer_entry_t *buffer_list, size_t buffer_len,
                             const char *location);
int unregisterLocalMemoryBatch(transfer_engine_t engine, void **addr_list,
                               size_t addr_len);

/*
 * Batches. A batch holds at most batch_size requests over its lifetime
 * (TE_TOO_MANY_REQUESTS past it); task ids number them in submission order
 * from 0. submitTransfer checks only the batch, its capacity and that every
 * target_id was opened (TE_INVALID_ARGUMENT, nothing queued): a range outside
 * the owner's registrations is accepted and the task ends FAILED after one
 * round trip; the local side is not checked; an opcode other than
 * OPCODE_WRITE reads; a zero length completes at once.
 *
 * A task is WAITING until it ends COMPLETED or FAILED, with transferred_bytes
 * 0 until COMPLETED. Completion is seen only by polling getTransferStatus,
 * and freeBatchID fails with TE_BATCH_BUSY until every task has been seen
 * finished; a poll that answers COMPLETED also counts as seen every task of
 * the batch already finished, up to the first FAILED one.
 */
batch_id_t allocateBatchID(transfer_engine_t engine, size_t batch_size);
int submitTransfer(transfer_engine_t engine, batch_id_t batch_id,
                   struct transfer_request *entries, size_t count);
int getTransferStatus(transfer_engine_t engine, batch_id_t batch_id,
                      size_t task_id, struct transfer_status *status);
int freeBatchID(transfer_engine_t engine, batch_id_t batch_id);

/* Notifications: a short (name, msg) pair delivered to a peer engine. */
int submitTransferWithNotify(transfer_engine_t engine, batch_id_t batch_id,
                             struct transfer_request *entries, size_t count,
                             notify_msg_t notify_msg);
notify_msg_t *getNotifsFromEngine(transfer_engine_t engine, int *size);
int freeNotifsMsgBuf(notify_msg_t *msg, int size);
int genNotifyInEngine(transfer_engine_t engine, uint64_t target_id,
                      notify_msg_t notify_msg);

/* Diagnostics; newer releases only, resolve them as optional. */
int discoverTopology(transfer_engine_t engine);
int warmupEfaSegment(transfer_engine_t engine, const char *segment_name);
int getNicLoadStats(transfer_engine_t engine, nic_load_stat_t *stats,
                    size_t *count);
int showLinks(transfer_engine_t engine, char *buf_out, size_t buf_len,
              int json);

#ifdef __cplusplus
}
#endif

#endif
