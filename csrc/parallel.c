/*
 * parallel.c: splitting large arrays across threads.
 *
 * One small pool of POSIX threads per process, started on first use. A call with at
 * least 2 * KVPS_GRAIN elements is cut into chunks of at least KVPS_GRAIN elements, about
 * four per thread, that the calling thread and up to kvps_num_threads() - 1 pool threads
 * take from a shared counter until none is left: a thread that the OS keeps off its core
 * (the machine is busy) holds up at most one chunk, the others take the rest.
 * Why these numbers: one core of a server CPU moves 10-20 GB/s, well short of what the
 * memory controllers give a socket, so memory-bound loops need several cores to reach
 * memory bandwidth; waking a pool thread costs a few microseconds, which a 64K-element
 * chunk (at least 128 KB moved) repays. Eight threads saturate the memory channels of
 * common servers, and more would take cores from the server's own I/O threads.
 *
 * Only one call uses the pool at a time: a second thread calling in meanwhile runs its
 * whole range itself (no queueing, no oversubscription), which suits servers that update
 * many keys from several engine threads. After fork() the child starts with no pool
 * threads (they do not survive fork) and builds a fresh pool when it needs one.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include "kvps_isa.h"

#define KVPS_MAX_THREADS 64
#define KVPS_DEFAULT_MAX_THREADS 8
#define KVPS_GRAIN ((int64_t)1 << 16)

typedef struct {
    kvps_range_fn fn;
    const void *args;
    int64_t n, chunk, nchunks;
    int helpers; /* pool threads that may join (kvps_num_threads() - 1 at most) */
} job_t;

static struct {
    pthread_mutex_t submit; /* owned by the one caller using the pool */
    pthread_mutex_t lock;   /* guards everything below but the atomics */
    pthread_cond_t wake, done;
    int started;            /* pool threads running */
    int threads;            /* kvps_num_threads(); 0 until first asked */
    uint64_t generation;    /* bumped for every job */
    job_t job;              /* the current job, valid while chunks remain */
    int joined;             /* pool threads that joined the current job */
    uint64_t ticket;        /* atomic: (generation << 32) | next chunk to take */
    int64_t remaining;      /* atomic: chunks not finished yet */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, 0, 0, 0, {NULL, NULL, 0, 0, 0, 0}, 0, 0, 0};

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void before_fork(void) {
    pthread_mutex_lock(&pool.submit);
    pthread_mutex_lock(&pool.lock);
}
static void after_fork_parent(void) {
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.submit);
}
static void after_fork_child(void) {
    pthread_mutex_init(&pool.submit, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.started = 0;
}
static void register_atfork(void) { pthread_atfork(before_fork, after_fork_parent, after_fork_child); }

static int default_threads(void) {
    int n = 0;
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0)
        n = CPU_COUNT(&set);
#endif
    if (n <= 0)
        n = (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (n <= 0)
        n = 1;
    return n < KVPS_DEFAULT_MAX_THREADS ? n : KVPS_DEFAULT_MAX_THREADS;
}

int kvps_num_threads(void) {
    pthread_mutex_lock(&pool.lock);
    if (pool.threads == 0)
        pool.threads = default_threads();
    int n = pool.threads;
    pthread_mutex_unlock(&pool.lock);
    return n;
}

int kvps_set_num_threads(int n) {
    if (n < 1 || n > KVPS_MAX_THREADS)
        return KVPS_ERR_ARG;
    pthread_mutex_lock(&pool.lock);
    pool.threads = n;
    pthread_mutex_unlock(&pool.lock);
    return KVPS_OK;
}

/* Take chunks of job `gen` until none is left; the last one to finish wakes the caller. */
static void take_chunks(uint64_t gen, const job_t *job) {
    for (;;) {
        uint64_t t = __atomic_load_n(&pool.ticket, __ATOMIC_ACQUIRE);
        if ((t >> 32) != (gen & 0xffffffffu) || (int64_t)(t & 0xffffffffu) >= job->nchunks)
            return;
        if (!__atomic_compare_exchange_n(&pool.ticket, &t, t + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;
        int64_t begin = (int64_t)(t & 0xffffffffu) * job->chunk;
        int64_t end = begin + job->chunk < job->n ? begin + job->chunk : job->n;
        job->fn(job->args, begin, end);
        if (__atomic_sub_fetch(&pool.remaining, 1, __ATOMIC_ACQ_REL) == 0) {
            pthread_mutex_lock(&pool.lock);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.lock);
        }
    }
}

static void *worker(void *arg) {
    (void)arg;
    /* Threads are only started by kvps_parallel_for, right before it publishes a job
     * (generation >= 1), so a new thread's first job is the current one. A thread that
     * wakes late finds the ticket of a newer job (or no chunk left) and takes nothing. */
    uint64_t seen = 0;
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        while (pool.generation == seen)
            pthread_cond_wait(&pool.wake, &pool.lock);
        seen = pool.generation;
        if (pool.joined >= pool.job.helpers)
            continue; /* the pool is larger than this job wants */
        pool.joined++;
        job_t job = pool.job;
        pthread_mutex_unlock(&pool.lock);
        take_chunks(seen, &job);
        pthread_mutex_lock(&pool.lock);
    }
    return NULL;
}

/* Start pool threads up to `want` (called with pool.lock held); returns how many run. */
static int ensure_started(int want) {
    if (pool.started >= want)
        return pool.started;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* signals stay with the application's threads */
    while (pool.started < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        int rc = pthread_create(&t, &attr, worker, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break;
        pool.started++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return pool.started;
}

void kvps_parallel_for(kvps_range_fn fn, const void *args, int64_t n, int64_t align) {
    int threads = kvps_num_threads();
    int64_t most = n / KVPS_GRAIN;
    int want = most < threads ? (int)most : threads;
    if (want < 2 || pthread_mutex_trylock(&pool.submit) != 0) {
        fn(args, 0, n);
        return;
    }
    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&pool.lock);
    int helpers = ensure_started(want - 1);
    if (helpers > want - 1)
        helpers = want - 1;
    int64_t pieces = 4 * (int64_t)(helpers + 1);
    int64_t chunk = (n + pieces - 1) / pieces;
    if (chunk < KVPS_GRAIN)
        chunk = KVPS_GRAIN;
    chunk = (chunk + align - 1) / align * align;
    job_t job = {fn, args, n, chunk, (n + chunk - 1) / chunk, helpers};
    uint64_t gen = ++pool.generation;
    pool.job = job;
    pool.joined = 0;
    __atomic_store_n(&pool.remaining, job.nchunks, __ATOMIC_RELEASE);
    __atomic_store_n(&pool.ticket, (gen & 0xffffffffu) << 32, __ATOMIC_RELEASE);
    if (helpers > 0)
        pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);

    take_chunks(gen, &job);

    pthread_mutex_lock(&pool.lock);
    while (__atomic_load_n(&pool.remaining, __ATOMIC_ACQUIRE) > 0)
        pthread_cond_wait(&pool.done, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.submit);
}
