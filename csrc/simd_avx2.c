/*
 * simd_avx2.c: the AVX2 + F16C path.
 *
 * Built with -mavx2 -mf16c (setup.py) and only run when dispatch.c has seen both in
 * CPUID. 8 float32 lanes per step, then the scalar path for the last elements. bfloat16
 * is rounded with integers, (x + 0x7fff + lsb) >> 16, NaN made quiet, as ml_dtypes does.
 */
#include "kvps_isa.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>

#define AT(p, i, sz) ((void *)((char *)(p) + (int64_t)(i) * (sz)))
#define CAT(p, i, sz) ((const void *)((const char *)(p) + (int64_t)(i) * (sz)))
#define INLINE static inline __attribute__((always_inline))

typedef __m256 V;

INLINE V ld32(const void *p) { return _mm256_loadu_ps(p); }
INLINE void st32(void *p, V v) { _mm256_storeu_ps(p, v); }
INLINE V ld16h(const void *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
INLINE void st16h(void *p, V v) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
INLINE V ld16b(const void *p) {
    __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}
INLINE void st16b(void *p, V v) {
    __m256i x = _mm256_castps_si256(v);
    __m256i hi = _mm256_srli_epi32(x, 16);
    __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    __m256i qnan = _mm256_or_si256(_mm256_and_si256(hi, _mm256_set1_epi32(0x8000)), _mm256_set1_epi32(0x7fc0));
    r = _mm256_blendv_epi8(r, qnan, nan);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
INLINE __m256d ld64f(const void *p) { return _mm256_loadu_pd(p); }
INLINE void st64f(void *p, __m256d v) { _mm256_storeu_pd(p, v); }
INLINE __m256i ldi(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
INLINE void sti(void *p, __m256i v) { _mm256_storeu_si256((__m256i *)p, v); }

/* ---- sums ------------------------------------------------------------------------------ */
#define BINARY_LOOP(NAME, DT, ESZ, LANES, VT, LD, ST, OP)                                         \
    static void NAME(void *d, const void *s, int64_t n) {                                       \
        int64_t i = 0;                                                                          \
        for (; i + 2 * LANES <= n; i += 2 * LANES) {                                            \
            VT a0 = LD(CAT(d, i, ESZ)), a1 = LD(CAT(d, i + LANES, ESZ));                        \
            VT b0 = LD(CAT(s, i, ESZ)), b1 = LD(CAT(s, i + LANES, ESZ));                        \
            ST(AT(d, i, ESZ), OP(a0, b0));                                                      \
            ST(AT(d, i + LANES, ESZ), OP(a1, b1));                                              \
        }                                                                                       \
        for (; i + LANES <= n; i += LANES)                                                      \
            ST(AT(d, i, ESZ), OP(LD(CAT(d, i, ESZ)), LD(CAT(s, i, ESZ))));                       \
        kvps_scalar_sum(DT, AT(d, i, ESZ), CAT(s, i, ESZ), n - i);                              \
    }
BINARY_LOOP(sum_f32, KVPS_F32, 4, 8, V, ld32, st32, _mm256_add_ps)
BINARY_LOOP(sum_f64, KVPS_F64, 8, 4, __m256d, ld64f, st64f, _mm256_add_pd)
BINARY_LOOP(sum_f16, KVPS_F16, 2, 8, V, ld16h, st16h, _mm256_add_ps)
BINARY_LOOP(sum_bf16, KVPS_BF16, 2, 8, V, ld16b, st16b, _mm256_add_ps)
BINARY_LOOP(sum_i32, KVPS_I32, 4, 8, __m256i, ldi, sti, _mm256_add_epi32)
BINARY_LOOP(sum_i64, KVPS_I64, 8, 4, __m256i, ldi, sti, _mm256_add_epi64)

#define SOURCES_LOOP(NAME, DT, ESZ, LANES, VT, LD, ST, OP)                                        \
    static void NAME(void *d, const void *const *srcs, int nsrc, int64_t off, int64_t n) {      \
        int64_t i = off, end = off + n;                                                         \
        for (; i + LANES <= end; i += LANES) {                                                  \
            VT acc = LD(CAT(srcs[0], i, ESZ));                                                  \
            for (int k = 1; k < nsrc; k++)                                                      \
                acc = OP(acc, LD(CAT(srcs[k], i, ESZ)));                                        \
            ST(AT(d, i, ESZ), acc);                                                             \
        }                                                                                       \
        kvps_scalar_sources(DT, d, srcs, nsrc, i, end - i);                                     \
    }
SOURCES_LOOP(src_f32, KVPS_F32, 4, 8, V, ld32, st32, _mm256_add_ps)
SOURCES_LOOP(src_f64, KVPS_F64, 8, 4, __m256d, ld64f, st64f, _mm256_add_pd)
SOURCES_LOOP(src_f16, KVPS_F16, 2, 8, V, ld16h, st16h, _mm256_add_ps)
SOURCES_LOOP(src_bf16, KVPS_BF16, 2, 8, V, ld16b, st16b, _mm256_add_ps)
SOURCES_LOOP(src_i32, KVPS_I32, 4, 8, __m256i, ldi, sti, _mm256_add_epi32)
SOURCES_LOOP(src_i64, KVPS_I64, 8, 4, __m256i, ldi, sti, _mm256_add_epi64)

/* ---- scale, axpy, casts ------------------------------------------------------------------- */
#define SCALE_AXPY(SUFFIX, DT, ESZ, LD, ST)                                                       \
    static void scale_##SUFFIX(void *x, double alpha, int64_t n) {                              \
        V a = _mm256_set1_ps((float)alpha);                                                     \
        int64_t i = 0;                                                                          \
        for (; i + 8 <= n; i += 8)                                                              \
            ST(AT(x, i, ESZ), _mm256_mul_ps(LD(CAT(x, i, ESZ)), a));                            \
        kvps_scalar_scale(DT, AT(x, i, ESZ), alpha, n - i);                                     \
    }                                                                                           \
    static void axpy_##SUFFIX(void *y, double alpha, const void *x, int64_t n) {                \
        V a = _mm256_set1_ps((float)alpha);                                                     \
        int64_t i = 0;                                                                          \
        for (; i + 8 <= n; i += 8)                                                              \
            ST(AT(y, i, ESZ), _mm256_add_ps(LD(CAT(y, i, ESZ)), _mm256_mul_ps(a, LD(CAT(x, i, ESZ))))); \
        kvps_scalar_axpy(DT, AT(y, i, ESZ), alpha, CAT(x, i, ESZ), n - i);                      \
    }
SCALE_AXPY(f32, KVPS_F32, 4, ld32, st32)
SCALE_AXPY(f16, KVPS_F16, 2, ld16h, st16h)
SCALE_AXPY(bf16, KVPS_BF16, 2, ld16b, st16b)

static void scale_f64(void *x, double alpha, int64_t n) {
    __m256d a = _mm256_set1_pd(alpha);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        st64f(AT(x, i, 8), _mm256_mul_pd(ld64f(CAT(x, i, 8)), a));
    kvps_scalar_scale(KVPS_F64, AT(x, i, 8), alpha, n - i);
}
static void axpy_f64(void *y, double alpha, const void *x, int64_t n) {
    __m256d a = _mm256_set1_pd(alpha);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        st64f(AT(y, i, 8), _mm256_add_pd(ld64f(CAT(y, i, 8)), _mm256_mul_pd(a, ld64f(CAT(x, i, 8)))));
    kvps_scalar_axpy(KVPS_F64, AT(y, i, 8), alpha, CAT(x, i, 8), n - i);
}

#define CASTS(SUFFIX, DT, LD, ST)                                                                 \
    static void from_f32_##SUFFIX(const void *s, void *d, int64_t n) {                          \
        int64_t i = 0;                                                                          \
        for (; i + 8 <= n; i += 8)                                                              \
            ST(AT(d, i, 2), ld32(CAT(s, i, 4)));                                                \
        kvps_scalar_from_f32(DT, CAT(s, i, 4), AT(d, i, 2), n - i);                             \
    }                                                                                           \
    static void to_f32_##SUFFIX(const void *s, void *d, int64_t n) {                            \
        int64_t i = 0;                                                                          \
        for (; i + 8 <= n; i += 8)                                                              \
            st32(AT(d, i, 4), LD(CAT(s, i, 2)));                                                \
        kvps_scalar_to_f32(DT, CAT(s, i, 2), AT(d, i, 4), n - i);                               \
    }
