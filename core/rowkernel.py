"""A small C++ kernel for the row-invariant attention (core/attention.py).

Each query row attends to its own list of keys: a leading run of the cache
(positions 0..prefix-1) followed by a few more positions (a tree node's
ancestors and itself). The kernel computes every (row, head) with the same
loops in the same order whatever the other rows are: the dot products with
eight fixed partial sums, the softmax and the weighted sum of values in key
order, in float32 for bf16 tensors (widened on load, rounded to bf16 once
at the end). So a row's result depends only on its query and its key sequence,
and a tree node gets bit for bit what a one-token step over the same keys
gets. It replaces about a dozen small torch operations per row and layer
with one call per layer.

On CPUs with AMX tiles, bf16 attention with a head size of 64 or 128 scores
keys on the tile unit: a tile product gives 16 keys' scores against up to 16
query vectors (a few rows' heads that share a key/value head), each score the
float32 sum of the exact products of its own key and query, whatever else
shares the tile, so any key scores the same in the cache and among a row's
extra keys. The softmax stays each query's own, in float32. The weighted sum
of values runs on the tile unit too, as torch's own bf16 attention computes
it: the weights rounded to bf16 once, 32 positions of a query's key sequence
per tile product (positions 0, 32, 64, ... whatever keys the row sees there),
summed in float32, then divided by the sum of the float32 weights (sixteen
partial sums by position, an order fixed by the number of keys). A query's
sums so take the same steps whatever shares its tiles. On the 2-core
reference Xeon, 9 heads over 3, a layer: 300 keys, 1 / 8 / 16 rows in
13 / 35 / 60 us (16 / 54 / 100 with the sums in float32 vectors, key by
key); 600 keys, 8 rows in 53 us (93).

On CPUs with AVX512-BF16 but no AMX (AMD's since Zen 4), the same products
run as vdpbf16ps chains (`Dots`): each score and each query's sums one
chain over its element pairs in order, in the tiles' layout, so a query's
result again does not depend on what shares its product. On the 2-core
AVX-512 EPYC, 9 heads over 3, a step's 30 layers: 300 keys, 1 / 4 / 8 / 16
rows in 0.43 / 0.69 / 0.99 / 1.84 ms (0.67 / 1.49 / 2.95 / 5.74 with the
float32 vectors); 600 keys, 8 rows in 1.72 ms (6.94).

The source is compiled once against the installed torch (core/native.py)
and registered as a torch operator; its (row, head) pairs are shared out
among torch's threads, each pair computed whole by one thread. Where no
compiler is found, or the build fails, the torch implementation in
core/attention.py is used."""

from __future__ import annotations

import functools
import os
import threading

import torch

from core import native

SOURCE = native.TILES + r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

template <typename T>
static inline T dot(const T* a, const T* b, int64_t n) {
    // eight fixed partial sums, combined in a fixed order: the same result
    // for the same inputs, whatever else is being computed
    T p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t d = 0;
    for (; d + 8 <= n; d += 8)
        for (int l = 0; l < 8; ++l) p[l] += a[d + l] * b[d + l];
    for (; d < n; ++d) p[0] += a[d] * b[d];
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

// Four keys' dot() at once, each with exactly dot()'s operations in dot()'s
// order (the same bits: the eight lanes are its eight partial sums);
// interleaving four independent chains of additions hides their latency,
// which bounds a lone dot product.
template <typename T>
struct Vector {
    typedef T lanes __attribute__((vector_size(8 * sizeof(T))));
};
template <typename T>
using Lanes = typename Vector<T>::lanes;

template <typename T>
static inline Lanes<T> load8(const T* p) {
    Lanes<T> v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}

template <typename T>
static inline T combine(const Lanes<T>& p) {
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

template <typename T>
static inline void dot4(const T* a, const T* b0, const T* b1, const T* b2, const T* b3, int64_t n, T* out) {
    Lanes<T> p0 = {};
    Lanes<T> p1 = {};
    Lanes<T> p2 = {};
    Lanes<T> p3 = {};
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) {
        const Lanes<T> x = load8<T>(a + d);
        p0 += x * load8<T>(b0 + d);
        p1 += x * load8<T>(b1 + d);
        p2 += x * load8<T>(b2 + d);
        p3 += x * load8<T>(b3 + d);
    }
    for (; d < n; ++d) {
        p0[0] += a[d] * b0[d];
        p1[0] += a[d] * b1[d];
        p2[0] += a[d] * b2[d];
        p3[0] += a[d] * b3[d];
    }
    out[0] = combine<T>(p0), out[1] = combine<T>(p1), out[2] = combine<T>(p2), out[3] = combine<T>(p3);
}

// Storage types: float and double are read as they are; bf16 (the upper
// 16 bits of a float) is widened to float exactly on load, and the whole
// computation runs in float.
struct bf16 {
    uint16_t bits;
};
template <typename S>
struct Compute {
    typedef S type;
};
template <>
struct Compute<bf16> {
    typedef float type;
};

// n stored values as the compute type: the values themselves for float and
// double, else widened into `out`.
template <typename S, typename T = typename Compute<S>::type>
static inline const T* widened(const S* p, int64_t n, T* out) {
    if constexpr (std::is_same<S, T>::value) {
        return p;
    } else {
        typedef uint16_t halves __attribute__((vector_size(8 * sizeof(uint16_t))));
        typedef uint32_t words __attribute__((vector_size(8 * sizeof(uint32_t))));
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {  // eight at a time
            halves h;
            std::memcpy(&h, p + i, sizeof(h));
            const words w = __builtin_convertvector(h, words) << 16;
            std::memcpy(out + i, &w, sizeof(w));
        }
        for (; i < n; ++i) {
            const uint32_t bits = uint32_t(p[i].bits) << 16;
            std::memcpy(out + i, &bits, sizeof(T));
        }
        return out;
    }
}

// exp(x[j] - shift) in place. Doubles use std::exp. Floats use a fixed
// polynomial eight lanes at a time (Cephes' expf: about 1 ulp; a tail is
// padded to eight lanes), the same operations for every element wherever it
// sits, and several times faster than a call per element.
static inline void exp_shifted(double* x, int64_t n, double shift) {
    for (int64_t j = 0; j < n; ++j) x[j] = std::exp(x[j] - shift);
}

static inline Lanes<float> exp8(Lanes<float> x) {
    typedef int32_t ints __attribute__((vector_size(8 * sizeof(int32_t))));
    const Lanes<float> zero = {}, floor = zero - 87.0f;
    const ints low = x < floor;  // exp underflows there: clamp, then zero
    x = low ? floor : x;
    const Lanes<float> rounder = {12582912.0f, 12582912.0f, 12582912.0f, 12582912.0f,
                                  12582912.0f, 12582912.0f, 12582912.0f, 12582912.0f};  // 1.5 * 2^23
    Lanes<float> n = x * 1.44269504088896341f + rounder;
    n = n - rounder;  // x / ln 2 rounded to the nearest integer
    const Lanes<float> r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    Lanes<float> p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const ints power = (__builtin_convertvector(n, ints) + 127) << 23;
    Lanes<float> scale;
    std::memcpy(&scale, &power, sizeof(scale));
    const Lanes<float> result = p * scale;
    return low ? zero : result;
}

static inline void exp_shifted(float* x, int64_t n, float shift) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        Lanes<float> v;
        std::memcpy(&v, x + j, sizeof(v));
        v = exp8(v - shift);
        std::memcpy(x + j, &v, sizeof(v));
    }
    if (j < n) {
        Lanes<float> v = {};
        std::memcpy(&v, x + j, (n - j) * sizeof(float));
        v = exp8(v - shift);
        std::memcpy(x + j, &v, (n - j) * sizeof(float));
    }
}

