/*
 * The exported ABI of the mock Transfer Engine: transfer_engine_c.h with the
 * semantics measured on the real library (see transfer_engine_c.h and
 * mooncake-capi/README.md), plus the mock_te_* controls. Unlike the real
 * library it validates every handle it is given, so a binding bug shows up
 * as an error code and a counter, not a crash.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

#define API __attribute__((visibility("default")))

struct engine *engine_check(transfer_engine_t h) {
    struct engine *e = h;
    return e && e->magic == ENGINE_MAGIC ? e : NULL;
}

void engine_log(struct engine *e, const char *fmt, ...) {
    if (e && !e->verbose) return;
    va_list ap;
    va_start(ap, fmt);
    fputs("mock-te: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static void notice_free(struct notice *nt) {
    if (!nt) return;
    peer_unref(nt->peer);
    free(nt->name);
    free(nt->msg);
    free(nt);
}

/* ---- configuration from the environment --------------------------------- */

/* 1 when unset, 0 when parsed, -1 when malformed or out of range. */
static int env_int(const char *name, int64_t lo, int64_t hi, int64_t *out) {
    const char *s = getenv(name);
    if (!s || !*s) return 1;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end || v < lo || v > hi) {
        fprintf(stderr, "mock-te: %s=%s is not an integer in [%lld, %lld]\n",
                name, s, (long long)lo, (long long)hi);
        return -1;
    }
    *out = v;
    return 0;
}

static int configure(struct engine *e) {
    int64_t v;
    int rc;
    e->io_timeout_ms = 30000;
    if ((rc = env_int("MOCK_TE_WORKERS", 1, MAX_WORKERS, &v)) < 0) return -1;
    int workers = rc ? 2 : (int)v;
    if ((rc = env_int("MOCK_TE_TIMEOUT_MS", 0, INT32_MAX, &v)) < 0) return -1;
    if (!rc) e->task_timeout_ms = (int)v;
    if ((rc = env_int("MOCK_TE_IO_TIMEOUT_MS", 1, INT32_MAX, &v)) < 0)
        return -1;
    if (!rc) e->io_timeout_ms = (int)v;
    if ((rc = env_int("MOCK_TE_FAIL_AFTER", 0, INT64_MAX, &v)) < 0) return -1;
    if (!rc) atomic_store(&e->fail_after, v);
    if ((rc = env_int("MOCK_TE_DELAY_US", 0, 60000000, &v)) < 0) return -1;
    if (!rc) atomic_store(&e->delay_us, v);
    if ((rc = env_int("MOCK_TE_LINK_MBPS", 1, 100000000, &v)) < 0) return -1;
    if (!rc) e->link_mbps = v;
    if ((rc = env_int("MOCK_TE_CORRUPT", 0, INT64_MAX, &v)) < 0) return -1;
    if (!rc) atomic_store(&e->corrupt, v);
    if ((rc = env_int("MOCK_TE_DROP", 0, 1, &v)) < 0) return -1;
    if (!rc) atomic_store(&e->drop, v == 1);
    if ((rc = env_int("MOCK_TE_VM_EPERM", 0, 1, &v)) < 0) return -1;
    if (!rc) atomic_store(&e->vm_eperm, v == 1);
    if ((rc = env_int("MOCK_TE_VERBOSE", 0, 1, &v)) < 0) return -1;
    if (!rc) e->verbose = v == 1;
    const char *path = getenv("MOCK_TE_PATH");
    if (path && *path) {
        if (!strcmp(path, "auto"))
            atomic_store(&e->path, MOCK_TE_PATH_AUTO);
        else if (!strcmp(path, "tcp"))
            atomic_store(&e->path, MOCK_TE_PATH_TCP);
        else if (!strcmp(path, "vm"))
            atomic_store(&e->path, MOCK_TE_PATH_VM);
        else {
            fprintf(stderr, "mock-te: MOCK_TE_PATH=%s: want auto, tcp or vm\n",
                    path);
            return -1;
        }
    }
    return workers;
}

