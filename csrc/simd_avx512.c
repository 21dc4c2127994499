/*
 * simd_avx512.c: the AVX-512 path (avx512f, avx512bw, avx512vl; avx512_bf16 when present).
 *
 * Built with -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mf16c (setup.py) and only
 * run when dispatch.c has seen those features in CPUID. 16 float32 lanes per step; every
 * loop ends in the scalar path for the last n % 16 elements. float16 goes through
 * VCVTPH2PS/VCVTPS2PH (round to nearest even). bfloat16 is rounded by VCVTNEPS2BF16 when
 * the CPU has avx512_bf16, except that this instruction flushes denormal inputs to zero,
 * so lanes whose exponent field is zero are redone with the integer rounding that
 * ml_dtypes uses (x + 0x7fff + lsb) >> 16.
 */
#include "kvps_isa.h"

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#define AT(p, i, sz) ((void *)((char *)(p) + (int64_t)(i) * (sz)))
#define CAT(p, i, sz) ((const void *)((const char *)(p) + (int64_t)(i) * (sz)))
#define INLINE static inline __attribute__((always_inline))

typedef __m512 V;

INLINE V ld32(const void *p) { return _mm512_loadu_ps(p); }
INLINE void st32(void *p, V v) { _mm512_storeu_ps(p, v); }
INLINE V ld16h(const void *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
INLINE void st16h(void *p, V v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
INLINE V ld16b(const void *p) {
    __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}
INLINE __m256i bf16_round_int(V v) {
    __m512i x = _mm512_castps_si512(v);
    __m512i hi = _mm512_srli_epi32(x, 16);
    __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    __m512i qnan = _mm512_or_si512(_mm512_and_si512(hi, _mm512_set1_epi32(0x8000)), _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, qnan));
}
INLINE void st16b(void *p, V v) {
    __m256i r;
#ifdef __AVX512BF16__
    if (kvps_avx512_has_bf16) {
        r = (__m256i)_mm512_cvtneps_pbh(v);
        __mmask16 tiny = _mm512_testn_epi32_mask(_mm512_castps_si512(v), _mm512_set1_epi32(0x7f800000));
        if (tiny)
            r = _mm256_mask_mov_epi16(r, tiny, bf16_round_int(v));
    } else
#endif
        r = bf16_round_int(v);
    _mm256_storeu_si256((__m256i *)p, r);
}

/* ---- sums ------------------------------------------------------------------------------ */
/* BODY2: two vectors per step for the memory-bound loops, then one, then the scalar tail */
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

INLINE __m512d ld64f(const void *p) { return _mm512_loadu_pd(p); }
INLINE void st64f(void *p, __m512d v) { _mm512_storeu_pd(p, v); }
INLINE __m512i ldi(const void *p) { return _mm512_loadu_si512(p); }
INLINE void sti(void *p, __m512i v) { _mm512_storeu_si512(p, v); }

BINARY_LOOP(sum_f32, KVPS_F32, 4, 16, V, ld32, st32, _mm512_add_ps)
BINARY_LOOP(sum_f64, KVPS_F64, 8, 8, __m512d, ld64f, st64f, _mm512_add_pd)
BINARY_LOOP(sum_f16, KVPS_F16, 2, 16, V, ld16h, st16h, _mm512_add_ps)
BINARY_LOOP(sum_bf16, KVPS_BF16, 2, 16, V, ld16b, st16b, _mm512_add_ps)
BINARY_LOOP(sum_i32, KVPS_I32, 4, 16, __m512i, ldi, sti, _mm512_add_epi32)
BINARY_LOOP(sum_i64, KVPS_I64, 8, 8, __m512i, ldi, sti, _mm512_add_epi64)

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

SOURCES_LOOP(src_f32, KVPS_F32, 4, 16, V, ld32, st32, _mm512_add_ps)
SOURCES_LOOP(src_f64, KVPS_F64, 8, 8, __m512d, ld64f, st64f, _mm512_add_pd)
SOURCES_LOOP(src_f16, KVPS_F16, 2, 16, V, ld16h, st16h, _mm512_add_ps)
SOURCES_LOOP(src_bf16, KVPS_BF16, 2, 16, V, ld16b, st16b, _mm512_add_ps)
SOURCES_LOOP(src_i32, KVPS_I32, 4, 16, __m512i, ldi, sti, _mm512_add_epi32)
SOURCES_LOOP(src_i64, KVPS_I64, 8, 8, __m512i, ldi, sti, _mm512_add_epi64)

/* ---- scale, axpy, casts ------------------------------------------------------------------- */
#define SCALE_AXPY(SUFFIX, DT, ESZ, LD, ST)                                                       \
    static void scale_##SUFFIX(void *x, double alpha, int64_t n) {                              \
        V a = _mm512_set1_ps((float)alpha);                                                     \
        int64_t i = 0;                                                                          \
        for (; i + 32 <= n; i += 32) {                                                          \
            V x0 = LD(CAT(x, i, ESZ)), x1 = LD(CAT(x, i + 16, ESZ));                             \
            ST(AT(x, i, ESZ), _mm512_mul_ps(x0, a));                                            \
            ST(AT(x, i + 16, ESZ), _mm512_mul_ps(x1, a));                                       \
        }                                                                                       \
        for (; i + 16 <= n; i += 16)                                                            \
            ST(AT(x, i, ESZ), _mm512_mul_ps(LD(CAT(x, i, ESZ)), a));                            \
        kvps_scalar_scale(DT, AT(x, i, ESZ), alpha, n - i);                                     \
    }                                                                                           \
    static void axpy_##SUFFIX(void *y, double alpha, const void *x, int64_t n) {                \
        V a = _mm512_set1_ps((float)alpha);                                                     \
        int64_t i = 0;                                                                          \
        for (; i + 16 <= n; i += 16)                                                            \
            ST(AT(y, i, ESZ), _mm512_add_ps(LD(CAT(y, i, ESZ)), _mm512_mul_ps(a, LD(CAT(x, i, ESZ))))); \
        kvps_scalar_axpy(DT, AT(y, i, ESZ), alpha, CAT(x, i, ESZ), n - i);                      \
    }
