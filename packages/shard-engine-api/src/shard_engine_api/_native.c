/* Native payload verification of the API package (optional; shard_engine_api._checksum falls
 * back to the xxhash package and numpy bit tests, with the same results).
 *
 * Every bundle a worker receives is checked for its xxh3-64 checksum and, under the default
 * "reject" policy, for NaN and infinity. Done in Python that is three passes over the payload
 * (xxhash, then two numpy max reductions over integer views of the bits) and numpy calls whose
 * fixed cost dominates a decode step's one-row bundle. Here one call does both in one pass.
 *
 * The hash is xxHash's own XXH3_64bits (seed 0), from the vendored official release (vendor/
 * xxhash, BSD-2-Clause) and its x86 dispatcher, which picks SSE2, AVX2 or AVX-512 at run time.
 * The tests compare every function here with the xxhash package on payloads of many sizes and
 * alignments, for every finiteness kind.
 *
 * One pass, three shapes:
 * - AVX2, inputs above XXH3_MIDSIZE_MAX (240 bytes): xxHash's long-input loop rebuilt from its
 *   own AVX2 accumulate and scramble steps, with the finiteness maximum of each 64-byte stripe
 *   taken while the stripe is in L1 (measured on 4 MiB: the test adds ~15% to the hash, where a
 *   second pass added ~65%). See hash_long_and_test_avx2.
 * - Otherwise, above BLOCK_BYTES: the streaming XXH3 API block by block, each block tested
 *   right after it is hashed, while cache-resident.
 * - Small inputs: the one-shot hash, then the test.
 *
 * Finiteness is tested on the bits: a value is NaN or infinite iff its exponent bits are all
 * ones. For 16-bit lanes that is (lane & M) == C with M = C = the exponent mask (f16 0x7c00,
 * bf16 0x7f80). An f32 is two lanes, low half first (little-endian): its high lane is tested
 * against 0x7f80 and its low lane gets M = 0, C = 0xffff, which never matches, so one 16-bit
 * lane loop serves every dtype (the SSE2 loop); the portable loop tests whole values, and the
 * AVX2 loops an equivalent test with fewer operations (see nonfinite_avx2).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* SHARD_PORTABLE builds the non-x86 shape on x86 too (to check that it compiles). */
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(SHARD_PORTABLE)
#  define SHARD_X86 1
/* xxHash's dispatcher: compiled for baseline x86-64, it selects SSE2/AVX2/AVX-512 by cpuid. */
#  include "xxh_x86dispatch.c"
#  define shard_xxh3 XXH3_64bits_dispatch
#  define shard_xxh3_update XXH3_64bits_update_dispatch
#  include <emmintrin.h>
#  include <immintrin.h>
#else
#  define SHARD_X86 0
#  define XXH_INLINE_ALL
#  include "xxhash.h"
#  define shard_xxh3 XXH3_64bits
#  define shard_xxh3_update XXH3_64bits_update
#endif

/* Finiteness kinds (shard_engine_api._dtypes.FINITE_KINDS). */
enum { KIND_NONE = 0, KIND_F16 = 1, KIND_BF16 = 2, KIND_F32 = 3 };
/* Results of verify() (shard_engine_api._bundle_checks's SOUND, CHECKSUM_MISMATCH, NONFINITE). */
enum { SOUND = 0, CHECKSUM_MISMATCH = 1, NONFINITE = 2 };

/* Blocks of the streaming shape: small enough to stay in L1 between hashing and testing. */
#ifndef BLOCK_BYTES
#  define BLOCK_BYTES (16 * 1024)
#endif
/* Above this the GIL is released (as numpy and xxhash do for large buffers). */
#define NOGIL_BYTES (256 * 1024)

/* The lane masks and compare values of a kind, for lane 0 (even) and lane 1 (odd). */
typedef struct {
    uint16_t mask[2];
    uint16_t value[2];
    size_t itemsize;
} lane_test;