static void read_identity(struct engine *e) {
    e->pid = (int32_t)getpid();
    struct stat st;
    if (stat("/proc/self/ns/pid", &st) == 0) e->pidns = (uint64_t)st.st_ino;
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "re");
    if (f) {
        if (!fgets(e->boot_id, sizeof(e->boot_id), f)) e->boot_id[0] = 0;
        e->boot_id[strcspn(e->boot_id, "\n")] = 0;
        fclose(f);
    }
}

/* ---- engine lifecycle ----------------------------------------------------- */

static void engine_free(struct engine *e) {
    workers_stop(e);
    server_stop(e);
    for (size_t i = 0; i < e->nsegs; i++) peer_unref(e->segs[i]);
    free(e->segs);
    for (size_t i = 0; i < e->bset_cap; i++) {
        struct batch *b = e->bset[i];
        if (b && b != (struct batch *)e) {
            notice_free(b->notice);
            free(b->tasks);
            free(b);
        }
    }
    free(e->bset);
    for (size_t i = 0; i < e->nnotifies; i++) {
        free(e->notifies[i].name);
        free(e->notifies[i].msg);
    }
    free(e->notifies);
    registry_destroy(&e->regs);
    pthread_cond_destroy(&e->qcv);
    pthread_mutex_destroy(&e->qmu);
    pthread_mutex_destroy(&e->mu);
    pthread_mutex_destroy(&e->conns_mu);
    e->magic = 0;
    free(e);
}

API transfer_engine_t createTransferEngine(const char *metadata_conn_string,
                                           const char *local_server_name,
                                           const char *ip_or_host_name,
                                           uint64_t rpc_port,
                                           int auto_discover) {
    (void)ip_or_host_name;
    (void)rpc_port;
    if (!metadata_conn_string) return NULL;
    if (strcmp(metadata_conn_string, P2PHANDSHAKE) != 0) {
        const char *known[] = {"etcd://", "redis://", "http://", "https://"};
        bool service = false;
        for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
            service |= !strncmp(metadata_conn_string, known[i],
                                strlen(known[i]));
        fprintf(stderr,
                service ? "mock-te: metadata service \"%s\" is not supported "
                          "by the mock; use P2PHANDSHAKE\n"
                        : "mock-te: unknown metadata scheme \"%s\"\n",
                metadata_conn_string);
        return NULL;
    }
    /* As in P2P mode of the real engine: listen on the host part of
     * local_server_name, on a fresh port. */
    char host[NAME_MAX_LEN] = "127.0.0.1", port[8];
    if (local_server_name && *local_server_name &&
        parse_host_port(local_server_name, host, sizeof(host), port,
                        sizeof(port))) {
        fprintf(stderr, "mock-te: bad local server name \"%s\"\n",
                local_server_name);
        return NULL;
    }
    struct engine *e = calloc(1, sizeof(*e));
    if (!e) return NULL;
    e->magic = ENGINE_MAGIC;
    e->listen_fd = e->wake_fd = -1;
    atomic_init(&e->fail_after, -1);
    atomic_init(&e->stall_after, -1);
    atomic_init(&e->link_free_us, 0);
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->conns_mu, NULL);
    pthread_mutex_init(&e->qmu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&e->qcv, &ca);
    pthread_condattr_destroy(&ca);
    registry_init(&e->regs);
    read_identity(e);
    int workers = configure(e);
    if (workers < 0) {
        engine_free(e);
        return NULL;
    }
    int rc = server_start(e, host);
    if (rc) {
        fprintf(stderr, "mock-te: cannot listen on %s (code %d)\n", host, rc);
        engine_free(e);
        return NULL;
    }
    e->segs = calloc(1, sizeof(*e->segs));
    if (e->segs) e->segs[0] = peer_local(e);
    if (!e->segs || !e->segs[0] || workers_start(e, workers)) {
        engine_free(e);
        return NULL;
    }
    e->nsegs = 1;
    e->tcp_installed = auto_discover != 0;
    return e;
}

API void destroyTransferEngine(transfer_engine_t engine) {
    struct engine *e = engine_check(engine);
    if (e) engine_free(e);
}

