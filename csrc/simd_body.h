/*
 * simd_body.h: the loops of the SIMD paths, written once for every vector width.
 *
 * simd_avx2.c and simd_avx512.c define their ISA's primitives and their compression
 * loops, then include this file at their end; it defines every other loop from those
 * primitives and fills the path's struct kvps_isa. Both paths therefore do the same
 * operations in the same order as kvps_*_elem (kvps_common.h) and the scalar path, and
 * give bit-identical results. Each loop handles whole vectors (two per step where the loop
 * is memory-bound), then leaves the remainder to the scalar function of simd_scalar.c.
 *
 * The including file defines, before the #include:
 *   SIMD_TABLE, SIMD_NAME       the struct kvps_isa to define, and its name ("avx2")
 *   LANES, LANES64              float32 and float64 lanes of one vector
 *   V, VD, VI                   the float32, float64 and integer vector types
 *   ADD SUB MUL DIV SQRT MIN MAX SET    float32 operations (SET broadcasts a float)
 *   ADD_PD MUL_PD SET_PD        float64 operations
 *   ADD_EPI32 ADD_EPI64         wrapping integer additions
 *   ld32/st32, ld64f/st64f, ldi/sti     unaligned loads and stores of whole vectors
 *   stream32                    an aligned float32 vector store that bypasses the cache
 *   ld16h/st16h, ld16b/st16b    float16 / bfloat16 widened to float32 and rounded back
 *                               (round to nearest even, NaN kept)
 *   compress2, compress1, decompress2, decompress1   the compression loops (their bit
 *                               gathering is ISA-specific: movemask or mask registers)
 * AT, CAT and INLINE come from kvps_isa.h.
 */
#ifndef SIMD_TABLE
#error "simd_body.h is included by simd_avx2.c and simd_avx512.c after their primitives"
#endif

/* ---- sums ------------------------------------------------------------------------------ */
/* two vectors per step for the memory-bound loops, then one, then the scalar tail */
#define BINARY_LOOP(NAME, DT, ESZ, N, VT, LD, ST, OP)                                             \
    static void NAME(void *d, const void *s, int64_t n) {                                       \
        int64_t i = 0;                                                                          \
        for (; i + 2 * N <= n; i += 2 * N) {                                                    \
            VT a0 = LD(CAT(d, i, ESZ)), a1 = LD(CAT(d, i + N, ESZ));                            \
            VT b0 = LD(CAT(s, i, ESZ)), b1 = LD(CAT(s, i + N, ESZ));                            \
            ST(AT(d, i, ESZ), OP(a0, b0));                                                      \
            ST(AT(d, i + N, ESZ), OP(a1, b1));                                                  \
        }                                                                                       \
        for (; i + N <= n; i += N)                                                              \
            ST(AT(d, i, ESZ), OP(LD(CAT(d, i, ESZ)), LD(CAT(s, i, ESZ))));                       \
        kvps_scalar_sum(DT, AT(d, i, ESZ), CAT(s, i, ESZ), n - i);                              \
    }
BINARY_LOOP(sum_f32, KVPS_F32, 4, LANES, V, ld32, st32, ADD)
BINARY_LOOP(sum_f64, KVPS_F64, 8, LANES64, VD, ld64f, st64f, ADD_PD)
BINARY_LOOP(sum_f16, KVPS_F16, 2, LANES, V, ld16h, st16h, ADD)
BINARY_LOOP(sum_bf16, KVPS_BF16, 2, LANES, V, ld16b, st16b, ADD)
BINARY_LOOP(sum_i32, KVPS_I32, 4, LANES, VI, ldi, sti, ADD_EPI32)
BINARY_LOOP(sum_i64, KVPS_I64, 8, LANES64, VI, ldi, sti, ADD_EPI64)

