/*
 * dispatch.c: the exported C ABI (kvps_kernels.h) of _kvps_kernels.so.
 *
 * Every entry point validates its arguments, picks the loop for the dtype from the
 * SIMD path chosen at first use (AVX-512 if CPUID and the OS allow it, else AVX2+F16C,
 * else scalar) and hands it to kvps_parallel_for, which splits large arrays across
 * threads at multiples of KVPS_ALIGN elements (a multiple of 32, so compressed words
 * never straddle two threads).
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "kvps_isa.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <emmintrin.h> /* SSE2, part of x86-64: the streaming stores of kvps_copy */
#define KVPS_X86 1
#endif

#define KVPS_ALIGN 1024

int kvps_avx512_has_bf16 = 0;

/* ---- dtype table and status names ------------------------------------------------------- */
#define DT_NAME_(name, value, size, text) [value] = text,
#define DT_SIZE_(name, value, size, text) [value] = size,
static const char *const dtype_names[KVPS_NDTYPES] = {KVPS_DTYPE_TABLE(DT_NAME_)};
static const int dtype_sizes[KVPS_NDTYPES] = {KVPS_DTYPE_TABLE(DT_SIZE_)};

int kvps_abi_version(void) { return KVPS_ABI_VERSION; }
const char *kvps_dtype_name(int dtype) { return dtype >= 0 && dtype < KVPS_NDTYPES ? dtype_names[dtype] : NULL; }
int kvps_dtype_size(int dtype) { return dtype >= 0 && dtype < KVPS_NDTYPES ? dtype_sizes[dtype] : 0; }

const char *kvps_status_name(int status) {
    switch (status) {
    case KVPS_OK: return "ok";
    case KVPS_ERR_ARG: return "invalid argument";
    case KVPS_ERR_DTYPE: return "unsupported dtype";
    case KVPS_ERR_NOMEM: return "out of memory";
    case KVPS_ERR_INDEX: return "index out of range";
    case KVPS_ERR_UNSUPPORTED: return "not supported by this CPU or build";
    case KVPS_ERR_CUDA: return "CUDA error";
    default: return "unknown status";
    }
}

/* ---- CPU features and the SIMD path ------------------------------------------------------ */
static struct {
    pthread_once_t once;
    const struct kvps_isa *usable[3]; /* best first, NULL-terminated */
    const struct kvps_isa *active;
    char features[160];
    char paths[48];
} cpu = {PTHREAD_ONCE_INIT, {NULL, NULL, NULL}, NULL, "", ""};

static void add_word(char *buf, size_t len, const char *word) {
    size_t used = strlen(buf);
    snprintf(buf + used, len - used, "%s%s", used ? " " : "", word);
}

static void detect(void) {
    int avx2_ok = 0, avx512_ok = 0, bf16 = 0;
#ifdef KVPS_X86
    unsigned a, b, c, d;
    int f16c = 0, fma = 0, avx2 = 0, f = 0, bw = 0, vl = 0, os_avx = 0, os_avx512 = 0;
    if (__get_cpuid(1, &a, &b, &c, &d)) {
        fma = (c >> 12) & 1;
        f16c = (c >> 29) & 1;
        if (((c >> 27) & 1) && ((c >> 28) & 1)) { /* OSXSAVE and AVX: ask the OS what it saves */
            unsigned lo, hi;
            __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
            (void)hi;
            os_avx = (lo & 0x6u) == 0x6u;
            os_avx512 = os_avx && (lo & 0xe0u) == 0xe0u;
        }
    }
    if (__get_cpuid_max(0, NULL) >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        avx2 = (b >> 5) & 1;
        f = (b >> 16) & 1;
        bw = (b >> 30) & 1;
        vl = (b >> 31) & 1;
        __cpuid_count(7, 1, a, b, c, d);
        bf16 = (a >> 5) & 1;
    }
    if (avx2) add_word(cpu.features, sizeof cpu.features, "avx2");
    if (f16c) add_word(cpu.features, sizeof cpu.features, "f16c");
    if (fma) add_word(cpu.features, sizeof cpu.features, "fma");
    if (f) add_word(cpu.features, sizeof cpu.features, "avx512f");
    if (bw) add_word(cpu.features, sizeof cpu.features, "avx512bw");
    if (vl) add_word(cpu.features, sizeof cpu.features, "avx512vl");
    if (bf16) add_word(cpu.features, sizeof cpu.features, "avx512_bf16");
    if (!os_avx && (avx2 || f)) add_word(cpu.features, sizeof cpu.features, "(AVX state not enabled by the OS)");
    avx2_ok = os_avx && avx2 && f16c;
    avx512_ok = os_avx512 && f && bw && vl && f16c;
#endif
    int k = 0;
    if (avx512_ok && kvps_isa_avx512.name)
        cpu.usable[k++] = &kvps_isa_avx512;
    if (avx2_ok && kvps_isa_avx2.name)
        cpu.usable[k++] = &kvps_isa_avx2;
    cpu.usable[k++] = &kvps_isa_scalar;
    for (int i = 0; i < k; i++)
        add_word(cpu.paths, sizeof cpu.paths, cpu.usable[i]->name);
    kvps_avx512_has_bf16 = bf16 && avx512_ok;
    __atomic_store_n(&cpu.active, cpu.usable[0], __ATOMIC_RELEASE);
}

