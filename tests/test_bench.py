import json
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from core.bench import LlamaStick, format_table, run_bench, summarize
from core.prompt import PromptFileError, load_prompts
from core.config import SamplingParams, TreeParams
from core.engine import Engine
from tests.factory import random_head


def write_prompts(path, rows):
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


def test_load_prompts_reads_turns_ids_and_sources(tmp_path):
    path = write_prompts(tmp_path / "p.jsonl", [
        {"id": "a", "source": "chat", "turns": ["hi", "more"]},
        {"turns": ["second"], "source": "code"},
        {"id": "c", "source": "chat", "turns": ["third"]},
    ])  # fmt: skip
    prompts = load_prompts(path)
    assert [p.id for p in prompts] == ["a", "line-2", "c"] and prompts[0].text == "hi"
    assert [p.id for p in load_prompts(path, limit=2)] == ["a", "line-2"]
    assert [p.id for p in load_prompts(path, per_source=1)] == ["a", "line-2"]


@pytest.mark.parametrize(
    "content, message",
    [
        ("{bad", r"p\.jsonl:1: not valid JSON"), ('{"id": "x"}', r"p\.jsonl:1: needs a 'turns' list"), ("\n", "no prompts"),
        ('{"turns": ["w1"]}\n{"turns": ["w1", 5, "w2"]}', r"p\.jsonl:2: turn 2 is not text"),  # not skipped: "w2" would be turn 2
        ('{"turns": ["w1", "w2", " "]}', r"p\.jsonl:1: turn 3 is empty"),
        ('{"id": 7, "turns": ["w1"]}\n{"id": null, "turns": ["w2"]}', r"p\.jsonl:2: its id null is not text or a number"),
    ],
)  # fmt: skip
def test_bad_prompt_files_name_the_line(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(PromptFileError, match=message):
        load_prompts(path)


def test_missing_prompt_file(tmp_path):
    with pytest.raises(PromptFileError, match="no such prompt file"):
        load_prompts(tmp_path / "none.jsonl")
    os.mkfifo(tmp_path / "pipe")  # as a shell's <(...) gives: it exists, and is no file to read twice
    for path in (tmp_path / "pipe", Path(os.devnull)):
        with pytest.raises(PromptFileError, match="not a regular file"):
            load_prompts(path)


def test_bench_in_float64_is_identical_and_complete(tiny_base, tmp_path):
    engine = Engine(tiny_base, random_head(tiny_base.model, seed=3))
    path = write_prompts(tmp_path / "p.jsonl", [{"id": str(i), "turns": [f"w{i} w{i + 1} w{i + 2}"]} for i in range(3)])
    calls = []
    result = run_bench(
        engine, load_prompts(path), ("vanilla", "eagle", "eagle2", "generate"),
        SamplingParams(max_new_tokens=24), TreeParams(10, 3, 3), warmup=1,
        progress=lambda done, total, text: calls.append((done, total)),
    )  # fmt: skip
    summary = result["summary"]
    assert summary["identical_fraction"] == 1.0
    assert summary["mean_accepted_length"] >= 1.0
    assert summary["speedup"] == pytest.approx(summary["eagle2_tokens_per_s"] / summary["vanilla_tokens_per_s"])
    assert result["modes"]["vanilla"]["mean_accepted_length"] == 1.0
    assert len(result["prompts"]) == 12 and calls[-1] == (12, 12)
    by_mode = {(row["id"], row["mode"]): row["output_ids"] for row in result["prompts"]}
    assert all(by_mode[(str(i), "generate")] == by_mode[(str(i), "vanilla")] for i in range(3))
    json.dumps(result)  # JSON-ready
    assert result["complete"] is True and result["settings"]["prompts"] == 3
    assert "eagle2" in format_table(result)
    # the rate after the first token: the tokens after each reply's first over the time after it
    vanilla = [row for row in result["prompts"] if row["mode"] == "vanilla"]
    after = sum(row["seconds"] - row["first_token_seconds"] for row in vanilla)
    assert result["modes"]["vanilla"]["decoding_tokens_per_s"] == pytest.approx((sum(row["tokens"] for row in vanilla) - 3) / after)
    assert result["modes"]["generate"]["decoding_tokens_per_s"] is None  # transformers' generate says no first-token time
    header, *rows = format_table(result).splitlines()
    assert header.split()[4] == "decode/s" and rows[3].split()[0] == "generate" and rows[3].split()[4] == "-"
    assert rows[0].split()[4] == f"{result['modes']['vanilla']['decoding_tokens_per_s']:.2f}"


def test_generate_decodes_with_kestrels_settings_alone(tmp_path, monkeypatch):
    """transformers' generate merged the rest of the model's generation_config
    (a Qwen2.5's repetition_penalty 1.05, ...) into the baseline, which then
    timed other text than Kestrel's vanilla."""
    from transformers import GenerationConfig

    from core.bench import run_once
    from models.base import load_base
    from tests.factory import save_tiny_model

    base = load_base(str(save_tiny_model(tmp_path / "spread", sharpness=2.0)), dtype="float64")
    recommended = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05,
                                   no_repeat_ngram_size=8, suppress_tokens=[60], bos_token_id=1, eos_token_id=4, pad_token_id=2)  # fmt: skip
    monkeypatch.setattr(base.model, "generation_config", recommended)
    engine = Engine(base)
    sampling = SamplingParams(max_new_tokens=30)
    for prompt in ([5, 9, 10, 11, 12, 13], [5, 20, 21, 22]):
        vanilla = run_once(engine, prompt, "vanilla", sampling, TreeParams())["output_ids"]
        for mode in ("generate", "prompt-lookup"):
            assert run_once(engine, prompt, mode, sampling, TreeParams())["output_ids"] == vanilla, (mode, prompt)
    assert base.model.generation_config is recommended  # the model's own is back after each run