CASTS(f16, KVPS_F16, ld16h, st16h)
CASTS(bf16, KVPS_BF16, ld16b, st16b)

/* ---- fused optimizer updates: same operations, same order as kvps_*_elem ---------------- */
INLINE V ldg(int gk, const void *g, int64_t i) {
    if (gk == KVPS_G_F32)
        return ld32(CAT(g, i, 4));
    return gk == KVPS_G_F16 ? ld16h(CAT(g, i, 2)) : ld16b(CAT(g, i, 2));
}
INLINE const void *g_at(int gk, const void *g, int64_t i) { return CAT(g, i, gk == KVPS_G_F32 ? 4 : 2); }
INLINE V clipv(V x, V c, V nc) { return _mm256_max_ps(nc, _mm256_min_ps(c, x)); }

#define MUL _mm256_mul_ps
#define ADD _mm256_add_ps
#define SUB _mm256_sub_ps
#define DIV _mm256_div_ps
#define SET _mm256_set1_ps

INLINE void sgd_body(const kvps_opt *p, float *w, const void *g, int64_t n, int gk) {
    V a = SET(p->one_minus_lrwd), lr = SET(p->lr), lrrs = SET(p->lr_rescale), rs = SET(p->rescale);
    V c = SET(p->clip), nc = SET(-p->clip);
    int64_t i = 0;
    if (p->clip_on)
        for (; i + 8 <= n; i += 8)
            st32(AT(w, i, 4), SUB(MUL(a, ld32(CAT(w, i, 4))), MUL(lr, clipv(MUL(rs, ldg(gk, g, i)), c, nc))));
    else
        for (; i + 8 <= n; i += 8)
            st32(AT(w, i, 4), SUB(MUL(a, ld32(CAT(w, i, 4))), MUL(lrrs, ldg(gk, g, i))));
    kvps_scalar_opt(KVPS_OPT_SGD, gk, p, AT(w, i, 4), g_at(gk, g, i), NULL, NULL, n - i);
}

