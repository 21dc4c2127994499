/*
 * kvps_common.h: scalar building blocks shared by the C library and the CUDA library.
 *
 * Everything here is one element at a time and compiles as C (static inline) and as
 * CUDA (__host__ __device__): float16/bfloat16 conversions, the per-element optimizer
 * formulas and the compression bit layout. Sharing them is what keeps the scalar C path,
 * the scalar tails of the SIMD paths and the CUDA kernels bit-identical to each other
 * and to kvps/kernels/reference.py. The library must be built with -ffp-contract=off
 * (nvcc: -fmad=false): a fused multiply-add rounds once where numpy rounds twice.
 */
#ifndef KVPS_COMMON_H
#define KVPS_COMMON_H

#include <stdint.h>
#include <string.h>
#ifndef __CUDACC__
#include <math.h>
#endif

#ifdef __CUDACC__
#define KVPS_HD static __host__ __device__ __forceinline__
#else
#define KVPS_HD static inline
#endif

/* ---- bit casts ---------------------------------------------------------------------- */
KVPS_HD uint32_t kvps_f2u(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
#endif
}

KVPS_HD float kvps_u2f(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* ---- float16 / bfloat16 <-> float32 (exact, round to nearest even) ------------------
 * These match numpy's float16 and ml_dtypes' bfloat16 casts bit for bit on every value
 * but NaN, whose payload is unspecified (NaN stays NaN, sign kept). */
KVPS_HD float kvps_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1fu) /* inf / nan */
        return kvps_u2f(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0)
            return kvps_u2f(sign);
        /* subnormal: man * 2^-24, renormalised */
        exp = 113;
        while (!(man & 0x400u)) {
            man <<= 1;
            exp--;
        }
        return kvps_u2f(sign | (exp << 23) | ((man & 0x3ffu) << 13));
    }
    return kvps_u2f(sign | ((exp + 112u) << 23) | (man << 13));
}

KVPS_HD uint16_t kvps_f32_to_f16(float f) {
    uint32_t x = kvps_f2u(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t a = x & 0x7fffffffu;
    if (a >= 0x7f800000u) { /* inf / nan */
        if (a == 0x7f800000u)
            return (uint16_t)(sign | 0x7c00u);
        uint32_t r = 0x7c00u | ((a & 0x7fffffu) >> 13);
        if (r == 0x7c00u)
            r++;
        return (uint16_t)(sign | r);
    }
    if (a >= 0x47800000u) /* >= 65536: overflows to inf */
        return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) { /* normal float16 range (rounding may carry into inf) */
        uint32_t bits = (((a >> 23) - 112u) << 10) | ((a >> 13) & 0x3ffu);
        uint32_t rem = a & 0x1fffu;
        if (rem > 0x1000u || (rem == 0x1000u && (bits & 1u)))
            bits++;
        return (uint16_t)(sign | bits);
    }
    if (a <= 0x33000000u) /* <= 2^-25: rounds to zero */
        return (uint16_t)sign;
    { /* subnormal float16 */
        uint32_t e = a >> 23;
        uint32_t man = (a & 0x7fffffu) | 0x800000u;
        uint32_t s = 126u - e; /* 14..24 */
        uint32_t q = man >> s;
        uint32_t rem = man & ((1u << s) - 1u);
        uint32_t half = 1u << (s - 1u);
        if (rem > half || (rem == half && (q & 1u)))
            q++;
        return (uint16_t)(sign | q);
    }
}

KVPS_HD float kvps_bf16_to_f32(uint16_t h) { return kvps_u2f((uint32_t)h << 16); }