static constexpr int64_t MAX_GROUP = 8;  // query heads computed together over one key/value head

// The row's keys (or values) in key order: pointers into the cache, or for
// bf16 rows widened once into `wide` (count x dim).
template <typename S, typename T = typename Compute<S>::type>
static void gather(const S* base, int64_t kv_pos, int64_t dim, int64_t lead, const int64_t* extra, int64_t count,
                   T* wide, const T** out) {
    for (int64_t j = 0; j < count; ++j)
        out[j] = widened<S>(base + (j < lead ? j : extra[j - lead]) * kv_pos, dim, wide + j * dim);
}

// One row and the g query heads sharing a key/value head: softmax(q k^T *
// scale) v over the row's keys, in key order, for each of the g heads.
// Every key and value is read (and widened) once for the g heads; each
// head's result gets exactly the operations a lone head would: dot products
// in eight fixed partial sums, and each output element the sum over keys in
// order of weight times value, held in registers 32 elements at a time.
template <typename S, typename T = typename Compute<S>::type>
static void group_heads(const S* qs, int64_t q_head, int64_t g, const S* kb, const S* vb, int64_t kv_pos, int64_t dim,
                        int64_t lead, const int64_t* extra, int64_t count, T scale, T* scores, T* wide,
                        const T** keys, const T** values, T* o) {
    const T* qv[MAX_GROUP];
    T best[MAX_GROUP];
    for (int64_t h = 0; h < g; ++h) {
        qv[h] = widened<S>(qs + h * q_head, dim, wide + h * dim);
        best[h] = -INFINITY;
    }
    T* rows_wide = wide + MAX_GROUP * dim;  // bf16: the widened keys, then the widened values
    gather<S>(kb, kv_pos, dim, lead, extra, count, rows_wide, keys);
    int64_t j = 0;
    for (; j + 4 <= count; j += 4) {
        for (int64_t h = 0; h < g; ++h) {
            T s[4];
            dot4(qv[h], keys[j], keys[j + 1], keys[j + 2], keys[j + 3], dim, s);
            T* row = scores + h * count;
            for (int i = 0; i < 4; ++i) {
                row[j + i] = s[i] * scale;
                if (row[j + i] > best[h]) best[h] = row[j + i];
            }
        }
    }
    for (; j < count; ++j) {
        for (int64_t h = 0; h < g; ++h) {
            const T s = dot(qv[h], keys[j], dim) * scale;
            scores[h * count + j] = s;
            if (s > best[h]) best[h] = s;
        }
    }
    gather<S>(vb, kv_pos, dim, lead, extra, count, rows_wide + count * dim, values);
    for (int64_t h = 0; h < g; ++h) {
        T* row = scores + h * count;
        T total = 0;
        exp_shifted(row, count, best[h]);
        for (int64_t j = 0; j < count; ++j) total += row[j];
        int64_t d = 0;
        for (; d + 32 <= dim; d += 32) {
            Lanes<T> a0 = {}, a1 = {}, a2 = {}, a3 = {};
            for (int64_t j = 0; j < count; ++j) {
                const T* vv = values[j] + d;
                const T w = row[j];
                a0 = a0 + w * load8<T>(vv);
                a1 = a1 + w * load8<T>(vv + 8);
                a2 = a2 + w * load8<T>(vv + 16);
                a3 = a3 + w * load8<T>(vv + 24);
            }
            T* out = o + h * dim + d;
            for (int l = 0; l < 8; ++l) {
                out[l] = a0[l] / total;
                out[8 + l] = a1[l] / total;
                out[16 + l] = a2[l] / total;
                out[24 + l] = a3[l] / total;
            }
        }
        for (; d < dim; ++d) {
            T a = 0;
            for (int64_t j = 0; j < count; ++j) a += row[j] * values[j][d];
            o[h * dim + d] = a / total;
        }
    }
}