def test_bench_turns_run_conversations_that_continue_their_caches(tiny_base, tmp_path):
    """--turns: each mode answers a prompt's turns with its own replies; later
    turns continue the last turn's caches, are timed read afresh too, and give
    the replies a fresh read gives (vanilla's, and transformers' generate's)."""
    engine = Engine(tiny_base, random_head(tiny_base.model, seed=3))
    path = write_prompts(tmp_path / "p.jsonl", [
        {"id": "a", "turns": ["w1 w2 w3", "w4 w5", "w6"]}, {"id": "b", "turns": ["w7 w8"]},
    ])  # fmt: skip
    assert load_prompts(path)[0].follow_ups == ("w4 w5", "w6")
    result = run_bench(engine, load_prompts(path), ("vanilla", "eagle2", "generate"), SamplingParams(max_new_tokens=12),
                       TreeParams(10, 3, 3), warmup=0, turns=3)  # fmt: skip
    rows = {(row["id"], row["mode"]): row for row in result["prompts"]}
    assert sorted({row["id"] for row in result["prompts"]}) == ["a", "a#2", "a#3", "b"]
    assert result["summary"]["identical_fraction"] == 1.0 and result["summary"]["identical_fraction_by_mode"]["generate"] == 1.0
    assert result["settings"]["turns"] == 3 and result["settings"]["prompts"] == 2
    for mode in ("vanilla", "eagle2"):
        assert rows[("a", mode)]["reused_tokens"] == 0  # the first turn reads its prompt, whatever ran before
        for later in ("a#2", "a#3"):
            row = rows[(later, mode)]
            assert row["prompt_tokens"] > row["reused_tokens"] >= rows[("a", mode)]["prompt_tokens"] - 1
            assert row["fresh_first_token_seconds"] > 0
        assert result["summary"]["later_turns"][mode]["turns"] == 2
    assert "generate" not in result["summary"]["later_turns"] and "fresh_first_token_seconds" not in rows[("a#2", "generate")]
    assert "eagle2, 2 later turns: first token after" in format_table(result)
    json.dumps(result)


def test_sampled_bench_compares_replies_made_with_one_seed(tiny_base, tmp_path):
    """One seed makes the same sample in vanilla and the speculative modes, so
    a seeded sampled run reports identity too; other engines' samplers are
    not compared, and without a seed nothing is."""
    engine = Engine(tiny_base, random_head(tiny_base.model))
    path = write_prompts(tmp_path / "p.jsonl", [{"turns": ["w1 w2"]}, {"turns": ["w3 w1 w2"]}])
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=7)
    result = run_bench(engine, load_prompts(path), ("vanilla", "eagle2", "generate"), sampling, warmup=0)
    assert result["summary"]["identical_fraction"] == 1.0
    assert result["summary"]["identical_fraction_by_mode"] == {"eagle2": 1.0}
    table = format_table(result)
    assert "identical_fraction 1.00" in table and "sampled with seed 7 (--seed 7 repeats it)" in table
    assert "note: the replies average" in table and "too few to time well" in table  # 8 tokens at most
    again = run_bench(engine, load_prompts(path), ("vanilla", "generate"), sampling, warmup=0)
    def generated(run):
        return [row["output_ids"] for row in run["prompts"] if row["mode"] == "generate"]

    assert generated(again) == generated(result)  # --seed repeats generate's sample too
    unseeded = run_bench(engine, load_prompts(path), ("vanilla", "eagle2"), replace(sampling, seed=None), warmup=0)
    assert unseeded["summary"]["identical_fraction"] is None
    assert "identical_fraction n/a (sampled without a seed)" in format_table(unseeded)