static const lane_test LANE_TESTS[4] = {
    {{0, 0}, {0xffff, 0xffff}, 1},
    {{0x7c00, 0x7c00}, {0x7c00, 0x7c00}, 2},
    {{0x7f80, 0x7f80}, {0x7f80, 0x7f80}, 2},
    {{0x0000, 0x7f80}, {0xffff, 0x7f80}, 4},
};

/* Whether any value of p[0..n) (n a multiple of the item size) is non-finite: the portable loop
 * and every vector tail. Written so that compilers vectorise it with any instruction set
 * (loads through memcpy, and, compare, or). Payloads are little-endian: a big-endian machine
 * tests the byte-swapped mask instead of swapping every value. */
static int
nonfinite_scalar(const unsigned char *p, size_t n, const lane_test *test)
{
    if (test->itemsize == 4) {
        uint32_t found = 0;
        const uint32_t mask = PY_LITTLE_ENDIAN ? 0x7f800000u : 0x0000807fu;
        for (size_t i = 0; i + 4 <= n; i += 4) {
            uint32_t v;
            memcpy(&v, p + i, 4);
            found |= (v & mask) == mask;
        }
        return found != 0;
    }
    const uint16_t mask = PY_LITTLE_ENDIAN ? test->mask[0]
                                           : (uint16_t)((test->mask[0] >> 8) | (test->mask[0] << 8));
    uint16_t found16 = 0; /* lane-sized, so the vectorised loop does not widen */
    for (size_t i = 0; i + 2 <= n; i += 2) {
        uint16_t v;
        memcpy(&v, p + i, 2);
        found16 |= (uint16_t)((v & mask) == mask);
    }
    return found16 != 0;
}

typedef int (*nonfinite_function)(const unsigned char *, size_t, const lane_test *);

#if SHARD_X86
/* n must be a multiple of the item size; p may be unaligned. */
static int
nonfinite_sse2(const unsigned char *p, size_t n, const lane_test *test)
{
    const __m128i mask = _mm_set1_epi32((int)((uint32_t)test->mask[0] | ((uint32_t)test->mask[1] << 16)));
    const __m128i value = _mm_set1_epi32((int)((uint32_t)test->value[0] | ((uint32_t)test->value[1] << 16)));
    __m128i found = _mm_setzero_si128();
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(p + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(p + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(p + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(p + i + 48));
        a = _mm_cmpeq_epi16(_mm_and_si128(a, mask), value);
        b = _mm_cmpeq_epi16(_mm_and_si128(b, mask), value);
        c = _mm_cmpeq_epi16(_mm_and_si128(c, mask), value);
        d = _mm_cmpeq_epi16(_mm_and_si128(d, mask), value);
        found = _mm_or_si128(found, _mm_or_si128(_mm_or_si128(a, b), _mm_or_si128(c, d)));
    }
    if (_mm_movemask_epi8(found)) {
        return 1;
    }
    /* i is a multiple of 64, so the tail starts on an even lane. */
    return nonfinite_scalar(p + i, n - i, test);
}

/* With AVX2 the test takes two operations per vector instead of three: doubling a lane drops
 * its sign bit, and a value is non-finite iff its doubled bits are >= the doubled exponent
 * mask (unsigned), so one running unsigned maximum per lane width decides. */
__attribute__((target("avx2"))) static int
nonfinite_avx2(const unsigned char *p, size_t n, const lane_test *test)
{
    __m256i top = _mm256_setzero_si256();
    size_t i = 0;
    if (test->itemsize == 4) {
        for (; i + 128 <= n; i += 128) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(p + i));
            __m256i b = _mm256_loadu_si256((const __m256i *)(p + i + 32));
            __m256i c = _mm256_loadu_si256((const __m256i *)(p + i + 64));
            __m256i d = _mm256_loadu_si256((const __m256i *)(p + i + 96));
            a = _mm256_max_epu32(_mm256_add_epi32(a, a), _mm256_add_epi32(b, b));
            c = _mm256_max_epu32(_mm256_add_epi32(c, c), _mm256_add_epi32(d, d));
            top = _mm256_max_epu32(top, _mm256_max_epu32(a, c));
        }
        const __m256i limit = _mm256_set1_epi32((int)0xff000000u);
        /* top >= limit iff max(top, limit) == top */
        if (_mm256_movemask_epi8(_mm256_cmpeq_epi32(_mm256_max_epu32(top, limit), top))) {
            return 1;
        }
    }
    else {
        for (; i + 128 <= n; i += 128) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(p + i));
            __m256i b = _mm256_loadu_si256((const __m256i *)(p + i + 32));
            __m256i c = _mm256_loadu_si256((const __m256i *)(p + i + 64));
            __m256i d = _mm256_loadu_si256((const __m256i *)(p + i + 96));
            a = _mm256_max_epu16(_mm256_add_epi16(a, a), _mm256_add_epi16(b, b));
            c = _mm256_max_epu16(_mm256_add_epi16(c, c), _mm256_add_epi16(d, d));
            top = _mm256_max_epu16(top, _mm256_max_epu16(a, c));
        }
        const __m256i limit = _mm256_set1_epi16((short)(uint16_t)(test->mask[0] << 1));
        if (_mm256_movemask_epi8(_mm256_cmpeq_epi16(_mm256_max_epu16(top, limit), top))) {
            return 1;
        }
    }
    return nonfinite_sse2(p + i, n - i, test);
}

