"""Int4 weights on CPUs: the bundled GGUF's own 4-bit format.

GGUF's Q4_1 stores each block of 32 weights along a row as a scale d, a
minimum m and 4-bit codes q, meaning d*q + m. Rather than parse the blocks,
the weights transformers dequantized are quantized again per group from their
minimum and maximum: a Q4_1 block holds codes 0 and 15 at its minimum and
maximum, so this finds d and m again (tests/test_int8.py).

Two kernels read them, chosen once per process:
- Kestrel's own (`Q4Linear`, the C++ below, built once with the system's
  compiler against the installed torch): float32 activations, d and m in
  float32, so it computes the GGUF's weights times the activations with
  float32 rounding only. Each output element is one thread's two fixed
  accumulators over the groups in order, so a row's result does not depend
  on how many rows share the call; the weights of a group are unpacked once
  for up to four rows. Measured on the 2-core AVX2 machine over a whole
  step's layers (30 x 7 products of SmolLM2-135M, more than the caches hold):
  8.1 ms for one row against 10.0 in torch's kernel, 12.1 against 13.7 for
  four, 21.0 against 24.7 for eight. Where the compiler targets AVX-512, a
  group is two 16-lane vectors: on a 2-core AVX-512 Xeon a step's products
  took 5.8 ms for one row (7.2 in the AVX2 build) and 13.7 for eight (18.3).
- On CPUs with AMX tiles (Intel Xeons since Sapphire Rapids), a bf16 layer
  runs on the tile unit instead (`tiles`): the bf16 activations times the
  codes themselves, which bf16 holds exactly, so each group's tile product is
  the float32 sum of exact products, and d and m follow in float32. The codes
  are unpacked to bf16 a few groups ahead of the tile products; a tile takes
  up to 16 rows at once, each computed alone, so extra rows cost little. On
  the 2-core reference Xeon, a step's products: 1 row 5.9 -> 3.9 ms, 16 rows
  20.3 -> 7.0 ms, a 300-token prefill 321 -> 94 ms. A float32 layer keeps the
  vector kernel: each layer runs one kernel for every row count.
- On CPUs with AVX512-BF16 but no AMX (AMD's since Zen 4), the same layout
  and arithmetic run with vdpbf16ps: a group's codes for 16 columns are
  unpacked to bf16 once for all rows, and each row's product with them is
  two chains of pair products in float32 lanes (`dot_columns`). On the 2-core
  AVX-512 EPYC, a step's products: 1 row 4.3 -> 3.1 ms against the float32
  vectors, 8 rows 8.0 -> 5.8, 16 rows 13.6 -> 9.8; with the groups 16 ahead
  prefetched (`PREFETCH`), 1 row 2.9 -> 2.4 ms and 8 rows 5.5 -> 4.3 more.
- torch's (`Int4Linear`, `_weight_int4pack_mm_for_cpu`), where the C++ one
  cannot be built: bf16 activations, and d and m rounded to bf16 (torch means
  (q - 8)*scale + zero, so scale = d and zero = m + 8d). It also computes
  every row alone.
"""

from __future__ import annotations

import os
import threading

import torch
from torch import nn

from core import native
from models import int8

GROUP = 32  # weights per scale and zero, along the input dimension (Q4_0/Q4_1's block)
# general.file_type MOSTLY_Q4_1: the one 4-bit GGUF whose blocks quantizing again gives back exactly.
# Q4_0's blocks (d * (q - 8)) seldom hold both codes 0 and 15, and Q4_K's mix in 6-bit tensors: quantized
# again from their minimum and maximum, about half of Q4_0's weights move (by some 4% of their rms).
GGUF_Q4_1 = 3


SOURCE = native.BLOCKS + native.TILES + r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

// codes (N, G, 16) uint8: byte j of a group holds element j (low nibble) and
// element j + 16 (high nibble); d, m (N, G) float32; weight = d * code + m.

