"""Compare tab: one prompt through vanilla, then EAGLE-2 (and optionally
EAGLE), one after the other, with a verdict; and the benchmark button."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import pandas as pd

from app import render
from app.chat import MODE_LABELS, WAITING_TEXT, Options, with_seed
from app.reply import Reply, follow_reply
from app.runtime import ModelChangedError, Runtime, TurnCancelled
from app.uploads import uploaded
from core.stats import SHORT_REPLY
from models import int8
from models.errors import KestrelError

QUICK_PROMPTS = Path(__file__).resolve().parent.parent / "assets" / "prompts" / "quick.jsonl"
PANE_INTERVAL = 0.5  # seconds between pane updates (the decoding never waits for them; see chat.TEXT_INTERVAL)
ALREADY_TEXT = "This tab's {what} is still running or waiting for the model: Stop it, or wait for its end, then press again."


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token; None when identical."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


# Logit margins below which a greedy choice is a near-tie that the rounding of
# a tree pass against a one-token pass can flip, per compute dtype: bf16 features
# were measured to move by up to 0.5 over 30 layers (EAGLE notes, Numerics).
NEAR_TIE = {"float64": 1e-6, "float32": 0.01, "bfloat16": 1.0, "float16": 0.5}


@dataclass(frozen=True)
class Divergence:
    index: int  # first generated token where the replies differ
    vanilla: str | None  # vanilla's token there, as text; None where vanilla's reply ended before it
    other: str | None  # the speculative mode's token there; None where its reply ended before it
    margin: float | None  # vanilla's top-2 logit margin at that position; None where not measured
    dtype: str  # the model's compute dtype
    exact: bool = False  # whether tree passes were checked bit for bit against one-token steps at load
    unmeasured: str = ""  # why the margin could not be measured, where it could not

    def explain(self, label: str) -> str:
        tie = NEAR_TIE.get(self.dtype, 0.01)
        where = f"{label} output differs from vanilla from token {self.index}: "
        if self.vanilla is None or self.other is None:  # one reply is the start of the other
            shorter, longer, wrote = ("vanilla", label, self.other) if self.vanilla is None else (label, "vanilla", self.vanilla)
            return render.escape(f"{where}{shorter}'s reply ends there, {longer}'s is longer and wrote {wrote!r} there.")
        where += f"vanilla wrote {self.vanilla!r}, {label} wrote {self.other!r}"
        if self.margin is None:
            return render.escape(f"{where}; vanilla's top-2 logit margin there could not be measured ({self.unmeasured}), "
                                 "so whether that is a rounding near-tie is not known.")  # fmt: skip
        where += f"; vanilla's top-2 logit margin there is {self.margin:.4g}."
        if self.exact:
            why = (" This engine computes every tree node bit for bit as a one-token step would (checked when the "
                   "model loaded), so the outputs should have been identical: please report it with the prompt and settings.")  # fmt: skip
        elif self.margin <= tie:
            why = (f" That is a near-tie in {self.dtype} (below {tie:g}): the tree pass and the one-token pass round "
                   "differently, which can flip such a choice; from there on the two replies are different texts, "
                   "each one the model could write. Replies come out identical to vanilla's where every tree node is "
                   "computed bit for bit as a one-token step (on CPUs with int4 or int8 weights, checked when the "
                   "model loads; the model line then says so).")  # fmt: skip
        else:
            why = (f" That is not a rounding near-tie in {self.dtype} (above {tie:g}), so the outputs should have "
                   "been identical: please report it with the prompt and settings.")  # fmt: skip
        return render.escape(where + why)


def verdict_html(
    replies: dict[str, Reply],
    greedy: bool,
    divergences: dict[str, Divergence | None] | None = None,
    seed: int | None = None,
    exact: bool = False,
) -> str:
    """tokens/s, tau and tokens per mode; speedup over vanilla; whether each
    reply is vanilla's token for token: greedy ones always, sampled ones too,
    since one seed makes the same sample in every mode (core/sampling.Noise).
    exact: whether tree passes were checked bit for bit against one-token steps at load."""
    base = replies["vanilla"].snapshot.tokens_per_s
    rows = []
    for mode, reply in replies.items():
        s = reply.snapshot
        speedup = speedup_text(s.tokens_per_s / base) if base else "-"
        rows.append(
            f'<tr><td>{MODE_LABELS[mode]}</td><td class="value" id="verdict-{mode}-tps">{s.tokens_per_s:.1f}</td>'
            f'<td class="value" id="verdict-{mode}-tau">{s.mean_accepted_length:.2f}</td>'
            f'<td class="value">{s.tokens}</td><td class="value" id="verdict-{mode}-speedup">{speedup}</td></tr>'
        )
    header = "<tr><td>mode</td><td>tokens/s</td><td>tau</td><td>tokens</td><td>speedup</td></tr>"
    lines = []
    if "eagle2" in replies and base:
        lines.append(f"EAGLE-2 speedup: <b id='verdict-speedup'>{speedup_text(replies['eagle2'].snapshot.tokens_per_s / base)}</b>")
    shortest = min(replies.values(), key=lambda reply: reply.snapshot.tokens)
    if shortest.snapshot.tokens < SHORT_REPLY:
        longer = {"length": "let the replies run longer (Max new tokens)",
                  "context": "use a shorter prompt (this one leaves little room in the context window)"}.get(
            shortest.finish_reason, "ask for a longer answer (this one ended on its own)")  # fmt: skip
        lines.append(f"<span id='verdict-short'>The shortest reply has {shortest.snapshot.tokens} tokens, too short to time well "
                     f"(reading the prompt takes much of its time); for a speed comparison {longer}.</span>")  # fmt: skip
    if not greedy:
        with_seed = "" if seed is None else f" with seed {seed}"
        lines.append(f"Sampled{with_seed} in every mode: one seed makes the same sample whatever trees were drafted.")
    for mode, reply in replies.items():
        if mode == "vanilla":
            continue
        divergence = (divergences or {}).get(mode) if greedy else None
        if divergence is None:
            index = first_difference(replies["vanilla"].token_ids, reply.token_ids)
            same = "is identical to vanilla" if index is None else f"differs from vanilla from token {index}"
            text = f"{MODE_LABELS[mode]} output {same}"
            if index is not None and not greedy:
                text += "." + sampled_difference(exact)
        else:
            text = divergence.explain(MODE_LABELS[mode])
        lines.append(f"<span id='verdict-{mode}-identity'>{render.escape(text) if divergence is None else text}</span>")
    return f'<div class="kestrel-stats" id="verdict"><table>{header}{"".join(rows)}</table><p>{"<br>".join(lines)}</p></div>'


def rounded_speedup(ratio: float) -> float:
    """To 2 decimals; a slowdown that would round up to 1.00 to 3 instead, and at most 0.999 (0.996)."""
    return min(round(ratio, 3), 0.999) if ratio < 1 <= round(ratio, 2) else round(ratio, 2)


def speedup_text(ratio: float) -> str:
    """As rounded_speedup, with 2 decimals where it has no third: "1.50x", "0.996x"."""
    shown = rounded_speedup(ratio)
    return f"{shown:.2f}x" if shown == round(shown, 2) else f"{shown:.3f}x"


def sampled_difference(exact: bool) -> str:
    """Why a sampled reply may part from vanilla's with the same seed."""
    if exact:
        return (" This engine computes every tree node bit for bit as a one-token step would (checked when the model "
                "loaded), so with one seed the samples should have been identical: please report it with the prompt and settings.")  # fmt: skip
    return (" The tree pass and the one-token pass round differently, which can flip a choice that the seed's noise made "
            "close; from there on the two replies are different samples, each one the model could write.")  # fmt: skip


