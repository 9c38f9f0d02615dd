/*
 * Shared state of the mock Transfer Engine. Everything here is hidden from
 * the dynamic symbol table: only the ABI of transfer_engine_c.h and the
 * mock_te_* controls are exported.
 */
#ifndef MCB_MOCK_TE_INTERNAL_H
#define MCB_MOCK_TE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>

#include "../include/transfer_engine_c.h"
#include "mock_te.h"

#define HIDDEN __attribute__((visibility("hidden")))

#define ENGINE_MAGIC 0x4d4f434b54450001ull
#define NAME_MAX_LEN 256
/* A task moves at most this much per data-path call; faults act per slice. */
#define SLICE_BYTES (4u << 20)
#define MAX_BATCH_SIZE (1u << 16)
#define MAX_WORKERS 64
#define MAX_SERVER_CONNS 256
#define MAX_IDLE_CONNS 8
#define MAX_NOTIFIES 4096
/* Most spans a same-host peer reads from another engine's table. */
#define TABLE_MAX_SPANS 65536u

/* ---- wire format (wire.c) ---------------------------------------------- */

#define WIRE_MAGIC 0x4554434du /* "MCTE" as little-endian bytes */
#define WIRE_VERSION 2
#define WIRE_HDR_LEN 32
#define WIRE_MAX_IO SLICE_BYTES
#define WIRE_MAX_NOTIFY (64u << 10)
#define WIRE_REPLY 0x80

enum wire_type {
    WIRE_HELLO = 1,  /* -> descriptor of the serving engine */
    WIRE_READ = 2,   /* addr, length -> payload */
    WIRE_WRITE = 3,  /* addr, length, payload -> status */
    WIRE_NOTIFY = 4, /* payload: u32 name_len, u32 msg_len, name, msg */
};

/*
 * Every frame starts with this header, little-endian on the wire:
 *   0 u32 magic, 4 u16 version, 6 u16 type,
 *   8 u64 addr (requests) | i32 status, u32 zero (replies),
 *   16 u64 length of what follows (READ request: of the payload wanted),
 *   24 u64 tag, echoed by the reply.
 */
struct wire_hdr {
    uint32_t magic;
    uint16_t version;
    uint16_t type;
    uint64_t addr;
    int32_t status;
    uint64_t length;
    uint64_t tag;
};

HIDDEN void wire_encode_request(uint8_t out[WIRE_HDR_LEN], uint16_t type,
                                uint64_t addr, uint64_t length, uint64_t tag);
HIDDEN void wire_encode_reply(uint8_t out[WIRE_HDR_LEN], uint16_t type,
                              int32_t status, uint64_t length, uint64_t tag);
/* 0 when magic, version and the reserved word are right; the type is not
 * checked. */
HIDDEN int wire_decode(const uint8_t in[WIRE_HDR_LEN], bool reply,
                       struct wire_hdr *out);

/* What HELLO returns: enough to tell whether the peer shares our kernel and
 * pid namespace, and where in its memory its registration table is (for the
 * same-host path, which reads it there at transfer time). */
struct hello {
    int32_t pid;
    uint64_t pidns;
    char boot_id[40];
    char name[NAME_MAX_LEN];
    uint64_t table; /* address of the peer's struct pubtab */
};
HIDDEN int hello_decode(const uint8_t *p, size_t n, struct hello *out);

/* Blocking socket helpers; timeout_ms < 0 waits forever. They return 0, or a
 * negative errno (-ETIMEDOUT on deadline, -ECONNRESET on EOF). */
HIDDEN int io_connect(int fd, const struct sockaddr *addr, socklen_t len,
                      int timeout_ms);
HIDDEN int io_send_all(int fd, const void *buf, size_t n, int timeout_ms);
HIDDEN int io_recv_all(int fd, void *buf, size_t n, int timeout_ms);

/* ---- memory registry (registry.c) --------------------------------------- */

/* A registered range. As in the real TCP transport, every registered range
 * is reachable by peers: remote_accessible is not looked at. */
struct span {
    uint64_t addr;
    uint64_t len;
};