// Every (row, key/value head) is computed whole by one thread with the same
// loops, so the result depends neither on the other rows nor on the thread
// count. `out` (1, T, H, D) is in the compute type.
template <typename S, typename T = typename Compute<S>::type>
static void rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* prefix,
                 const int64_t* offsets, const int64_t* extra, double scale, at::Tensor& out) {
    const int64_t n_rows = q.size(2), heads = q.size(1), kv_heads = k.size(1), dim = q.size(3);
    const int64_t q_row = q.stride(2), q_head = q.stride(1), kv_head = k.stride(1), kv_pos = k.stride(2);
    const int64_t group = heads / kv_heads;
    // a group wider than MAX_GROUP is computed MAX_GROUP heads (or fewer) at a time
    const int64_t parts = (group + MAX_GROUP - 1) / MAX_GROUP, width = (group + parts - 1) / parts;
    const S* qp = static_cast<const S*>(q.data_ptr());
    const S* kp = static_cast<const S*>(k.data_ptr());
    const S* vp = static_cast<const S*>(v.data_ptr());
    T* op = out.data_ptr<T>();
    int64_t longest = 1;
    for (int64_t r = 0; r < n_rows; ++r)
        longest = std::max(longest, prefix[r] + offsets[r + 1] - offsets[r]);
    const bool widen = !std::is_same<S, T>::value;
    at::parallel_for(0, n_rows * kv_heads * parts, 1, [&](int64_t begin, int64_t end) {
        std::vector<T> scores(width * longest), wide((MAX_GROUP + (widen ? 2 * longest : 0)) * dim);
        std::vector<const T*> keys(longest), values(longest);
        for (int64_t item = begin; item < end; ++item) {
            const int64_t r = item / (kv_heads * parts), kv = item % (kv_heads * parts) / parts, part = item % parts;
            const int64_t h = kv * group + part * width, g = std::min(width, (kv + 1) * group - h);
            const int64_t lead = prefix[r], first = offsets[r], count = lead + offsets[r + 1] - first;
            group_heads<S>(qp + r * q_row + h * q_head, q_head, g, kp + kv * kv_head, vp + kv * kv_head, kv_pos, dim,
                           lead, extra + first, count, (T)scale, scores.data(), wide.data(), keys.data(),
                           values.data(), op + (r * heads + h) * dim);
        }
    });
}

// AMX (Intel's tile unit, where the compiler targets it) for bf16: a tile product gives the scores
// of 16 keys against up to 16 query vectors (a few rows' heads that share a key/value head), each
// score the float32 sum of the exact products of bf16 elements, computed for its own key and
// query whatever else shares the tile. The softmax is then each query's own, in float32; the
// weighted sum of values is a tile product per 32 positions of a query's key sequence
// (weighted_sums). Any key scores the same in the cache or among a row's extra keys, and a
// query's sums take the same steps whatever shares its tiles, so a tree node still gets bit for
// bit what a one-token step gets.
#ifdef KESTREL_DOTS
static constexpr int64_t TILE = 16;  // keys per tile product, and query vectors per item