API int getLocalIpAndPort(transfer_engine_t engine, char *buf_out,
                          size_t buf_len) {
    struct engine *e = engine_check(engine);
    if (!e || !buf_out || buf_len == 0) return -1;
    snprintf(buf_out, buf_len, "%s", e->name);
    return 0;
}

/* Only TCP: the mock has no RDMA NIC, and the real engine returns NULL for
 * "rdma" without one. Installing twice returns the same transport. */
API transport_t installTransport(transfer_engine_t engine, const char *proto,
                                 void **args) {
    (void)args;
    struct engine *e = engine_check(engine);
    if (!e || !proto) return NULL;
    if (strcmp(proto, "tcp") != 0) {
        engine_log(e, "installTransport: no \"%s\" transport", proto);
        return NULL;
    }
    pthread_mutex_lock(&e->mu);
    e->tcp_installed = true;
    pthread_mutex_unlock(&e->mu);
    return &e->tcp_installed;
}

/* As in the real engine, a no-op: the transport keeps working. */
API int uninstallTransport(transfer_engine_t engine, const char *proto) {
    return engine_check(engine) && proto ? 0 : -1;
}

/* ---- segments ------------------------------------------------------------- */

static const char *trim_slashes(const char *s) {
    while (*s == '/') s++;
    return s;
}

/* Caller holds e->mu. */
static segment_id_t find_segment_locked(struct engine *e, const char *name) {
    for (size_t i = 0; i < e->nsegs; i++)
        if (e->segs[i] && !strcmp(e->segs[i]->name, name))
            return (segment_id_t)i;
    return -1;
}

static segment_id_t open_segment(struct engine *e, const char *name,
                                 bool refresh) {
    pthread_mutex_lock(&e->mu);
    segment_id_t id = find_segment_locked(e, name);
    struct peer *cached = id > 0 ? e->segs[id] : NULL;
    if (cached) peer_ref(cached);
    pthread_mutex_unlock(&e->mu);
    if (id == LOCAL_SEGMENT) return id;
    if (cached) {
        int rc = refresh ? peer_refresh(e, cached) : 0;
        peer_unref(cached);
        return rc ? -1 : id;
    }
    /* The handshake runs unlocked: it waits on the network. */
    struct peer *p = peer_open(e, name);
    if (!p) {
        engine_log(e, "openSegment: cannot reach \"%s\"", name);
        return -1;
    }
    pthread_mutex_lock(&e->mu);
    id = find_segment_locked(e, name);
    if (id < 0) {
        struct peer **segs = realloc(e->segs, (e->nsegs + 1) * sizeof(*segs));
        if (segs) {
            e->segs = segs;
            e->segs[e->nsegs] = p;
            id = (segment_id_t)e->nsegs++;
            p = NULL;
        }
    }
    pthread_mutex_unlock(&e->mu);
    peer_unref(p);
    return id;
}

/* Whether a segment can be opened: the real engine has no local segment
 * descriptor, and opens nothing, before a transport is installed. */
static bool can_open(struct engine *e) {
    pthread_mutex_lock(&e->mu);
    bool ok = e->tcp_installed;
    pthread_mutex_unlock(&e->mu);
    return ok;
}

API segment_id_t openSegment(transfer_engine_t engine,
                             const char *segment_name) {
    struct engine *e = engine_check(engine);
    if (!e || !segment_name || !*trim_slashes(segment_name) || !can_open(e))
        return -1;
    return open_segment(e, trim_slashes(segment_name), false);
}

API segment_id_t openSegmentNoCache(transfer_engine_t engine,
                                    const char *segment_name) {
    struct engine *e = engine_check(engine);
    if (!e || !segment_name || !*trim_slashes(segment_name) || !can_open(e))
        return -1;
    return open_segment(e, trim_slashes(segment_name), true);
}

/* As in the real engine, a no-op: ids stay valid for the engine's life, and
 * a later openSegment of the same name returns the same id. */