/*
 * The registration table as peers on the same host read it, with
 * process_vm_readv, at transfer time: a seqlock (seq is odd while the table
 * is rewritten) over the address and count of a span array. Only whole
 * 64-bit words, so that a reader in another process sees each field either
 * old or new.
 */
struct pubtab {
    _Atomic uint64_t seq;
    _Atomic uint64_t n;
    _Atomic uint64_t spans; /* address of struct span[n] */
};

struct registry {
    pthread_rwlock_t lock;
    struct span *v; /* sorted by addr, disjoint */
    size_t n, cap;
    struct pubtab pub;
    struct span *pub_spans; /* what pub points at; replaced on every change */
};

HIDDEN void registry_init(struct registry *r);
HIDDEN void registry_destroy(struct registry *r);
/* Both take the write lock and republish the table. registry_add is all or
 * none; registry_remove removes every known start and returns
 * -TE_ADDRESS_NOT_REGISTERED if any start was unknown, as the real library
 * does. 0 or a negative TE code. */
HIDDEN int registry_add(struct registry *r, const struct span *add, size_t n);
HIDDEN int registry_remove(struct registry *r, void *const *addrs, size_t n);
/* Caller holds the lock (read or write). */
HIDDEN bool registry_covers_locked(const struct registry *r, uint64_t addr,
                                   uint64_t len);
HIDDEN bool spans_cover(const struct span *v, size_t n, uint64_t addr,
                        uint64_t len);

/* ---- engine --------------------------------------------------------------- */

struct engine;

struct peer {
    atomic_int refs;
    struct engine *eng;
    char name[NAME_MAX_LEN];
    struct sockaddr_storage addr;
    socklen_t addrlen;
    bool is_local;  /* the engine's own segment */
    bool same_host; /* same kernel and pid namespace */
    int32_t pid;
    int pidfd; /* -1 when pidfd_open is unavailable */
    uint64_t table; /* the peer's struct pubtab, in its address space */
    atomic_bool vm_denied;
    /* A peer whose TCP exchange just timed out is unreachable until this
     * monotonic time (ms): later tasks fail fast instead of each waiting
     * out its own timeout on a dead link, as a real engine marks an
     * endpoint failed. */
    _Atomic int64_t down_until_ms;

    pthread_mutex_t mu; /* guards the table copy and idle */
    struct span *spans; /* the peer's table as last read, at seq */
    size_t nspans;
    uint64_t seq;   /* 0: never read (a published seq is >= 2) */
    int idle[MAX_IDLE_CONNS];
    size_t nidle;
};

struct batch;

/* The message of a submitTransferWithNotify, to the first request's peer.
 * As in the real engine a batch holds one (a later call replaces it), and
 * the poll that first sees every task of the batch COMPLETED sends it. */
struct notice {
    struct peer *peer;
    char *name;
    char *msg;
};

/* A task is WAITING until its final state, which the worker publishes last;
 * like the real engine, it reports no progress before then. */
struct task {
    struct transfer_request req;
    struct peer *peer;
    atomic_int state;
    /* The abort fence (mock_te_abort_batch, local_begin): */
    atomic_bool aborted;  /* the batch was aborted: touch local memory no more */
    atomic_bool touching; /* a worker is reading or writing local memory */
    bool observed; /* a final state was reported; guarded by engine.mu */
    struct task *next;
};

struct batch {
    struct engine *eng;
    size_t cap;
    size_t n;              /* guarded by engine.mu */
    struct notice *notice; /* not yet sent; guarded by engine.mu */
    struct task *tasks;
};

struct server_conn {
    int fd;
    pthread_t thread;
    atomic_bool done;
    struct engine *eng;
    struct server_conn *next;
};

struct notify_entry {
    char *name;
    char *msg;
};

struct engine {
    uint64_t magic;
    char name[NAME_MAX_LEN];
    struct sockaddr_storage listen_addr;
    socklen_t listen_addrlen;
    int listen_fd;
    int wake_fd; /* eventfd that stops the accept loop */
    pthread_t accept_thread;

    pthread_mutex_t conns_mu;
    struct server_conn *conns;
    size_t nconns;
    bool conns_closing;

    struct registry regs;