// The tile products below run on one of two units with the same interface:
// - Amx: the tile unit. The queries wait in tiles 2..5, the weighted sums accumulate in tiles 0..3.
// - Dots: vdpbf16ps (AVX512-BF16 without AMX, or refused the tile state). Each element of a
//   product is one chain of vdpbf16ps over its pairs in order (a pair's two exact products added
//   to the lane), so a key's score for a query and a query's sums take the same operations
//   whatever else shares the product, as on the tile unit (whose bits may differ from these).
#ifdef KESTREL_TILES
struct Amx {
    static constexpr bool unit = true;
    template <int CHUNKS>
    void queries(const uint32_t (*b)[16][16]) {  // chunk t, pair row p, column i: tiles 2 .. 2 + CHUNKS
        _tile_loadd(2, b[0], 64);
        _tile_loadd(3, b[1], 64);
        if constexpr (CHUNKS > 2) {
            _tile_loadd(4, b[2], 64);
            _tile_loadd(5, b[3], 64);
        }
    }
    template <int CHUNKS>
    void score(const uint16_t* keys, int64_t stride, float* c);  // 16 keys `stride` elements apart -> c[key][query]
    void clear_sums() {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    void weigh(const uint16_t* a, int64_t a_stride, const uint16_t* b, int64_t, int64_t);
    void sums(int t, float* c) {  // C tile t (queries x 16 columns) -> c
        switch (t) {
            case 0: _tile_stored(0, c, 64); break;
            case 1: _tile_stored(1, c, 64); break;
            case 2: _tile_stored(2, c, 64); break;
            default: _tile_stored(3, c, 64); break;
        }
    }
};

template <int CHUNKS>
inline void Amx::score(const uint16_t* keys, int64_t stride, float* c) {  // c[key][query]
    const int64_t stride_bytes = stride * 2;
    _tile_zero(0);
    _tile_loadd(1, keys, stride_bytes);
    _tile_dpbf16ps(0, 1, 2);
    _tile_loadd(1, keys + 32, stride_bytes);
    _tile_dpbf16ps(0, 1, 3);
    if constexpr (CHUNKS > 2) {
        _tile_loadd(1, keys + 64, stride_bytes);
        _tile_dpbf16ps(0, 1, 4);
        _tile_loadd(1, keys + 96, stride_bytes);
        _tile_dpbf16ps(0, 1, 5);
    }
    _tile_stored(0, c, 64);
}
#endif

struct Dots {
    static constexpr bool unit = false;
    const uint32_t (*b)[16][16] = nullptr;
    alignas(64) float acc[4][TILE * 16];  // the weighted sums: C tile t, query row i, 16 columns
    template <int CHUNKS>
    void queries(const uint32_t (*chunks)[16][16]) { b = chunks; }
    template <int CHUNKS>
    void score(const uint16_t* keys, int64_t stride, float* c) {  // c[key][query]: a chain per key, 16 keys side by side
        __m512 lanes[TILE];
        for (int m = 0; m < TILE; ++m) lanes[m] = _mm512_setzero_ps();
        for (int t = 0; t < CHUNKS; ++t)
            for (int p = 0; p < 16; ++p) {
                const __m512bh pairs = (__m512bh)_mm512_load_si512((const void*)b[t][p]);
                for (int m = 0; m < TILE; ++m) {
                    const int32_t* key = (const int32_t*)(keys + m * stride + 32 * t);
                    lanes[m] = _mm512_dpbf16_ps(lanes[m], (__m512bh)_mm512_set1_epi32(key[p]), pairs);
                }
            }
        for (int m = 0; m < TILE; ++m) _mm512_store_ps(c + 16 * m, lanes[m]);
    }
    void clear_sums() { std::memset(acc, 0, sizeof acc); }
    void weigh(const uint16_t* a, int64_t a_stride, const uint16_t* v, int64_t first, int64_t end) {  // rows [first, end) of A
        for (int64_t i = first; i < end; ++i) {
            const int32_t* weights = (const int32_t*)((const char*)a + i * a_stride);
            __m512 c0 = _mm512_load_ps(acc[0] + 16 * i), c1 = _mm512_load_ps(acc[1] + 16 * i);
            __m512 c2 = _mm512_load_ps(acc[2] + 16 * i), c3 = _mm512_load_ps(acc[3] + 16 * i);
            for (int p = 0; p < 16; ++p) {
                const __m512bh w = (__m512bh)_mm512_set1_epi32(weights[p]);
                c0 = _mm512_dpbf16_ps(c0, w, (__m512bh)_mm512_load_si512((const void*)(v + 32 * p)));
                c1 = _mm512_dpbf16_ps(c1, w, (__m512bh)_mm512_load_si512((const void*)(v + 512 + 32 * p)));
                c2 = _mm512_dpbf16_ps(c2, w, (__m512bh)_mm512_load_si512((const void*)(v + 1024 + 32 * p)));
                c3 = _mm512_dpbf16_ps(c3, w, (__m512bh)_mm512_load_si512((const void*)(v + 1536 + 32 * p)));
            }
            _mm512_store_ps(acc[0] + 16 * i, c0);
            _mm512_store_ps(acc[1] + 16 * i, c1);
            _mm512_store_ps(acc[2] + 16 * i, c2);
            _mm512_store_ps(acc[3] + 16 * i, c3);
        }
    }
    void sums(int t, float* c) { std::memcpy(c, acc[t], sizeof acc[t]); }
};

// Values as four B tiles for the weighted sum: 32 positions of the row's key sequence (position p
// is row p of `value_rows`, a null row a zero), 64 columns of the head dimension, in the tile
// unit's pair layout: tile t, row p holds (position 2p, position 2p + 1) for columns 16t .. 16t + 15.
static inline void pair_values(const uint16_t* const* value_rows, uint16_t* b) {
    alignas(64) static const uint16_t order[64] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                   8,  40, 9,  41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47,
                                                   16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                   24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i low = _mm512_load_si512((const void*)order), high = _mm512_load_si512((const void*)(order + 32));
    for (int p = 0; p < 16; ++p) {
        const uint16_t* even = value_rows[2 * p];
        const uint16_t* odd = value_rows[2 * p + 1];
        for (int half = 0; half < 2; ++half) {
            const __m512i a = even ? _mm512_loadu_si512((const void*)(even + 32 * half)) : _mm512_setzero_si512();
            const __m512i o = odd ? _mm512_loadu_si512((const void*)(odd + 32 * half)) : _mm512_setzero_si512();
            _mm512_store_si512(b + (2 * half) * 512 + 32 * p, _mm512_permutex2var_epi16(a, low, o));
            _mm512_store_si512(b + (2 * half + 1) * 512 + 32 * p, _mm512_permutex2var_epi16(a, high, o));
        }
    }
}

// C tiles 0..3 += A tile 4 (weights) times the value tiles b[0..3], B through tile 5
#ifdef KESTREL_TILES
inline void Amx::weigh(const uint16_t* a, int64_t a_stride, const uint16_t* b, int64_t, int64_t) {
    _tile_loadd(4, a, a_stride);
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, b + 512, 64);
    _tile_dpbf16ps(1, 4, 5);
    _tile_loadd(5, b + 1024, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(5, b + 1536, 64);
    _tile_dpbf16ps(3, 4, 5);
}
#endif

// The weighted sums of values for the item's n queries (rows r0..r1, g queries each), on the tile
// unit: each query's softmax weights rounded to bf16 once, times the values, 32 positions of its
// key sequence per tile product, positions 0, 32, 64, ... whatever the row's keys are, so a
// query's float32 sums take the same steps in the same order as the same keys alone would. A
// chunk of positions that every row takes from the cache is one product for all n queries; a
// chunk where a row's own extra keys begin is a product for that row's queries alone, the others'
// weights zero (adding exact zeros). Then each sum is divided by the sum of the float32 weights
// (sixteen partial sums by position, a fixed order). `out` points at the item's first head of row
// 0, rows `row_stride` apart.
template <int CHUNKS, typename Unit>
static void weighted_sums(Unit& unit, const float* scores, int64_t longest, int64_t n, int64_t g, int64_t r0, int64_t r1,
                          const uint16_t* values, int64_t kv_pos, int64_t length, const int64_t* prefix,
                          const int64_t* offsets, const int64_t* extra, float* out, int64_t row_stride, float* c,
                          std::vector<uint16_t>& weights) {
    constexpr int64_t dim = 32 * CHUNKS;
    const int64_t spans = (longest + 31) / 32, padded = spans * 32;
    // the weights as A tiles: query i's bf16 weights at positions 0 .. padded, zero past its count
    weights.assign(TILE * padded, 0);
    alignas(64) float divisor[TILE];
    for (int64_t i = 0; i < n; ++i) {
        const int64_t r = r0 + i / g, count = prefix[r] + offsets[r + 1] - offsets[r];
        const float* row = scores + i * longest;
        uint16_t* to = weights.data() + i * padded;
        __m512 sums = _mm512_setzero_ps();
        for (int64_t j = 0; j < count; j += 32) {
            const int64_t left = count - j;
            const __mmask16 first = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
            const __mmask16 second = left >= 32 ? __mmask16(0xFFFF) : left <= 16 ? __mmask16(0) : __mmask16((1u << (left - 16)) - 1);
            const __m512 lo = _mm512_maskz_loadu_ps(first, row + j), hi = _mm512_maskz_loadu_ps(second, row + j + 16);
            sums = _mm512_add_ps(sums, lo);
            sums = _mm512_add_ps(sums, hi);
            _mm512_storeu_si512((void*)(to + j), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
        divisor[i] = _mm512_reduce_add_ps(sums);
    }
    // where each row's own keys begin: a chunk ending at or before every row's cache run is shared
    int64_t shared_end = INT64_MAX;
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t count = prefix[r] + offsets[r + 1] - offsets[r];
        if (count > prefix[r]) shared_end = std::min(shared_end, prefix[r] / 32 * 32);
    }
    alignas(64) uint16_t b[4 * 512];
    alignas(64) uint16_t lone[TILE * 32];
    const uint16_t* rows_of[32];
    for (int half = 0; half < dim / 64; ++half) {  // 64 columns of the head dimension at a time
        const uint16_t* base = values + 64 * half;
        unit.clear_sums();
        for (int64_t s = 0; s < spans; ++s) {
            const int64_t j0 = s * 32;
            if (j0 + 32 <= shared_end) {
                for (int p = 0; p < 32; ++p) rows_of[p] = j0 + p < length ? base + (j0 + p) * kv_pos : nullptr;
                pair_values(rows_of, b);
                unit.weigh(weights.data() + j0, padded * 2, b, 0, n);
                continue;
            }
            for (int64_t r = r0; r < r1; ++r) {
                const int64_t own = prefix[r], count = own + offsets[r + 1] - offsets[r];
                if (count <= j0) continue;
                for (int p = 0; p < 32; ++p) {
                    const int64_t j = j0 + p;
                    rows_of[p] = j >= count ? nullptr : base + (j < own ? j : extra[offsets[r] + j - own]) * kv_pos;
                }
                pair_values(rows_of, b);
                std::memset(lone, 0, sizeof lone);
                const int64_t i0 = (r - r0) * g;
                for (int64_t i = i0; i < i0 + g; ++i) std::memcpy(lone + i * 32, weights.data() + i * padded + j0, 64);
                unit.weigh(lone, 64, b, i0, i0 + g);
            }
        }
        for (int t = 0; t < 4; ++t) {
            unit.sums(t, c);
            for (int64_t i = 0; i < n; ++i) {
                float* to = out + (r0 + i / g) * row_stride + (i % g) * dim + 64 * half + 16 * t;
                _mm512_storeu_ps(to, _mm512_div_ps(_mm512_load_ps(c + 16 * i), _mm512_set1_ps(divisor[i])));
            }
        }
    }
}

// One item: key/value head kv and rows [r0, r1), whose g heads each are the item's queries.
template <int CHUNKS, typename Unit>
static void tiles_item(Unit& unit, const uint16_t* qp, const uint16_t* kp, const uint16_t* vp, int64_t q_row, int64_t q_head,
                       int64_t kv_head, int64_t kv_pos, int64_t length, int64_t heads, int64_t g, int64_t kv, int64_t r0, int64_t r1,
                       const int64_t* prefix, const int64_t* offsets, const int64_t* extra, float scale, float* op,
                       std::vector<float>& scores, std::vector<uint16_t>& pad, std::vector<uint16_t>& weights, float* c) {
    constexpr int64_t dim = 32 * CHUNKS;
    const int64_t n = (r1 - r0) * g;
    int64_t lead = 0, longest = 0;
    for (int64_t r = r0; r < r1; ++r) {
        lead = std::max(lead, prefix[r]);
        longest = std::max(longest, prefix[r] + offsets[r + 1] - offsets[r]);
    }
    // the queries as B tiles: chunk t, row p, column i = the pair of elements 32t + 2p, +1 of query i
    alignas(64) uint32_t b[CHUNKS][16][16];
    for (int64_t i = 0; i < TILE; ++i) {
        const uint16_t* query = i < n ? qp + (r0 + i / g) * q_row + (kv * g + i % g) * q_head : nullptr;
        for (int t = 0; t < CHUNKS; ++t)
            for (int p = 0; p < 16; ++p) {
                uint32_t pair = 0;
                if (query) std::memcpy(&pair, query + 32 * t + 2 * p, 4);
                b[t][p][i] = pair;
            }
    }
    unit.template queries<CHUNKS>(b);
    scores.resize(TILE * longest + TILE);
    const __m512i across = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    const uint16_t* keys = kp + kv * kv_head;
    const uint16_t* values = vp + kv * kv_head;
    // the cache's leading keys, 16 at a time (a tail past the cache's end through a zero-padded copy)
    for (int64_t j0 = 0; j0 < lead; j0 += TILE) {
        if (j0 + TILE <= length) {
            unit.template score<CHUNKS>(keys + j0 * kv_pos, kv_pos, c);
        } else {
            std::fill(pad.begin(), pad.end(), 0);
            for (int64_t j = j0; j < length && j < j0 + TILE; ++j) std::memcpy(&pad[(j - j0) * dim], keys + j * kv_pos, dim * 2);
            unit.template score<CHUNKS>(pad.data(), dim, c);
        }
        for (int64_t i = 0; i < n; ++i) {  // column i of the tile: query i's scores for these keys
            const int64_t own = prefix[r0 + i / g];
            if (own <= j0) continue;
            const __m512 column = _mm512_i32gather_ps(_mm512_add_epi32(across, _mm512_set1_epi32(int(i))), c, 4);
            const __mmask16 keep = own - j0 >= TILE ? __mmask16(0xFFFF) : __mmask16((1u << (own - j0)) - 1);
            _mm512_mask_storeu_ps(scores.data() + i * longest + j0, keep, _mm512_mul_ps(column, _mm512_set1_ps(scale)));
        }
    }
    // each row's extra keys, through a zero-padded copy
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t first = offsets[r], count = offsets[r + 1] - first;
        for (int64_t e0 = 0; e0 < count; e0 += TILE) {
            std::fill(pad.begin(), pad.end(), 0);
            for (int64_t e = e0; e < count && e < e0 + TILE; ++e) std::memcpy(&pad[(e - e0) * dim], keys + extra[first + e] * kv_pos, dim * 2);
            unit.template score<CHUNKS>(pad.data(), dim, c);
            for (int64_t i = (r - r0) * g; i < (r - r0 + 1) * g; ++i)
                for (int64_t e = e0; e < count && e < e0 + TILE; ++e) scores[i * longest + prefix[r] + e] = c[(e - e0) * TILE + i] * scale;
        }
    }
    // each query's softmax, then its weighted sum of values in key order; a row's heads share its
    // keys, so each value is widened once for up to `together` of them
    for (int64_t i = 0; i < n; ++i) {
        const int64_t r = r0 + i / g, count = prefix[r] + offsets[r + 1] - offsets[r];
        float* row = scores.data() + i * longest;
        __m512 most = _mm512_set1_ps(-INFINITY);
        int64_t j = 0;
        for (; j + 16 <= count; j += 16) most = _mm512_max_ps(most, _mm512_loadu_ps(row + j));
        float best = _mm512_reduce_max_ps(most);  // exact: the order of a maximum does not matter
        for (; j < count; ++j) best = row[j] > best ? row[j] : best;
        exp_shifted(row, count, best);
    }
    weighted_sums<CHUNKS>(unit, scores.data(), longest, n, g, r0, r1, values, kv_pos, length, prefix, offsets, extra,
                          op + (kv * g) * dim, heads * dim, c, weights);
}

// Whether the tile path takes these tensors: bf16, head size 64 or 128, up to 16 heads per key/value head.
static bool tiles_take(const at::Tensor& q, const at::Tensor& k) {
    const int64_t dim = q.size(3), group = q.size(1) / k.size(1);
    return q.scalar_type() == at::kBFloat16 && (dim == 64 || dim == 128) && group <= TILE;
}

template <typename Unit>
static void rows_on(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* prefix,
                    const int64_t* offsets, const int64_t* extra, double scale, at::Tensor& out) {
    const int64_t n_rows = q.size(2), heads = q.size(1), kv_heads = k.size(1), dim = q.size(3), length = k.size(2);
    const int64_t g = heads / kv_heads, per_item = TILE / g, blocks = (n_rows + per_item - 1) / per_item;
    const uint16_t* qp = static_cast<const uint16_t*>(q.data_ptr());
    const uint16_t* kp = static_cast<const uint16_t*>(k.data_ptr());
    const uint16_t* vp = static_cast<const uint16_t*>(v.data_ptr());
    float* op = out.data_ptr<float>();
    at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
#ifdef KESTREL_TILES
        // 0: scores (16 keys x 16 queries); 1: keys; 2..5: the queries' chunks
        if constexpr (Unit::unit) configure_tiles({16, 16, 16, 16, 16, 16});
#endif
        Unit unit;
        std::vector<float> scores;
        std::vector<uint16_t> pad(TILE * dim), weights;  // weights: the weighted sums' A tiles, reused item to item
        alignas(64) float c[TILE * TILE];
        for (int64_t item = begin; item < end; ++item) {
            const int64_t kv = item / blocks, r0 = item % blocks * per_item, r1 = std::min(n_rows, r0 + per_item);
            if (dim == 64)
                tiles_item<2>(unit, qp, kp, vp, q.stride(2), q.stride(1), k.stride(1), k.stride(2), length, heads, g, kv, r0, r1,
                              prefix, offsets, extra, float(scale), op, scores, pad, weights, c);
            else
                tiles_item<4>(unit, qp, kp, vp, q.stride(2), q.stride(1), k.stride(1), k.stride(2), length, heads, g, kv, r0, r1,
                              prefix, offsets, extra, float(scale), op, scores, pad, weights, c);
        }
#ifdef KESTREL_TILES
        if constexpr (Unit::unit) _tile_release();
#endif
    });
}

