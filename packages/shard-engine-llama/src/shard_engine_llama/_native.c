/* Native llama.cpp callbacks of the llama engine (optional; _abi falls back to Python ones).
 *
 * llama.cpp calls its graph-evaluation callback for every graph node before the one a non-tail
 * shard captures (a few hundred per decode) and its abort callback after every node. As ctypes
 * callbacks each call takes the GIL and runs Python: measured with callgrind on a 3-way split,
 * that was most of what an extra shard cost per token beyond its layers' compute. These two
 * functions do the same work without leaving C. Nothing here knows Python objects: _abi passes
 * plain memory (a capture_state and a flag byte) and the ggml functions to call.
 *
 * Built by setuptools as an optional extension module; _abi loads it with ctypes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define CAPTURE_NAME_BYTES 64 /* GGML_MAX_NAME of the pinned release */
#define GGML_TYPE_F32 0

enum capture_error {
    CAPTURE_OK = 0,
    CAPTURE_BAD_TYPE = 1,   /* not F32 */
    CAPTURE_BAD_SHAPE = 2,  /* row width differs from n_embd, or more than 2 dimensions */
    CAPTURE_OVERFLOW = 3,   /* more rows than the destination holds */
    CAPTURE_BAD_BYTES = 4,  /* ggml_nbytes disagrees with rows * row_bytes (not contiguous) */
};

/* Filled by _abi (ctypes.Structure of the same layout) before llama_decode. */
struct capture_state {
    const char *(*get_name)(const void *tensor);                      /* ggml_get_name */
    void (*tensor_get)(const void *tensor, void *dst, size_t offset, size_t size);
    size_t (*nbytes)(const void *tensor);                             /* ggml_nbytes */
    int64_t ne_offset;        /* offset of ggml_tensor.ne in bytes */
    int64_t row_values;       /* n_embd: float32 values per captured row */
    int64_t capacity_rows;    /* rows the destination holds */
    char *destination;        /* capacity_rows * row_values float32 */
    int64_t rows;             /* rows captured so far (one graph per ubatch appends) */
    int32_t error;            /* enum capture_error; the graph is stopped on an error */
    int32_t calls;            /* data-phase calls (diagnostics) */
    char name[CAPTURE_NAME_BYTES]; /* the tensor to capture, NUL-terminated */
};

/* ggml_backend_sched_eval_callback: interested only in the tensor called `name`; when it has
 * been computed, append its rows to the destination and stop the graph (the identity block and
 * lm-head after it are never computed). */
bool shard_engine_capture_eval(void *tensor, bool ask, void *user_data)
{
    struct capture_state *state = (struct capture_state *)user_data;
    if (tensor == NULL || state == NULL) {
        return true;
    }
    if (ask) {
        return strncmp(state->get_name(tensor), state->name, CAPTURE_NAME_BYTES) == 0;
    }
    state->calls += 1;
    const int32_t type = *(const int32_t *)tensor;
    const int64_t *ne = (const int64_t *)((const char *)tensor + state->ne_offset);
    if (type != GGML_TYPE_F32) {
        state->error = CAPTURE_BAD_TYPE;
        return false;
    }
    if (ne[0] != state->row_values || ne[2] != 1 || ne[3] != 1 || ne[1] < 0) {
        state->error = CAPTURE_BAD_SHAPE;
        return false;
    }
    if (ne[1] > state->capacity_rows - state->rows) {
        state->error = CAPTURE_OVERFLOW;
        return false;
    }
    const size_t row_bytes = (size_t)state->row_values * sizeof(float);
    const size_t size = state->nbytes(tensor);
    if (size != (size_t)ne[1] * row_bytes) {
        state->error = CAPTURE_BAD_BYTES;
        return false;
    }
    state->tensor_get(tensor, state->destination + (size_t)state->rows * row_bytes, 0, size);
    state->rows += ne[1];
    return false;
}

