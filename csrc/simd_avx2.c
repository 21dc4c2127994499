/*
 * simd_avx2.c: the AVX2 + F16C path: its primitives and compression loops; the other loops
 * are simd_body.h's.
 *
 * Built with -mavx2 -mf16c (setup.py) and only run when dispatch.c has seen both in
 * CPUID. 8 float32 lanes per step, then the scalar path for the last elements. bfloat16
 * is rounded with integers, (x + 0x7fff + lsb) >> 16, NaN made quiet, as ml_dtypes does.
 */
#include "kvps_isa.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>

#define SIMD_TABLE kvps_isa_avx2
#define SIMD_NAME "avx2"
#define LANES 8
#define LANES64 4

typedef __m256 V;
typedef __m256d VD;
typedef __m256i VI;

#define ADD _mm256_add_ps
#define SUB _mm256_sub_ps
#define MUL _mm256_mul_ps
#define DIV _mm256_div_ps
#define SQRT _mm256_sqrt_ps
#define MIN _mm256_min_ps
#define MAX _mm256_max_ps
#define SET _mm256_set1_ps
#define ADD_PD _mm256_add_pd
#define MUL_PD _mm256_mul_pd
#define SET_PD _mm256_set1_pd
#define ADD_EPI32 _mm256_add_epi32
#define ADD_EPI64 _mm256_add_epi64

INLINE V ld32(const void *p) { return _mm256_loadu_ps(p); }
INLINE void st32(void *p, V v) { _mm256_storeu_ps(p, v); }
INLINE void stream32(void *p, V v) { _mm256_stream_ps(p, v); }
INLINE VD ld64f(const void *p) { return _mm256_loadu_pd(p); }
INLINE void st64f(void *p, VD v) { _mm256_storeu_pd(p, v); }
INLINE VI ldi(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
INLINE void sti(void *p, VI v) { _mm256_storeu_si256((__m256i *)p, v); }
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

#include "simd_body.h"

#else /* compiler or target without AVX2 + F16C: an empty table that dispatch.c never picks */
const struct kvps_isa kvps_isa_avx2 = {.name = NULL};
#endif
