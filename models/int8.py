"""Int8 weights on CPUs: torch's int8 weight-only kernel.

A CPU decoding a small model spends most of a step reading weights from
memory. Stored as int8 with one bf16 scale per output row, they are a
quarter of float32's bytes, and torch's kernel (`_weight_int8pack_mm`, bf16
activations, float32 accumulation) reads them directly. Measured on a 2-core
AVX2 CPU without native bf16: a 1536x576 layer takes 45 us for one row
against 94 us in float32, and no more than float32 up to 16 rows. The kernel
computes every row alone, so a row's result does not depend on how many rows
share the call (tests/test_int8.py checks it), which float32 products here do
not promise.

Two uses: drafting (the head and its draft vocabulary: proposals only, which
the base model verifies, so rounding there never changes the output), and
the base model itself with quantization "int8" (then the model that decodes
is the int8 one, in vanilla, tree passes and prefill alike)."""

from __future__ import annotations

import copy
import functools
import os
import threading
import time

import torch
from torch import nn

from core import native

PROBE_SHAPE = (1536, 576)  # a small model's MLP projection: the probe's stand-in for every layer
PROBE_ROWS = (1, 8)  # a vanilla step and a typical tree pass
TREE_SLACK = 1.25  # int8 may be this much slower for tree-sized blocks and still pay (single rows dominate)


def kernel_available(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")


def available(device: torch.device) -> bool:
    """Whether int8 drafting pays on `device`: a CPU where the kernel is
    measured faster than float32 products (`pays`)."""
    return kernel_available(device) and pays(torch.float32)


@functools.cache
def pays(dtype: torch.dtype) -> bool:
    """Whether the int8 kernel beats `dtype` products on this CPU: faster for
    one row (every vanilla step) and not much slower for a tree's worth of
    rows (measured on 2 cores: 45 against 94 us for one row, 174 against 320
    for eight; on one core 81 against 93, and 335 against 323). A probe of
    about 20 ms, once per process."""
    if not kernel_available(torch.device("cpu")) or dtype not in (torch.float32, torch.bfloat16):
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(PROBE_SHAPE, generator=generator).to(dtype)
    packed, scales = quantize_rows(weight)
    times = {}
    for rows in PROBE_ROWS:
        x = torch.randn(rows, PROBE_SHAPE[1], generator=generator).to(dtype)
        times[rows] = (_best_time(lambda: x @ weight.T), _best_time(lambda: matmul(x, packed, scales)))
    (plain_one, int8_one), (plain_tree, int8_tree) = times[PROBE_ROWS[0]], times[PROBE_ROWS[1]]
    return int8_one < plain_one and int8_tree < TREE_SLACK * plain_tree


def _best_time(run, repeats: int = 12) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


ONE_ROW_REPEATS = 6  # products of each kernel when `PackedRows.choose_one_row` measures them

CHUNK_ROWS = 2048  # rows per slice when quantizing large weights


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) -> (int8 (N, K), bf16 scales (N,)), symmetric per row.
    Each scale is rounded up to bf16 so that no weight clips: every weight is
    then within half a scale of its int8 value times the scale."""
    weight = weight.detach()
    needed = weight.abs().amax(dim=1).float().clamp_min(1e-30) / 127
    scales = needed.to(torch.bfloat16)
    short = scales.float() < needed
    scales[short] = torch.nextafter(scales[short], torch.full_like(scales[short], float("inf")))
    packed = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    divisors = scales.float()[:, None]
    for start in range(0, len(weight), CHUNK_ROWS):  # a slice at a time: no vocabulary-sized float32 temporaries
        rows = slice(start, start + CHUNK_ROWS)
        packed[rows] = (weight[rows].float() / divisors[rows]).round().clamp(-127, 127).to(torch.int8)
    return packed, scales


def dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weights an int8 matmul multiplies by."""
    return packed.float() * scales.float()[:, None]


def matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (m, K) -> (m, N) in bf16: x @ (packed * scales).T."""
    return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), packed, scales)


# Kestrel's own int8 product, for the lm_head screen (core/argmax.py) and the draft vocabulary
# (core/drafter.py): float32 activations, so its only rounding is float32 accumulation. Measured on
# the 2-core AVX2 machine, a 49k x 576 lm_head: 2.4 ms for one row against torch's 3.6, 2.4 against
# 5.2 for four rows, 9.0 against 20.8 for sixteen.
SOURCE = native.BLOCKS + native.TILES + r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

// Weight rows are read in order, a block of C at a time; on AVX2 builds the rows AHEAD_ROWS further
// on are asked into the cache meanwhile (the hardware's own prefetching left the 2-core AMD EPYC
// waiting on memory: a 49k x 576 lm_head, one row, 4.0 -> 3.5 ms here, 2.3 ms with the integer
// screen below). Reads only: the arithmetic is unchanged.
static constexpr int64_t AHEAD_ROWS = 64;
static inline void prefetch_ahead(const int8_t* w, int64_t n0, int64_t C, int64_t K, int64_t N) {
#ifndef __AVX512F__  // measured on AVX2 only; AVX-512 builds read as before
    if (n0 + AHEAD_ROWS + C <= N)
        for (int64_t line = 0; line < C * K; line += 64) _mm_prefetch((const char*)(w + (n0 + AHEAD_ROWS) * K + line), _MM_HINT_T0);
#endif
}

// C output columns times RB rows; every output element gets the same
// operations in the same order whatever C, RB and the other rows are (two
// accumulators along K, 2 * LANES weights a step, a last odd LANES into the
// first, then the fixed-order sum of their sum, times the row's scale), so a
// row's result does not depend on how many rows share the call.
template <int C, int RB>
static inline void block(int64_t n0, int64_t r0, int64_t K, int64_t N, const int8_t* w, const float* s,
                         const float* x, float* out) {
    prefetch_ahead(w, n0, C, K, N);
    vec a[C][RB], b[C][RB];
    for (int c = 0; c < C; ++c)
        for (int r = 0; r < RB; ++r) a[c][r] = b[c][r] = vzero();
    int64_t k = 0;
    for (; k + 2 * LANES <= K; k += 2 * LANES) {
        for (int c = 0; c < C; ++c) {
            const int8_t* wp = w + (n0 + c) * K + k;
            const vec w0 = vfrom_i8(wp), w1 = vfrom_i8(wp + LANES);
            for (int r = 0; r < RB; ++r) {
                const float* xr = x + (r0 + r) * K + k;
                a[c][r] = vfma(w0, vload(xr), a[c][r]);
                b[c][r] = vfma(w1, vload(xr + LANES), b[c][r]);
            }
        }
    }
    if (k < K) {  // K is a multiple of 16, so with 16 lanes one vector may be left
        for (int c = 0; c < C; ++c) {
            const vec w0 = vfrom_i8(w + (n0 + c) * K + k);
            for (int r = 0; r < RB; ++r) a[c][r] = vfma(w0, vload(x + (r0 + r) * K + k), a[c][r]);
        }
    }
    for (int c = 0; c < C; ++c)
        for (int r = 0; r < RB; ++r) out[(r0 + r) * N + n0 + c] = s[n0 + c] * vsum(a[c][r], b[c][r]);
}

at::Tensor int8_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& scales) {
    TORCH_CHECK(input.dim() == 2 && weight.dim() == 2 && scales.dim() == 1, "int8_linear: x (R, K), weight (N, K), scales (N,)");
    TORCH_CHECK(input.scalar_type() == at::kFloat && weight.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat,
                "int8_linear: x float32, weight int8, scales float32");
    TORCH_CHECK(weight.is_contiguous() && scales.is_contiguous(), "int8_linear: contiguous weights");
    const at::Tensor x = input.contiguous();
    const int64_t R = x.size(0), K = x.size(1), N = weight.size(0);
    TORCH_CHECK(weight.size(1) == K && K % 16 == 0 && scales.size(0) == N, "int8_linear: shapes (K a multiple of 16)");
    at::Tensor result = at::empty({R, N}, x.options());
    const int8_t* w = weight.data_ptr<int8_t>();
    const float *s = scales.data_ptr<float>(), *xp = x.data_ptr<float>();
    float* out = result.data_ptr<float>();
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
        each_block(R, begin, end, [&](auto c, auto rb, int64_t n, int64_t r) {
            block<decltype(c)::value, decltype(rb)::value>(n, r, K, N, w, s, xp, out);
        });
    });
    return result;
}


// AMX (Intel's tile unit, where the compiler targets it): bf16 activations times the int8 codes
// widened to bf16 (exactly: whole numbers below 128), each product exact and summed in float32
// inside the unit, then times the row's scale. tiles (N/16, K/32, 512) int8: for 16 output rows
// and 32 inputs, byte 32p + j holds the code of input 2p + (j & 1) for output row j >> 1 (a B
// tile's row p). The codes are widened a few chunks ahead of the tile products that read them.
#ifdef KESTREL_DOTS
static inline void widen_codes(const int8_t* src, uint16_t* dst) {  // 512 codes -> a B tile of bf16
    for (int c = 0; c < 16; ++c) {
        const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(src + 32 * c))));
        const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(src + 32 * c + 16))));
        _mm512_store_si512(dst + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
}

// Without the tile unit (AVX512-BF16 CPUs without AMX, or refused the tile state): the same
// widened codes, each row's products with them one chain of vdpbf16ps per 16 output rows over the
// pairs of every group in order, then times the row's scale.
static void dot_rows(int64_t R, int64_t t, const uint16_t* x, int64_t K, const int8_t* tiles, const float* scales,
                     int64_t N, float* out, float* acc) {
    const int64_t G = K / 32;
    alignas(64) uint16_t b[512];
    for (int64_t r = 0; r < R; ++r) _mm512_store_ps(acc + 16 * r, _mm512_setzero_ps());
    for (int64_t g = 0; g < G; ++g) {
        if (t * G + g + PREFETCH < N / 16 * G) prefetch_lines(tiles + (t * G + g + PREFETCH) * 512, 8);  // core/native.py
        widen_codes(tiles + (t * G + g) * 512, b);
        __m512i w[16];
        for (int p = 0; p < 16; ++p) w[p] = _mm512_load_si512(b + 32 * p);
        for (int64_t r = 0; r < R; ++r) {
            const int32_t* pairs = (const int32_t*)(x + r * K + g * 32);
            __m512 a = _mm512_load_ps(acc + 16 * r);
            for (int p = 0; p < 16; ++p) a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_set1_epi32(pairs[p]), (__m512bh)w[p]);
            _mm512_store_ps(acc + 16 * r, a);
        }
    }
    const __m512 scale = _mm512_loadu_ps(scales + t * 16);
    for (int64_t r = 0; r < R; ++r) _mm512_storeu_ps(out + r * N + t * 16, _mm512_mul_ps(scale, _mm512_load_ps(acc + 16 * r)));
}
#endif

#ifdef KESTREL_TILES
constexpr int AHEAD = 3, RING = 4;

static void tile_rows(int rows, int64_t r0, int64_t t0, int64_t t1, const uint16_t* x, int64_t K, const int8_t* tiles,
                      const float* scales, int64_t N, float* out) {
    const int64_t G = K / 32, first = t0 * G, last = t1 * G;
    alignas(64) uint16_t b[RING][512];
    alignas(64) float c[16 * 16];
    for (int64_t i = first; i < first + AHEAD && i < last; ++i) widen_codes(tiles + i * 512, b[i % RING]);
    for (int64_t i = first; i < last; ++i) {
        const int64_t g = i % G;
        if (g == 0) _tile_zero(0);
        _tile_loadd(2, b[i % RING], 64);
        _tile_loadd(1, x + r0 * K + g * 32, K * 2);
        _tile_dpbf16ps(0, 1, 2);
        if (i + AHEAD < last) widen_codes(tiles + (i + AHEAD) * 512, b[(i + AHEAD) % RING]);
        if (g == G - 1) {
            _tile_stored(0, c, 64);
            const int64_t n = (i / G) * 16;
            const __m512 scale = _mm512_loadu_ps(scales + n);
            for (int r = 0; r < rows; ++r) _mm512_storeu_ps(out + (r0 + r) * N + n, _mm512_mul_ps(scale, _mm512_load_ps(c + 16 * r)));
        }
    }
}

#endif

#ifdef KESTREL_DOTS
static bool tiles_ready() { return true; }  // the tile layout runs here: on the tile unit or with vdpbf16ps

at::Tensor int8_tiles(const at::Tensor& input, const at::Tensor& tiles_t, const at::Tensor& scales_t) {
    TORCH_CHECK(input.dim() == 2 && input.scalar_type() == at::kBFloat16, "int8_tiles: x (R, K) bf16");
    TORCH_CHECK(tiles_t.dim() == 3 && tiles_t.size(2) == 512 && tiles_t.scalar_type() == at::kChar && tiles_t.is_contiguous(),
                "int8_tiles: tiles (N/16, K/32, 512) int8");
    const at::Tensor x = input.contiguous();
    const int64_t R = x.size(0), K = x.size(1), T = tiles_t.size(0), N = T * 16;
    TORCH_CHECK(K == tiles_t.size(1) * 32 && scales_t.scalar_type() == at::kFloat && scales_t.is_contiguous() && scales_t.numel() == N,
                "int8_tiles: shapes");
    at::Tensor result = at::empty({R, N}, x.options().dtype(at::kFloat));
    const uint16_t* xp = (const uint16_t*)x.data_ptr();
    const int8_t* tiles = tiles_t.data_ptr<int8_t>();
    const float* scales = scales_t.data_ptr<float>();
    float* out = result.data_ptr<float>();
#ifdef KESTREL_TILES
    if (tiles_permitted()) {
        at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
            for (int64_t r0 = 0; r0 < R; r0 += 16) {
                const int rows = int(std::min<int64_t>(16, R - r0));
                configure_tiles({rows, rows, 16});  // 0: C (rows x 16 float), 1: A (rows x 32 bf16), 2: B (16 x 32 bf16)
                tile_rows(rows, r0, t0, t1, xp, K, tiles, scales, N, out);
            }
            _tile_release();
        });
        return result;
    }
#endif
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
        std::vector<float> storage;
        float* acc = row_accumulators(storage, R);
        for (int64_t t = t0; t < t1; ++t) dot_rows(R, t, xp, K, tiles, scales, N, out, acc);
    });
    return result;
}
#else
static bool tiles_ready() { return false; }
at::Tensor int8_tiles(const at::Tensor&, const at::Tensor&, const at::Tensor&) { TORCH_CHECK(false, "int8_tiles: built without AVX512-BF16"); }
#endif

// The lm_head screen's integer product, where the CPU has AVX2 but not AVX-512 (there the float
// kernel above stays): each row of x rounded to int8 per group of 32 inputs (p = round(x / a), a = the
// group's largest magnitude / 127), each group's dot product with the weight codes computed exactly in
// integers (vpmaddubsw of |w| and p * sign(w), then vpmaddwd: at most 4 * 127 * 127 per lane, so its
// conversion to float32 is exact), times a and summed in float32 (8 lanes, one fused multiply-add per
// group, a fixed-order lane sum), times the row's scale. Every element gets the same operations
// whatever the other rows and columns, so a row's result does not depend on what shares the call.
// -> the products (R, N) and, per row, ||x - a p|| in float64: how far the rounded activations are
// from x, which the screen's bound adds (core/argmax.py).
#ifndef __AVX512F__
static constexpr bool INTEGER_SCREEN = true;

static double round_groups(const float* x, int64_t K, int8_t* p, float* a) {
    double error = 0.0;
    for (int64_t g = 0; g < K / 32; ++g) {
        const float* xg = x + g * 32;
        float largest = 0.0f;
        for (int j = 0; j < 32; ++j) largest = std::max(largest, std::fabs(xg[j]));
        const float scale = largest / 127.0f, inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
        a[g] = scale;
        for (int j = 0; j < 32; ++j) {
            const float q = std::min(127.0f, std::max(-127.0f, std::nearbyint(xg[j] * inverse)));
            p[g * 32 + j] = int8_t(q);
            const double off = double(xg[j]) - double(scale) * double(q);
            error += off * off;
        }
    }
    return std::sqrt(error);
}

template <int C, int RB>
static inline void screen_block(int64_t n0, int64_t r0, int64_t K, int64_t N, const int8_t* w, const float* s,
                                const int8_t* p, const float* a, float* out) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t G = K / 32;
    prefetch_ahead(w, n0, C, K, N);
    __m256 acc[C][RB];
    for (int c = 0; c < C; ++c)
        for (int r = 0; r < RB; ++r) acc[c][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
        for (int c = 0; c < C; ++c) {
            const __m256i wc = _mm256_loadu_si256((const __m256i*)(w + (n0 + c) * K + g * 32));
            const __m256i magnitude = _mm256_sign_epi8(wc, wc);
            for (int r = 0; r < RB; ++r) {
                const __m256i pg = _mm256_loadu_si256((const __m256i*)(p + (r0 + r) * K + g * 32));
                const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(pg, wc));
                acc[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)), _mm256_set1_ps(a[(r0 + r) * G + g]), acc[c][r]);
            }
        }
    }
    for (int c = 0; c < C; ++c)
        for (int r = 0; r < RB; ++r) out[(r0 + r) * N + n0 + c] = s[n0 + c] * sum8(acc[c][r]);
}

std::tuple<at::Tensor, at::Tensor> int8_screen(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& scales) {
    TORCH_CHECK(input.dim() == 2 && weight.dim() == 2 && scales.dim() == 1, "int8_screen: x (R, K), weight (N, K), scales (N,)");
    TORCH_CHECK(input.scalar_type() == at::kFloat && weight.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat,
                "int8_screen: x float32, weight int8, scales float32");
    TORCH_CHECK(weight.is_contiguous() && scales.is_contiguous(), "int8_screen: contiguous weights");
    const at::Tensor x = input.contiguous();
    const int64_t R = x.size(0), K = x.size(1), N = weight.size(0), G = K / 32;
    TORCH_CHECK(weight.size(1) == K && K % 32 == 0 && scales.size(0) == N, "int8_screen: shapes (K a multiple of 32)");
    // the codes are at most 127 in magnitude (quantize_rows), so |w| fits vpmaddubsw's unsigned operand
    at::Tensor codes = at::empty({R, K}, weight.options()), group_scales = at::empty({R, G}, scales.options());
    at::Tensor errors = at::empty({R}, x.options().dtype(at::kDouble));
    int8_t* p = codes.data_ptr<int8_t>();
    float* a = group_scales.data_ptr<float>();
    for (int64_t r = 0; r < R; ++r) errors.data_ptr<double>()[r] = round_groups(x.data_ptr<float>() + r * K, K, p + r * K, a + r * G);
    at::Tensor result = at::empty({R, N}, x.options());
    const int8_t* w = weight.data_ptr<int8_t>();
    const float* s = scales.data_ptr<float>();
    float* out = result.data_ptr<float>();
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
        each_block(R, begin, end, [&](auto c, auto rb, int64_t n, int64_t r) {
            screen_block<decltype(c)::value, decltype(rb)::value>(n, r, K, N, w, s, p, a, out);
        });
    });
    return {result, errors};
}
#else
static constexpr bool INTEGER_SCREEN = false;
std::tuple<at::Tensor, at::Tensor> int8_screen(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
    TORCH_CHECK(false, "int8_screen: built for AVX-512, where the float kernel screens");
}
#endif
static bool integer_screen() { return INTEGER_SCREEN; }

// The k largest of each row of x (R, V) float32, largest first (an equal value: the earlier index
// first): one pass that keeps the k best in order and compares LANES values at a time with the
// k-th best so far, so a row of a large vocabulary costs little more than reading it.
std::tuple<at::Tensor, at::Tensor> top_k(const at::Tensor& input, int64_t k) {
    TORCH_CHECK(input.dim() == 2 && input.scalar_type() == at::kFloat, "top_k: x (R, V) float32");
    const at::Tensor x = input.contiguous();
    const int64_t R = x.size(0), V = x.size(1);
    TORCH_CHECK(k >= 1 && k <= V && k <= 64, "top_k: 1 <= k <= min(V, 64)");
    at::Tensor values = at::empty({R, k}, x.options()), indices = at::empty({R, k}, x.options().dtype(at::kLong));
    const float* xp = x.data_ptr<float>();
    float* vp = values.data_ptr<float>();
    int64_t* ip = indices.data_ptr<int64_t>();
    at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const float* row = xp + r * V;
            float* best = vp + r * k;
            int64_t* where = ip + r * k;
            int64_t kept = 0;
            auto offer = [&](float value, int64_t index) {  // into the kept list, in order
                if (kept == k && !(value > best[k - 1])) return;
                int64_t at = kept < k ? kept++ : k - 1;
                for (; at > 0 && value > best[at - 1]; --at) best[at] = best[at - 1], where[at] = where[at - 1];
                best[at] = value, where[at] = index;
            };
            int64_t i = 0;
            for (; i < k; ++i) offer(row[i], i);
            for (; i + LANES <= V; i += LANES) {
                const vec chunk = vload(row + i);
#ifdef __AVX512F__
                uint32_t above = _mm512_cmp_ps_mask(chunk, vset1(best[k - 1]), _CMP_GT_OQ);
#else
                uint32_t above = _mm256_movemask_ps(_mm256_cmp_ps(chunk, vset1(best[k - 1]), _CMP_GT_OQ));
#endif
                for (; above; above &= above - 1) {
                    const int64_t j = i + __builtin_ctz(above);
                    offer(row[j], j);
                }
            }
            for (; i < V; ++i) offer(row[i], i);
        }
    });
    return {values, indices};
}

TORCH_LIBRARY_FRAGMENT(kestrel_int8, lib) {
    lib.def("linear(Tensor x, Tensor weight, Tensor scales) -> Tensor");
    lib.def("tiles(Tensor x, Tensor tiles, Tensor scales) -> Tensor");
    lib.def("tiles_ready() -> bool", &tiles_ready);  // no tensors to dispatch on: a catch-all
    lib.def("tile_unit() -> bool", &tiles_permitted);
    lib.def("top_k(Tensor x, int k) -> (Tensor, Tensor)");
    lib.def("screen(Tensor x, Tensor weight, Tensor scales) -> (Tensor, Tensor)");
    lib.def("screen_ready() -> bool", &integer_screen);  // no tensors to dispatch on: a catch-all
}
TORCH_LIBRARY_IMPL(kestrel_int8, CPU, lib) {
    lib.impl("linear", &int8_linear);
    lib.impl("tiles", &int8_tiles);
    lib.impl("top_k", &top_k);
    lib.impl("screen", &int8_screen);
}
"""