/* ggml_abort_callback: true once the byte at `flag` is non-zero (set by another thread). */
bool shard_engine_abort_flag(void *flag)
{
    return flag != NULL && __atomic_load_n((const unsigned char *)flag, __ATOMIC_RELAXED) != 0;
}

/* ---- Compute threads: every llama_decode of the process in as few libgomp teams as possible --
 *
 * An OpenMP build of ggml runs each graph in libgomp's thread team of the *calling* thread, and
 * libgomp keeps one team per thread that ever called, for that thread's lifetime. Once the
 * process holds more team threads than CPUs, libgomp throttles every barrier's spin to 100
 * iterations, so the threads of a graph sleep and are woken at almost every node. A server that
 * serves successive requests on different threads (a thread pool, turn-taking readers, an
 * asyncio executor) got exactly that: a gemma3-270m head shard decoded in 8.9 ms called from two
 * alternating threads against 1.8 ms from one (121 against 0 voluntary context switches per
 * decode). So every llama_decode goes to a compute thread, the lowest-numbered idle one: calls
 * made one after another, from whichever threads, all run on compute thread 0 and its one team.
 * A call that overlaps a running one gets compute thread 1 (and so on), which ends after
 * IDLE_EXIT_S without work, taking its team with it. (Running a lone caller's calls on the
 * caller until a second thread calls saves two wake-ups per call, but leaves the first caller's
 * team behind whenever that thread stops calling — a server's loading thread does — and two
 * teams are already throttled on two CPUs.) The caller waits without the GIL (ctypes releases
 * it). After fork() the child starts with no compute threads.
 */
#include <errno.h>
#include <pthread.h>
#include <time.h>

#define MAX_COMPUTE_THREADS 64
#define IDLE_EXIT_S 2
#define COMPUTE_STACK_BYTES (8u << 20)

/* struct llama_batch of the pinned release (passed to llama_decode by value). */
struct llama_batch_abi {
    int32_t n_tokens;
    void *token;
    void *embd;
    void *pos;
    void *n_seq_id;
    void *seq_id;
    void *logits;
};

typedef int32_t (*llama_decode_fn)(void *context, struct llama_batch_abi batch);

struct compute_slot {
    pthread_cond_t wake;          /* a job was posted, or (slots > 0) time to check idleness */
    pthread_cond_t finished;      /* the job's result is in `result` */
    int alive;                    /* the thread runs (or is starting) */
    int busy;                     /* a caller owns this slot until it has read the result */
    int posted;                   /* a job waits to be run */
    int done;
    llama_decode_fn fn;
    void *context;
    struct llama_batch_abi batch;
    int32_t result;
};

static pthread_mutex_t compute_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t compute_slot_free = PTHREAD_COND_INITIALIZER;
static struct compute_slot compute_slots[MAX_COMPUTE_THREADS];
static int compute_initialized;
static int compute_threads_started; /* diagnostics: threads created since load (or fork) */

static void compute_init_locked(void)
{
    if (compute_initialized) {
        return;
    }
    for (int i = 0; i < MAX_COMPUTE_THREADS; i++) {
        pthread_cond_init(&compute_slots[i].wake, NULL);
        pthread_cond_init(&compute_slots[i].finished, NULL);
    }
    compute_initialized = 1;
}

static void *compute_main(void *arg)
{
    struct compute_slot *slot = (struct compute_slot *)arg;
    const int index = (int)(slot - compute_slots);
    pthread_mutex_lock(&compute_lock);
    for (;;) {
        while (!slot->posted) {
            if (index == 0) {
                pthread_cond_wait(&slot->wake, &compute_lock);
                continue;
            }
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_sec += IDLE_EXIT_S;
            int status = pthread_cond_timedwait(&slot->wake, &compute_lock, &until);
            if (status == ETIMEDOUT && !slot->posted && !slot->busy) {
                slot->alive = 0;
                pthread_mutex_unlock(&compute_lock);
                return NULL;
            }
        }
        slot->posted = 0;
        llama_decode_fn fn = slot->fn;
        void *context = slot->context;
        struct llama_batch_abi batch = slot->batch;
        pthread_mutex_unlock(&compute_lock);
        int32_t result = fn(context, batch);
        pthread_mutex_lock(&compute_lock);
        slot->result = result;
        slot->done = 1;
        pthread_cond_signal(&slot->finished);
    }
}