def test_table_says_when_a_baseline_timed_other_text(tiny_base, tmp_path):
    """A baseline whose greedy replies differ from vanilla's (another engine's
    kernels at a near-tie) times other text: the table says so, not only the JSON."""
    engine = Engine(tiny_base)
    path = write_prompts(tmp_path / "p.jsonl", [{"turns": ["w1 w2"]}, {"turns": ["w3 w1"]}])
    result = run_bench(engine, load_prompts(path), ("vanilla", "generate"), SamplingParams(max_new_tokens=4), warmup=0)
    assert result["summary"]["identical_fraction_by_mode"] == {"generate": 1.0}
    assert "differ from vanilla" not in format_table(result)
    first = next(row for row in result["prompts"] if row["mode"] == "generate")
    first["output_ids"] = first["output_ids"][:-1] + [first["output_ids"][-1] + 1]
    result["summary"] = summarize(result["prompts"], ("vanilla", "generate"), SamplingParams(max_new_tokens=4))
    assert "note: generate's replies differ from vanilla's on 50% of the prompts" in format_table(result)


def test_the_warm_up_decodes_none_of_the_timed_prompts(tiny_base, tmp_path, monkeypatch):
    """The warm-up ran the first timed prompts, so their replies' first 16
    tokens were decoded (and the planner taught) before they were timed.
    It runs built-in prompts, round again past the last."""
    from core import bench

    engine = Engine(tiny_base, random_head(tiny_base.model))
    path = write_prompts(tmp_path / "p.jsonl", [{"turns": ["w1 w2"]}, {"turns": ["w3 w4 w5"]}])
    timed = [engine.encode([{"role": "user", "content": text}]) for text in ("w1 w2", "w3 w4 w5")]
    warm = [engine.encode([{"role": "user", "content": text}]) for text in bench.WARMUP_PROMPTS]
    decoded, run_once = [], bench.run_once
    monkeypatch.setattr(bench, "run_once", lambda engine, ids, *args: decoded.append(list(ids)) or run_once(engine, ids, *args))
    result = run_bench(engine, load_prompts(path), ("vanilla", "eagle2"), SamplingParams(max_new_tokens=4), warmup=4)
    first = len(bench.WARMUP_PROMPTS) + 1
    assert decoded[: 2 * first] == [ids for ids in warm + warm[:1] for _ in range(2)]  # each through both modes
    assert decoded[2 * first :] == [ids for ids in timed for _ in range(2)]
    assert result["settings"]["warmup"] == 4


def test_a_run_records_what_the_planner_had_learnt_before_it(tiny_base, tmp_path):
    """A long-lived engine (the Compare tab's server) sizes its first timed
    trees from earlier replies: the result records what each planned mode's
    planner had learnt before the warm-up and before the first timed prompt,
    and says so where it had learnt anything before the run."""
    engine = Engine(tiny_base, random_head(tiny_base.model, seed=3))
    path = write_prompts(tmp_path / "p.jsonl", [{"turns": ["w1 w2"]}])
    sampling = SamplingParams(max_new_tokens=8)
    fresh = run_bench(engine, load_prompts(path), ("vanilla", "eagle2", "eagle2:8/3/3"), sampling, warmup=1)
    learned = fresh["summary"]["planner_learned"]
    assert set(learned["before_warmup"]) == {"eagle2"}  # a fixed tree plans nothing
    assert learned["before_warmup"]["eagle2"] == {"head_nodes": 0, "context_nodes": 0, "drafts_timed": 0}
    warm = learned["before_timing"]["eagle2"]
    assert warm["head_nodes"] > 0 and warm["drafts_timed"] > 0  # the warm-up taught it
    assert "planner had learnt" not in format_table(fresh)
    again = run_bench(engine, load_prompts(path), ("vanilla", "eagle2"), sampling, warmup=0)
    before = again["summary"]["planner_learned"]["before_warmup"]["eagle2"]
    assert before["head_nodes"] >= warm["head_nodes"] and before == again["summary"]["planner_learned"]["before_timing"]["eagle2"]
    nodes = before["head_nodes"] + before["context_nodes"]
    said = f"note: eagle2's planner had learnt from {nodes} verified draft nodes and {before['drafts_timed']} timed drafts (earlier replies)"
    assert said in format_table(again)
    json.dumps(again)
    sampled = run_bench(engine, load_prompts(path), ("vanilla", "eagle2"), replace(sampling, temperature=0.7, seed=1), warmup=0)
    learned = sampled["summary"]["planner_learned"]["before_warmup"]["eagle2"]  # nothing of this setting; the drafts' timing is shared
    assert learned["head_nodes"] == 0 and learned["drafts_timed"] > 0
    assert f"eagle2's planner had learnt from {learned['drafts_timed']} timed drafts (earlier replies)" in format_table(sampled)


