/*
 * meshnode linger: keep a hop's CPU awake between decode steps.
 *
 * A hop of a route computes, sends its output on, and then waits while the
 * other hops compute: with one core each, that core idles about as long as
 * it works. A virtual CPU that idles halts, the hypervisor takes the
 * physical core back, and the next step's llama_decode runs slower: on this
 * project's machine kind, a split model's halves pinned to a core each spent
 * ~5% more time in llama.cpp than with their cores kept busy
 * (docs/performance.md, "Lingering between steps"). llama.cpp's thread pool
 * polls for its next graph for a like reason (its --poll), as a guest
 * kernel's haltpoll does where the host allows it.
 *
 * One thread per handle, at SCHED_IDLE (it takes a core only when nothing
 * else on the machine wants it): mn_linger_idle(until) has it spin until the
 * monotonic clock reaches ``until`` or mn_linger_busy() is called (the next
 * step came); otherwise it sleeps on a condition variable and uses no CPU.
 * It counts its lingers' wall time and its own CPU time in them: where other
 * work wants the core, a SCHED_IDLE spinner gets little of it, and the
 * caller stops lingering there. Pure C with its own pthread, so the spin
 * never holds Python's GIL.
 * meshnode/executor/linger.py decides how long to linger; this file only
 * does it.
 *
 * Compiled as a Python extension only to ride setuptools' build; it has no
 * PyInit and is loaded with ctypes.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

struct mn_linger {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    int stop;       /* set by busy(): end the spin now (read without the lock) */
    int64_t stopped_at; /* when busy() set it: a spinner preempted by the step notices later */
    int closed;
    uint64_t gen;   /* bumped by every idle() */
    int64_t until;  /* CLOCK_MONOTONIC ns */
    uint64_t spins; /* lingers ended by busy() (the step came in time) */
    uint64_t lapses; /* lingers that reached their deadline */
    uint64_t wall_ns; /* lingers' time, start to end */
    uint64_t cpu_ns;  /* of it, the time this thread had a core (others took the rest) */
};

/* No pause hint: with one, lingering gained nothing in turn (docs/performance.md), likely because
 * KVM's pause-loop exiting takes a PAUSE loop for a spinning lock and hands the physical core away,
 * which is what lingering is meant to prevent. A compiler barrier keeps the flag re-read each round. */
static inline void relax(void) {
    __asm__ __volatile__("" ::: "memory");
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline int64_t cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void *run(void *arg) {
    struct mn_linger *l = arg;
    struct sched_param p = {0};
    pthread_setschedparam(pthread_self(), SCHED_IDLE, &p); /* best effort: spin only on an idle core */
    uint64_t served = 0;
    pthread_mutex_lock(&l->mu);
    for (;;) {
        while (l->gen == served && !l->closed) {
            pthread_cond_wait(&l->cv, &l->mu);
        }
        if (l->closed) {
            break;
        }
        served = l->gen;
        int64_t until = l->until;
        pthread_mutex_unlock(&l->mu);
        int64_t w0 = now_ns(), c0 = cpu_ns();
        int stopped = 0;
        while (!stopped) {
            for (int i = 0; i < 256; i++) {
                /* a new idle() also ends it: the step came and went while this thread was preempted,
                 * and idle() cleared ``stop`` again before it could see it */
                if (__atomic_load_n(&l->stop, __ATOMIC_ACQUIRE) ||
                    __atomic_load_n(&l->gen, __ATOMIC_ACQUIRE) != served) {
                    stopped = 1;
                    break;
                }
                relax();
            }
            if (!stopped && now_ns() >= until) {
                break;
            }
        }
        int64_t w1 = now_ns(), c1 = cpu_ns();
        if (stopped) { /* the linger ended when busy() was called, not when this thread next ran */
            int64_t at = __atomic_load_n(&l->stopped_at, __ATOMIC_RELAXED);
            w1 = at < w0 ? w0 : (at < w1 ? at : w1);
        }
        pthread_mutex_lock(&l->mu);
        l->wall_ns += (uint64_t)(w1 - w0);
        l->cpu_ns += (uint64_t)(c1 - c0);
        if (stopped) {
            l->spins++;
        } else {
            l->lapses++;
        }
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

struct mn_linger *mn_linger_new(void) {
    struct mn_linger *l = calloc(1, sizeof *l);
    if (!l) {
        return NULL;
    }
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv, NULL);
    l->stop = 1;
    if (pthread_create(&l->thread, NULL, run, l) != 0) {
        pthread_cond_destroy(&l->cv);
        pthread_mutex_destroy(&l->mu);
        free(l);
        return NULL;
    }
    return l;
}

/* A step ended: spin until ``until_ns`` (CLOCK_MONOTONIC) or the next busy(). */
void mn_linger_idle(struct mn_linger *l, int64_t until_ns) {
    pthread_mutex_lock(&l->mu);
    l->until = until_ns;
    __atomic_store_n(&l->stop, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&l->gen, l->gen + 1, __ATOMIC_RELEASE);
    pthread_cond_signal(&l->cv);
    pthread_mutex_unlock(&l->mu);
}

/* A step starts: end the spin (lock-free; the thread sees it within a few hundred rounds of its loop). */
void mn_linger_busy(struct mn_linger *l) {
    __atomic_store_n(&l->stopped_at, now_ns(), __ATOMIC_RELAXED);
    __atomic_store_n(&l->stop, 1, __ATOMIC_RELEASE);
}

/* The lingers so far: [0] ended by the next step, [1] by the deadline, [2] their wall time and [3] the
 * CPU time the spinner got in it (ns): a spinner at SCHED_IDLE gets little where others want the core. */
void mn_linger_counts(struct mn_linger *l, uint64_t out[4]) {
    pthread_mutex_lock(&l->mu);
    out[0] = l->spins;
    out[1] = l->lapses;
    out[2] = l->wall_ns;
    out[3] = l->cpu_ns;
    pthread_mutex_unlock(&l->mu);
}

void mn_linger_free(struct mn_linger *l) {
    if (!l) {
        return;
    }
    __atomic_store_n(&l->stop, 1, __ATOMIC_RELAXED);
    pthread_mutex_lock(&l->mu);
    l->closed = 1;
    pthread_cond_signal(&l->cv);
    pthread_mutex_unlock(&l->mu);
    pthread_join(l->thread, NULL);
    pthread_cond_destroy(&l->cv);
    pthread_mutex_destroy(&l->mu);
    free(l);
}