/* One pass with AVX2: xxHash's own long-input XXH3_64bits (XXH3_hashLong_64b_internal with the
 * default secret: 1 KiB blocks of 16 stripes, a scramble after each block, the last stripe,
 * then XXH3_mergeAccs), built from xxhash.h's AVX2 accumulate and scramble steps, with the
 * finiteness maximum of each 64-byte stripe taken while it is in registers or L1. The stripes
 * cover every byte (the last stripe ends at the end), at offsets that are multiples of every
 * item size. Only for inputs longer than XXH3_MIDSIZE_MAX, as XXH3_64bits itself. */
XXH_FORCE_INLINE __attribute__((target("avx2"))) __m256i
stripe_top(__m256i top, const unsigned char *stripe, unsigned char *copy, int wide)
{
    __m256i a = _mm256_loadu_si256((const __m256i *)stripe);
    __m256i b = _mm256_loadu_si256((const __m256i *)(stripe + 32));
    if (copy != NULL) {
        _mm256_storeu_si256((__m256i *)copy, a);
        _mm256_storeu_si256((__m256i *)(copy + 32), b);
    }
    if (wide) {
        return _mm256_max_epu32(top, _mm256_max_epu32(_mm256_add_epi32(a, a), _mm256_add_epi32(b, b)));
    }
    return _mm256_max_epu16(top, _mm256_max_epu16(_mm256_add_epi16(a, a), _mm256_add_epi16(b, b)));
}

/* With ``copy`` (not NULL), every stripe is also stored there while in registers: the stripes
 * cover every byte, so copy[0..len) ends up equal to input[0..len). */
