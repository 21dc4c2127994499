/*
 * kvps_kernels.h: the flat C ABI of kvps's compute kernels.
 *
 * Two shared libraries implement it: _kvps_kernels.so (CPU: scalar, AVX2+F16C and
 * AVX-512 paths, chosen at run time) and, when nvcc was found at install time,
 * _kvps_cuda.so (the kvps_cuda_* functions, device pointers plus a stream).
 * Python binds both with ctypes in kvps/kernels/native.py and kvps/kernels/cuda.py;
 * the numpy reference in kvps/kernels/reference.py defines every operation's exact
 * result, rounding included. csrc/README.md describes the files and the dispatch.
 *
 * Conventions: every function returns a kvps_status; sizes are element counts
 * (int64_t); arrays are contiguous and may sit at any byte address; the in-place
 * argument comes first. Low-precision types (float16, bfloat16) travel as uint16_t
 * bit patterns and are computed in float32 with one round-to-nearest-even at the end.
 */
#ifndef KVPS_KERNELS_H
#define KVPS_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped on every change of a signature or of a table below; Python checks it at load. */
#define KVPS_ABI_VERSION 2

#if defined(_WIN32)
#define KVPS_API __declspec(dllexport)
#else
#define KVPS_API __attribute__((visibility("default")))
#endif

/* The dtype table of C and CUDA. Python's is kvps/dtypes.py (the wire's codes too):
 * native.py checks every code named here by kvps_dtype_name/kvps_dtype_size against it
 * at load. X(enum name, value, bytes, numpy name). */
#define KVPS_DTYPE_TABLE(X)              \
    X(KVPS_F32, 0, 4, "float32")         \
    X(KVPS_F64, 1, 8, "float64")         \
    X(KVPS_F16, 2, 2, "float16")         \
    X(KVPS_BF16, 3, 2, "bfloat16")       \
    X(KVPS_I32, 4, 4, "int32")           \
    X(KVPS_I64, 5, 8, "int64")

#define KVPS_DTYPE_ENUM_(name, value, size, text) name = value,
typedef enum kvps_dtype { KVPS_DTYPE_TABLE(KVPS_DTYPE_ENUM_) KVPS_NDTYPES } kvps_dtype;
#undef KVPS_DTYPE_ENUM_

typedef enum kvps_status {
    KVPS_OK = 0,
    KVPS_ERR_ARG = 1,         /* bad argument: NULL pointer, negative size, bad parameter */
    KVPS_ERR_DTYPE = 2,       /* the operation does not support this dtype */
    KVPS_ERR_NOMEM = 3,       /* a temporary buffer could not be allocated */
    KVPS_ERR_INDEX = 4,       /* an index is outside the destination (nothing was changed) */
    KVPS_ERR_UNSUPPORTED = 5, /* the CPU (or this build) lacks the requested SIMD path */
    KVPS_ERR_CUDA = 6         /* a CUDA runtime call failed: see kvps_cuda_last_error */
} kvps_status;

/* ---- introspection ---------------------------------------------------------------- */
KVPS_API int kvps_abi_version(void);
KVPS_API const char *kvps_dtype_name(int dtype);   /* NULL for an unknown code */
KVPS_API int kvps_dtype_size(int dtype);           /* 0 for an unknown code */
KVPS_API const char *kvps_status_name(int status);
/* Space-separated CPU features this library looks for and found, e.g. "avx2 f16c avx512f". */
KVPS_API const char *kvps_cpu_features(void);
/* Space-separated SIMD paths usable on this CPU, best first, e.g. "avx512 avx2 scalar". */
KVPS_API const char *kvps_simd_paths(void);
KVPS_API const char *kvps_simd_path(void);          /* the path in use */
/* Use another path (tests run every path); KVPS_ERR_UNSUPPORTED if this CPU lacks it. */
KVPS_API int kvps_set_simd_path(const char *name);
/* Threads that large arrays are split across (default: min(CPUs this process may use, 8)). */
KVPS_API int kvps_num_threads(void);
KVPS_API int kvps_set_num_threads(int n);           /* 1..64 */

