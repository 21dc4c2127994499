/*
 * simd_scalar.c: the portable path, one element at a time.
 *
 * It runs where neither AVX2+F16C nor AVX-512 is available, and its functions finish
 * (the "scalar tail") every loop of the SIMD paths. Loads and stores go through memcpy,
 * so arrays at any byte address are fine. Built without SIMD flags; -ffp-contract=off.
 */
#include <string.h>

#include "kvps_isa.h"

static inline float ldf(const void *p, int64_t i) {
    float v;
    memcpy(&v, (const char *)p + 4 * i, 4);
    return v;
}
static inline void stf(void *p, int64_t i, float v) { memcpy((char *)p + 4 * i, &v, 4); }
static inline double ldd(const void *p, int64_t i) {
    double v;
    memcpy(&v, (const char *)p + 8 * i, 8);
    return v;
}
static inline void std_(void *p, int64_t i, double v) { memcpy((char *)p + 8 * i, &v, 8); }
static inline uint16_t ldh(const void *p, int64_t i) {
    uint16_t v;
    memcpy(&v, (const char *)p + 2 * i, 2);
    return v;
}
static inline void sth(void *p, int64_t i, uint16_t v) { memcpy((char *)p + 2 * i, &v, 2); }
static inline uint32_t ldu(const void *p, int64_t i) {
    uint32_t v;
    memcpy(&v, (const char *)p + 4 * i, 4);
    return v;
}
static inline void stu(void *p, int64_t i, uint32_t v) { memcpy((char *)p + 4 * i, &v, 4); }
static inline uint64_t ldq(const void *p, int64_t i) {
    uint64_t v;
    memcpy(&v, (const char *)p + 8 * i, 8);
    return v;
}
static inline void stq(void *p, int64_t i, uint64_t v) { memcpy((char *)p + 8 * i, &v, 8); }

/* a float16 / bfloat16 element, as float32 and back */
static inline float ld_lp(int dtype, const void *p, int64_t i) {
    uint16_t h = ldh(p, i);
    return dtype == KVPS_F16 ? kvps_f16_to_f32(h) : kvps_bf16_to_f32(h);
}
static inline void st_lp(int dtype, void *p, int64_t i, float v) {
    sth(p, i, dtype == KVPS_F16 ? kvps_f32_to_f16(v) : kvps_f32_to_bf16(v));
}

void kvps_scalar_sum(int dtype, void *d, const void *s, int64_t n) {
    int64_t i;
    switch (dtype) {
    case KVPS_F32:
        for (i = 0; i < n; i++)
            stf(d, i, ldf(d, i) + ldf(s, i));
        break;
    case KVPS_F64:
        for (i = 0; i < n; i++)
            std_(d, i, ldd(d, i) + ldd(s, i));
        break;
    case KVPS_F16:
    case KVPS_BF16:
        for (i = 0; i < n; i++)
            st_lp(dtype, d, i, ld_lp(dtype, d, i) + ld_lp(dtype, s, i));
        break;
    case KVPS_I32: /* unsigned arithmetic: wraps like numpy, without signed overflow */
        for (i = 0; i < n; i++)
            stu(d, i, ldu(d, i) + ldu(s, i));
        break;
    case KVPS_I64:
        for (i = 0; i < n; i++)
            stq(d, i, ldq(d, i) + ldq(s, i));
        break;
    }
}

void kvps_scalar_sources(int dtype, void *d, const void *const *srcs, int nsrc, int64_t off, int64_t n) {
    int64_t i, end = off + n;
    int k;
    switch (dtype) {
    case KVPS_F32:
        for (i = off; i < end; i++) {
            float acc = ldf(srcs[0], i);
            for (k = 1; k < nsrc; k++)
                acc += ldf(srcs[k], i);
            stf(d, i, acc);
        }
        break;
    case KVPS_F64:
        for (i = off; i < end; i++) {
            double acc = ldd(srcs[0], i);
            for (k = 1; k < nsrc; k++)
                acc += ldd(srcs[k], i);
            std_(d, i, acc);
        }
        break;
    case KVPS_F16:
    case KVPS_BF16:
        for (i = off; i < end; i++) {
            float acc = ld_lp(dtype, srcs[0], i);
            for (k = 1; k < nsrc; k++)
                acc += ld_lp(dtype, srcs[k], i);
            st_lp(dtype, d, i, acc);
        }
        break;
    case KVPS_I32:
        for (i = off; i < end; i++) {
            uint32_t acc = ldu(srcs[0], i);
            for (k = 1; k < nsrc; k++)
                acc += ldu(srcs[k], i);
            stu(d, i, acc);
        }
        break;
    case KVPS_I64:
        for (i = off; i < end; i++) {
            uint64_t acc = ldq(srcs[0], i);
            for (k = 1; k < nsrc; k++)
                acc += ldq(srcs[k], i);
            stq(d, i, acc);
        }
        break;
    }
}

