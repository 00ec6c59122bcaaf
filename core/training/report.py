"""training_report.json and TRAINING.md: what the head was trained on, how
long each phase took, and how well it drafts."""

from __future__ import annotations

import json
from pathlib import Path

from models.paths import write_whole

REPORT_FILE = "training_report.json"
NOTES_FILE = "TRAINING.md"


def write_report(folder: Path, report: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_whole(folder / REPORT_FILE, json.dumps(report, indent=2) + "\n")
    write_whole(folder / NOTES_FILE, render_markdown(report))


def read_report(folder: Path) -> dict:
    return json.loads((folder / REPORT_FILE).read_text(encoding="utf-8"))


def update_report(folder: Path, **fields) -> dict:
    """Add sections (an acceptance check, notes) to a written report."""
    report = {**read_report(folder), **fields}
    write_report(folder, report)
    return report


def percent(value: float | None) -> str:
    """A share as a percentage; n/a for a draft step that no position reached (None)."""
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _percent(values: list[float | None]) -> str:
    return " / ".join(percent(value) for value in values)


def _numbers(values: list[float | None]) -> str:
    return " / ".join("n/a" if value is None else f"{value:.3f}" for value in values)


def _started_from(report: dict) -> list[str]:
    """The line saying which head a fine-tune (--init-head) started from, and whose draft tokens it keeps."""
    init_head = report.get("training", {}).get("params", {}).get("init_head")
    if not init_head:
        return []
    kept = " and keeps its draft tokens" if report.get("draft_vocab_from") == "init_head" else ""
    return [f"It started from the head in `{init_head}` (`--init-head`){kept}; the data below is this run's alone."]


def _steps(count: int) -> str:
    """"1/2/3": the draft steps 1 to `count`."""
    return "/".join(str(k) for k in range(1, count + 1))


def _unanswered(data: dict) -> str:
    """What the answers line adds where some planned answers were not made."""
    unanswered, planned = data.get("unanswered", 0), data.get("planned_answers", 0)
    unplanned = data.get("unplanned_answers", 0)
    if unplanned:  # the prompts file changed after the features were taken: the head learned from those answers too
        unplanned_text = (f"; {unplanned} of them answer prompts or samples this run does not plan (gone from its prompts "
                          "file, or skipped there): their features were taken before, and they were trained on too")  # fmt: skip
        return unplanned_text + (f"; {unanswered} of the {planned} planned were not made" if unanswered else "")
    if not unanswered:
        return ""
    if data.get("features_kept"):
        return (f"; {unanswered} of the {planned} planned were not made: the features were taken from the answers made "
                "before, and a resumed run keeps them")  # fmt: skip
    return f"; the time budget stopped the answers at {planned - unanswered} of {planned} planned"


def render_markdown(report: dict) -> str:
    data, training, phases = report["data"], report["training"], report["phases"]
    third = report.get("arch") == "eagle3"
    if third:
        kind = (
            f"EAGLE-3 head (one decoder layer over three captured layers of the base model, its own lm_head over "
            f"{report.get('draft_vocab') or 'all'} draft tokens, no feature regression)"
        )
    else:
        drafted = f"drafting from {report['draft_vocab']:,} of the base model's tokens" if report.get("draft_vocab") else "drafting from the whole vocabulary"
        kind = f"EAGLE-1/2 head (one decoder layer, {drafted})"
    unroll = training["params"]["unroll_steps"]
    lines = [
        f"# Draft head for {report['base_model']}",
        "",
        f"Self-distilled {kind}, trained by `python3 launch.py train-head`",
        "(core/training/). "
        + (f"Steps below are the unrolled draft steps {_steps(unroll)} (EAGLE-3's training-time test)." if unroll > 1 else
           "Its figures are for one draft step (no unrolled steps)."),  # fmt: skip
        *_started_from(report),
        "",
        "## Data",
        f"- prompts: {data['prompts']} from `{data['prompts_file']}` ({data['eval_prompts']} held out for evaluation)",
        f"- answers: {data['answers']} ({data['samples_per_prompt']} planned per prompt, sample 0 greedy, the others at "
        f"temperature {data['temperature']}; {100 * data['finished_fraction']:.0f}% ended before {data['max_new_tokens']} tokens)"
        + _unanswered(data),
        f"- answer tokens: {data['answer_tokens']:,}; feature rows (prompts + answers): {data['feature_rows']:,} "
        f"in {data['shards']} shards, {data['feature_megabytes']:.1f} MB of bf16"
        + (" (three layers' inputs per row)" if third else ""),
        "",
        "## Training",
        f"- steps: {training['steps']} of {training['total_steps']} planned ({training['steps_per_epoch']} per epoch, "
        f"about {training['params']['batch_tokens']} padded positions each)",
    ]
    params = training["params"]
    lines.append(
        f"- AdamW lr {params['learning_rate']} (warm-up {training.get('warmup_steps', params['warmup_steps'])}, cosine to x{params['min_lr_ratio']}), "
        f"betas 0.9/0.95, gradient value clip {params['grad_clip']}, input noise +-{params['noise']} x rms, "
        f"{params['unroll_steps']} unrolled step{'s' if params['unroll_steps'] != 1 else ''} (weights decay x{params['step_decay']}), "
        f"{'bf16 autocast' if params['bf16'] else 'fp32'}, seed {params['seed']}"
    )
    columns = ["epoch", "step", "split", *([] if third else ["SmoothL1"]), "CE", "top-1 (teacher-forced)", "chain step accuracy"]
    lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for record in training["history"]:
        for split in ("train", "eval"):
            metrics = record[split]
            if not metrics.get("accuracy"):  # no held-out prompt: no row
                continue
            cells = [str(record["epoch"]), str(record["step"]), split]
            cells += [] if third else [_numbers(metrics["smooth_l1"])]
            cells += [_numbers(metrics["cross_entropy"]), _percent(metrics["accuracy"]), _percent(metrics["chain_accuracy"])]
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "The table's figures are measured as the head trains (in its training precision"
        + ("; CE and top-1 over the draft vocabulary, at positions whose next token is in it)." if third else
           "; top-1 over the whole vocabulary" + (", before the head is cut to its draft tokens)." if report.get("draft_vocab") else ")."))  # fmt: skip
    )
    final = report.get("final_eval")
    if final and final.get("positions"):
        lines += [
            "",
            f"Final held-out, the written head as `eval-heads` judges it (float32; "
            f"{'its draft tokens' if report.get('draft_vocab') else 'its tokens'} against the base "
            f"model's greedy token over the whole vocabulary; {int(final['positions']):,} positions): top-1 "
            f"{_percent(final['accuracy'])} for step{'s' if len(final['accuracy']) > 1 else ''} "
            f"{_steps(len(final['accuracy']))}; in a greedy chain, step k is right "
            f"{_percent(final['chain_accuracy'])} of the time when steps < k were.",
        ]
    elif final is not None:
        lines += ["", "No held-out figures: no held-out prompt has an answer of 2 tokens or more."]
    lines += ["", "## Wall time"]
    lines += [f"- {name}: {seconds / 60:.1f} min" for name, seconds in phases.items()]
    acceptance = report.get("acceptance")
    if acceptance:
        lines += [
            "",
            "## Acceptance",
            f"{acceptance['prompts']} prompts of `{acceptance['prompts_file']}`, {acceptance['max_new_tokens']} new tokens, "
            f"greedy, eagle2 (tree {acceptance['tree']}): mean accepted length tau = {acceptance['tau']:.2f} "
            f"(per prompt: {', '.join(f'{t:.2f}' for t in acceptance['per_prompt'])}); "
            f"all outputs equal vanilla greedy: {acceptance['lossless']}.",
        ]
    notes = report.get("notes")
    if notes:
        lines += ["", "## Notes", *[f"- {note}" for note in notes]]
    return "\n".join(lines) + "\n"
