/* Registered memory: a sorted array of disjoint spans under a rwlock, and
 * its published copy that same-host peers read at transfer time. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

void registry_init(struct registry *r) {
    memset(r, 0, sizeof(*r));
    pthread_rwlock_init(&r->lock, NULL);
    /* Readers take seq 0 for "never read": a published table is >= 2. */
    atomic_store(&r->pub.seq, 2);
}

void registry_destroy(struct registry *r) {
    pthread_rwlock_destroy(&r->lock);
    free(r->v);
    free(r->pub_spans);
    r->v = r->pub_spans = NULL;
    r->n = r->cap = 0;
}

/* Rewrites the published table; caller holds the write lock. The old array
 * is freed at once: a peer that still reads it sees seq move and rereads. */
static void publish_locked(struct registry *r) {
    struct span *copy = malloc((r->n ? r->n : 1) * sizeof(*copy));
    uint64_t seq = atomic_load_explicit(&r->pub.seq, memory_order_relaxed);
    atomic_store_explicit(&r->pub.seq, seq + 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    if (copy) {
        memcpy(copy, r->v, r->n * sizeof(*copy));
        atomic_store_explicit(&r->pub.n, r->n, memory_order_relaxed);
    } else {
        /* Out of memory: publish nothing rather than a stale table, so
         * same-host transfers fail instead of reaching removed memory. */
        atomic_store_explicit(&r->pub.n, 0, memory_order_relaxed);
    }
    atomic_store_explicit(&r->pub.spans, (uint64_t)(uintptr_t)copy,
                          memory_order_relaxed);
    atomic_store_explicit(&r->pub.seq, seq + 2, memory_order_release);
    free(r->pub_spans);
    r->pub_spans = copy;
}

/* First index whose span starts at or after addr. */
static size_t lower_bound(const struct span *v, size_t n, uint64_t addr) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (v[mid].addr < addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static bool overlaps_locked(const struct registry *r, uint64_t addr,
                            uint64_t len) {
    size_t i = lower_bound(r->v, r->n, addr);
    if (i < r->n && r->v[i].addr - addr < len) return true;
    if (i > 0 && addr - r->v[i - 1].addr < r->v[i - 1].len) return true;
    return false;
}

static int cmp_span(const void *a, const void *b) {
    uint64_t x = ((const struct span *)a)->addr;
    uint64_t y = ((const struct span *)b)->addr;
    return x < y ? -1 : x > y;
}

int registry_add(struct registry *r, const struct span *add, size_t n) {
    if (n == 0) return 0;
    struct span *sorted = malloc(n * sizeof(*sorted));
    if (!sorted) return -TE_MEMORY;
    memcpy(sorted, add, n * sizeof(*sorted));
    qsort(sorted, n, sizeof(*sorted), cmp_span);
    for (size_t i = 0; i < n; i++) {
        if (sorted[i].len == 0 ||
            sorted[i].addr + sorted[i].len < sorted[i].addr) {
            free(sorted);
            return -TE_INVALID_ARGUMENT;
        }
        if (i > 0 && sorted[i].addr - sorted[i - 1].addr < sorted[i - 1].len) {
            free(sorted);
            return -TE_ADDRESS_OVERLAPPED;
        }
    }
    pthread_rwlock_wrlock(&r->lock);
    int rc = 0;
    for (size_t i = 0; i < n && rc == 0; i++)
        if (overlaps_locked(r, sorted[i].addr, sorted[i].len))
            rc = -TE_ADDRESS_OVERLAPPED;
    if (rc == 0 && r->n + n > r->cap) {
        size_t cap = r->cap ? r->cap : 16;
        while (cap < r->n + n) cap *= 2;
        struct span *v = realloc(r->v, cap * sizeof(*v));
        if (!v)
            rc = -TE_MEMORY;
        else {
            r->v = v;
            r->cap = cap;
        }
    }
    if (rc == 0) {
        /* Merge the two sorted runs from the back, in place. */
        size_t i = r->n, j = n, k = r->n + n;
        while (j > 0) {
            if (i > 0 && r->v[i - 1].addr > sorted[j - 1].addr)
                r->v[--k] = r->v[--i];
            else
                r->v[--k] = sorted[--j];
        }
        r->n += n;
        publish_locked(r);
    }
    pthread_rwlock_unlock(&r->lock);
    free(sorted);
    return rc;
}

int registry_remove(struct registry *r, void *const *addrs, size_t n) {
    int rc = 0;
    bool changed = false;
    pthread_rwlock_wrlock(&r->lock);
    for (size_t j = 0; j < n; j++) {
        uint64_t a = (uint64_t)(uintptr_t)addrs[j];
        size_t i = lower_bound(r->v, r->n, a);
        if (i >= r->n || r->v[i].addr != a) {
            rc = -TE_ADDRESS_NOT_REGISTERED;
            continue;
        }
        memmove(&r->v[i], &r->v[i + 1], (r->n - i - 1) * sizeof(r->v[0]));
        r->n--;
        changed = true;
    }
    if (changed) publish_locked(r);
    pthread_rwlock_unlock(&r->lock);
    return rc;
}

bool spans_cover(const struct span *v, size_t n, uint64_t addr, uint64_t len) {
    if (len == 0 || addr + len < addr) return false;
    /* The last span starting at or before addr is the only candidate. */
    size_t i = lower_bound(v, n, addr + 1);
    if (i == 0) return false;
    const struct span *g = &v[i - 1];
    return addr - g->addr <= g->len && len <= g->len - (addr - g->addr);
}

bool registry_covers_locked(const struct registry *r, uint64_t addr,
                            uint64_t len) {
    return spans_cover(r->v, r->n, addr, len);
}