API int closeSegment(transfer_engine_t engine, segment_id_t segment_id) {
    (void)segment_id;
    return engine_check(engine) ? 0 : -1;
}

API int removeLocalSegment(transfer_engine_t engine,
                           const char *segment_name) {
    struct engine *e = engine_check(engine);
    if (!e || !segment_name || !*trim_slashes(segment_name))
        return -TE_INVALID_ARGUMENT;
    return strcmp(trim_slashes(segment_name), e->name) ? -TE_METADATA : 0;
}

API int syncSegmentCache(transfer_engine_t engine) {
    struct engine *e = engine_check(engine);
    if (!e) return -1;
    int rc = 0;
    for (size_t i = 1;; i++) {
        pthread_mutex_lock(&e->mu);
        struct peer *p = i < e->nsegs ? e->segs[i] : NULL;
        bool more = i < e->nsegs;
        if (p) peer_ref(p);
        pthread_mutex_unlock(&e->mu);
        if (!more) break;
        if (p) {
            int r = peer_refresh(e, p);
            if (r && !rc) rc = r;
            peer_unref(p);
        }
    }
    return rc;
}

/* ---- memory registration ------------------------------------------------- */

/*
 * Registration as the real engine's TCP build does it: the location string
 * is not looked at (a non-CUDA build takes "cuda:0" or "nonsense"), nor is
 * remote_accessible (peers reach every registered range), nor a NULL start.
 */
API int registerLocalMemory(transfer_engine_t engine, void *addr,
                            size_t length, const char *location,
                            int remote_accessible) {
    (void)remote_accessible;
    struct engine *e = engine_check(engine);
    if (!e || !location || length == 0) return -TE_INVALID_ARGUMENT;
    struct span r = {(uint64_t)(uintptr_t)addr, length};
    int rc = registry_add(&e->regs, &r, 1);
    if (rc)
        engine_log(e, "registerLocalMemory(%p, %zu): code %d", addr, length,
                   rc);
    return rc;
}

API int unregisterLocalMemory(transfer_engine_t engine, void *addr) {
    struct engine *e = engine_check(engine);
    if (!e) return -TE_INVALID_ARGUMENT;
    return registry_remove(&e->regs, &addr, 1);
}

API int registerLocalMemoryBatch(transfer_engine_t engine,
                                 buffer_entry_t *buffer_list,
                                 size_t buffer_len, const char *location) {
    struct engine *e = engine_check(engine);
    if (!e || !location || (!buffer_list && buffer_len > 0))
        return -TE_INVALID_ARGUMENT;
    if (buffer_len == 0) return 0;
    struct span *v = calloc(buffer_len, sizeof(*v));
    if (!v) return -TE_MEMORY;
    for (size_t i = 0; i < buffer_len; i++)
        v[i] = (struct span){(uint64_t)(uintptr_t)buffer_list[i].addr,
                             buffer_list[i].length};
    int rc = registry_add(&e->regs, v, buffer_len);
    free(v);
    return rc;
}

API int unregisterLocalMemoryBatch(transfer_engine_t engine, void **addr_list,
                                   size_t addr_len) {
    struct engine *e = engine_check(engine);
    if (!e || (!addr_list && addr_len > 0)) return -TE_INVALID_ARGUMENT;
    return registry_remove(&e->regs, addr_list, addr_len);
}

/* ---- batches -------------------------------------------------------------- */

/*
 * Live batches sit in an open-addressed set keyed by address, so that every
 * id a caller passes is checked before it is dereferenced. A deleted slot
 * holds the engine pointer as a tombstone.
 */
static size_t bset_slot(uint64_t id, size_t cap) {
    uint64_t h = id * 0x9e3779b97f4a7c15ull;
    return (size_t)(h >> 17) & (cap - 1);
}

/* Caller holds e->mu. */
static struct batch *bset_find_locked(struct engine *e, batch_id_t id) {
    if (!e->bset || id == 0 || id == INVALID_BATCH) return NULL;
    for (size_t i = bset_slot(id, e->bset_cap), k = 0; k < e->bset_cap;
         i = (i + 1) & (e->bset_cap - 1), k++) {
        struct batch *b = e->bset[i];
        if (!b) return NULL;
        if ((uintptr_t)b == id && b != (struct batch *)e) return b;
    }
    return NULL;
}

