"""The planner, calibration, the context branch and the cost cache: pure
functions on synthetic tables, then the engine with the planner on."""

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from core import costs as costs_module
from core import planner
from core.calibration import Calibration, Calibrations, Continuation, DraftTiming
from core.config import SamplingParams, TreeParams
from core.costs import Costs
from core.drafter import EXPLORING, LONGEST_REST, Drafter
from core.engine import Engine
from core.lookup import ContextIndex
from models.base import load_base
from tests.factory import ARCHITECTURES, random_head, save_tiny_model

SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def table(per_node: float, one: float = 0.01, expand: float = 0.001, overhead: float = 0.001) -> Costs:
    """A cost table whose tree pass costs `one` plus `per_node` per extra node."""
    row = tuple(one + per_node * (n - 1) for n in SIZES)
    return Costs(SIZES, (0, 4096), (row, row), (1, 16), (expand, expand), overhead)


GPU_LIKE = table(per_node=1e-6, expand=1e-5)  # 128 nodes cost 1.01 one-node passes
CPU_LIKE = table(per_node=0.004)  # every extra node costs 40% of a one-node pass


def curve_of(costs: Costs, largest: int = 128) -> torch.Tensor:
    return costs.verify_curve(100, largest)


def brute_force(estimates: list[float], curve: torch.Tensor, spent: float) -> tuple[int, float]:
    best = (1, 1 / (spent + float(curve[0])))
    for n in range(2, min(len(estimates) + 1, len(curve)) + 1):
        rate = (1 + sum(sorted(estimates, reverse=True)[: n - 1])) / (spent + float(curve[n - 1]))
        if rate > best[1] + 1e-12:
            best = (n, rate)
    return best


def test_best_size_maximises_the_expected_rate():
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        count = int(torch.randint(0, 60, (), generator=generator))
        estimates = sorted(torch.rand(count, generator=generator).pow(3).tolist(), reverse=True)
        per_node = float(torch.rand((), generator=generator)) * 0.01
        curve = curve_of(table(per_node), 64)
        spent = float(torch.rand((), generator=generator)) * 0.01
        size, rate = planner.best_size(torch.tensor(estimates, dtype=torch.float64), curve, spent)
        expected_size, expected_rate = brute_force(estimates, curve, spent)
        assert rate == pytest.approx(expected_rate)
        assert size == expected_size


def test_cheaper_verification_never_picks_a_smaller_tree():
    generator = torch.Generator().manual_seed(1)
    for trial in range(100):
        estimates = torch.sort(torch.rand(100, generator=generator).pow(2), descending=True).values.double()
        sizes = [planner.best_size(estimates, curve_of(table(per_node)), 0.002)[0] for per_node in (0.01, 0.003, 0.001, 0.0003, 0.0)]
        assert sizes == sorted(sizes), sizes
    # a flat cost takes every candidate; a steep one takes only the sure ones
    sure = torch.tensor([0.99, 0.98, 0.5, 0.2, 0.1, 0.05], dtype=torch.float64)
    assert planner.best_size(sure, curve_of(GPU_LIKE), 0.001)[0] == 7
    assert planner.best_size(sure, curve_of(CPU_LIKE), 0.001)[0] == 3


def test_deepening_stops_where_no_deeper_tree_can_pay():
    curve = curve_of(CPU_LIKE)
    have = torch.tensor([0.9, 0.3, 0.1], dtype=torch.float64)
    # a confident frontier on cheap verification pays for one more expansion
    assert planner.worth_deepening(have, torch.tensor([0.9, 0.3]), curve_of(GPU_LIKE), 0.001, 0.001)
    # a hopeless frontier never does, nor does an expansion dearer than any gain
    assert not planner.worth_deepening(have, torch.tensor([0.001, 0.0005]), curve, 0.001, 0.001)
    assert not planner.worth_deepening(have, torch.tensor([0.9, 0.3]), curve, 0.001, 10.0)
    assert not planner.worth_deepening(have, torch.tensor([]), curve, 0.001, 0.001)
    # the rule is a bound: whenever it says stop, no level of children (each at
    # most as likely as its frontier parent) raises the best rate
    generator = torch.Generator().manual_seed(2)
    for trial in range(300):
        have = torch.sort(torch.rand(10, generator=generator).pow(2), descending=True).values.double()
        frontier = have[:4] * torch.rand(4, generator=generator).double()
        expand = float(torch.rand((), generator=generator)) * 0.01
        curve = curve_of(table(float(torch.rand((), generator=generator)) * 0.005))
        if planner.worth_deepening(have, frontier, curve, 0.002, expand):
            continue
        children = frontier * torch.rand(4, generator=generator).double()
        merged = torch.sort(torch.cat([have, children]), descending=True).values
        assert planner.best_size(merged, curve, 0.002 + expand)[1] <= planner.best_size(have, curve, 0.002)[1] + 1e-12