def divergence(engine, prompt_ids: list[int], vanilla: Reply, other: Reply, unmeasured: str = "") -> Divergence | None:
    """Where two greedy replies part, what each wrote there, and (in the model's
    turn) how close vanilla's choice was; `unmeasured`: why that cannot be measured."""
    index = first_difference(vanilla.token_ids, other.token_ids)
    if index is None:
        return None
    decode = engine.base.tokenizer.decode
    ours, theirs = (decode(reply.token_ids[index : index + 1]) if index < len(reply.token_ids) else None for reply in (vanilla, other))
    parted = ours is not None and theirs is not None  # else one reply is the start of the other (it ended there)
    margin = engine.next_token_margin(prompt_ids + vanilla.token_ids[:index]) if parted and not unmeasured else None
    dtype = str(int8.compute_dtype(engine.model)).removeprefix("torch.")
    return Divergence(index, ours, theirs, margin, dtype, engine.exact, unmeasured)


def check_model(runtime: Runtime, engine) -> None:
    """ModelChangedError where the Models tab unloaded or replaced `engine` (in a
    turn of its own, which may come between a comparison's turns), as the API checks."""
    runtime.check_loaded(engine, "during the comparison; press Compare again")


def speculation_refused(engine, what: str) -> str | None:
    """Why `what` (a comparison with EAGLE-2) cannot run on this engine, or None."""
    if "eagle2" in engine.modes:
        return None
    if engine.head is not None and (problem := engine.speculation_problem()):
        return f"{what} needs speculative decoding, which is off for this model ({problem})."
    return f"{what} needs a draft head; load a model with one in the Models tab."


