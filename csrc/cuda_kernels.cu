/*
 * cuda_kernels.cu: the kvps_cuda_* half of kvps_kernels.h, built into _kvps_cuda.so.
 *
 * Same operations and the same results as the C library on device memory: the optimizer
 * formulas and the compression bit layout come from kvps_common.h, shared with the CPU
 * code. Built by setup.py with nvcc -fmad=false (no fused multiply-add, as on the CPU)
 * for sm_80 and sm_90, plus compute_90 PTX for newer GPUs. cudart is linked statically,
 * so loading this library needs no CUDA toolkit, only the driver (libcuda.so.1) when a
 * function is first called.
 *
 * Every launcher sets the device, launches on the caller's stream and returns at once;
 * kernels are grid-stride loops of 256 threads. 2-bit and 1-bit compression give each
 * warp 32 consecutive elements and assemble the packed words from two __ballot_sync
 * masks with kvps_pack2 / kvps_pack1, the same bit shuffles the SIMD CPU paths use.
 * float16/bfloat16 conversions use the hardware round-to-nearest-even instructions
 * (NaN comes out as the canonical NaN: payloads are unspecified).
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cmath>
#include <stdio.h>

#include "kvps_common.h"
#include "kvps_kernels.h"

#define THREADS 256

static thread_local char last_error[256] = "";

static int fail(cudaError_t err, const char *what) {
    snprintf(last_error, sizeof last_error, "%s: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
    return KVPS_ERR_CUDA;
}

extern "C" KVPS_API const char *kvps_cuda_last_error(void) { return last_error; }
extern "C" KVPS_API int kvps_cuda_abi_version(void) { return KVPS_ABI_VERSION; }

extern "C" KVPS_API int kvps_cuda_device_count(int *count) {
    cudaError_t err = cudaGetDeviceCount(count);
    if (err != cudaSuccess) {
        *count = 0;
        return fail(err, "cudaGetDeviceCount");
    }
    return KVPS_OK;
}

extern "C" KVPS_API int kvps_cuda_device_name(int device, char *buf, int len) {
    cudaDeviceProp prop;
    cudaError_t err = cudaGetDeviceProperties(&prop, device);
    if (err != cudaSuccess)
        return fail(err, "cudaGetDeviceProperties");
    snprintf(buf, (size_t)len, "%s (sm_%d%d, %d SMs)", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
    return KVPS_OK;
}

static unsigned blocks_for(int64_t n) {
    int64_t b = (n + THREADS - 1) / THREADS;
    return (unsigned)(b < (1 << 20) ? (b > 0 ? b : 1) : (1 << 20));
}

/* set the device, launch, report the launch error */
#define LAUNCH(device, stream, n, kernel, ...)                                               \
    do {                                                                                     \
        auto kernel_ = kernel; /* a pointer: template arguments need no parentheses */        \
        if ((n) < 0)                                                                         \
            return KVPS_ERR_ARG;                                                             \
        if ((n) == 0)                                                                        \
            return KVPS_OK;                                                                  \
        cudaError_t err_ = cudaSetDevice(device);                                            \
        if (err_ != cudaSuccess)                                                             \
            return fail(err_, "cudaSetDevice");                                              \
        kernel_<<<blocks_for(n), THREADS, 0, (cudaStream_t)(stream)>>>(__VA_ARGS__);          \
        err_ = cudaGetLastError();                                                           \
        if (err_ != cudaSuccess)                                                             \
            return fail(err_, "kernel launch");                                              \
        return KVPS_OK;                                                                      \
    } while (0)

#define GRID_STRIDE(i, n) \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

/* ---- element types: load as float (or the native type), store with one rounding ---- */
struct F16 {
    typedef __half T;
    static __device__ __forceinline__ float load(const T *p, int64_t i) { return __half2float(p[i]); }
    static __device__ __forceinline__ void store(T *p, int64_t i, float v) { p[i] = __float2half_rn(v); }
};
struct BF16 {
    typedef __nv_bfloat16 T;
    static __device__ __forceinline__ float load(const T *p, int64_t i) { return __bfloat162float(p[i]); }
    static __device__ __forceinline__ void store(T *p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }
};
template <typename N> struct Native {
    typedef N T;
    static __device__ __forceinline__ N load(const T *p, int64_t i) { return p[i]; }
    static __device__ __forceinline__ void store(T *p, int64_t i, N v) { p[i] = v; }
};
typedef Native<float> F32;
typedef Native<double> F64;
typedef Native<uint32_t> I32; /* unsigned: wraps like numpy, without signed overflow */
typedef Native<unsigned long long> I64;