// A group's 32 weights, d * code + m, as 32 / LANES vectors in element order.
#ifdef __AVX512F__
static inline void dequantize(__m128i lo, __m128i hi, vec scale, vec base, vec* w) {
    w[0] = vfma(scale, vfrom_u8(lo), base);
    w[1] = vfma(scale, vfrom_u8(hi), base);
}
#else
static inline void dequantize(__m128i lo, __m128i hi, vec scale, vec base, vec* w) {
    w[0] = vfma(scale, vfrom_u8(lo), base);
    w[1] = vfma(scale, vfrom_u8(_mm_srli_si128(lo, 8)), base);
    w[2] = vfma(scale, vfrom_u8(hi), base);
    w[3] = vfma(scale, vfrom_u8(_mm_srli_si128(hi, 8)), base);
}
#endif

// C output columns times RB rows. Every output element gets the same
// operations in the same order whatever C, RB and the other rows are: two
// accumulators (the group's vectors alternating between them) over the
// groups in order, then the fixed-order sum of their sum.
template <int C, int RB>
static inline void block(int64_t n0, int64_t r0, int64_t G, int64_t K, int64_t N, const uint8_t* codes,
                         const float* d, const float* m, const float* x, float* out) {
    constexpr int W = 32 / LANES;  // vectors per group
    const __m128i low = _mm_set1_epi8(0x0F);
    vec a[C][RB], b[C][RB];
    for (int c = 0; c < C; ++c)
        for (int r = 0; r < RB; ++r) a[c][r] = b[c][r] = vzero();
    for (int64_t g = 0; g < G; ++g) {
        for (int c = 0; c < C; ++c) {
            const int64_t at = (n0 + c) * G + g;
            const __m128i raw = _mm_loadu_si128((const __m128i*)(codes + at * 16));
            vec w[W];
            dequantize(_mm_and_si128(raw, low), _mm_and_si128(_mm_srli_epi16(raw, 4), low), vset1(d[at]), vset1(m[at]), w);
            for (int r = 0; r < RB; ++r) {
                const float* xr = x + (r0 + r) * K + g * 32;
                for (int i = 0; i < W; ++i) {
                    vec& acc = i % 2 ? b[c][r] : a[c][r];
                    acc = vfma(w[i], vload(xr + i * LANES), acc);
                }
            }
        }
    }
    for (int c = 0; c < C; ++c)
        for (int r = 0; r < RB; ++r) out[(r0 + r) * N + n0 + c] = vsum(a[c][r], b[c][r]);
}

at::Tensor q4_linear(const at::Tensor& input, const at::Tensor& codes_t, const at::Tensor& d_t, const at::Tensor& m_t) {
    TORCH_CHECK(input.dim() == 2 && codes_t.dim() == 3 && codes_t.size(2) == 16, "q4_linear: x (R, K), codes (N, K/32, 16)");
    TORCH_CHECK(codes_t.scalar_type() == at::kByte && d_t.scalar_type() == at::kFloat && m_t.scalar_type() == at::kFloat,
                "q4_linear: codes uint8, d and m float32");
    TORCH_CHECK(codes_t.is_contiguous() && d_t.is_contiguous() && m_t.is_contiguous(), "q4_linear: contiguous weights");
    const at::Tensor x = input.to(at::kFloat).contiguous();
    const int64_t R = x.size(0), K = x.size(1), N = codes_t.size(0), G = codes_t.size(1);
    TORCH_CHECK(K == G * 32 && d_t.size(0) == N && d_t.size(1) == G && m_t.sizes() == d_t.sizes(), "q4_linear: shapes");
    at::Tensor result = at::empty({R, N}, x.options());
    const uint8_t* codes = codes_t.data_ptr<uint8_t>();
    const float *d = d_t.data_ptr<float>(), *m = m_t.data_ptr<float>(), *xp = x.data_ptr<float>();
    float* out = result.data_ptr<float>();
    // columns are split between threads; each element is computed by one thread
    at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
        each_block(R, begin, end, [&](auto c, auto rb, int64_t n, int64_t r) {
            block<decltype(c)::value, decltype(rb)::value>(n, r, G, K, N, codes, d, m, xp, out);
        });
    });
    return result;
}