static bool tiles_ready() { return true; }  // the tile path runs here: on the unit or with vdpbf16ps

// on the tile unit where this process may use it, else with vdpbf16ps
static void rows_tiles(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* prefix,
                       const int64_t* offsets, const int64_t* extra, double scale, at::Tensor& out) {
#ifdef KESTREL_TILES
    if (tiles_permitted()) return rows_on<Amx>(q, k, v, prefix, offsets, extra, scale, out);
#endif
    rows_on<Dots>(q, k, v, prefix, offsets, extra, scale, out);
}
#else
static bool tiles_ready() { return false; }
static bool tiles_take(const at::Tensor&, const at::Tensor&) { return false; }
static void rows_tiles(const at::Tensor&, const at::Tensor&, const at::Tensor&, const int64_t*, const int64_t*, const int64_t*,
                       double, at::Tensor&) {}
#endif

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& prefix,
                  const at::Tensor& offsets, const at::Tensor& extra, double scale) {
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == 1, "rows attention: q, k, v are (1, H, T, D)");
    TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "rows attention: one dtype");
    TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && k.strides() == v.strides(), "rows attention: layouts");
    TORCH_CHECK(prefix.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong && extra.scalar_type() == at::kLong,
                "rows attention: int64 row lists");
    TORCH_CHECK(prefix.is_contiguous() && offsets.is_contiguous() && extra.is_contiguous(), "rows attention: contiguous row lists");
    TORCH_CHECK(prefix.numel() == q.size(2) && offsets.numel() == q.size(2) + 1, "rows attention: one list per row");
    const int64_t* p = prefix.data_ptr<int64_t>();
    const int64_t* o = offsets.data_ptr<int64_t>();
    const int64_t* e = extra.data_ptr<int64_t>();
    const std::vector<int64_t> shape{1, q.size(2), q.size(1), q.size(3)};
    if (q.scalar_type() == at::kDouble) {
        auto out = at::empty(shape, q.options());
        rows<double>(q, k, v, p, o, e, scale, out);
        return out;
    }
    auto out = at::empty(shape, q.options().dtype(at::kFloat));
    if (q.scalar_type() == at::kFloat)
        rows<float>(q, k, v, p, o, e, scale, out);
    else if (tiles_take(q, k))
        rows_tiles(q, k, v, p, o, e, scale, out);
    else if (q.scalar_type() == at::kBFloat16)
        rows<bf16>(q, k, v, p, o, e, scale, out);
    else
        TORCH_CHECK(false, "rows attention: float32, float64 or bfloat16 only");
    return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());  // bf16: each element rounded once
}