static void compute_atfork_prepare(void) { pthread_mutex_lock(&compute_lock); }
static void compute_atfork_parent(void) { pthread_mutex_unlock(&compute_lock); }
static void compute_atfork_child(void)
{
    /* Only the forking thread survives, holding the lock (prepare took it): no compute thread
     * runs in the child and nobody waits on a condition. */
    pthread_cond_init(&compute_slot_free, NULL);
    memset(compute_slots, 0, sizeof(compute_slots));
    compute_initialized = 0;
    compute_threads_started = 0;
    pthread_mutex_unlock(&compute_lock);
}

static pthread_once_t compute_atfork_once = PTHREAD_ONCE_INIT;
static void compute_register_atfork(void)
{
    pthread_atfork(compute_atfork_prepare, compute_atfork_parent, compute_atfork_child);
}

/* Claim the lowest idle slot, starting its thread if needed; -1 when a thread cannot start
 * (the caller then runs the call itself). Waits while every slot is busy. */
static int compute_claim_locked(void)
{
    for (;;) {
        for (int i = 0; i < MAX_COMPUTE_THREADS; i++) {
            struct compute_slot *slot = &compute_slots[i];
            if (slot->busy) {
                continue;
            }
            if (!slot->alive) {
                pthread_attr_t attributes;
                pthread_t thread;
                pthread_attr_init(&attributes);
                pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
                pthread_attr_setstacksize(&attributes, COMPUTE_STACK_BYTES);
                int status = pthread_create(&thread, &attributes, compute_main, slot);
                pthread_attr_destroy(&attributes);
                if (status != 0) {
                    return -1;
                }
                slot->alive = 1;
                compute_threads_started += 1;
            }
            slot->busy = 1;
            return i;
        }
        pthread_cond_wait(&compute_slot_free, &compute_lock);
    }
}

/* llama_decode(context, *batch) on a compute thread; returns its status. */
int32_t shard_engine_decode(void *fn, void *context, const struct llama_batch_abi *batch)
{
    pthread_once(&compute_atfork_once, compute_register_atfork);
    pthread_mutex_lock(&compute_lock);
    compute_init_locked();
    const int index = compute_claim_locked();
    if (index < 0) {
        pthread_mutex_unlock(&compute_lock);
        return ((llama_decode_fn)fn)(context, *batch);
    }
    struct compute_slot *slot = &compute_slots[index];
    slot->fn = (llama_decode_fn)fn;
    slot->context = context;
    slot->batch = *batch;
    slot->done = 0;
    slot->posted = 1;
    pthread_cond_signal(&slot->wake);
    while (!slot->done) {
        pthread_cond_wait(&slot->finished, &compute_lock);
    }
    const int32_t result = slot->result;
    slot->busy = 0;
    pthread_cond_signal(&compute_slot_free);
    pthread_mutex_unlock(&compute_lock);
    return result;
}

/* How many compute threads run now and how many were started (tests and diagnostics). */
void shard_engine_compute_threads(int32_t *alive, int32_t *started)
{
    pthread_mutex_lock(&compute_lock);
    int32_t count = 0;
    for (int i = 0; i < MAX_COMPUTE_THREADS; i++) {
        count += compute_slots[i].alive;
    }
    *alive = count;
    *started = compute_threads_started;
    pthread_mutex_unlock(&compute_lock);
}

/* A loadable module so that setuptools builds and installs this file like any extension; the
 * functions above are reached through ctypes, not through Python. */
static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "_native", "Native llama.cpp callbacks (used through ctypes).", -1,
    NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModule_Create(&native_module);
}