static int bset_insert_locked(struct engine *e, struct batch *b) {
    if ((e->bset_used + 1) * 2 > e->bset_cap) {
        size_t cap = e->bset_cap ? e->bset_cap : 64;
        while ((e->bset_live + 1) * 4 > cap) cap *= 2;
        struct batch **v = calloc(cap, sizeof(*v));
        if (!v) return -1;
        for (size_t i = 0; i < e->bset_cap; i++) {
            struct batch *old = e->bset[i];
            if (!old || old == (struct batch *)e) continue;
            size_t j = bset_slot((uintptr_t)old, cap);
            while (v[j]) j = (j + 1) & (cap - 1);
            v[j] = old;
        }
        free(e->bset);
        e->bset = v;
        e->bset_cap = cap;
        e->bset_used = e->bset_live;
    }
    size_t j = bset_slot((uintptr_t)b, e->bset_cap);
    while (e->bset[j] && e->bset[j] != (struct batch *)e)
        j = (j + 1) & (e->bset_cap - 1);
    if (!e->bset[j]) e->bset_used++;
    e->bset[j] = b;
    e->bset_live++;
    return 0;
}

static void bset_remove_locked(struct engine *e, struct batch *b) {
    for (size_t i = bset_slot((uintptr_t)b, e->bset_cap);;
         i = (i + 1) & (e->bset_cap - 1)) {
        if (e->bset[i] == b) {
            e->bset[i] = (struct batch *)e;
            e->bset_live--;
            return;
        }
    }
}

static struct batch *find_batch_locked(struct engine *e, batch_id_t id) {
    struct batch *b = bset_find_locked(e, id);
    if (!b) {
        atomic_fetch_add(&e->stats.invalid_batch_calls, 1);
        engine_log(e, "unknown batch id %#llx", (unsigned long long)id);
    }
    return b;
}

API batch_id_t allocateBatchID(transfer_engine_t engine, size_t batch_size) {
    struct engine *e = engine_check(engine);
    if (!e || batch_size > MAX_BATCH_SIZE) return INVALID_BATCH;
    struct batch *b = calloc(1, sizeof(*b));
    if (!b) return INVALID_BATCH;
    b->eng = e;
    b->cap = batch_size;
    b->tasks = calloc(batch_size ? batch_size : 1, sizeof(*b->tasks));
    pthread_mutex_lock(&e->mu);
    int rc = b->tasks ? bset_insert_locked(e, b) : -1;
    pthread_mutex_unlock(&e->mu);
    if (rc) {
        free(b->tasks);
        free(b);
        return INVALID_BATCH;
    }
    return (batch_id_t)(uintptr_t)b;
}


/*
 * Queues count requests, all or none; returns a Status code. As in the real
 * engine only the batch, its capacity and the segment ids are checked here:
 * the ranges are checked when the bytes move, so a request outside the
 * owner's registrations is accepted and ends FAILED, and the local side is
 * not checked at all (the real TCP transport never checks it). An opcode
 * other than OPCODE_WRITE reads; a zero length completes.
 */