static const struct kvps_isa *isa(void) {
    pthread_once(&cpu.once, detect);
    return __atomic_load_n(&cpu.active, __ATOMIC_ACQUIRE);
}

const char *kvps_cpu_features(void) {
    isa();
    return cpu.features;
}
const char *kvps_simd_paths(void) {
    isa();
    return cpu.paths;
}
const char *kvps_simd_path(void) { return isa()->name; }

int kvps_set_simd_path(const char *name) {
    isa();
    if (!name)
        return KVPS_ERR_ARG;
    for (int i = 0; i < 3 && cpu.usable[i]; i++)
        if (strcmp(cpu.usable[i]->name, name) == 0) {
            __atomic_store_n(&cpu.active, cpu.usable[i], __ATOMIC_RELEASE);
            return KVPS_OK;
        }
    return KVPS_ERR_UNSUPPORTED;
}

/* ---- argument checks -------------------------------------------------------------------- */
#define CHECK(cond, status)      \
    do {                         \
        if (!(cond))             \
            return (status);     \
    } while (0)
#define CHECK_ARRAY(p, n) CHECK((n) >= 0 && ((p) != NULL || (n) == 0), KVPS_ERR_ARG)

static int is_float(int dt) { return dt == KVPS_F32 || dt == KVPS_F64 || dt == KVPS_F16 || dt == KVPS_BF16; }
static char *at(const void *p, int64_t i, int esz) { return (char *)p + i * esz; }

/* ---- element-wise ops --------------------------------------------------------------------- */
typedef struct {
    kvps_binary_fn fn;
    void *d;
    const void *s;
    int esz;
} bin_job;
static void bin_range(const void *a, int64_t b, int64_t e) {
    const bin_job *j = (const bin_job *)a;
    j->fn(at(j->d, b, j->esz), at(j->s, b, j->esz), e - b);
}

int kvps_sum_into(int dtype, void *dst, const void *src, int64_t n) {
    CHECK(dtype >= 0 && dtype < KVPS_NDTYPES, KVPS_ERR_DTYPE);
    CHECK_ARRAY(dst, n);
    CHECK_ARRAY(src, n);
    bin_job j = {isa()->sum[dtype], dst, src, dtype_sizes[dtype]};
    if (n)
        kvps_parallel_for(bin_range, &j, n, KVPS_ALIGN);
    return KVPS_OK;
}

typedef struct {
    kvps_sources_fn fn;
    void *d;
    const void *const *srcs;
    int nsrc;
} src_job;
static void src_range(const void *a, int64_t b, int64_t e) {
    const src_job *j = (const src_job *)a;
    j->fn(j->d, j->srcs, j->nsrc, b, e - b);
}

int kvps_sum_sources(int dtype, void *dst, const void *const *srcs, int nsrc, int64_t n) {
    CHECK(dtype >= 0 && dtype < KVPS_NDTYPES, KVPS_ERR_DTYPE);
    CHECK_ARRAY(dst, n);
    CHECK(srcs != NULL && nsrc >= 1, KVPS_ERR_ARG);
    for (int k = 0; k < nsrc; k++)
        CHECK_ARRAY(srcs[k], n);
    src_job j = {isa()->sources[dtype], dst, srcs, nsrc};
    if (dtype == KVPS_F32 && n * 4 >= KVPS_STREAM_BYTES && isa()->sources_stream_f32)
        j.fn = isa()->sources_stream_f32;
    if (n)
        kvps_parallel_for(src_range, &j, n, KVPS_ALIGN);
    return KVPS_OK;
}

