/*
 * kvps_isa.h: the internal interface between dispatch.c and the SIMD paths.
 *
 * Each path (simd_scalar.c, simd_avx2.c, simd_avx512.c) fills one struct kvps_isa with
 * loops over [0, n) of already-offset pointers (the two SIMD paths write their loops once,
 * in simd_body.h, from their own primitives); dispatch.c validates arguments, picks a
 * table from the CPU's features and splits large arrays across threads (parallel.c).
 * The SIMD paths finish every loop with the scalar functions declared at the bottom.
 * Pointers carry no alignment promise: every load and store is unaligned-safe.
 */
#ifndef KVPS_ISA_H
#define KVPS_ISA_H

#include <stdint.h>

#include "kvps_common.h"
#include "kvps_kernels.h"

#define KVPS_HIDDEN __attribute__((visibility("hidden")))

/* For the SIMD paths: element i of an array of sz-byte elements, as a byte offset (the
 * pointers carry no alignment promise), and a helper that must not stay a call. */
#define AT(p, i, sz) ((void *)((char *)(p) + (int64_t)(i) * (sz)))
#define CAT(p, i, sz) ((const void *)((const char *)(p) + (int64_t)(i) * (sz)))
#define INLINE static inline __attribute__((always_inline))

typedef void (*kvps_binary_fn)(void *dst, const void *src, int64_t n);
/* sources: element range [off, off + n) of dst and of every srcs[k] */
typedef void (*kvps_sources_fn)(void *dst, const void *const *srcs, int nsrc, int64_t off, int64_t n);
typedef void (*kvps_scale_fn)(void *x, double alpha, int64_t n);
typedef void (*kvps_axpy_fn)(void *y, double alpha, const void *x, int64_t n);
typedef void (*kvps_cast_fn)(const void *src, void *dst, int64_t n);
typedef void (*kvps_opt_fn)(const kvps_opt *p, float *w, const void *g, float *s1, float *s2, int64_t n);
typedef void (*kvps_compress_fn)(const float *g, float *r, uint32_t *out, float t, int64_t n);
typedef void (*kvps_decompress_fn)(const uint32_t *in, float t, float *dst, int64_t n);

enum kvps_opt_kind {
    KVPS_OPT_SGD,     /* s1 unused */
    KVPS_OPT_SGD_MOM, /* s1 = mom */
    KVPS_OPT_NAG,     /* s1 = mom */
    KVPS_OPT_ADAM,    /* s1 = mean, s2 = var */
    KVPS_OPT_ADAMW,   /* s1 = mean, s2 = var */
    KVPS_OPT_ADAGRAD, /* s1 = history */
    KVPS_OPT_RMSPROP, /* s1 = n */
    KVPS_NOPT
};

/* grad dtypes of the optimizers, as the index of kvps_isa.opt[kind][...] */
enum { KVPS_G_F32, KVPS_G_F16, KVPS_G_BF16, KVPS_NGRAD };

struct kvps_isa {
    const char *name;
    kvps_binary_fn sum[KVPS_NDTYPES];
    kvps_sources_fn sources[KVPS_NDTYPES];
    /* float32 sources with stores that bypass the cache, for sums of KVPS_STREAM_BYTES or more
     * (NULL: the path has none, the scalar one) */
    kvps_sources_fn sources_stream_f32;
    kvps_scale_fn scale[KVPS_NDTYPES];   /* float dtypes only */
    kvps_axpy_fn axpy[KVPS_NDTYPES];     /* float dtypes only */
    kvps_cast_fn from_f32[KVPS_NDTYPES]; /* float32 -> float16 / bfloat16 */
    kvps_cast_fn to_f32[KVPS_NDTYPES];   /* float16 / bfloat16 -> float32 */
    kvps_opt_fn opt[KVPS_NOPT][KVPS_NGRAD];
    kvps_compress_fn compress2, compress1;       /* n counted from a word boundary */
    kvps_decompress_fn decompress2, decompress1; /* add the decoded values to dst */
};

/* NULL-free tables; the AVX ones are empty (name NULL) where the compiler or the target
 * lacks them. */
extern KVPS_HIDDEN const struct kvps_isa kvps_isa_scalar;
extern KVPS_HIDDEN const struct kvps_isa kvps_isa_avx2;
extern KVPS_HIDDEN const struct kvps_isa kvps_isa_avx512;
/* set by dispatch.c before any kernel runs: whether VCVTNEPS2BF16 may be used */
extern KVPS_HIDDEN int kvps_avx512_has_bf16;

/* ---- scalar loops, also the tails of the SIMD paths ---------------------------------- */
KVPS_HIDDEN void kvps_scalar_sum(int dtype, void *dst, const void *src, int64_t n);
KVPS_HIDDEN void kvps_scalar_sources(int dtype, void *dst, const void *const *srcs, int nsrc, int64_t off,
                                     int64_t n);
KVPS_HIDDEN void kvps_scalar_scale(int dtype, void *x, double alpha, int64_t n);
KVPS_HIDDEN void kvps_scalar_axpy(int dtype, void *y, double alpha, const void *x, int64_t n);
KVPS_HIDDEN void kvps_scalar_from_f32(int dtype, const void *src, void *dst, int64_t n);
KVPS_HIDDEN void kvps_scalar_to_f32(int dtype, const void *src, void *dst, int64_t n);
KVPS_HIDDEN void kvps_scalar_opt(int kind, int gkind, const kvps_opt *p, float *w, const void *g, float *s1,
                                 float *s2, int64_t n);
KVPS_HIDDEN void kvps_scalar_compress2(const float *g, float *r, uint32_t *out, float t, int64_t n);
KVPS_HIDDEN void kvps_scalar_compress1(const float *g, float *r, uint32_t *out, float t, int64_t n);
KVPS_HIDDEN void kvps_scalar_decompress2(const uint32_t *in, float t, float *dst, int64_t n);
KVPS_HIDDEN void kvps_scalar_decompress1(const uint32_t *in, float t, float *dst, int64_t n);

/* ---- threads (parallel.c) ------------------------------------------------------------- */
typedef void (*kvps_range_fn)(const void *args, int64_t begin, int64_t end);
/* Runs fn over [0, n) split into chunks whose boundaries are multiples of `align`
 * elements, on up to kvps_num_threads() threads; the caller runs the first chunk. */
KVPS_HIDDEN void kvps_parallel_for(kvps_range_fn fn, const void *args, int64_t n, int64_t align);

/* ---- top-k (topk.c) ------------------------------------------------------------------- */
KVPS_HIDDEN int kvps_topk_select(float *residual, int64_t n, int64_t k, int index_dtype, void *indices,
                                 float *values);

#endif /* KVPS_ISA_H */