#define SOURCES_LOOP(NAME, DT, ESZ, N, VT, LD, ST, OP)                                            \
    static void NAME(void *d, const void *const *srcs, int nsrc, int64_t off, int64_t n) {      \
        int64_t i = off, end = off + n;                                                         \
        for (; i + N <= end; i += N) {                                                          \
            VT acc = LD(CAT(srcs[0], i, ESZ));                                                  \
            for (int k = 1; k < nsrc; k++)                                                      \
                acc = OP(acc, LD(CAT(srcs[k], i, ESZ)));                                        \
            ST(AT(d, i, ESZ), acc);                                                             \
        }                                                                                       \
        kvps_scalar_sources(DT, d, srcs, nsrc, i, end - i);                                     \
    }
SOURCES_LOOP(src_f32, KVPS_F32, 4, LANES, V, ld32, st32, ADD)
SOURCES_LOOP(src_f64, KVPS_F64, 8, LANES64, VD, ld64f, st64f, ADD_PD)
SOURCES_LOOP(src_f16, KVPS_F16, 2, LANES, V, ld16h, st16h, ADD)
SOURCES_LOOP(src_bf16, KVPS_BF16, 2, LANES, V, ld16b, st16b, ADD)
SOURCES_LOOP(src_i32, KVPS_I32, 4, LANES, VI, ldi, sti, ADD_EPI32)
SOURCES_LOOP(src_i64, KVPS_I64, 8, LANES64, VI, ldi, sti, ADD_EPI64)

/* float32 sums too big for the caches: the same adds, stored with stream32 (past the cache,
 * so the sum's bytes are not read in first) once d + i is vector-aligned; the head before that
 * and the tail go to the scalar function. The fence makes the streamed stores visible before the
 * chunk counts as done (kvps_parallel_for's threads hand results over through atomics). */
static void src_f32_stream(void *d, const void *const *srcs, int nsrc, int64_t off, int64_t n) {
    int64_t i = off, end = off + n;
    int64_t head = (int64_t)((LANES * 4 - ((uintptr_t)AT(d, i, 4) & (LANES * 4 - 1))) & (LANES * 4 - 1)) / 4;
    if ((uintptr_t)d & 3)
        head = n; /* not even float-aligned: no vector store can be aligned */
    head = head < n ? head : n;
    kvps_scalar_sources(KVPS_F32, d, srcs, nsrc, i, head);
    for (i += head; i + LANES <= end; i += LANES) {
        V acc = ld32(CAT(srcs[0], i, 4));
        for (int k = 1; k < nsrc; k++)
            acc = ADD(acc, ld32(CAT(srcs[k], i, 4)));
        stream32(AT(d, i, 4), acc);
    }
    _mm_sfence();
    kvps_scalar_sources(KVPS_F32, d, srcs, nsrc, i, end - i);
}

/* ---- scale, axpy, casts ------------------------------------------------------------------- */
#define SCALE_AXPY(SUFFIX, DT, ESZ, LD, ST)                                                       \
    static void scale_##SUFFIX(void *x, double alpha, int64_t n) {                              \
        V a = SET((float)alpha);                                                                \
        int64_t i = 0;                                                                          \
        for (; i + 2 * LANES <= n; i += 2 * LANES) {                                            \
            V x0 = LD(CAT(x, i, ESZ)), x1 = LD(CAT(x, i + LANES, ESZ));                         \
            ST(AT(x, i, ESZ), MUL(x0, a));                                                      \
            ST(AT(x, i + LANES, ESZ), MUL(x1, a));                                              \
        }                                                                                       \
        for (; i + LANES <= n; i += LANES)                                                      \
            ST(AT(x, i, ESZ), MUL(LD(CAT(x, i, ESZ)), a));                                      \
        kvps_scalar_scale(DT, AT(x, i, ESZ), alpha, n - i);                                     \
    }                                                                                           \
    static void axpy_##SUFFIX(void *y, double alpha, const void *x, int64_t n) {                \
        V a = SET((float)alpha);                                                                \
        int64_t i = 0;                                                                          \
        for (; i + LANES <= n; i += LANES)                                                      \
            ST(AT(y, i, ESZ), ADD(LD(CAT(y, i, ESZ)), MUL(a, LD(CAT(x, i, ESZ)))));             \
        kvps_scalar_axpy(DT, AT(y, i, ESZ), alpha, CAT(x, i, ESZ), n - i);                      \
    }