void kvps_scalar_scale(int dtype, void *x, double alpha, int64_t n) {
    int64_t i;
    float a = (float)alpha;
    switch (dtype) {
    case KVPS_F32:
        for (i = 0; i < n; i++)
            stf(x, i, ldf(x, i) * a);
        break;
    case KVPS_F64:
        for (i = 0; i < n; i++)
            std_(x, i, ldd(x, i) * alpha);
        break;
    case KVPS_F16:
    case KVPS_BF16:
        for (i = 0; i < n; i++)
            st_lp(dtype, x, i, ld_lp(dtype, x, i) * a);
        break;
    }
}

void kvps_scalar_axpy(int dtype, void *y, double alpha, const void *x, int64_t n) {
    int64_t i;
    float a = (float)alpha;
    switch (dtype) {
    case KVPS_F32:
        for (i = 0; i < n; i++)
            stf(y, i, ldf(y, i) + a * ldf(x, i));
        break;
    case KVPS_F64:
        for (i = 0; i < n; i++)
            std_(y, i, ldd(y, i) + alpha * ldd(x, i));
        break;
    case KVPS_F16:
    case KVPS_BF16:
        for (i = 0; i < n; i++)
            st_lp(dtype, y, i, ld_lp(dtype, y, i) + a * ld_lp(dtype, x, i));
        break;
    }
}

void kvps_scalar_from_f32(int dtype, const void *src, void *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        st_lp(dtype, dst, i, ldf(src, i));
}

void kvps_scalar_to_f32(int dtype, const void *src, void *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        stf(dst, i, ld_lp(dtype, src, i));
}

static inline float ld_grad(int gkind, const void *g, int64_t i) {
    if (gkind == KVPS_G_F32)
        return ldf(g, i);
    return gkind == KVPS_G_F16 ? kvps_f16_to_f32(ldh(g, i)) : kvps_bf16_to_f32(ldh(g, i));
}

void kvps_scalar_opt(int kind, int gkind, const kvps_opt *p, float *w, const void *g, float *s1, float *s2,
                     int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        /* through locals: the arrays may sit at any byte address */
        float gv = ld_grad(gkind, g, i), wv = ldf(w, i), a = 0.0f, b = 0.0f;
        if (s1)
            a = ldf(s1, i);
        if (s2)
            b = ldf(s2, i);
        switch (kind) {
        case KVPS_OPT_SGD: kvps_sgd_elem(p, gv, &wv); break;
        case KVPS_OPT_SGD_MOM: kvps_sgd_mom_elem(p, gv, &wv, &a); break;
        case KVPS_OPT_NAG: kvps_nag_elem(p, gv, &wv, &a); break;
        case KVPS_OPT_ADAM: kvps_adam_elem(p, gv, &wv, &a, &b); break;
        case KVPS_OPT_ADAMW: kvps_adamw_elem(p, gv, &wv, &a, &b); break;
        case KVPS_OPT_ADAGRAD: kvps_adagrad_elem(p, gv, &wv, &a); break;
        case KVPS_OPT_RMSPROP: kvps_rmsprop_elem(p, gv, &wv, &a); break;
        }
        stf(w, i, wv);
        if (s1)
            stf(s1, i, a);
        if (s2)
            stf(s2, i, b);
    }
}

void kvps_scalar_compress2(const float *g, float *r, uint32_t *out, float t, int64_t n) {
    for (int64_t w = 0; w * 16 < n; w++) {
        uint32_t pos = 0, neg = 0;
        int64_t base = w * 16;
        int m = n - base < 16 ? (int)(n - base) : 16;
        for (int j = 0; j < m; j++) {
            float v = ldf(r, base + j) + ldf(g, base + j);
            if (v >= t) {
                pos |= 1u << j;
                v -= t;
            } else if (v <= -t) {
                neg |= 1u << j;
                v -= -t;
            }
            stf(r, base + j, v);
        }
        stu(out, w, kvps_pack2(pos, neg));
    }
}

void kvps_scalar_compress1(const float *g, float *r, uint32_t *out, float t, int64_t n) {
    for (int64_t w = 0; w * 32 < n; w++) {
        uint32_t one = 0;
        int64_t base = w * 32;
        int m = n - base < 32 ? (int)(n - base) : 32;
        for (int j = 0; j < m; j++) {
            float v = ldf(r, base + j) + ldf(g, base + j);
            if (v > t) {
                one |= 1u << j;
                v -= 1.0f;
            } else {
                v += 1.0f;
            }
            stf(r, base + j, v);
        }
        stu(out, w, kvps_pack1(one));
    }
}

void kvps_scalar_decompress2(const uint32_t *in, float t, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t code = (ldu(in, i >> 4) >> kvps_shift2((int)(i & 15))) & 3u;
        float v = code == 3u ? t : (code == 2u ? -t : 0.0f);
        stf(dst, i, ldf(dst, i) + v);
    }
}