/* ---- sums ----------------------------------------------------------------------------- */
template <typename E> __global__ void sum_into_kernel(typename E::T *d, const typename E::T *s, int64_t n) {
    GRID_STRIDE(i, n) E::store(d, i, E::load(d, i) + E::load(s, i));
}

struct Sources {
    const void *p[KVPS_CUDA_MAX_SOURCES];
};

template <typename E> __global__ void sum_sources_kernel(typename E::T *d, Sources srcs, int nsrc, int64_t n) {
    GRID_STRIDE(i, n) {
        auto acc = E::load((const typename E::T *)srcs.p[0], i);
        for (int k = 1; k < nsrc; k++)
            acc = acc + E::load((const typename E::T *)srcs.p[k], i);
        E::store(d, i, acc);
    }
}

template <typename E> static int sum_into_t(void *d, const void *s, int64_t n, int device, void *stream) {
    LAUNCH(device, stream, n, &sum_into_kernel<E>, (typename E::T *)d, (const typename E::T *)s, n);
}

template <typename E>
static int sum_sources_t(void *d, const Sources &srcs, int nsrc, int64_t n, int device, void *stream) {
    LAUNCH(device, stream, n, &sum_sources_kernel<E>, (typename E::T *)d, srcs, nsrc, n);
}

extern "C" KVPS_API int kvps_cuda_sum_into(int dtype, void *dst, const void *src, int64_t n, int device,
                                           void *stream) {
    switch (dtype) {
    case KVPS_F32: return sum_into_t<F32>(dst, src, n, device, stream);
    case KVPS_F64: return sum_into_t<F64>(dst, src, n, device, stream);
    case KVPS_F16: return sum_into_t<F16>(dst, src, n, device, stream);
    case KVPS_BF16: return sum_into_t<BF16>(dst, src, n, device, stream);
    case KVPS_I32: return sum_into_t<I32>(dst, src, n, device, stream);
    case KVPS_I64: return sum_into_t<I64>(dst, src, n, device, stream);
    default: return KVPS_ERR_DTYPE;
    }
}

extern "C" KVPS_API int kvps_cuda_sum_sources(int dtype, void *dst, const void *const *srcs, int nsrc, int64_t n,
                                              int device, void *stream) {
    if (nsrc < 1 || nsrc > KVPS_CUDA_MAX_SOURCES || !srcs)
        return KVPS_ERR_ARG;
    Sources s;
    for (int k = 0; k < nsrc; k++)
        s.p[k] = srcs[k];
    switch (dtype) {
    case KVPS_F32: return sum_sources_t<F32>(dst, s, nsrc, n, device, stream);
    case KVPS_F64: return sum_sources_t<F64>(dst, s, nsrc, n, device, stream);
    case KVPS_F16: return sum_sources_t<F16>(dst, s, nsrc, n, device, stream);
    case KVPS_BF16: return sum_sources_t<BF16>(dst, s, nsrc, n, device, stream);
    case KVPS_I32: return sum_sources_t<I32>(dst, s, nsrc, n, device, stream);
    case KVPS_I64: return sum_sources_t<I64>(dst, s, nsrc, n, device, stream);
    default: return KVPS_ERR_DTYPE;
    }
}

/* ---- scale, axpy, casts ------------------------------------------------------------------ */
template <typename E, typename A> __global__ void scale_kernel(typename E::T *x, A a, int64_t n) {
    GRID_STRIDE(i, n) E::store(x, i, E::load(x, i) * a);
}
template <typename E, typename A>
__global__ void axpy_kernel(typename E::T *y, A a, const typename E::T *x, int64_t n) {
    GRID_STRIDE(i, n) E::store(y, i, E::load(y, i) + a * E::load(x, i));
}