SCALE_AXPY(f32, KVPS_F32, 4, ld32, st32)
SCALE_AXPY(f16, KVPS_F16, 2, ld16h, st16h)
SCALE_AXPY(bf16, KVPS_BF16, 2, ld16b, st16b)

static void scale_f64(void *x, double alpha, int64_t n) {
    VD a = SET_PD(alpha);
    int64_t i = 0;
    for (; i + LANES64 <= n; i += LANES64)
        st64f(AT(x, i, 8), MUL_PD(ld64f(CAT(x, i, 8)), a));
    kvps_scalar_scale(KVPS_F64, AT(x, i, 8), alpha, n - i);
}
static void axpy_f64(void *y, double alpha, const void *x, int64_t n) {
    VD a = SET_PD(alpha);
    int64_t i = 0;
    for (; i + LANES64 <= n; i += LANES64)
        st64f(AT(y, i, 8), ADD_PD(ld64f(CAT(y, i, 8)), MUL_PD(a, ld64f(CAT(x, i, 8)))));
    kvps_scalar_axpy(KVPS_F64, AT(y, i, 8), alpha, CAT(x, i, 8), n - i);
}

#define CASTS(SUFFIX, DT, LD, ST)                                                                 \
    static void from_f32_##SUFFIX(const void *s, void *d, int64_t n) {                          \
        int64_t i = 0;                                                                          \
        for (; i + 2 * LANES <= n; i += 2 * LANES) {                                            \
            V a = ld32(CAT(s, i, 4)), b = ld32(CAT(s, i + LANES, 4));                           \
            ST(AT(d, i, 2), a);                                                                 \
            ST(AT(d, i + LANES, 2), b);                                                         \
        }                                                                                       \
        for (; i + LANES <= n; i += LANES)                                                      \
            ST(AT(d, i, 2), ld32(CAT(s, i, 4)));                                                \
        kvps_scalar_from_f32(DT, CAT(s, i, 4), AT(d, i, 2), n - i);                             \
    }                                                                                           \
    static void to_f32_##SUFFIX(const void *s, void *d, int64_t n) {                            \
        int64_t i = 0;                                                                          \
        for (; i + 2 * LANES <= n; i += 2 * LANES) {                                            \
            V a = LD(CAT(s, i, 2)), b = LD(CAT(s, i + LANES, 2));                               \
            st32(AT(d, i, 4), a);                                                               \
            st32(AT(d, i + LANES, 4), b);                                                       \
        }                                                                                       \
        for (; i + LANES <= n; i += LANES)                                                      \
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
INLINE V clipv(V x, V c, V nc) { return MAX(nc, MIN(c, x)); }

INLINE void sgd_body(const kvps_opt *p, float *w, const void *g, int64_t n, int gk) {
    V a = SET(p->one_minus_lrwd), lr = SET(p->lr), lrrs = SET(p->lr_rescale), rs = SET(p->rescale);
    V c = SET(p->clip), nc = SET(-p->clip);
    int64_t i = 0;
    if (p->clip_on)
        for (; i + LANES <= n; i += LANES)
            st32(AT(w, i, 4), SUB(MUL(a, ld32(CAT(w, i, 4))), MUL(lr, clipv(MUL(rs, ldg(gk, g, i)), c, nc))));
    else
        for (; i + LANES <= n; i += LANES)
            st32(AT(w, i, 4), SUB(MUL(a, ld32(CAT(w, i, 4))), MUL(lrrs, ldg(gk, g, i))));
    kvps_scalar_opt(KVPS_OPT_SGD, gk, p, AT(w, i, 4), g_at(gk, g, i), NULL, NULL, n - i);
}