// AMX (Intel's tile unit, where the compiler targets it): bf16 activations times the codes
// themselves, whole numbers 0..15 that bf16 holds exactly, so a tile product of a group is the
// float32 sum of exact products; d and m come after, in float32: out += d * (x . codes) + m * sum(x).
// tiles (N/16, G, 256) uint8: a group's codes for 16 columns as one B tile (16 rows of 16 column
// pairs): byte j of 32-byte chunk c holds row 2c's word j (low nibble) and row 2c+1's (high), word j
// of row p being the code of element 2p + (j & 1) of column j >> 1. d, m (N/16, G, 16) float32.
// A row's result does not depend on the other rows of its tile (the unit computes each row alone)
// nor on how many there are: every row gets the same operations in the same order.
#ifdef KESTREL_DOTS
// a group's codes for 16 columns (256 bytes of the tile layout) -> the B tile's 16 rows of bf16 words
static inline void unpack_tile(const uint8_t* src, uint16_t* dst, __m512i bf16_of_code) {
    const __m512i low = _mm512_set1_epi16(0x0F);
    for (int c = 0; c < 8; ++c) {
        const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(src + 32 * c)));
        _mm512_store_si512(dst + 64 * c, _mm512_permutexvar_epi16(_mm512_and_si512(words, low), bf16_of_code));
        _mm512_store_si512(dst + 64 * c + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), bf16_of_code));
    }
}

// bf16 of the codes 0..15, for _mm512_permutexvar_epi16 (exact: whole numbers below 256)
static inline __m512i code_table() {
    alignas(64) uint16_t table[32];
    for (int v = 0; v < 32; ++v) {
        const float f = float(v & 15);
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        table[v] = uint16_t(bits >> 16);
    }
    return _mm512_load_si512(table);
}