_lock = threading.Lock()
_built: bool | None = None


def own_kernel() -> bool:
    """Whether Kestrel's int8 kernel is built and registered (building it on
    first use: about 10 s, then cached); False where it cannot be (no
    compiler, no AVX2)."""
    global _built
    if _built is None:
        with _lock:
            if _built is None:
                _built = os.environ.get("KESTREL_INT8_KERNEL", "1") != "0" and _load()
    return _built


def _load() -> bool:
    if not hasattr(torch.ops.kestrel_int8, "linear"):
        if not native.load_operator("int8", SOURCE, "The lm_head screen through torch's int8 kernel"):
            return False

        # shapes for torch.compile, which traces the drafting head's linears (core/compiled.py)
        @torch.library.register_fake("kestrel_int8::linear")
        def _(x, packed, scales):
            return x.new_empty((x.shape[0], packed.shape[0]), dtype=torch.float32)

        @torch.library.register_fake("kestrel_int8::tiles")
        def _(x, codes, scales):
            return x.new_empty((x.shape[0], scales.shape[0]), dtype=torch.float32)

    return True


def own_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (m, K) float32 -> (m, N) float32: x @ (packed * scales).T, with
    scales (N,) float32, rounded by float32 accumulation only."""
    return torch.ops.kestrel_int8.linear(x, packed, scales)


def integer_screen() -> bool:
    """Whether the lm_head screen's integer product (`screen`) is built here:
    Kestrel's kernels on a CPU with AVX2 but not AVX-512, where it is about
    1.5x as fast as the float32 one for one row (a 49k x 576 lm_head on the
    2-core AMD EPYC: 2.3 against 3.5 ms) and no faster for three or more.
    AVX-512 builds keep the float32 kernel, whose speed there this was not
    measured against."""
    return own_kernel() and bool(torch.ops.kestrel_int8.screen_ready())


def screen(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (m, K) float32, K a multiple of 32 -> (m, N) float32 products with the
    activations rounded to int8 per group of 32, and per row the float64 norm
    of that rounding, ||x - rounded x||: x @ (packed * scales).T to within
    ||packed_t * scale_t|| times it, plus float32 accumulation. Only where
    `integer_screen()`."""
    return torch.ops.kestrel_int8.screen(x, packed, scales)


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, V) -> the k largest of each row, largest first, and their indices:
    Kestrel's one-pass kernel for float32 rows of a vocabulary on the CPU (a
    49k row: 9 against torch.topk's 79 us; 4 rows 16 against 150), else
    torch.topk (faster for short rows)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and k <= 64 and x.shape[1] >= 4096 and own_kernel():
        return torch.ops.kestrel_int8.top_k(x, k)
    top = x.topk(k, dim=-1)
    return top.values, top.indices