class CompareHandlers:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        # a run's cancel key -> "compare" or "benchmark", from the click to the run's end ("ended" as its last update goes out)
        self.pending: dict[str, str] = {}
        runtime.on_stop.append(self._stop_all)  # Ctrl+C on the server: a benchmark would run on past the server's wait

    def _stop_all(self) -> None:
        for key in list(self.pending):
            self.runtime.cancel(key)

    def arm(self, request: gr.Request = None) -> tuple:
        """Compare pressed, before the run waits for the model: this tab's Stop is
        released here, so that a Stop pressed while the run waits still applies,
        and the last comparison leaves the screen. Outputs: the three panes, verdict,
        refused (a hidden box that `compare` reads: its value travels with this press's run)."""
        if not self._armed(request, "compare"):
            return gr.skip(), gr.skip(), gr.skip(), ALREADY_TEXT.format(what="comparison"), True
        return "", "", "", WAITING_TEXT, False

    def arm_benchmark(self, request: gr.Request = None) -> tuple:
        """As arm, for the benchmark. Outputs: summary table, bar chart, full result, notice, refused."""
        if not self._armed(request, "benchmark"):  # its progress bar says "Waiting for the model...", then how far it got
            return gr.skip(), gr.skip(), gr.skip(), ALREADY_TEXT.format(what="benchmark"), True
        return None, None, None, "", False

    def _armed(self, request, kind: str) -> bool:
        """False where this tab's run of this kind is still on or waiting: the
        second press's run, which the page sends all the same, then does nothing,
        and arming it would have released a Stop pressed for the first. The page
        sends every press's run (ui.py), since a press in the moment between a
        run's end here and the page's word of it is armed: were its run dropped,
        as Gradio drops an event pending already, its mark would stay, and every
        later press be refused."""
        key = compare_key(request, kind)  # the tab's comparison and benchmark each have their own: arming one
        if key in self.pending:
            return False
        self.runtime.fresh_cancel(key)  # leaves a Stop pressed for the other as it was
        self.pending[key] = kind
        return True

    def forget(self, request: gr.Request = None) -> None:
        """A browser tab closed: its comparison and benchmark stop (running or
        waiting), rather than hold the model for a page no one reads."""
        for kind in ("compare", "benchmark"):
            key = compare_key(request, kind)  # a run Gradio dropped with the tab never clears its mark
            self.runtime.cancel_kept(key)  # a signal for every closed tab, where it began nothing, added up
            if self.pending.pop(key, None) is None:  # else its run, still to come or to end, reads the signal and lets it go
                self.runtime.drop_cancel(key)

    def compare(self, prompt: str, with_eagle: bool, refused: bool, request: gr.Request, *values) -> Iterator[tuple]:
        """Outputs: vanilla pane, EAGLE pane, EAGLE-2 pane, verdict. The tab's
        Stop signal is released by arm (at the click), not here. refused: arm
        refused this press (and said why); the run pressed before keeps its mark."""
        if refused:
            yield gr.skip(), gr.skip(), gr.skip(), gr.skip()
            return
        key = compare_key(request, "compare")
        panes = {mode: "" for mode in ("vanilla", "eagle", "eagle2")}
        try:
            verdict = yield from self._compare(prompt, with_eagle, request, values, panes)
            self.pending[key] = "ended"  # a Stop pressed as the verdict goes out leaves it (stop)
            yield *panes.values(), verdict
        finally:
            self._ended(key)

    def _compare(self, prompt: str, with_eagle: bool, request, values, panes: dict[str, str]) -> Iterator[tuple]:
        """Yields the updates while the modes run, filling `panes`; returns the verdict."""
        prompt = (prompt or "").strip()
        try:
            if not prompt:
                raise ValueError("Type a prompt to compare.")
            options = with_seed(Options.from_values(values))  # one seed for every mode
            engine = self.runtime.require()
            if refused := speculation_refused(engine, "Comparing"):
                raise ValueError(refused)
        except (KestrelError, ValueError) as error:
            return render.escape(render.sentence(str(error)))
        modes = ("vanilla", "eagle", "eagle2") if with_eagle else ("vanilla", "eagle2")
        replies: dict[str, Reply] = {}
        cancel = self.runtime.cancel_event(compare_key(request, "compare"))
        messages = [{"role": "user", "content": prompt}]
        for mode in modes:
            reply = None
            running = f"Running {MODE_LABELS[mode]}..."
            yield *panes.values(), self._before_turn(running)
            try:
                updates = follow_reply(
                    self.runtime.queue, engine, messages, mode, options.sampling, options.tree, cancel, PANE_INTERVAL,
                    check=lambda: check_model(self.runtime, engine),  # in each mode's turn: the Models tab may have had one between
                )  # fmt: skip
                for reply in updates:
                    panes[mode] = render.pane_html(reply.segments)
                    yield *panes.values(), f"{running} {reply.reading_text}".strip()
            except (KestrelError, ValueError) as error:  # ModelChangedError included
                return render.escape(render.sentence(str(error)))
            if reply is None or reply.finish_reason == "cancelled":  # stopped, perhaps before its turn came
                return "Stopped."
            replies[mode] = reply
        greedy = options.sampling.greedy
        divergences = {}
        if greedy and (differing := [m for m in replies if m != "vanilla" and replies[m].token_ids != replies["vanilla"].token_ids]):
            yield *panes.values(), self._before_turn("Measuring where the replies part...")
            try:
                divergences = self._divergences(engine, messages, replies, differing, cancel)
            except ModelChangedError as error:
                return render.escape(render.sentence(str(error)))
        return verdict_html(replies, greedy, divergences, options.sampling.seed, engine.exact)

    def _before_turn(self, running: str) -> str:
        """What the verdict says as a turn is asked for: the wait where another
        request holds the model or waits for it (as the Chat tab says), else `running`."""
        return WAITING_TEXT if self.runtime.queue.busy else running

    def _divergences(
        self, engine, messages: list[dict], replies: dict[str, Reply], differing: list[str], cancel: threading.Event | None = None
    ) -> dict[str, Divergence | None]:
        """Where each of the `differing` greedy replies parts from vanilla's, and
        vanilla's margin there (one forward each, in the model's queue).
        ModelChangedError where the model was unloaded or replaced meanwhile."""
        vanilla = replies["vanilla"]
        try:
            with self.runtime.queue.turn(cancel):
                check_model(self.runtime, engine)
                prompt_ids = engine.encode(messages)
                return {mode: divergence(engine, prompt_ids, vanilla, replies[mode]) for mode in differing}
        except TurnCancelled:  # a Stop, or the tab closed, while this waited for its turn
            unmeasured = "the comparison was stopped before it could be"
        except ModelChangedError:
            raise
        except KestrelError as error:  # the queue is full
            unmeasured = str(error)
        return {mode: divergence(engine, [], vanilla, replies[mode], unmeasured) for mode in differing}

    def stop(self, request: gr.Request = None) -> tuple:
        """Compare's Stop: this tab's comparison or benchmark, never its chat reply nor another tab's run.
        Outputs: verdict, benchmark notice ("Stopping..." at once where a run is on or waits for the model,
        not where a comparison's verdict is final)."""
        keys = {kind: compare_key(request, kind) for kind in ("compare", "benchmark")}
        for key in keys.values():
            self.runtime.cancel(key)
        return tuple("Stopping..." if self.pending.get(key) == kind else gr.skip() for kind, key in keys.items())

    def benchmark(self, upload, limit: int, refused: bool, request: gr.Request, *values, progress=gr.Progress()) -> tuple:
        """Outputs: summary table, tokens/s bar chart, full result (JSON), notice.
        The tab's Stop signal is released by arm_benchmark (at the click).
        refused: as compare's."""
        if refused:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip()
        try:
            return self._benchmark(upload, limit, request, values, progress)
        finally:
            self._ended(compare_key(request, "benchmark"))

    def _ended(self, key: str) -> None:
        """A run has ended: its mark goes, and its signal too where its tab closed meanwhile (forget took the mark)."""
        if self.pending.pop(key, None) is None:
            self.runtime.drop_cancel(key)

    def _benchmark(self, upload, limit: int, request, values, progress) -> tuple:
        cancel = self.runtime.cancel_event(compare_key(request, "benchmark"))
        try:
            from core.bench import BenchCancelled, run_bench
            from core.prompt import load_prompts

            options = with_seed(Options.from_values(values))  # one seed for every prompt and mode
            engine = self.runtime.require()
            if refused := speculation_refused(engine, "The benchmark compares vanilla with EAGLE-2 and"):
                raise ValueError(refused)
            if upload and not uploaded(upload):
                raise ValueError(f"{Path(upload).name} was not uploaded through the page")
            path = upload if upload else QUICK_PROMPTS
            try:
                prompts = load_prompts(path, limit=int(limit) if limit else None)
            except ValueError as error:  # named as the user knows the file, not by Gradio's copy of it
                raise ValueError(str(error).replace(str(path), Path(path).name)) from None
            if self.runtime.queue.busy:  # over the table, where its progress shows once it runs
                progress(None, desc="Waiting for the model...")
            with self.runtime.queue.turn(cancel):
                result = run_bench(
                    engine, prompts, ("vanilla", "eagle2"), options.sampling, options.tree, warmup=1,
                    progress=lambda done, total, description: progress((done, total), desc=description), cancel=cancel,
                )  # fmt: skip
        except BenchCancelled as stopped:
            if stopped.result is None:
                return None, None, None, "Stopped before the first prompt finished."
            result = stopped.result
            finished = result["settings"]["prompts"]
            note = f"Stopped: the figures are those of the first {finished} of {len(prompts)} prompts."
            return summary_frame(result), speed_frame(result), result, note + learned_note(result)
        except TurnCancelled:
            return None, None, None, "Stopped before the benchmark started."
        except (KestrelError, ValueError, ImportError) as error:
            return None, None, None, render.escape(render.sentence(str(error)))
        identical = result["summary"].get("identical_fraction")
        note = "" if options.sampling.greedy else f"Sampled with seed {options.sampling.seed}, the same for every prompt and mode. "
        if identical is not None:
            note += f"EAGLE-2 output identical to vanilla on {100 * identical:.0f}% of the prompts."
        if int(limit or 0) > len(prompts):
            held = "1 prompt; it was" if len(prompts) == 1 else f"{len(prompts)} prompts; all were"
            where = "The file holds" if upload else "The built-in prompts are"
            note = f"{note} {where} {held} run."
        return summary_frame(result), speed_frame(result), result, note + learned_note(result)