// each row's group sums of x (R, K) bf16 (float32, one fixed order) -> sums (R * K/32)
static inline void group_sums(const uint16_t* xp, int64_t count, float* sums) {
    for (int64_t i = 0; i < count; ++i) {
        const __m512i raw = _mm512_loadu_si512((const void*)(xp + i * 32));
        const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
        const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
        sums[i] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
}

// The same product without the tile unit (AVX512-BF16 CPUs without AMX, or refused the tile
// state): a group's codes for 16 columns are unpacked to bf16 once for all R rows; each row's
// product with them is two chains of vdpbf16ps over the group's 16 element pairs (even pairs,
// odd pairs, each pair's two exact products added to its lane), the chains added, then d and m
// as on the tiles. Every row gets these operations in this order, whatever R.
static void dot_columns(int64_t t, int64_t R, const uint16_t* x, int64_t K, const float* sums, const uint8_t* tiles,
                        const float* d, const float* m, int64_t G, int64_t N, float* out, float* acc, __m512i bf16_of_code) {
    alignas(64) uint16_t b[512];
    for (int64_t r = 0; r < R; ++r) _mm512_store_ps(acc + 16 * r, _mm512_setzero_ps());
    for (int64_t g = 0; g < G; ++g) {
        const int64_t i = t * G + g;
        if (i + PREFETCH < N / 16 * G) {  // codes, d and m of a group further on (core/native.py)
            prefetch_lines(tiles + (i + PREFETCH) * 256, 4);
            prefetch_lines(d + (i + PREFETCH) * 16, 1);
            prefetch_lines(m + (i + PREFETCH) * 16, 1);
        }
        unpack_tile(tiles + i * 256, b, bf16_of_code);
        __m512i w[16];
        for (int p = 0; p < 16; ++p) w[p] = _mm512_load_si512(b + 32 * p);
        const __m512 scale = _mm512_loadu_ps(d + i * 16), base = _mm512_loadu_ps(m + i * 16);
        for (int64_t r = 0; r < R; ++r) {
            const int32_t* pairs = (const int32_t*)(x + r * K + g * 32);
            __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
            for (int p = 0; p < 16; p += 2) {
                even = _mm512_dpbf16_ps(even, (__m512bh)_mm512_set1_epi32(pairs[p]), (__m512bh)w[p]);
                odd = _mm512_dpbf16_ps(odd, (__m512bh)_mm512_set1_epi32(pairs[p + 1]), (__m512bh)w[p + 1]);
            }
            __m512 a = _mm512_load_ps(acc + 16 * r);
            a = _mm512_fmadd_ps(scale, _mm512_add_ps(even, odd), a);
            a = _mm512_fmadd_ps(base, _mm512_set1_ps(sums[r * G + g]), a);
            _mm512_store_ps(acc + 16 * r, a);
        }
    }
    for (int64_t r = 0; r < R; ++r) _mm512_storeu_ps(out + r * N + t * 16, _mm512_load_ps(acc + 16 * r));
}
#endif

#ifdef KESTREL_TILES
constexpr int AHEAD = 3;  // groups unpacked ahead of the tile product: the unit loads B only once its stores land
constexpr int LAG = 2;    // groups between a tile product and reading its stored result
constexpr int RING = 4;

// M rows from r0, the column tiles [t0, t1): a software pipeline over the (tile, group) pairs
template <int M>
static void amx_rows(int64_t r0, int64_t t0, int64_t t1, const uint16_t* x, int64_t K, const float* sums, const uint8_t* tiles,
                     const float* d, const float* m, int64_t G, int64_t N, float* out, __m512i bf16_of_code) {
    alignas(64) uint16_t b[RING][512];
    alignas(64) float c[RING][16 * 16];
    const int64_t first = t0 * G, last = t1 * G;
    __m512 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t i = first; i < first + AHEAD && i < last; ++i) unpack_tile(tiles + i * 256, b[i % RING], bf16_of_code);
    for (int64_t i = first; i < last + LAG; ++i) {
        if (i < last) {
            const int64_t g = i % G;
            _tile_loadd(2, b[i % RING], 64);
            _tile_loadd(1, x + r0 * K + g * 32, K * 2);
            _tile_zero(0);
            _tile_dpbf16ps(0, 1, 2);
            _tile_stored(0, c[i % RING], 64);
            if (i + AHEAD < last) unpack_tile(tiles + (i + AHEAD) * 256, b[(i + AHEAD) % RING], bf16_of_code);
        }
        const int64_t j = i - LAG;
        if (j >= first) {
            const int64_t g = j % G;
            const __m512 scale = _mm512_loadu_ps(d + j * 16), base = _mm512_loadu_ps(m + j * 16);
            const float* products = c[j % RING];
            for (int r = 0; r < M; ++r) {
                acc[r] = _mm512_fmadd_ps(scale, _mm512_load_ps(products + 16 * r), acc[r]);
                acc[r] = _mm512_fmadd_ps(base, _mm512_set1_ps(sums[(r0 + r) * G + g]), acc[r]);
            }
            if (g == G - 1) {
                const int64_t n = (j / G) * 16;
                for (int r = 0; r < M; ++r) {
                    _mm512_storeu_ps(out + (r0 + r) * N + n, acc[r]);
                    acc[r] = _mm512_setzero_ps();
                }
            }
        }
    }
}

template <int M = 1>
static inline void amx_dispatch(int rows, int64_t r0, int64_t t0, int64_t t1, const uint16_t* x, int64_t K, const float* sums,
                                const uint8_t* tiles, const float* d, const float* m, int64_t G, int64_t N, float* out, __m512i table) {
    if constexpr (M <= 16) {
        if (rows == M) return amx_rows<M>(r0, t0, t1, x, K, sums, tiles, d, m, G, N, out, table);
        amx_dispatch<M + 1>(rows, r0, t0, t1, x, K, sums, tiles, d, m, G, N, out, table);
    }
}

#endif

#ifdef KESTREL_DOTS
static bool tiles_ready() { return true; }  // the tile layout runs here: on the tile unit or with vdpbf16ps