XXH_FORCE_INLINE __attribute__((target("avx2"))) XXH64_hash_t
hash_long_and_test_avx2(const unsigned char *input, unsigned char *copy, size_t len,
                        const lane_test *test, int wide, int *found)
{
    XXH_ALIGN(64) xxh_u64 acc[XXH_ACC_NB] = XXH3_INIT_ACC;
    const xxh_u8 *const secret = XXH3_kSecret;
    const size_t secret_size = sizeof(XXH3_kSecret);
    const size_t stripes_per_block = (secret_size - XXH_STRIPE_LEN) / XXH_SECRET_CONSUME_RATE;
    const size_t block_len = XXH_STRIPE_LEN * stripes_per_block;
    const size_t nb_blocks = (len - 1) / block_len;
    __m256i top = _mm256_setzero_si256();

    for (size_t n = 0; n < nb_blocks; n++) {
        const unsigned char *block = input + n * block_len;
        for (size_t s = 0; s < stripes_per_block; s++) {
            const unsigned char *stripe = block + s * XXH_STRIPE_LEN;
            XXH_PREFETCH(stripe + XXH_PREFETCH_DIST);
            XXH3_accumulate_512_avx2(acc, stripe, secret + s * XXH_SECRET_CONSUME_RATE);
            top = stripe_top(top, stripe, copy ? copy + (stripe - input) : NULL, wide);
        }
        XXH3_scrambleAcc_avx2(acc, secret + secret_size - XXH_STRIPE_LEN);
    }
    {   /* the last partial block, then the last stripe */
        const unsigned char *block = input + nb_blocks * block_len;
        size_t const stripes = ((len - 1) - block_len * nb_blocks) / XXH_STRIPE_LEN;
        for (size_t s = 0; s < stripes; s++) {
            const unsigned char *stripe = block + s * XXH_STRIPE_LEN;
            XXH3_accumulate_512_avx2(acc, stripe, secret + s * XXH_SECRET_CONSUME_RATE);
            top = stripe_top(top, stripe, copy ? copy + (stripe - input) : NULL, wide);
        }
        const unsigned char *last = input + len - XXH_STRIPE_LEN;
        XXH3_accumulate_512_avx2(acc, last,
                                 secret + secret_size - XXH_STRIPE_LEN - XXH_SECRET_LASTACC_START);
        top = stripe_top(top, last, copy ? copy + (last - input) : NULL, wide);
    }
    if (wide) {
        const __m256i limit = _mm256_set1_epi32((int)0xff000000u);
        *found = _mm256_movemask_epi8(_mm256_cmpeq_epi32(_mm256_max_epu32(top, limit), top)) != 0;
    }
    else {
        const __m256i limit = _mm256_set1_epi16((short)(uint16_t)(test->mask[0] << 1));
        *found = _mm256_movemask_epi8(_mm256_cmpeq_epi16(_mm256_max_epu16(top, limit), top)) != 0;
    }
    return XXH3_mergeAccs(acc, secret + XXH_SECRET_MERGEACCS_START, (xxh_u64)len * XXH_PRIME64_1);
}

__attribute__((target("avx2"))) static XXH64_hash_t
hash_and_test_avx2(const unsigned char *input, unsigned char *copy, size_t len,
                   const lane_test *test, int *found)
{
    /* Specialised per lane width, and with or without the copy, so the stripe loop has no
     * branch to take. */
    const int wide = test->itemsize == 4;
    if (copy == NULL) {
        return wide ? hash_long_and_test_avx2(input, NULL, len, test, 1, found)
                    : hash_long_and_test_avx2(input, NULL, len, test, 0, found);
    }
    return wide ? hash_long_and_test_avx2(input, copy, len, test, 1, found)
                : hash_long_and_test_avx2(input, copy, len, test, 0, found);
}

static int use_avx2 = 0;

static nonfinite_function nonfinite_scan = nonfinite_sse2;
static int cpu_avx2 = 0;
#else
static nonfinite_function nonfinite_scan = nonfinite_scalar;
#endif
static const char *scan_name = "portable";

static int
nonfinite(const unsigned char *p, size_t n, int kind)
{
    return kind != KIND_NONE && nonfinite_scan(p, n, &LANE_TESTS[kind]);
}

/* The digest of p[0..n) and (when kind is not KIND_NONE) whether it holds a non-finite value,
 * in one pass: each block is hashed, then tested while cache-resident. With ``copy`` (not
 * NULL; it must not overlap p), p[0..n) is copied there in the same pass: AVX2 stores each
 * stripe from registers; otherwise each block is copied, then hashed and tested in the copy. */