SCALE_AXPY(f32, KVPS_F32, 4, ld32, st32)
SCALE_AXPY(f16, KVPS_F16, 2, ld16h, st16h)
SCALE_AXPY(bf16, KVPS_BF16, 2, ld16b, st16b)

static void scale_f64(void *x, double alpha, int64_t n) {
    __m512d a = _mm512_set1_pd(alpha);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        st64f(AT(x, i, 8), _mm512_mul_pd(ld64f(CAT(x, i, 8)), a));
    kvps_scalar_scale(KVPS_F64, AT(x, i, 8), alpha, n - i);
}
static void axpy_f64(void *y, double alpha, const void *x, int64_t n) {
    __m512d a = _mm512_set1_pd(alpha);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        st64f(AT(y, i, 8), _mm512_add_pd(ld64f(CAT(y, i, 8)), _mm512_mul_pd(a, ld64f(CAT(x, i, 8)))));
    kvps_scalar_axpy(KVPS_F64, AT(y, i, 8), alpha, CAT(x, i, 8), n - i);
}

#define CASTS(SUFFIX, DT, LD, ST)                                                                 \
    static void from_f32_##SUFFIX(const void *s, void *d, int64_t n) {                          \
        int64_t i = 0;                                                                          \
        for (; i + 32 <= n; i += 32) {                                                          \
            V a = ld32(CAT(s, i, 4)), b = ld32(CAT(s, i + 16, 4));                               \
            ST(AT(d, i, 2), a);                                                                 \
            ST(AT(d, i + 16, 2), b);                                                            \
        }                                                                                       \
        for (; i + 16 <= n; i += 16)                                                            \
            ST(AT(d, i, 2), ld32(CAT(s, i, 4)));                                                \
        kvps_scalar_from_f32(DT, CAT(s, i, 4), AT(d, i, 2), n - i);                             \
    }                                                                                           \
    static void to_f32_##SUFFIX(const void *s, void *d, int64_t n) {                            \
        int64_t i = 0;                                                                          \
        for (; i + 32 <= n; i += 32) {                                                          \
            V a = LD(CAT(s, i, 2)), b = LD(CAT(s, i + 16, 2));                                   \
            st32(AT(d, i, 4), a);                                                               \
            st32(AT(d, i + 16, 4), b);                                                          \
        }                                                                                       \
        for (; i + 16 <= n; i += 16)                                                            \
            st32(AT(d, i, 4), LD(CAT(s, i, 2)));                                                \
        kvps_scalar_to_f32(DT, CAT(s, i, 2), AT(d, i, 4), n - i);                               \
    }
CASTS(f16, KVPS_F16, ld16h, st16h)
CASTS(bf16, KVPS_BF16, ld16b, st16b)