INLINE void sgd_mom_body(const kvps_opt *p, float *w, const void *g, float *mom, int64_t n, int gk) {
    V mu = SET(p->momentum), lrwd = SET(p->lr_wd), lr = SET(p->lr), lrrs = SET(p->lr_rescale);
    V rs = SET(p->rescale), c = SET(p->clip), nc = SET(-p->clip);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        V wv = ld32(CAT(w, i, 4)), gv = ldg(gk, g, i);
        V m = SUB(MUL(mu, ld32(CAT(mom, i, 4))), MUL(lrwd, wv));
        m = p->clip_on ? SUB(m, MUL(lr, clipv(MUL(rs, gv), c, nc))) : SUB(m, MUL(lrrs, gv));
        st32(AT(mom, i, 4), m);
        st32(AT(w, i, 4), ADD(wv, m));
    }
    kvps_scalar_opt(KVPS_OPT_SGD_MOM, gk, p, AT(w, i, 4), g_at(gk, g, i), AT(mom, i, 4), NULL, n - i);
}

INLINE void nag_body(const kvps_opt *p, float *w, const void *g, float *mom, int64_t n, int gk) {
    V mu = SET(p->momentum), mu1 = SET(p->momentum_plus_one), lr = SET(p->lr), wd = SET(p->wd);
    V rs = SET(p->rescale), c = SET(p->clip), nc = SET(-p->clip);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        V wv = ld32(CAT(w, i, 4));
        V gg = clipv(MUL(rs, ldg(gk, g, i)), c, nc);
        V m1 = MUL(mu, ld32(CAT(mom, i, 4)));
        V wn = ADD(SUB(wv, m1), MUL(mu1, SUB(m1, MUL(lr, ADD(gg, MUL(wd, wv))))));
        st32(AT(mom, i, 4), SUB(m1, MUL(lr, ADD(gg, MUL(wd, wn)))));
        st32(AT(w, i, 4), wn);
    }
    kvps_scalar_opt(KVPS_OPT_NAG, gk, p, AT(w, i, 4), g_at(gk, g, i), AT(mom, i, 4), NULL, n - i);
}