def test_a_run_of_baselines_alone_prints_no_empty_tau_lines(tiny_base, tmp_path):
    """generate and prompt-lookup count no forwards: a run of them alone has
    no tau to say, and printed a "tau on SOURCE: " line with nothing after it."""
    path = write_prompts(tmp_path / "p.jsonl", [{"turns": ["w1 w2"], "source": "chat"}])
    result = run_bench(Engine(tiny_base), load_prompts(path), ("generate",), SamplingParams(max_new_tokens=4), warmup=0)
    assert result["summary"]["tau_by_source"] == {"chat": {"generate": None}}
    assert "tau on" not in format_table(result)


def test_a_cancelled_bench_stops_transformers_generate_too(tiny_base, tmp_path):
    """The cancel signal (Ctrl+C) ends a generate or prompt-lookup row within a
    step, as it ends Kestrel's modes, and a run cancelled before any prompt
    finished has nothing to report."""
    import threading

    from core.bench import BenchCancelled, run_once

    engine = Engine(tiny_base)
    cancel = threading.Event()
    cancel.set()
    for mode in ("generate", "prompt-lookup"):
        assert run_once(engine, [5, 6, 7], mode, SamplingParams(max_new_tokens=60), TreeParams(), None, cancel)["tokens"] <= 1
    path = write_prompts(tmp_path / "p.jsonl", [{"turns": ["w1 w2"]}])
    with pytest.raises(BenchCancelled) as stopped:
        run_bench(engine, load_prompts(path), ("vanilla", "generate"), SamplingParams(max_new_tokens=8), cancel=cancel)
    assert stopped.value.result is None


def test_unknown_mode_is_named(tiny_base, tmp_path):
    path = write_prompts(tmp_path / "p.jsonl", [{"turns": ["w1"]}])
    with pytest.raises(ValueError, match="warp"):
        run_bench(Engine(tiny_base), load_prompts(path), ("warp",))
    with pytest.raises(ValueError, match="needs a draft head"):
        run_bench(Engine(tiny_base), load_prompts(path), ("eagle2",))


def test_mode_labels_set_tree_shapes():
    from core.bench import parse_mode

    tree = TreeParams(16, 5, 4, min_path_prob=0.1)
    assert parse_mode("eagle2", tree) == ("eagle2", tree)
    assert parse_mode("eagle2:8/4/2", tree) == ("eagle2", TreeParams(8, 4, 2, min_path_prob=0.1))
    assert parse_mode("eagle2:8/4/2/6", tree)[1].lookup_tokens == 6
    with pytest.raises(ValueError, match="eagle drafts EAGLE-1's fixed tree; tree shapes are for eagle2"):
        parse_mode("eagle@x:6/3/2", tree)  # the shape was shown in the table and ignored
    # "@" alone ran the own head, unlabelled; "eagle2:" ran eagle2 under a label no summary reads
    for bad in ("eagle2:8/4", "vanilla:8/4/2", "eagle2:a/b/c", "eagle2@", "eagle2@:8/4/2", "eagle2:", "vanilla:"):
        with pytest.raises(ValueError, match="bad mode"):
            parse_mode(bad, tree)


def test_bench_app_reads_the_chat_command_and_server_lines_and_shows_medians():
    from app.appbench import CHAT_RATE, SERVER_URL, format_rows

    line = "[eagle2] 202 tokens in 18.80 s: 10.7 tokens/s, tau 3.21, first token after 0.34 s, finished: stop"
    assert CHAT_RATE.findall(line) == [("202", "10.7")]
    started = "Kestrel is running at http://127.0.0.1:7861/ on 127.0.0.1. Press Ctrl+C to stop."
    assert SERVER_URL.search(started).group(1) == "http://127.0.0.1:7861/"
    rows = [
        {"way": way, "mode": "eagle2", "round": r, "tokens": 10, "tokens_per_s": rate, "vs_chat_command": ratio}
        for r, (way, rate, ratio) in enumerate(
            [("chat command", 10.0, 1.0), ("page in Chromium", 7.0, 0.7), ("chat command", 12.0, 1.0),
             ("page in Chromium", 9.0, 0.75), ("page in Chromium", 1.0, 0.1)]
        )
    ]  # fmt: skip
    table = format_rows(rows).splitlines()
    assert table[1].split()[-2:] == ["11.0", "1.00x"]
    assert table[2].split()[-2:] == ["7.0", "0.70x"]  # medians of three rounds
    rows[-1]["tokens"] = 12  # a round whose reply came out longer: the range, not the last round's count
    assert format_rows(rows).splitlines()[2].split()[-3:] == ["10-12", "7.0", "0.70x"]