static XXH64_hash_t
hash_and_test(unsigned char *copy, const unsigned char *p, size_t n, int kind, int *found)
{
    *found = 0;
#if SHARD_X86
    if (use_avx2 && kind != KIND_NONE && n > XXH3_MIDSIZE_MAX) {
        return hash_and_test_avx2(p, copy, n, &LANE_TESTS[kind], found);
    }
#endif
    if (kind == KIND_NONE || n <= BLOCK_BYTES) {
        if (copy != NULL) {
            memcpy(copy, p, n);
            p = copy;
        }
        *found = nonfinite(p, n, kind);
        return shard_xxh3(p, n);
    }
    XXH3_state_t state;
    XXH3_INITSTATE(&state);
    XXH3_64bits_reset(&state);
    for (size_t at = 0; at < n; at += BLOCK_BYTES) {
        size_t size = n - at < BLOCK_BYTES ? n - at : BLOCK_BYTES;
        const unsigned char *block = p + at;
        if (copy != NULL) {
            memcpy(copy + at, block, size);
            block = copy + at;
        }
        shard_xxh3_update(&state, block, size);
        if (!*found) {
            *found = nonfinite(block, size, kind);
        }
    }
    return XXH3_64bits_digest(&state);
}

/* ------------------------------------------------------------------ Python functions */

static int
get_buffer(PyObject *object, Py_buffer *view)
{
    return PyObject_GetBuffer(object, view, PyBUF_SIMPLE);
}

