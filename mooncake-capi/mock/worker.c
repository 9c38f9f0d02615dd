/*
 * Worker threads: each takes a queued task, moves it slice by slice through
 * the fault hooks, and publishes the final state last, because a published
 * final state lets the caller free the batch that owns the task.
 */
#include <errno.h>
#include <stdlib.h>
#include <time.h>

#include "internal.h"

static int64_t mono_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* Sleeps until the monotonic time until unless the engine stops or the task
 * is aborted. */
static void pause_until(struct engine *e, struct task *t, int64_t until) {
    struct timespec ts = {.tv_sec = until / 1000000,
                          .tv_nsec = (until % 1000000) * 1000};
    pthread_mutex_lock(&e->qmu);
    while (!atomic_load(&e->stopping) && !atomic_load(&t->aborted) &&
           mono_us() < until)
        if (pthread_cond_timedwait(&e->qcv, &e->qmu, &ts) == ETIMEDOUT) break;
    pthread_mutex_unlock(&e->qmu);
}

static void pause_us(struct engine *e, struct task *t, int64_t us) {
    pause_until(e, t, mono_us() + us);
}

/*
 * Reserves the engine's link for n bytes and returns when the link will have
 * sent them: after every slice reserved before, at link_mbps. The caller moves
 * the bytes and then waits for that time, so a copy faster than the link
 * takes the link's time, as it would on a wire; 0 when unshaped.
 */
static int64_t link_reserve(struct engine *e, uint64_t n) {
    if (e->link_mbps <= 0) return 0;
    int64_t cost = (int64_t)((n + (uint64_t)e->link_mbps - 1) /
                             (uint64_t)e->link_mbps);
    int64_t now = mono_us();
    int64_t free_at = atomic_load(&e->link_free_us), end;
    do {
        end = (free_at > now ? free_at : now) + cost;
    } while (!atomic_compare_exchange_weak(&e->link_free_us, &free_at, end));
    return end;
}

static bool stalled(struct engine *e) {
    int64_t at = atomic_load(&e->stall_after);
    return at >= 0 && atomic_load(&e->moved) >= (uint64_t)at;
}

/* Holds the worker while a stall is armed and reached; false on stop or
 * abort. */
static bool wait_unstalled(struct engine *e, struct task *t) {
    if (stalled(e)) {
        pthread_mutex_lock(&e->qmu);
        while (!atomic_load(&e->stopping) && !atomic_load(&t->aborted) &&
               stalled(e))
            pthread_cond_wait(&e->qcv, &e->qmu);
        pthread_mutex_unlock(&e->qmu);
    }
    return !atomic_load(&e->stopping) && !atomic_load(&t->aborted);
}

/*
 * Claims up to want bytes of the fault budgets: the fail and stall limits
 * apply to the sum of all workers' bytes, so the claim is one atomic step.
 * Returns 0 when the fail budget is spent.
 */
static uint64_t claim(struct engine *e, uint64_t want) {
    for (;;) {
        uint64_t m = atomic_load(&e->moved);
        uint64_t n = want;
        int64_t fail = atomic_load(&e->fail_after);
        int64_t stall = atomic_load(&e->stall_after);
        if (fail >= 0) {
            if (m >= (uint64_t)fail) return 0;
            if (n > (uint64_t)fail - m) n = (uint64_t)fail - m;
        }
        if (stall >= 0 && m < (uint64_t)stall && n > (uint64_t)stall - m)
            n = (uint64_t)stall - m;
        if (atomic_compare_exchange_weak(&e->moved, &m, m + n)) return n;
    }
}

static bool take_corruption(struct engine *e) {
    int64_t c = atomic_load(&e->corrupt);
    while (c > 0)
        if (atomic_compare_exchange_weak(&e->corrupt, &c, c - 1)) return true;
    return false;
}

/* Flips one byte of what the task delivered, by the path it used. */
static int corrupt(struct engine *e, struct task *t) {
    const struct transfer_request *r = &t->req;
    uint64_t off = r->length / 2;
    if (r->opcode != OPCODE_WRITE) {
        if (!local_begin(t)) return -ECANCELED;
        volatile uint8_t *b = (uint8_t *)r->source + off;
        *b ^= 0xff;
        local_end(t);
        return 0;
    }
    uint8_t b;
    int rc = peer_transfer(e, NULL, t->peer, OPCODE_READ, (uintptr_t)&b,
                           r->target_offset + off, 1);
    b ^= 0xff;
    if (rc == 0)
        rc = peer_transfer(e, NULL, t->peer, OPCODE_WRITE, (uintptr_t)&b,
                           r->target_offset + off, 1);
    return rc;
}