def test_a_crashing_llama_cpp_helper_is_reported_as_a_crash(tmp_path):
    """llama.cpp dying on a signal (e.g. an AMX build where AMX is not enabled) is named as a crash."""
    helper = tmp_path / "python"
    helper.write_text('#!/bin/sh\necho \'{"ready": true}\'\nread request\nkill -SEGV $$\n')
    helper.chmod(0o755)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    engine = SimpleNamespace(base=SimpleNamespace(name=str(gguf)), stop_ids={2}, context_limit=8192)
    stick = LlamaStick(str(helper), engine, SamplingParams())
    with pytest.raises(ValueError, match=r"crashed \(signal 11\)"):
        stick.run([1, 2, 3], 4)


def test_a_python_without_llama_cpp_is_one_line(tmp_path, capfd):
    """The helper run by a Python that lacks llama-cpp-python says so in
    Kestrel's one-line error, not with that Python's traceback first."""
    import sys

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    engine = SimpleNamespace(base=SimpleNamespace(name=str(gguf)), stop_ids={2}, context_limit=8192)
    with pytest.raises(ValueError, match=r"llama.cpp did not start \(llama-cpp-python is not installed there \(No module named 'llama_cpp'"):
        LlamaStick(sys.executable, engine, SamplingParams())
    assert "Traceback" not in capfd.readouterr().err


def test_two_heads_are_compared_in_one_run(tiny_base, tmp_path):
    from tests.factory import random_eagle3_head

    engine = Engine(tiny_base, random_head(tiny_base.model, seed=3))
    other = Engine(tiny_base, random_eagle3_head(tiny_base.model, seed=4), "third")
    path = write_prompts(tmp_path / "p.jsonl", [{"id": str(i), "turns": [f"w{i} w{i + 3}"]} for i in range(2)])
    result = run_bench(
        engine, load_prompts(path), ("vanilla", "eagle2", "eagle2@third:8/3/2"), SamplingParams(max_new_tokens=16),
        TreeParams(8, 3, 2), warmup=0, other_heads={"third": other},
    )  # fmt: skip
    assert result["summary"]["identical_fraction_by_mode"] == {"eagle2": 1.0, "eagle2@third:8/3/2": 1.0}
    assert result["settings"]["other_heads"] == {"third": "third"}
    rows = [row for row in result["prompts"] if row["mode"] == "eagle2@third:8/3/2"]
    assert len(rows) == 2 and all(row["tree_nodes"] > row["forwards"] - 1 for row in rows)  # trees, not single tokens
    with pytest.raises(ValueError, match="no other head called 'fourth'"):
        run_bench(engine, load_prompts(path), ("eagle2@fourth",), other_heads={"third": other})
    with pytest.raises(ValueError, match="only eagle and eagle2"):
        run_bench(engine, load_prompts(path), ("vanilla@third",), other_heads={"third": other})

    from app.cli import main

    assert main(["bench", "--prompts", str(path), "--other-head", "no name"]) == 2


def test_bench_refuses_an_unknown_or_missing_other_head_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from app.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr("app.cli.load_engine", no_model)
    path = write_prompts(tmp_path / "p.jsonl", [{"id": "0", "turns": ["w1 w2"]}])
    cases = [
        (["--modes", "vanilla,eagle2@mine"], "--modes eagle2@mine: no other head called 'mine'"),
        (["--modes", "eagle2@mine", "--other-head", f"mine={tmp_path / 'nope'}"], "nope: no such draft-head folder"),
        (["--modes", "eagle2@mine", "--other-head", f"mine={path}"], "is a file; a draft head is the folder"),
        (["--modes", "vanilla,eagle2", "--other-head", f"mine={tmp_path}"], "--other-head mine: no mode drafts with it"),
        (["--modes", "eagle2:08/4/4,eagle2:8/4/4"], "--modes eagle2:08/4/4 and eagle2:8/4/4 run the same decoding"),
        (["--modes", "eagle2,eagle2:8/4/4", "--total-tokens", "8", "--depth", "4", "--tree-top-k", "4"], "run the same decoding"),
        (["--model", str(tmp_path), "--modes", "vanilla,eagle2"], "--modes eagle2 needs a draft head: give --head HEAD"),  # no bundled head for it
        (["--model", str(tmp_path / "mistyped")], "mistyped: no such file or folder, and not a Hugging Face repo id"),  # not "needs a head"
    ]
    for extra, message in cases:
        assert main(["bench", "--prompts", str(path), *extra]) == 2
        assert message in capsys.readouterr().err