static int
get_kind(PyObject *object, int *kind)
{
    long value = PyLong_AsLong(object);
    if (value == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (value < KIND_NONE || value > KIND_F32) {
        PyErr_Format(PyExc_ValueError, "unknown finiteness kind %ld", value);
        return -1;
    }
    *kind = (int)value;
    return 0;
}

static int
check_itemsize(const Py_buffer *view, int kind)
{
    size_t itemsize = LANE_TESTS[kind].itemsize;
    if ((size_t)view->len % itemsize) {
        /* numpy's words for the same refusal (the fallback reads payloads with frombuffer). */
        PyErr_SetString(PyExc_ValueError, "buffer size must be a multiple of element size");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(checksum_doc,
"checksum(buffer) -> int\n--\n\n"
"The xxh3-64 digest (seed 0) of buffer's bytes, as xxhash.xxh3_64_intdigest.");

static PyObject *
native_checksum(PyObject *module, PyObject *buffer)
{
    (void)module;
    Py_buffer view;
    if (get_buffer(buffer, &view) < 0) {
        return NULL;
    }
    XXH64_hash_t digest;
    if (view.len >= NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        digest = shard_xxh3(view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    }
    else {
        digest = shard_xxh3(view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong((unsigned long long)digest);
}

/* The shared part of finite(), verify() and checksum_and_finite(): read the kind and the
 * buffer, refuse a length that is not whole values, and scan it (without the GIL when it is
 * large): NaN/Inf into *found and, when digest is not NULL, the xxh3-64 digest in the same
 * pass. 0, or -1 with a Python error set. */
static int
scan_buffer(PyObject *buffer, PyObject *kind_object, XXH64_hash_t *digest, int *found)
{
    int kind;
    if (get_kind(kind_object, &kind) < 0) {
        return -1;
    }
    Py_buffer view;
    if (get_buffer(buffer, &view) < 0) {
        return -1;
    }
    if (check_itemsize(&view, kind) < 0) {
        PyBuffer_Release(&view);
        return -1;
    }
    const unsigned char *p = view.buf;
    const size_t n = (size_t)view.len;
    if (view.len >= NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        if (digest != NULL) {
            *digest = hash_and_test(NULL, p, n, kind, found);
        }
        else {
            *found = nonfinite(p, n, kind);
        }
        Py_END_ALLOW_THREADS
    }
    else if (digest != NULL) {
        *digest = hash_and_test(NULL, p, n, kind, found);
    }
    else {
        *found = nonfinite(p, n, kind);
    }
    PyBuffer_Release(&view);
    return 0;
}

PyDoc_STRVAR(finite_doc,
"finite(buffer, kind) -> bool\n--\n\n"
"Whether every value of buffer (f16, bf16 or f32 bits by kind 1, 2, 3) is finite.");

static PyObject *
native_finite(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "finite() takes exactly 2 arguments");
        return NULL;
    }
    int found;
    if (scan_buffer(args[0], args[1], NULL, &found) < 0) {
        return NULL;
    }
    return PyBool_FromLong(!found);
}

PyDoc_STRVAR(verify_doc,
"verify(buffer, checksum, kind) -> int\n--\n\n"
"0 when buffer's xxh3-64 digest equals checksum and (kind 1, 2, 3: f16, bf16, f32; 0: not\n"
"tested) every value is finite; 1 when the digest differs (whatever the values); 2 when\n"
"the digest matches but a value is NaN or infinite. One pass over the buffer.");

static PyObject *
native_verify(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "verify() takes exactly 3 arguments");
        return NULL;
    }
    int found;
    XXH64_hash_t digest;
    if (scan_buffer(args[0], args[2], &digest, &found) < 0) {
        return NULL;
    }

    int matches;
    PyObject *expected = args[1];
    if (PyLong_CheckExact(expected)) {
        unsigned long long value = PyLong_AsUnsignedLongLong(expected);
        if (value == (unsigned long long)-1 && PyErr_Occurred()) {
            /* Negative or beyond 64 bits: no digest equals it. */
            PyErr_Clear();
            matches = 0;
        }
        else {
            matches = value == (unsigned long long)digest;
        }
    }
    else {
        /* Whatever the checksum is, compare as Python would (digest == checksum). */
        PyObject *computed = PyLong_FromUnsignedLongLong((unsigned long long)digest);
        if (computed == NULL) {
            return NULL;
        }
        matches = PyObject_RichCompareBool(computed, expected, Py_EQ);
        Py_DECREF(computed);
        if (matches < 0) {
            return NULL;
        }
    }
    return PyLong_FromLong(!matches ? CHECKSUM_MISMATCH : found ? NONFINITE : SOUND);
}

/* The (checksum, finite) tuple of checksum_and_finite() and copy_checksum_and_finite(). */
static PyObject *
digest_and_finite(XXH64_hash_t digest, int found)
{
    PyObject *checksum = PyLong_FromUnsignedLongLong((unsigned long long)digest);
    if (checksum == NULL) {
        return NULL;
    }
    PyObject *result = PyTuple_Pack(2, checksum, found ? Py_False : Py_True);
    Py_DECREF(checksum);
    return result;
}

PyDoc_STRVAR(checksum_and_finite_doc,
"checksum_and_finite(buffer, kind) -> (int, bool)\n--\n\n"
"buffer's xxh3-64 digest and whether every value (kind 1, 2, 3: f16, bf16, f32) is finite,\n"
"in one pass.");

static PyObject *
native_checksum_and_finite(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "checksum_and_finite() takes exactly 2 arguments");
        return NULL;
    }
    int found;
    XXH64_hash_t digest;
    if (scan_buffer(args[0], args[1], &digest, &found) < 0) {
        return NULL;
    }
    return digest_and_finite(digest, found);
}

PyDoc_STRVAR(copy_checksum_and_finite_doc,
"copy_checksum_and_finite(destination, source, kind) -> (int, bool)\n--\n\n"
"Copy source's bytes into the writable destination (of the same length; the two must not\n"
"overlap) and return what checksum_and_finite(destination, kind) would, in one pass.");