    pthread_mutex_t mu; /* segments, batches, transports, notifications */
    struct peer **segs; /* index = segment id; NULL when closed */
    size_t nsegs;
    struct batch **bset; /* open-addressed set of live batches */
    size_t bset_cap, bset_used, bset_live;
    bool tcp_installed;
    struct notify_entry *notifies;
    size_t nnotifies;

    pthread_mutex_t qmu;
    pthread_cond_t qcv;
    struct task *qhead, *qtail;
    atomic_bool stopping;
    pthread_t workers[MAX_WORKERS];
    int nworkers;

    /* faults; the stall fields are guarded by qmu */
    atomic_int_fast64_t fail_after; /* < 0: off */
    atomic_int_fast64_t delay_us;
    atomic_int_fast64_t corrupt;
    atomic_bool drop;
    atomic_bool vm_eperm;
    atomic_int_fast64_t stall_after;
    atomic_uint_fast64_t moved; /* bytes counted against fail/stall */
    atomic_int path;

    /* One link shared by every transfer the engine initiates, at link_mbps
     * bytes per microsecond (0: unshaped); link_free_us is when it has sent
     * every slice reserved so far. */
    int64_t link_mbps;
    atomic_int_fast64_t link_free_us;

    int task_timeout_ms;
    int io_timeout_ms;
    bool verbose;

    int32_t pid;
    uint64_t pidns;
    char boot_id[40];

    struct {
        atomic_uint_fast64_t vm_bytes, tcp_bytes, vm_fallbacks,
            tasks_completed, tasks_failed, invalid_batch_calls, frames_served,
            frames_rejected, inflight_bytes;
    } stats;
};

HIDDEN struct engine *engine_check(transfer_engine_t h);
HIDDEN void engine_log(struct engine *e, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* server.c */
HIDDEN int server_start(struct engine *e, const char *host);
HIDDEN void server_stop(struct engine *e);
HIDDEN void server_drop_conns(struct engine *e);
HIDDEN int server_queue_notify(struct engine *e, const char *name,
                               size_t name_len, const char *msg,
                               size_t msg_len);

/* peer.c */
HIDDEN int parse_host_port(const char *s, char *host, size_t host_len,
                           char *port, size_t port_len);
HIDDEN int resolve_addr(const char *host, const char *port,
                        struct sockaddr_storage *out, socklen_t *outlen);
HIDDEN struct peer *peer_open(struct engine *e, const char *name);
HIDDEN struct peer *peer_local(struct engine *e);
HIDDEN void peer_ref(struct peer *p);
HIDDEN void peer_unref(struct peer *p);
HIDDEN int peer_refresh(struct engine *e, struct peer *p);
HIDDEN void peer_drop_idle(struct peer *p);
/* Move len bytes of one request. 0, or a negative TE code; -TE_CLOCK marks a
 * deadline that passed (the task ends as TIMEOUT). */
HIDDEN int peer_transfer(struct engine *e, struct task *t, struct peer *p,
                         int opcode, uintptr_t local, uint64_t remote,
                         uint64_t len);

/*
 * The abort fence. A worker marks its task as touching local memory before
 * it does and checks aborted after marking; mock_te_abort_batch sets aborted,
 * then waits until touching is clear. With sequentially consistent atomics
 * one of them sees the other, so once the abort returns no worker touches the
 * task's local memory again. false: aborted, touch nothing. A NULL task (a
 * worker's own bytes) is never fenced.
 */
static inline bool local_begin(struct task *t) {
    if (!t) return true;
    atomic_store(&t->touching, true);
    if (!atomic_load(&t->aborted)) return true;
    atomic_store(&t->touching, false);
    return false;
}

static inline void local_end(struct task *t) {
    if (t) atomic_store(&t->touching, false);
}
HIDDEN int peer_notify(struct engine *e, struct peer *p, const char *name,
                       const char *msg);

/* worker.c */
HIDDEN int workers_start(struct engine *e, int n);
HIDDEN void workers_stop(struct engine *e);
HIDDEN void workers_enqueue(struct engine *e, struct task *first, size_t n);
HIDDEN void faults_release_stall(struct engine *e);

/* Milliseconds of CLOCK_MONOTONIC. */
int64_t mono_ms(void);

#endif