def test_a_run_cut_short_keeps_the_prompts_it_finished(tiny_base, tmp_path, monkeypatch):
    """After each prompt's last mode the result so far is handed out ("complete"
    false); when the third prompt fails, the first two are still there."""
    from core import bench

    engine = Engine(tiny_base, random_head(tiny_base.model, seed=3))
    path = write_prompts(tmp_path / "p.jsonl", [{"id": str(i), "turns": [f"w{i} w{i + 1}"]} for i in range(3)])
    original, calls = bench.run_once, []

    def failing_third(*args, **kwargs):
        calls.append(1)
        if len(calls) > 4:  # two prompts x two modes, then the third prompt breaks
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(bench, "run_once", failing_third)
    saved = []
    with pytest.raises(KeyboardInterrupt):
        run_bench(engine, load_prompts(path), ("vanilla", "eagle2"), SamplingParams(max_new_tokens=8), warmup=0, partial=saved.append)
    assert [result["settings"]["prompts"] for result in saved] == [1, 2]
    last = saved[-1]
    assert last["complete"] is False and [row["id"] for row in last["prompts"]] == ["0", "0", "1", "1"]
    assert last["summary"]["identical_fraction"] == 1.0 and set(last["summary"]["draft_timing"]) == {"eagle2"}
    assert engine.calibrations.timing.observations > 0  # what draft_timing reports was learned
    json.dumps(last)


