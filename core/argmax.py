"""Exact greedy argmax of the lm_head at a fraction of its full-precision cost.

An int8 product (models/int8.py: a quarter of float32's bytes to read) ranks
every token; the best few are recomputed in the model's precision; a
rounding-error bound then proves that no other token can beat them. Where the
bound cannot prove it (a near-tie), the full-precision logits decide. So the
result always equals argmax(lm_head(h)) in full precision.

Bound, for token t with exact weights w_t, int8 weights w'_t = scale_t * q_t
and quantization error e_t = w_t - w'_t (known, so its norm is stored):
  |w_t . h - w'_t . h| <= ||e_t|| ||h||                      (Cauchy-Schwarz)
plus the product's own rounding, which depends on the kernel:
- Kestrel's (float32 activations and accumulation): h rounded to float32
  (exact for a float32 model), K products accumulated and one scaling, so
  |rough_t - w'_t . h| <= (K + 2) 2^-24 ||w'_t|| ||h||;
- torch's, where Kestrel's cannot be built: it rounds h to bf16 (relative
  error <= 2^-8 per element, so |w'_t . (h - bf16(h))| <= 2^-8 ||w'_t|| ||h||),
  accumulates in float32 (<= K 2^-24 ||w'_t|| ||h||) and rounds the result to
  bf16 (<= 2^-7 |rough_t|).
ERROR_SCALE doubles the sum for margin.

Where Kestrel's kernels are built for AVX2 without AVX-512, a screen of one
or two rows (every vanilla step, small trees) multiplies integers instead
(`int8.screen`, about 1.5x faster here): h is rounded to int8 per group of
32, h' = a p, and the kernel returns r = ||h - h'||. Its rough logit is
w'_t . h' up to float32 accumulation, so the bound gains
  |w'_t . h - w'_t . h'| <= ||w'_t|| r
and its rounding term covers ||h'|| <= ||h|| + r. Only the ranking changes:
the argmax is still proved over full-precision logits.

A bf16 lm_head is screened too, with Kestrel's kernel: its exact logits are
then float32 products of the bf16 weights and the bf16 features (both widened
exactly), the same for vanilla steps and tree nodes, so the bound above holds
as for float32 weights."""

from __future__ import annotations

from typing import NamedTuple

import torch

from models import int8

ERROR_SCALE = 2.0  # margin on the bound above
CANDIDATES = 16  # tokens recomputed exactly per row (proved the argmax for every row measured)
ONE_ROW_PROBE_ROWS = 4096  # lm_heads of at least this many tokens measure which kernel screens one row faster
INTEGER_ROWS = 2  # screens of at most this many rows use the integer product where it is built (more: no faster)
INTEGER_CONTENDERS = 1024  # more tokens than this left by an integer screen's bound (flat logits): screen in float32


class Rough(NamedTuple):
    """A row's screen: int8 logits (V,) float32, and ||h - h'||, how far the
    activations the screen multiplied were rounded from h (0 for float32
    activations)."""

    logits: torch.Tensor
    rounding: float


def exact_argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension. bf16/fp16 logits are upcast first: the
    upcast is exact (ties still go to the first index) and CPU argmax kernels
    run several times faster over float32 (1.4 ms against 0.3 ms for 16 rows
    of the 49k vocabulary here)."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return logits.argmax(dim=-1)