typedef struct {
    kvps_scale_fn scale;
    kvps_axpy_fn axpy;
    void *y;
    const void *x;
    double alpha;
    int esz;
} scale_job;
static void scale_range(const void *a, int64_t b, int64_t e) {
    const scale_job *j = (const scale_job *)a;
    if (j->scale)
        j->scale(at(j->y, b, j->esz), j->alpha, e - b);
    else
        j->axpy(at(j->y, b, j->esz), j->alpha, at(j->x, b, j->esz), e - b);
}

int kvps_scale(int dtype, void *x, double alpha, int64_t n) {
    CHECK(is_float(dtype), KVPS_ERR_DTYPE);
    CHECK_ARRAY(x, n);
    scale_job j = {isa()->scale[dtype], NULL, x, NULL, alpha, dtype_sizes[dtype]};
    if (n)
        kvps_parallel_for(scale_range, &j, n, KVPS_ALIGN);
    return KVPS_OK;
}

int kvps_axpy(int dtype, void *y, double alpha, const void *x, int64_t n) {
    CHECK(is_float(dtype), KVPS_ERR_DTYPE);
    CHECK_ARRAY(y, n);
    CHECK_ARRAY(x, n);
    scale_job j = {NULL, isa()->axpy[dtype], y, x, alpha, dtype_sizes[dtype]};
    if (n)
        kvps_parallel_for(scale_range, &j, n, KVPS_ALIGN);
    return KVPS_OK;
}

typedef struct {
    kvps_cast_fn fn;
    const void *s;
    void *d;
    int ssz, dsz;
} cast_job;
static void cast_range(const void *a, int64_t b, int64_t e) {
    const cast_job *j = (const cast_job *)a;
    j->fn(at(j->s, b, j->ssz), at(j->d, b, j->dsz), e - b);
}

int kvps_cast(int src_dtype, const void *src, int dst_dtype, void *dst, int64_t n) {
    CHECK_ARRAY(src, n);
    CHECK_ARRAY(dst, n);
    const struct kvps_isa *t = isa();
    cast_job j = {NULL, src, dst, 0, 0};
    if (src_dtype == KVPS_F32 && (dst_dtype == KVPS_F16 || dst_dtype == KVPS_BF16))
        j.fn = t->from_f32[dst_dtype];
    else if (dst_dtype == KVPS_F32 && (src_dtype == KVPS_F16 || src_dtype == KVPS_BF16))
        j.fn = t->to_f32[src_dtype];
    else
        return KVPS_ERR_DTYPE;
    j.ssz = dtype_sizes[src_dtype];
    j.dsz = dtype_sizes[dst_dtype];
    if (n)
        kvps_parallel_for(cast_range, &j, n, KVPS_ALIGN);
    return KVPS_OK;
}

/* ---- copies ------------------------------------------------------------------------------ */
int kvps_copy(void *dst, const void *src, int64_t nbytes) {
    CHECK_ARRAY(dst, nbytes);
    CHECK_ARRAY(src, nbytes);
    char *d = (char *)dst;
    const char *s = (const char *)src;
    CHECK(d + nbytes <= s || s + nbytes <= d || nbytes == 0, KVPS_ERR_ARG);
#ifdef KVPS_X86
    if (nbytes >= KVPS_STREAM_BYTES) {
        size_t head = (16 - ((uintptr_t)d & 15)) & 15; /* streaming stores need 16-byte aligned dst */
        memcpy(d, s, head);
        d += head, s += head, nbytes -= (int64_t)head;
        for (; nbytes >= 64; nbytes -= 64, d += 64, s += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)d, a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c);
            _mm_stream_si128((__m128i *)(d + 48), e);
        }
        _mm_sfence(); /* the streamed bytes are visible before whatever the caller does next */
    }
#endif
    memcpy(d, s, (size_t)nbytes);
    return KVPS_OK;
}

/* ---- optimizers -------------------------------------------------------------------------- */
static int grad_kind(int dtype) {
    switch (dtype) {
    case KVPS_F32: return KVPS_G_F32;
    case KVPS_F16: return KVPS_G_F16;
    case KVPS_BF16: return KVPS_G_BF16;
    default: return -1;
    }
}

typedef struct {
    kvps_opt_fn fn;
    const kvps_opt *p;
    float *w;
    const void *g;
    float *s1, *s2;
    int gsz;
} opt_job;
static void opt_range(const void *a, int64_t b, int64_t e) {
    const opt_job *j = (const opt_job *)a;
    j->fn(j->p, (float *)at(j->w, b, 4), at(j->g, b, j->gsz), j->s1 ? (float *)at(j->s1, b, 4) : NULL,
          j->s2 ? (float *)at(j->s2, b, 4) : NULL, e - b);
}

