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