STEP = 16  # both int8 kernels take inputs of a multiple of 16 columns: torch's reads past its weights otherwise


def takes(weight: torch.Tensor) -> bool:
    """Whether the int8 kernels can multiply by `weight` (N, K): K a multiple of
    their step of 16. torch's kernel does not check it, and for K = 8, 24 or
    40 returns products of 1e23 and more, or crashes the process."""
    return weight.shape[1] % STEP == 0


def own_kernel_takes(weight: torch.Tensor) -> bool:
    """Whether Kestrel's int8 kernel is built and can multiply by `weight` (N, K)."""
    return weight.device.type == "cpu" and takes(weight) and own_kernel()


def torch_kernel_takes(weight: torch.Tensor) -> bool:
    """Whether torch's int8 kernel can multiply by `weight` and pays on its device (`available`)."""
    return takes(weight) and available(weight.device)


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The decoder layers where the kernels replace linears (`model.layers` of
    the decoder, as Llama-like models keep them), or None (GPT-2's `h`, say)."""
    layers = getattr(model.get_decoder(), "layers", None)
    return layers if isinstance(layers, nn.ModuleList) and len(layers) else None


def fits(model: nn.Module) -> bool:
    """Whether the int8 kernels take every decoder linear of `model`."""
    layers = decoder_layers(model)
    return layers is not None and all(takes(linear.weight) for linear in _linears(layers))


def tiles_available() -> bool:
    """Whether Kestrel's int8 product in the tile layout runs here (bf16
    activations): on AMX tiles, or with vdpbf16ps on AVX512-BF16 CPUs."""
    return own_kernel() and bool(torch.ops.kestrel_int8.tiles_ready())


@functools.cache
def tile_unit() -> bool:
    """Whether that product runs on the AMX tile unit (fixed for the process)."""
    return own_kernel() and bool(torch.ops.kestrel_int8.tile_unit())


class PackedRows:
    """A weight (N, K) as int8 rows with one scale each, multiplied by
    Kestrel's kernel (`own`: float32 activations; with `tiles`, in the tile
    layout with bf16 activations, output rows padded to 16) or else torch's."""

    def __init__(self, weight: torch.Tensor, own: bool, tiles: bool = False):
        self.own, self.tiles, self.rows = own, tiles and weight.shape[1] % 32 == 0, weight.shape[0]
        self.one_row_tiles = False  # one row on the vector kernel unless `choose_one_row` measured tiles faster
        self.packed, self.scales = quantize_rows(weight)
        if own:
            self.scales = self.scales.float()
        if self.tiles:
            padded = -(-self.rows // 16) * 16
            codes = torch.zeros(padded, weight.shape[1], dtype=torch.int8)
            codes[: self.rows] = self.packed
            groups = weight.shape[1] // 32
            # [tile, output row, group, pair, element] -> [tile, group, pair, output row, element]
            self.tile_codes = codes.reshape(padded // 16, 16, groups, 16, 2).permute(0, 2, 3, 1, 4).reshape(padded // 16, groups, 512).contiguous()
            self.tile_scales = torch.zeros(padded, dtype=torch.float32)
            self.tile_scales[: self.rows] = self.scales.float()

    def choose_one_row(self) -> bool:
        """Measure which kernel multiplies one bf16 row faster by these weights
        (a few products of each, best of ONE_ROW_REPEATS) and send one row there
        from now on. On the reference Xeon's tile unit the vector kernel was a
        little faster for one row; on the AVX512-BF16 EPYC a 49,152 x 576
        lm_head took 1.9 ms on it against 0.85 ms in vdpbf16ps. Returns the choice."""
        if not (self.tiles and self.own):
            return False
        x = torch.randn(1, self.packed.shape[1], generator=torch.Generator().manual_seed(0)).bfloat16()
        vector = _best_time(lambda: own_matmul(x.float(), self.packed, self.scales), ONE_ROW_REPEATS)
        tiled = _best_time(lambda: torch.ops.kestrel_int8.tiles(x, self.tile_codes, self.tile_scales), ONE_ROW_REPEATS)
        self.one_row_tiles = tiled < vector
        return self.one_row_tiles

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (m, K) -> (m, N) float32. With `tiles`, bf16 rows, two or more, go to
        the tiles (their cost hardly grows with the rows), one row to the vector
        kernel unless `choose_one_row` found the tiles faster: the callers only
        rank or screen, and for bf16 x both are float32 sums of the same exact
        products. float32 x stays on the vector kernel, as tiles would round it to bf16."""
        if self.tiles and (len(x) >= 2 or self.one_row_tiles) and x.dtype == torch.bfloat16:
            return torch.ops.kestrel_int8.tiles(x, self.tile_codes, self.tile_scales)[:, : self.rows]
        if self.own:
            return own_matmul(x.float(), self.packed, self.scales)
        return matmul(x, self.packed, self.scales).float()

    def dequantized(self) -> torch.Tensor:
        """The float32 weights (N, K) the product multiplies by."""
        return dequantize(self.packed, self.scales)


class QuantizedLinear(nn.Module):
    """A frozen nn.Linear whose weights a CPU kernel reads packed (`product`);
    inputs and outputs keep their dtype, the kernel sees bf16 activations."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(torch.bfloat16))

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x (m, K) bf16, contiguous -> (m, N) bf16."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous())
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], -1).to(x.dtype)


class Int8Linear(QuantizedLinear):
    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        packed, scales = quantize_rows(linear.weight)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.packed, self.scales)