/* ---- fused optimizer updates ------------------------------------------------------------- */
/* The same operations, in the same order, as kvps_*_elem in kvps_common.h. */
INLINE V ldg(int gk, const void *g, int64_t i) {
    if (gk == KVPS_G_F32)
        return ld32(CAT(g, i, 4));
    return gk == KVPS_G_F16 ? ld16h(CAT(g, i, 2)) : ld16b(CAT(g, i, 2));
}
INLINE const void *g_at(int gk, const void *g, int64_t i) { return CAT(g, i, gk == KVPS_G_F32 ? 4 : 2); }
/* min(c, x) keeps a NaN x; max(-c, .) likewise: MXNet's clip, NaN passing through */
INLINE V clipv(V x, V c, V nc) { return _mm512_max_ps(nc, _mm512_min_ps(c, x)); }

#define MUL _mm512_mul_ps
#define ADD _mm512_add_ps
#define SUB _mm512_sub_ps
#define DIV _mm512_div_ps
#define SET _mm512_set1_ps

INLINE void sgd_body(const kvps_opt *p, float *w, const void *g, int64_t n, int gk) {
    V a = SET(p->one_minus_lrwd), lr = SET(p->lr), lrrs = SET(p->lr_rescale), rs = SET(p->rescale);
    V c = SET(p->clip), nc = SET(-p->clip);
    int64_t i = 0;
    if (p->clip_on)
        for (; i + 16 <= n; i += 16)
            st32(AT(w, i, 4), SUB(MUL(a, ld32(CAT(w, i, 4))), MUL(lr, clipv(MUL(rs, ldg(gk, g, i)), c, nc))));
    else
        for (; i + 16 <= n; i += 16)
            st32(AT(w, i, 4), SUB(MUL(a, ld32(CAT(w, i, 4))), MUL(lrrs, ldg(gk, g, i))));
    kvps_scalar_opt(KVPS_OPT_SGD, gk, p, AT(w, i, 4), g_at(gk, g, i), NULL, NULL, n - i);
}