static int run_opt(int kind, int grad_dtype, kvps_opt *p, float *w, const void *g, float *s1, float *s2,
                   int64_t n) {
    int gk = grad_kind(grad_dtype);
    CHECK(gk >= 0, KVPS_ERR_DTYPE);
    CHECK_ARRAY(w, n);
    CHECK_ARRAY(g, n);
    kvps_opt_derive(p);
    opt_job j = {isa()->opt[kind][gk], p, w, g, s1, s2, dtype_sizes[grad_dtype]};
    if (n)
        kvps_parallel_for(opt_range, &j, n, KVPS_ALIGN);
    return KVPS_OK;
}

int kvps_sgd_update(int grad_dtype, float *weight, const void *grad, float *mom, int64_t n, float lr,
                    float momentum, float wd, float rescale_grad, float clip_gradient, int nesterov) {
    kvps_opt p = kvps_opt_make(lr, wd, rescale_grad, clip_gradient);
    p.momentum = momentum;
    if (!mom)
        return run_opt(KVPS_OPT_SGD, grad_dtype, &p, weight, grad, NULL, NULL, n);
    return run_opt(nesterov ? KVPS_OPT_NAG : KVPS_OPT_SGD_MOM, grad_dtype, &p, weight, grad, mom, NULL, n);
}

int kvps_adam_update(int grad_dtype, float *weight, const void *grad, float *mean, float *var, int64_t n,
                     float lr, float beta1, float beta2, float epsilon, float wd, float rescale_grad,
                     float clip_gradient) {
    CHECK_ARRAY(mean, n);
    CHECK_ARRAY(var, n);
    kvps_opt p = kvps_opt_make(lr, wd, rescale_grad, clip_gradient);
    p.beta1 = beta1;
    p.beta2 = beta2;
    p.eps = epsilon;
    return run_opt(KVPS_OPT_ADAM, grad_dtype, &p, weight, grad, mean, var, n);
}

int kvps_adamw_update(int grad_dtype, float *weight, const void *grad, float *mean, float *var, int64_t n,
                      float lr, float beta1, float beta2, float epsilon, float wd, float rescale_grad,
                      float clip_gradient, float eta) {
    CHECK_ARRAY(mean, n);
    CHECK_ARRAY(var, n);
    CHECK(grad_kind(grad_dtype) >= 0, KVPS_ERR_DTYPE);
    /* MXNet's contrib adamw skips the whole update when the loss scale overflowed */
    if (!isfinite(rescale_grad) || rescale_grad == 0.0f)
        return KVPS_OK;
    kvps_opt p = kvps_opt_make(lr, wd, rescale_grad, clip_gradient);
    p.beta1 = beta1;
    p.beta2 = beta2;
    p.eps = epsilon;
    p.eta = eta;
    return run_opt(KVPS_OPT_ADAMW, grad_dtype, &p, weight, grad, mean, var, n);
}

int kvps_adagrad_update(int grad_dtype, float *weight, const void *grad, float *history, int64_t n, float lr,
                        float epsilon, float wd, float rescale_grad, float clip_gradient) {
    CHECK_ARRAY(history, n);
    kvps_opt p = kvps_opt_make(lr, wd, rescale_grad, clip_gradient);
    p.eps = epsilon;
    return run_opt(KVPS_OPT_ADAGRAD, grad_dtype, &p, weight, grad, history, NULL, n);
}

int kvps_rmsprop_update(int grad_dtype, float *weight, const void *grad, float *state_n, int64_t n, float lr,
                        float gamma1, float epsilon, float wd, float rescale_grad, float clip_gradient,
                        float clip_weights) {
    CHECK_ARRAY(state_n, n);
    kvps_opt p = kvps_opt_make(lr, wd, rescale_grad, clip_gradient);
    p.gamma1 = gamma1;
    p.eps = epsilon;
    if (clip_weights > 0.0f)
        p.clip_weights = clip_weights;
    return run_opt(KVPS_OPT_RMSPROP, grad_dtype, &p, weight, grad, state_n, NULL, n);
}

