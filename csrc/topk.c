/*
 * topk.c: selecting the k entries of largest magnitude, for top-k sparsification.
 *
 * The magnitude key of a float32 is its bit pattern without the sign bit: for non-NaN
 * values it orders like |x|, and NaN keys sort above infinity (so a NaN residual is
 * always sent, never kept forever). A three-level radix select (11, 10 and 10 bits)
 * finds the k-th largest key in three passes over the data: a histogram of the top
 * bits of every key, then the keys of the one bucket that holds the k-th, refined twice.
 * A last pass emits, in index order, every entry above that key and the first entries
 * equal to it until k are out: ties go to the lower index, as in reference.py.
 */
#include <stdlib.h>
#include <string.h>

#include "kvps_isa.h"

static inline uint32_t key_at(const float *r, int64_t i) {
    uint32_t u;
    memcpy(&u, (const char *)r + 4 * i, 4);
    return u & 0x7fffffffu;
}

/* Bucket holding the need-th largest of the counted keys; *need becomes the rank
 * inside that bucket. */
static int find_bucket(const int64_t *hist, int nb, int64_t *need) {
    int64_t above = 0;
    int b;
    for (b = nb - 1; b > 0; b--) {
        if (above + hist[b] >= *need)
            break;
        above += hist[b];
    }
    *need -= above;
    return b;
}

static void emit(void *indices, int index_dtype, float *values, int64_t j, int64_t i, float *r) {
    float v;
    const float zero = 0.0f;
    memcpy(&v, (char *)r + 4 * i, 4);
    memcpy((char *)values + 4 * j, &v, 4);
    memcpy((char *)r + 4 * i, &zero, 4);
    if (index_dtype == KVPS_I32) {
        int32_t x = (int32_t)i;
        memcpy((char *)indices + 4 * j, &x, 4);
    } else {
        int64_t x = i;
        memcpy((char *)indices + 8 * j, &x, 8);
    }
}

int kvps_topk_select(float *r, int64_t n, int64_t k, int index_dtype, void *indices, float *values) {
    if (k > n)
        k = n;
    if (k <= 0)
        return KVPS_OK;
    if (k == n) {
        for (int64_t i = 0; i < n; i++)
            emit(indices, index_dtype, values, i, i, r);
        return KVPS_OK;
    }

    int64_t hist[2048];
    int64_t need = k;
    memset(hist, 0, sizeof hist);
    for (int64_t i = 0; i < n; i++)
        hist[key_at(r, i) >> 20]++;
    uint32_t b1 = (uint32_t)find_bucket(hist, 2048, &need);

    int64_t count = hist[b1];
    uint32_t *cand = (uint32_t *)malloc((size_t)count * sizeof *cand);
    if (!cand)
        return KVPS_ERR_NOMEM;
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t key = key_at(r, i);
        if ((key >> 20) == b1)
            cand[m++] = key;
    }

    memset(hist, 0, 1024 * sizeof hist[0]);
    for (int64_t c = 0; c < m; c++)
        hist[(cand[c] >> 10) & 1023u]++;
    uint32_t b2 = (uint32_t)find_bucket(hist, 1024, &need);
    int64_t m2 = 0;
    for (int64_t c = 0; c < m; c++)
        if (((cand[c] >> 10) & 1023u) == b2)
            cand[m2++] = cand[c];

    memset(hist, 0, 1024 * sizeof hist[0]);
    for (int64_t c = 0; c < m2; c++)
        hist[cand[c] & 1023u]++;
    uint32_t b3 = (uint32_t)find_bucket(hist, 1024, &need);
    free(cand);

    uint32_t kth = (b1 << 20) | (b2 << 10) | b3;
    int64_t j = 0, ties = need; /* entries equal to kth still to take */
    for (int64_t i = 0; i < n && j < k; i++) {
        uint32_t key = key_at(r, i);
        if (key > kth || (key == kth && ties > 0)) {
            if (key == kth)
                ties--;
            emit(indices, index_dtype, values, j++, i, r);
        }
    }
    return KVPS_OK;
}