KVPS_HD uint16_t kvps_f32_to_bf16(float f) {
    uint32_t x = kvps_f2u(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) /* nan: quiet, sign kept (as ml_dtypes) */
        return (uint16_t)(((x >> 16) & 0x8000u) | 0x7fc0u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* ---- optimizer parameters ------------------------------------------------------------ */
typedef struct kvps_opt {
    float lr, momentum, wd, rescale;
    float clip;          /* +inf when clipping is off: clip(x, +inf) == x, NaN included */
    int clip_on;         /* SGD rounds differently with and without clipping (as MXNet) */
    float beta1, beta2, eps, eta, gamma1;
    float clip_weights;  /* +inf when off */
    /* derived once, in float32, the way MXNet's kernels compute them */
    float one_minus_lrwd, lr_wd, lr_rescale, momentum_plus_one;
    float one_minus_beta1, one_minus_beta2, one_minus_gamma1, neg_lr;
} kvps_opt;

KVPS_HD float kvps_clipf(float x, float c) { return x > c ? c : (x < -c ? -c : x); }

/* The parameters common to every update; clip <= 0 (or NaN) means no clipping. */
KVPS_HD kvps_opt kvps_opt_make(float lr, float wd, float rescale, float clip) {
    kvps_opt p;
    memset(&p, 0, sizeof p);
    p.lr = lr;
    p.wd = wd;
    p.rescale = rescale;
    p.clip_on = clip > 0.0f;
    p.clip = p.clip_on ? clip : kvps_u2f(0x7f800000u);
    p.clip_weights = kvps_u2f(0x7f800000u);
    p.eta = 1.0f;
    return p;
}

/* The derived constants, in float32 as MXNet's kernels compute them. */
KVPS_HD void kvps_opt_derive(kvps_opt *p) {
    p->lr_wd = p->lr * p->wd;
    p->one_minus_lrwd = 1.0f - p->lr_wd;
    p->lr_rescale = p->lr * p->rescale;
    p->momentum_plus_one = p->momentum + 1.0f;
    p->one_minus_beta1 = 1.0f - p->beta1;
    p->one_minus_beta2 = 1.0f - p->beta2;
    p->one_minus_gamma1 = 1.0f - p->gamma1;
    p->neg_lr = -p->lr;
}

/* ---- per-element optimizer formulas: the scalar form of reference.py ---------------- */
KVPS_HD void kvps_sgd_elem(const kvps_opt *p, float g, float *w) {
    float wv = *w;
    if (p->clip_on)
        *w = p->one_minus_lrwd * wv - p->lr * kvps_clipf(p->rescale * g, p->clip);
    else
        *w = p->one_minus_lrwd * wv - p->lr_rescale * g;
}

KVPS_HD void kvps_sgd_mom_elem(const kvps_opt *p, float g, float *w, float *mom) {
    float wv = *w, m;
    if (p->clip_on)
        m = p->momentum * *mom - p->lr_wd * wv - p->lr * kvps_clipf(p->rescale * g, p->clip);
    else
        m = p->momentum * *mom - p->lr_wd * wv - p->lr_rescale * g;
    *mom = m;
    *w = wv + m;
}

/* MXNet's nag_mom_update. Its weight-decay term in the momentum update reads the weight
 * after the update, as MXNet's in-place kernel (out == weight) and its mp_ kernel do. */
KVPS_HD void kvps_nag_elem(const kvps_opt *p, float g, float *w, float *mom) {
    float wv = *w;
    float gg = kvps_clipf(p->rescale * g, p->clip);
    float m1 = p->momentum * *mom;
    float wn = (wv - m1) + p->momentum_plus_one * (m1 - p->lr * (gg + p->wd * wv));
    *mom = m1 - p->lr * (gg + p->wd * wn);
    *w = wn;
}

KVPS_HD void kvps_adam_elem(const kvps_opt *p, float g, float *w, float *mean, float *var) {
    float wv = *w;
    float gg = kvps_clipf(p->rescale * g + p->wd * wv, p->clip);
    float m = p->beta1 * *mean + p->one_minus_beta1 * gg;
    float v = p->beta2 * *var + p->one_minus_beta2 * gg * gg;
    *mean = m;
    *var = v;
    *w = wv - p->lr * m / (sqrtf(v) + p->eps);
}

KVPS_HD void kvps_adamw_elem(const kvps_opt *p, float g, float *w, float *mean, float *var) {
    float wv = *w;
    float gg = kvps_clipf(p->rescale * g, p->clip);
    float m = p->beta1 * *mean + p->one_minus_beta1 * gg;
    float v = p->beta2 * *var + p->one_minus_beta2 * (gg * gg);
    *mean = m;
    *var = v;
    *w = wv - p->eta * (p->lr * m / (sqrtf(v) + p->eps) + p->wd * wv);
}

KVPS_HD void kvps_adagrad_elem(const kvps_opt *p, float g, float *w, float *hist) {
    float wv = *w;
    float gg = kvps_clipf(p->rescale * g, p->clip);
    float h = *hist + gg * gg;
    float div = gg / sqrtf(h + p->eps);
    *hist = h;
    *w = wv + (div + wv * p->wd) * p->neg_lr;
}

KVPS_HD void kvps_rmsprop_elem(const kvps_opt *p, float g, float *w, float *state_n) {
    float wv = *w;
    float gg = kvps_clipf(p->rescale * g + p->wd * wv, p->clip);
    float n = p->one_minus_gamma1 * (gg * gg) + p->gamma1 * *state_n;
    *state_n = n;
    *w = kvps_clipf(wv - p->lr * (gg / sqrtf(n + p->eps)), p->clip_weights);
}

/* ---- compression bit layout (MXNet's gradient_compression-inl.h) ---------------------
 * 2-bit: element j of a word (j < 16) is the field at bit kvps_shift2(j); 1-bit: bit
 * kvps_shift1(j) (j < 32). The pack functions build a whole word from per-element masks
 * (bit j of the mask = element j) with shifts and masks only, so SIMD code (movemask),
 * CUDA (ballot) and scalar code share them. */
KVPS_HD int kvps_shift2(int j) { return 8 * (j >> 2) + 6 - 2 * (j & 3); }
KVPS_HD int kvps_shift1(int j) { return 8 * (j >> 3) + 7 - (j & 7); }

/* reverse the bit order inside each 4-bit group of a 16-bit mask */
KVPS_HD uint32_t kvps_rev_nibbles(uint32_t x) {
    x = ((x >> 1) & 0x5555u) | ((x & 0x5555u) << 1);
    x = ((x >> 2) & 0x3333u) | ((x & 0x3333u) << 2);
    return x;
}

/* bit b of x -> bit 2b */
KVPS_HD uint32_t kvps_spread16(uint32_t x) {
    x &= 0xffffu;
    x = (x | (x << 8)) & 0x00ff00ffu;
    x = (x | (x << 4)) & 0x0f0f0f0fu;
    x = (x | (x << 2)) & 0x33333333u;
    x = (x | (x << 1)) & 0x55555555u;
    return x;
}

/* pos/neg: 16-bit masks of the elements coded 11 (+t) and 10 (-t) */
KVPS_HD uint32_t kvps_pack2(uint32_t pos, uint32_t neg) {
    uint32_t any = pos | neg;
    return (kvps_spread16(kvps_rev_nibbles(any)) << 1) | kvps_spread16(kvps_rev_nibbles(pos));
}

/* one: 32-bit mask of the elements coded 1 (+1); reverses the bits of each byte */
KVPS_HD uint32_t kvps_pack1(uint32_t one) {
    one = ((one >> 1) & 0x55555555u) | ((one & 0x55555555u) << 1);
    one = ((one >> 2) & 0x33333333u) | ((one & 0x33333333u) << 2);
    one = ((one >> 4) & 0x0f0f0f0fu) | ((one & 0x0f0f0f0fu) << 4);
    return one;
}

#endif /* KVPS_COMMON_H */