static void finish(struct engine *e, struct task *t, int state) {
    peer_unref(t->peer);
    atomic_fetch_sub(&e->stats.inflight_bytes, t->req.length);
    if (state == STATUS_COMPLETED)
        atomic_fetch_add(&e->stats.tasks_completed, 1);
    else
        atomic_fetch_add(&e->stats.tasks_failed, 1);
    atomic_store_explicit(&t->state, state, memory_order_release);
}

static void run_task(struct engine *e, struct task *t) {
    const struct transfer_request *r = &t->req;
    int64_t start = mono_us();
    uint64_t done = 0;
    int state = STATUS_COMPLETED;
    while (done < r->length) {
        int64_t delay = atomic_load(&e->delay_us);
        if (delay > 0) pause_us(e, t, delay);
        if (!wait_unstalled(e, t)) {
            state = STATUS_CANCELED;
            break;
        }
        if (atomic_load(&e->drop)) {
            state = STATUS_FAILED;
            break;
        }
        uint64_t want = r->length - done;
        if (want > SLICE_BYTES) want = SLICE_BYTES;
        uint64_t n = claim(e, want);
        if (n == 0) {
            state = STATUS_FAILED;
            break;
        }
        int64_t sent_at = link_reserve(e, n);
        int rc = peer_transfer(e, t, t->peer, r->opcode,
                               (uintptr_t)r->source + done,
                               r->target_offset + done, n);
        if (!rc && sent_at) pause_until(e, t, sent_at);
        if (rc) {
            state = rc == -TE_CLOCK     ? STATUS_TIMEOUT
                    : rc == -ECANCELED ? STATUS_CANCELED
                                       : STATUS_FAILED;
            break;
        }
        done += n;
        if (e->task_timeout_ms > 0 && done < r->length &&
            mono_us() - start > (int64_t)e->task_timeout_ms * 1000) {
            state = STATUS_TIMEOUT;
            break;
        }
    }
    if (state == STATUS_COMPLETED && r->length > 0 && take_corruption(e)) {
        int rc = corrupt(e, t);
        if (rc) state = rc == -ECANCELED ? STATUS_CANCELED : STATUS_FAILED;
    }
    finish(e, t, state);
}

static void *worker_main(void *arg) {
    struct engine *e = arg;
    for (;;) {
        pthread_mutex_lock(&e->qmu);
        while (!atomic_load(&e->stopping) && !e->qhead)
            pthread_cond_wait(&e->qcv, &e->qmu);
        struct task *t = NULL;
        if (!atomic_load(&e->stopping)) {
            t = e->qhead;
            e->qhead = t->next;
            if (!e->qhead) e->qtail = NULL;
        }
        pthread_mutex_unlock(&e->qmu);
        if (!t) return NULL;
        run_task(e, t);
    }
}

int workers_start(struct engine *e, int n) {
    for (e->nworkers = 0; e->nworkers < n; e->nworkers++)
        if (pthread_create(&e->workers[e->nworkers], NULL, worker_main, e))
            return -TE_MEMORY;
    return 0;
}

void workers_stop(struct engine *e) {
    pthread_mutex_lock(&e->qmu);
    atomic_store(&e->stopping, true);
    pthread_cond_broadcast(&e->qcv);
    pthread_mutex_unlock(&e->qmu);
    for (int i = 0; i < e->nworkers; i++) pthread_join(e->workers[i], NULL);
    e->nworkers = 0;
    for (struct task *t = e->qhead, *next; t; t = next) {
        next = t->next;
        finish(e, t, STATUS_CANCELED);
    }
    e->qhead = e->qtail = NULL;
}

void workers_enqueue(struct engine *e, struct task *first, size_t n) {
    for (size_t i = 0; i < n; i++) {
        first[i].next = i + 1 < n ? &first[i + 1] : NULL;
        atomic_fetch_add(&e->stats.inflight_bytes, first[i].req.length);
    }
    pthread_mutex_lock(&e->qmu);
    if (e->qtail)
        e->qtail->next = first;
    else
        e->qhead = first;
    e->qtail = &first[n - 1];
    pthread_cond_broadcast(&e->qcv);
    pthread_mutex_unlock(&e->qmu);
}

void faults_release_stall(struct engine *e) {
    pthread_mutex_lock(&e->qmu);
    pthread_cond_broadcast(&e->qcv);
    pthread_mutex_unlock(&e->qmu);
}