INLINE void sgd_mom_body(const kvps_opt *p, float *w, const void *g, float *mom, int64_t n, int gk) {
    V mu = SET(p->momentum), lrwd = SET(p->lr_wd), lr = SET(p->lr), lrrs = SET(p->lr_rescale);
    V rs = SET(p->rescale), c = SET(p->clip), nc = SET(-p->clip);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
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
    for (; i + 16 <= n; i += 16) {
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
    for (; i + 16 <= n; i += 16) {
        V wv = ld32(CAT(w, i, 4)), gv = ldg(gk, g, i), gg, m, v;
        if (decoupled) { /* AdamW */
            gg = clipv(MUL(rs, gv), c, nc);
            m = ADD(MUL(b1, ld32(CAT(mean, i, 4))), MUL(omb1, gg));
            v = ADD(MUL(b2, ld32(CAT(var, i, 4))), MUL(omb2, MUL(gg, gg)));
            wv = SUB(wv, MUL(eta, ADD(DIV(MUL(lr, m), ADD(_mm512_sqrt_ps(v), eps)), MUL(wd, wv))));
        } else {
            gg = clipv(ADD(MUL(rs, gv), MUL(wd, wv)), c, nc);
            m = ADD(MUL(b1, ld32(CAT(mean, i, 4))), MUL(omb1, gg));
            v = ADD(MUL(b2, ld32(CAT(var, i, 4))), MUL(MUL(omb2, gg), gg));
            wv = SUB(wv, DIV(MUL(lr, m), ADD(_mm512_sqrt_ps(v), eps)));
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
    for (; i + 16 <= n; i += 16) {
        V wv = ld32(CAT(w, i, 4));
        V gg = clipv(MUL(rs, ldg(gk, g, i)), c, nc);
        V h = ADD(ld32(CAT(hist, i, 4)), MUL(gg, gg));
        V div = DIV(gg, _mm512_sqrt_ps(ADD(h, eps)));
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
    for (; i + 16 <= n; i += 16) {
        V wv = ld32(CAT(w, i, 4));
        V gg = clipv(ADD(MUL(rs, ldg(gk, g, i)), MUL(wd, wv)), c, nc);
        V nv = ADD(MUL(omg, MUL(gg, gg)), MUL(g1, ld32(CAT(sn, i, 4))));
        st32(AT(sn, i, 4), nv);
        st32(AT(w, i, 4), clipv(SUB(wv, MUL(lr, DIV(gg, _mm512_sqrt_ps(ADD(nv, eps))))), cw, ncw));
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
    V tv = SET(t), ntv = SET(-t);
    int64_t w = 0;
    for (; (w + 1) * 16 <= n; w++) {
        int64_t i = w * 16;
        V v = ADD(ld32(CAT(r, i, 4)), ld32(CAT(g, i, 4)));
        __mmask16 pos = _mm512_cmp_ps_mask(v, tv, _CMP_GE_OQ);
        __mmask16 neg = (__mmask16)(_mm512_cmp_ps_mask(v, ntv, _CMP_LE_OQ) & ~pos);
        v = _mm512_mask_sub_ps(v, pos, v, tv);
        v = _mm512_mask_sub_ps(v, neg, v, ntv);
        st32(AT(r, i, 4), v);
        uint32_t word = kvps_pack2(pos, neg);
        memcpy(AT(out, w, 4), &word, 4);
    }
    kvps_scalar_compress2(CAT(g, w * 16, 4), AT(r, w * 16, 4), AT(out, w, 4), t, n - w * 16);
}

static void compress1(const float *g, float *r, uint32_t *out, float t, int64_t n) {
    V tv = SET(t), one = SET(1.0f);
    int64_t w = 0;
    for (; (w + 1) * 32 <= n; w++) {
        int64_t i = w * 32;
        V v0 = ADD(ld32(CAT(r, i, 4)), ld32(CAT(g, i, 4)));
        V v1 = ADD(ld32(CAT(r, i + 16, 4)), ld32(CAT(g, i + 16, 4)));
        __mmask16 m0 = _mm512_cmp_ps_mask(v0, tv, _CMP_GT_OQ), m1 = _mm512_cmp_ps_mask(v1, tv, _CMP_GT_OQ);
        v0 = _mm512_mask_add_ps(_mm512_mask_sub_ps(v0, m0, v0, one), (__mmask16)~m0, v0, one);
        v1 = _mm512_mask_add_ps(_mm512_mask_sub_ps(v1, m1, v1, one), (__mmask16)~m1, v1, one);
        st32(AT(r, i, 4), v0);
        st32(AT(r, i + 16, 4), v1);
        uint32_t word = kvps_pack1((uint32_t)m0 | ((uint32_t)m1 << 16));
        memcpy(AT(out, w, 4), &word, 4);
    }
    kvps_scalar_compress1(CAT(g, w * 32, 4), AT(r, w * 32, 4), AT(out, w, 4), t, n - w * 32);
}

static void decompress2(const uint32_t *in, float t, float *dst, int64_t n) {
    const __m512i shifts = _mm512_setr_epi32(6, 4, 2, 0, 14, 12, 10, 8, 22, 20, 18, 16, 30, 28, 26, 24);
    const __m512i three = _mm512_set1_epi32(3), two = _mm512_set1_epi32(2);
    V tv = SET(t), ntv = SET(-t), zero = _mm512_setzero_ps();
    int64_t w = 0;
    for (; (w + 1) * 16 <= n; w++) {
        uint32_t word;
        memcpy(&word, CAT(in, w, 4), 4);
        __m512i codes = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)word), shifts), three);
        V val = _mm512_mask_mov_ps(zero, _mm512_cmpeq_epi32_mask(codes, three), tv);
        val = _mm512_mask_mov_ps(val, _mm512_cmpeq_epi32_mask(codes, two), ntv);
        st32(AT(dst, w * 16, 4), ADD(ld32(CAT(dst, w * 16, 4)), val));
    }
    kvps_scalar_decompress2(CAT(in, w, 4), t, AT(dst, w * 16, 4), n - w * 16);
}

static void decompress1(const uint32_t *in, float t, float *dst, int64_t n) {
    const __m512i shifts = _mm512_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0, 15, 14, 13, 12, 11, 10, 9, 8);
    const __m512i sixteen = _mm512_set1_epi32(16), bit = _mm512_set1_epi32(1);
    V one = SET(1.0f), none = SET(-1.0f);
    int64_t w = 0;
    for (; (w + 1) * 32 <= n; w++) {
        uint32_t word;
        memcpy(&word, CAT(in, w, 4), 4);
        __m512i x = _mm512_set1_epi32((int)word);
        __mmask16 m0 = _mm512_test_epi32_mask(_mm512_srlv_epi32(x, shifts), bit);
        __mmask16 m1 = _mm512_test_epi32_mask(_mm512_srlv_epi32(x, _mm512_add_epi32(shifts, sixteen)), bit);
        int64_t i = w * 32;
        st32(AT(dst, i, 4), ADD(ld32(CAT(dst, i, 4)), _mm512_mask_blend_ps(m0, none, one)));
        st32(AT(dst, i + 16, 4), ADD(ld32(CAT(dst, i + 16, 4)), _mm512_mask_blend_ps(m1, none, one)));
    }
    kvps_scalar_decompress1(CAT(in, w, 4), t, AT(dst, w * 32, 4), n - w * 32);
}

const struct kvps_isa kvps_isa_avx512 = {
    .name = "avx512",
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

#else /* compiler or target without AVX-512: an empty table that dispatch.c never picks */
const struct kvps_isa kvps_isa_avx512 = {.name = NULL};
#endif