def test_the_bench_command_leaves_a_json_file_when_stopped(tiny_dir, tmp_path, monkeypatch):
    """Ctrl-C during the second prompt: the command ends as interrupted, and
    its --json file holds the first prompt, marked incomplete."""
    from app.cli import main
    from core import bench

    path = write_prompts(tmp_path / "p.jsonl", [{"id": str(i), "turns": [f"w{i} w{i + 1}"]} for i in range(3)])
    original, calls = bench.run_once, []

    def stopped_second(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(bench, "run_once", stopped_second)
    out = tmp_path / "bench.json"
    command = ["bench", "--prompts", str(path), "--model", str(tiny_dir), "--dtype", "float64", "--modes", "vanilla"]
    assert main([*command, "--warmup", "0", "--max-new-tokens", "4", "--json", str(out)]) == 130
    saved = json.loads(out.read_text())
    assert saved["complete"] is False and [row["id"] for row in saved["prompts"]] == ["0"]
    assert not out.with_name("bench.json.partial").exists()


def test_a_json_file_that_cannot_be_written_says_what_it_holds(tiny_dir, tmp_path, monkeypatch, capsys):
    """A full disk at the last write: the error names the file and says it holds an earlier prompt's results."""
    import app.store
    from app.cli import main

    path = write_prompts(tmp_path / "p.jsonl", [{"id": str(i), "turns": [f"w{i} w{i + 1}"]} for i in range(2)])
    original, calls = app.store.write_atomic, []

    def full_disk_at_the_end(target, *args, **kwargs):
        calls.append(1)
        if len(calls) > 1:  # the first prompt's write reached the file
            raise OSError(28, "No space left on device", str(target))
        return original(target, *args, **kwargs)

    monkeypatch.setattr(app.store, "write_atomic", full_disk_at_the_end)
    out = tmp_path / "bench.json"
    command = ["bench", "--prompts", str(path), "--model", str(tiny_dir), "--dtype", "float64", "--modes", "vanilla"]
    assert main([*command, "--warmup", "0", "--max-new-tokens", "4", "--json", str(out)]) == 2
    said = capsys.readouterr().err
    assert f"{out}: cannot be written (No space left on device); it holds this run's results as of an earlier prompt" in said, said
    assert json.loads(out.read_text())["complete"] is False


def test_results_files_follow_the_umask_and_chats_stay_private(tmp_path):
    import os

    from app.store import write_atomic

    mask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "result.json", "{}", shared=True)
        write_atomic(tmp_path / "chat.json", "{}")
    finally:
        os.umask(mask)
    assert (tmp_path / "result.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "chat.json").stat().st_mode & 0o777 == 0o600


def test_bench_app_refuses_modes_the_page_cannot_run_before_starting_a_server(capsys, tmp_path, monkeypatch):
    from app import appbench
    from app.cli import main

    monkeypatch.setattr(appbench, "run_app_bench", lambda *args, **kwargs: pytest.fail("no server may start"))
    assert main(["bench-app", "--modes", "vanilla,generate", "--threads", "1"]) == 2
    assert "--modes generate: bench-app measures vanilla, eagle, eagle2" in capsys.readouterr().err
    assert main(["bench-app", "--root", str(tmp_path), "--threads", "1"]) == 2
    assert f"--root {tmp_path}: no launch.py there" in capsys.readouterr().err
    assert main(["bench-app", "--prompt", " ", "--threads", "1"]) == 2
    assert "--prompt is empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the page's limit: past it, the page's own endpoint refuses the reply midway
        main(["bench-app", "--max-new-tokens", "32769"])
    assert "--max-new-tokens: must be from 1 to 32768" in capsys.readouterr().err
    assert appbench.fresh_reads(Path(__file__).resolve().parent.parent) == ["--no-kept-caches"] and appbench.fresh_reads(tmp_path) == []  # an older Kestrel has no such option


def test_a_conversation_past_the_context_window_is_left_out_and_baselines_stop_where_kestrel_does(tiny_base, tmp_path):
    """A later turn that no longer fits (its length depends on the replies)
    ended the whole run without a table; the other prompts are kept now. And
    transformers' generate ran past the window where Kestrel's modes stop,
    timing other work."""
    engine = Engine(tiny_base, random_head(tiny_base.model, seed=3))
    words = lambda count, start: " ".join(f"w{(start + i) % 50}" for i in range(count))  # noqa: E731
    path = write_prompts(tmp_path / "p.jsonl", [
        {"id": "long", "turns": [words(40, 0), words(100, 7), words(100, 13)]}, {"id": "short", "turns": ["w7 w8", "w9"]},
        {"id": "last", "turns": ["w3"]},
    ])  # fmt: skip
    written = []  # the JSON after each prompt but the last: none while no prompt is kept (the left-out one came first)
    result = run_bench(engine, load_prompts(path), ("vanilla", "eagle2", "generate"), SamplingParams(max_new_tokens=12),
                       TreeParams(10, 3, 3), warmup=5, turns=3, partial=lambda r: written.append(json.loads(json.dumps(r))))  # fmt: skip
    assert [sorted({row["id"] for row in partial["prompts"]}) for partial in written] == [["short", "short#2"]]
    assert sorted({row["id"] for row in result["prompts"]}) == ["last", "short", "short#2"]
    assert len(result["summary"]["left_out"]) == 1 and result["summary"]["left_out"][0].startswith("prompt long, turn 3 (vanilla)")
    assert "note: left out, prompt long, turn 3 (vanilla)" in format_table(result) and result["settings"]["warmup"] == 5  # built-in prompts, not capped by the timed ones
    # a prompt 16 tokens short of the window: every mode stops there, generate too
    near = write_prompts(tmp_path / "near.jsonl", [{"id": "near", "turns": [words(engine.context_limit - 16 - 8, 3)]}])
    prompt_tokens = len(engine.encode([{"role": "user", "content": load_prompts(near)[0].text}]))
    result = run_bench(engine, load_prompts(near), ("vanilla", "generate", "prompt-lookup"), SamplingParams(max_new_tokens=64), warmup=0)
    tokens = {row["mode"]: row["tokens"] for row in result["prompts"]}
    assert max(tokens.values()) <= engine.context_limit - prompt_tokens and tokens["generate"] == tokens["vanilla"]
    assert result["summary"]["identical_fraction_by_mode"] == {"generate": 1.0, "prompt-lookup": 1.0}
    lookup = result["modes"]["prompt-lookup"]["tokens_per_s"] / result["modes"]["generate"]["tokens_per_s"]
    assert f"prompt-lookup {lookup:.2f}x of generate, both transformers' generate (run eagerly)" in format_table(result)
    del result["modes"]["generate"]  # prompt-lookup beside Kestrel's own modes alone: the table says what it compares
    assert "note: prompt-lookup runs transformers' generate eagerly, where vanilla runs Kestrel's own passes" in format_table(result)
    del result["modes"]["vanilla"]  # no mode of Kestrel's ran: nothing to set it beside
    assert "prompt-lookup runs transformers' generate" not in format_table(result)
    # a prompt named as another's later turn would share its rows
    clash = write_prompts(tmp_path / "clash.jsonl", [{"id": "a", "turns": ["w1", "w2"]}, {"id": "a#2", "turns": ["w3"]}])
    with pytest.raises(ValueError, match="prompt a#2: the rows of prompt a's turn 2 are named so"):
        run_bench(engine, load_prompts(clash), ("vanilla",), SamplingParams(max_new_tokens=4), warmup=0, turns=2)


def test_bench_loads_no_head_for_modes_without_one_and_refuses_bad_options_before_loading(tiny_dir, tmp_path, capsys, monkeypatch):
    from app import session
    from app.cli import main

    path = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "turns": ["w1 w2"]}])
    common = ["bench", "--prompts", str(path), "--model", str(tiny_dir), "--dtype", "float64", "--warmup", "0", "--max-new-tokens", "4"]
    assert main([*common, "--modes", "vanilla,generate", "--head", str(tmp_path / "no-head")]) == 0  # none is loaded
    assert "vanilla" in capsys.readouterr().out

    def loaded(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(session, "load_base", loaded)
    for options, message in (
        (["--modes", "generate@x"], "only eagle and eagle2 draft with a head"),  # not "give --other-head x=...", which fails next
        (["--modes", "vanilla,llama.cpp", "--llama-python", str(tmp_path / "no-python")], "no such program"),
    ):
        assert main([*common, *options]) == 2 and message in capsys.readouterr().err


def test_a_kill_stops_a_bench_as_ctrl_c_does():
    """SIGTERM (a time limit, a scheduler) ended bench at once, with no table:
    where main() makes it raise as Ctrl+C does, it stops the decoding instead."""
    import os
    import signal

    from app.cli import _interrupted, stop_on_interrupt

    before = signal.signal(signal.SIGTERM, _interrupted)
    try:
        with stop_on_interrupt() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.is_set()
            assert signal.getsignal(signal.SIGTERM) is _interrupted  # a second one raises at once
        assert signal.getsignal(signal.SIGTERM) is _interrupted
    finally:
        signal.signal(signal.SIGTERM, before)


def test_bench_app_keeps_the_rows_measured_before_a_way_fails(tmp_path, monkeypatch, capsys):
    """--json was written only once every way had run: a page that failed in
    the second round (or Ctrl+C) lost the rows of the first."""
    from app import appbench
    from app.cli import main
    from models.errors import KestrelError

    (tmp_path / "data").mkdir()
    monkeypatch.setattr(appbench.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "data"))
    monkeypatch.setattr(appbench.subprocess, "Popen", lambda *args, **kwargs: SimpleNamespace(terminate=lambda: None, wait=lambda timeout: 0))
    monkeypatch.setattr(appbench, "wait_until_up", lambda log, server: "http://127.0.0.1:7877/")
    monkeypatch.setattr(appbench, "api_model", lambda url: None)
    monkeypatch.setattr(appbench, "CHROMIUM", tmp_path / "no-chromium")
    monkeypatch.setattr(appbench, "chat_command", lambda *args: {"tokens": 10, "tokens_per_s": 10.0})
    warmed = []
    monkeypatch.setattr(appbench, "warm_server", lambda url, model, modes: warmed.append(modes))
    pages = []

    def page(url, prompt, mode, max_new_tokens):
        pages.append(mode)
        if len(pages) > 2:  # round 2's first page
            raise KestrelError("the page's reply did not finish in time")
        return {"tokens": 10, "tokens_per_s": 5.0, "updates": 3}

    monkeypatch.setattr(appbench, "through_gradio_client", page)
    out = tmp_path / "rows.json"
    assert main(["bench-app", "--threads", "1", "--rounds", "2", "--json", str(out)]) == 2
    rows = json.loads(out.read_text())
    assert [(row["round"], row["mode"], row["way"], row["vs_chat_command"]) for row in rows] == [
        (1, "vanilla", "chat command", 1.0), (1, "vanilla", "page endpoint (gradio_client)", 0.5),
        (1, "eagle2", "chat command", 1.0), (1, "eagle2", "page endpoint (gradio_client)", 0.5), (2, "vanilla", "chat command", 1.0),
    ]  # fmt: skip
    err = capsys.readouterr().err
    assert f"wrote {out} with the 5 rows measured before it stopped" in err and "error: the page's reply did not finish in time" in err
    assert warmed == [["vanilla", "eagle2"]]  # once, before the first round


def test_bench_app_gives_the_chat_command_a_prompt_that_starts_with_a_dash_as_the_prompt(monkeypatch):
    """`bench-app --prompt=-v` ran `chat -v ...`, which the chat command read
    as an option; `--prompt=-` made it wait for standard input."""
    from app import appbench
    from app.cli import build_parser

    ran = []

    def run(command, input=None, **kwargs):
        ran.append((command, input))
        return SimpleNamespace(returncode=0, stdout="", stderr="[eagle2] 5 tokens in 1.00 s: 5.0 tokens/s, tau 1.00")

    monkeypatch.setattr(appbench.subprocess, "run", run)
    root = Path(__file__).resolve().parent.parent
    for prompt in ("-v", "--help", "-", "- a list item"):
        assert appbench.chat_command(root, prompt, "eagle2", 8, 1, {}) == {"tokens": 5, "tokens_per_s": 5.0}
        command, given = ran[-1]
        args = build_parser().parse_args(command[2:])
        assert (args.command, args.prompt, args.mode, args.warmup) == ("chat", prompt, "eagle2", 1)  # a warm process's reply
        assert given == ("-" if prompt == "-" else "")  # `chat -` reads the prompt from standard input