INLINE void adam_body(const kvps_opt *p, float *w, const void *g, float *mean, float *var, int64_t n, int gk,
                      int decoupled) {
    V rs = SET(p->rescale), wd = SET(p->wd), c = SET(p->clip), nc = SET(-p->clip);
    V b1 = SET(p->beta1), omb1 = SET(p->one_minus_beta1), b2 = SET(p->beta2), omb2 = SET(p->one_minus_beta2);
    V lr = SET(p->lr), eps = SET(p->eps), eta = SET(p->eta);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        V wv = ld32(CAT(w, i, 4)), gv = ldg(gk, g, i), gg, m, v;
        if (decoupled) {
            gg = clipv(MUL(rs, gv), c, nc);
            m = ADD(MUL(b1, ld32(CAT(mean, i, 4))), MUL(omb1, gg));
            v = ADD(MUL(b2, ld32(CAT(var, i, 4))), MUL(omb2, MUL(gg, gg)));
            wv = SUB(wv, MUL(eta, ADD(DIV(MUL(lr, m), ADD(_mm256_sqrt_ps(v), eps)), MUL(wd, wv))));
        } else {
            gg = clipv(ADD(MUL(rs, gv), MUL(wd, wv)), c, nc);
            m = ADD(MUL(b1, ld32(CAT(mean, i, 4))), MUL(omb1, gg));
            v = ADD(MUL(b2, ld32(CAT(var, i, 4))), MUL(MUL(omb2, gg), gg));
            wv = SUB(wv, DIV(MUL(lr, m), ADD(_mm256_sqrt_ps(v), eps)));
        }
        st32(AT(mean, i, 4), m);
        st32(AT(var, i, 4), v);
        st32(AT(w, i, 4), wv);
    }
    kvps_scalar_opt(decoupled ? KVPS_OPT_ADAMW : KVPS_OPT_ADAM, gk, p, AT(w, i, 4), g_at(gk, g, i),
                    AT(mean, i, 4), AT(var, i, 4), n - i);
}

INLINE void adagrad_body(const kvps_opt *p, float *w, const void *g, float *hist, int64_t n, int gk) {
    V rs = SET(p->rescale), wd = SET(p->wd), c = SET(p->clip), nc = SET(-p->clip);
    V eps = SET(p->eps), nlr = SET(p->neg_lr);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        V wv = ld32(CAT(w, i, 4));
        V gg = clipv(MUL(rs, ldg(gk, g, i)), c, nc);
        V h = ADD(ld32(CAT(hist, i, 4)), MUL(gg, gg));
        V div = DIV(gg, _mm256_sqrt_ps(ADD(h, eps)));
        st32(AT(hist, i, 4), h);
        st32(AT(w, i, 4), ADD(wv, MUL(ADD(div, MUL(wv, wd)), nlr)));
    }
    kvps_scalar_opt(KVPS_OPT_ADAGRAD, gk, p, AT(w, i, 4), g_at(gk, g, i), AT(hist, i, 4), NULL, n - i);
}

INLINE void rmsprop_body(const kvps_opt *p, float *w, const void *g, float *sn, int64_t n, int gk) {
    V rs = SET(p->rescale), wd = SET(p->wd), c = SET(p->clip), nc = SET(-p->clip);
    V omg = SET(p->one_minus_gamma1), g1 = SET(p->gamma1), lr = SET(p->lr), eps = SET(p->eps);
    V cw = SET(p->clip_weights), ncw = SET(-p->clip_weights);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        V wv = ld32(CAT(w, i, 4));
        V gg = clipv(ADD(MUL(rs, ldg(gk, g, i)), MUL(wd, wv)), c, nc);
        V nv = ADD(MUL(omg, MUL(gg, gg)), MUL(g1, ld32(CAT(sn, i, 4))));
        st32(AT(sn, i, 4), nv);
        st32(AT(w, i, 4), clipv(SUB(wv, MUL(lr, DIV(gg, _mm256_sqrt_ps(ADD(nv, eps))))), cw, ncw));
    }
    kvps_scalar_opt(KVPS_OPT_RMSPROP, gk, p, AT(w, i, 4), g_at(gk, g, i), AT(sn, i, 4), NULL, n - i);
}