// The compiled layers' attention (core/compiled.py): one forward's state, pushed by
// begin_pass and popped by end_pass, read by pass_attend once per layer. A forward with
// the cache's buffers appends each layer's keys and values in place and attends with the
// row kernel, without Python; one pushed without buffers leaves every layer to kestrel::attend
// (the Python op: sdpa, prefill). Forwards may nest, so the states are a stack.
struct CachePass {
    std::vector<at::Tensor> keys, values;  // per layer (1, H_kv, capacity, D): the cache's buffers
    std::vector<double> scales;            // per layer
    at::Tensor prefix, offsets, extra;     // the row kernel's key lists for this forward
    int64_t length = 0;                    // positions the cache held before this forward
    int64_t added = -1;                    // rows this forward appends (from its first layer)
    int64_t layer = 0;                     // the next layer to attend
};
static thread_local std::vector<CachePass> passes;

void begin_pass(at::TensorList keys, at::TensorList values, int64_t length, const at::Tensor& prefix,
                const at::Tensor& offsets, const at::Tensor& extra, at::ArrayRef<double> scales) {
    TORCH_CHECK(keys.size() == values.size() && (keys.empty() || keys.size() == scales.size()),
                "begin_pass: one key buffer, value buffer and scale per layer");
    CachePass pass;
    pass.keys.assign(keys.begin(), keys.end());
    pass.values.assign(values.begin(), values.end());
    pass.scales.assign(scales.begin(), scales.end());
    pass.prefix = prefix;
    pass.offsets = offsets;
    pass.extra = extra;
    pass.length = length;
    passes.push_back(std::move(pass));
}