template <typename E, typename A> static int scale_t(void *x, A a, int64_t n, int device, void *stream) {
    LAUNCH(device, stream, n, (&scale_kernel<E, A>), (typename E::T *)x, a, n);
}
template <typename E, typename A>
static int axpy_t(void *y, A a, const void *x, int64_t n, int device, void *stream) {
    LAUNCH(device, stream, n, (&axpy_kernel<E, A>), (typename E::T *)y, a, (const typename E::T *)x, n);
}

extern "C" KVPS_API int kvps_cuda_scale(int dtype, void *x, double alpha, int64_t n, int device, void *stream) {
    switch (dtype) {
    case KVPS_F32: return scale_t<F32, float>(x, (float)alpha, n, device, stream);
    case KVPS_F64: return scale_t<F64, double>(x, alpha, n, device, stream);
    case KVPS_F16: return scale_t<F16, float>(x, (float)alpha, n, device, stream);
    case KVPS_BF16: return scale_t<BF16, float>(x, (float)alpha, n, device, stream);
    default: return KVPS_ERR_DTYPE;
    }
}

extern "C" KVPS_API int kvps_cuda_axpy(int dtype, void *y, double alpha, const void *x, int64_t n, int device,
                                       void *stream) {
    switch (dtype) {
    case KVPS_F32: return axpy_t<F32, float>(y, (float)alpha, x, n, device, stream);
    case KVPS_F64: return axpy_t<F64, double>(y, alpha, x, n, device, stream);
    case KVPS_F16: return axpy_t<F16, float>(y, (float)alpha, x, n, device, stream);
    case KVPS_BF16: return axpy_t<BF16, float>(y, (float)alpha, x, n, device, stream);
    default: return KVPS_ERR_DTYPE;
    }
}

template <typename S, typename D>
__global__ void cast_kernel(const typename S::T *s, typename D::T *d, int64_t n) {
    GRID_STRIDE(i, n) D::store(d, i, S::load(s, i));
}
template <typename S, typename D> static int cast_t(const void *s, void *d, int64_t n, int device, void *stream) {
    LAUNCH(device, stream, n, (&cast_kernel<S, D>), (const typename S::T *)s, (typename D::T *)d, n);
}

extern "C" KVPS_API int kvps_cuda_cast(int src_dtype, const void *src, int dst_dtype, void *dst, int64_t n,
                                       int device, void *stream) {
    if (src_dtype == KVPS_F32 && dst_dtype == KVPS_F16) return cast_t<F32, F16>(src, dst, n, device, stream);
    if (src_dtype == KVPS_F32 && dst_dtype == KVPS_BF16) return cast_t<F32, BF16>(src, dst, n, device, stream);
    if (src_dtype == KVPS_F16 && dst_dtype == KVPS_F32) return cast_t<F16, F32>(src, dst, n, device, stream);
    if (src_dtype == KVPS_BF16 && dst_dtype == KVPS_F32) return cast_t<BF16, F32>(src, dst, n, device, stream);
    return KVPS_ERR_DTYPE;
}

/* ---- optimizers: kvps_*_elem from kvps_common.h, one thread per element ---------------- */
enum { OPT_SGD, OPT_SGD_MOM, OPT_NAG, OPT_ADAM, OPT_ADAMW, OPT_ADAGRAD, OPT_RMSPROP };

template <typename G>
__global__ void opt_kernel(int kind, kvps_opt p, float *w, const typename G::T *g, float *s1, float *s2,
                           int64_t n) {
    GRID_STRIDE(i, n) {
        float gv = G::load(g, i), wv = w[i], a = s1 ? s1[i] : 0.0f, b = s2 ? s2[i] : 0.0f;
        switch (kind) {
        case OPT_SGD: kvps_sgd_elem(&p, gv, &wv); break;
        case OPT_SGD_MOM: kvps_sgd_mom_elem(&p, gv, &wv, &a); break;
        case OPT_NAG: kvps_nag_elem(&p, gv, &wv, &a); break;
        case OPT_ADAM: kvps_adam_elem(&p, gv, &wv, &a, &b); break;
        case OPT_ADAMW: kvps_adamw_elem(&p, gv, &wv, &a, &b); break;
        case OPT_ADAGRAD: kvps_adagrad_elem(&p, gv, &wv, &a); break;
        case OPT_RMSPROP: kvps_rmsprop_elem(&p, gv, &wv, &a); break;
        }
        w[i] = wv;
        if (s1)
            s1[i] = a;
        if (s2)
            s2[i] = b;
    }
}

