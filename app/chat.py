"""Chat tab handlers: plain functions of plain values (tests call them
directly); app/ui.py wires them to components."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import math
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import gradio as gr

from app import render
from app.decoding import ServerStopping
from app.reply import Reply, Throttle, follow_reply
from app.runtime import Runtime
from app.store import (
    CHATS_FOLDER, EARLIER, NAME_LIMIT, SETTINGS_FILE, Store, as_chat, chat_file_problem, chat_title, clean_name, earlier_replies, new_chat,
    oldest_messages, to_json, to_markdown, well_formed,
)  # fmt: skip
from app.store import made_with as made_with_line
from app.uploads import uploaded
from core.config import TOP_K_LIMIT, SamplingParams, TreeParams
from core.engine import ContextOverflowError, Engine, check_prompt
from core.prompt import UNFINISHED
from models.errors import ChatTemplateError, KestrelError

# The settings controls, in the order their values reach the handlers.
SETTINGS = ("mode", "temperature", "top_p", "top_k", "max_new_tokens", "seed", "total_tokens", "depth", "tree_top_k", "colour")
MODE_LABELS = {"vanilla": "vanilla", "eagle": "EAGLE", "eagle2": "EAGLE-2"}
TEXT_INTERVAL = 0.5  # seconds between chat text updates: each one costs the browser a re-render
# of the reply and of Gradio's component state, taken from the decoding on small machines
PANEL_INTERVAL = 0.5  # seconds between updates of the statistics
PLOT_INTERVAL = 2.0  # seconds between plot updates while streaming (plots cost the browser most to redraw)
FINISHING_WAIT_S = 5.0  # the longest a click on a chat whose reply is ending waits for its last update to reach the page
SAVE_INTERVAL = 1.0  # seconds between saves of a new reply as it grows: a crash loses at most this much of it
SKIP_PANEL = (gr.skip(),) * 4  # stats and the three plots left as they are

log = logging.getLogger("kestrel")


# The settings' ranges (-1 = a random seed; up to 32768 new tokens, which reasoning models such as
# Qwen3 are recommended); a value typed into a number box outside them
# is refused by name (a slider's box brings its value back into range itself when left).
RANGES = {
    "temperature": (0, 2), "top_p": (0.05, 1), "top_k": (0, TOP_K_LIMIT), "max_new_tokens": (1, 32768), "seed": (-1, 2**32 - 1),
    "total_tokens": (0, 128), "depth": (1, 12), "tree_top_k": (1, 16),
}  # fmt: skip
# the settings the page shows as sliders: a value typed past a slider's range settles, in the
# browser, on the nearest end without another input event, and is saved as that (see _chosen)
SLIDERS = ("temperature", "top_p", "max_new_tokens", "total_tokens", "depth", "tree_top_k")


def default_settings() -> dict:
    sampling, tree = SamplingParams(), TreeParams()
    return {
        "mode": "eagle2", "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
        "max_new_tokens": sampling.max_new_tokens, "seed": -1, "total_tokens": tree.total_tokens,
        "depth": tree.depth, "tree_top_k": tree.top_k, "colour": True, "system": "",
    }  # fmt: skip


def restored_settings(saved: dict) -> dict:
    """The defaults, with each saved value of its setting's kind (a number for
    a number, a bool for a switch, text for text): a settings file edited by
    hand or from another version cannot put text into a slider."""
    settings = default_settings()
    for name, default in settings.items():
        value = saved.get(name)
        if isinstance(default, bool):
            fits = isinstance(value, bool)
        elif isinstance(default, (int, float)):
            fits = render.is_number(value)
            low, high = RANGES.get(name, (-math.inf, math.inf))
            fits = fits and low <= value <= high and (isinstance(default, float) or float(value).is_integer())
        else:
            fits = isinstance(value, type(default))
        if fits:
            settings[name] = value
    return settings


def invalid_settings(saved: dict, restored: dict) -> list[str]:
    """The saved settings that restored_settings(saved) replaced by their defaults (named in the page's notice)."""
    return [name for name in default_settings() if name in saved and saved[name] != restored[name]]


@dataclass(frozen=True)
class Options:
    mode: str
    sampling: SamplingParams
    tree: TreeParams
    colour: bool

    @classmethod
    def from_values(cls, values: Sequence) -> Options:
        """From the settings controls' values (in SETTINGS order); raises
        ValueError naming the bad setting."""
        v = dict(zip(SETTINGS, values))
        seed = None if v["seed"] in (None, "") else _number(v, "seed", int)
        sampling = SamplingParams(
            _number(v, "temperature", float), _number(v, "top_p", float), _number(v, "top_k", int),
            _number(v, "max_new_tokens", int), None if seed is None or seed < 0 else seed,
        )  # fmt: skip
        total_tokens = _number(v, "total_tokens", int)
        if total_tokens == 1:  # the slider reaches it; a tree of the root alone is vanilla decoding
            raise ValueError("Tree: tokens verified per step must be 0 (sized automatically) or at least 2")
        tree = TreeParams(total_tokens, _number(v, "depth", int), _number(v, "tree_top_k", int))
        return cls(v["mode"], sampling, tree, bool(v["colour"]))


TREE_SETTINGS = ("total_tokens", "depth", "tree_top_k")
LABELS = {
    "temperature": "Temperature", "top_p": "Top-p", "top_k": "Top-k", "max_new_tokens": "Max new tokens", "seed": "Seed",
    "total_tokens": "Tree: tokens verified per step", "depth": "Tree: depth", "tree_top_k": "Tree: top-k per node",
}  # fmt: skip


def _number(values: dict, name: str, kind: type) -> int | float:
    """A settings control's number; ValueError naming the control when it is empty or not a number."""
    value = values[name]
    try:
        if value is None or isinstance(value, bool) or (isinstance(value, str) and not value.strip()):
            raise ValueError
        number = kind(float(value)) if kind is int else kind(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{LABELS[name]}: enter a number (it is {'empty' if value in (None, '') else repr(value)})") from None
    if kind is int and number != float(value):
        raise ValueError(f"{LABELS[name]}: enter a whole number (it is {value!r})")
    low, high = RANGES.get(name, (-math.inf, math.inf))
    if not low <= number <= high:
        raise ValueError(f"{LABELS[name]}: enter a number from {low} to {high} (it is {value!r})")
    return number


def mode_choices(modes) -> list[tuple[str, str]]:
    """The mode selector's (label, value) pairs for `modes`."""
    return [(MODE_LABELS[m], m) for m in modes]


def mode_for(engine: Engine, wanted: str) -> tuple[str, str]:
    """The mode to run and a note when the wanted one is unavailable."""
    if wanted in engine.modes:
        return wanted, ""
    if engine.head is not None and (problem := engine.speculation_problem()):
        return "vanilla", f"{MODE_LABELS.get(wanted, wanted)} is off for this model ({problem}): decoding vanilla."
    return "vanilla", f"{MODE_LABELS.get(wanted, wanted)} needs a draft head, and none is loaded: decoding vanilla."


def engine_messages(chat: dict) -> list[dict]:
    """The chat as the engine reads it; a reply that ended before its end (Stop,
    the token limit) marked so (core/prompt.without_unfinished_thinking)."""
    system = [{"role": "system", "content": chat["system"]}] if chat.get("system") else []
    return system + [{"role": m["role"], "content": m["content"], **({UNFINISHED: True} if unfinished(m) else {})} for m in chat["messages"]]


def unfinished(message: dict) -> bool:
    """A reply stopped, or cut by the token limit, the context window or the server's end."""
    stats = message.get("stats")
    return message["role"] == "assistant" and isinstance(stats, dict) and stats.get("finish_reason") in UNFINISHED_REASONS


UNFINISHED_REASONS = ("cancelled", "length", "context", "interrupted")


def fit_context(engine: Engine, messages: list[dict], room: int) -> tuple[list[dict], int]:
    """Drop the oldest turns until the prompt leaves `room` tokens of the
    context window; returns the messages and how many were dropped. A reply
    whose message was dropped stays where the chat template takes a
    conversation that starts with a reply: after a long pasted text and a reply
    cut at the window, "continue" then still sees the reply it continues.

    Past the window, turns go in steps of an eighth of it (CONTEXT_STEPS), not
    just enough for this turn: the next turns then drop the same ones, until the
    chat has grown by another step. So a long chat's prompt keeps its start, and
    its next turn continues the caches kept from the previous reply instead of
    reading the whole window again at every turn. Where the step would take a
    long message too (a pasted text), it stays while it fits."""
    system = [m for m in messages if m["role"] == "system"]
    turns = [m for m in messages if m["role"] != "system"]
    window = engine.context_limit - room
    full = prompt_length(engine, system + turns)
    sizes = [1] * len(turns)  # messages in each turn
    if full is None and len(joined := joined_turns(turns)) < len(turns):  # a template that wants roles to alternate (Llama-2's,
        turns, sizes = [turn for turn, _ in joined], [size for _, size in joined]  # Mistral's), after a message left
        full = prompt_length(engine, system + turns)  # without a reply: the two as one turn

    def messages_in(dropped: int) -> int:
        return sum(sizes[:dropped])

    @functools.cache  # each count encoded once
    def length(dropped: int) -> int | None:
        """The prompt's length with the oldest `dropped` turns dropped."""
        return full if dropped == 0 else prompt_length(engine, system + turns[dropped:])

    if not turns or (full is not None and full <= window):
        return system + turns, 0
    last = len(turns) - 1  # the newest message always stays
    needed = fewest_dropped(length, last, window)
    if needed is None and room > MIN_REPLY_ROOM:  # the newest message leaves the reply less: the turns that fit stay
        return fit_context(engine, messages, MIN_REPLY_ROOM)
    if needed is None:  # too long even alone: the engine names it
        return system + turns[last:], messages_in(last)
    step = max(1, engine.context_limit // CONTEXT_STEPS)
    # what dropped turns must free: the excess rounded up to a whole step, which stays the same while the chat grows within it
    stepped = full - -(-(full - window) // step) * step if full is not None else window
    dropped = fewest_dropped(length, last, stepped) or needed
    # the step took a long message (it frees a step more than the step's target): keep it while it fits; judged
    # against the target, not this turn's excess, so that the choice too stays the same while the chat grows within it
    if dropped > needed and length(dropped) < stepped - step:
        dropped = next(d for d in range(dropped - 1, needed - 1, -1) if length(d) is not None)
    return system + turns[dropped:], messages_in(dropped)


def joined_turns(turns: list[dict]) -> list[tuple[dict, int]]:
    """Messages in a row from the same side as one (their texts a blank line
    apart), each with how many messages it holds."""
    joined: list[tuple[dict, int]] = []
    for turn in turns:
        if joined and joined[-1][0]["role"] == turn["role"]:
            last, size = joined[-1]
            joined[-1] = {**last, "content": f"{last['content']}\n\n{turn['content']}"}, size + 1
        else:
            joined.append((turn, 1))
    return joined


def fewest_dropped(length: Callable[[int], int | None], last: int, budget: int) -> int | None:
    """The fewest oldest turns (1..last) to drop for a prompt within `budget`
    tokens that the chat template takes, by bisection: prompts shrink as turns
    are dropped, and a count the template refuses (length None) is judged by the
    next one it takes. None where no count does."""

    def taken(dropped: int) -> int | None:
        return next((d for d in range(dropped, last + 1) if length(d) is not None), None)

    low, high, found = 1, last, None
    while low <= high:
        middle = (low + high) // 2
        first = taken(middle)
        if first is not None and length(first) <= budget:
            found, high = first, middle - 1
        else:
            low = middle + 1
    return found


CONTEXT_STEPS = 8  # past the context window, the oldest turns are dropped in steps of 1/8 of it
REPLY_SHARE = 4  # the oldest turns are dropped to leave the reply its Max new tokens, up to 1/4 of the window
MIN_REPLY_ROOM = 64  # ... or this much, where the newest message alone leaves less


def reply_room(engine: Engine, max_new_tokens: int) -> int:
    """The tokens of the context window kept free for the reply when older
    turns are dropped: its Max new tokens, so that a reply is not cut at the
    window right after turns were dropped "to fit", but never more than a
    share of the window (Max new tokens may exceed the window itself)."""
    return max(1, min(max_new_tokens, engine.context_limit // REPLY_SHARE))


def prompt_length(engine: Engine, messages: list[dict]) -> int | None:
    """The prompt's length in tokens; None for a conversation the chat template
    refuses (Llama-2's and Mistral's want a user turn first)."""
    try:
        return len(engine.encode(messages))
    except ChatTemplateError:
        return None


def overflow_text(engine: Engine, messages: list[dict], error: ContextOverflowError) -> str:
    """What to do about a prompt that does not fit even with the oldest turns
    dropped: shorten the system prompt where shortening the message alone
    cannot make room, else the message (or the system prompt)."""
    system = [m for m in messages if m["role"] == "system"]
    tokens = prompt_length(engine, system) if system else None  # None also where the template wants a user turn with it
    total = len(engine.encode(messages))
    over = total - engine.context_limit + 1  # earlier turns are dropped already: a new chat would not help
    amount = f"{over:,} token{'' if over == 1 else 's'}"
    if tokens is not None and total - tokens <= over:  # more than the message's own tokens: the system prompt leaves no room
        return f"{error}. The system prompt alone is {tokens:,} tokens: shorten it (a new chat keeps it)."
    if tokens:
        return (f"{error}. Shorten the message or the system prompt ({tokens:,} tokens; a new chat keeps it) by at least {amount} "
                "in all, and more to leave room for the reply.")  # fmt: skip
    return f"{error}. Shorten the message by at least {amount}, and more to leave room for the reply."


def reasoning_mark(reply: Reply) -> dict:
    """A reasoning model's reply is stored marked so: the page folds its reasoning (render.message_html)."""
    return {"reasoning": True} if reply.reasoning else {}


def run_settings(engine: Engine, mode: str, options: Options) -> dict:
    """What a reply was made with, stored beside it: with its seed, the same
    settings give the same reply again."""
    sampling, tree = options.sampling, options.tree
    settings = {
        "model": engine.base.name, "dtype": str(engine.base.dtype).removeprefix("torch."),
        "quantization": engine.base.quantization, "temperature": sampling.temperature, "top_p": sampling.top_p,
        "top_k": sampling.top_k, "max_new_tokens": sampling.max_new_tokens, "seed": sampling.seed,
    }  # fmt: skip
    if mode != "vanilla" and engine.head_name:  # where the head came from: a path, a repo id or "bundled"
        settings["head"] = engine.head_name
    if mode == "eagle2":  # EAGLE drafts its fixed tree: the Tree settings do not apply to it
        settings["tree"] = {"total_tokens": tree.total_tokens, "depth": tree.depth, "top_k": tree.top_k}
    return well_formed(settings)  # a folder's name that is not UTF-8 reads with lone surrogates: as the file keeps it


def with_seed(options: Options) -> Options:
    """Sampling without a seed gets one drawn here (within the Seed box's
    range), so that the reply's stored settings can make it again."""
    return replace(options, sampling=options.sampling.seeded())


def reply_summary(reply: Reply, mode: str, settings: dict | None = None) -> dict:
    snapshot = reply.snapshot
    return {
        **({"settings": settings} if settings else {}),
        "mode": mode,
        "tokens": snapshot.tokens,
        "seconds": round(snapshot.seconds, 3),
        "tokens_per_s": round(snapshot.tokens_per_s, 2),
        **({} if snapshot.decoding_tokens_per_s is None else {"decoding_tokens_per_s": round(snapshot.decoding_tokens_per_s, 2)}),
        "tau": round(snapshot.mean_accepted_length, 3),
        "forwards": snapshot.forwards,
        **({} if snapshot.time_to_first_token is None else {"time_to_first_token": round(snapshot.time_to_first_token, 3)}),
        "reused_tokens": snapshot.reused_tokens,
        "mean_tree_size": round(snapshot.mean_tree_size, 2),
        "mean_tree_depth": round(snapshot.mean_tree_depth, 2),
        "finish_reason": reply.finish_reason,
        # the side panel's charts, drawn again when the chat is opened or the page reloaded
        "acceptance_by_depth": [round(rate, 3) for rate in snapshot.acceptance_by_depth],
        "rate_points": [[seconds, round(rate, 1)] for seconds, rate in thinned(reply.rate_points, RATE_POINTS_KEPT)],
    }


RATE_POINTS_KEPT = 240  # a reply's tokens/s curve is saved with at most this many points


def thinned(points: list, limit: int) -> list:
    """At most `limit` of `points`, evenly spread, the last one kept."""
    if len(points) <= limit:
        return list(points)
    step = len(points) / limit
    return [points[min(len(points) - 1, round((i + 1) * step) - 1)] for i in range(limit)]


def saved_plots(stats: dict | None) -> tuple:
    """The depth and rate charts of a reply's stored summary (empty where it has
    none: saved before they were kept, a vanilla reply, a hand-edited file)."""
    stats = stats if isinstance(stats, dict) else {}
    rates, points = stats.get("acceptance_by_depth"), stats.get("rate_points")
    if not (isinstance(rates, list) and all(render.is_number(r) for r in rates)):
        rates = []
    if not (isinstance(points, list) and all(isinstance(p, list) and len(p) == 2 and all(render.is_number(v) for v in p) for p in points)):
        points = []
    return render.depth_frame(None, rates), render.rate_frame([tuple(p) for p in points])


def saved_sampling(stats: dict | None) -> SamplingParams:
    """The sampling settings a stored reply was made with (greedy where they
    are not stored, or not valid: a hand-edited file)."""
    settings = (stats or {}).get("settings") if isinstance(stats, dict) else None
    if not isinstance(settings, dict):
        return SamplingParams()
    chosen = {name: settings[name] for name in ("temperature", "top_p", "top_k") if render.is_number(settings.get(name))}
    try:
        return SamplingParams(**chosen)
    except (TypeError, ValueError):
        return SamplingParams()


def session_tau(chat: dict, reply: Reply | None = None) -> float | None:
    """Mean accepted length over the chat's drafted replies (a vanilla reply's
    is 1 by definition, and is not counted), with `reply` still being written."""
    tokens, forwards = chat["session"]["tokens"], chat["session"]["forwards"]
    if reply is not None and reply.snapshot is not None:
        tokens, forwards = tokens + reply.snapshot.tokens, forwards + reply.snapshot.forwards
    return tokens / forwards if forwards else None


# In a tab's chat state after Edit: the messages taken back, which the saved chat keeps until the
# edited message is sent (a failed send saves them back): a reload before then loses nothing
TAKEN_BACK = "taken_back"


# A saved assistant message's EARLIER replies are in the order they were written; in one that
# Earlier reply shows, NEWER counts those of them written after it (the last ones)
NEWER = "newer"
SYSTEM_FOR = "system_typed_for"  # in the settings: the id of the chat shown when the system prompt was typed
EARLIER_LIMIT = 20  # replies kept per message


def newer_count(message: dict, earlier: list[dict]) -> int:
    """How many of the message's `earlier` replies were written after it (0 where a hand-edited file says otherwise)."""
    newer = message.get(NEWER)
    return newer if isinstance(newer, int) and not isinstance(newer, bool) and 0 <= newer <= len(earlier) else 0


def with_earlier(replaced: dict) -> list[dict]:
    """The earlier replies of a regenerated message: those of the reply it
    replaces and that reply, in the order they were written, the oldest dropped past EARLIER_LIMIT."""
    earlier = earlier_replies(replaced)
    at = len(earlier) - newer_count(replaced, earlier)
    return [*earlier[:at], kept_reply(replaced), *earlier[at:]][-EARLIER_LIMIT:]


def kept_reply(message: dict) -> dict:
    """A reply as kept among another's earlier ones: without its own."""
    return {name: value for name, value in message.items() if name not in (EARLIER, NEWER)}


def without(mapping: dict, key: str) -> dict:
    """A shallow copy of `mapping` without `key`."""
    return {name: value for name, value in mapping.items() if name != key}


def stored(chat: dict) -> dict:
    """The chat as it is saved: without the page's own TAKEN_BACK."""
    return without(chat, TAKEN_BACK)


def taken_mark(chat: dict | None) -> str:
    """What the page keeps of the messages Edit took back from the chat shown:
    their count and digest ("" where none). The chat state goes with a server
    restart; the page's mark still names them in the saved chat (taken_back_again)."""
    taken = (chat or {}).get(TAKEN_BACK)
    return f"{len(taken)} {messages_digest(taken)}" if taken else ""


def messages_digest(messages: list[dict]) -> str:
    """A digest of messages as they are stored."""
    text = json.dumps(messages, sort_keys=True, ensure_ascii=False, allow_nan=True)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def taken_back_again(chat: dict, mark: str) -> dict:
    """The saved chat as the page showed it after Edit, where `mark`
    (taken_mark) names its last messages: those are taken back again, so that
    the edited message is sent in their place. As it is where they are not its
    last messages (changed since, from another tab)."""
    written, _, digest = (mark or "").partition(" ")
    count = int(written) if written.isascii() and written.isdecimal() else 0  # "²": a digit int() refuses
    if not 0 < count <= len(chat["messages"]):
        return chat
    kept, taken = chat["messages"][:-count], chat["messages"][-count:]
    if taken[0].get("role") != "user" or messages_digest(taken) != digest:
        return chat
    return {**chat, "messages": kept, TAKEN_BACK: taken}


EMPTY_REPLY_TEXT = "The model ended its reply without writing anything (at a temperature above 0, Regenerate may get one)."
TYPED_TEXT = "The message box holds text that Edit would replace: send it, or empty the box, first."
EDIT_PENDING_TEXT = ("An edit is pending: send the edited message first, or open the chat again from Saved chats "
                     "to leave it as it was.")  # fmt: skip


def invalid_text(names: list[str]) -> str:
    if not names:
        return ""
    shown = ", ".join(LABELS.get(name, name.replace("_", " ")) for name in names)
    return f"Some saved settings were not valid, so their defaults are in use (a change saves the new value): {shown}."


def cut_short_text(chat: dict, busy: bool = False) -> str:
    """A notice for a chat whose last reply a crash or a killed server cut short,
    or whose last message has no reply (the page was closed or reloaded, or
    Kestrel stopped, before the reply's first token; `busy`: it is on its way)."""
    if busy:  # its reply is on its way (written now, from this tab or another): it is not cut short
        return BEING_WRITTEN_TEXT
    stats = last_reply_stats(chat)
    last = chat["messages"][-1]["role"] if chat["messages"] else None
    if last == "assistant" and stats and stats.get("finish_reason") == "interrupted":
        return ("The last reply was cut short: Kestrel stopped while writing it. Regenerate writes it again "
                "(the cut one is kept: Earlier reply shows it).")  # fmt: skip
    if last == "user":
        return "The last message has no reply: it was interrupted before its first token. Regenerate writes one."
    return ""


def last_reply_stats(chat: dict) -> dict | None:
    """The stored summary of the chat's last reply, for the side panel of a chat opened or reloaded."""
    replies = [m for m in chat["messages"] if m.get("role") == "assistant"]
    stats = replies[-1].get("stats") if replies else None
    return stats if isinstance(stats, dict) else None


def display(chat: dict, colour: bool, pending: dict | None = None) -> list[dict]:
    """The chatbot's messages: escaped (optionally coloured) model text."""
    messages = chat["messages"] + ([pending] if pending else [])
    return [shown(m, colour) for m in messages]


def shown(message: dict, colour: bool) -> dict:
    return {"role": message["role"], "content": render.message_html(message, colour)}


def fault_text(error: Exception) -> str:
    """An unexpected error named as the log names it: "RuntimeError: what it says"."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def notice_html(text: str) -> str:
    return f'<div class="kestrel-notice">{render.escape(text)}</div>' if text else ""


BUSY_TEXT = "A reply is being written (or waits for the model): wait for it or press Stop first."
BEING_WRITTEN_TEXT = ("A reply to this chat is still being written: it shows here as far as it was saved; "
                      "open the chat again from Saved chats once it ends to see all of it.")  # fmt: skip
GONE_TEXT = "That chat is no longer saved: it was deleted in another tab or window. The list shows the saved chats again."
STOPPING_TEXT = "Stopping..."
WAITING_TEXT = "Waiting for the model..."
DOUBLE_PRESS_S = 1.0  # a second Send of the same text from the same tab within this is the same press
SENT_MARK = "\x00sent:"  # accept's message to send, in the hidden box: this mark, a token, ":" and the text
EMPTY_CHAT_TEXT = "This chat has no messages yet: there is nothing to {}."
IMPORT_LIMIT = 16 * 2**20  # bytes of a chat's JSON export that Import reads, at most (a long chat's is a few MB)
BUSY_TOAST_S = 4  # seconds the refusal also shows as a toast: the reply's next frames may redraw the notice line
FORKED_TEXT = "This chat was changed in another tab: your message continues it as a new chat."
STALE_TEXT = "This chat was changed in another tab: open it again from Saved chats to see its messages first."
DAMAGED_TEXT = "The chat's file {} can no longer be read ({}), so it is left as it is."  # as damage_text says at page load
EMPTY_PLOTS = (render.depth_frame(None), render.rate_frame([]))  # a chat without its last reply's figures


def busy_notice() -> str:
    """The refusal of an action during a reply: in the notice line and, for a
    few seconds, as a toast that the reply being written cannot redraw."""
    gr.Warning(BUSY_TEXT, duration=BUSY_TOAST_S)
    return notice_html(BUSY_TEXT)


def damage_text(
    folder: Path, settings: str | None, chats: list[str], reasons: dict[str, str] | None = None, unwritable: str | None = None
) -> str:
    """What a page load found unreadable in the data folder: the settings file
    (by the name it is kept under) and the chat files, which stay as they are
    (each named with what is wrong with it, where `reasons` says); and why
    nothing can be saved there (`unwritable`), where that shows already."""
    notes = []
    if unwritable:
        notes.append(f"Chats and settings cannot be saved: {unwritable}. Replies still come, but a closed page loses them.")
    if settings == SETTINGS_FILE:
        notes.append(f"The saved settings ({folder / settings}) cannot be read: the defaults are in use.")
    elif settings:
        notes.append(f"The saved settings could not be read: the defaults are in use, and the file is kept as {folder / settings}.")
    if chats:
        named = [f"{name} ({reasons[name]})" if reasons and name in reasons else name for name in chats[:5]]
        names = ", ".join(named) + (f" and {len(chats) - 5} more" if len(chats) > 5 else "")
        if len(chats) == 1:
            notes.append(f"A saved chat cannot be read and is not listed; the file is left as it is: {folder / CHATS_FOLDER / names}.")
        else:
            notes.append(f"{len(chats)} saved chats cannot be read and are not listed; the files are left as they are in {folder / CHATS_FOLDER}: {names}.")
    return " ".join(notes)


def chat_choices(store: Store, chats: list[dict] | None = None) -> list[tuple[str, str]]:
    """The saved-chats list (`chats`: store.list_chats() where already read)."""
    return [(f"{chat['title']} ({_when(chat['updated'])})", chat["id"]) for chat in (chats if chats is not None else store.list_chats())]


def _when(seconds: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(seconds))
    except (OSError, OverflowError, ValueError):  # a time this platform cannot show
        return "no date"


class LiveReply:
    """A reply being written, for the server's stop to save as far as it got.
    The reply's last save happens once, whoever comes first: the reply's own
    end (or a closed page) on the page's thread, or the server's stop on
    the main thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._claimed = False
        self.reply: Reply | None = None  # the latest state the page was shown

    def claim(self) -> bool:
        """True for the first caller only: that one saves the reply's end."""
        with self._lock:
            claimed, self._claimed = self._claimed, True
            return not claimed


class ChatHandlers:
    def __init__(self, runtime: Runtime, store: Store):
        self.runtime = runtime
        self.store = store
        # the replies being written: chat id -> what saves it as far as it got, when the server stops
        self.live: dict[str, Callable[[], None]] = {}
        runtime.on_stop.append(self.save_live)
        self.exports: tempfile.TemporaryDirectory | None = None  # one folder for every export, removed at exit
        # the chats whose reply is being written: id -> that reply's colouring, as the page's box has it now
        self.replying: dict[str, bool] = {}
        self.reply_owner: dict[str, str | None] = {}  # of those, the browser tab (session) whose Send or Regenerate began it
        # of those, the ones whose decoding has ended, until their last update has gone to the page: set then
        self.finishing: dict[str, threading.Event] = {}
        # ids of copies made by accept -> why, until their first send ends: its reply's notice says why again, and a
        # send that fails removes the copy (it holds nothing new)
        self.forked: dict[str, str] = {}
        self.unsaved: set[str] = set()  # ids of chats whose latest save failed: their disk copy is older, not another tab's
        # ids of chats whose accepted message (or regeneration) waits for the model, not yet started -> the
        # browser tab's session: a tab closed meanwhile never starts it, and its unload forgets the mark
        self.sent: dict[str, str | None] = {}
        self.accepting = threading.Lock()  # one accept at a time: a second press of Send checks what the first marked
        self.pressed: dict[str | None, tuple[str | None, str, float]] = {}  # per tab: the last Send's chat id, text and time
        self.unsent: dict[str, str | None] = {}  # tokens of messages accepted whose send has not begun -> the tab's session

    @staticmethod
    def shown_marks(chat: dict | None) -> tuple[str, str]:
        """What the page keeps of the chat it shows (app/ui.py's shown_id and
        taken): its id, and the mark of what Edit took back from it (taken_mark)."""
        return (chat["id"] if chat else ""), taken_mark(chat)

    def recover(self, chat: dict | None, shown: str, taken: str = ""):
        """Before a button acts on the chat shown: where the server restarted
        since the page showed it (the chat state went with the server), the saved
        chat that the page's `shown` id names, less what Edit took back (`taken`);
        else the state as it is."""
        restored = self._restored(chat, shown, taken)
        return restored if restored is not chat else gr.skip()

    def _restored(self, chat: dict | None, shown: str, taken: str = "") -> dict | None:
        """`chat`, or where it is None (the server restarted) the saved chat named
        `shown`, if there is one, with what Edit took back taken back again."""
        if chat is not None or not shown:
            return chat
        saved = self.store.load_chat(shown)
        return taken_back_again(saved, taken) if saved else saved

    def accept(self, message: str, chat: dict | None, colour: bool, shown: str = "", taken: str = "", request: gr.Request = None) -> tuple:
        """At once on Send, before the reply waits for the model: the message
        leaves the box for the chat (saved, so a reload keeps it), the chat's
        Stop signal is reset (a Stop from now on stops this reply, even while it
        waits for its turn), and the text goes on to `send` through a hidden box.
        A chat that another browser tab has changed on disk since this tab
        showed it goes on as a copy under a new id: neither tab's messages
        overwrite the other's, and each has its own Stop. `shown`: the id of
        the chat the page shows, by which a page open across a server restart
        (its chat state gone with the server) continues that chat; `taken`: the
        page's mark of what Edit took back from it, which the message replaces.
        Outputs: message box, pending message, chatbot, chat state, notice."""
        message = well_formed(message or "")  # a lone surrogate could be neither saved nor tokenized
        text = message.strip()
        if not text:  # no pending message: send does nothing
            return message, "", gr.skip(), gr.skip(), notice_html("Type a message first.")
        chat = self._restored(chat, shown, taken)  # None where it was never saved (an empty new chat) or is gone
        session = getattr(request, "session_hash", None)
        with self.accepting:
            pressed, self.pressed[session] = self.pressed.get(session), (chat["id"] if chat else None, text, time.monotonic())
            if session is not None and pressed is not None and pressed[:2] == self.pressed[session][:2] and \
                    self.pressed[session][2] - pressed[2] < DOUBLE_PRESS_S:  # fmt: skip
                # this tab's Send pressed twice (a double click, Enter twice): both carry the same text, and the first
                # goes on alone. An error the page does not show ends this press's events (send follows accept's
                # success only): a send it started would take the place of the first press's (the page runs one
                # send of a tab at a time) and read the hidden box before the first press had filled it
                raise gr.Error("Send was pressed again", visible=False, print_exception=False)
            if self._busy(chat):  # being answered (from this tab or another): the text stays in the box, nothing is queued
                return message, "", gr.skip(), gr.skip(), busy_notice()
            return self._accepted(text, chat, colour, session)

    def _accepted(self, text: str, chat: dict | None, colour: bool, session: str | None) -> tuple:
        chat = copy.deepcopy(chat) if chat else new_chat()
        notes = []
        if stale := self._stale(chat):
            chat["copy_of"] = chat["id"]  # titled as a copy in Saved chats
            chat["id"] = new_chat()["id"]
            chat.pop(TAKEN_BACK, None)  # a copy: nothing of it is saved yet
            notes.append(FORKED_TEXT if stale == STALE_TEXT else stale)
            self.forked[chat["id"]] = notes[-1]  # the reply's own notice says it again
        if self.runtime.queue.busy or self.replying:  # another reply, a comparison, the benchmark or an API request
            notes.append(WAITING_TEXT)
        self.runtime.fresh_cancel(chat["id"])
        self.sent[chat["id"]] = session
        sent = copy.deepcopy(stored(chat))
        sent["messages"].append({"role": "user", "content": text})
        try:
            self.store.save_chat(sent)
            self._opened(sent["id"])  # a reload while the reply waits for the model shows this chat
        except OSError:
            pass  # saved with the reply, or reported then
        shown_chat = [*display(sent, colour), shown({"role": "assistant", "content": ""}, colour)]
        token = uuid.uuid4().hex
        self.unsent[token] = session
        return "", f"{SENT_MARK}{token}:{text}", shown_chat, chat, notice_html(" ".join(notes))

    def send(self, message: str, chat: dict, system: str, *values) -> Iterator[tuple]:
        """Outputs: message box, chatbot, chat state, notice, stats, depth plot, rate plot, calibration plot."""
        message = well_formed(message or "")
        if message.startswith(SENT_MARK):  # from accept (a caller of /send gives the message alone)
            token, _, message = message.removeprefix(SENT_MARK).partition(":")
            if token not in self.unsent:  # sent already: the send of a second press of the same Send
                yield gr.skip(), gr.skip(), gr.skip(), gr.skip(), *SKIP_PANEL
                return
            self.unsent.pop(token, None)
        message = message.strip()
        if not message:  # accept refused it and said why (or a caller of /send sent nothing)
            yield gr.skip(), gr.skip(), gr.skip(), gr.skip(), *SKIP_PANEL
            return
        owner = self.sent.pop(chat["id"], None) if chat else None
        if chat and chat["id"] in self.replying:
            yield message, gr.skip(), chat, busy_notice(), *SKIP_PANEL
            return
        chat = copy.deepcopy(chat) if chat else new_chat()
        chat["system"] = well_formed(system or "")
        chat["messages"].append({"role": "user", "content": message})
        yield from self._respond(chat, values, message, owner=owner)

    def check_idle(self, chat: dict | None, request: gr.Request = None) -> tuple:
        """At once on Regenerate, before it waits for the model: refused while
        this chat's reply is being written (it would wait, then replace that
        reply). Outputs: notice, refused (a hidden box that `regenerate` reads:
        its value travels with that event, so a later click cannot change it)."""
        if self._busy(chat):
            return busy_notice(), True
        if chat and chat.get(TAKEN_BACK):  # it would replace the reply before the exchange Edit took back, and save over that
            return notice_html(EDIT_PENDING_TEXT), True
        if chat:
            self.runtime.fresh_cancel(chat["id"])  # here, so that a Stop pressed while it waits applies
            self.sent[chat["id"]] = getattr(request, "session_hash", None)  # busy while the regeneration waits for the model
        return gr.skip(), False

    def regenerate(self, chat: dict | None, refused: bool, system: str, *values) -> Iterator[tuple]:
        owner = self.sent.pop(chat["id"], None) if chat and not refused else None
        if refused:  # check_idle said why
            yield gr.skip(), gr.skip(), gr.skip(), gr.skip(), *SKIP_PANEL
            return
        if chat and chat["id"] in self.replying:
            yield gr.skip(), gr.skip(), chat, busy_notice(), *SKIP_PANEL
            return
        if stale := self._stale(chat):
            yield gr.skip(), gr.skip(), chat, notice_html(stale), *SKIP_PANEL
            return
        chat = copy.deepcopy(chat) if chat else new_chat()  # its Stop was released by check_idle, at the click
        chat["system"] = well_formed(system or "")
        kept = chat["messages"].pop() if chat["messages"] and chat["messages"][-1]["role"] == "assistant" else None
        if not chat["messages"]:
            yield gr.skip(), gr.skip(), chat, notice_html("Nothing to regenerate."), *SKIP_PANEL
            return
        yield from self._respond(chat, values, None, kept, owner)

    def _respond(self, chat: dict, values: Sequence, message: str | None, kept: dict | None = None, owner: str | None = None) -> Iterator[tuple]:
        """Stream the assistant's reply to the chat's last user message. `owner`:
        the browser tab that asked for it, whose colour box its updates follow."""
        cancel = self.runtime.cancel_event(chat["id"])  # reset on Send (accept), or by regenerate
        try:
            yield from self._reply(chat, values, message, cancel, kept, owner)
        finally:  # let go once the reply has ended: a signal kept for every chat ever sent adds up
            self.runtime.drop_cancel(chat["id"], cancel)

    def _reply(self, chat: dict, values: Sequence, message: str | None, cancel: threading.Event, kept: dict | None, owner: str | None) -> Iterator[tuple]:
        """_respond's reply, stopped by `cancel`."""
        colour = bool(dict(zip(SETTINGS, values)).get("colour", True))
        try:
            options = with_seed(Options.from_values(values))
            engine = self.runtime.require()
        except (KestrelError, ValueError) as error:
            yield from self._failed(chat, message, colour, str(error), kept)
            return
        self._update_settings({**self._chosen(values), "system": chat["system"], "open_chat": chat["id"]})
        mode, note = mode_for(engine, options.mode)
        if mode == "eagle2" and (short := options.tree.shortfall(tuple(f'"{LABELS[name]}"' for name in TREE_SETTINGS))):
            note = f"{note} {short}".strip()
        made_with = run_settings(engine, mode, options)
        if forked := self.forked.get(chat["id"]):
            note = f"{forked} {note}".strip()
        messages, dropped = fit_context(engine, engine_messages(chat), room=reply_room(engine, options.sampling.max_new_tokens))
        if dropped:
            note = f"{note} Dropped the {oldest_messages(dropped)} to fit the context window.".strip()
            made_with = {**made_with, "context_dropped": dropped}  # kept with the reply: it was written without them
        try:  # fit_context kept turns that fit, or the newest message alone, which may not: that is refused here,
            if all(m["role"] == "system" for m in messages[:-1]):  # before the panel is emptied for its reply
                check_prompt(engine, engine.encode(messages))
        except ContextOverflowError as error:
            yield from self._failed(chat, message, colour, overflow_text(engine, messages, error), kept)
            return
        except ChatTemplateError as error:  # e.g. a System prompt for a model whose template takes none
            yield from self._failed(chat, message, colour, str(error), kept)
            return
        if cancel.is_set():  # Stop was pressed while this waited for its turn in the page's queue
            yield from self._failed(chat, message, colour, "Stopped before the reply started.", kept)
            return
        stats_throttle, plot_throttle = Throttle(PANEL_INTERVAL), Throttle(PLOT_INTERVAL)
        history = display(chat, colour)  # rendered once (and again if the colouring changes); each update renders only the growing reply
        reply, failure = None, None  # failure: why the decoding failed, as the notice says it
        self.replying[chat["id"]] = colour
        self.reply_owner[chat["id"]] = owner
        try:  # this chat counts as being replied to until its last update has reached the page: a New chat
            # clicked meanwhile would be undone by it (the chat shown and chat_state set back to this one)
            live = LiveReply()
            self.live[chat["id"]] = lambda: live.claim() and self._keep_stopped(chat, live.reply, kept, mode, made_with)
            save_throttle = Throttle(SAVE_INTERVAL)
            # the panel with the plots as this run last sent them, sent again by a yield that ends it: Gradio streams a
            # plot skipped after a value as a diff deleting that value's fields, which the page applies to
            # the plot's value in place, so a run that ended there left the plots without their data
            # (drawn empty, and the page's resize handlers failing on them)
            sent_panel = SKIP_PANEL
            try:
                empty_panel = render.stats_html(None, 0, session_tau(chat)), *EMPTY_PLOTS, gr.skip()  # not the last reply's figures
                # waiting behind an API request, which the page's own queue does not hold back
                read = self.runtime.queue.busy  # whether the notice shows more than `note` (the wait, how far a long conversation is read)
                waiting = f"{note} {WAITING_TEXT}".strip() if read else note
                # the message box is left alone: accept emptied it, and what is typed there now is the next message
                yield gr.skip(), [*history, shown({"role": "assistant", "content": ""}, colour)], chat, notice_html(waiting), *empty_panel
                sent_panel = gr.skip(), *empty_panel[1:]
                again = "send it again" if message is not None else "press Regenerate again"
                replies = follow_reply(
                    self.runtime.queue, engine, messages, mode, options.sampling, options.tree, cancel, TEXT_INTERVAL, reuse=self.runtime.reuse,
                    # in its turn: the Models tab's Unload or Load may have had one before it (as Compare and the API check)
                    check=lambda: self.runtime.check_loaded(engine, f"while the reply waited for its turn; {again}"),
                )  # fmt: skip
                for reply in replies:
                    if reply.finish_reason is not None:
                        continue
                    live.reply = reply
                    if reply.snapshot is None:  # no token yet: a long conversation being read
                        read = True
                        yield gr.skip(), gr.skip(), gr.skip(), notice_html(f"{note} {reply.reading_text}".strip()), *SKIP_PANEL
                        continue
                    if self.replying[chat["id"]] != colour:  # ticked or unticked during the reply
                        colour = self.replying[chat["id"]]
                        history = display(chat, colour)
                    pending = {"role": "assistant", "content": reply.text, "segments": reply.segments, **reasoning_mark(reply)}
                    stats = self._stats(chat, reply, mode) if stats_throttle.ready() else gr.skip()
                    plots = SKIP_PANEL[1:]
                    if plot_throttle.ready():
                        plots = self._plots(reply, engine, options.sampling)
                        sent_panel = gr.skip(), *plots
                    notice = notice_html(note) if read else gr.skip()
                    read = False
                    if kept is None and save_throttle.ready():  # a regeneration keeps the saved reply until it ends
                        self._save_progress(chat, reply, mode, made_with)
                    yield gr.skip(), [*history, shown(pending, colour)], gr.skip(), notice, stats, *plots
            except GeneratorExit:  # the page was closed or reloaded mid-reply: keep what was written, and
                cancel.set()  # a regeneration closed before its first token keeps the saved reply, as a stopping server does
                if live.claim():
                    self._keep_stopped(chat, reply, kept, mode, made_with)
                raise
            except ServerStopping:  # Ctrl+C on the server: keep the message and the reply so far, as Stop does
                self._ending(chat["id"])
                if live.claim():
                    self._keep_stopped(chat, reply, kept, mode, made_with)
                yield gr.skip(), gr.skip(), gr.skip(), notice_html("The server is stopping."), *sent_panel
                return
            except (KestrelError, ValueError) as error:  # ContextOverflowError included
                self._ending(chat["id"])
                failure = render.sentence(overflow_text(engine, messages, error) if isinstance(error, ContextOverflowError) else str(error))
            except Exception as error:  # a fault of the engine or the model: a notice, not the page's raw error box
                log.exception("The reply to chat %s failed", chat["id"])
                self._ending(chat["id"])
                failure = f"The reply failed ({fault_text(error)})."
            finally:
                colour = self.replying[chat["id"]]
                self.live.pop(chat["id"], None)
                self._ending(chat["id"])
            written = reply is not None and reply.snapshot is not None and bool(reply.token_ids)
            if failure is not None and not written:  # as a send refused: the message goes back into the box
                yield from self._failed(chat, message, colour, failure, kept, sent_panel)
                return
            if not live.claim():  # the server's stop saved it already
                yield gr.skip(), gr.skip(), gr.skip(), notice_html("The server is stopping."), *sent_panel
                return
            if reply is None or (reply.finish_reason == "cancelled" and not reply.token_ids):  # stopped before its first token
                yield from self._failed(chat, message, colour, "Stopped before the reply started.", kept, sent_panel)
                return
            if failure is not None:  # the reply so far is kept (shown and saved as it grew), cut short as Stop keeps one
                note = self._cut_short(chat, reply, mode, f"{note} {failure} What was written is kept.", made_with, kept)
            else:
                note = self._finish(chat, reply, mode, note, made_with, kept)
            panel = self._stats(chat, reply, mode, finished=True), *self._plots(reply, engine, options.sampling)
            colour = self.replying[chat["id"]]  # ticked or unticked until now
            yield gr.skip(), display(chat, colour), chat, notice_html(note), *panel
        finally:
            self.forked.pop(chat["id"], None)
            self.replying.pop(chat["id"], None)
            self.reply_owner.pop(chat["id"], None)
            finished = self.finishing.pop(chat["id"], None)
            if finished is not None:
                finished.set()

    def _ending(self, chat_id: str) -> None:
        """The reply's decoding has ended; its last update is still to go to the page."""
        self.finishing.setdefault(chat_id, threading.Event())

    def _finish(self, chat: dict, reply: Reply, mode: str, note: str, settings: dict, kept: dict | None = None) -> str:
        """Add the reply to the chat and save it; returns the note to show.
        `kept`: the reply a regeneration replaces, kept with the new one as an earlier reply."""
        self._add_reply(chat, reply, mode, settings, kept)
        endings = {"cancelled": "Stopped.", "length": "The reply reached the token limit.",
                   "context": "The reply reached the context window."}  # fmt: skip
        ending = endings.get(reply.finish_reason, "")
        if reply.finish_reason == "stop" and not reply.text.strip():  # an empty bubble would look like a fault of the page
            ending = EMPTY_REPLY_TEXT
        note = f"{note} {ending}".strip()
        return f"{note} {self._save(chat)}".strip()

    def _cut_short(self, chat: dict, reply: Reply, mode: str, note: str, settings: dict, kept: dict | None = None) -> str:
        """_finish for a reply whose decoding failed after its first tokens: kept
        as a stopped one, so that the chat shown is the one saved (its progress
        saves hold it already) and the next message continues it; `note` says why."""
        reply.finish_reason = "cancelled"
        self._add_reply(chat, reply, mode, settings, kept)
        return f"{note} {self._save(chat)}".strip()

    @staticmethod
    def _add_reply(chat: dict, reply: Reply, mode: str, settings: dict, kept: dict | None) -> None:
        """Append the reply, with its stats (and `kept` among its earlier replies), to the chat and its session totals."""
        stats = reply_summary(reply, mode, settings)
        chat.pop(TAKEN_BACK, None)  # the reply is saved in place of the exchange Edit took back
        message = {"role": "assistant", "content": reply.text, "segments": reply.segments, "stats": stats, **reasoning_mark(reply)}
        if kept is not None:
            message[EARLIER] = with_earlier(kept)
        chat["messages"].append(message)
        if mode != "vanilla":  # its tau is 1 whatever the head: it would dilute the drafted replies' figure
            chat["session"]["tokens"] += reply.snapshot.tokens
            chat["session"]["forwards"] += reply.snapshot.forwards

    def _save(self, chat: dict) -> str:
        """Save the chat; "" or why it could not be saved (its disk copy is then
        older than this tab's view, which is not another tab's change)."""
        try:
            self.store.save_chat(stored(chat))
            self.unsaved.discard(chat["id"])
            return ""
        except OSError as error:
            self.unsaved.add(chat["id"])
            return f"The chat could not be saved ({error})."

    def _save_progress(self, chat: dict, reply: Reply, mode: str, settings: dict) -> None:
        """Save the message with the reply so far, marked "interrupted", so that a
        crash or a killed server loses at most SAVE_INTERVAL of it; the chat in
        memory is left as it is (the reply's end saves it whole)."""
        stats = {**reply_summary(reply, mode, settings), "finish_reason": "interrupted"}
        message = {"role": "assistant", "content": reply.text, "segments": [list(run) for run in reply.segments], "stats": stats,
                   **reasoning_mark(reply)}  # fmt: skip
        try:
            self.store.save_chat({**stored(chat), "messages": [*chat["messages"], message]})
        except OSError:
            pass  # the reply's end saves it, or says why it cannot

    def save_live(self) -> None:
        """The server is stopping: save every reply being written as far as it got."""
        for keep in list(self.live.values()):
            keep()

    def _keep_stopped(self, chat: dict, reply: Reply | None, kept: dict | None, mode: str, settings: dict) -> None:
        """The server stopped during this reply: keep the message and the reply so
        far, as Stop does; a regeneration that had not begun keeps the saved reply."""
        if kept is not None and (reply is None or reply.snapshot is None):
            chat["messages"].append(kept)  # the saved reply stays as it is
        else:
            self._keep_interrupted(chat, reply, mode, settings, kept)

    def _keep_interrupted(self, chat: dict, reply: Reply | None, mode: str, settings: dict, kept: dict | None = None) -> None:
        """Save the message and the reply so far (as a stopped reply) when nobody is left to show them to."""
        try:
            if reply is not None and reply.snapshot is not None:
                reply.finish_reason = "cancelled"
                self._finish(chat, reply, mode, "", settings, kept)
            else:
                self.store.save_chat(stored(chat))
        except OSError:
            pass  # no page to report it on; the message is what is lost, as when the disk is full

    def _failed(
        self, chat: dict, message: str | None, colour: bool, error: str, kept: dict | None = None, panel: tuple = SKIP_PANEL
    ) -> Iterator[tuple]:
        """Show the error; a just-sent message goes back into the message box,
        and the reply that a regeneration replaced (`kept`) back into the chat;
        a copy that the message began (another tab had changed the chat) is removed again.
        `panel`: the stats and plots as the run last sent them (or skipped)."""
        if kept is not None:
            chat["messages"].append(kept)
        copied = self.forked.pop(chat["id"], None) is not None  # a copy that this send made: nothing of it was saved before
        if message is not None:
            chat["messages"].pop()
            restored = {**stored(chat), "messages": chat["messages"] + chat.get(TAKEN_BACK, [])}
            try:  # as saved before it was sent (accept saved it), with what Edit took back
                self.store.save_chat(restored) if restored["messages"] and not copied else self.store.delete_chat(chat["id"])
            except OSError:
                pass
        box = message if message is not None else gr.skip()  # a regeneration leaves what is typed in the box alone
        yield box, display(chat, colour), chat, notice_html(render.sentence(error)), *panel

    def _stats(self, chat: dict, reply: Reply, mode: str, finished: bool = False) -> str:
        """The stats panel; a finished reply is already in the session totals, a vanilla one never."""
        tau = session_tau(chat, None if finished or mode == "vanilla" else reply)
        return render.stats_html(reply.snapshot, reply.tree_size, tau)

    def _plots(self, reply: Reply, engine: Engine, sampling: SamplingParams) -> tuple:
        """Depth plot, rate plot, calibration plot."""
        curve = render.calibration_frame(engine.calibration_curve(sampling))
        return render.depth_frame(reply.snapshot), render.rate_frame(reply.rate_points), curve

    def stop(self, chat: dict | None) -> str:
        """Stop this chat's reply, or the one waiting for the model. Output: the
        notice, said at once (a waiting reply ends only when its turn would come)."""
        busy = self._busy(chat)
        self.runtime.cancel_kept(chat["id"] if chat else None)  # a chat that began nothing keeps no signal
        return notice_html(STOPPING_TEXT) if busy else gr.skip()

    def forget_session(self, request: gr.Request = None) -> None:
        """A browser tab closed: its requests that had not started never will,
        so the chats they marked as waiting are free again."""
        session = getattr(request, "session_hash", None)
        if session is not None:
            for chat_id in [chat_id for chat_id, owner in self.sent.items() if owner == session]:
                self.sent.pop(chat_id, None)
                if chat_id not in self.replying:  # nor its Stop signal, which only that request would have let go
                    self.runtime.drop_cancel(chat_id)
                    # nor the mark of a copy its message began: saved with that message, the copy is a chat like any
                    # other now, which a later send's failure must not take for an empty copy and delete
                    self.forked.pop(chat_id, None)
            self.pressed.pop(session, None)
            for token in [token for token, owner in self.unsent.items() if owner == session]:  # its send will never come
                self.unsent.pop(token, None)

    def _busy(self, chat: dict | None, wait: bool = False) -> bool:
        """Whether this chat's reply is being written, or its sent message waits
        for the model (while the model is busy: a message whose `send` never
        came, its page closed meanwhile, does not hold the chat). `wait`: for a
        reply that has ended and is sending its last update, wait for that (at
        most FINISHING_WAIT_S) rather than say busy; for New chat and opening
        another chat, which that update would otherwise undo, and which do not
        read the chat (its state as this click found it lacks the reply)."""
        if not chat:
            return False
        if wait and (finishing := self.finishing.get(chat["id"])) is not None:
            finishing.wait(FINISHING_WAIT_S)
        if chat["id"] in self.replying:
            return True
        return chat["id"] in self.sent and bool(self.replying or self.runtime.queue.busy)

    def _stale(self, chat: dict | None) -> str:
        """Why this tab's view of the chat must not be saved over its file, or
        "": STALE_TEXT where another tab has changed the chat on disk since this
        tab showed it (not when this tab's own latest save failed), or the file
        named with what is wrong with it where it can no longer be read (damaged
        by hand: left as it is). After Edit the view lacks the exchange taken
        back, which stays saved until the edited message is sent: the saved
        messages are then the ones Edit saw."""
        shown = chat["messages"] + chat.get(TAKEN_BACK, []) if chat else []
        if not shown:
            return ""
        saved = self.store.load_chat(chat["id"])
        if saved is None and (damage := self._damage(chat["id"])):
            return f"{damage} Nothing is written to it or removed: a message sent goes on as a new chat; fix or remove the file to change it."
        if saved is None or chat["id"] in self.unsaved:
            return ""
        return STALE_TEXT if saved["messages"] != json.loads(json.dumps(shown)) else ""  # as stored: lists

    def _damage(self, chat_id: str) -> str:
        """DAMAGED_TEXT for a chat whose file can be read but holds no chat; "" where
        there is none, or it cannot be read just now (held by another program on Windows)."""
        problem = self.store.chat_damage(chat_id)
        return DAMAGED_TEXT.format(self.store.chat_path(chat_id), problem) if problem else ""

    def _saved(self, action: Callable[[], None]) -> str:
        """Run a change to the saved chats; "" or the notice saying why it failed."""
        try:
            action()
        except OSError as error:
            return notice_html(f"The saved chats could not be changed ({error}).")
        return ""

    def edit_last(self, chat: dict | None, colour: bool, typed: str | None = None) -> tuple:
        """Take back the last user message (and the reply to it) for editing.
        The saved chat keeps them until the edited message is sent (and again
        if that send fails), so a reload or another chat opened meanwhile
        loses nothing; from the send on, the saved chat holds the edited message.
        `typed`: what the message box holds, which the message taken back would
        replace: refused unless it is the one an earlier Edit put there.
        Outputs: message box, chatbot, chat state, notice."""
        if self._busy(chat):
            return gr.skip(), gr.skip(), gr.skip(), busy_notice()
        if stale := self._stale(chat):
            return gr.skip(), gr.skip(), gr.skip(), notice_html(stale)
        put_back = (chat or {}).get(TAKEN_BACK) or [{}]
        if typed and typed.strip() and typed != put_back[0].get("content"):
            return gr.skip(), gr.skip(), gr.skip(), notice_html(TYPED_TEXT)
        chat = copy.deepcopy(chat) if chat else new_chat()
        users = [i for i, m in enumerate(chat["messages"]) if m["role"] == "user"]
        if not users:
            return gr.skip(), display(chat, colour), chat, notice_html("There is no message to edit yet.")
        text = chat["messages"][users[-1]]["content"]
        chat[TAKEN_BACK] = chat["messages"][users[-1] :] + chat.get(TAKEN_BACK, [])
        del chat["messages"][users[-1] :]
        return text, display(chat, colour), chat, ""

    def earlier_reply(self, chat: dict | None, colour: bool) -> tuple:
        """Show the last message's previous reply: a regeneration keeps the
        replies it replaces, and pressing again goes on through them, back to
        the latest. The reply shown is the one saved and continued from.
        Outputs: chatbot, chat state, stats, notice."""
        if self._busy(chat):
            return gr.skip(), gr.skip(), gr.skip(), busy_notice()
        if stale := self._stale(chat):
            return gr.skip(), gr.skip(), gr.skip(), notice_html(stale)
        if chat and chat.get(TAKEN_BACK):  # the saved chat still ends with the exchange Edit took back
            return gr.skip(), gr.skip(), gr.skip(), notice_html(EDIT_PENDING_TEXT)
        last = chat["messages"][-1] if chat and chat["messages"] else None
        if last is None or last["role"] != "assistant":
            return gr.skip(), gr.skip(), gr.skip(), notice_html("There is no reply to show earlier versions of.")
        earlier = earlier_replies(last)
        if not earlier:
            return gr.skip(), gr.skip(), gr.skip(), notice_html("This reply has no earlier versions: Regenerate keeps the replies it replaces.")
        chat = copy.deepcopy(chat)
        at = len(earlier) - newer_count(last, earlier)  # where the reply shown goes among them
        if at == 0:  # the oldest is shown: back to the newest
            previous, others, newer = earlier[-1], [kept_reply(last), *earlier[:-1]], 0
        else:  # the one written before it
            previous, others, newer = earlier[at - 1], [*earlier[: at - 1], kept_reply(last), *earlier[at:]], len(earlier) - at + 1
        chat["messages"][-1] = {**kept_reply(previous), EARLIER: others, **({NEWER: newer} if newer else {})}
        made = made_with_line(previous.get("stats"))
        note = (f"Another kept reply{f' ({made})' if made else ''}: {len(earlier) + 1} are kept for this message; "
                "press Earlier reply again for the next.")  # fmt: skip
        note = f"{note} {self._save(chat)}".strip()
        stats = render.stats_html(None, 0, session_tau(chat), saved=last_reply_stats(chat))
        return display(chat, colour), chat, stats, notice_html(note)

    def clear(self, chat: dict, confirmed: bool = True, colour: bool | None = None) -> tuple:
        """Empty this chat (delete its saved copy and go on as a new chat),
        once the page's dialog is confirmed. `colour` is given where the page
        has emptied the chatbot already (its own trash icon): a clear that does
        not happen shows the chat again. Outputs: chatbot, chat, stats, depth plot, rate plot, notice."""
        shown_again = gr.skip() if colour is None or not chat else display(chat, colour)
        if not confirmed:
            return shown_again, *(gr.skip(),) * 5
        if not self._removable(chat):
            return shown_again, *(gr.skip(),) * 4, notice_html(EMPTY_CHAT_TEXT.format("clear"))
        if self._busy(chat):
            return shown_again, gr.skip(), gr.skip(), gr.skip(), gr.skip(), busy_notice()
        if stale := self._stale(chat):  # it would delete messages this tab never showed
            return shown_again, gr.skip(), gr.skip(), gr.skip(), gr.skip(), notice_html(stale)
        chat = chat or new_chat()
        notice = self._saved(lambda: self.store.delete_chat(chat["id"]))
        if notice:
            return shown_again, gr.skip(), gr.skip(), gr.skip(), gr.skip(), notice
        cleared = new_chat(chat.get("system", ""))  # a new id: another tab showing the chat may save it again
        self._opened(None)
        return [], cleared, render.stats_html(None, 0, None), *EMPTY_PLOTS, ""

    def new(self, chat: dict, system: str) -> tuple:
        """Keep the current chat on disk and start another.
        Outputs: chatbot, chat, stats, depth plot, rate plot, chat list, notice."""
        if self._busy(chat, wait=True):
            return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), busy_notice()
        chat = new_chat(system or "")
        self._opened(None)
        choices = gr.update(choices=chat_choices(self.store), value=None)
        return [], chat, render.stats_html(None, 0, None), *EMPTY_PLOTS, choices, ""

    def open(self, chat_id: str | None, chat: dict, colour: bool) -> tuple:
        """Outputs: chatbot, chat, system prompt, stats, depth plot, rate plot, chat list, notice."""
        if self._busy(chat, wait=True):  # the reply would land in the chat opened instead
            return self._kept_open(chat, busy_notice())
        try:
            loaded = self.store.load_chat(chat_id) if chat_id else None
            damage = self._damage(chat_id) if chat_id and loaded is None else ""
        except ValueError:  # not a chat id (typed into the list)
            loaded, damage = None, ""
        if loaded is None and chat_id:  # deleted in another tab or window since this page listed it, or damaged by hand
            return self._kept_open(chat, notice_html(f"{damage} The list shows the saved chats again." if damage else GONE_TEXT))
        if loaded is None:
            return gr.skip(), chat, gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
        return self._shown(loaded, colour, gr.skip(), notice_html(cut_short_text(loaded, self._busy(loaded))))

    def _shown(self, chat: dict, colour: bool, listed, notice: str) -> tuple:
        """open's outputs for the saved `chat` shown, which a next page load then opens."""
        last = last_reply_stats(chat)
        stats = render.stats_html(None, 0, session_tau(chat), saved=last)
        outputs = (display(chat, colour), chat, chat.get("system", ""), stats, *saved_plots(last), listed, notice)
        self._opened(chat["id"])  # last: only once it can be shown
        return outputs

    def import_chat(self, path: str | None, chat: dict, colour: bool) -> tuple:
        """A chat exported as JSON (by Export, here or on another computer) saved as
        a chat of its own, never over a saved one, and shown; while this tab's reply
        is written, only saved. Outputs: as open's."""
        if not path:
            return (gr.skip(),) * 8
        file = Path(path)
        name = file.name  # Gradio's copy keeps the name the file had
        if not uploaded(file):
            return self._kept_open(chat, notice_html(f"{name} was not uploaded through the page; nothing was imported."))
        try:
            size = file.stat().st_size
        except OSError as error:
            return self._kept_open(chat, notice_html(f"{name} could not be read ({error.strerror or error}); nothing was imported."))
        if size > IMPORT_LIMIT:
            return self._kept_open(chat, notice_html(f"{name} is larger than a chat's export ({IMPORT_LIMIT >> 20} MB at most); nothing was imported."))
        value = Store.read_object(file)
        imported = as_chat(value, str((value or {}).get("id", "")))
        if imported is None:
            return self._kept_open(chat, notice_html(f"{name} is not a chat's export: {chat_file_problem(file)}; nothing was imported."))
        if not imported["messages"]:
            return self._kept_open(chat, notice_html(f"{name} holds a chat without messages; nothing was imported."))
        in_use = {*self.replying, *self.sent, *self.unsaved}  # chats of this app's own not saved (yet): their ids are taken too
        try:
            saved = self.store.add_chat(stored(imported), in_use)
        except OSError as error:
            return self._kept_open(chat, notice_html(f"{name} could not be saved ({error}); nothing was imported."))
        said = f"Imported {name} as \"{saved['title']}\"."
        if self._busy(chat, wait=True):  # the reply would land in the chat shown instead
            return self._kept_open(chat, notice_html(f"{said} It opens from Saved chats once this reply ends."))
        return self._shown(saved, colour, gr.update(choices=chat_choices(self.store), value=saved["id"]), notice_html(said))

    def _kept_open(self, chat: dict, notice: str) -> tuple:
        """open's outputs where the chat shown stays: the list of saved chats
        read again (a reply's chat is saved with its message, maybe not yet
        listed) and set on the chat shown, which Delete and Export act on."""
        choices = chat_choices(self.store)
        current = chat["id"] if chat and chat["id"] in {listed for _, listed in choices} else None
        back = gr.update(choices=choices, value=current)
        return gr.skip(), chat, gr.skip(), gr.skip(), gr.skip(), gr.skip(), back, notice

    def delete(self, chat: dict, confirmed: bool = True) -> tuple:
        """Delete the current chat, once the page's dialog is confirmed.
        Outputs: chatbot, chat, chat list, stats, depth plot, rate plot, notice."""
        if not confirmed:
            return (gr.skip(),) * 7
        if not self._removable(chat):
            return *(gr.skip(),) * 6, notice_html(EMPTY_CHAT_TEXT.format("delete"))
        if self._busy(chat):  # its reply would save it again when it ends
            return *(gr.skip(),) * 6, busy_notice()
        if stale := self._stale(chat):  # it would delete messages this tab never showed
            return *(gr.skip(),) * 6, notice_html(stale)
        chat = chat or new_chat()
        notice = self._saved(lambda: self.store.delete_chat(chat["id"]))
        if notice:
            return *(gr.skip(),) * 6, notice
        self._opened(None)
        choices = gr.update(choices=chat_choices(self.store), value=None)
        return [], new_chat(chat.get("system", "")), choices, render.stats_html(None, 0, None), *EMPTY_PLOTS, ""

    def _removable(self, chat: dict | None) -> bool:
        """Whether Clear and Delete have a chat to remove: one with messages, or saved
        without (a file written by hand or another program, listed by its title)."""
        return bool(chat) and bool(chat["messages"] or chat.get(TAKEN_BACK) or self.store.chat_path(chat["id"]).exists())

    def rename(self, name: str | None, chat: dict | None) -> tuple:
        """Name the chat shown as the user typed it (spaces and line breaks
        collapsed): the list and the export show the name, kept in the chat's
        file; an empty name gives back the one made of its first message.
        Outputs: chat, chat list, name box, notice."""
        if not chat or not (chat["messages"] or chat.get(TAKEN_BACK)):
            return gr.skip(), gr.skip(), gr.skip(), notice_html("This chat has no messages yet: send one first, then name the chat.")
        if self._busy(chat):  # the reply's own saves would write the chat without the name
            return gr.skip(), gr.skip(), gr.skip(), busy_notice()
        if stale := self._stale(chat):  # saving it would drop what another tab added
            return gr.skip(), gr.skip(), gr.skip(), notice_html(stale)
        if chat.get(TAKEN_BACK):  # the exchange Edit took back stays saved until the edited message is sent
            return gr.skip(), gr.skip(), gr.skip(), notice_html(EDIT_PENDING_TEXT)
        cleaned = clean_name(well_formed(name or ""))
        if len(cleaned) > NAME_LIMIT:
            return gr.skip(), gr.skip(), gr.skip(), notice_html(
                f"A chat's name can have at most {NAME_LIMIT} characters; this one has {len(cleaned)}: shorten it."
            )
        renamed = {**without(chat, "name"), **({"name": cleaned} if cleaned else {})}
        saved = stored(renamed)
        try:
            self.store.save_chat(saved, named=True)
        except OSError as error:
            return gr.skip(), gr.skip(), gr.skip(), notice_html(f"The chat could not be renamed ({error}).")
        renamed["title"] = saved["title"]
        return renamed, gr.update(choices=chat_choices(self.store), value=renamed["id"]), cleaned, ""

    @staticmethod
    def name_of(chat: dict | None) -> str:
        """The name box's text for the chat shown: the name the user gave it, or nothing."""
        return (chat or {}).get("name", "")

    def export(self, chat: dict) -> tuple:
        """The chat as Markdown and JSON files, for download. Gradio serves a
        copy of them from its own cache, so one folder holds every export
        (a chat exported again replaces its files) and goes when the app ends.
        Outputs: the files, notice."""
        if not chat or not chat["messages"]:
            return gr.skip(), notice_html("There is nothing to export yet: send a message first.")
        if self._busy(chat):  # the files would lack the reply being written
            return gr.skip(), busy_notice()
        if stale := self._stale(chat):  # the files would lack what another tab added
            return gr.skip(), notice_html(stale)
        try:
            if self.exports is None or not Path(self.exports.name).is_dir():  # a temp cleaner may remove it while the app runs
                self.exports = tempfile.TemporaryDirectory(prefix="kestrel-export-")
            folder = Path(self.exports.name)
            markdown, data = folder / f"chat-{chat['id']}.md", folder / f"chat-{chat['id']}.json"
            exported = self._as_saved(chat)  # both files from it: the Markdown's heading is the JSON's name
            markdown.write_text(to_markdown(exported), encoding="utf-8")
            data.write_text(to_json(exported), encoding="utf-8")
        except OSError as error:  # a full or read-only temporary folder: the chat itself stays saved
            return gr.skip(), notice_html(f"The chat could not be exported ({error}); it is still saved.")
        return [str(markdown), str(data)], ""

    def _as_saved(self, chat: dict) -> dict:
        """The chat as its saved file has it: the title and time of the last
        change are set when it is saved (the page's copy lacks them), and are
        now's where the page holds what is not saved yet; its name is the
        file's (a rename in another tab leaves this tab's view without it)."""
        exported = stored(chat)
        saved = self.store.load_chat(chat["id"])
        if saved is not None and saved["messages"] == exported["messages"]:
            named = {**without(exported, "name"), **({"name": saved["name"]} if "name" in saved else {})}
            return {**named, "title": saved.get("title", ""), "updated": saved.get("updated", exported.get("updated"))}
        return {**exported, "title": chat_title(exported), "updated": time.time()}

    def exports_of(self, files: list[str] | None, chat: dict | None):
        """The exported files listed while the chat they hold is shown; none once another is."""
        if files and (not chat or not all(Path(file).name.startswith(f"chat-{chat['id']}.") for file in files)):
            return None
        return gr.skip()

    def listed(self, chat: dict | None):
        """The saved chats' list, with the chat shown ticked where it is saved (Delete and Export act on it)."""
        choices = chat_choices(self.store)
        shown = chat["id"] if chat and any(chat_id == chat["id"] for _, chat_id in choices) else None
        return gr.update(choices=choices, value=shown)

    def recolour(self, chat: dict | None, colour: bool, request: gr.Request = None) -> list[dict]:
        """The chat shown with or without colours; while its reply is written, that reply's
        next update (and its end) takes the new setting instead: the view lacks the reply so far.
        Another tab showing the same chat redraws its own view and leaves the reply's colours alone."""
        if chat and chat["id"] in self.replying:
            owner = self.reply_owner.get(chat["id"])
            if owner is None or owner == getattr(request, "session_hash", None):
                self.replying[chat["id"]] = colour
                return gr.skip()
        if chat is None:  # a server restarted since the page showed its chat: left as shown (the next action takes it back)
            return gr.skip()
        return display(chat, colour)

    def remember(self, system: str, shown: str, *values):
        """Save the settings as soon as they change, the system prompt with the
        id of the chat it was typed for (`shown`: a reload showing that chat
        gives back the prompt as typed, not as the chat was sent with).
        Output: notice (said only where they cannot be saved)."""
        try:
            self.store.update_settings({**self._chosen(values), "system": well_formed(system), SYSTEM_FOR: shown or None})
        except OSError as error:
            return notice_html(f"The settings could not be saved ({error}); they apply until the page is closed.")
        return gr.skip()

    def _chosen(self, values: Sequence) -> dict:
        """The settings controls' values to save: the mode only where the
        page offered a choice. A model without a draft head shows vanilla
        alone, and saving that would lose the EAGLE mode the user had."""
        settings = dict(zip(SETTINGS, values))
        if settings.get("mode") == "vanilla" and self.runtime.loaded_modes in ((), ("vanilla",)):
            del settings["mode"]
        for name in SLIDERS:  # as the slider's box shows it once it loses the focus (the value replies then use)
            if name in settings and render.is_number(settings[name]):
                low, high = RANGES[name]
                settings[name] = min(max(settings[name], low), high)
        if settings.get("seed") in (None, ""):
            settings["seed"] = -1  # an empty box: a random seed, as a message sent with it gets
        for name in ("top_k", "seed"):  # a value a message would refuse is not kept for the next load
            try:
                _number(settings, name, int)
            except (KeyError, ValueError):
                settings.pop(name, None)
        return settings

    def _opened(self, chat_id: str | None) -> None:
        """Remember which chat the page shows (None: a new one, not saved yet), for the next page load."""
        self._update_settings({"open_chat": chat_id})

    def _update_settings(self, changes: dict) -> None:
        try:
            self.store.update_settings(changes)
        except OSError:
            pass  # saved again with the next change; a settings file is not worth an error dialog

    def plots_of(self, chat: dict | None) -> tuple:
        """The depth and rate charts of the chat's last reply as saved (a page
        reloaded, a kept reply shown by Earlier reply), and the calibration the
        loaded model has learned so far under that reply's sampling settings (as
        a reply shows it: the model's, over every request); nothing while a reply
        is written. Outputs: depth plot, rate plot, calibration plot."""
        if not chat or self._busy(chat):
            return gr.skip(), gr.skip(), gr.skip()
        stats = last_reply_stats(chat)
        engine = self.runtime.engine
        curve = engine.calibration_curve(saved_sampling(stats)) if engine is not None else []
        return *saved_plots(stats), render.calibration_frame(curve)

    def restore_page(self, tab_chat: str | None = None) -> tuple:
        """At page load: restore's outputs, then the saved mode where the model
        loaded now lacks it (no head), else None: the Chat tab gives it back
        once a model has it again. tab_chat: the id of the chat this tab showed
        before a reload (its sessionStorage), or empty for a new tab."""
        return self.restore(wanted=True, tab_chat=tab_chat)

    def restore(self, wanted: bool = False, tab_chat: str | None = None) -> tuple:
        """At page load: saved settings and the chat this tab showed before a
        reload (`tab_chat`; a new chat where that is not saved: a new chat's, or
        one deleted since), or in a new tab the chat last opened or
        written in (a new chat if that was one; else the latest), and a notice naming
        saved files that cannot be read (kept on disk, never overwritten).
        Outputs: the SETTINGS controls, system prompt, chatbot, chat, chat list, stats, notice
        (and with `wanted`, the saved mode that the model loaded now lacks)."""
        damaged = self.store.set_aside_damaged_settings() or self.store.set_aside
        self.store.set_aside = None
        saved = self.store.load_settings()
        settings = restored_settings(saved)
        modes = self.runtime.modes or ("vanilla",)
        mode = settings["mode"] if settings["mode"] in modes else modes[-1]
        chats, unreadable = self.store.scan_chats()
        opened = saved.get("open_chat")
        if tab_chat:  # this tab's own chat, though another tab may have opened another since; a new chat where it
            latest = next((c for c in chats if c["id"] == tab_chat), None)  # is not saved (a new chat, or one deleted)
        else:
            latest = next((c for c in chats if c["id"] == opened), None)
            if latest is None and not ("open_chat" in saved and opened is None):  # None: a new chat, with its system prompt
                latest = next(iter(chats), None)
        chat = self.store.load_chat(latest["id"]) if latest else None
        chat = chat or new_chat(settings["system"])
        mode_update = gr.update(choices=mode_choices(modes), value=mode)
        controls = [mode_update] + [settings[name] for name in SETTINGS[1:]]
        outputs = (
            *controls, settings["system"] if saved.get(SYSTEM_FOR) == chat["id"] else chat.get("system", settings["system"]),
            display(chat, settings["colour"]), chat,
            gr.update(choices=chat_choices(self.store, chats), value=chat["id"] if latest else None),
            render.stats_html(None, 0, session_tau(chat), saved=last_reply_stats(chat)),
            notice_html(" ".join(filter(None, (
                damage_text(self.store.folder, damaged, unreadable, {name: self.store.why_unreadable(name) for name in unreadable[:5]},
                            self.store.write_problem()),
                invalid_text(invalid_settings(saved, settings)),
                cut_short_text(chat, self._busy(chat)))))),
        )  # fmt: skip
        return (*outputs, None if mode == settings["mode"] else settings["mode"]) if wanted else outputs