#define OPT_WRAPPERS(GK, SUFFIX)                                                                            \
    static void sgd_##SUFFIX(const kvps_opt *p, float *w, const void *g, float *a, float *b, int64_t n) {     \
        (void)a, (void)b;                                                                                   \
        sgd_body(p, w, g, n, GK);                                                                           \
    }                                                                                                       \
    static void sgd_mom_##SUFFIX(const kvps_opt *p, float *w, const void *g, float *a, float *b, int64_t n) { \
        (void)b;                                                                                            \
        sgd_mom_body(p, w, g, a, n, GK);                                                                    \
    }                                                                                                       \
    static void nag_##SUFFIX(const kvps_opt *p, float *w, const void *g, float *a, float *b, int64_t n) {     \
        (void)b;                                                                                            \
        nag_body(p, w, g, a, n, GK);                                                                        \
    }                                                                                                       \
    static void adam_##SUFFIX(const kvps_opt *p, float *w, const void *g, float *a, float *b, int64_t n) {    \
        adam_body(p, w, g, a, b, n, GK, 0);                                                                 \
    }                                                                                                       \
    static void adamw_##SUFFIX(const kvps_opt *p, float *w, const void *g, float *a, float *b, int64_t n) {   \
        adam_body(p, w, g, a, b, n, GK, 1);                                                                 \
    }                                                                                                       \
    static void adagrad_##SUFFIX(const kvps_opt *p, float *w, const void *g, float *a, float *b, int64_t n) { \
        (void)b;                                                                                            \
        adagrad_body(p, w, g, a, n, GK);                                                                    \
    }                                                                                                       \
    static void rmsprop_##SUFFIX(const kvps_opt *p, float *w, const void *g, float *a, float *b, int64_t n) { \
        (void)b;                                                                                            \
        rmsprop_body(p, w, g, a, n, GK);                                                                    \
    }
OPT_WRAPPERS(KVPS_G_F32, f32)
OPT_WRAPPERS(KVPS_G_F16, f16)
OPT_WRAPPERS(KVPS_G_BF16, bf16)
#define OPT3(NAME) {NAME##_f32, NAME##_f16, NAME##_bf16}

/* ---- compression ------------------------------------------------------------------------------ */
static void compress2(const float *g, float *r, uint32_t *out, float t, int64_t n) {
    V tv = SET(t), ntv = SET(-t), zero = _mm256_setzero_ps();
    int64_t w = 0;
    for (; (w + 1) * 16 <= n; w++) {
        uint32_t pos = 0, neg = 0;
        for (int h = 0; h < 2; h++) {
            int64_t i = w * 16 + h * 8;
            V v = ADD(ld32(CAT(r, i, 4)), ld32(CAT(g, i, 4)));
            V p = _mm256_cmp_ps(v, tv, _CMP_GE_OQ);
            V q = _mm256_andnot_ps(p, _mm256_cmp_ps(v, ntv, _CMP_LE_OQ));
            /* v - 0 == v for every v (-0 and NaN included), so one subtraction does all */
            V sub = _mm256_blendv_ps(_mm256_blendv_ps(zero, tv, p), ntv, q);
            st32(AT(r, i, 4), SUB(v, sub));
            pos |= (uint32_t)_mm256_movemask_ps(p) << (8 * h);
            neg |= (uint32_t)_mm256_movemask_ps(q) << (8 * h);
        }
        uint32_t word = kvps_pack2(pos, neg);
        memcpy(AT(out, w, 4), &word, 4);
    }
    kvps_scalar_compress2(CAT(g, w * 16, 4), AT(r, w * 16, 4), AT(out, w, 4), t, n - w * 16);
}

static void compress1(const float *g, float *r, uint32_t *out, float t, int64_t n) {
    V tv = SET(t), one = SET(1.0f), none = SET(-1.0f);
    int64_t w = 0;
    for (; (w + 1) * 32 <= n; w++) {
        uint32_t bits = 0;
        for (int h = 0; h < 4; h++) {
            int64_t i = w * 32 + h * 8;
            V v = ADD(ld32(CAT(r, i, 4)), ld32(CAT(g, i, 4)));
            V m = _mm256_cmp_ps(v, tv, _CMP_GT_OQ);
            /* v - 1 where emitted +1, v - (-1) == v + 1 elsewhere */
            st32(AT(r, i, 4), SUB(v, _mm256_blendv_ps(none, one, m)));
            bits |= (uint32_t)_mm256_movemask_ps(m) << (8 * h);
        }
        uint32_t word = kvps_pack1(bits);
        memcpy(AT(out, w, 4), &word, 4);
    }
    kvps_scalar_compress1(CAT(g, w * 32, 4), AT(r, w * 32, 4), AT(out, w, 4), t, n - w * 32);
}

