"""A quick acceptance check of a trained head: greedy eagle2 against vanilla on
a few prompts; tau = tokens committed per base-model forward (bonus included)."""

from __future__ import annotations

import json
from pathlib import Path

from core.config import SamplingParams, TreeParams
from core.engine import Engine


def read_turns(path: Path, limit: int) -> list[str]:
    with open(path, encoding="utf-8") as lines:
        records = [json.loads(line) for line in lines if line.strip()]
    return [record["turns"][0] for record in records[:limit]]


def measure_acceptance(engine: Engine, prompts: list[str], max_new_tokens: int = 64, tree: TreeParams = TreeParams()) -> dict:
    sampling = SamplingParams(max_new_tokens=max_new_tokens)
    taus, lossless = [], True
    for prompt in prompts:
        ids = engine.encode([{"role": "user", "content": prompt}])
        steps = list(engine.stream(ids, mode="eagle2", sampling=sampling, tree=tree))
        vanilla = list(engine.stream(ids, mode="vanilla", sampling=sampling))
        taus.append(steps[-1].stats.mean_accepted_length)
        lossless &= [t for s in steps for t in s.token_ids] == [t for s in vanilla for t in s.token_ids]
    return {
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "tree": {"total_tokens": tree.total_tokens, "depth": tree.depth, "top_k": tree.top_k},
        "tau": sum(taus) / len(taus),
        "per_prompt": taus,
        "lossless": lossless,
    }
