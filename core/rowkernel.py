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
        for (int64_t i = 0; i < n; ++i) {
            const uint32_t bits = uint32_t(p[i].bits) << 16;
            std::memcpy(out + i, &bits, sizeof(T));
        }
        return out;
    }
}

// One (row, head): softmax(q k^T * scale) v over the row's keys, in key order.
template <typename S, typename T = typename Compute<S>::type>
static void head(const S* qs, const S* kb, const S* vb, int64_t kv_pos, int64_t dim, int64_t lead,
                 const int64_t* extra, int64_t count, T scale, T* scores, T* acc, T* wide, T* o) {
    T* kw = wide + dim;  // room for four widened keys (or one value)
    const T* qv = widened<S>(qs, dim, wide);
    T best = -INFINITY;
    int64_t j = 0;
    for (; j + 4 <= count; j += 4) {
        const T* b[4];
        for (int i = 0; i < 4; ++i)
            b[i] = widened<S>(kb + (j + i < lead ? j + i : extra[j + i - lead]) * kv_pos, dim, kw + i * dim);
        T s[4];
        dot4(qv, b[0], b[1], b[2], b[3], dim, s);
        for (int i = 0; i < 4; ++i) {
            scores[j + i] = s[i] * scale;
            if (scores[j + i] > best) best = scores[j + i];
        }
    }
    for (; j < count; ++j) {
        const int64_t pos = j < lead ? j : extra[j - lead];
        const T s = dot(qv, widened<S>(kb + pos * kv_pos, dim, kw), dim) * scale;
        scores[j] = s;
        if (s > best) best = s;
    }
    T total = 0;
    for (int64_t j = 0; j < count; ++j) {
        scores[j] = std::exp(scores[j] - best);
        total += scores[j];
    }
    for (int64_t d = 0; d < dim; ++d) acc[d] = 0;
    for (int64_t j = 0; j < count; ++j) {
        const int64_t pos = j < lead ? j : extra[j - lead];
        const T* vv = widened<S>(vb + pos * kv_pos, dim, kw);
        const T w = scores[j];
        for (int64_t d = 0; d < dim; ++d) acc[d] += w * vv[d];
    }
    for (int64_t d = 0; d < dim; ++d) o[d] = acc[d] / total;
}

// Every (row, head) is computed whole by one thread with the same loops, so
// the result depends neither on the other rows nor on the thread count.
// `out` (1, T, H, D) is in the compute type.
template <typename S, typename T = typename Compute<S>::type>
static void rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* prefix,
                 const int64_t* offsets, const int64_t* extra, double scale, at::Tensor& out) {
    const int64_t n_rows = q.size(2), heads = q.size(1), kv_heads = k.size(1), dim = q.size(3);
    const int64_t q_row = q.stride(2), q_head = q.stride(1), kv_head = k.stride(1), kv_pos = k.stride(2);
    const int64_t group = heads / kv_heads;
    const S* qp = static_cast<const S*>(q.data_ptr());
    const S* kp = static_cast<const S*>(k.data_ptr());
    const S* vp = static_cast<const S*>(v.data_ptr());
    T* op = out.data_ptr<T>();
    int64_t longest = 1;
    for (int64_t r = 0; r < n_rows; ++r)
        longest = std::max(longest, prefix[r] + offsets[r + 1] - offsets[r]);
    at::parallel_for(0, n_rows * heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<T> scores(longest), acc(dim), wide(5 * dim);
        for (int64_t item = begin; item < end; ++item) {
            const int64_t r = item / heads, h = item % heads;
            const int64_t lead = prefix[r], first = offsets[r], count = lead + offsets[r + 1] - first;
            head<S>(qp + r * q_row + h * q_head, kp + (h / group) * kv_head, vp + (h / group) * kv_head, kv_pos, dim,
                    lead, extra + first, count, (T)scale, scores.data(), acc.data(), wide.data(),
                    op + (r * heads + h) * dim);
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