/* ---- element-wise sums, scaling, casts --------------------------------------------- */
/* dst[i] += src[i]. All six dtypes; integers wrap around. */
KVPS_API int kvps_sum_into(int dtype, void *dst, const void *src, int64_t n);
/* dst[i] = srcs[0][i] + srcs[1][i] + ..., left to right (float16/bfloat16: in float32,
 * rounded once). dst may be one of the sources; it must not partially overlap one. float32 sums
 * of KVPS_STREAM_BYTES or more are stored past the cache, as kvps_copy does. */
KVPS_API int kvps_sum_sources(int dtype, void *dst, const void *const *srcs, int nsrc, int64_t n);
/* x[i] *= alpha; y[i] += alpha * x[i]. Float dtypes; alpha is rounded to float32 except
 * for float64. */
KVPS_API int kvps_scale(int dtype, void *x, double alpha, int64_t n);
KVPS_API int kvps_axpy(int dtype, void *y, double alpha, const void *x, int64_t n);
/* float32 <-> float16 / bfloat16, round to nearest even (one side must be float32). */
KVPS_API int kvps_cast(int src_dtype, const void *src, int dst_dtype, void *dst, int64_t n);
/* dst[0 .. nbytes) = src[0 .. nbytes) (no overlap). From KVPS_STREAM_BYTES on, with stores that
 * bypass the cache (x86-64): a copy bigger than the caches would only evict what the copying thread
 * reads next, and streaming skips reading dst in first (about a third fewer bytes moved). */
#define KVPS_STREAM_BYTES (1 << 20)
KVPS_API int kvps_copy(void *dst, const void *src, int64_t nbytes);

/* ---- fused optimizer updates (MXNet's formulas; see reference.py) --------------------
 * weight and state arrays are float32; grad_dtype is KVPS_F32, KVPS_F16 or KVPS_BF16.
 * clip_gradient <= 0 (or NaN) turns clipping off. */
/* mom == NULL: plain SGD; otherwise momentum SGD, or MXNet's NAG when nesterov != 0. */
KVPS_API int kvps_sgd_update(int grad_dtype, float *weight, const void *grad, float *mom, int64_t n,
                             float lr, float momentum, float wd, float rescale_grad,
                             float clip_gradient, int nesterov);
KVPS_API int kvps_adam_update(int grad_dtype, float *weight, const void *grad, float *mean, float *var,
                              int64_t n, float lr, float beta1, float beta2, float epsilon, float wd,
                              float rescale_grad, float clip_gradient);
KVPS_API int kvps_adamw_update(int grad_dtype, float *weight, const void *grad, float *mean, float *var,
                               int64_t n, float lr, float beta1, float beta2, float epsilon, float wd,
                               float rescale_grad, float clip_gradient, float eta);
KVPS_API int kvps_adagrad_update(int grad_dtype, float *weight, const void *grad, float *history,
                                 int64_t n, float lr, float epsilon, float wd, float rescale_grad,
                                 float clip_gradient);
/* clip_weights <= 0 (or NaN) turns weight clipping off. */
KVPS_API int kvps_rmsprop_update(int grad_dtype, float *weight, const void *grad, float *state_n,
                                 int64_t n, float lr, float gamma1, float epsilon, float wd,
                                 float rescale_grad, float clip_gradient, float clip_weights);

/* ---- gradient compression with error feedback (MXNet's layout) -----------------------
 * 2-bit: 16 values per uint32 word; element i lives in word i/16, byte (i%16)/4 of the
 * word in memory order, bits 7-6 of that byte for i%4 == 0 down to bits 1-0 for i%4 == 3;
 * 11 = +threshold, 10 = -threshold, 00 = 0. On a little-endian uint32 that is the 2-bit
 * field at bit 8*((i%16)/4) + 6 - 2*(i%4). out has ceil(n/16) words.
 * 1-bit: 32 values per word; element i is bit 7 - i%8 of byte (i%32)/8 of word i/32
 * (uint32 bit 8*((i%32)/8) + 7 - i%8); 1 = +1, 0 = -1. out has ceil(n/32) words. */
KVPS_API int kvps_compress_2bit(const float *grad, float *residual, uint32_t *out, int64_t n,
                                float threshold);
KVPS_API int kvps_decompress_2bit_add(const uint32_t *packed, float threshold, float *dst, int64_t n);
KVPS_API int kvps_compress_1bit(const float *grad, float *residual, uint32_t *out, int64_t n,
                                float threshold);