static int submit(struct engine *e, batch_id_t batch_id,
                  const struct transfer_request *entries, size_t count,
                  const notify_msg_t *notify) {
    if (!entries && count > 0) return TE_INVALID_ARGUMENT;
    struct notice *nt = NULL;
    if (notify) {
        if (count == 0) return TE_INVALID_ARGUMENT;
        nt = calloc(1, sizeof(*nt));
        if (nt) {
            nt->name = strdup(notify->name ? notify->name : "");
            nt->msg = strdup(notify->msg ? notify->msg : "");
        }
        if (!nt || !nt->name || !nt->msg) {
            notice_free(nt);
            return TE_MEMORY;
        }
    }
    int rc = TE_OK;
    size_t first = 0;
    pthread_mutex_lock(&e->mu);
    struct batch *b = find_batch_locked(e, batch_id);
    if (!b)
        rc = TE_INVALID_ARGUMENT;
    else if (count > b->cap - b->n)
        rc = TE_TOO_MANY_REQUESTS;
    else if (!e->tcp_installed)
        rc = TE_NOT_SUPPORTED_TRANSPORT;
    for (size_t i = 0; rc == TE_OK && i < count; i++) {
        segment_id_t sid = entries[i].target_id;
        if (sid < 0 || (size_t)sid >= e->nsegs || !e->segs[sid])
            rc = TE_INVALID_ARGUMENT;
    }
    if (rc == TE_OK && count > 0) {
        first = b->n;
        for (size_t i = 0; i < count; i++) {
            struct task *t = &b->tasks[first + i];
            t->req = entries[i];
            t->peer = e->segs[entries[i].target_id];
            peer_ref(t->peer);
            t->observed = false;
            atomic_store(&t->aborted, false);
            atomic_store(&t->touching, false);
            atomic_store(&t->state, STATUS_WAITING);
        }
        b->n += count;
        if (nt) {
            nt->peer = b->tasks[first].peer;
            peer_ref(nt->peer);
            notice_free(b->notice);
            b->notice = nt;
            nt = NULL;
        }
    }
    pthread_mutex_unlock(&e->mu);
    notice_free(nt);
    /* The new tasks are not yet seen finished, so the batch cannot be freed
     * before they are queued. */
    if (rc == TE_OK && count > 0) workers_enqueue(e, &b->tasks[first], count);
    return rc;
}

API int submitTransfer(transfer_engine_t engine, batch_id_t batch_id,
                       struct transfer_request *entries, size_t count) {
    struct engine *e = engine_check(engine);
    if (!e) return TE_INVALID_ARGUMENT;
    return submit(e, batch_id, entries, count, NULL);
}

API int submitTransferWithNotify(transfer_engine_t engine, batch_id_t batch_id,
                                 struct transfer_request *entries,
                                 size_t count, notify_msg_t notify_msg) {
    struct engine *e = engine_check(engine);
    if (!e) return TE_INVALID_ARGUMENT;
    return submit(e, batch_id, entries, count, &notify_msg);
}

/*
 * What a COMPLETED answer does in the real engine: it computes the batch's
 * status, which polls every task in order, so each one already final counts
 * as seen, up to and including the first FAILED or TIMEOUT. Caller holds
 * e->mu.
 */
static bool sweep_locked(struct batch *b) {
    bool all = true;
    for (size_t i = 0; i < b->n; i++) {
        struct task *t = &b->tasks[i];
        int s = atomic_load_explicit(&t->state, memory_order_acquire);
        all = all && s == STATUS_COMPLETED;
        if (s == STATUS_WAITING) continue;
        t->observed = true;
        if (s == STATUS_FAILED || s == STATUS_TIMEOUT) return false;
    }
    return all;
}

API int getTransferStatus(transfer_engine_t engine, batch_id_t batch_id,
                          size_t task_id, struct transfer_status *status) {
    struct engine *e = engine_check(engine);
    if (!e || !status) return TE_INVALID_ARGUMENT;
    int rc = TE_OK;
    struct notice *send = NULL;
    pthread_mutex_lock(&e->mu);
    struct batch *b = find_batch_locked(e, batch_id);
    if (!b || task_id >= b->n) {
        rc = TE_INVALID_ARGUMENT;
    } else {
        struct task *t = &b->tasks[task_id];
        int s = atomic_load_explicit(&t->state, memory_order_acquire);
        status->status = s;
        status->transferred_bytes = s == STATUS_COMPLETED ? t->req.length : 0;
        if (s != STATUS_WAITING) t->observed = true;
        if (s == STATUS_COMPLETED && sweep_locked(b)) {
            send = b->notice;
            b->notice = NULL;
        }
    }
    pthread_mutex_unlock(&e->mu);
    /* Inside the poll, as the real engine sends it: the poll waits on the
     * peer. */
    if (send) peer_notify(e, send->peer, send->name, send->msg);
    notice_free(send);
    return rc;
}

