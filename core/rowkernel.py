"""A small C++ kernel for the row-invariant attention (core/attention.py).

Each query row attends to its own list of keys: a leading run of the cache
(positions 0..prefix-1) followed by a few more positions (a tree node's
ancestors and itself). The kernel computes every (row, head) with the same
loops in the same order whatever the other rows are: the dot products with
eight fixed partial sums, the softmax and the weighted sum of values in key
order. So a row's result depends only on its query and its key sequence,
and a tree node gets bit for bit what a one-token step over the same keys
gets. It replaces about a dozen small torch operations per row and layer
with one call per layer.

The source is compiled once (core/native.py) and loaded with ctypes,
which releases the GIL during the call. Where no compiler is found, or the
build fails, the torch implementation in core/attention.py is used."""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import torch

from core import native

log = logging.getLogger("kestrel")

SOURCE = r"""
#include <cmath>
#include <cstdint>
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

template <typename T>
static void rows(const T* q, int64_t q_row, int64_t q_head,
                 const T* k, const T* v, int64_t kv_head, int64_t kv_pos,
                 int64_t n_rows, int64_t heads, int64_t kv_heads, int64_t dim,
                 const int64_t* prefix, const int64_t* offsets, const int64_t* extra,
                 double scale, T* out) {
    const int64_t group = heads / kv_heads;
    std::vector<T> scores;
    std::vector<T> acc(dim);
    for (int64_t r = 0; r < n_rows; ++r) {
        const int64_t lead = prefix[r], first = offsets[r], count = lead + offsets[r + 1] - first;
        scores.resize(count);
        for (int64_t h = 0; h < heads; ++h) {
            const T* qv = q + r * q_row + h * q_head;
            const T* kb = k + (h / group) * kv_head;
            const T* vb = v + (h / group) * kv_head;
            T best = -INFINITY;
            for (int64_t j = 0; j < count; ++j) {
                const int64_t pos = j < lead ? j : extra[first + j - lead];
                const T s = dot(qv, kb + pos * kv_pos, dim) * (T)scale;
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
                const int64_t pos = j < lead ? j : extra[first + j - lead];
                const T* vv = vb + pos * kv_pos;
                const T w = scores[j];
                for (int64_t d = 0; d < dim; ++d) acc[d] += w * vv[d];
            }
            T* o = out + (r * heads + h) * dim;
            for (int64_t d = 0; d < dim; ++d) o[d] = acc[d] / total;
        }
    }
}

extern "C" {
void kestrel_rows_f32(const float* q, int64_t q_row, int64_t q_head, const float* k, const float* v,
                      int64_t kv_head, int64_t kv_pos, int64_t n_rows, int64_t heads, int64_t kv_heads,
                      int64_t dim, const int64_t* prefix, const int64_t* offsets, const int64_t* extra,
                      double scale, float* out) {
    rows<float>(q, q_row, q_head, k, v, kv_head, kv_pos, n_rows, heads, kv_heads, dim, prefix, offsets, extra, scale, out);
}
void kestrel_rows_f64(const double* q, int64_t q_row, int64_t q_head, const double* k, const double* v,
                      int64_t kv_head, int64_t kv_pos, int64_t n_rows, int64_t heads, int64_t kv_heads,
                      int64_t dim, const int64_t* prefix, const int64_t* offsets, const int64_t* extra,
                      double scale, double* out) {
    rows<double>(q, q_row, q_head, k, v, kv_head, kv_pos, n_rows, heads, kv_heads, dim, prefix, offsets, extra, scale, out);
}
}
"""
FLAGS = [*native.FLAGS, "-std=c++17"]
DTYPES = {torch.float32: "kestrel_rows_f32", torch.float64: "kestrel_rows_f64"}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def library() -> ctypes.CDLL | None:
    """The built kernel, building it on first use (about a second); None where it cannot be built."""
    global _library, _tried
    if _tried:  # the common case, without the lock
        return _library
    with _lock:
        if _tried:
            return _library
        _tried = True
        if os.environ.get("KESTREL_ROW_KERNEL", "1") == "0":
            return None
        path = native.build("rows", SOURCE, FLAGS, "Row-invariant attention in torch")
        if path is None:
            return None
        try:
            loaded = ctypes.CDLL(str(path))
            for name in DTYPES.values():
                function = getattr(loaded, name)
                function.restype = None
                function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_double, ctypes.c_void_p]  # fmt: skip
            _library = loaded
        except (OSError, AttributeError) as error:
            log.warning(f"Row-invariant attention in torch: loading its kernel failed ({type(error).__name__}: {error})")
        return _library


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
    _, heads, count, dim = query.shape
    kv_heads = key.shape[1]
    out = query.new_empty(1, count, heads, dim)
    getattr(library(), DTYPES[query.dtype])(
        query.data_ptr(), query.stride(2), query.stride(1), key.data_ptr(), value.data_ptr(),
        key.stride(1), key.stride(2), count, heads, kv_heads, dim,
        rows.prefix.data_ptr(), rows.offsets.data_ptr(), rows.extra.data_ptr(), float(scale), out.data_ptr(),
    )  # fmt: skip
    return out