def test_closed_estimates_keep_parents_before_children():
    estimates = torch.tensor([0.2, 0.5, 0.9, 0.1, 0.3])
    parents = [-1, -1, 0, 2, 1]
    closed = planner.closed_estimates(estimates, parents)
    assert closed.tolist() == pytest.approx([0.2, 0.5, 0.2, 0.1, 0.3])
    order = planner.ranked(closed).tolist()
    for count in range(1, 6):
        chosen = set(order[:count])
        assert all(parents[node] == -1 or parents[node] in chosen for node in chosen)


def test_calibration_converges_to_the_true_rates():
    """An overconfident head (accepted with probability c^2 at confidence c,
    and less at depth 3) is learned bucket by bucket."""
    calibration = Calibration()
    generator = torch.Generator().manual_seed(3)
    for batch in range(500):
        confidence = torch.rand(100, generator=generator).double()
        depth = torch.randint(1, 4, (100,), generator=generator)
        true_rate = confidence**2 * torch.where(depth == 3, 0.5, 1.0)
        calibration.observe(confidence, depth, torch.rand(100, generator=generator).double() < true_rate)
    probe = torch.tensor([0.05, 0.25, 0.55, 0.85, 0.97], dtype=torch.float64)
    for depth in (1, 2, 3):
        truth = probe**2 * (0.5 if depth == 3 else 1.0)
        got = calibration.estimate(probe, torch.full((5,), depth))
        assert torch.allclose(got, truth, atol=0.06), (depth, got, truth)
    # with no observations the estimate is the confidence itself
    assert torch.allclose(Calibration().estimate(probe, torch.ones(5)), probe)
    points = calibration.curve()
    # pooled over depths the rate is (1 + 1 + 0.5) / 3 of c^2
    assert len(points) == 15 and all(abs(p.accepted - 5 / 6 * p.confidence**2) < 0.05 for p in points)


def test_continuation_learns_how_often_accepted_paths_go_deeper():
    continuation = Continuation()
    assert continuation.rate(1) == pytest.approx(Continuation.PRIOR_RATE)
    generator = torch.Generator().manual_seed(4)
    for trial in range(3000):  # accepted depth: 1 with p 0.6, then each next level with p 0.5, in trees of depth 4
        accepted = 0
        while accepted < 4 and float(torch.rand((), generator=generator)) < (0.6 if accepted == 0 else 0.5):
            accepted += 1
        continuation.observe(accepted, 4)
    assert [continuation.rate(depth) for depth in (1, 2, 3)] == pytest.approx([0.5, 0.5, 0.5], abs=0.05)