KVPS_API int kvps_decompress_1bit_add(const uint32_t *packed, float *dst, int64_t n);
/* residual += grad; the k entries of largest |residual| (ties: lower index first) are
 * written in ascending index order to indices (KVPS_I32 or KVPS_I64) and values, and
 * set to zero in residual. k is clamped to n. */
KVPS_API int kvps_compress_topk(const float *grad, float *residual, int64_t n, int64_t k,
                                int index_dtype, void *indices, float *values);
/* dst[indices[j]] += values[j], j in order (repeated indices add up). */
KVPS_API int kvps_decompress_topk_add(int index_dtype, const void *indices, const float *values,
                                      int64_t k, float *dst, int64_t n);

/* ---- CUDA (exported by _kvps_cuda.so only) ------------------------------------------
 * Pointers are device pointers on `device`; `stream` is a cudaStream_t (NULL: the
 * legacy default stream). Launches are asynchronous; errors from the launch are
 * reported, errors during execution surface at the caller's next synchronisation. */
KVPS_API int kvps_cuda_abi_version(void);
KVPS_API int kvps_cuda_device_count(int *count);
KVPS_API const char *kvps_cuda_last_error(void);    /* this thread's last CUDA error text */
KVPS_API int kvps_cuda_device_name(int device, char *buf, int len);
KVPS_API int kvps_cuda_sum_into(int dtype, void *dst, const void *src, int64_t n, int device,
                                void *stream);
/* srcs is a host array of nsrc (<= KVPS_CUDA_MAX_SOURCES) device pointers. */
#define KVPS_CUDA_MAX_SOURCES 64
KVPS_API int kvps_cuda_sum_sources(int dtype, void *dst, const void *const *srcs, int nsrc, int64_t n,
                                   int device, void *stream);
KVPS_API int kvps_cuda_scale(int dtype, void *x, double alpha, int64_t n, int device, void *stream);
KVPS_API int kvps_cuda_axpy(int dtype, void *y, double alpha, const void *x, int64_t n, int device,
                            void *stream);
KVPS_API int kvps_cuda_cast(int src_dtype, const void *src, int dst_dtype, void *dst, int64_t n,
                            int device, void *stream);
KVPS_API int kvps_cuda_sgd_update(int grad_dtype, float *weight, const void *grad, float *mom, int64_t n,
                                  float lr, float momentum, float wd, float rescale_grad,
                                  float clip_gradient, int nesterov, int device, void *stream);
KVPS_API int kvps_cuda_adam_update(int grad_dtype, float *weight, const void *grad, float *mean,
                                   float *var, int64_t n, float lr, float beta1, float beta2,
                                   float epsilon, float wd, float rescale_grad, float clip_gradient,
                                   int device, void *stream);
KVPS_API int kvps_cuda_adamw_update(int grad_dtype, float *weight, const void *grad, float *mean,
                                    float *var, int64_t n, float lr, float beta1, float beta2,
                                    float epsilon, float wd, float rescale_grad, float clip_gradient,
                                    float eta, int device, void *stream);
KVPS_API int kvps_cuda_adagrad_update(int grad_dtype, float *weight, const void *grad, float *history,
                                      int64_t n, float lr, float epsilon, float wd, float rescale_grad,
                                      float clip_gradient, int device, void *stream);
KVPS_API int kvps_cuda_rmsprop_update(int grad_dtype, float *weight, const void *grad, float *state_n,
                                      int64_t n, float lr, float gamma1, float epsilon, float wd,
                                      float rescale_grad, float clip_gradient, float clip_weights,
                                      int device, void *stream);
KVPS_API int kvps_cuda_compress_2bit(const float *grad, float *residual, uint32_t *out, int64_t n,
                                     float threshold, int device, void *stream);
KVPS_API int kvps_cuda_decompress_2bit_add(const uint32_t *packed, float threshold, float *dst,
                                           int64_t n, int device, void *stream);
KVPS_API int kvps_cuda_compress_1bit(const float *grad, float *residual, uint32_t *out, int64_t n,
                                     float threshold, int device, void *stream);
KVPS_API int kvps_cuda_decompress_1bit_add(const uint32_t *packed, float *dst, int64_t n, int device,
                                           void *stream);

#ifdef __cplusplus
}
#endif

#endif /* KVPS_KERNELS_H */