// on the tile unit where this process may use it, else with vdpbf16ps (dot_columns)
at::Tensor q4_tiles(const at::Tensor& input, const at::Tensor& tiles_t, const at::Tensor& d_t, const at::Tensor& m_t) {
    TORCH_CHECK(input.dim() == 2 && input.scalar_type() == at::kBFloat16, "q4_tiles: x (R, K) bf16");
    TORCH_CHECK(tiles_t.dim() == 3 && tiles_t.size(2) == 256 && tiles_t.scalar_type() == at::kByte && tiles_t.is_contiguous(),
                "q4_tiles: tiles (N/16, K/32, 256) uint8");
    TORCH_CHECK(d_t.scalar_type() == at::kFloat && m_t.scalar_type() == at::kFloat && d_t.is_contiguous() && m_t.is_contiguous(),
                "q4_tiles: d and m float32");
    const at::Tensor x = input.contiguous();
    const int64_t R = x.size(0), K = x.size(1), T = tiles_t.size(0), G = tiles_t.size(1), N = T * 16;
    TORCH_CHECK(K == G * 32 && d_t.size(0) == T && d_t.size(1) == G && d_t.size(2) == 16 && m_t.sizes() == d_t.sizes(), "q4_tiles: shapes");
    const uint16_t* xp = (const uint16_t*)x.data_ptr();
    std::vector<float> sums(R * G);
    group_sums(xp, R * G, sums.data());
    at::Tensor result = at::empty({R, N}, x.options().dtype(at::kFloat));
    const uint8_t* tiles = tiles_t.data_ptr<uint8_t>();
    const float *d = d_t.data_ptr<float>(), *m = m_t.data_ptr<float>();
    float* out = result.data_ptr<float>();
#ifdef KESTREL_TILES
    if (tiles_permitted()) {
        at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
            const __m512i bf16_of_code = code_table();
            for (int64_t r0 = 0; r0 < R; r0 += 16) {
                const int rows = int(std::min<int64_t>(16, R - r0));
                configure_tiles({rows, rows, 16});  // 0: C (rows x 16 float), 1: A (rows x 32 bf16), 2: B (16 x 32 bf16)
                amx_dispatch(rows, r0, t0, t1, xp, K, sums.data(), tiles, d, m, G, N, out, bf16_of_code);
            }
            _tile_release();
        });
        return result;
    }
#endif
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
        const __m512i bf16_of_code = code_table();
        std::vector<float> storage;
        float* acc = row_accumulators(storage, R);
        for (int64_t t = t0; t < t1; ++t) dot_columns(t, R, xp, K, sums.data(), tiles, d, m, G, N, out, acc, bf16_of_code);
    });
    return result;
}
#else
static bool tiles_ready() { return false; }
at::Tensor q4_tiles(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
    TORCH_CHECK(false, "q4_tiles: built without AVX512-BF16");
}
#endif