def test_planned_steps_skip_the_head_where_drafting_does_not_pay(engine64, monkeypatch):
    """Where one more node costs five one-node passes, steps rest (no head
    work at all), looking again after 1, 2, 4 and 8 steps; the output is vanilla's."""
    engine64.costs, engine64.calibrations = table(per_node=0.05), Calibrations()
    sampling = SamplingParams(max_new_tokens=40)
    head, forwards = engine64.draft_head, [0]  # head forwards so far (counted, not timed: machines differ)
    original = head.forward

    def counted(*args, **kwargs):
        forwards[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(head, "forward", counted)
    steps, head_work = [], []
    for step in engine64.stream([8, 9, 10, 11], "eagle2", sampling):
        head_work.append(forwards[0] - sum(head_work))
        steps.append(step)
    steps, head_work = steps[1:], head_work[1:]
    resting = [step for step, work in zip(steps, head_work) if work == 0]  # a one-node tree, no head forward
    looking = [step for step, work in zip(steps, head_work) if work > 0]
    assert len(resting) >= len(steps) // 2 and len(looking) >= 3, (len(resting), len(looking), len(steps))
    assert all(step.tree_size == 1 for step in resting)
    assert tokens_of(steps) == tokens_of(engine64.stream([8, 9, 10, 11], "vanilla", sampling))[1:]


def test_draft_timing_fits_scale_and_extra_per_draft():
    timing = DraftTiming()
    assert timing.fit == (1.0, 0.0)
    for depth in range(1, 120):  # drafts of different sizes: measured = 3 x predicted + 2 ms
        predicted = 0.001 * (1 + depth % 5)
        timing.observe(predicted, 3 * predicted + 0.002)
    scale, extra = timing.fit  # the first drafts, capped at 3x the fit so far, have faded
    assert scale == pytest.approx(3.0, rel=1e-3) and extra == pytest.approx(0.002, rel=1e-3)
    same = DraftTiming()  # drafts of one size: the slope is unknown, the difference is extra
    for _ in range(100):
        same.observe(0.001, 0.004)
    assert same.fit == (1.0, pytest.approx(0.003, rel=1e-3))
    steep = DraftTiming()
    for depth in range(1, 10):
        steep.observe(1e-6 * depth, 0.001 * depth)
    assert steep.fit[0] == DraftTiming.SCALES[1]
    steep.observe(0.0, 1.0)  # nothing predicted: nothing learned
    assert steep.observations == 9


def test_one_stalled_draft_hardly_moves_the_timing_fit_and_a_slowdown_still_does():
    timing = DraftTiming()
    for depth in range(1, 40):
        predicted = 0.001 * (1 + depth % 5)
        timing.observe(predicted, 1.5 * predicted + 0.0005)
    before = timing.fit
    timing.observe(0.002, 0.3)  # a 300 ms stall
    first = DraftTiming()
    first.observe(0.002, 0.3)  # a stall at the very first draft (the table predicted 2 ms)
    assert first.fit[1] <= 0.0041
    assert timing.fit[1] < before[1] + 0.002  # uncapped, extra would jump by some 15 ms
    for depth in range(1, 100):  # the machine really gets twice as slow
        predicted = 0.001 * (1 + depth % 5)
        timing.observe(predicted, 2 * (1.5 * predicted + 0.0005))
    scale, extra = timing.fit
    assert scale == pytest.approx(3.0, rel=0.05) and extra == pytest.approx(0.001, abs=2e-4)


def test_planned_drafting_learns_its_real_cost_against_the_table(engine64):
    """A table that counts almost nothing for the head's expansions: the
    measured drafts take longer, which the fit puts on the per-draft extra."""
    engine64.costs, engine64.calibrations = table(per_node=1e-6, expand=1e-9), Calibrations()
    list(engine64.stream(prompts(2)[1], "eagle2", SamplingParams(max_new_tokens=12)))
    timing = engine64.calibrations.timing
    assert timing.observations > 0 and timing.fit[1] > 1e-5


def test_drafting_that_costs_more_than_the_table_says_gets_shallower_trees(engine64, monkeypatch):
    """The same cheap-verification table, expansions taken at the table's word
    or 16 times dearer (the fit held fixed): dearer drafting, shallower trees."""
    depths = {}
    for scale in (1.0, 16.0):
        monkeypatch.setattr(DraftTiming, "fit", property(lambda self, scale=scale: (scale, 0.0)))
        engine64.costs, engine64.calibrations = table(per_node=1e-6, expand=0.002), Calibrations()
        steps = list(engine64.stream(prompts(2)[1], "eagle2", SamplingParams(max_new_tokens=30)))
        depths[scale] = steps[-1].stats.mean_tree_depth
    assert depths[16.0] < depths[1.0], depths


def test_context_index_proposes_distinct_branches_longest_match_first():
    index = ContextIndex()
    # "7 8" occurs three times before the end; the match before 40 is the longest
    index.extend([1, 2, 7, 8, 30, 31, 5, 6, 7, 8, 40, 41, 42, 3, 7, 8, 50, 9, 5, 6, 7, 8])
    branches = index.branches(count=4, longest=16)
    assert [branch.tokens[0] for branch in branches] == [40, 50, 30]
    assert branches[0].match == 4 and branches[1].match == 2
    assert len(branches[0].tokens) > len(branches[1].tokens)  # longer matches are copied further
    assert branches[0].confidence(1) > branches[1].confidence(1) > branches[2].confidence(1)
    assert branches[0].confidence(2) < branches[0].confidence(1)
    assert index.branches(count=1, longest=2)[0].tokens == (40, 41)
    assert ContextIndex().branches(4, 16) == []


@pytest.fixture(scope="module", params=ARCHITECTURES)
def engine64(request, tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp(request.param) / "m", request.param, vocab_size=48)
    base = load_base(str(folder), dtype="float64")
    return Engine(base, random_head(base.model, seed=1, qkv_bias=request.param == "qwen2"))


def tokens_of(steps) -> list[int]:
    return [token for step in steps for token in step.token_ids]


def prompts(count: int) -> list[list[int]]:
    """Random prompts, half of them repeating a phrase so that the context branch has matches."""
    generator = torch.Generator().manual_seed(5)
    result = []
    for index in range(count):
        prompt = torch.randint(8, 48, (4 + 3 * index,), generator=generator).tolist()
        result.append(prompt + prompt[:5] if index % 2 else prompt)
    return result


@pytest.mark.parametrize("costs", [GPU_LIKE, CPU_LIKE], ids=["gpu-like", "cpu-like"])
def test_planned_eagle2_equals_vanilla(engine64, costs):
    """Greedy and seeded sampling: the planner's trees never change the output."""
    engine64.costs, engine64.calibrations = costs, Calibrations()
    for prompt in prompts(6):
        for sampling in (SamplingParams(max_new_tokens=40), SamplingParams(temperature=0.9, top_k=20, max_new_tokens=40, seed=11)):
            reference = tokens_of(engine64.stream(prompt, "vanilla", sampling))
            for tree in (TreeParams(), TreeParams(depth=3, top_k=2, context_branches=1), TreeParams(lookup_tokens=0)):
                assert tokens_of(engine64.stream(prompt, "eagle2", sampling, tree)) == reference, (prompt, sampling, tree)


def test_the_planner_grows_trees_where_verification_is_cheap(engine64, monkeypatch):
    """Fed a GPU-like cost table (flat in the node count) the planner picks big
    trees; fed a CPU-like one (steep) it picks small ones or none."""
    sizes = {}
    monkeypatch.setattr(DraftTiming, "observe", lambda self, predicted, measured: None)  # the tables' costs, as given
    for name, costs in (("gpu", GPU_LIKE), ("cpu", CPU_LIKE)):
        engine64.costs, engine64.calibrations = costs, Calibrations()
        steps = list(engine64.stream(prompts(2)[1], "eagle2", SamplingParams(max_new_tokens=30)))
        sizes[name] = steps[-1].stats.mean_tree_size
    assert sizes["gpu"] >= 20 and sizes["cpu"] <= 6 and sizes["gpu"] >= 4 * sizes["cpu"], sizes


def test_seeded_sampling_is_the_same_in_every_mode(engine64):
    engine64.costs = GPU_LIKE
    sampling = SamplingParams(temperature=1.0, max_new_tokens=30, seed=3)
    replies = [tokens_of(engine64.stream([8, 9, 10, 11], mode, sampling)) for mode in ("vanilla", "eagle", "eagle2")]
    replies.append(tokens_of(engine64.stream([8, 9, 10, 11], "eagle2", sampling, TreeParams(20, 4, 4))))
    assert all(reply == replies[0] for reply in replies)
    other = tokens_of(engine64.stream([8, 9, 10, 11], "vanilla", SamplingParams(temperature=1.0, max_new_tokens=30, seed=4)))
    assert other != replies[0]


def test_costs_are_measured_once_and_remeasured_when_the_setup_changes(tiny_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("KESTREL_COSTS_DIR", str(tmp_path))  # none measured yet
    measured = []
    real = costs_module.measure

    def counting(*args, **kwargs):
        measured.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(costs_module, "measure", counting)
    base = load_base(str(tiny_dir), dtype="float64")
    first = Engine(base, random_head(base.model)).prepare_costs()
    assert len(measured) == 1 and first.sizes[0] == 1 and all(t > 0 for row in first.verify for t in row)
    assert all(list(row) == sorted(row) for row in first.verify)  # a bigger tree never measures cheaper
    again = Engine(base, random_head(base.model)).prepare_costs()  # a new session: read from disk
    assert len(measured) == 1 and again == first
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        Engine(base, random_head(base.model)).prepare_costs()
        assert len(measured) == 2
    finally:
        torch.set_num_threads(threads)
    float32 = load_base(str(tiny_dir), dtype="float32")
    Engine(float32, random_head(float32.model)).prepare_costs()
    assert len(measured) == 3
    Engine(base, random_head(base.model)).prepare_costs(remeasure=True)  # bench --calibrate
    assert len(measured) == 4
    monkeypatch.setattr(costs_module, "kernel_sources", lambda: "changed")  # an update changed Kestrel's kernels
    Engine(base, random_head(base.model)).prepare_costs()
    assert len(measured) == 5
    monkeypatch.setattr(Engine, "_screen_route", lambda self: "tiles")  # the one-row screen measured faster elsewhere
    Engine(base, random_head(base.model)).prepare_costs()
    assert len(measured) == 6
    for folder in ("a/head", "b/head"):
        (tmp_path / "w" / folder).mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "w" / "a")
    Engine(base, random_head(base.model), "head").prepare_costs()
    Engine(base, random_head(base.model), "./head/").prepare_costs()  # the same folder, typed otherwise
    assert len(measured) == 7
    monkeypatch.chdir(tmp_path / "w" / "b")
    Engine(base, random_head(base.model), "head").prepare_costs()  # another folder of the same name
    assert len(measured) == 8
    assert Engine(base, None).prepare_costs() is None  # nothing to plan without a head


def test_costs_past_the_longest_measured_context_never_fall():
    """Extended past the longest measured context, a tree pass costs at least
    what it cost there, and more nodes never cost less: a noise-sized slope
    between two short contexts had made a 4-node pass at 5,000 tokens cheaper
    than a one-node pass, and the planner drafted where it lost."""
    costs = costs_module.Costs(sizes=(1, 2, 4), contexts=(64, 512), verify=((0.010, 0.010, 0.0117), (0.010, 0.010, 0.0113)),
                               widths=(1, 2), expand=(0.001, 0.002), overhead=0.0005)  # fmt: skip
    for context in (512, 1000, 5000, 20000):
        curve = costs.verify_curve(context).tolist()
        assert curve == sorted(curve) and all(a >= b for a, b in zip(curve, costs.verify_curve(512).tolist())), context
    assert costs.verify_curve(5000)[3] >= costs.verify_curve(5000)[0]
    assert costs_module.CONTEXTS[-1] >= 2048  # a long context is measured, not only extended to


def test_a_damaged_cost_file_is_measured_again(tmp_path):
    """A cost file that is not a table measure() makes (JSON null, a list, a
    short row, a negative time) is read as missing, so it is measured again
    instead of stopping the start or failing every planned step."""
    costs = costs_module.Costs(sizes=(1, 2, 4), contexts=(64, 512), verify=((1.0, 1.2, 1.5), (1.1, 1.3, 1.6)),
                               widths=(1, 2), expand=(0.1, 0.2), overhead=0.05)  # fmt: skip
    key = {"model": "m"}
    stale, fresh = tmp_path / "costs-0123.99.tmp", tmp_path / "costs-0123.98.tmp"
    for left in (stale, fresh):
        left.write_text("{")
    os.utime(stale, (0, 0))  # left by a process killed long ago; the fresh one may be another start's, still writing
    path = costs_module.save_cached(tmp_path, key, costs)
    assert costs_module.load_cached(tmp_path, key) == costs and not stale.exists() and fresh.exists()
    good = json.loads(path.read_text())
    for damaged in (None, [], "x", {"key": key, "costs": {**good["costs"], "sizes": []}},
                    {"key": key, "costs": {**good["costs"], "verify": [[1.0, 1.2], [1.1, 1.3, 1.6]]}},
                    {"key": key, "costs": {**good["costs"], "expand": [0.1, -1]}},
                    {"key": key, "costs": {**good["costs"], "sizes": "abc"}}):  # fmt: skip
        path.write_text(json.dumps(damaged))
        assert costs_module.load_cached(tmp_path, key) is None, damaged


def test_a_cost_file_that_cannot_be_written_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A full disk while the table is written: the half-written temporary file
    stayed in the costs folder, removed only by a later save an hour on."""
    costs = costs_module.Costs(sizes=(1, 2), contexts=(64,), verify=((1.0, 1.2),), widths=(1,), expand=(0.1,), overhead=0.05)
    written = []

    def full(self, text, encoding=None):
        written.append(self)
        with open(self, "w", encoding=encoding) as file:
            file.write(text[:10])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(costs_module.Path, "write_text", full)
    with pytest.raises(OSError, match="No space"):
        costs_module.save_cached(tmp_path, {"model": "m"}, costs)
    assert written and list(tmp_path.iterdir()) == []


def test_calibrations_keep_the_settings_used_last_and_round_top_p():
    """Every sampling setting an API client sends made a calibration table of
    its own, kept for the whole run (300 top_p values: 600 tables)."""
    from core import calibration

    calibrations = Calibrations()
    first = calibrations.get("head", calibration.setting_of(SamplingParams(temperature=0.7, top_p=0.9)))
    assert calibrations.get("head", calibration.setting_of(SamplingParams(temperature=0.7, top_p=0.90001))) is first
    for index in range(300):
        setting = calibration.setting_of(SamplingParams(temperature=0.5 + 0.005 * index, top_p=0.001 * index + 0.5))
        calibrations.get("head", setting), calibrations.get("context", setting), calibrations.continuation(setting)
        calibrations.get("head", ("greedy",))  # used all along: kept
    assert len(calibrations.tables) == 2 * calibration.SETTINGS_KEPT and len(calibrations.continuations) <= 2 * calibration.SETTINGS_KEPT
    assert ("head", ("greedy",)) in calibrations.tables and ("head", (0.7, 0.9, 0)) not in calibrations.tables


def test_a_slow_moment_on_a_small_tree_does_not_make_it_dearer_than_bigger_ones():
    """A pass over more nodes does the same work and more: a smaller tree
    measured dearer (the machine slowed while it ran) takes the bigger one's time."""
    assert costs_module.monotone([0.0197, 0.0161, 0.0167, 0.0171, 0.0207]) == (0.0161, 0.0161, 0.0167, 0.0171, 0.0207)
    assert costs_module.monotone([1.0, 2.0, 3.0]) == (1.0, 2.0, 3.0)


def test_costs_are_measured_over_ordinary_text(tiny_dir, monkeypatch, tmp_path):
    """Tree passes are timed after the bundled task prompts' passages (as the
    model's tokenizer reads them), each tree rooted at the text's next token:
    after random tokens the logits are flat, which makes the greedy screen
    dearer than in replies. Without that file, random tokens stand in."""
    from core import engine as engine_module

    monkeypatch.setenv("KESTREL_COSTS_DIR", str(tmp_path))
    contexts, roots = [], []
    real_forward, real_tree = costs_module.base_forward, costs_module._bushy_tree
    monkeypatch.setattr(costs_module, "base_forward", lambda model, tokens, *rest: contexts.append(tokens.tolist()) or real_forward(model, tokens, *rest))
    monkeypatch.setattr(costs_module, "_bushy_tree", lambda *args: roots.append(args[3]) or real_tree(*args))
    base = load_base(str(tiny_dir), dtype="float64")
    engine = Engine(base, random_head(base.model))
    text = engine._sample_text()
    assert text and max(text) < base.model.get_input_embeddings().weight.shape[0]
    engine.prepare_costs()
    measured = [tokens for tokens in contexts if len(tokens) in costs_module.CONTEXTS]
    assert measured and all(tokens == (text * 10)[: len(tokens)] for tokens in measured)
    assert roots and set(roots) <= {(text * 10)[len(tokens)] for tokens in measured}
    contexts.clear(), roots.clear()
    monkeypatch.setattr(engine_module, "SAMPLE_TEXT", tmp_path / "missing.jsonl")
    Engine(base, random_head(base.model)).prepare_costs(remeasure=True)
    assert set(roots) == {None} and all(tokens != (text * 10)[: len(tokens)] for tokens in contexts if len(tokens) in costs_module.CONTEXTS)


def test_rests_grow_past_max_rest_only_where_drafts_cost_many_steps():
    """Rests double while drafts do not pay: up to MAX_REST steps where a
    draft is cheap; where one costs about seven plain steps (graphed passes
    on a GPU, the head dispatched op by op), until looking again costs about
    EXPLORING of the time. A draft that pays ends the rests."""
    curve = torch.tensor([0.004, 0.0045, 0.005])

    def rests(draft_seconds: float, drafts: int) -> list[int]:
        drafter = SimpleNamespace(resting=0, unprofitable=0)
        seen = []
        for _ in range(drafts):
            Drafter._rest_after(drafter, 100.0, curve, draft_seconds)  # 100 tokens/s: below a plain step's 250
            seen.append(drafter.resting)
        Drafter._rest_after(drafter, 300.0, curve, draft_seconds)
        assert drafter.unprofitable == 0
        return seen

    assert rests(0.001, 6) == [1, 2, 4, 8, 8, 8]
    longest = math.ceil(0.027 / (EXPLORING * 0.004))
    assert rests(0.027, 9) == [1, 2, 4, 8, 16, 32, 64, longest, longest]
    assert rests(10.0, 10)[-1] == LONGEST_REST


def counted_measure(monkeypatch, measured: list) -> None:
    """costs.measure counted, giving a fixed table at once (what is measured does not matter here)."""
    monkeypatch.setattr(costs_module, "measure", lambda *args, **kwargs: measured.append(1) or GPU_LIKE)


def test_a_model_or_head_saved_over_the_same_path_is_measured_again(tmp_path, monkeypatch):
    """The cache key named a local model or head by its path alone, so another
    model saved into the same folder (or a head trained again into its own)
    planned its trees with the old one's table."""
    from models.head import save_head

    monkeypatch.setenv("KESTREL_COSTS_DIR", str(tmp_path / "costs"))
    measured = []
    counted_measure(monkeypatch, measured)
    folder, head_folder = tmp_path / "model", tmp_path / "head"
    save_tiny_model(folder)
    base = load_base(str(folder), dtype="float64")
    save_head(random_head(base.model), head_folder)
    Engine(base, random_head(base.model), str(head_folder)).prepare_costs()
    Engine(base, random_head(base.model), str(head_folder)).prepare_costs()  # nothing changed: read from the cache
    assert len(measured) == 1
    save_head(random_head(base.model, seed=5), head_folder)  # trained again: the same sizes, new weights
    weights = head_folder / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # later, even on coarse clocks
    Engine(base, random_head(base.model), str(head_folder)).prepare_costs()
    assert len(measured) == 2
    save_tiny_model(folder, hidden_size=128, intermediate_size=256)  # a bigger model in the same folder
    bigger = load_base(str(folder), dtype="float64")
    Engine(bigger, random_head(bigger.model), str(head_folder)).prepare_costs()
    assert len(measured) == 3
    from core import engine as engine_module

    monkeypatch.setattr(engine_module, "BUNDLED_HEAD", head_folder)  # the head Kestrel ships, named "bundled"
    Engine(bigger, random_head(bigger.model), "bundled").prepare_costs()
    save_head(random_head(bigger.model, seed=6), head_folder, {"intermediate_size": 64})  # an update ships another
    Engine(bigger, random_head(bigger.model), "bundled").prepare_costs()
    assert len(measured) == 5
    gguf = tmp_path / "model.gguf"  # a model file: by its size and time
    gguf.write_bytes(b"GGUF" + bytes(64))
    first = costs_module.contents(str(gguf))
    gguf.write_bytes(b"GGUF" + bytes(128))
    assert first is not None and costs_module.contents(str(gguf)) not in (None, first)


def test_a_hub_model_is_keyed_by_the_snapshot_the_cache_holds(tmp_path, monkeypatch):
    """A repo id names whatever its branch points to: the commit's snapshot in
    the Hugging Face cache (read there, without the network) tells them apart."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--owner--name"
    for commit, hidden in (("a" * 40, 64), ("b" * 40, 128)):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text(json.dumps({"hidden_size": hidden}))
        (repo / "snapshots" / commit / "model.safetensors").write_bytes(bytes(hidden))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    old = costs_module.contents("owner/name")
    (repo / "refs" / "main").write_text("b" * 40)  # the branch moved on, and the new commit was downloaded
    assert old is not None and costs_module.contents("owner/name") not in (None, old)
    assert costs_module.contents("owner/name@" + "a" * 40) == old
    assert costs_module.contents("other/missing") is None and costs_module.contents(None) is None


def test_a_second_process_waits_for_the_first_s_measurement_and_reads_it(tiny_dir, tmp_path, monkeypatch):
    """Two starts measuring at once slowed each other's passes and both cached
    what they measured. A lock in the cache folder makes the second wait; it
    then reads the first's table instead of measuring its own. (flock's locks
    belong to an open file, so two engines of one process stand in for two processes.)"""
    import threading

    monkeypatch.setenv("KESTREL_COSTS_DIR", str(tmp_path))
    base = load_base(str(tiny_dir), dtype="float64")
    first, second = Engine(base, random_head(base.model)), Engine(base, random_head(base.model))
    found, measured, looked = [], [], threading.Event()
    other = threading.Thread(target=lambda: found.append(second.prepare_costs()))
    load_cached = costs_module.load_cached

    def watched(folder, key, warn=True):
        result = load_cached(folder, key, warn)
        if threading.current_thread() is other:
            looked.set()
        return result

    def slow_measure(*args, **kwargs):
        measured.append(1)
        if threading.current_thread() is not other:  # the first, measuring: the second starts, finds nothing cached
            other.start()
            assert looked.wait(30)
        return CPU_LIKE if len(measured) == 1 else GPU_LIKE

    monkeypatch.setattr(costs_module, "load_cached", watched)
    monkeypatch.setattr(costs_module, "measure", slow_measure)
    first.prepare_costs()
    other.join(30)
    assert len(measured) == 1 and first.costs == CPU_LIKE and found == [CPU_LIKE]
    assert (tmp_path / costs_module.LOCK_FILE).exists()
    monkeypatch.setattr(costs_module, "LOCK_FILE", "missing-folder/lock")  # a lock that cannot be taken: measured all the same
    monkeypatch.setattr(costs_module, "measure", lambda *args, **kwargs: measured.append(1) or GPU_LIKE)
    assert Engine(base, random_head(base.model)).prepare_costs(remeasure=True) == GPU_LIKE and len(measured) == 2


@pytest.mark.skipif(os.name == "nt", reason="flock is POSIX's")
def test_the_measuring_lock_is_skipped_where_none_can_be_taken_and_waited_for_at_most_lock_wait(tmp_path, monkeypatch, caplog):
    """A file system that takes no locks (ENOLCK) measures at once, without a
    wait or a warning; a lock another process holds past LOCK_WAIT is said
    and measured alongside."""
    import errno
    import fcntl

    def flock(fd, operation, error):
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(fcntl, "flock", lambda fd, operation: flock(fd, operation, errno.ENOLCK))
    with caplog.at_level("INFO", logger="kestrel"), costs_module.measuring(tmp_path):
        pass
    assert caplog.text == ""
    monkeypatch.setattr(fcntl, "flock", lambda fd, operation: flock(fd, operation, errno.EWOULDBLOCK))
    monkeypatch.setattr(costs_module, "LOCK_WAIT", 0.2)
    with caplog.at_level("INFO", logger="kestrel"), costs_module.measuring(tmp_path):
        pass
    assert "Another process is measuring step costs; waiting for it" in caplog.text
    assert "another process has measured step costs for 0.2 s; measuring alongside it" in caplog.text


def test_cpus_of_one_name_but_another_generation_are_measured_apart(tmp_path, monkeypatch):
    """A VM's /proc/cpuinfo may name its processor "AMD EPYC" whatever the
    generation, and an Arm Linux's names none: family, model and stepping (Arm:
    implementer, variant and part) tell them apart; the transformers version too
    (its attention and cache code runs in every pass)."""
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(costs_module, "CPUINFO", cpuinfo)
    cpu = torch.device("cpu")
    block = "processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: {model}\nmodel name\t: AMD EPYC\nstepping\t: 1\n"
    names = []
    for family, model in ((23, 49), (25, 1), (25, 17)):  # Rome, Milan, Genoa
        cpuinfo.write_text("\n".join(block.format(n=n, family=family, model=model) for n in range(2)))
        names.append(costs_module.device_name(cpu))
    assert len(set(names)) == 3 and all(name.startswith("AMD EPYC (") for name in names), names
    assert names[1] == "AMD EPYC (AuthenticAMD family 25 model 1 stepping 1)"
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\nCPU variant\t: 0x{v}\nCPU part\t: 0x{part}\n"
    cpuinfo.write_text(arm.format(v=3, part="d0c"))  # Neoverse N1 (Graviton2)
    graviton2 = costs_module.device_name(cpu)
    cpuinfo.write_text(arm.format(v=1, part="d40"))  # Neoverse V1 (Graviton3)
    graviton3 = costs_module.device_name(cpu)
    assert graviton2 != graviton3 and "part 0xd40" in graviton3
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse sse2\n")  # nothing else said: its extensions
    plain = costs_module.device_name(cpu)
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 avx512f\n")
    assert plain != costs_module.device_name(cpu) and "flags" in plain
    import transformers

    key = costs_module.cache_key(cpu, "m", None, torch.float32, "none")
    monkeypatch.setattr(transformers, "__version__", "0.0.1")
    assert costs_module.cache_key(cpu, "m", None, torch.float32, "none") != key


def test_a_cost_file_nested_past_the_parser_s_depth_is_named_and_measured_again(tiny_dir, tmp_path, monkeypatch, caplog):
    """A file of 200,000 '[' raised RecursionError out of the start; a damaged
    file is now measured again with one warning that names it."""
    monkeypatch.setenv("KESTREL_COSTS_DIR", str(tmp_path))
    measured = []
    counted_measure(monkeypatch, measured)
    base = load_base(str(tiny_dir), dtype="float64")
    Engine(base, random_head(base.model)).prepare_costs()
    (path,) = tmp_path.glob("costs-*.json")
    path.write_text("[" * 200000 + "]" * 200000)
    with caplog.at_level("WARNING", logger="kestrel"):
        assert Engine(base, random_head(base.model)).prepare_costs() == GPU_LIKE
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert len(measured) == 2 and len(warnings) == 1 and str(path) in warnings[0] and "RecursionError" in warnings[0], warnings
    caplog.clear()
    Engine(base, random_head(base.model)).prepare_costs()  # measured again and saved: read back silently
    assert len(measured) == 2 and not caplog.records


def test_a_calibration_taken_from_two_threads_at_once_is_one_table():
    """The page's calibration plot takes a table from its thread while a
    decoding takes it from another: both made it anew (what it had learned
    lost), or deleted the same oldest table (KeyError)."""
    import sys
    import threading

    calibrations, setting, seen, failed = Calibrations(), ("greedy",), set(), []
    first = calibrations.get("head", setting)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)

    def take():
        try:
            for n in range(100_000):
                seen.add(id(calibrations.get("head", setting)))
                calibrations.get("head", ("top_p", n % 100))  # past SETTINGS_KEPT: the oldest go
        except Exception as error:
            failed.append(repr(error))

    try:
        threads = [threading.Thread(target=take) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert failed == [] and seen == {id(first)} and calibrations.get("head", setting) is first