static void decompress2(const uint32_t *in, float t, float *dst, int64_t n) {
    const __m256i shifts = _mm256_setr_epi32(6, 4, 2, 0, 14, 12, 10, 8);
    const __m256i three = _mm256_set1_epi32(3), two = _mm256_set1_epi32(2), sixteen = _mm256_set1_epi32(16);
    V tv = SET(t), ntv = SET(-t), zero = _mm256_setzero_ps();
    int64_t w = 0;
    for (; (w + 1) * 16 <= n; w++) {
        uint32_t word;
        memcpy(&word, CAT(in, w, 4), 4);
        __m256i x = _mm256_set1_epi32((int)word);
        for (int h = 0; h < 2; h++) {
            __m256i sh = h ? _mm256_add_epi32(shifts, sixteen) : shifts;
            __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(x, sh), three);
            V val = _mm256_blendv_ps(zero, tv, _mm256_castsi256_ps(_mm256_cmpeq_epi32(codes, three)));
            val = _mm256_blendv_ps(val, ntv, _mm256_castsi256_ps(_mm256_cmpeq_epi32(codes, two)));
            int64_t i = w * 16 + h * 8;
            st32(AT(dst, i, 4), ADD(ld32(CAT(dst, i, 4)), val));
        }
    }
    kvps_scalar_decompress2(CAT(in, w, 4), t, AT(dst, w * 16, 4), n - w * 16);
}

static void decompress1(const uint32_t *in, float t, float *dst, int64_t n) {
    const __m256i shifts = _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    const __m256i bit = _mm256_set1_epi32(1);
    V one = SET(1.0f), none = SET(-1.0f);
    int64_t w = 0;
    for (; (w + 1) * 32 <= n; w++) {
        uint32_t word;
        memcpy(&word, CAT(in, w, 4), 4);
        __m256i x = _mm256_set1_epi32((int)word);
        for (int h = 0; h < 4; h++) {
            __m256i sh = _mm256_add_epi32(shifts, _mm256_set1_epi32(8 * h));
            __m256i b = _mm256_and_si256(_mm256_srlv_epi32(x, sh), bit);
            V m = _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, bit));
            int64_t i = w * 32 + h * 8;
            st32(AT(dst, i, 4), ADD(ld32(CAT(dst, i, 4)), _mm256_blendv_ps(none, one, m)));
        }
    }
    kvps_scalar_decompress1(CAT(in, w, 4), t, AT(dst, w * 32, 4), n - w * 32);
}

const struct kvps_isa kvps_isa_avx2 = {
    .name = "avx2",
    .sum = {sum_f32, sum_f64, sum_f16, sum_bf16, sum_i32, sum_i64},
    .sources = {src_f32, src_f64, src_f16, src_bf16, src_i32, src_i64},
    .scale = {scale_f32, scale_f64, scale_f16, scale_bf16, NULL, NULL},
    .axpy = {axpy_f32, axpy_f64, axpy_f16, axpy_bf16, NULL, NULL},
    .from_f32 = {[KVPS_F16] = from_f32_f16, [KVPS_BF16] = from_f32_bf16},
    .to_f32 = {[KVPS_F16] = to_f32_f16, [KVPS_BF16] = to_f32_bf16},
    .opt = {OPT3(sgd), OPT3(sgd_mom), OPT3(nag), OPT3(adam), OPT3(adamw), OPT3(adagrad), OPT3(rmsprop)},
    .compress2 = compress2,
    .compress1 = compress1,
    .decompress2 = decompress2,
    .decompress1 = decompress1,
};

#else /* compiler or target without AVX2 + F16C: an empty table that dispatch.c never picks */
const struct kvps_isa kvps_isa_avx2 = {.name = NULL};
#endif
