"""Calibrated acceptance: how often a drafted node of a given confidence is
really accepted, learned online from every verified tree.

EAGLE-2 (Li et al. 2024, section 4) finds that a node's draft confidence (the
product of the head's probabilities along its path) approximates its chance of
being accepted, but the head is over- or under-confident by amounts that
differ between heads, tasks and temperatures. So each verified node adds one
observation (its confidence, its depth, whether it ended on the accepted path)
and the estimate for a confidence bucket is the measured rate, shrunk towards
the confidence itself while a bucket has few observations. With no data the
estimate is the confidence; with many it is the measured rate."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

import torch

from core.config import SamplingParams

# bucket edges over draft confidence; narrow near 0, where most nodes are
EDGES = (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
DEPTHS = 16  # depths kept apart (deeper ones share the last row)
PRIOR = 4.0  # pseudo-observations at the raw confidence (bucket) and at the pooled rate (depth)


@dataclass(frozen=True)
class CurvePoint:
    confidence: float  # mean draft confidence of the bucket's observations
    accepted: float  # measured acceptance rate
    count: int  # observations


class Calibration:
    """Acceptance rates by confidence bucket, pooled over depths and per depth.
    Counts are kept in Python floats: a draft asks for a few dozen estimates
    and a verified tree adds a few dozen observations, where each torch call
    on so small a tensor would cost more than the arithmetic (the tensor
    methods below are the same arithmetic, for callers holding tensors)."""

    def __init__(self):
        buckets = len(EDGES) - 1
        self.inner_edges = EDGES[1:-1]
        self.counts = [[[0.0] * buckets for _ in range(DEPTHS)] for _ in range(3)]  # offered, accepted, confidence sum
        self._pooled: tuple[list[float], list[float]] | None = None  # offered and accepted per bucket, depths summed

    @property
    def observations(self) -> int:
        return int(sum(map(sum, self.counts[0])))

    def _cell(self, confidence: float, depth: int) -> tuple[int, int, float]:
        """-> (depth row, confidence bucket, confidence clamped to [0, 1])."""
        confidence = min(max(confidence, 0.0), 1.0)
        return min(max(depth - 1, 0), DEPTHS - 1), bisect.bisect_right(self.inner_edges, confidence), confidence

    def observe(self, confidence: torch.Tensor, depth: torch.Tensor, accepted: torch.Tensor) -> None:
        """One verified tree's drafted nodes: confidence (n,) in [0, 1], depth (n,) >= 1, accepted (n,) bool."""
        self.add(confidence.double().tolist(), depth.long().tolist(), accepted.bool().tolist())

    def add(self, confidences: list[float], depths: list[int], accepted: list[bool]) -> None:
        """`observe` for lists."""
        offered, taken, total = self.counts
        for confidence, depth, hit in zip(confidences, depths, accepted):
            row, bucket, confidence = self._cell(confidence, depth)
            offered[row][bucket] += 1.0
            taken[row][bucket] += 1.0 if hit else 0.0
            total[row][bucket] += confidence
        if confidences:
            self._pooled = None

    def estimate(self, confidence: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """(n,) acceptance estimates, float64 on the CPU (see `estimates`)."""
        return torch.tensor(self.estimates(confidence.double().tolist(), depth.long().tolist()), dtype=torch.float64)

    def estimates(self, confidences: list[float], depths: list[int] | int) -> list[float]:
        """Acceptance estimates: per-depth rate shrunk to the pooled rate,
        which is shrunk to the confidence itself. `depths`: one per
        confidence, or one for all."""
        if self._pooled is None:
            self._pooled = ([sum(column) for column in zip(*self.counts[0])], [sum(column) for column in zip(*self.counts[1])])
        pooled_offered, pooled_accepted = self._pooled
        offered, accepted = self.counts[0], self.counts[1]
        if isinstance(depths, int):
            depths = [depths] * len(confidences)
        result = []
        for confidence, depth in zip(confidences, depths):
            row, bucket, raw = self._cell(confidence, depth)
            pooled = (pooled_accepted[bucket] + PRIOR * raw) / (pooled_offered[bucket] + PRIOR)
            result.append((accepted[row][bucket] + PRIOR * pooled) / (offered[row][bucket] + PRIOR))
        return result

    def curve(self) -> list[CurvePoint]:
        """Measured acceptance per confidence bucket (depths pooled), for the calibration plot."""
        offered, accepted, total = ([sum(column) for column in zip(*table)] for table in self.counts)
        return [
            CurvePoint(total[b] / offered[b], accepted[b] / offered[b], int(offered[b]))
            for b in range(len(offered))
            if offered[b] > 0
        ]


class Continuation:
    """How often a draft accepted down to depth d went one level deeper, per
    d, counted on trees that reached depth d + 1: the chance that a frontier
    node's best child is accepted when the node is, which tells the planner
    what one more level is likely to add."""

    PRIOR_RATE = 0.7  # before any observation: EAGLE-2 reports 0.6-0.8 for later draft steps

    def __init__(self):
        self.offered = [0.0] * DEPTHS
        self.accepted = [0.0] * DEPTHS

    def observe(self, accepted_depth: int, tree_depth: int) -> None:
        """One verified tree: its accepted drafted tokens and its depth."""
        for depth in range(1, min(tree_depth, accepted_depth + 1, DEPTHS)):
            self.offered[depth - 1] += 1.0
            self.accepted[depth - 1] += 1.0 if accepted_depth > depth else 0.0

    def rate(self, depth: int) -> float:
        """P(the path goes on to depth + 1 | accepted down to depth), depth >= 1."""
        row = min(max(depth, 1), DEPTHS) - 1
        return (self.accepted[row] + PRIOR * self.PRIOR_RATE) / (self.offered[row] + PRIOR)


def setting_of(sampling: SamplingParams) -> tuple:
    """The sampling settings acceptance depends on: greedy, or temperature, top-p and top-k
    (rounded: API clients may send any top_p, and settings a hundredth apart accept alike)."""
    return ("greedy",) if sampling.greedy else (round(sampling.temperature, 2), round(sampling.top_p, 2), sampling.top_k)


class DraftTiming:
    """How long drafting really takes against what the measured cost table
    predicts. The table times the head's expansions alone; a planned draft also
    ranks candidates, looks up calibrated estimates and grafts the context
    branch: host-side work, part of it per level and part of it per draft, that
    costs little on a CPU but can outweigh the expansions on a GPU, where the
    head's own work is tiny. Each planned draft adds one observation
    (predicted, measured seconds), and a least-squares line through the recent
    ones (older ones fading by DECAY each) gives measured = scale x predicted
    + extra: the planner multiplies the table's expansion times by `scale`
    (deeper levels get dearer) and adds `extra` once per draft (every tree pays
    it). While the drafts' predicted times hardly differ, the slope cannot be
    told from the intercept: scale stays 1 and extra takes the difference.
    A draft measured over OUTLIER times what the fit predicts (the table's
    time before any observation) counts as that much: one stall (a page
    fault, a first call's allocations, another process) would otherwise
    raise `extra` by tens of milliseconds, and every draft after it would
    look unprofitable for a hundred steps, which then draft too rarely to
    correct it. Drafting that really costs more still moves the fit, by up to
    OUTLIER times per draft."""

    DECAY = 0.95  # weight of an observation per newer one
    SCALES = (0.5, 16.0)  # the slope is kept within these
    OUTLIER = 3.0  # cap on a measured time, in times the fit's prediction

    def __init__(self):
        self.observations = 0
        self.sums = [0.0] * 5  # decayed weight, x, y, x^2, x*y

    def observe(self, predicted: float, measured: float) -> None:
        if predicted <= 0 or measured <= 0:
            return
        scale, extra = self.fit
        measured = min(measured, self.OUTLIER * (scale * predicted + extra))
        terms = (1.0, predicted, measured, predicted * predicted, predicted * measured)
        self.sums = [self.DECAY * total + term for total, term in zip(self.sums, terms)]
        self.observations += 1

    @property
    def fit(self) -> tuple[float, float]:
        """(scale, extra seconds per draft); (1, 0) before any observation."""
        weight, x, y, xx, xy = self.sums
        if weight == 0:
            return 1.0, 0.0
        mean_x, mean_y = x / weight, y / weight
        variance, covariance = xx / weight - mean_x**2, xy / weight - mean_x * mean_y
        scale = covariance / variance if variance > (0.05 * mean_x) ** 2 else 1.0
        scale = min(max(scale, self.SCALES[0]), self.SCALES[1])
        return scale, max(mean_y - scale * mean_x, 0.0)


class Calibrations:
    """One Calibration per kind of node and sampling setting: acceptance
    depends on temperature, top-p and top-k, and head nodes and context
    (copied) nodes have different confidence measures. Drafting's timing
    does not depend on the setting: one DraftTiming for all."""

    def __init__(self):
        self.tables: dict[tuple, Calibration] = {}
        self.continuations: dict[tuple, Continuation] = {}
        self.timing = DraftTiming()
        # the page's calibration plot reads a table from its own thread while a decoding takes it: without
        # the lock both could make the table anew (one's learning lost), or delete the same oldest one (KeyError)
        self._lock = threading.Lock()

    def get(self, kind: str, setting: tuple) -> Calibration:
        with self._lock:
            return _recent(self.tables, (kind, setting), Calibration)

    def continuation(self, setting: tuple) -> Continuation:
        with self._lock:
            return _recent(self.continuations, setting, Continuation)

    def learned(self, setting: tuple) -> dict[str, int]:
        """What the planner has learnt so far that a draft under `setting` uses:
        verified drafted nodes of each kind (the head's, the context branch's)
        and planned drafts timed. Reading makes no table."""
        with self._lock:
            tables = {kind: self.tables.get((kind, setting)) for kind in ("head", "context")}
        nodes = {f"{kind}_nodes": table.observations if table is not None else 0 for kind, table in tables.items()}
        return {**nodes, "drafts_timed": self.timing.observations}


SETTINGS_KEPT = 32  # calibrations kept per kind of node, the most recently used: every setting an API client sends makes one


def _recent(tables: dict, key, make):
    """tables[key] (made where missing), moved to the end: the dict keeps the SETTINGS_KEPT * 2 most recently used."""
    table = tables.pop(key, None)
    table = make() if table is None else table
    tables[key] = table
    while len(tables) > 2 * SETTINGS_KEPT:  # two kinds of node per setting in `tables`
        del tables[next(iter(tables))]
    return table
