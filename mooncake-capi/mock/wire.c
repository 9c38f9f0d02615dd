/* Frame encoding and socket I/O shared by the server and the client side. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "internal.h"

static void put16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static void put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint16_t get16(const uint8_t *p) {
    return (uint16_t)(p[0] | (uint16_t)p[1] << 8);
}

static uint32_t get32(const uint8_t *p) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static uint64_t get64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

void wire_encode_request(uint8_t out[WIRE_HDR_LEN], uint16_t type,
                         uint64_t addr, uint64_t length, uint64_t tag) {
    put32(out, WIRE_MAGIC);
    put16(out + 4, WIRE_VERSION);
    put16(out + 6, type);
    put64(out + 8, addr);
    put64(out + 16, length);
    put64(out + 24, tag);
}

void wire_encode_reply(uint8_t out[WIRE_HDR_LEN], uint16_t type,
                       int32_t status, uint64_t length, uint64_t tag) {
    put32(out, WIRE_MAGIC);
    put16(out + 4, WIRE_VERSION);
    put16(out + 6, (uint16_t)(type | WIRE_REPLY));
    put32(out + 8, (uint32_t)status);
    put32(out + 12, 0);
    put64(out + 16, length);
    put64(out + 24, tag);
}

int wire_decode(const uint8_t in[WIRE_HDR_LEN], bool reply,
                struct wire_hdr *out) {
    memset(out, 0, sizeof(*out));
    out->magic = get32(in);
    out->version = get16(in + 4);
    out->type = get16(in + 6);
    out->length = get64(in + 16);
    out->tag = get64(in + 24);
    if (reply) {
        out->status = (int32_t)get32(in + 8);
        if (get32(in + 12) != 0) return -1;
    } else {
        out->addr = get64(in + 8);
    }
    if (out->magic != WIRE_MAGIC || out->version != WIRE_VERSION) return -1;
    return 0;
}

#define HELLO_FIXED 56

/*
 * HELLO payload, little-endian:
 *   0 u32 pid, 4 u32 name length, 8 u64 pid namespace inode,
 *   16 boot id (40 bytes, NUL-padded), 56 name, then u64 address of the
 *   peer's registration table (struct pubtab).
 */
int hello_decode(const uint8_t *p, size_t n, struct hello *out) {
    memset(out, 0, sizeof(*out));
    if (n < HELLO_FIXED + 8) return -1;
    out->pid = (int32_t)get32(p);
    uint32_t name_len = get32(p + 4);
    out->pidns = get64(p + 8);
    memcpy(out->boot_id, p + 16, sizeof(out->boot_id));
    out->boot_id[sizeof(out->boot_id) - 1] = 0;
    if (name_len == 0 || name_len >= NAME_MAX_LEN) return -1;
    if (n != HELLO_FIXED + (size_t)name_len + 8) return -1;
    memcpy(out->name, p + HELLO_FIXED, name_len);
    out->name[name_len] = 0;
    if (strlen(out->name) != name_len) return -1;
    out->table = get64(p + HELLO_FIXED + name_len);
    return 0;
}

int64_t mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Waits until fd is ready for events or the deadline passes. */
static int wait_fd(int fd, short events, int64_t deadline) {
    for (;;) {
        int wait = -1;
        if (deadline >= 0) {
            int64_t left = deadline - mono_ms();
            if (left <= 0) return -ETIMEDOUT;
            wait = left > 1000000 ? 1000000 : (int)left;
        }
        struct pollfd pfd = {.fd = fd, .events = events};
        int rc = poll(&pfd, 1, wait);
        if (rc > 0) return 0;
        if (rc < 0 && errno != EINTR) return -errno;
    }
}

/*
 * Connects fd within timeout_ms (< 0: no deadline). A blocking connect
 * bounded by SO_SNDTIMEO fails with EINTR whenever a signal lands on the
 * calling thread (signal(7): never restarted once a timeout is set), and a
 * Go host's threads take signals at any time; so the connect runs
 * non-blocking and the wait is a poll that resumes after a signal.
 * 0, -ETIMEDOUT or -errno.
 */
int io_connect(int fd, const struct sockaddr *addr, socklen_t len,
               int timeout_ms) {
    int64_t deadline = timeout_ms < 0 ? -1 : mono_ms() + timeout_ms;
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK)) return -errno;
    int rc = 0;
    if (connect(fd, addr, len)) {
        rc = errno == EINPROGRESS || errno == EINTR ? 0 : -errno;
        if (rc == 0) rc = wait_fd(fd, POLLOUT, deadline);
        int err = 0;
        socklen_t n = sizeof(err);
        if (rc == 0 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &n)) rc = -errno;
        if (rc == 0 && err) rc = -err;
    }
    if (fcntl(fd, F_SETFL, flags) && rc == 0) rc = -errno;
    return rc;
}

int io_send_all(int fd, const void *buf, size_t n, int timeout_ms) {
    const uint8_t *p = buf;
    int64_t deadline = timeout_ms < 0 ? -1 : mono_ms() + timeout_ms;
    while (n > 0) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return -errno;
        int rc = wait_fd(fd, POLLOUT, deadline);
        if (rc) return rc;
    }
    return 0;
}

int io_recv_all(int fd, void *buf, size_t n, int timeout_ms) {
    uint8_t *p = buf;
    int64_t deadline = timeout_ms < 0 ? -1 : mono_ms() + timeout_ms;
    while (n > 0) {
        ssize_t k = recv(fd, p, n, MSG_DONTWAIT);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k == 0) return -ECONNRESET;
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return -errno;
        int rc = wait_fd(fd, POLLIN, deadline);
        if (rc) return rc;
    }
    return 0;
}
