/* Registered memory: a sorted array of disjoint regions under a rwlock. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

void registry_init(struct registry *r) {
    memset(r, 0, sizeof(*r));
    pthread_rwlock_init(&r->lock, NULL);
}

void registry_destroy(struct registry *r) {
    pthread_rwlock_destroy(&r->lock);
    free(r->v);
    r->v = NULL;
    r->n = r->cap = 0;
}

/* First index whose region starts at or after addr. */
static size_t lower_bound(const struct registry *r, uintptr_t addr) {
    size_t lo = 0, hi = r->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (r->v[mid].addr < addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static bool overlaps_locked(const struct registry *r, uintptr_t addr,
                            uint64_t len) {
    size_t i = lower_bound(r, addr);
    if (i < r->n && r->v[i].addr - addr < len) return true;
    if (i > 0 && addr - r->v[i - 1].addr < r->v[i - 1].len) return true;
    return false;
}

static int cmp_region(const void *a, const void *b) {
    uintptr_t x = ((const struct region *)a)->addr;
    uintptr_t y = ((const struct region *)b)->addr;
    return x < y ? -1 : x > y;
}

int registry_add(struct registry *r, const struct region *add, size_t n) {
    if (n == 0) return 0;
    struct region *sorted = malloc(n * sizeof(*sorted));
    if (!sorted) return -TE_MEMORY;
    memcpy(sorted, add, n * sizeof(*sorted));
    qsort(sorted, n, sizeof(*sorted), cmp_region);
    for (size_t i = 0; i < n; i++) {
        if (sorted[i].addr == 0 || sorted[i].len == 0 ||
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
        struct region *v = realloc(r->v, cap * sizeof(*v));
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
    }
    pthread_rwlock_unlock(&r->lock);
    free(sorted);
    return rc;
}

int registry_remove(struct registry *r, void *const *addrs, size_t n) {
    pthread_rwlock_wrlock(&r->lock);
    for (size_t j = 0; j < n; j++) {
        size_t i = lower_bound(r, (uintptr_t)addrs[j]);
        if (i >= r->n || r->v[i].addr != (uintptr_t)addrs[j]) {
            pthread_rwlock_unlock(&r->lock);
            return -TE_ADDRESS_NOT_REGISTERED;
        }
    }
    for (size_t j = 0; j < n; j++) {
        size_t i = lower_bound(r, (uintptr_t)addrs[j]);
        /* A duplicate in addrs was removed by an earlier round. */
        if (i >= r->n || r->v[i].addr != (uintptr_t)addrs[j]) continue;
        memmove(&r->v[i], &r->v[i + 1], (r->n - i - 1) * sizeof(r->v[0]));
        r->n--;
    }
    pthread_rwlock_unlock(&r->lock);
    return 0;
}

bool registry_covers_locked(const struct registry *r, uint64_t addr,
                            uint64_t len, bool need_remote) {
    if (len == 0 || addr + len < addr) return false;
    size_t i = lower_bound(r, (uintptr_t)addr + 1);
    if (i == 0) return false;
    const struct region *g = &r->v[i - 1];
    if (need_remote && !g->remote) return false;
    return addr - g->addr <= g->len && len <= g->len - (addr - g->addr);
}

bool registry_covers(struct registry *r, uint64_t addr, uint64_t len,
                     bool need_remote) {
    pthread_rwlock_rdlock(&r->lock);
    bool ok = registry_covers_locked(r, addr, len, need_remote);
    pthread_rwlock_unlock(&r->lock);
    return ok;
}

int registry_snapshot(struct registry *r, struct span **out, size_t *n) {
    pthread_rwlock_rdlock(&r->lock);
    size_t k = 0;
    struct span *v = malloc((r->n ? r->n : 1) * sizeof(*v));
    if (v) {
        for (size_t i = 0; i < r->n; i++)
            if (r->v[i].remote)
                v[k++] = (struct span){r->v[i].addr, r->v[i].len};
    }
    pthread_rwlock_unlock(&r->lock);
    if (!v) return -TE_MEMORY;
    *out = v;
    *n = k;
    return 0;
}