static PyObject *
native_copy_checksum_and_finite(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "copy_checksum_and_finite() takes exactly 3 arguments");
        return NULL;
    }
    int kind;
    if (get_kind(args[2], &kind) < 0) {
        return NULL;
    }
    Py_buffer destination;
    if (PyObject_GetBuffer(args[0], &destination, PyBUF_WRITABLE) < 0) {
        return NULL;
    }
    Py_buffer source;
    if (get_buffer(args[1], &source) < 0) {
        PyBuffer_Release(&destination);
        return NULL;
    }
    PyObject *result = NULL;
    const unsigned char *from = source.buf;
    unsigned char *to = destination.buf;
    const size_t n = (size_t)source.len;
    if (destination.len != source.len) {
        PyErr_Format(PyExc_ValueError, "destination has %zd bytes, source %zd", destination.len,
                     source.len);
    }
    else if (from < to + n && to < from + n && n) {
        PyErr_SetString(PyExc_ValueError, "destination and source overlap");
    }
    else if (check_itemsize(&source, kind) == 0) {
        int found;
        XXH64_hash_t digest;
        if (source.len >= NOGIL_BYTES) {
            Py_BEGIN_ALLOW_THREADS
            digest = hash_and_test(to, from, n, kind, &found);
            Py_END_ALLOW_THREADS
        }
        else {
            digest = hash_and_test(to, from, n, kind, &found);
        }
        result = digest_and_finite(digest, found);
    }
    PyBuffer_Release(&source);
    PyBuffer_Release(&destination);
    return result;
}

PyDoc_STRVAR(select_scan_doc,
"_select_scan(name) -> str\n--\n\n"
"For the tests: run the loops of \"avx2\", \"sse2\" or \"portable\" from now on (the hash keeps\n"
"xxHash's own choice) and return the previous name. ValueError if this CPU or build has none.");

static PyObject *
native_select_scan(PyObject *module, PyObject *name)
{
    (void)module;
    const char *wanted = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
    if (wanted == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "_select_scan() takes a str");
        }
        return NULL;
    }
    const char *previous = scan_name;
    if (strcmp(wanted, "portable") == 0) {
        nonfinite_scan = nonfinite_scalar;
        scan_name = "portable";
#if SHARD_X86
        use_avx2 = 0;
    }
    else if (strcmp(wanted, "sse2") == 0) {
        nonfinite_scan = nonfinite_sse2;
        use_avx2 = 0;
        scan_name = "sse2";
    }
    else if (strcmp(wanted, "avx2") == 0 && cpu_avx2) {
        nonfinite_scan = nonfinite_avx2;
        use_avx2 = 1;
        scan_name = "avx2";
#endif
    }
    else {
        PyErr_Format(PyExc_ValueError, "no %s loops in this build or on this CPU", wanted);
        return NULL;
    }
    return PyUnicode_FromString(previous);
}

static PyMethodDef native_methods[] = {
    {"_select_scan", (PyCFunction)native_select_scan, METH_O, select_scan_doc},
    {"checksum_and_finite", (PyCFunction)(void (*)(void))native_checksum_and_finite, METH_FASTCALL,
     checksum_and_finite_doc},
    {"checksum", (PyCFunction)native_checksum, METH_O, checksum_doc},
    {"copy_checksum_and_finite", (PyCFunction)(void (*)(void))native_copy_checksum_and_finite,
     METH_FASTCALL, copy_checksum_and_finite_doc},
    {"finite", (PyCFunction)(void (*)(void))native_finite, METH_FASTCALL, finite_doc},
    {"verify", (PyCFunction)(void (*)(void))native_verify, METH_FASTCALL, verify_doc},
    {NULL, NULL, 0, NULL},
};

static int
native_exec(PyObject *module)
{
    const char *vector = "portable";
#if SHARD_X86
    int level = XXH_featureTest();
    nonfinite_scan = nonfinite_sse2;
    scan_name = "sse2";
    if (level >= XXH_AVX2) {
        nonfinite_scan = nonfinite_avx2;
        use_avx2 = 1;
        cpu_avx2 = 1;
        scan_name = "avx2";
    }
    vector = level >= XXH_AVX512 ? "avx512" : level >= XXH_AVX2 ? "avx2" : "sse2";
#endif
    return PyModule_AddStringConstant(module, "VECTOR", vector);
}

static PyModuleDef_Slot native_slots[] = {
    {Py_mod_exec, native_exec},
    {0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "shard_engine_api._native",
    .m_doc = "Native payload verification: xxh3-64 and the NaN/Inf test in one pass.",
    .m_size = 0,
    .m_methods = native_methods,
    .m_slots = native_slots,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    return PyModuleDef_Init(&native_module);
}