def learned_note(result: dict) -> str:
    """" EAGLE-2's tree planner had learnt from ...", where this server's engine
    sized the run's first trees from its earlier replies (a fresh one would not); else ""."""
    from core.bench import learned_words

    learned = result["summary"]["planner_learned"].get("before_warmup", {}).get("eagle2")
    words = learned_words(learned) if learned else None
    return f" EAGLE-2's tree planner had learnt from {words} of earlier replies before this run." if words else ""


def compare_key(request: gr.Request | None, kind: str = "compare") -> str:
    """The cancel signal of a tab's comparison or benchmark: one each per browser
    tab (Gradio's session), apart from the chat's (chat.py uses the chat id) and other tabs'."""
    session = getattr(request, "session_hash", None)
    return f"{kind}:{session or 'local'}"


SUMMARY_COLUMNS = ("mode", "tokens", "seconds", "tokens/s", "tau", "speedup")  # the benchmark's table, also before a run


def summary_frame(result: dict) -> pd.DataFrame:
    base = result["modes"].get("vanilla", {}).get("tokens_per_s")
    rows = []
    for mode, totals in result["modes"].items():
        tau = totals.get("mean_accepted_length")
        rows.append((
            MODE_LABELS.get(mode, mode), totals["tokens"], round(totals["seconds"], 2), round(totals["tokens_per_s"], 1),
            None if tau is None else round(tau, 2), rounded_speedup(totals["tokens_per_s"] / base) if base else None,
        ))  # fmt: skip
    return pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))


def speed_frame(result: dict) -> pd.DataFrame:
    modes = result["modes"]
    return pd.DataFrame({
        "mode": [MODE_LABELS.get(mode, mode) for mode in modes],
        "tokens/s": [totals["tokens_per_s"] for totals in modes.values()],
    })  # fmt: skip
