/*
 * The initiator side: opening segments by handshake, and moving bytes either
 * with process_vm_readv/writev (peer on the same kernel and pid namespace)
 * or over the peer's TCP server.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "internal.h"

int parse_host_port(const char *s, char *host, size_t host_len, char *port,
                    size_t port_len) {
    const char *h = s, *he, *p = NULL;
    if (*s == '[') {
        h = s + 1;
        he = strchr(h, ']');
        if (!he) return -1;
        if (he[1] == ':')
            p = he + 2;
        else if (he[1] != 0)
            return -1;
    } else {
        const char *c = strchr(s, ':');
        if (c && strchr(c + 1, ':')) {
            he = s + strlen(s); /* bare IPv6 address, no port */
        } else if (c) {
            he = c;
            p = c + 1;
        } else {
            he = s + strlen(s);
        }
    }
    size_t hl = (size_t)(he - h);
    if (hl == 0 || hl >= host_len) return -1;
    memcpy(host, h, hl);
    host[hl] = 0;
    if (!p) {
        port[0] = 0;
        return 0;
    }
    size_t pl = strlen(p);
    if (pl == 0 || pl >= port_len || pl > 5) return -1;
    for (size_t i = 0; i < pl; i++)
        if (p[i] < '0' || p[i] > '9') return -1;
    if (atoi(p) > 65535) return -1;
    memcpy(port, p, pl + 1);
    return 0;
}

int resolve_addr(const char *host, const char *port,
                 struct sockaddr_storage *out, socklen_t *outlen) {
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    if (getaddrinfo(host, port, &hints, &res) || !res) return -1;
    memcpy(out, res->ai_addr, res->ai_addrlen);
    *outlen = res->ai_addrlen;
    freeaddrinfo(res);
    return 0;
}

static int io_error(int rc) { return rc == -ETIMEDOUT ? -TE_CLOCK : -TE_SOCKET; }