template <typename G>
static int opt_t(int kind, const kvps_opt &p, float *w, const void *g, float *s1, float *s2, int64_t n, int device,
                 void *stream) {
    LAUNCH(device, stream, n, &opt_kernel<G>, kind, p, w, (const typename G::T *)g, s1, s2, n);
}

static int run_opt(int kind, int grad_dtype, kvps_opt p, float *w, const void *g, float *s1, float *s2, int64_t n,
                   int device, void *stream) {
    kvps_opt_derive(&p);
    switch (grad_dtype) {
    case KVPS_F32: return opt_t<F32>(kind, p, w, g, s1, s2, n, device, stream);
    case KVPS_F16: return opt_t<F16>(kind, p, w, g, s1, s2, n, device, stream);
    case KVPS_BF16: return opt_t<BF16>(kind, p, w, g, s1, s2, n, device, stream);
    default: return KVPS_ERR_DTYPE;
    }
}

extern "C" KVPS_API int kvps_cuda_sgd_update(int grad_dtype, float *weight, const void *grad, float *mom, int64_t n,
                                             float lr, float momentum, float wd, float rescale_grad,
                                             float clip_gradient, int nesterov, int device, void *stream) {
    kvps_opt p = kvps_opt_make(lr, wd, rescale_grad, clip_gradient);
    p.momentum = momentum;
    int kind = !mom ? OPT_SGD : (nesterov ? OPT_NAG : OPT_SGD_MOM);
    return run_opt(kind, grad_dtype, p, weight, grad, mom, NULL, n, device, stream);
}

extern "C" KVPS_API int kvps_cuda_adam_update(int grad_dtype, float *weight, const void *grad, float *mean,
                                              float *var, int64_t n, float lr, float beta1, float beta2,
                                              float epsilon, float wd, float rescale_grad, float clip_gradient,
                                              int device, void *stream) {
    kvps_opt p = kvps_opt_make(lr, wd, rescale_grad, clip_gradient);
    p.beta1 = beta1;
    p.beta2 = beta2;
    p.eps = epsilon;
    return run_opt(OPT_ADAM, grad_dtype, p, weight, grad, mean, var, n, device, stream);
}

extern "C" KVPS_API int kvps_cuda_adamw_update(int grad_dtype, float *weight, const void *grad, float *mean,
                                               float *var, int64_t n, float lr, float beta1, float beta2,
                                               float epsilon, float wd, float rescale_grad, float clip_gradient,
                                               float eta, int device, void *stream) {
    if (!std::isfinite(rescale_grad) || rescale_grad == 0.0f)
        return KVPS_OK; /* MXNet skips the update when the loss scale overflowed */
    kvps_opt p = kvps_opt_make(lr, wd, rescale_grad, clip_gradient);
    p.beta1 = beta1;
    p.beta2 = beta2;
    p.eps = epsilon;
    p.eta = eta;
    return run_opt(OPT_ADAMW, grad_dtype, p, weight, grad, mean, var, n, device, stream);
}

extern "C" KVPS_API int kvps_cuda_adagrad_update(int grad_dtype, float *weight, const void *grad, float *history,
                                                 int64_t n, float lr, float epsilon, float wd, float rescale_grad,
                                                 float clip_gradient, int device, void *stream) {
    kvps_opt p = kvps_opt_make(lr, wd, rescale_grad, clip_gradient);
    p.eps = epsilon;
    return run_opt(OPT_ADAGRAD, grad_dtype, p, weight, grad, history, NULL, n, device, stream);
}