INLINE void sgd_mom_body(const kvps_opt *p, float *w, const void *g, float *mom, int64_t n, int gk) {
    V mu = SET(p->momentum), lrwd = SET(p->lr_wd), lr = SET(p->lr), lrrs = SET(p->lr_rescale);
    V rs = SET(p->rescale), c = SET(p->clip), nc = SET(-p->clip);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
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
    for (; i + LANES <= n; i += LANES) {
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
    for (; i + LANES <= n; i += LANES) {
        V wv = ld32(CAT(w, i, 4)), gv = ldg(gk, g, i), gg, m, v;
        if (decoupled) { /* AdamW */
            gg = clipv(MUL(rs, gv), c, nc);
            m = ADD(MUL(b1, ld32(CAT(mean, i, 4))), MUL(omb1, gg));
            v = ADD(MUL(b2, ld32(CAT(var, i, 4))), MUL(omb2, MUL(gg, gg)));
            wv = SUB(wv, MUL(eta, ADD(DIV(MUL(lr, m), ADD(SQRT(v), eps)), MUL(wd, wv))));
        } else {
            gg = clipv(ADD(MUL(rs, gv), MUL(wd, wv)), c, nc);
            m = ADD(MUL(b1, ld32(CAT(mean, i, 4))), MUL(omb1, gg));
            v = ADD(MUL(b2, ld32(CAT(var, i, 4))), MUL(MUL(omb2, gg), gg));
            wv = SUB(wv, DIV(MUL(lr, m), ADD(SQRT(v), eps)));
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
    for (; i + LANES <= n; i += LANES) {
        V wv = ld32(CAT(w, i, 4));
        V gg = clipv(MUL(rs, ldg(gk, g, i)), c, nc);
        V h = ADD(ld32(CAT(hist, i, 4)), MUL(gg, gg));
        V div = DIV(gg, SQRT(ADD(h, eps)));
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
    for (; i + LANES <= n; i += LANES) {
        V wv = ld32(CAT(w, i, 4));
        V gg = clipv(ADD(MUL(rs, ldg(gk, g, i)), MUL(wd, wv)), c, nc);
        V nv = ADD(MUL(omg, MUL(gg, gg)), MUL(g1, ld32(CAT(sn, i, 4))));
        st32(AT(sn, i, 4), nv);
        st32(AT(w, i, 4), clipv(SUB(wv, MUL(lr, DIV(gg, SQRT(ADD(nv, eps))))), cw, ncw));
    }
    kvps_scalar_opt(KVPS_OPT_RMSPROP, gk, p, AT(w, i, 4), g_at(gk, g, i), AT(sn, i, 4), NULL, n - i);
}

/* the table's signature for every optimizer, one function per grad dtype */
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

const struct kvps_isa SIMD_TABLE = {
    .name = SIMD_NAME,
    .sum = {[KVPS_F32] = sum_f32, [KVPS_F64] = sum_f64, [KVPS_F16] = sum_f16, [KVPS_BF16] = sum_bf16,
            [KVPS_I32] = sum_i32, [KVPS_I64] = sum_i64},
    .sources = {[KVPS_F32] = src_f32, [KVPS_F64] = src_f64, [KVPS_F16] = src_f16, [KVPS_BF16] = src_bf16,
                [KVPS_I32] = src_i32, [KVPS_I64] = src_i64},
    .sources_stream_f32 = src_f32_stream,
    .scale = {[KVPS_F32] = scale_f32, [KVPS_F64] = scale_f64, [KVPS_F16] = scale_f16, [KVPS_BF16] = scale_bf16},
    .axpy = {[KVPS_F32] = axpy_f32, [KVPS_F64] = axpy_f64, [KVPS_F16] = axpy_f16, [KVPS_BF16] = axpy_bf16},
    .from_f32 = {[KVPS_F16] = from_f32_f16, [KVPS_BF16] = from_f32_bf16},
    .to_f32 = {[KVPS_F16] = to_f32_f16, [KVPS_BF16] = to_f32_bf16},
    .opt = {OPT3(sgd), OPT3(sgd_mom), OPT3(nag), OPT3(adam), OPT3(adamw), OPT3(adagrad), OPT3(rmsprop)},
    .compress2 = compress2,
    .compress1 = compress1,
    .decompress2 = decompress2,
    .decompress1 = decompress1,
};