// -> the positions the cache's buffers hold after the forward; -1 where it did not append
// through pass_attend at every layer
int64_t end_pass() {
    TORCH_CHECK(!passes.empty(), "end_pass without begin_pass");
    const CachePass& pass = passes.back();
    const int64_t layers = pass.keys.size();
    const int64_t held = layers > 0 && pass.layer == layers ? pass.length + pass.added : -1;
    passes.pop_back();
    return held;
}

// x (1, H_kv, T, D) into buffer (1, H_kv, capacity, D) from position `at` (a copy of each row's bytes)
static void append_rows(at::Tensor& buffer, const at::Tensor& x, int64_t at) {
    TORCH_CHECK(x.dim() == 4 && x.scalar_type() == buffer.scalar_type() && x.size(1) == buffer.size(1) &&
                    x.size(3) == buffer.size(3) && x.stride(3) == 1 && buffer.stride(3) == 1,
                "pass_attend: keys and values must match the cache's buffers");
    const int64_t size = x.element_size(), bytes = x.size(3) * size;
    char* to = static_cast<char*>(buffer.data_ptr());
    const char* from = static_cast<const char*>(x.data_ptr());
    for (int64_t h = 0; h < x.size(1); ++h)
        for (int64_t r = 0; r < x.size(2); ++r)
            std::memcpy(to + (h * buffer.stride(1) + (at + r) * buffer.stride(2)) * size,
                        from + (h * x.stride(1) + r * x.stride(2)) * size, bytes);
}

// query (1, H, T, D), this layer's key/value (1, H_kv, T, D) -> (1, T, H, D)
at::Tensor pass_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    if (passes.empty() || passes.back().keys.empty()) {
        static const auto python = c10::Dispatcher::singleton()
            .findSchemaOrThrow("kestrel::attend", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
        return python.call(q, k, v);
    }
    CachePass& pass = passes.back();
    TORCH_CHECK(pass.layer < (int64_t)pass.keys.size(), "pass_attend: more attention calls than layers");
    const int64_t index = pass.layer, rows = k.size(2);
    TORCH_CHECK(pass.added < 0 || rows == pass.added, "pass_attend: layers append different row counts");
    at::Tensor& key_buffer = pass.keys[index];
    at::Tensor& value_buffer = pass.values[index];
    TORCH_CHECK(pass.length + rows <= key_buffer.size(2), "pass_attend: the cache's buffers have no room for this forward");
    append_rows(key_buffer, k, pass.length);
    append_rows(value_buffer, v, pass.length);
    pass.added = rows;
    pass.layer = index + 1;
    const int64_t end = pass.length + rows;
    return attend(q, key_buffer.narrow(2, 0, end), value_buffer.narrow(2, 0, end), pass.prefix, pass.offsets, pass.extra,
                  pass.scales[index]);
}