void kvps_scalar_decompress1(const uint32_t *in, float t, float *dst, int64_t n) {
    (void)t;
    for (int64_t i = 0; i < n; i++) {
        uint32_t bit = (ldu(in, i >> 5) >> kvps_shift1((int)(i & 31))) & 1u;
        stf(dst, i, ldf(dst, i) + (bit ? 1.0f : -1.0f));
    }
}

/* ---- the table: fixed-signature wrappers -------------------------------------------- */
#define WRAP_DT(NAME, DT)                                                                    \
    static void sum_##NAME(void *d, const void *s, int64_t n) { kvps_scalar_sum(DT, d, s, n); } \
    static void src_##NAME(void *d, const void *const *s, int ns, int64_t off, int64_t n) {     \
        kvps_scalar_sources(DT, d, s, ns, off, n);                                              \
    }
WRAP_DT(f32, KVPS_F32)
WRAP_DT(f64, KVPS_F64)
WRAP_DT(f16, KVPS_F16)
WRAP_DT(bf16, KVPS_BF16)
WRAP_DT(i32, KVPS_I32)
WRAP_DT(i64, KVPS_I64)

#define WRAP_FLOAT(NAME, DT)                                                                       \
    static void scale_##NAME(void *x, double a, int64_t n) { kvps_scalar_scale(DT, x, a, n); }    \
    static void axpy_##NAME(void *y, double a, const void *x, int64_t n) {                        \
        kvps_scalar_axpy(DT, y, a, x, n);                                                         \
    }
WRAP_FLOAT(f32, KVPS_F32)
WRAP_FLOAT(f64, KVPS_F64)
WRAP_FLOAT(f16, KVPS_F16)
WRAP_FLOAT(bf16, KVPS_BF16)

static void from_f32_f16(const void *s, void *d, int64_t n) { kvps_scalar_from_f32(KVPS_F16, s, d, n); }
static void from_f32_bf16(const void *s, void *d, int64_t n) { kvps_scalar_from_f32(KVPS_BF16, s, d, n); }
static void to_f32_f16(const void *s, void *d, int64_t n) { kvps_scalar_to_f32(KVPS_F16, s, d, n); }
static void to_f32_bf16(const void *s, void *d, int64_t n) { kvps_scalar_to_f32(KVPS_BF16, s, d, n); }

#define WRAP_OPT(KIND, GK, NAME)                                                                    \
    static void opt_##NAME(const kvps_opt *p, float *w, const void *g, float *a, float *b, int64_t n) { \
        kvps_scalar_opt(KIND, GK, p, w, g, a, b, n);                                                \
    }
#define WRAP_OPT3(KIND, NAME)                         \
    WRAP_OPT(KIND, KVPS_G_F32, NAME##_f32)             \
    WRAP_OPT(KIND, KVPS_G_F16, NAME##_f16)             \
    WRAP_OPT(KIND, KVPS_G_BF16, NAME##_bf16)
WRAP_OPT3(KVPS_OPT_SGD, sgd)
WRAP_OPT3(KVPS_OPT_SGD_MOM, sgd_mom)
WRAP_OPT3(KVPS_OPT_NAG, nag)
WRAP_OPT3(KVPS_OPT_ADAM, adam)
WRAP_OPT3(KVPS_OPT_ADAMW, adamw)
WRAP_OPT3(KVPS_OPT_ADAGRAD, adagrad)
WRAP_OPT3(KVPS_OPT_RMSPROP, rmsprop)
#define OPT3(NAME) {opt_##NAME##_f32, opt_##NAME##_f16, opt_##NAME##_bf16}

const struct kvps_isa kvps_isa_scalar = {
    .name = "scalar",
    .sum = {sum_f32, sum_f64, sum_f16, sum_bf16, sum_i32, sum_i64},
    .sources = {src_f32, src_f64, src_f16, src_bf16, src_i32, src_i64},
    .scale = {scale_f32, scale_f64, scale_f16, scale_bf16, NULL, NULL},
    .axpy = {axpy_f32, axpy_f64, axpy_f16, axpy_bf16, NULL, NULL},
    .from_f32 = {[KVPS_F16] = from_f32_f16, [KVPS_BF16] = from_f32_bf16},
    .to_f32 = {[KVPS_F16] = to_f32_f16, [KVPS_BF16] = to_f32_bf16},
    .opt = {OPT3(sgd), OPT3(sgd_mom), OPT3(nag), OPT3(adam), OPT3(adamw), OPT3(adagrad), OPT3(rmsprop)},
    .compress2 = kvps_scalar_compress2,
    .compress1 = kvps_scalar_compress1,
    .decompress2 = kvps_scalar_decompress2,
    .decompress1 = kvps_scalar_decompress1,
};