static int dial(struct engine *e, struct peer *p) {
    int fd = socket(p->addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -TE_SOCKET;
    int rc = io_connect(fd, (struct sockaddr *)&p->addr, p->addrlen,
                        e->io_timeout_ms);
    if (rc) {
        close(fd);
        return io_error(rc);
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return fd;
}

static int conn_get(struct engine *e, struct peer *p) {
    pthread_mutex_lock(&p->mu);
    int fd = p->nidle > 0 ? p->idle[--p->nidle] : -1;
    pthread_mutex_unlock(&p->mu);
    return fd >= 0 ? fd : dial(e, p);
}

static void conn_put(struct engine *e, struct peer *p, int fd) {
    if (!atomic_load(&e->drop)) {
        pthread_mutex_lock(&p->mu);
        if (p->nidle < MAX_IDLE_CONNS) {
            p->idle[p->nidle++] = fd;
            fd = -1;
        }
        pthread_mutex_unlock(&p->mu);
    }
    if (fd >= 0) close(fd);
}

void peer_drop_idle(struct peer *p) {
    pthread_mutex_lock(&p->mu);
    while (p->nidle > 0) close(p->idle[--p->nidle]);
    pthread_mutex_unlock(&p->mu);
}

/* One request/reply exchange on fd. payload_in receives a READ reply. */
static int exchange(struct engine *e, int fd, uint16_t type, uint64_t addr,
                    const void *out, uint64_t out_len, void *in,
                    uint64_t in_len, uint8_t **hello, size_t *hello_len) {
    static atomic_uint_fast64_t next_tag = 1;
    uint64_t tag = atomic_fetch_add(&next_tag, 1);
    uint8_t raw[WIRE_HDR_LEN];
    uint64_t len = type == WIRE_READ ? in_len : out_len;
    wire_encode_request(raw, type, addr, len, tag);
    /* As the real TCP transport: the status frame (a READ's reply header,
     * a WRITE's ack) has the I/O deadline, a payload streaming either way
     * none (tcp_transport_session_impl.h). */
    int rc = io_send_all(fd, raw, sizeof(raw), e->io_timeout_ms);
    if (rc == 0 && out_len > 0) rc = io_send_all(fd, out, out_len, -1);
    if (rc == 0) rc = io_recv_all(fd, raw, sizeof(raw), e->io_timeout_ms);
    if (rc) return io_error(rc);
    struct wire_hdr h;
    if (wire_decode(raw, true, &h) || h.type != (type | WIRE_REPLY) ||
        h.tag != tag)
        return -TE_MALFORMED_JSON;
    if (h.status != 0) {
        if (h.length != 0) return -TE_MALFORMED_JSON;
        return h.status < 0 ? h.status : -TE_REJECT_HANDSHAKE;
    }
    if (type == WIRE_HELLO) {
        if (h.length < 64 || h.length > 64 + NAME_MAX_LEN)
            return -TE_MALFORMED_JSON;
        uint8_t *buf = malloc(h.length);
        if (!buf) return -TE_MEMORY;
        rc = io_recv_all(fd, buf, h.length, e->io_timeout_ms);
        if (rc) {
            free(buf);
            return io_error(rc);
        }
        *hello = buf;
        *hello_len = h.length;
        return 0;
    }
    if (h.length != (type == WIRE_READ ? in_len : 0)) return -TE_MALFORMED_JSON;
    if (h.length > 0) {
        rc = io_recv_all(fd, in, h.length, -1);
        /* EFAULT: the local buffer went away; the stream is out of sync. */
        if (rc) return rc == -EFAULT ? -TE_MEMORY : io_error(rc);
    }
    return 0;
}

static int hello_fetch(struct engine *e, struct peer *p, struct hello *out) {
    int fd = dial(e, p);
    if (fd < 0) return fd;
    uint8_t *buf = NULL;
    size_t len = 0;
    int rc = exchange(e, fd, WIRE_HELLO, 0, NULL, 0, NULL, 0, &buf, &len);
    close(fd);
    if (rc) return rc;
    rc = hello_decode(buf, len, out) ? -TE_MALFORMED_JSON : 0;
    free(buf);
    return rc;
}

static struct peer *peer_new(struct engine *e, const char *name) {
    struct peer *p = calloc(1, sizeof(*p));
    if (!p) return NULL;
    atomic_init(&p->refs, 1);
    p->eng = e;
    p->pidfd = -1;
    snprintf(p->name, sizeof(p->name), "%s", name);
    pthread_mutex_init(&p->mu, NULL);
    return p;
}

struct peer *peer_local(struct engine *e) {
    struct peer *p = peer_new(e, e->name);
    if (!p) return NULL;
    p->is_local = true;
    p->same_host = true;
    p->pid = e->pid;
    memcpy(&p->addr, &e->listen_addr, e->listen_addrlen);
    p->addrlen = e->listen_addrlen;
    return p;
}

struct peer *peer_open(struct engine *e, const char *name) {
    char host[NAME_MAX_LEN], port[8];
    if (parse_host_port(name, host, sizeof(host), port, sizeof(port)) ||
        port[0] == 0)
        return NULL;
    struct peer *p = peer_new(e, name);
    if (!p) return NULL;
    struct hello h;
    if (resolve_addr(host, port, &p->addr, &p->addrlen) ||
        hello_fetch(e, p, &h)) {
        peer_unref(p);
        return NULL;
    }
    p->pid = h.pid;
    p->table = h.table;
    p->same_host = h.pidns == e->pidns && e->boot_id[0] != 0 &&
                   strcmp(h.boot_id, e->boot_id) == 0;
#ifdef SYS_pidfd_open
    /* Holds the peer's identity: a recycled pid must never be read. */
    if (p->same_host) p->pidfd = (int)syscall(SYS_pidfd_open, h.pid, 0);
#endif
    return p;
}

void peer_ref(struct peer *p) { atomic_fetch_add(&p->refs, 1); }

void peer_unref(struct peer *p) {
    if (!p || atomic_fetch_sub(&p->refs, 1) != 1) return;
    peer_drop_idle(p);
    if (p->pidfd >= 0) close(p->pidfd);
    pthread_mutex_destroy(&p->mu);
    free(p->spans);
    free(p);
}

/* The peer's registrations are read where they are used (by its server,
 * or from its table on the same host), so a refresh only checks that the
 * peer still answers. */
int peer_refresh(struct engine *e, struct peer *p) {
    if (p->is_local) return 0;
    struct hello h;
    return hello_fetch(e, p, &h);
}

static bool peer_alive(struct peer *p) {
    if (p->pid == p->eng->pid) return true;
    if (p->pidfd >= 0) {
        struct pollfd pfd = {.fd = p->pidfd, .events = POLLIN};
        return poll(&pfd, 1, 0) == 0;
    }
    return kill(p->pid, 0) == 0 || errno == EPERM;
}

/* Reads exactly len bytes at addr of the peer's memory; 0 or -errno. */
static int peer_peek(struct peer *p, void *buf, uint64_t addr, size_t len) {
    struct iovec l = {.iov_base = buf, .iov_len = len};
    struct iovec r = {.iov_base = (void *)(uintptr_t)addr, .iov_len = len};
    for (;;) {
        ssize_t n = process_vm_readv(p->pid, &l, 1, &r, 1, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return -errno;
        return (size_t)n == len ? 0 : -EFAULT;
    }
}

/*
 * Brings the copy of the peer's registration table up to date: one read of
 * its header when nothing changed. The seqlock retries a read that raced a
 * change, including one of an array the peer freed meanwhile. Caller holds
 * p->mu. 0 or -errno.
 */
static int table_sync_locked(struct peer *p) {
    for (int attempt = 0; attempt < 1000; attempt++) {
        uint64_t t[3]; /* seq, n, spans: struct pubtab */
        int rc = peer_peek(p, t, p->table, sizeof(t));
        if (rc) return rc;
        if (t[0] & 1) {
            sched_yield();
            continue;
        }
        if (t[0] == p->seq) return 0;
        if (t[1] > TABLE_MAX_SPANS) return -EPROTO;
        struct span *v = malloc((t[1] ? t[1] : 1) * sizeof(*v));
        if (!v) return -ENOMEM;
        rc = t[1] ? peer_peek(p, v, t[2], t[1] * sizeof(*v)) : 0;
        uint64_t seq = 0;
        int rc2 = rc == 0 || rc == -EFAULT ? peer_peek(p, &seq, p->table, 8)
                                           : rc;
        if (rc == 0 && rc2 == 0 && seq == t[0]) {
            free(p->spans);
            p->spans = v;
            p->nspans = t[1];
            p->seq = t[0];
            return 0;
        }
        free(v);
        if (rc2) return rc2;
    }
    return -EAGAIN;
}

/* Whether the peer has [addr, addr+len) registered now; 0 or -errno. */
static int table_covers(struct peer *p, uint64_t addr, uint64_t len,
                        bool *covered) {
    pthread_mutex_lock(&p->mu);
    int rc = table_sync_locked(p);
    *covered = rc == 0 && spans_cover(p->spans, p->nspans, addr, len);
    pthread_mutex_unlock(&p->mu);
    return rc;
}

/* Copies between local and pid's remote; 0 or a negative errno. */
static int vm_copy(struct engine *e, int32_t pid, int opcode, uintptr_t local,
                   uint64_t remote, uint64_t len) {
    while (len > 0) {
        struct iovec l = {.iov_base = (void *)local, .iov_len = len};
        struct iovec r = {.iov_base = (void *)(uintptr_t)remote, .iov_len = len};
        ssize_t n = opcode == OPCODE_WRITE
                        ? process_vm_writev(pid, &l, 1, &r, 1, 0)
                        : process_vm_readv(pid, &l, 1, &r, 1, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return -errno;
        if (n == 0) return -EFAULT;
        local += (uintptr_t)n;
        remote += (uint64_t)n;
        len -= (uint64_t)n;
        atomic_fetch_add(&e->stats.vm_bytes, (uint64_t)n);
    }
    return 0;
}

/*
 * The same-host path. The owner's registrations are checked at transfer
 * time, as the real engine's server checks them: the engine's own under its
 * lock, a peer's in the table it publishes. A read is checked again after
 * the copy, so that bytes of a range unregistered meanwhile are not
 * reported. Returns 0 or a negative errno; -EFAULT for an unregistered
 * range.
 */
static int vm_io(struct engine *e, struct task *t, struct peer *p, int opcode,
                 uintptr_t local, uint64_t remote, uint64_t len) {
    if (atomic_load(&e->vm_eperm)) return -EPERM;
    if (p->is_local) {
        pthread_rwlock_rdlock(&e->regs.lock);
        int rc = -EFAULT;
        if (registry_covers_locked(&e->regs, remote, len)) {
            rc = local_begin(t) ? vm_copy(e, e->pid, opcode, local, remote, len)
                                : -ECANCELED;
            local_end(t);
        }
        pthread_rwlock_unlock(&e->regs.lock);
        return rc;
    }
    if (!peer_alive(p)) return -ESRCH;
    bool covered;
    int rc = table_covers(p, remote, len, &covered);
    if (rc) return rc;
    if (!covered) return -EFAULT;
    if (!local_begin(t)) return -ECANCELED;
    rc = vm_copy(e, p->pid, opcode, local, remote, len);
    local_end(t);
    if (rc) return rc;
    if (opcode != OPCODE_WRITE) {
        rc = table_covers(p, remote, len, &covered);
        if (rc) return rc;
        if (!covered) return -EFAULT;
    }
    /* Bytes read from a process that died meanwhile are not trusted. */
    return peer_alive(p) ? 0 : -ESRCH;
}

/* Only a timeout marks a peer down: a refused or reset connection fails
 * fast by itself, and a peer that comes back must be reachable at once. */
static void mark_down(struct engine *e, struct peer *p) {
    atomic_store(&p->down_until_ms, mono_ms() + e->io_timeout_ms);
}

/*
 * Copies n bytes within this process as the kernel does, so that a local
 * buffer that went away fails with -EFAULT, as a socket call into it would,
 * instead of faulting. 0 or -errno.
 */
static int self_copy(void *dst, const void *src, size_t n) {
    while (n > 0) {
        struct iovec l = {.iov_base = dst, .iov_len = n};
        struct iovec r = {.iov_base = (void *)src, .iov_len = n};
        ssize_t k = process_vm_readv(getpid(), &l, 1, &r, 1, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && errno == ENOSYS) {
            memcpy(dst, src, n);
            return 0;
        }
        if (k <= 0) return k < 0 ? -errno : -EFAULT;
        dst = (uint8_t *)dst + k;
        src = (const uint8_t *)src + k;
        n -= (size_t)k;
    }
    return 0;
}

/*
 * A fenced task's bytes cross the socket through a bounce buffer, so that
 * only a copy, never a wait on the peer, runs inside the abort fence.
 */
static int tcp_io(struct engine *e, struct task *t, struct peer *p, int opcode,
                  uintptr_t local, uint64_t remote, uint64_t len) {
    if (mono_ms() < atomic_load(&p->down_until_ms)) return -TE_SOCKET;
    uint8_t *bounce = NULL;
    if (t) {
        bounce = malloc(len);
        if (!bounce) return -TE_MEMORY;
        if (opcode == OPCODE_WRITE) {
            if (!local_begin(t)) {
                free(bounce);
                return -ECANCELED;
            }
            int rc = self_copy(bounce, (const void *)local, len);
            local_end(t);
            if (rc) {
                free(bounce);
                return -TE_MEMORY;
            }
        }
    }
    void *buf = bounce ? bounce : (void *)local;
    int fd = conn_get(e, p);
    if (fd < 0) {
        if (fd == -TE_CLOCK) mark_down(e, p);
        free(bounce);
        return fd;
    }
    int rc = opcode == OPCODE_WRITE
                 ? exchange(e, fd, WIRE_WRITE, remote, buf, len, NULL, 0, NULL,
                            NULL)
                 : exchange(e, fd, WIRE_READ, remote, NULL, 0, buf, len, NULL,
                            NULL);
    /* A refused range leaves the stream in sync; anything else may not. */
    if (rc == 0 || rc == -TE_ADDRESS_NOT_REGISTERED ||
        rc == -TE_INVALID_ARGUMENT) {
        conn_put(e, p, fd);
    } else {
        close(fd);
        if (rc == -TE_CLOCK) mark_down(e, p);
    }
    if (rc == 0) atomic_fetch_add(&e->stats.tcp_bytes, len);
    if (rc == 0 && bounce && opcode != OPCODE_WRITE) {
        if (local_begin(t)) {
            /* EFAULT: the local buffer went away. */
            if (self_copy((void *)local, bounce, len)) rc = -TE_MEMORY;
            local_end(t);
        } else {
            rc = -ECANCELED;
        }
    }
    free(bounce);
    return rc;
}

static void warn_eperm_once(struct engine *e, int32_t pid) {
    static atomic_bool warned;
    if (atomic_exchange(&warned, true)) return;
    char scope[16] = "absent";
    FILE *f = fopen("/proc/sys/kernel/yama/ptrace_scope", "re");
    if (f) {
        if (!fgets(scope, sizeof(scope), f)) snprintf(scope, sizeof(scope), "?");
        scope[strcspn(scope, "\n")] = 0;
        fclose(f);
    }
    fprintf(stderr,
            "mock-te: process_vm_readv/writev into pid %d failed with EPERM "
            "(%s; kernel.yama.ptrace_scope: %s); same-host transfers to that "
            "peer fall back to TCP\n",
            (int)pid,
            atomic_load(&e->vm_eperm) ? "injected by MOCK_TE_FAULT_VM_EPERM"
                                      : "Yama ptrace_scope or no CAP_SYS_PTRACE",
            scope);
}

int peer_transfer(struct engine *e, struct task *t, struct peer *p,
                  int opcode, uintptr_t local, uint64_t remote, uint64_t len) {
    int path = atomic_load(&e->path);
    bool vm = path != MOCK_TE_PATH_TCP && p->same_host &&
              !atomic_load(&p->vm_denied);
    if (path == MOCK_TE_PATH_VM && !vm) return -TE_NOT_SUPPORTED_TRANSPORT;
    if (vm) {
        int rc = vm_io(e, t, p, opcode, local, remote, len);
        if (rc == 0 || rc == -ECANCELED) return rc;
        if (rc != -EPERM || path == MOCK_TE_PATH_VM)
            return rc == -EFAULT ? -TE_ADDRESS_NOT_REGISTERED : -TE_ENDPOINT;
        if (!atomic_exchange(&p->vm_denied, true)) {
            atomic_fetch_add(&e->stats.vm_fallbacks, 1);
            warn_eperm_once(e, p->pid);
        }
        /* Nothing was moved: EPERM comes before any byte is copied. */
    }
    return tcp_io(e, t, p, opcode, local, remote, len);
}

int peer_notify(struct engine *e, struct peer *p, const char *name,
                const char *msg) {
    size_t nl = strlen(name), ml = strlen(msg);
    if (8 + nl + ml > WIRE_MAX_NOTIFY) return -TE_INVALID_ARGUMENT;
    uint8_t *buf = malloc(8 + nl + ml);
    if (!buf) return -TE_MEMORY;
    for (int i = 0; i < 4; i++) {
        buf[i] = (uint8_t)(nl >> (8 * i));
        buf[4 + i] = (uint8_t)(ml >> (8 * i));
    }
    memcpy(buf + 8, name, nl);
    memcpy(buf + 8 + nl, msg, ml);
    int fd = conn_get(e, p);
    int rc = fd;
    if (fd >= 0) {
        rc = exchange(e, fd, WIRE_NOTIFY, 0, buf, 8 + nl + ml, NULL, 0, NULL,
                      NULL);
        if (rc == 0)
            conn_put(e, p, fd);
        else
            close(fd);
    }
    free(buf);
    return rc;
}
