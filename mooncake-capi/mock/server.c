/*
 * The engine's RPC listener: answers HELLO, serves READ and WRITE against
 * registered memory (checked when the frame arrives, as the real TCP
 * transport checks it), and queues notifications. Every field
 * of a request is checked before any memory is touched; a frame that cannot
 * be parsed closes the connection.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "internal.h"

static void put32le(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static void put64le(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32le(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
           (uint32_t)p[3] << 24;
}

/* The HELLO payload; layout documented at hello_decode. */
static uint8_t *hello_encode(struct engine *e, size_t *len) {
    size_t name_len = strlen(e->name);
    size_t n = 56 + name_len + 8;
    uint8_t *p = calloc(1, n);
    if (p) {
        put32le(p, (uint32_t)e->pid);
        put32le(p + 4, (uint32_t)name_len);
        put64le(p + 8, e->pidns);
        memcpy(p + 16, e->boot_id, sizeof(e->boot_id));
        memcpy(p + 56, e->name, name_len);
        put64le(p + 56 + name_len, (uint64_t)(uintptr_t)&e->regs.pub);
        *len = n;
    }
    return p;
}

int server_queue_notify(struct engine *e, const char *name, size_t name_len,
                        const char *msg, size_t msg_len) {
    char *n = strndup(name, name_len);
    char *m = strndup(msg, msg_len);
    int rc = -TE_MEMORY;
    pthread_mutex_lock(&e->mu);
    if (n && m && e->nnotifies < MAX_NOTIFIES) {
        if (!e->notifies) e->notifies = calloc(MAX_NOTIFIES, sizeof(*e->notifies));
        if (e->notifies) {
            e->notifies[e->nnotifies++] = (struct notify_entry){n, m};
            n = m = NULL;
            rc = 0;
        }
    }
    pthread_mutex_unlock(&e->mu);
    free(n);
    free(m);
    return rc;
}

struct conn_state {
    struct engine *e;
    int fd;
    uint8_t *buf; /* grows up to WIRE_MAX_IO */
    size_t cap;
};

static int reserve(struct conn_state *c, size_t n) {
    if (n <= c->cap) return 0;
    uint8_t *b = realloc(c->buf, n);
    if (!b) return -1;
    c->buf = b;
    c->cap = n;
    return 0;
}

static int reply(struct conn_state *c, const struct wire_hdr *h,
                 int32_t status, const void *payload, size_t len) {
    uint8_t hdr[WIRE_HDR_LEN];
    wire_encode_reply(hdr, h->type, status, len, h->tag);
    /* As the real transport's ServerSession, which arms no timer: the
     * client's status deadline is the only one, and a client stopped
     * mid-payload holds this connection until it resumes or the kernel
     * drops it (server_stop shuts the socket down to end the wait). */
    int rc = io_send_all(c->fd, hdr, sizeof(hdr), -1);
    if (rc == 0 && len > 0) rc = io_send_all(c->fd, payload, len, -1);
    if (status == 0)
        atomic_fetch_add(&c->e->stats.frames_served, 1);
    else
        atomic_fetch_add(&c->e->stats.frames_rejected, 1);
    return rc;
}

/* Returns < 0 when the connection must close. */
static int serve_one(struct conn_state *c, const struct wire_hdr *h) {
    struct engine *e = c->e;
    switch (h->type) {
    case WIRE_HELLO: {
        if (h->addr != 0 || h->length != 0) return -1;
        size_t len = 0;
        uint8_t *p = hello_encode(e, &len);
        if (!p) return reply(c, h, -TE_MEMORY, NULL, 0);
        int rc = reply(c, h, 0, p, len);
        free(p);
        return rc;
    }
    case WIRE_READ: {
        if (h->length == 0 || h->length > WIRE_MAX_IO)
            return reply(c, h, -TE_INVALID_ARGUMENT, NULL, 0);
        if (reserve(c, h->length)) return reply(c, h, -TE_MEMORY, NULL, 0);
        /* Copy under the read lock so an unregister cannot race the copy. */
        pthread_rwlock_rdlock(&e->regs.lock);
        bool ok = registry_covers_locked(&e->regs, h->addr, h->length);
        if (ok) memcpy(c->buf, (const void *)(uintptr_t)h->addr, h->length);
        pthread_rwlock_unlock(&e->regs.lock);
        if (!ok) return reply(c, h, -TE_ADDRESS_NOT_REGISTERED, NULL, 0);
        return reply(c, h, 0, c->buf, h->length);
    }
    case WIRE_WRITE: {
        /* The payload cannot be skipped safely when its length is absurd. */
        if (h->length == 0 || h->length > WIRE_MAX_IO) return -1;
        if (reserve(c, h->length)) return -1;
        if (io_recv_all(c->fd, c->buf, h->length, -1)) return -1;
        pthread_rwlock_rdlock(&e->regs.lock);
        bool ok = registry_covers_locked(&e->regs, h->addr, h->length);
        if (ok) memcpy((void *)(uintptr_t)h->addr, c->buf, h->length);
        pthread_rwlock_unlock(&e->regs.lock);
        return reply(c, h, ok ? 0 : -TE_ADDRESS_NOT_REGISTERED, NULL, 0);
    }
    case WIRE_NOTIFY: {
        if (h->addr != 0 || h->length < 8 || h->length > WIRE_MAX_NOTIFY)
            return -1;
        if (reserve(c, h->length)) return -1;
        if (io_recv_all(c->fd, c->buf, h->length, -1)) return -1;
        uint64_t nl = get32le(c->buf), ml = get32le(c->buf + 4);
        if (nl + ml != h->length - 8)
            return reply(c, h, -TE_INVALID_ARGUMENT, NULL, 0);
        const char *name = (const char *)c->buf + 8;
        int rc = server_queue_notify(e, name, nl, name + nl, ml);
        return reply(c, h, rc, NULL, 0);
    }
    }
    return -1;
}

