/*
 * simd_avx512.c: the AVX-512 path (avx512f, avx512bw, avx512vl; avx512_bf16 when present):
 * its primitives and compression loops; the other loops are simd_body.h's.
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

#define SIMD_TABLE kvps_isa_avx512
#define SIMD_NAME "avx512"
#define LANES 16
#define LANES64 8

typedef __m512 V;
typedef __m512d VD;
typedef __m512i VI;

#define ADD _mm512_add_ps
#define SUB _mm512_sub_ps
#define MUL _mm512_mul_ps
#define DIV _mm512_div_ps
#define SQRT _mm512_sqrt_ps
#define MIN _mm512_min_ps
#define MAX _mm512_max_ps
#define SET _mm512_set1_ps
#define ADD_PD _mm512_add_pd
#define MUL_PD _mm512_mul_pd
#define SET_PD _mm512_set1_pd
#define ADD_EPI32 _mm512_add_epi32
#define ADD_EPI64 _mm512_add_epi64

INLINE V ld32(const void *p) { return _mm512_loadu_ps(p); }
INLINE void st32(void *p, V v) { _mm512_storeu_ps(p, v); }
INLINE void stream32(void *p, V v) { _mm512_stream_ps(p, v); }
INLINE VD ld64f(const void *p) { return _mm512_loadu_pd(p); }
INLINE void st64f(void *p, VD v) { _mm512_storeu_pd(p, v); }
INLINE VI ldi(const void *p) { return _mm512_loadu_si512(p); }
INLINE void sti(void *p, VI v) { _mm512_storeu_si512(p, v); }
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

#include "simd_body.h"

#else /* compiler or target without AVX-512: an empty table that dispatch.c never picks */
const struct kvps_isa kvps_isa_avx512 = {.name = NULL};
#endif