API int freeBatchID(transfer_engine_t engine, batch_id_t batch_id) {
    struct engine *e = engine_check(engine);
    if (!e) return TE_INVALID_ARGUMENT;
    pthread_mutex_lock(&e->mu);
    struct batch *b = find_batch_locked(e, batch_id);
    int rc = b ? TE_OK : TE_INVALID_ARGUMENT;
    for (size_t i = 0; b && i < b->n && rc == TE_OK; i++)
        if (!b->tasks[i].observed) rc = TE_BATCH_BUSY;
    if (rc == TE_OK) bset_remove_locked(e, b);
    pthread_mutex_unlock(&e->mu);
    if (rc == TE_OK) {
        notice_free(b->notice);
        free(b->tasks);
        free(b);
    }
    return rc;
}

/* ---- notifications -------------------------------------------------------- */

API notify_msg_t *getNotifsFromEngine(transfer_engine_t engine, int *size) {
    struct engine *e = engine_check(engine);
    if (size) *size = 0;
    if (!e || !size) return NULL;
    pthread_mutex_lock(&e->mu);
    size_t n = e->nnotifies;
    notify_msg_t *out = n ? calloc(n, sizeof(*out)) : NULL;
    if (out) {
        for (size_t i = 0; i < n; i++)
            out[i] = (notify_msg_t){e->notifies[i].name, e->notifies[i].msg};
        e->nnotifies = 0;
        *size = (int)n;
    }
    pthread_mutex_unlock(&e->mu);
    return out;
}

API int freeNotifsMsgBuf(notify_msg_t *msg, int size) {
    if (!msg) return 0;
    for (int i = 0; i < size; i++) {
        free(msg[i].name);
        free(msg[i].msg);
    }
    free(msg);
    return 0;
}

API int genNotifyInEngine(transfer_engine_t engine, uint64_t target_id,
                          notify_msg_t notify_msg) {
    struct engine *e = engine_check(engine);
    if (!e || !notify_msg.name || !notify_msg.msg) return -TE_INVALID_ARGUMENT;
    pthread_mutex_lock(&e->mu);
    struct peer *p = target_id < e->nsegs ? e->segs[target_id] : NULL;
    if (p) peer_ref(p);
    pthread_mutex_unlock(&e->mu);
    if (!p) return -TE_METADATA;
    int rc = peer_notify(e, p, notify_msg.name, notify_msg.msg);
    peer_unref(p);
    return rc;
}

/* ---- diagnostics ---------------------------------------------------------- */

API int discoverTopology(transfer_engine_t engine) {
    return engine_check(engine) ? 0 : -1;
}

API int warmupEfaSegment(transfer_engine_t engine, const char *segment_name) {
    (void)segment_name;
    return engine_check(engine) ? 0 : -1;
}

API int getNicLoadStats(transfer_engine_t engine, nic_load_stat_t *stats,
                        size_t *count) {
    struct engine *e = engine_check(engine);
    if (!e || !stats || !count) return -1;
    if (*count >= 1) {
        memset(&stats[0], 0, sizeof(stats[0]));
        snprintf(stats[0].device_name, sizeof(stats[0].device_name), "mock");
        stats[0].inflight_bytes = atomic_load(&e->stats.inflight_bytes);
    }
    *count = 1;
    return 0;
}

API int showLinks(transfer_engine_t engine, char *buf_out, size_t buf_len,
                  int json) {
    struct engine *e = engine_check(engine);
    if (!e || !buf_out || buf_len == 0) return -1;
    static const char *paths[] = {"auto", "tcp", "vm"};
    int path = atomic_load(&e->path);
    snprintf(buf_out, buf_len,
             json ? "{\"segment\":\"%s\",\"path\":\"%s\",\"workers\":%d}"
                  : "segment %s path %s workers %d",
             e->name, paths[path], e->nworkers);
    return 0;
}

/* ---- mock controls -------------------------------------------------------- */