static void *conn_main(void *arg) {
    struct server_conn *sc = arg;
    struct conn_state c = {.e = sc->eng, .fd = sc->fd};
    uint8_t raw[WIRE_HDR_LEN];
    for (;;) {
        /* Idle pooled connections may wait forever for their next request. */
        if (io_recv_all(c.fd, raw, sizeof(raw), -1)) break;
        if (atomic_load(&c.e->drop)) break;
        struct wire_hdr h;
        if (wire_decode(raw, false, &h)) {
            atomic_fetch_add(&c.e->stats.frames_rejected, 1);
            break;
        }
        if (serve_one(&c, &h) < 0) {
            atomic_fetch_add(&c.e->stats.frames_rejected, 1);
            break;
        }
    }
    free(c.buf);
    shutdown(c.fd, SHUT_RDWR);
    atomic_store(&sc->done, true);
    return NULL;
}

/* Joins the threads of finished connections; caller holds conns_mu. */
static void reap_locked(struct engine *e) {
    struct server_conn **pp = &e->conns;
    while (*pp) {
        struct server_conn *sc = *pp;
        if (!atomic_load(&sc->done)) {
            pp = &sc->next;
            continue;
        }
        *pp = sc->next;
        pthread_join(sc->thread, NULL);
        close(sc->fd);
        free(sc);
        e->nconns--;
    }
}

static void *accept_main(void *arg) {
    struct engine *e = arg;
    for (;;) {
        struct pollfd p[2] = {{.fd = e->listen_fd, .events = POLLIN},
                              {.fd = e->wake_fd, .events = POLLIN}};
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR) continue;
            break;
        }
        if (p[1].revents) break;
        if (!(p[0].revents & POLLIN)) continue;
        int fd = accept4(e->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) continue;
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        pthread_mutex_lock(&e->conns_mu);
        reap_locked(e);
        struct server_conn *sc = NULL;
        if (!e->conns_closing && !atomic_load(&e->drop) &&
            e->nconns < MAX_SERVER_CONNS)
            sc = calloc(1, sizeof(*sc));
        if (sc) {
            sc->fd = fd;
            sc->eng = e;
            if (pthread_create(&sc->thread, NULL, conn_main, sc) == 0) {
                sc->next = e->conns;
                e->conns = sc;
                e->nconns++;
            } else {
                free(sc);
                sc = NULL;
            }
        }
        pthread_mutex_unlock(&e->conns_mu);
        if (!sc) close(fd);
    }
    return NULL;
}

int server_start(struct engine *e, const char *host) {
    if (resolve_addr(host, "0", &e->listen_addr, &e->listen_addrlen))
        return -TE_DNS;
    e->listen_fd = socket(e->listen_addr.ss_family,
                          SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (e->listen_fd < 0) return -TE_SOCKET;
    if (bind(e->listen_fd, (struct sockaddr *)&e->listen_addr,
             e->listen_addrlen) ||
        listen(e->listen_fd, 64) ||
        getsockname(e->listen_fd, (struct sockaddr *)&e->listen_addr,
                    &e->listen_addrlen)) {
        close(e->listen_fd);
        e->listen_fd = -1;
        return -TE_SOCKET;
    }
    uint16_t port =
        e->listen_addr.ss_family == AF_INET6
            ? ntohs(((struct sockaddr_in6 *)&e->listen_addr)->sin6_port)
            : ntohs(((struct sockaddr_in *)&e->listen_addr)->sin_port);
    bool v6 = strchr(host, ':') != NULL;
    snprintf(e->name, sizeof(e->name), v6 ? "[%s]:%u" : "%s:%u", host,
             (unsigned)port);
    e->wake_fd = eventfd(0, EFD_CLOEXEC);
    if (e->wake_fd < 0 ||
        pthread_create(&e->accept_thread, NULL, accept_main, e)) {
        if (e->wake_fd >= 0) close(e->wake_fd);
        close(e->listen_fd);
        e->wake_fd = e->listen_fd = -1;
        return -TE_SOCKET;
    }
    return 0;
}

void server_drop_conns(struct engine *e) {
    pthread_mutex_lock(&e->conns_mu);
    for (struct server_conn *sc = e->conns; sc; sc = sc->next)
        shutdown(sc->fd, SHUT_RDWR);
    pthread_mutex_unlock(&e->conns_mu);
}

void server_stop(struct engine *e) {
    if (e->listen_fd < 0) return;
    uint64_t one = 1;
    ssize_t w = write(e->wake_fd, &one, sizeof(one));
    (void)w;
    pthread_join(e->accept_thread, NULL);
    pthread_mutex_lock(&e->conns_mu);
    e->conns_closing = true;
    struct server_conn *all = e->conns;
    e->conns = NULL;
    e->nconns = 0;
    for (struct server_conn *sc = all; sc; sc = sc->next)
        shutdown(sc->fd, SHUT_RDWR);
    pthread_mutex_unlock(&e->conns_mu);
    while (all) {
        struct server_conn *next = all->next;
        pthread_join(all->thread, NULL);
        close(all->fd);
        free(all);
        all = next;
    }
    close(e->listen_fd);
    close(e->wake_fd);
    e->listen_fd = e->wake_fd = -1;
}
