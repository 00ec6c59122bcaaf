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

The source is compiled once against the installed torch (core/native.py)
and registered as a torch operator; its (row, head) pairs are shared out
among torch's threads, each pair computed whole by one thread. Where no
compiler is found, or the build fails, the torch implementation in
core/attention.py is used."""

from __future__ import annotations

import os
import threading

import torch

from core import native

SOURCE = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
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
    else if (q.scalar_type() == at::kBFloat16)
        rows<bf16>(q, k, v, p, o, e, scale, out);
    else
        TORCH_CHECK(false, "rows attention: float32, float64 or bfloat16 only");
    return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());  // bf16: each element rounded once
}

TORCH_LIBRARY_FRAGMENT(kestrel_rows, lib) {
    lib.def("attend(Tensor q, Tensor k, Tensor v, Tensor prefix, Tensor offsets, Tensor extra, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(kestrel_rows, CPU, lib) { lib.impl("attend", &attend); }
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
    if not registered and not native.load_operator("rows", SOURCE, "Row-invariant attention in torch"):
        return None
    return torch.ops.kestrel_rows.attend


def covers(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel computes attention in this dtype on this device (and is built)."""
    return dtype in DTYPES and device.type == "cpu" and library() is not None


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