API int mock_te_set_fault(transfer_engine_t engine, int kind, int64_t arg) {
    struct engine *e = engine_check(engine);
    if (!e) return -1;
    /* Byte limits count from now: "arg more bytes". */
    int64_t from_now =
        arg < 0 ? -1 : (int64_t)atomic_load(&e->moved) + arg;
    switch (kind) {
    case MOCK_TE_FAULT_NONE:
        atomic_store(&e->fail_after, -1);
        atomic_store(&e->delay_us, 0);
        atomic_store(&e->corrupt, 0);
        atomic_store(&e->drop, false);
        atomic_store(&e->vm_eperm, false);
        atomic_store(&e->stall_after, -1);
        break;
    case MOCK_TE_FAULT_FAIL_AFTER:
        atomic_store(&e->fail_after, from_now);
        break;
    case MOCK_TE_FAULT_DELAY_US:
        atomic_store(&e->delay_us, arg < 0 ? 0 : arg);
        break;
    case MOCK_TE_FAULT_CORRUPT:
        atomic_store(&e->corrupt, arg < 0 ? 0 : arg);
        break;
    case MOCK_TE_FAULT_DROP:
        if (arg > 1) return -1;
        atomic_store(&e->drop, arg == 1);
        if (arg == 1) {
            server_drop_conns(e);
            pthread_mutex_lock(&e->mu);
            for (size_t i = 0; i < e->nsegs; i++)
                if (e->segs[i]) peer_drop_idle(e->segs[i]);
            pthread_mutex_unlock(&e->mu);
        }
        break;
    case MOCK_TE_FAULT_STALL_AFTER:
        atomic_store(&e->stall_after, from_now);
        break;
    case MOCK_TE_FAULT_VM_EPERM:
        if (arg > 1) return -1;
        atomic_store(&e->vm_eperm, arg == 1);
        break;
    default:
        return -1;
    }
    faults_release_stall(e);
    return 0;
}

API int mock_te_abort_batch(transfer_engine_t engine, batch_id_t batch_id) {
    struct engine *e = engine_check(engine);
    if (!e) return -1;
    pthread_mutex_lock(&e->mu);
    struct batch *b = find_batch_locked(e, batch_id);
    for (size_t i = 0; b && i < b->n; i++)
        atomic_store(&b->tasks[i].aborted, true);
    /* Wakes workers held by a stall or a delay, which then cancel. */
    faults_release_stall(e);
    /* A worker inside the fence finishes one slice at most: a copy, never a
     * wait on a peer. e->mu keeps the batch from being freed meanwhile; no
     * worker takes it inside the fence. */
    for (size_t i = 0; b && i < b->n; i++)
        while (atomic_load(&b->tasks[i].touching)) sched_yield();
    pthread_mutex_unlock(&e->mu);
    return b ? 0 : -1;
}

API int mock_te_set_path(transfer_engine_t engine, int path) {
    struct engine *e = engine_check(engine);
    if (!e || path < MOCK_TE_PATH_AUTO || path > MOCK_TE_PATH_VM) return -1;
    atomic_store(&e->path, path);
    return 0;
}

API int mock_te_get_stats(transfer_engine_t engine, struct mock_te_stats *out,
                          size_t size) {
    struct engine *e = engine_check(engine);
    if (!e || !out) return -1;
    struct mock_te_stats s = {
        .vm_bytes = atomic_load(&e->stats.vm_bytes),
        .tcp_bytes = atomic_load(&e->stats.tcp_bytes),
        .vm_fallbacks = atomic_load(&e->stats.vm_fallbacks),
        .tasks_completed = atomic_load(&e->stats.tasks_completed),
        .tasks_failed = atomic_load(&e->stats.tasks_failed),
        .invalid_batch_calls = atomic_load(&e->stats.invalid_batch_calls),
        .frames_served = atomic_load(&e->stats.frames_served),
        .frames_rejected = atomic_load(&e->stats.frames_rejected),
    };
    memcpy(out, &s, size < sizeof(s) ? size : sizeof(s));
    return 0;
}
