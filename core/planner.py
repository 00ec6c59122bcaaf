"""Sizing each draft tree from measured costs and calibrated acceptance.

A drafted node's acceptance estimate a is its chance of ending on the
accepted path (core/calibration.py), so a tree holding the root and nodes
a_1 >= a_2 >= ... commits in expectation

    E[tokens](n) = 1 + a_1 + ... + a_{n-1}       (the root's bonus token is sure)

for a base-model pass of n nodes costing verify(n) seconds on this device
(core/costs.py). The planner picks the n maximising

    rate(n) = E[tokens](n) / (spent + verify(n))

where `spent` is the step's drafting so far, and keeps drafting deeper only
while the next level is expected to raise that rate by more than the head
expansion costs. All functions here are pure."""

from __future__ import annotations

import torch


def closed_estimates(estimates: torch.Tensor, parents: list[int]) -> torch.Tensor:
    """Cap each candidate's estimate at its parent's (-1 = the root), so
    that ranking by estimate, earlier candidates first among equals, keeps
    every chosen node's parent in the tree: a child is never more likely to
    be accepted than its parent."""
    return torch.tensor(closed(estimates.double().tolist(), parents), dtype=torch.float64)


def closed(estimates: list[float], parents: list[int]) -> list[float]:
    """closed_estimates for lists (a new list)."""
    capped = list(estimates)
    for node, parent in enumerate(parents):
        if parent >= 0 and capped[node] > capped[parent]:
            capped[node] = capped[parent]
    return capped


def ranked(estimates: torch.Tensor) -> torch.Tensor:
    """Candidate indices by estimate, highest first, earlier first among equals."""
    return torch.tensor(order(estimates.double().tolist()), dtype=torch.long)


def order(estimates: list[float]) -> list[int]:
    """ranked for lists."""
    return sorted(range(len(estimates)), key=lambda index: -estimates[index])  # sorted is stable


def best_size(sorted_estimates: torch.Tensor | list[float], verify_curve: torch.Tensor | list[float], spent: float) -> tuple[int, float]:
    """-> (n, rate): the node count (root included) of the highest expected
    rate(n) = E[tokens](n) / (spent + verify_curve[n-1]), the smallest such n
    among equals, with the root and the best n - 1 candidates (sorted_estimates
    are descending; n runs up to len(verify_curve), and no further than the
    candidates go). In Python floats: a draft asks this a few times, over a few
    dozen values, where each torch call on so small a tensor costs more than
    the arithmetic."""
    return _best(_floats(sorted_estimates), _floats(verify_curve), spent)


def _floats(values) -> list[float]:
    return values if isinstance(values, list) else values.tolist()


def _best(estimates: list[float], curve: list[float], spent: float) -> tuple[int, float]:
    best, best_rate, expected = 1, 1.0 / (spent + curve[0]), 1.0
    for n in range(2, min(len(curve), len(estimates) + 1) + 1):
        expected += estimates[n - 2]
        rate = expected / (spent + curve[n - 1])
        if rate > best_rate:
            best, best_rate = n, rate
    return best, best_rate


def worth_deepening(
    sorted_estimates: torch.Tensor | list[float],
    child_estimates: torch.Tensor | list[float],
    verify_curve: torch.Tensor | list[float],
    spent: float,
    expand_seconds: float,
) -> bool:
    """Whether expanding the frontier is expected to raise the best rate:
    with the candidates so far plus, per frontier node, its likeliest
    child's estimate (`child_estimates`: the node's estimate times the
    measured chance that an accepted path goes one level deeper), for one
    more head expansion's time. With each child at its parent's estimate
    this is an upper bound: if that does not pay, no real level can."""
    if len(child_estimates) == 0:
        return False
    have, curve = _floats(sorted_estimates), _floats(verify_curve)
    _, now = _best(have, curve, spent)
    _, deeper = _best(sorted(have + _floats(child_estimates), reverse=True), curve, spent + expand_seconds)
    return deeper > now