TORCH_LIBRARY_FRAGMENT(kestrel_rows, lib) {
    lib.def("attend(Tensor q, Tensor k, Tensor v, Tensor prefix, Tensor offsets, Tensor extra, float scale) -> Tensor");
    lib.def("tiles_ready() -> bool", &tiles_ready);  // no tensors to dispatch on: a catch-all
    lib.def("tile_unit() -> bool", &tiles_permitted);
    lib.def("begin_pass(Tensor[] keys, Tensor[] values, int length, Tensor prefix, Tensor offsets, Tensor extra, float[] scales) -> ()",
            &begin_pass);
    lib.def("end_pass() -> int", &end_pass);
    lib.def("pass_attend(Tensor q, Tensor k, Tensor v) -> Tensor");
}
TORCH_LIBRARY_IMPL(kestrel_rows, CPU, lib) {
    lib.impl("attend", &attend);
    lib.impl("pass_attend", &pass_attend);
}
"""
DTYPES = (torch.float32, torch.float64, torch.bfloat16)

_lock = threading.Lock()
_operator = None
_tried = False


def library():
    """The built kernel (a torch operator), building it on first use (about
    10 s, then cached); None where it cannot be built."""
    global _operator, _tried
    if _tried:  # the common case, without the lock
        return _operator
    with _lock:
        if not _tried:
            _operator = _load()
            _tried = True
    return _operator


def _load():
    if os.environ.get("KESTREL_ROW_KERNEL", "1") == "0":
        return None
    registered = hasattr(torch.ops.kestrel_rows, "attend")  # by an earlier load in this process
    if not registered:
        if not native.load_operator("rows", SOURCE, "Row-invariant attention in torch"):
            return None
        torch.library.register_fake("kestrel_rows::pass_attend", _pass_attend_shape)
    return torch.ops.kestrel_rows.attend


def _pass_attend_shape(query, key, value):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


def tiles() -> bool:
    """Whether bf16 attention with head size 64 or 128 runs as tile products
    here: on AMX tiles (a CPU with them, Linux granting the tile state) or
    with vdpbf16ps (a CPU with AVX512-BF16), the kernel built for it."""
    return library() is not None and bool(torch.ops.kestrel_rows.tiles_ready())


def covers(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel computes attention in this dtype on this device (and is built)."""
    return dtype in DTYPES and device.type == "cpu" and library() is not None


def prefills(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a prefill (causal rows) runs on the kernel rather than sdpa:
    bf16 on CPUs whose tile products run as vdpbf16ps, where it is the faster.
    On the 2-core AVX-512 EPYC, 30 layers of 9 heads over 3: 64 / 258 / 600
    rows in 1.1 / 10.6 / 50.2 ms against sdpa's 2.8 / 30.9 / 131.5. (Not
    measured against sdpa where the tile unit runs them: there sdpa stays.)"""
    return dtype == torch.bfloat16 and covers(dtype, device) and _vector_tiles()


@functools.cache
def _vector_tiles() -> bool:
    """The tile products run here, and not on the tile unit (fixed for the process)."""
    return tiles() and not bool(torch.ops.kestrel_rows.tile_unit())


class Rows:
    """Which keys each query row sees: the cache's first `prefix[r]` positions,
    then extra[offsets[r]:offsets[r + 1]], in that order."""

    def __init__(self, prefix: torch.Tensor, offsets: torch.Tensor, extra: torch.Tensor):
        self.prefix, self.offsets, self.extra = prefix, offsets, extra

    @classmethod
    def of(cls, visible: torch.Tensor | None, rows: int, total: int) -> Rows:
        """visible (T, S) bool, or None for causal rows ending at `total`."""
        if visible is None:
            prefix = torch.arange(total - rows + 1, total + 1, dtype=torch.int64)
            return cls(prefix, torch.zeros(rows + 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
        visible = visible.to(torch.bool).cpu()
        # the leading run of visible positions: the first invisible one (or the row's length)
        hidden = ~visible
        lead = torch.where(hidden.any(dim=1), hidden.to(torch.int8).argmax(dim=1), torch.full((rows,), visible.shape[1]))
        after = visible & (torch.arange(visible.shape[1])[None, :] >= lead[:, None])
        counts = after.sum(dim=1)
        offsets = torch.zeros(rows + 1, dtype=torch.int64)
        offsets[1:] = counts.cumsum(0)
        extra = after.nonzero()[:, 1].contiguous()  # row-major: each row's extras in key order
        return cls(lead.to(torch.int64).contiguous(), offsets, extra if len(extra) else torch.zeros(1, dtype=torch.int64))


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: Rows, scale: float) -> torch.Tensor | None:
    """query (1, H, T, D), key/value (1, H_kv, S, D) -> (1, T, H, D), or None
    where the kernel cannot take these tensors (then use the torch code)."""
    if not covers(query.dtype, query.device):
        return None
    if key.dtype != query.dtype or value.dtype != query.dtype or query.stride(-1) != 1 or key.stride(-1) != 1:
        return None
    if value.stride() != key.stride():
        return None
    return library()(query, key, value, rows.prefix, rows.offsets, rows.extra, float(scale))