extern "C" KVPS_API int kvps_cuda_rmsprop_update(int grad_dtype, float *weight, const void *grad, float *state_n,
                                                 int64_t n, float lr, float gamma1, float epsilon, float wd,
                                                 float rescale_grad, float clip_gradient, float clip_weights,
                                                 int device, void *stream) {
    kvps_opt p = kvps_opt_make(lr, wd, rescale_grad, clip_gradient);
    p.gamma1 = gamma1;
    p.eps = epsilon;
    if (clip_weights > 0.0f)
        p.clip_weights = clip_weights;
    return run_opt(OPT_RMSPROP, grad_dtype, p, weight, grad, state_n, NULL, n, device, stream);
}

/* ---- compression: a warp per 32 elements, words from ballots ----------------------------- */
#define WARP_STRIDE(base, n)                                                                  \
    for (int64_t base = (int64_t)blockIdx.x * blockDim.x + (threadIdx.x & ~31u); base < (n); \
         base += (int64_t)gridDim.x * blockDim.x)

__global__ void compress2_kernel(const float *g, float *r, uint32_t *out, int64_t n, float t) {
    const unsigned lane = threadIdx.x & 31u;
    WARP_STRIDE(base, n) {
        int64_t i = base + lane;
        bool pos = false, neg = false;
        if (i < n) {
            float v = r[i] + g[i];
            if (v >= t) {
                pos = true;
                v -= t;
            } else if (v <= -t) {
                neg = true;
                v -= -t;
            }
            r[i] = v;
        }
        unsigned pm = __ballot_sync(0xffffffffu, pos), nm = __ballot_sync(0xffffffffu, neg);
        if (lane == 0)
            out[base / 16] = kvps_pack2(pm & 0xffffu, nm & 0xffffu);
        else if (lane == 16 && base + 16 < n)
            out[base / 16 + 1] = kvps_pack2(pm >> 16, nm >> 16);
    }
}

__global__ void compress1_kernel(const float *g, float *r, uint32_t *out, int64_t n, float t) {
    const unsigned lane = threadIdx.x & 31u;
    WARP_STRIDE(base, n) {
        int64_t i = base + lane;
        bool one = false;
        if (i < n) {
            float v = r[i] + g[i];
            one = v > t;
            r[i] = one ? v - 1.0f : v + 1.0f;
        }
        unsigned m = __ballot_sync(0xffffffffu, one);
        if (lane == 0)
            out[base / 32] = kvps_pack1(m);
    }
}

__global__ void decompress2_kernel(const uint32_t *in, float t, float *d, int64_t n) {
    GRID_STRIDE(i, n) {
        uint32_t code = (in[i >> 4] >> kvps_shift2((int)(i & 15))) & 3u;
        d[i] = d[i] + (code == 3u ? t : (code == 2u ? -t : 0.0f));
    }
}

__global__ void decompress1_kernel(const uint32_t *in, float *d, int64_t n) {
    GRID_STRIDE(i, n) {
        uint32_t bit = (in[i >> 5] >> kvps_shift1((int)(i & 31))) & 1u;
        d[i] = d[i] + (bit ? 1.0f : -1.0f);
    }
}

extern "C" KVPS_API int kvps_cuda_compress_2bit(const float *grad, float *residual, uint32_t *out, int64_t n,
                                                float threshold, int device, void *stream) {
    LAUNCH(device, stream, n, compress2_kernel, grad, residual, out, n, threshold);
}

extern "C" KVPS_API int kvps_cuda_decompress_2bit_add(const uint32_t *packed, float threshold, float *dst,
                                                      int64_t n, int device, void *stream) {
    LAUNCH(device, stream, n, decompress2_kernel, packed, threshold, dst, n);
}

extern "C" KVPS_API int kvps_cuda_compress_1bit(const float *grad, float *residual, uint32_t *out, int64_t n,
                                                float threshold, int device, void *stream) {
    LAUNCH(device, stream, n, compress1_kernel, grad, residual, out, n, threshold);
}

extern "C" KVPS_API int kvps_cuda_decompress_1bit_add(const uint32_t *packed, float *dst, int64_t n, int device,
                                                      void *stream) {
    LAUNCH(device, stream, n, decompress1_kernel, packed, dst, n);
}