def _norms(weight: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, in float64: the norm of the quantization error weight - rounded
    (rounded = the int8 rows times their scales) and the norm of rounded. A
    slice of rows at a time: float64 copies of a whole vocabulary's weights
    are hundreds of MB, and allocating them was most of the screen's load time."""
    errors = torch.empty(len(weight), dtype=torch.float64, device=weight.device)
    norms = torch.empty_like(errors)
    for start in range(0, len(weight), chunk):
        wide = int8.dequantize(packed[start : start + chunk], scales[start : start + chunk]).to(torch.float64)
        errors[start : start + chunk] = (weight[start : start + chunk].to(torch.float64) - wide).norm(dim=1)
        norms[start : start + chunk] = wide.norm(dim=1)
    return errors, norms


class ScreenedArgmax:
    def __init__(self, lm_head: torch.nn.Module):
        weight = lm_head.weight.detach()
        self.lm_head = lm_head
        self.weight = weight  # (V, H) in the model's precision
        self.row_by_row = False  # set by an exact engine: unscreened rows one product each
        # Screening pays where the model computes in float32/float64 on a CPU
        # with Kestrel's int8 kernel (K a multiple of its step of 16), or
        # torch's where a probe finds that faster than float32, or in bf16
        # with Kestrel's kernel, and the head has no bias; elsewhere the
        # plain product is used.
        self.own = int8.own_kernel_takes(weight)
        self.enabled = lm_head.bias is None and (
            (weight.dtype in (torch.float32, torch.float64) and (self.own or int8.torch_kernel_takes(weight)))
            or (weight.dtype == torch.bfloat16 and self.own)
        )
        self.exact_dtype = torch.float32 if weight.dtype == torch.bfloat16 else weight.dtype  # what logits are computed in
        if self.enabled:
            # bf16 weights and features in the tile layout (AMX or vdpbf16ps): exact products summed in float32
            # as the vector kernel does, so the bound holds, plus the flushing of values below 2^-126 (`absolute`)
            tiles = weight.dtype == torch.bfloat16 and self.own and int8.tiles_available()
            self.rows = int8.PackedRows(weight, self.own, tiles=tiles)
            if tiles and weight.shape[0] >= ONE_ROW_PROBE_ROWS:  # a vocabulary: every vanilla step screens one row
                self.rows.choose_one_row()
            error_norms, rounded_norms = _norms(weight, self.rows.packed, self.rows.scales)
            columns = weight.shape[1]
            relative = (columns + 2) * 2.0**-24 if self.own else 2.0**-8 + columns * 2.0**-24
            # per token: the bound's factor of ||h|| (everything but the output rounding)
            self.row_bounds = (error_norms + relative * rounded_norms).float() * ERROR_SCALE
            self.largest_bound = float(self.row_bounds.max())
            # the integer screen's factor of ||h - h'|| per token (see the module's docstring)
            self.integer = self.own and not tiles and columns % 32 == 0 and int8.integer_screen()
            self.rounding_bounds = ((1 + relative) * rounded_norms).float() * ERROR_SCALE
            self.largest_rounding_bound = float(self.rounding_bounds.max())
            self.output_rounding = 0.0 if self.own else 2.0**-7 * ERROR_SCALE  # per |rough_t|
            largest = float(self.rows.scales.abs().max()) * 127 if tiles else 0.0
            self.absolute = ERROR_SCALE * (columns + 2) * 2.0**-126 * (1.0 + largest)

    def __call__(self, hidden: torch.Tensor) -> list[int]:
        """hidden (m, H) -> the exact argmax token of each row of lm_head(hidden)."""
        if not self.enabled:
            if self.row_by_row:  # a product's rows may depend on how many share it (float32 on CPUs)
                return [int(exact_argmax(self.lm_head(hidden[row : row + 1]))[0]) for row in range(len(hidden))]
            return exact_argmax(self.lm_head(hidden)).tolist()
        rough = self.screen(hidden)
        return [self.resolve(hidden[row], rough[row]) for row in range(len(hidden))]

    def screen(self, hidden: torch.Tensor) -> list[Rough]:
        """hidden (m, H) -> each row's int8 logits, to `resolve` it with (only
        where `enabled`)."""
        if self.integer and len(hidden) <= INTEGER_ROWS:
            logits, rounding = int8.screen(hidden.float(), self.rows.packed, self.rows.scales)
            return [Rough(row, float(error)) for row, error in zip(logits, rounding.tolist())]
        return [Rough(row, 0.0) for row in self.rows(hidden)]

    def resolve(self, hidden: torch.Tensor, screened: Rough, gumbel: torch.Tensor | None = None, temperature: float = 1.0) -> int:
        """The exact argmax for one row: hidden (H,) and its screen. With
        `gumbel` (V,) float64 noise, the exact argmax of logits / temperature
        + gumbel instead: a sample of softmax(logits / temperature) (the
        Gumbel-max trick), screened the same way, since dividing by the
        temperature divides the bound and the noise is known exactly.
        The best CANDIDATES by rough score are computed exactly; every other
        token whose bound still reaches their best (a near-tie, or flat
        logits) is computed exactly too, and the first of the highest wins,
        as in argmax. A token left out is strictly below the best."""
        rough, rounding = screened
        hidden = hidden.to(self.exact_dtype)
        scale = 1.0 if gumbel is None else 1.0 / temperature
        # the rough scores in float64 where noise is added; ranked in float32, whose rounding
        # (at most 2^-24 of a value) the early exit below allows for
        scores = rough if gumbel is None else rough.double() * scale + gumbel[: len(rough)]
        ranked = scores.float()
        values, indices = int8.top_k(ranked[None], min(CANDIDATES + 1, len(rough)))
        candidates = indices[0, :CANDIDATES]  # (k,)
        exact = self._scores(candidates, hidden, gumbel, scale)  # (k,)
        best = exact.max()
        norm = float(hidden.norm())
        if not self.output_rounding and values.shape[1] > CANDIDATES:
            # every other token's ceiling is at most the next rough score plus the largest bound
            largest = (self.largest_bound * norm + self.largest_rounding_bound * rounding + self.absolute) * scale
            following = float(values[0, CANDIDATES])
            if gumbel is not None:
                following += abs(following) * 2.0**-22
            if following + largest < float(best):
                return int(candidates[exact == best].min())  # exact ties go to the first index, as in argmax
        bound = self.row_bounds * norm + self.absolute
        if rounding:
            bound += self.rounding_bounds * rounding
        if self.output_rounding:
            bound += self.output_rounding * rough.abs()
        ceiling = scores + bound if gumbel is None else scores + bound.double() * scale
        ceiling[candidates] = float("-inf")
        if float(ceiling.max()) < float(best):
            return int(candidates[exact == best].min())  # exact ties go to the first index, as in argmax
        others = (ceiling >= best).nonzero().squeeze(1)
        if rounding and len(others) > INTEGER_CONTENDERS:
            # flat logits, where the rounded features' bound leaves thousands of tokens (a random
            # context's do): the float32 screen's tighter bound leaves few, for one more product
            return self.resolve(hidden, Rough(self.rows(hidden[None])[0], 0.0), gumbel, temperature)
        contenders = torch.cat([candidates, others])
        exact = torch.cat([exact, self._scores(contenders[len(candidates) :], hidden, gumbel, scale)])
        return int(contenders[exact == exact.max()].min())

    def sample(self, hidden: torch.Tensor, gumbels: list[torch.Tensor], temperature: float) -> list[int]:
        """hidden (m, H), one (V,) float64 noise per row -> each row's exact
        argmax(logits / temperature + noise): a sample of softmax(logits /
        temperature) (only where `enabled`)."""
        rough = self.screen(hidden)
        return [self.resolve(row, screened, noise, temperature) for row, screened, noise in zip(hidden, rough, gumbels)]

    def _scores(self, tokens: torch.Tensor, hidden: torch.Tensor, gumbel: torch.Tensor | None, scale: float) -> torch.Tensor:
        """The exact logits of `tokens`, or with `gumbel` their exact scores logits * scale + noise in float64."""
        exact = self._exact(tokens, hidden)
        return exact if gumbel is None else exact.double() * scale + gumbel[tokens]

    def _exact(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of `tokens` in the model's precision (float32 for bf16 weights), a slice at a time.
        Each token's logit is its own row's products summed, the same bits whichever tokens share the
        call and wherever it sits among them (a matrix-vector product's are not: its low bits depend on
        both), so a vanilla step and a tree node whose screens rank the candidates differently still
        settle a near-tie alike. (torch sums a row of up to 32,768 elements on one thread, in one order;
        a wider model's rows could be split among threads where one token is alone in the call.)"""
        chunk = 4096
        if len(tokens) == 0:
            return hidden.new_empty(0)
        return torch.cat(
            [(self.weight[tokens[start : start + chunk]].to(self.exact_dtype) * hidden).sum(-1) for start in range(0, len(tokens), chunk)]
        )