TORCH_LIBRARY_FRAGMENT(kestrel_q4, lib) {
    lib.def("linear(Tensor x, Tensor codes, Tensor d, Tensor m) -> Tensor");
    lib.def("tiles(Tensor x, Tensor tiles, Tensor d, Tensor m) -> Tensor");
    lib.def("tiles_ready() -> bool", &tiles_ready);  // no tensors to dispatch on: a catch-all
    lib.def("tile_unit() -> bool", &tiles_permitted);
}
TORCH_LIBRARY_IMPL(kestrel_q4, CPU, lib) {
    lib.impl("linear", &q4_linear);
    lib.impl("tiles", &q4_tiles);
}
"""

_lock = threading.Lock()
_built: bool | None = None


def own_kernel() -> bool:
    """Whether Kestrel's int4 kernel is built and registered (building it on
    first use: about 10 s, then cached); False where it cannot be."""
    global _built
    if _built is not None:
        return _built
    with _lock:
        if _built is None:
            _built = _load()
    return _built


def _load() -> bool:
    if os.environ.get("KESTREL_INT4_KERNEL", "1") == "0":
        return False
    if not hasattr(torch.ops.kestrel_q4, "linear"):
        if not native.load_operator("int4", SOURCE, "Int4 weights through torch's kernel"):
            return False

        @torch.library.register_fake("kestrel_q4::linear")
        def _(x, codes, d, m):
            return x.new_empty((x.shape[0], codes.shape[0]), dtype=torch.float32)

        @torch.library.register_fake("kestrel_q4::tiles")
        def _(x, tiles, d, m):
            return x.new_empty((x.shape[0], tiles.shape[0] * 16), dtype=torch.float32)

    return True


def torch_kernel(device: torch.device) -> bool:
    ops = torch.ops.aten
    return device.type == "cpu" and hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


def kernel_available(device: torch.device) -> bool:
    return device.type == "cpu" and (own_kernel() or torch_kernel(device))


def fits(model: nn.Module) -> bool:
    """Whether the kernel takes every decoder linear: input sizes a whole number
    of groups, output sizes a multiple of 16 (the packer's tile)."""
    layers = int8.decoder_layers(model)
    if layers is None:
        return False
    linears = [module for module in layers.modules() if isinstance(module, nn.Linear)]
    return all(module.in_features % GROUP == 0 and module.out_features % 16 == 0 for module in linears)


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight (N, K) -> (codes (N, K/32, 16) uint8 as Kestrel's kernel reads
    them, d (N, K/32), m (N, K/32) float32): asymmetric per group of 32 along K."""
    rows, columns = weight.shape
    groups = weight.detach().float().reshape(rows, columns // GROUP, GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp_min(1e-30)
    codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return packed.contiguous(), scale.contiguous(), low.contiguous()


def dequantize_blocks(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The float32 weights (N, K) that Kestrel's kernel multiplies by."""
    values = torch.cat([codes & 15, codes >> 4], dim=-1).float()
    return torch.addcmul(m[..., None], d[..., None], values).reshape(codes.shape[0], -1)


def tiles_available() -> bool:
    """Whether Kestrel's product in the tile layout runs here: the kernel built
    for a CPU with AVX512-BF16 (on AMX tiles where Linux grants this process
    the tile state, else with vdpbf16ps)."""
    return own_kernel() and bool(torch.ops.kestrel_q4.tiles_ready())


def tile_unit() -> bool:
    """Whether that product runs on the AMX tile unit (KESTREL_AMX=0: no, core/native.py)."""
    return own_kernel() and bool(torch.ops.kestrel_q4.tile_unit())


def pack_tiles(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes (N, G, 16), d, m (N, G)) as `quantize_blocks` gives them -> the
    AMX layout: (tiles (N/16, G, 256) uint8, d, m (N/16, G, 16) float32)."""
    rows, groups, _ = codes.shape
    q = torch.cat([codes & 15, codes >> 4], dim=-1).reshape(rows // 16, 16, groups, 16, 2)  # [t, n, g, p, e]: element 2p + e
    words = q.permute(0, 2, 3, 1, 4).reshape(rows // 16, groups, 8, 2, 32)  # [t, g, chunk, row 2c + h, word 2n + e]
    tiles = words[:, :, :, 0] | (words[:, :, :, 1] << 4)
    per_tile = lambda v: v.reshape(rows // 16, 16, groups).transpose(1, 2).contiguous()  # noqa: E731
    return tiles.reshape(rows // 16, groups, 256).contiguous(), per_tile(d), per_tile(m)


def unpack_tiles(tiles: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack_tiles` undone: -> (codes (N, G, 16), d, m (N, G))."""
    count, groups, _ = tiles.shape
    words = tiles.reshape(count, groups, 8, 1, 32)
    q = torch.cat([words & 15, words >> 4], dim=3).reshape(count, groups, 16, 16, 2)  # [t, g, p, n, e]
    q = q.permute(0, 3, 1, 2, 4).reshape(count * 16, groups, 32)
    per_row = lambda v: v.transpose(1, 2).reshape(count * 16, groups).contiguous()  # noqa: E731
    return (q[..., :16] | (q[..., 16:] << 4)).contiguous(), per_row(d), per_row(m)


class Q4Linear(nn.Module):
    """A frozen nn.Linear whose weights Kestrel's int4 kernel reads: in the
    tile layout (bf16 activations) for a bf16 layer where the CPU has
    AVX512-BF16, else with float32 vectors. One layer always runs one kernel."""

    def __init__(self, linear: nn.Linear, tiles: bool | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.tiles = (linear.weight.dtype == torch.bfloat16 and tiles_available()) if tiles is None else tiles
        codes, d, m = quantize_blocks(linear.weight)
        if self.tiles:
            codes, d, m = pack_tiles(codes, d, m)
        self.register_buffer("codes", codes)
        self.register_buffer("d", d)
        self.register_buffer("m", m)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())

    def weight(self) -> torch.Tensor:
        """The float32 weights (N, K) the kernel multiplies by."""
        return dequantize_blocks(*(unpack_tiles(self.codes, self.d, self.m) if self.tiles else (self.codes, self.d, self.m)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.tiles:
            out = torch.ops.kestrel_q4.tiles(flat.to(torch.bfloat16), self.codes, self.d, self.m)
        else:
            out = torch.ops.kestrel_q4.linear(flat, self.codes, self.d, self.m)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], -1).to(x.dtype)


class TileRows:
    """A weight (N, K) as 4-bit groups in the tile layout, for drafting (the draft
    vocabulary: a quarter of bf16's bytes to read): rows padded to a multiple
    of 16, any activation dtype (rounded to bf16)."""

    def __init__(self, weight: torch.Tensor):
        self.rows = weight.shape[0]
        padded = torch.zeros(-(-self.rows // 16) * 16, weight.shape[1], dtype=torch.float32)
        padded[: self.rows] = weight.detach().float()
        self.tiles = pack_tiles(*quantize_blocks(padded))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (m, K) -> (m, N) float32."""
        return torch.ops.kestrel_q4.tiles(x.to(torch.bfloat16).contiguous(), *self.tiles)[:, : self.rows]


def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) -> (torch's packed codes, bf16 scale_and_zeros (K/32, N, 2)),
    asymmetric per group of 32 along K."""
    rows, columns = weight.shape
    groups = weight.detach().float().reshape(rows, columns // GROUP, GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp_min(1e-30).to(torch.bfloat16)
    zero = (low + 8 * scale.float()).to(torch.bfloat16)
    codes = ((groups - zero.float()[..., None]) / scale.float()[..., None] + 8).round().clamp(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.reshape(rows, columns).to(torch.int32), 1)
    return packed, torch.stack([scale.T, zero.T], dim=-1).contiguous()


class Int4Linear(int8.QuantizedLinear):
    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        packed, scale_and_zeros = quantize_groups(linear.weight)
        self.register_buffer("packed", packed)
        self.register_buffer("scale_and_zeros", scale_and_zeros)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scale_and_zeros)


def kernel_of(model: nn.Module) -> str | None:
    """Which kernel reads a model's int4 weights: "kestrel-amx", "kestrel-bf16"
    (the tile layout with vdpbf16ps), "kestrel", "torch", or None (no int4 layers)."""
    for module in model.modules():
        if isinstance(module, Q4Linear):
            return ("kestrel-amx" if tile_unit() else "kestrel-bf16") if module.tiles else "kestrel"
        if isinstance(module, Int4Linear):
            return "torch"
    return None


def quantize_decoder(model: nn.Module) -> int:
    """Int4 weights for every linear layer of a causal LM's decoder layers, in
    place, read by Kestrel's kernel where it builds, else by torch's; the
    embedding and the lm_head keep their precision. -> layers replaced."""
    return int8.replace_linears(model.get_decoder().layers, Q4Linear if own_kernel() else Int4Linear)


def gguf_is_q4_1(path) -> bool:
    """Whether a GGUF file's weights are mostly Q4_1 blocks (its general.file_type), which int4 holds exactly."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(path)).fields["general.file_type"]
        return int(field.parts[field.data[0]][0]) == GGUF_Q4_1
    except Exception:  # an unreadable or unusual header: not known to be 4-bit
        return False