class DraftLinear(QuantizedLinear):
    """An int8 linear for drafting only, through Kestrel's kernels: the vector
    one for a single row, the tile layout (AMX, or vdpbf16ps on AVX512-BF16
    CPUs) for two rows or more. Its rows are not computed alike at every row count, which a draft
    may afford: it only ranks proposals, which the base model verifies."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        self.rows = PackedRows(linear.weight, own=True, tiles=tiles_available())

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows(x)


def replace_linears(module: nn.Module, kind: type[nn.Module] = Int8Linear) -> int:
    """Swap every nn.Linear inside `module` for kind(linear), in place; -> how many."""
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, kind(child))
                count += 1
    return count


def drafting_head(head: nn.Module) -> nn.Module:
    """The head as drafting runs it: int8 linears through Kestrel's kernels
    where they take every linear (they beat bf16 and float32 products at the
    row counts drafting uses, a few rows: on the reference Xeon a 1536 x 576
    linear at 1 and 8 rows took 33 and 54 us against torch's bf16 73 and 78),
    else torch's int8 kernel where its probe finds it faster (`available`),
    else the head itself. Decided by the kernels built, not by a timing, so
    every process of a machine drafts alike."""
    linears = _linears(head)
    if linears and (_own_takes_all(linears) or all(torch_kernel_takes(linear.weight) for linear in linears)):
        return with_int8_linears(head)
    return head


def _linears(module: nn.Module) -> list[nn.Linear]:
    return [child for child in module.modules() if isinstance(child, nn.Linear)]


def _own_takes_all(linears: list[nn.Linear]) -> bool:
    return all(own_kernel_takes(linear.weight) for linear in linears)


def with_int8_linears(module: nn.Module) -> nn.Module:
    """A copy of `module` (a draft head) whose nn.Linear layers are int8
    (DraftLinear where Kestrel's kernel is built and takes them, else
    Int8Linear); the original is untouched."""
    linears = _linears(module)
    shared = {id(tensor): tensor for linear in linears for tensor in linear.parameters()}
    own = _own_takes_all(linears)
    module = copy.deepcopy(module, memo=shared)  # linear weights are not copied, only replaced below
    replace_linears(module, DraftLinear if own else Int8Linear)
    return module


def is_quantized(model: nn.Module) -> bool:
    """Whether some of `model`'s linears run through torch's int8 or int4
    kernel (so compute with bf16 activations)."""
    return any(isinstance(module, QuantizedLinear) for module in model.modules())


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a model's products compute in: bf16 where its linears run
    through torch's int4/int8 kernels, else its embedding's dtype."""
    return torch.bfloat16 if is_quantized(model) else model.get_input_embeddings().weight.dtype


def quantize_decoder(model: nn.Module) -> int:
    """Int8 weights for every linear layer of a causal LM's decoder layers,
    in place; the embedding and the lm_head keep their precision (greedy
    choices and sampling read the exact lm_head). -> layers replaced."""
    return replace_linears(model.get_decoder().layers)


def kernel_of(module: nn.Module) -> str | None:
    """Which kernel reads a module's int8 linears: "kestrel-amx", "kestrel-bf16" (the tile layout with
    vdpbf16ps), "kestrel", "torch", or None (none int8)."""
    for child in module.modules():
        if isinstance(child, DraftLinear):
            return ("kestrel-amx" if tile_unit() else "kestrel-bf16") if child.rows.tiles else "kestrel"
        if isinstance(child, Int8Linear):
            return "torch"
    return None