/* ---- compression ------------------------------------------------------------------------ */
typedef struct {
    kvps_compress_fn compress;
    kvps_decompress_fn decompress;
    const float *g;
    float *r;
    uint32_t *words;
    float t;
    int per_word;
} pack_job;
static void pack_range(const void *a, int64_t b, int64_t e) {
    const pack_job *j = (const pack_job *)a;
    uint32_t *words = (uint32_t *)at(j->words, b / j->per_word, 4);
    if (j->compress)
        j->compress((const float *)at(j->g, b, 4), (float *)at(j->r, b, 4), words, j->t, e - b);
    else
        j->decompress(words, j->t, (float *)at(j->r, b, 4), e - b);
}

int kvps_compress_2bit(const float *grad, float *residual, uint32_t *out, int64_t n, float threshold) {
    CHECK_ARRAY(grad, n);
    CHECK_ARRAY(residual, n);
    CHECK_ARRAY(out, n);
    pack_job j = {isa()->compress2, NULL, grad, residual, out, threshold, 16};
    if (n)
        kvps_parallel_for(pack_range, &j, n, KVPS_ALIGN);
    return KVPS_OK;
}

int kvps_decompress_2bit_add(const uint32_t *packed, float threshold, float *dst, int64_t n) {
    CHECK_ARRAY(packed, n);
    CHECK_ARRAY(dst, n);
    pack_job j = {NULL, isa()->decompress2, NULL, dst, (uint32_t *)packed, threshold, 16};
    if (n)
        kvps_parallel_for(pack_range, &j, n, KVPS_ALIGN);
    return KVPS_OK;
}

int kvps_compress_1bit(const float *grad, float *residual, uint32_t *out, int64_t n, float threshold) {
    CHECK_ARRAY(grad, n);
    CHECK_ARRAY(residual, n);
    CHECK_ARRAY(out, n);
    pack_job j = {isa()->compress1, NULL, grad, residual, out, threshold, 32};
    if (n)
        kvps_parallel_for(pack_range, &j, n, KVPS_ALIGN);
    return KVPS_OK;
}

int kvps_decompress_1bit_add(const uint32_t *packed, float *dst, int64_t n) {
    CHECK_ARRAY(packed, n);
    CHECK_ARRAY(dst, n);
    pack_job j = {NULL, isa()->decompress1, NULL, dst, (uint32_t *)packed, 0.0f, 32};
    if (n)
        kvps_parallel_for(pack_range, &j, n, KVPS_ALIGN);
    return KVPS_OK;
}

int kvps_compress_topk(const float *grad, float *residual, int64_t n, int64_t k, int index_dtype,
                       void *indices, float *values) {
    CHECK(index_dtype == KVPS_I32 || index_dtype == KVPS_I64, KVPS_ERR_DTYPE);
    CHECK(index_dtype == KVPS_I64 || n <= INT32_MAX, KVPS_ERR_ARG);
    CHECK(k >= 0, KVPS_ERR_ARG);
    int64_t kk = k < n ? k : n;
    CHECK_ARRAY(grad, n);
    CHECK_ARRAY(residual, n);
    CHECK_ARRAY(indices, kk);
    CHECK_ARRAY(values, kk);
    int rc = kvps_sum_into(KVPS_F32, residual, grad, n);
    if (rc != KVPS_OK)
        return rc;
    return kvps_topk_select(residual, n, kk, index_dtype, indices, values);
}

int kvps_decompress_topk_add(int index_dtype, const void *indices, const float *values, int64_t k, float *dst,
                             int64_t n) {
    CHECK(index_dtype == KVPS_I32 || index_dtype == KVPS_I64, KVPS_ERR_DTYPE);
    CHECK_ARRAY(indices, k);
    CHECK_ARRAY(values, k);
    CHECK_ARRAY(dst, n);
    int esz = dtype_sizes[index_dtype];
    for (int64_t j = 0; j < k; j++) { /* all or nothing: check every index first */
        int64_t i;
        if (index_dtype == KVPS_I32) {
            int32_t x;
            memcpy(&x, at(indices, j, esz), 4);
            i = x;
        } else {
            memcpy(&i, at(indices, j, esz), 8);
        }
        CHECK(i >= 0 && i < n, KVPS_ERR_INDEX);
    }
    for (int64_t j = 0; j < k; j++) {
        int64_t i;
        float v, d;
        if (index_dtype == KVPS_I32) {
            int32_t x;
            memcpy(&x, at(indices, j, esz), 4);
            i = x;
        } else {
            memcpy(&i, at(indices, j, esz), 8);
        }
        memcpy(&v, at(values, j, 4), 4);
        memcpy(&d, at(dst, i, 4), 4);
        d += v;
        memcpy(at(dst, i, 4), &d, 4);
    }
    return KVPS_OK;
}
