"""UI handlers with the tiny model: streaming, stop, persistence, escaping,
the models tab and the launched server."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
import types
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pandas as pd
import pytest
import torch

from app import chat as chat_module
from app import compare as compare_module
from app import render
from app import store as store_module
from app.chat import RANGES, SETTINGS, SLIDERS, ChatHandlers, default_settings, fit_context, last_reply_stats, restored_settings
from app.compare import CompareHandlers, first_difference
from app.library import LibraryHandlers, catalog_frame, trained_heads
from app.reply import Reply, follow_reply
from app.runtime import Runtime
from app.store import Store, new_chat
from core.config import SamplingParams, TreeParams
from core.engine import Engine, Step
from core.stats import Snapshot
from models import catalog
from models.errors import ChatTemplateError
from tests.factory import CHAT_TEMPLATE, random_head, save_tiny_model


def values(**changes) -> list:
    """Settings controls' values in SETTINGS order."""
    settings = {**default_settings(), "max_new_tokens": 24, **changes}
    return [settings[name] for name in SETTINGS]


@pytest.fixture(scope="module")
def engine(tiny_base):
    return Engine(tiny_base, random_head(tiny_base.model))


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "data")


@pytest.fixture
def handlers(engine, store, monkeypatch):
    monkeypatch.setattr(chat_module, "TEXT_INTERVAL", 0.0)
    monkeypatch.setattr(chat_module, "PANEL_INTERVAL", 0.0)
    monkeypatch.setattr(chat_module, "PLOT_INTERVAL", 0.0)
    return ChatHandlers(Runtime(engine), store)


def is_skip(value) -> bool:
    return isinstance(value, dict) and value.get("__type__") == "update" and len(value) == 1


def test_send_streams_text_and_stats(handlers, store, engine, monkeypatch):
    chat_steps = engine.chat

    def paced(*args, **kwargs):  # steps a little apart, as a real model's are: on a busy machine the tiny
        for step in chat_steps(*args, **kwargs):  # model's whole reply could be done before the page's first read
            yield step
            time.sleep(0.02)

    monkeypatch.setattr(engine, "chat", paced)
    updates = list(handlers.send("w1 w2 w3", new_chat(), "w5", *values(max_new_tokens=30)))
    streamed = [u for u in updates[1:-1] if not is_skip(u[1])]
    assert len(streamed) >= 2, "the reply should arrive in several updates"
    lengths = [len(u[1][-1]["content"]) for u in streamed]
    assert lengths == sorted(lengths) and lengths[-1] > lengths[0]
    assert any(isinstance(u[4], str) and 'id="stat-tps"' in u[4] for u in streamed)
    assert any(isinstance(u[5], pd.DataFrame) and len(u[5]) > 0 for u in streamed), "acceptance per depth"
    _, chatbot, chat, notice, stats, depth, rate, calibration = updates[-1]
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant"]
    assert 'id="stat-tree-mean"' in stats
    # the calibration plot: the diagonal, and the measured acceptance of the head's drafted nodes
    measured = calibration[calibration["series"] == "measured"]
    assert len(calibration[calibration["series"] == "diagonal"]) == 2 and len(measured) > 0
    assert measured["accepted"].between(0, 1).all() and measured["draft confidence"].between(0, 1).all()
    assert chat["messages"][1]["stats"]["tokens"] == 30 and chat["system"] == "w5"
    assert chatbot[-1]["content"] == render.escape(chat["messages"][1]["content"]) or "kd" in chatbot[-1]["content"]
    assert 'id="stat-tau-session"' in stats and isinstance(rate, pd.DataFrame)
    assert store.load_chat(chat["id"])["messages"] == chat["messages"]


def test_a_reply_shorter_than_the_rate_interval_draws_a_line(handlers):
    """A point at the first token and one at the end (a single point drew nothing)."""
    rate = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][6]
    assert len(rate) == 2 and rate["seconds"].iloc[0] < rate["seconds"].iloc[1] and (rate["tokens/s"] > 0).all()


def test_a_chat_opened_or_reloaded_draws_its_last_replys_charts_again(handlers, store, monkeypatch):
    monkeypatch.setattr(chat_module, "RATE_POINTS_KEPT", 3)
    monkeypatch.setattr("app.reply.RATE_INTERVAL", 0.0)  # a point per step: more than are kept
    updates = list(handlers.send("w1 w2 w3", new_chat(), "", *values(max_new_tokens=30)))
    _, _, chat, _, _, depth, rate, _ = updates[-1]
    saved = store.load_chat(chat["id"])["messages"][-1]["stats"]
    assert saved["acceptance_by_depth"] == [round(r, 3) for r in depth["acceptance"]] and len(depth) > 0
    assert len(saved["rate_points"]) == 3 and saved["rate_points"][-1][0] == rate["seconds"].iloc[-1] and len(rate) > 3
    for plots in (handlers.open(chat["id"], new_chat(), True)[4:6], handlers.plots_of(store.load_chat(chat["id"]))):
        assert list(plots[0]["acceptance"]) == saved["acceptance_by_depth"] and list(plots[0]["depth"]) == [str(d + 1) for d in range(len(depth))]
        assert [list(p) for p in zip(plots[1]["seconds"], plots[1]["tokens/s"])] == saved["rate_points"]
    broken = store.load_chat(chat["id"])
    broken["messages"][-1]["stats"].update(acceptance_by_depth="high", rate_points=[[1.0, "fast"]])  # a hand-edited file
    depth, rate, _ = handlers.plots_of(broken)
    assert len(depth) == 0 and len(rate) == 0
    assert [is_skip(p) for p in handlers.plots_of(None)] == [True, True, True]
    calibration = handlers.plots_of(store.load_chat(chat["id"]))[2]  # the model's, as the reply left it
    assert len(calibration[calibration["series"] == "measured"].dropna()) > 0


def test_stop_ends_reply_within_a_step(handlers, engine):
    chat = new_chat()
    stream = handlers.send("w1", chat, "", *values(max_new_tokens=200, mode="vanilla"))
    first = next(stream)
    next(stream)  # the first streamed text
    handlers.stop(first[2])
    stopped_at = time.perf_counter()
    final = list(stream)[-1]
    assert time.perf_counter() - stopped_at < 1.0
    reply = final[2]["messages"][-1]
    assert reply["stats"]["finish_reason"] == "cancelled"
    assert reply["stats"]["tokens"] < 200
    assert "Stopped" in final[3]


def test_new_chat_clicked_as_a_reply_ends_waits_for_its_last_update(handlers):
    """The reply is saved before its last update goes to the page: a New chat handled in
    between was undone by that update (the old chat shown and continued again). It waits for
    it, then starts the new chat, not refused as busy."""
    stream = handlers.send("w1 w2", new_chat(), "", *values(max_new_tokens=6, mode="vanilla"))
    shown = next(stream)[2]
    for update in stream:
        if not is_skip(update[2]) and len(update[2]["messages"]) == 2:  # the last update, not yet taken by the page
            break
    outputs = []
    clicked = threading.Thread(target=lambda: outputs.append(handlers.new(shown, "")))
    clicked.start()
    clicked.join(0.5)
    assert clicked.is_alive() and not outputs
    assert list(stream) == []  # the page took the last update: the generator ends
    clicked.join(5)
    _, chat, *_, notice = outputs[0]
    assert chat["id"] != shown["id"] and chat["messages"] == [] and notice == ""


def test_closing_the_page_mid_reply_keeps_the_reply_so_far(handlers, store):
    stream = handlers.send("w1 w2", new_chat(), "", *values(max_new_tokens=200, mode="vanilla"))
    chat = next(stream)[2]
    for _ in range(3):
        next(stream)
    stream.close()  # what Gradio does when the browser goes away
    saved = store.load_chat(chat["id"])["messages"]
    assert [m["role"] for m in saved] == ["user", "assistant"] and saved[0]["content"] == "w1 w2"
    assert saved[1]["content"]
    assert 0 < saved[1]["stats"]["tokens"] < 200 and saved[1]["stats"]["finish_reason"] == "cancelled"

    stream = handlers.send("w3", new_chat(), "", *values(max_new_tokens=200, mode="vanilla"))
    chat = next(stream)[2]
    stream.close()  # before the first token: the message itself is kept
    assert [m["content"] for m in store.load_chat(chat["id"])["messages"]] == ["w3"]


def test_a_regeneration_closed_before_its_first_token_keeps_the_saved_reply(handlers, store):
    """The page closed or reloaded while a regeneration waits or reads the
    conversation: the reply it would have replaced stays saved, with its
    earlier versions (it was saved without them)."""
    chat = list(handlers.send("w1 w2", new_chat(), "", *values(max_new_tokens=6, mode="vanilla")))[-1][2]
    chat = list(handlers.regenerate(chat, False, "", *values(max_new_tokens=6, mode="vanilla")))[-1][2]
    before = store.load_chat(chat["id"])["messages"]
    assert len(before) == 2 and before[1].get("earlier")
    stream = handlers.regenerate(chat, False, "", *values(max_new_tokens=6, mode="vanilla"))
    next(stream)  # the panel emptied for the new reply; no token yet
    stream.close()
    assert store.load_chat(chat["id"])["messages"] == before


def test_a_message_sent_as_a_closed_page_s_reply_ends_does_not_start_that_reply_again(handlers, engine, monkeypatch):
    """The page went away mid-reply (its Stop set) and the same chat's next
    message was sent before the decoding's next step looked: Send's fresh Stop
    signal is the new reply's own, so the abandoned decoding still ends at once,
    instead of running to its token limit while the new message waits."""
    chat_steps, produced = engine.chat, []

    def paced(*args, **kwargs):  # the decoding thread between two steps when the page goes away
        produced.append(0)
        for step in chat_steps(*args, **kwargs):
            produced[-1] += 1
            yield step
            time.sleep(0.3)  # longer than the closing's save of the reply so far

    monkeypatch.setattr(engine, "chat", paced)
    chat = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=1)))[-1][2]
    stream = handlers.send("w2", chat, "", *values(max_new_tokens=30, mode="vanilla"))
    shown = next(stream)[2]
    while not produced or produced[-1] < 2:
        next(stream)
    stream.close()
    _, pending, _, shown, _ = handlers.accept("w3", store_module.Store.read_object(handlers.store.chat_path(shown["id"])) or shown, True)
    list(handlers.send(pending, shown, "", *values(max_new_tokens=1, mode="vanilla")))
    assert produced[1] < 10, produced


def test_regenerate_edit_and_clear(handlers):
    chat = list(handlers.send("w1 w2", new_chat(), "", *values(temperature=0.9, seed=-1)))[-1][2]
    regenerated = list(handlers.regenerate(chat, False, "", *values()))[-1][2]
    assert len(regenerated["messages"]) == 2
    text, chatbot, edited, _ = handlers.edit_last(regenerated, True)
    assert text == "w1 w2" and edited["messages"] == [] and chatbot == []
    chatbot, cleared, *_ = handlers.clear(edited)  # the page's chat as Edit left it
    assert cleared["messages"] == [] and cleared["id"] != chat["id"]


def test_edit_keeps_the_saved_exchange_until_the_edited_message_is_sent(handlers, store, engine):
    chat = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    chat = list(handlers.send("w2", chat, "", *values(max_new_tokens=4)))[-1][2]
    text, _, edited, notice = handlers.edit_last(chat, True)
    assert text == "w2" and [m["content"] for m in edited["messages"] if m["role"] == "user"] == ["w1"] and notice == ""
    # a reload before sending shows the chat whole: nothing is lost
    reloaded = ChatHandlers(Runtime(engine), Store(store.folder)).restore()[-4]
    assert reloaded["messages"] == store.load_chat(chat["id"])["messages"] and len(reloaded["messages"]) == 4
    # a second Edit takes back the exchange before, in place of the text the first put in the box; but not of text typed there
    assert handlers.edit_last(edited, True, "w2 changed")[3] == chat_module.notice_html(chat_module.TYPED_TEXT)
    assert handlers.edit_last(chat, True, "typed before any Edit")[3] == chat_module.notice_html(chat_module.TYPED_TEXT)
    edited_again = handlers.edit_last(edited, True, "w2")
    assert edited_again[0] == "w1" and edited_again[2]["messages"] == [] and len(store.load_chat(chat["id"])["messages"]) == 4
    # sending the edited message replaces the exchange taken back, in this chat (not a copy)
    box, pending, _, state, notice = handlers.accept("w2 edited", edited, True)
    assert "another tab" not in notice and state["id"] == chat["id"]
    final = list(handlers.send(pending, state, "", *values(max_new_tokens=4)))[-1][2]
    saved = store.load_chat(chat["id"])
    assert [m["content"] for m in saved["messages"] if m["role"] == "user"] == ["w1", "w2 edited"] and "taken_back" not in saved
    assert final["messages"] == saved["messages"]
    # another tab's change after the Edit still counts
    text, _, edited, _ = handlers.edit_last(final, True)
    list(handlers.send("w3", final, "", *values(max_new_tokens=4)))
    assert "another tab" in handlers.accept("w4", edited, True)[4]
    # an edited message whose reply fails (no model) leaves the saved chat as it was, and Edit's view
    only = list(handlers.send("w5", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    _, _, edited, _ = handlers.edit_last(only, True)
    unloaded = ChatHandlers(Runtime(None), Store(store.folder))
    box, pending, _, state, _ = unloaded.accept("w5 edited", edited, True)
    final = list(unloaded.send(pending, state, "", *values(max_new_tokens=4)))[-1]
    assert final[0] == "w5 edited" and "No model is loaded; load one in the Models tab." in final[3] and final[2]["messages"] == []
    assert store.load_chat(only["id"])["messages"] == only["messages"]
    again = list(handlers.send(*handlers.accept("w5 again", final[2], True)[1:2], final[2], "", *values(max_new_tokens=4)))[-1][2]
    assert [m["content"] for m in store.load_chat(only["id"])["messages"] if m["role"] == "user"] == ["w5 again"]
    assert again["messages"] == store.load_chat(only["id"])["messages"]
    # a regeneration after Edit that fails leaves both as they were, and the next send is not taken for another tab's
    _, _, edited, _ = handlers.edit_last(chat_module.copy.deepcopy(again), True)
    regenerated = list(unloaded.regenerate(edited, False, "", *values()))[-1]
    assert "taken_back" in regenerated[2] and "another tab" not in handlers.accept("w6", regenerated[2], True)[4]


def test_a_reply_stores_its_settings_and_seed_and_they_make_it_again(handlers, engine):
    sampled = values(temperature=0.9, top_k=20, seed=-1, max_new_tokens=12)
    chat = list(handlers.send("w1 w2", new_chat(), "", *sampled))[-1][2]
    settings = chat["messages"][-1]["stats"]["settings"]
    assert settings["model"] == engine.base.name and settings["temperature"] == 0.9 and settings["top_k"] == 20
    assert isinstance(settings["seed"], int) and 0 <= settings["seed"] <= chat_module.RANGES["seed"][1]  # drawn for it
    again = list(handlers.send("w1 w2", new_chat(), "", *values(temperature=0.9, top_k=20, seed=settings["seed"], max_new_tokens=12)))
    assert again[-1][2]["messages"][-1]["content"] == chat["messages"][-1]["content"]
    markdown = open(handlers.export(chat)[0][0]).read()
    assert f"temperature 0.9, top-p 1.0, top-k 20, seed {settings['seed']}" in markdown and "tokens/s" in markdown
    assert "tokens/s after the first token" in markdown  # the rate without the prompt's reading, as the panel shows it
    greedy = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]["messages"][-1]["stats"]
    assert greedy["settings"]["seed"] is None and "greedy" in store_module.made_with(greedy)
    assert store_module.made_with(greedy).endswith("cut at the token limit")  # 4 of 4 tokens
    assert f"{engine.base.name} ({str(engine.base.dtype).removeprefix('torch.')}, {engine.base.quantization})" in store_module.made_with(greedy)
    assert "at most 4 new tokens, trees sized by the planner (depth up to" in store_module.made_with(greedy)
    for mode, tree in (("eagle2", {"total_tokens": 10, "depth": 3, "top_k": 2}), ("eagle", None), ("vanilla", None)):
        made = list(handlers.send("w1", new_chat(), "", *values(mode=mode, total_tokens=10, depth=3, tree_top_k=2, max_new_tokens=4)))
        assert made[-1][2]["messages"][-1]["stats"]["settings"].get("tree") == tree, mode  # EAGLE's fixed tree: not the settings
    assert store_module.made_with({"mode": 3, "settings": "x", "tokens": True}) == ""  # a file edited by hand
    assert store_module.made_with({"finish_reason": ["length"], "tokens": 2}) == "2 tokens"  # or imported: no unhashable lookup
    long = " ".join(["w1"] * (engine.context_limit // 2))  # two of these and their replies do not fit: the oldest are left out
    chat = new_chat()
    for _ in range(3):
        chat = list(handlers.send(long, chat, "", *values(max_new_tokens=4)))[-1][2]
    stats = chat["messages"][-1]["stats"]
    assert stats["settings"]["context_dropped"] >= 2 and "oldest messages (past the context window)" in store_module.made_with(stats)
    assert 'id="stat-dropped"' in render.stats_html(None, 0, None, saved=stats)  # the panel of the chat opened again


def test_history_and_settings_survive_a_restart(engine, store, handlers):
    chat = list(handlers.send("w7 w8", new_chat(), "w9", *values(temperature=0.7, seed=5)))[-1][2]
    restarted = ChatHandlers(Runtime(engine), Store(store.folder))
    restored = restarted.restore()
    controls = dict(zip(SETTINGS, restored[: len(SETTINGS)]))
    system, chatbot, loaded = restored[len(SETTINGS) : len(SETTINGS) + 3]
    assert controls["temperature"] == 0.7 and controls["seed"] == 5
    assert system == "w9" and loaded["messages"] == chat["messages"]
    assert chatbot[0]["content"] == "w7 w8"


def test_a_system_prompt_typed_for_a_saved_chat_survives_a_reload(handlers, engine, store):
    """A saved chat sent with system prompt w9, then w5 typed in the box (not
    sent): a reload showing that chat gave back w9, and the next settings save
    wrote it over w5. Another chat shown gets its own system prompt."""
    chat = list(handlers.send("w7 w8", new_chat(), "w9", *values(max_new_tokens=4)))[-1][2]
    other = list(handlers.send("w1", new_chat(), "w3", *values(max_new_tokens=4)))[-1][2]
    handlers.remember("w5", chat["id"], *values())  # typed while that chat is shown

    def system_after_reload(tab_chat: str) -> str:
        return ChatHandlers(Runtime(engine), Store(store.folder)).restore(tab_chat=tab_chat)[len(SETTINGS)]

    assert system_after_reload(chat["id"]) == "w5"
    assert system_after_reload(other["id"]) == "w3"  # typed for another chat: this one's own
    handlers.remember("w5", other["id"], *values())
    assert system_after_reload(chat["id"]) == "w9"


def test_a_reload_shows_the_chat_last_opened_or_written_in(handlers, engine, store):
    older = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    time.sleep(0.01)
    newer = list(handlers.send("w2", new_chat(), "", *values(max_new_tokens=4)))[-1][2]

    def reloaded() -> str:
        return ChatHandlers(Runtime(engine), Store(store.folder)).restore()[-4]["id"]

    assert reloaded() == newer["id"]
    handlers.open(older["id"], newer, True)
    assert reloaded() == older["id"]
    # a reloaded tab that showed another saved chat shows it again (another tab opened this one since)
    again = ChatHandlers(Runtime(engine), Store(store.folder))
    assert again.restore(tab_chat=newer["id"])[-4]["id"] == newer["id"] and again.restore_page(newer["id"])[-5]["id"] == newer["id"]
    gone = again.restore(tab_chat="gone")[-4]  # a new chat the tab showed (not saved until its first message), or one deleted:
    assert gone["messages"] == [] and gone["id"] not in (older["id"], newer["id"])  # a new chat, not another tab's
    handlers.remember("", "", *values(temperature=0.5))  # a setting changed meanwhile
    assert reloaded() == older["id"]
    list(handlers.send("w3", newer, "", *values(max_new_tokens=4)))
    assert reloaded() == newer["id"]
    handlers.new(newer, "")  # a new chat, not saved until its first message, shows again with its system prompt
    handlers.remember("w5", "", *values())
    restored = ChatHandlers(Runtime(engine), Store(store.folder)).restore()
    assert restored[-4]["messages"] == [] and restored[-4]["id"] not in (older["id"], newer["id"])
    assert restored[len(SETTINGS)] == "w5" and restored[-4]["system"] == "w5"
    handlers.open(older["id"], newer, True)
    handlers.clear(older)  # cleared: a new chat too
    assert ChatHandlers(Runtime(engine), Store(store.folder)).restore()[-4]["messages"] == []
    accepted = handlers.accept("w6", new_chat(), True)[3]  # its first message sent, its reply not begun
    assert ChatHandlers(Runtime(engine), Store(store.folder)).restore()[-4]["id"] == accepted["id"]


def test_a_chat_opened_or_reloaded_shows_its_last_reply_s_figures(handlers, engine, store):
    chat = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    stats = chat["messages"][-1]["stats"]
    for panel in (
        ChatHandlers(Runtime(engine), Store(store.folder)).restore()[-2],
        handlers.open(chat["id"], new_chat(), True)[3],
    ):
        assert f'id="stat-tps">{stats["tokens_per_s"]:.1f}<' in panel
        assert f'id="stat-tps-decoding">{stats["decoding_tokens_per_s"]:.1f}<' in panel
        assert f'id="stat-forwards">{stats["forwards"]}<' in panel and f'id="stat-ttft">{stats["time_to_first_token"]:.2f} s<' in panel
        assert f'id="stat-tree-mean">{stats["mean_tree_size"]:.1f} / {stats["mean_tree_depth"]:.1f}<' in panel
        assert f'id="stat-tau">{stats["tau"]:.2f}<' in panel and 'id="stat-tokens">4<' in panel
    damaged = {**chat, "messages": [*chat["messages"][:-1], {**chat["messages"][-1], "stats": {"tau": "x", "tokens": True}}]}
    panel = render.stats_html(None, 0, None, saved=last_reply_stats(damaged))
    assert 'id="stat-tau">-<' in panel and 'id="stat-tokens">-<' in panel and 'id="stat-tps">-<' in panel


def test_saved_settings_of_the_wrong_kind_fall_back_to_defaults(engine, store):
    store.folder.mkdir(parents=True, exist_ok=True)
    (store.folder / "settings.json").write_text(
        '{"temperature": "hot", "top_p": NaN, "colour": 1, "seed": true, "max_new_tokens": 64, "system": 5}'
    )
    restored = ChatHandlers(Runtime(engine), Store(store.folder)).restore()
    controls = dict(zip(SETTINGS, restored[: len(SETTINGS)]))
    defaults = default_settings()
    assert controls["max_new_tokens"] == 64
    assert [controls[name] for name in ("temperature", "top_p", "colour", "seed")] == [
        defaults[name] for name in ("temperature", "top_p", "colour", "seed")
    ]
    assert restored[len(SETTINGS)] == ""  # the system prompt


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"temperature": 5}, "Temperature: enter a number from 0 to 2 (it is 5)"),
        ({"top_p": None}, "Top-p: enter a number (it is empty)"),
        ({"depth": 0}, "Tree: depth: enter a number from 1 to 12"),
        ({"max_new_tokens": 99999}, "Max new tokens: enter a number from 1 to 32768"),
        ({"seed": 1.5}, "Seed: enter a whole number"),
        ({"top_k": -3}, "Top-k: enter a number from 0 to 1000000 (it is -3)"),
        ({"seed": 1e30}, "Seed: enter a number from -1 to 4294967295"),
    ],
)
def test_a_setting_typed_out_of_range_or_emptied_is_named_and_the_message_kept(handlers, store, changes, named):
    """The page passes the settings as typed (ui.as_typed): the reply is refused
    naming the setting, and the message goes back into the box. A slider's
    value is saved as its box settles on it (the nearest end of its range); no
    other bad value is saved that would come back at the next start."""
    final = list(handlers.send("w1", new_chat(), "", *values(**changes)))[-1]
    assert named in final[3] and final[0] == "w1"
    handlers.remember("", "", *values(**changes))
    name, typed = next(iter(changes.items()))
    restored = restored_settings(store.load_settings())[name]
    if name in SLIDERS and typed is not None:  # the slider's box settles on its range's nearest end, and is saved so
        assert restored == min(max(typed, RANGES[name][0]), RANGES[name][1]) != default_settings()[name]
    else:
        assert restored == default_settings()[name]
    if name not in SLIDERS:  # not saved: the next load does not call it not valid
        assert "not valid" not in handlers.restore()[-1]


def test_an_empty_seed_box_is_saved_as_random(handlers, store):
    """An emptied Seed box sends with a random seed, and is kept as -1 (random), not as a setting not valid."""
    final = list(handlers.send("w1", new_chat(), "", *values(seed=None, temperature=1.0, max_new_tokens=4)))[-1]
    assert "enter" not in final[3]
    handlers.remember("", "", *values(seed=None))
    assert store.load_settings()["seed"] == -1 and "not valid" not in handlers.restore()[-1]


def test_clear_and_delete_refuse_a_chat_another_tab_has_extended(handlers, engine, store):
    """A tab showing a chat that another tab has since written to: Clear and
    Delete would remove messages this tab never showed, and Export would leave
    them out, so they say so instead."""
    shown = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    elsewhere = list(ChatHandlers(Runtime(engine), store).send("w2", shown, "", *values(max_new_tokens=4)))[-1][2]
    assert elsewhere["id"] == shown["id"] and len(store.load_chat(shown["id"])["messages"]) == 4
    assert "changed in another tab" in handlers.export(shown)[-1]
    assert len(handlers.export(elsewhere)[0]) == 2  # the chat as saved: exported
    assert "changed in another tab" in handlers.clear(shown)[-1]
    assert "changed in another tab" in handlers.delete(shown)[-1]
    assert len(store.load_chat(shown["id"])["messages"]) == 4
    handlers.delete(elsewhere)  # the chat as saved: deleted
    assert store.load_chat(shown["id"]) is None


def test_a_chat_deleted_in_another_tab_is_said_when_picked_and_delete_keeps_the_chat_shown_apart(handlers, engine, store, monkeypatch):
    """A page lists a chat that another tab deletes; picking it says so and
    puts the list back on the chat shown, so Delete acts on what the user sees
    (it deleted the shown chat while the list named the gone one)."""
    kept = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    gone = list(handlers.send("w2", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    other = list(handlers.send("w3", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    ChatHandlers(Runtime(engine), store).delete(gone)  # another tab
    shown, chat, _, _, _, _, listed, notice = handlers.open(gone["id"], kept, True)
    assert chat == kept and shown == gr.skip() and "no longer saved" in notice
    assert listed["value"] == kept["id"] and gone["id"] not in [chat_id for _, chat_id in listed["choices"]]
    handlers.delete(chat)
    assert store.load_chat(kept["id"]) is None and store.load_chat(other["id"]) is not None
    unsaved = new_chat()  # shown but never sent: nothing in the list to point at
    assert handlers.open(gone["id"], unsaved, True)[6]["value"] is None
    # ids typed into the list that would name a file elsewhere (on Windows: a drive, a stream, a device) open nothing
    monkeypatch.setattr(store_module.os, "name", "nt")
    for typed in ("C:notes", "x:stream", "CON", "nul.txt", "COM1", "../x", "a\\b"):
        with pytest.raises(ValueError):
            store.chat_path(typed)
        assert "no longer saved" in handlers.open(typed, kept, True)[-1]
    assert store.chat_path("console").name == "console.json"
    monkeypatch.undo()  # elsewhere those are file names like any other: a chat listed under one opens
    assert store.chat_path("aux").name == "aux.json" and store.chat_path("a:b").name == "a:b.json"


def test_the_page_passes_settings_as_typed():
    from app.ui import as_typed

    slider = gr.Slider(0, 2, 1)
    as_typed(slider)
    assert slider.preprocess(5) == 5 and slider.preprocess(None) is None


def test_settings_saved_when_changed(handlers, store):
    handlers.remember("w3", "", *values(temperature=1.2, depth=3))
    assert store.load_settings()["temperature"] == 1.2 and store.load_settings()["system"] == "w3"


def test_interrupted_write_keeps_the_previous_history(store, monkeypatch):
    chat = new_chat()
    chat["messages"] = [{"role": "user", "content": "first"}]
    store.save_chat(chat)
    chat["messages"].append({"role": "assistant", "content": "second"})

    def crash(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError):
        store.save_chat(chat)
    assert store.load_chat(chat["id"])["messages"] == [{"role": "user", "content": "first"}]
    assert [p.name for p in store.chat_path(chat["id"]).parent.iterdir()] == [f"{chat['id']}.json"]


def test_a_file_held_open_for_a_moment_is_replaced_when_it_is_let_go(store, monkeypatch):
    """Windows refuses to replace a file that a scanner is reading: the save
    tries again a few times before it gives up."""
    import app.store as store_module

    real, refusals = os.replace, []

    def held(source, target):
        if len(refusals) < 2:
            refusals.append(target)
            raise PermissionError(13, "The process cannot access the file")
        real(source, target)

    monkeypatch.setattr(store_module, "REPLACE_TRIES", 6)
    monkeypatch.setattr(os, "replace", held)
    chat = new_chat()
    chat["messages"] = [{"role": "user", "content": "kept"}]
    store.save_chat(chat)
    assert len(refusals) == 2 and store.load_chat(chat["id"])["messages"][0]["content"] == "kept"
    refusals.clear()
    monkeypatch.setattr(store_module, "REPLACE_TRIES", 2)
    with pytest.raises(PermissionError):
        store.save_chat(chat)
    assert [p.name for p in store.chat_path(chat["id"]).parent.iterdir()] == [f"{chat['id']}.json"]


def test_data_dir_override(tmp_path, monkeypatch):
    from app.instance import data_dir

    monkeypatch.setenv("KESTREL_DATA_DIR", str(tmp_path))
    assert data_dir() == tmp_path


def test_damaged_chat_file_is_skipped(store):
    store.chat_path("broken").parent.mkdir(parents=True)
    store.chat_path("broken").write_text("{not json")
    assert store.list_chats() == [] and store.load_chat("broken") is None
    store.chat_path("odd").write_text(json.dumps({"messages": [{"role": "user"}]}))  # a message without content
    assert store.list_chats() == [] and store.load_chat("odd") is None
    # a role the page does not write would reach the model unseen on the page: damaged, named, left on disk
    store.chat_path("role").write_text(json.dumps({"messages": [{"role": "bogus", "content": "x"}, {"role": "user", "content": "y"}]}))
    assert store.load_chat("role") is None and "role.json" in store.scan_chats()[1] and store.chat_path("role").exists()


def test_chat_file_lacking_fields_loads_with_defaults(store, handlers):
    store.chat_path("by-hand").parent.mkdir(parents=True, exist_ok=True)
    store.chat_path("by-hand").write_text(json.dumps({"messages": [{"role": "user", "content": "Hello"}], "session": None}))
    assert store.list_chats() == [{"id": "by-hand", "title": "Hello", "updated": 0.0}]  # titled by its first message
    chat = store.load_chat("by-hand")
    assert chat["id"] == "by-hand" and chat["system"] == "" and chat["session"] == {"tokens": 0, "forwards": 0}
    shown, opened, system, *_ = handlers.open("by-hand", new_chat(), True)
    assert opened["id"] == "by-hand" and system == "" and "Hello" in str(shown)
    store.save_chat(chat)  # saved back whole, under the same name
    assert store.load_chat("by-hand")["title"] == "Hello"


def test_model_text_is_html_escaped():
    evil = "<script>alert(1)</script><img src=x onerror=alert(2)>"
    message = {"role": "assistant", "content": evil, "segments": [[evil[:10], render.DRAFT], [evil[10:], render.BASE]]}
    for colour in (True, False):
        shown = chat_module.display({"messages": [message]}, colour)[0]["content"]
        assert "<script>" not in shown and "<img" not in shown and "&lt;script&gt;" in shown
    assert "<script>" not in render.pane_html(message["segments"])
    assert "<script>" not in chat_module.notice_html(evil)


def snapshot(tokens: int) -> Snapshot:
    return Snapshot(tokens, 1, 0.1, 0.01, 10.0, 1.0, 0.0, 0.0, ())


def test_tokens_are_coloured_by_origin(tiny_base):
    reply = Reply()
    reply.add(Step((9,), "w1", 0, 1, 0.0, 0.0, snapshot(1)))
    reply.add(Step((10, 11, 12), " w2 w3 w4", 2, 8, 0.0, 0.0, snapshot(4), None, " w2 w3"))
    assert reply.segments == [["w1", render.BASE], [" w2 w3", render.DRAFT], [" w4", render.BASE]]
    assert render.coloured(reply.segments).count('class="kd"') == 1


def test_vanilla_fallback_without_head(tiny_base, store):
    handlers = ChatHandlers(Runtime(Engine(tiny_base)), store)
    final = list(handlers.send("w1", new_chat(), "", *values(mode="eagle2", max_new_tokens=4)))[-1]
    assert "needs a draft head" in final[3]
    assert final[2]["messages"][-1]["stats"]["mode"] == "vanilla"


def test_oldest_turns_dropped_to_fit_context(engine):
    long = " ".join(["w1"] * 100)
    messages = [{"role": "system", "content": "w2"}] + [
        {"role": role, "content": long} for role in ("user", "assistant", "user", "assistant", "user")
    ]
    fitted, dropped = fit_context(engine, messages, room=32)
    assert dropped >= 2 and fitted[0]["role"] == "system" and fitted[1:] == messages[len(messages) - len(fitted) + 1 :]  # the newest kept
    assert len(engine.encode(fitted)) + 32 <= engine.context_limit


def test_a_long_chat_drops_its_oldest_turns_in_steps(engine):
    """Past the window, the turns dropped stay the same for several turns, so
    each turn's prompt continues the previous one's (its kept caches) until the
    chat has grown by another eighth of the window; just enough dropped at
    every turn would change the prompt's start at every turn."""
    class Window:  # the bundled tokenizer with a small window
        context_limit = 2048
        encode = staticmethod(engine.encode)

    messages, prompts, drops = [{"role": "system", "content": "w2"}], [], []
    for turn in range(60):
        messages.append({"role": "user", "content": " ".join([f"w{turn % 7 + 1}"] * 10)})
        fitted, dropped = fit_context(Window(), messages, room=16)
        prompt = engine.encode(fitted)
        assert len(prompt) + 16 <= Window.context_limit and fitted[-1] is messages[-1] and fitted[0] is messages[0]
        prompts.append(prompt)
        drops.append(dropped)
        messages.append({"role": "assistant", "content": " ".join([f"w{turn % 5 + 3}"] * (90 + 7 * (turn % 4)))})  # replies of varying length
    past = [index for index, dropped in enumerate(drops) if dropped]
    assert len(past) >= 15  # the chat went well past the window
    continued = [index for index in past[1:] if prompts[index][: len(prompts[index - 1])] == prompts[index - 1]]
    # a step is about two and a half turns here (just enough dropped each turn: none continued); a step judged
    # against each turn's excess rather than its fixed target flipped from turn to turn and continued 11 of 42
    assert 5 * len(continued) >= 2 * len(past), (drops, continued)
    for index in past:  # never more dropped than a step beyond what the window needs, and the rest of a message
        whole = len(engine.encode(messages[: 2 * index + 2]))
        needed = whole + 16 - Window.context_limit
        assert whole - len(prompts[index]) < needed + Window.context_limit // 8 + 130


def test_a_long_newest_message_keeps_the_turns_that_fit_with_less_room_for_the_reply(engine):
    """A newest message that leaves less than the wanted reply room (Max new
    tokens, up to a quarter of the window) but fits with 64 tokens to spare:
    the earlier turns that fit stay, instead of all of them being dropped."""
    class Window:
        context_limit = 2048
        encode = staticmethod(engine.encode)

    earlier = [{"role": role, "content": "w1 w2"} for role in ("user", "assistant") * 3]
    paste = {"role": "user", "content": " ".join(["w3"] * 1700)}
    assert Window.context_limit - 512 < len(engine.encode([paste])) < Window.context_limit - 64 - len(engine.encode(earlier))
    fitted, dropped = fit_context(Window(), [*earlier, paste], room=512)
    assert dropped == 0 and fitted[-1] is paste


def test_a_pasted_text_stays_while_it_fits_and_long_chats_encode_a_few_times(engine):
    """Where the step would drop a long pasted text together with the short
    messages before it, the text stays while it fits; and a chat of hundreds of
    messages is fitted with a few dozen encodes, not one per message dropped."""
    class Window:
        context_limit = 2048
        calls = 0

        def encode(self, messages):
            Window.calls += 1
            return engine.encode(messages)

    short = [{"role": role, "content": "w1 w2"} for role in ("user", "assistant") * 4]
    paste = {"role": "user", "content": " ".join(["w3"] * 1500)}
    messages = [*short, paste, {"role": "assistant", "content": "w4"}, {"role": "user", "content": "w5"}]
    over = len(engine.encode(messages)) + 16 - Window.context_limit
    paste["content"] = " ".join(["w3"] * (1500 - over + 5))  # 5 tokens over the window, or about
    fitted, dropped = fit_context(Window(), messages, room=16)
    assert paste in fitted and 0 < dropped <= len(short), dropped
    assert len(engine.encode(fitted)) + 16 <= Window.context_limit
    many = [{"role": role, "content": f"w{index % 9 + 1} w2 w3"} for index, role in enumerate(("user", "assistant") * 300)]
    Window.calls = 0
    fitted, dropped = fit_context(Window(), many, room=16)
    assert len(engine.encode(fitted)) + 16 <= Window.context_limit and fitted[-1] is many[-1]
    assert Window.calls <= 40, Window.calls


def test_a_reply_cut_at_the_window_stays_for_continue(engine):
    """A long pasted message, its reply cut at the context window, then
    "continue": the paste is dropped, and the reply it continues stays (the
    bundled ChatML-style template takes a conversation that starts with a reply)."""
    paste = " ".join(["w1"] * (engine.context_limit - 10))
    messages = [{"role": "user", "content": paste}, {"role": "assistant", "content": "w5 w6 w7"}, {"role": "user", "content": "w8"}]
    fitted, dropped = fit_context(engine, messages, room=16)
    assert dropped == 1 and fitted == messages[1:]
    class Alternating:  # a template that wants a user turn first (as Llama-2's and Mistral's raise)
        context_limit = engine.context_limit

        def encode(self, messages):
            if messages[0]["role"] != "user":
                raise ChatTemplateError("the model's chat template refuses this conversation: roles must alternate")
            return engine.encode(messages)

    assert fit_context(Alternating(), messages, room=16) == (messages[2:], 2)

    class Strict(Alternating):  # and that wants the roles to alternate from there on
        def encode(self, messages):
            turns = [m["role"] for m in messages if m["role"] != "system"]
            if any(a == b for a, b in zip(turns, turns[1:])):
                raise ChatTemplateError("the model's chat template refuses this conversation: roles must alternate")
            return super().encode(messages)

    # a message left without a reply, then the next: read as one turn, and the count dropped is of messages
    left = [{"role": "user", "content": paste}, {"role": "assistant", "content": "w5"}, {"role": "user", "content": "w6"},
            {"role": "user", "content": "w7"}, {"role": "assistant", "content": paste}, {"role": "user", "content": "w8"}]  # fmt: skip
    fitted, dropped = fit_context(Strict(), left, room=16)
    assert fitted == left[5:] and dropped == 5  # four turns, one of them two messages


ALTERNATING = (
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% endfor %}"
) + CHAT_TEMPLATE


def test_a_message_sent_after_one_left_without_a_reply_keeps_the_conversation(handlers, engine, store, monkeypatch):
    """A template that wants roles to alternate (Llama-2's), and a message whose
    reply was interrupted before its first token (the page closed): the next
    message's reply reads both messages as one turn, after the whole chat; the
    template's refusal had dropped everything before them, blaming the context window."""
    monkeypatch.setattr(engine.base.tokenizer, "chat_template", ALTERNATING)
    chat = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    stream = handlers.send("w2", chat, "", *values(max_new_tokens=4))
    chat = next(stream)[2]
    stream.close()
    assert [m["role"] for m in store.load_chat(chat["id"])["messages"]] == ["user", "assistant", "user"]
    prompts = []
    chat_steps = engine.chat
    monkeypatch.setattr(engine, "chat", lambda messages, *args, **kwargs: prompts.append(messages) or chat_steps(messages, *args, **kwargs))
    _, pending, _, chat, _ = handlers.accept("w3", chat, True)  # as Send does: it also resets the Stop the closing set
    updates = list(handlers.send(pending, chat, "", *values(max_new_tokens=4)))
    assert [(m["role"], m["content"]) for m in prompts[0]] == [("user", "w1"), ("assistant", chat["messages"][1]["content"]), ("user", "w2\n\nw3")]
    assert "Dropped" not in updates[-1][3] and len(updates[-1][2]["messages"]) == 5


REFUSES_SYSTEM = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}" + CHAT_TEMPLATE


def test_a_system_prompt_the_model_s_template_refuses_is_named_and_the_message_kept(handlers, engine, store, monkeypatch):
    """A model whose chat template takes no system message (as Gemma-2's): a
    Send with a System prompt is refused in the template's words, the message
    goes back into the box and nothing is saved; without it the chat goes on."""
    monkeypatch.setattr(engine.base.tokenizer, "chat_template", REFUSES_SYSTEM)
    for chat in (new_chat(), list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]):
        before = store.load_chat(chat["id"]) if chat["messages"] else None
        updates = list(handlers.send("w2 w3", chat, "w4", *values(max_new_tokens=4)))
        assert len(updates) == 1, updates
        box, _, shown, notice = updates[0][:4]
        assert box == "w2 w3" and "chat template refuses this conversation: System role not supported." in notice
        saved = store.load_chat(chat["id"])
        assert shown["messages"] == chat["messages"] and (saved and saved["messages"]) == (before and before["messages"])
    regenerated = list(handlers.regenerate(chat, False, "w4", *values(max_new_tokens=4)))
    assert "System role not supported" in regenerated[-1][3] and is_skip(regenerated[-1][0])
    assert regenerated[-1][2]["messages"] == chat["messages"] == store.load_chat(chat["id"])["messages"]
    assert len(list(handlers.send("w2 w3", chat, "", *values(max_new_tokens=4)))[-1][2]["messages"]) == 4


def test_a_message_too_long_for_the_window_leaves_the_last_reply_s_panel(handlers, engine):
    """Refused before its reply starts: the box gets it back, the panel and charts keep the last reply's figures."""
    chat = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    updates = list(handlers.send(" ".join(["w1"] * engine.context_limit), chat, "", *values(max_new_tokens=4)))
    over = len(engine.encode([{"role": "user", "content": " ".join(["w1"] * engine.context_limit)}])) - engine.context_limit + 1
    assert len(updates) == 1 and "context window" in updates[0][3] and f"Shorten the message by at least {over:,} tokens" in updates[0][3]
    assert "new chat" not in updates[0][3]  # the earlier turns are dropped already: a new chat would not help
    assert updates[0][0].startswith("w1 w1") and all(output == gr.skip() for output in updates[0][4:])
    assert updates[0][2]["messages"] == chat["messages"]


def test_a_system_prompt_too_long_for_the_window_is_named(engine):
    from app.chat import overflow_text
    from core.engine import ContextOverflowError

    system = [{"role": "system", "content": " ".join(["w2"] * engine.context_limit)}]
    error = ContextOverflowError("the prompt is too long")
    assert "The system prompt alone is" in overflow_text(engine, system + [{"role": "user", "content": "w1"}], error)
    assert "Shorten the message by at least" in overflow_text(engine, [{"role": "user", "content": "w1 " * 300}], error)
    # a system prompt that fits alone, with a message that fits alone: either may be shortened (the system prompt was blamed)
    half = engine.context_limit // 2 + 10
    both = [{"role": "system", "content": " ".join(["w2"] * half)}, {"role": "user", "content": " ".join(["w1"] * half)}]
    said = overflow_text(engine, both, error)
    assert "Shorten the message or the system prompt" in said and "alone" not in said, said
    over = len(engine.encode(both)) - engine.context_limit + 1
    assert f"by at least {over} tokens in all" in said
    one = [{"role": "user", "content": "w1"}]
    while len(engine.encode(one)) < engine.context_limit:
        one[0]["content"] += " w1"
    assert "by at least 1 token," in overflow_text(engine, one, error)  # not "1 tokens"


def test_older_turns_are_dropped_to_leave_the_reply_its_max_new_tokens(tmp_path, store, monkeypatch):
    """The page dropped turns to leave 64 tokens for the reply whatever Max new
    tokens said, so a reply right after turns were dropped "to fit the context
    window" was cut at the window; now it has its Max new tokens, up to a
    quarter of the window."""
    from app.chat import reply_room
    from models.base import load_base

    base = load_base(str(save_tiny_model(tmp_path / "wide", max_position_embeddings=1024)), dtype="float32")
    engine = Engine(base, random_head(base.model))
    assert engine.context_limit == 1024
    assert reply_room(engine, 200) == 200 and reply_room(engine, 10) == 10 and reply_room(engine, 10**6) == 256
    for name in ("TEXT_INTERVAL", "PANEL_INTERVAL", "PLOT_INTERVAL"):
        monkeypatch.setattr(chat_module, name, 0.0)
    handlers = ChatHandlers(Runtime(engine), store)
    wanted = 200  # more than the 64 kept before
    long_turn = " ".join(["w1"] * 150)
    chat = new_chat()
    dropped = 0
    for _ in range(6):
        chat = list(handlers.send(long_turn, chat, "", *values(max_new_tokens=wanted)))[-1][2]
        stats = chat["messages"][-1]["stats"]
        assert stats["finish_reason"] != "context", stats  # the tiny model writes on to its token limit: "length"
        dropped = max(dropped, stats["settings"].get("context_dropped", 0))
    assert dropped  # the chat outgrew the window


def test_compare_streams_both_panes_then_verdict(engine, monkeypatch):
    monkeypatch.setattr(compare_module, "PANE_INTERVAL", 0.0)
    updates = list(CompareHandlers(Runtime(engine)).compare("w3 w4", True, False, None, *values(max_new_tokens=20)))
    assert any(u[0] and not u[2] for u in updates), "vanilla streams before EAGLE-2 starts"
    vanilla, eagle, eagle2, verdict = updates[-1]
    assert vanilla and eagle and eagle2
    assert "identical to vanilla" in verdict and "verdict-eagle2-tps" in verdict
    assert "too short to time well" in verdict  # 20 tokens at most
    # the way to longer replies: the token limit where the shortest reply reached it, else a prompt that asks for more
    from app.compare import verdict_html

    def short(finish_reason: str) -> Reply:
        return Reply(snapshot=Snapshot(5, 2, 0.1, 0.01, 50.0, 2.5, 0.0, 0.0, ()), finish_reason=finish_reason)

    ended = verdict_html({"vanilla": short("stop"), "eagle2": short("stop")}, True)
    assert "ask for a longer answer (this one ended on its own)" in ended and "Max new tokens" not in ended
    assert "let the replies run longer (Max new tokens)" in verdict_html({"vanilla": short("length"), "eagle2": short("length")}, True)
    cut = verdict_html({"vanilla": short("context"), "eagle2": short("context")}, True)  # a longer answer would not fit
    assert "use a shorter prompt (this one leaves little room in the context window)" in cut and "longer answer" not in cut
    verdict = list(CompareHandlers(Runtime(engine)).compare("w3 w4", False, False, None, *values(max_new_tokens=60)))[-1][3]
    tokens = [int(n) for n in re.findall(r'-tau">[^<]*</td><td class="value">(\d+)</td>', verdict)]
    assert len(tokens) == 2 and ("too short" in verdict) == (min(tokens) < compare_module.SHORT_REPLY)
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2 and first_difference([1], [1]) is None


def test_a_finished_reply_leaves_the_shared_cancel_signal_alone(engine):
    """A browser session's decodings share one cancel event: a reply that ended
    by itself must not set it on the way out, or the next decoding starts cancelled."""
    runtime = Runtime(engine)
    cancel = runtime.cancel_event(None)
    cancel.clear()
    messages = [{"role": "user", "content": "w3 w4"}]
    sampling = SamplingParams(max_new_tokens=6)
    for mode in ("vanilla", "eagle2"):
        replies = list(follow_reply(runtime.queue, engine, messages, mode, sampling, TreeParams(), cancel))
        assert replies[-1].finish_reason in ("stop", "length") and not cancel.is_set()
    replies = follow_reply(runtime.queue, engine, messages, "vanilla", SamplingParams(max_new_tokens=200), TreeParams(), cancel)
    assert next(replies).finish_reason is None
    replies.close()  # a reader that goes away mid-reply still cancels it
    assert cancel.is_set()
    with runtime.queue.turn():  # the cancelled decoding has left the model
        pass


def no_progress(*args, **kwargs):
    pass


def test_a_reply_closed_while_its_long_prompt_is_read_is_cancelled(engine, monkeypatch):
    import core.engine

    monkeypatch.setattr(core.engine, "PREFILL_CHUNK", 4)
    read = core.engine._Run._read
    monkeypatch.setattr(core.engine._Run, "_read", lambda run, start, end: (time.sleep(0.05), read(run, start, end))[1])
    runtime = Runtime(engine)
    cancel = runtime.cancel_event("reading")
    cancel.clear()
    messages = [{"role": "user", "content": " ".join(["w3"] * 60)}]
    replies = follow_reply(runtime.queue, engine, messages, "vanilla", SamplingParams(max_new_tokens=200), TreeParams(), cancel)
    assert next(replies).reading is not None
    replies.close()  # the page went away
    assert cancel.is_set()
    with runtime.queue.turn():  # the decoding has left the model
        pass


def test_benchmark_button(engine, tmp_path):
    pytest.importorskip("core.bench")
    table, chart, result, notice = CompareHandlers(Runtime(engine)).benchmark(
        None, 1, False, None, *values(max_new_tokens=8), progress=no_progress
    )
    assert "identical to vanilla on 100%" in notice and list(table["mode"]) == ["vanilla", "EAGLE-2"]
    assert set(result["modes"]) == {"vanilla", "eagle2"} and len(chart) == 2
    upload = tmp_path / "0123456789abcdef" / "mine.jsonl"  # as Gradio keeps an upload: under a folder of its own
    upload.parent.mkdir()
    upload.write_text('{"turns": ["w1"]}\n{"turns": [\n')
    *_, notice = CompareHandlers(Runtime(engine)).benchmark(str(upload), 1, False, None, *values(max_new_tokens=8), progress=no_progress)
    assert notice.startswith("mine.jsonl:2: not valid JSON") and "0123456789abcdef" not in notice
    upload.write_text('{"turns": ["w1"]}\n')
    *_, notice = CompareHandlers(Runtime(engine)).benchmark(str(upload), 3, False, None, *values(max_new_tokens=8), progress=no_progress)
    assert "of the prompts. The file holds 1 prompt; it was run." in notice
    # the engine answered the runs before: its planner sized this run's first trees from them, and the notice says so
    assert re.search(r"run\. EAGLE-2's tree planner had learnt from \d+ verified draft nodes and \d+ timed drafts of earlier replies before this run\.$", notice)
    elsewhere = Path(tempfile.mkdtemp()) / "elsewhere.jsonl"  # named by a client, never uploaded: not read
    elsewhere.write_text('{"turns": ["w1"]}\n')
    *_, notice = CompareHandlers(Runtime(engine)).benchmark(str(elsewhere), 1, False, None, *values(max_new_tokens=8), progress=no_progress)
    assert "elsewhere.jsonl was not uploaded through the page" in notice


def test_gradio_s_copies_of_uploads_and_exports_are_kept_in_a_folder_of_the_user_s_own(tmp_path, monkeypatch):
    """Not /tmp/gradio, where Gradio's copies kept their 0644 mode in folders
    any user of the machine could open."""
    from app import uploads

    monkeypatch.setenv("KESTREL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("GRADIO_TEMP_DIR")
    folder = tmp_path / "cache" / uploads.FOLDER
    (folder / "old").mkdir(parents=True)  # a killed process's copies: gone at the next start, a day on
    (folder / "old" / "chat.json").write_text("{}")
    (folder / "new.json").write_text("{}")
    os.utime(folder / "old", (time.time() - 2 * 86400,) * 2)
    uploads.keep_private()
    assert sorted(entry.name for entry in folder.iterdir()) == ["new.json"]
    assert os.environ["GRADIO_TEMP_DIR"] == str(folder) and stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert uploads.uploaded(folder / "abc" / "chat.json") and not uploads.uploaded(tmp_path / "chat.json")
    assert not uploads.uploaded(folder / ".." / "chat.json")
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "mine"))  # the user's own choice stands
    uploads.keep_private()
    assert os.environ["GRADIO_TEMP_DIR"] == str(tmp_path / "mine")


def tab(name: str) -> SimpleNamespace:
    """A browser tab as a handler sees it: Gradio's request, with the tab's session."""
    return SimpleNamespace(session_hash=name)


def test_compare_stop_and_chat_stop_each_stop_their_own(handlers, engine, monkeypatch):
    """The Compare tab's Stop ends its comparison or benchmark, never the chat's
    reply nor another browser tab's comparison, and the chat's Stop never a comparison."""
    monkeypatch.setattr(compare_module, "PANE_INTERVAL", 0.0)
    compare = CompareHandlers(handlers.runtime)
    chat, mine, other = new_chat(), tab("mine"), tab("other")
    reply = handlers.send("w1", chat, "", *values(max_new_tokens=200, mode="vanilla"))
    next(reply), next(reply)
    compare.stop(mine)
    assert list(reply)[-1][2]["messages"][-1]["stats"]["finish_reason"] != "cancelled"
    assert compare.arm(mine) == ("", "", "", "Waiting for the model...", False)
    runs = compare.compare("w3 w4", False, False, mine, *values(max_new_tokens=200))
    next(runs), next(runs)
    handlers.stop(chat)
    compare.stop(other)
    assert "verdict-eagle2-tps" in list(runs)[-1][3]
    compare.arm(mine)
    runs = compare.compare("w3 w4", False, False, mine, *values(max_new_tokens=200))
    next(runs), next(runs)
    # a second press while the first runs: refused, saying so (the page would not send its run, and arming it
    # again had released a Stop pressed for the first); the first run goes on, and Stop still ends it
    again = compare.arm(mine)
    assert all(is_skip(pane) for pane in again[:3]) and "still running or waiting" in again[3]
    compare.stop(mine)
    assert list(runs)[-1][3] == "Stopped."
    assert compare.arm(mine) == ("", "", "", "Waiting for the model...", False)  # taken again once it has ended
    list(compare.compare("w3 w4", False, False, mine, *values(max_new_tokens=2)))


def test_stop_pressed_while_a_comparison_waits_for_the_model_applies(engine):
    """Stop between the click (arm) and the run's turn: the run must not start
    with the signal released, in the comparison and in the benchmark."""
    compare = CompareHandlers(Runtime(engine))
    assert all(is_skip(update) for update in compare.stop(tab("mine")))  # nothing to stop: nothing said
    compare.arm(tab("mine"))
    verdict, bench_notice = compare.stop(tab("mine"))
    assert verdict == "Stopping..." and is_skip(bench_notice)  # said at once, not when the turn would come
    updates = list(compare.compare("w4 w5", False, False, tab("mine"), *values(max_new_tokens=200)))
    assert updates[-1][3] == "Stopped." and not any(update[0] for update in updates)  # not even the first token
    # a comparison stopped while it waits stays stopped when the benchmark is pressed next (they shared one signal)
    compare.arm(tab("mine"))
    compare.stop(tab("mine"))
    compare.arm_benchmark(tab("mine"))
    assert list(compare.compare("w4 w5", False, False, tab("mine"), *values(max_new_tokens=200)))[-1][3] == "Stopped."
    compare.benchmark(None, 1, False, tab("mine"), *values(max_new_tokens=8), progress=no_progress)
    # a tab closed while its comparison waits: it never runs
    compare.arm(tab("closed"))
    compare.forget(tab("closed"))
    assert list(compare.compare("w4 w5", False, False, tab("closed"), *values(max_new_tokens=200)))[-1][3] == "Stopped."
    signals = len(compare.runtime._cancels)
    compare.forget(tab("never-compared"))  # a tab that began nothing here: no signal kept for it
    assert len(compare.runtime._cancels) == signals and not compare.pending
    compare.arm_benchmark(tab("stopping"))  # Ctrl+C on the server stops a benchmark on or waiting
    compare.runtime.stopping()
    assert compare.benchmark(None, 1, False, tab("stopping"), *values(max_new_tokens=8), progress=no_progress)[3] == "Stopped before the benchmark started."
    assert compare.arm_benchmark(tab("mine")) == (None, None, None, "", False)  # its progress bar says the rest
    assert compare.stop(tab("mine"))[1] == "Stopping..."
    assert compare.benchmark(None, 1, False, tab("mine"), *values(max_new_tokens=8), progress=no_progress) == (
        None, None, None, "Stopped before the benchmark started."
    )  # fmt: skip


def test_compare_pressed_as_the_last_comparison_ends_runs_and_leaves_the_tab_free(engine, tmp_path, monkeypatch):
    """Compare pressed in the moment between a comparison's end on the server
    (its mark let go) and the page's word of that end: arm takes the press while
    the page still counts the last run as pending, and Gradio's page drops a
    run pending already where its event's trigger_mode is "once". That press's
    run must come all the same: a mark left for a run that never came refused
    every later press as still running. A press refused during a run sends a
    run too, which does nothing. The page is played here from the app's own
    wiring: arm's outputs shown, then the run with the inputs the page holds."""
    from gradio.helpers import special_args

    from app.ui import build_app

    monkeypatch.setattr(compare_module, "PANE_INTERVAL", 0.0)
    demo = build_app(Runtime(engine), tmp_path / "data")
    arm, run = (next(event for event in demo.fns.values() if getattr(event.fn, "__name__", "") == name) for name in ("arm", "compare"))
    shown = {block._id: block.value for block in run.inputs}  # what the page holds: as built, then as typed and set
    shown.update(zip((block._id for block in run.inputs[-len(SETTINGS):]), values(max_new_tokens=4)))
    shown[run.inputs[0]._id] = "w3 w4"
    mine, verdict = tab("mine"), arm.outputs[3]._id

    def press(last_run_pending: bool):
        """Compare pressed: arm's outputs shown, then the updates of the run the page sends (none where it drops it)."""
        for block, value in zip(arm.outputs, arm.fn(mine)):
            if not is_skip(value):
                shown[block._id] = value
        if last_run_pending and run.trigger_mode == "once":
            return iter(())
        return run.fn(*special_args(run.fn, [shown[block._id] for block in run.inputs], mine)[0])

    assert "verdict-eagle2-tps" in list(press(last_run_pending=False))[-1][3]  # the generator has ended: its mark is let go
    second = list(press(last_run_pending=True))  # the page has not heard of that end yet
    assert shown[verdict] == "Waiting for the model..."
    third = press(last_run_pending=False)
    assert shown[verdict] == "Waiting for the model..."  # not refused as still running
    assert "verdict-eagle2-tps" in second[-1][3]
    next(third)
    refused = press(last_run_pending=True)
    assert "still running" in shown[verdict]
    assert all(is_skip(pane) for update in refused for pane in update)  # it does nothing, and the first run goes on
    assert "verdict-eagle2-tps" in list(third)[-1][3]
    fourth = press(last_run_pending=False)
    assert shown[verdict] == "Waiting for the model..." and "verdict-eagle2-tps" in list(fourth)[-1][3]


def test_compare_with_sampling_uses_one_seed_for_every_mode(engine, monkeypatch):
    """Seed -1 (random): one seed is drawn per comparison, used by every mode and shown."""
    import app.reply

    seeds = []

    def follow(queue, engine, messages, mode, sampling, *rest, **options):
        seeds.append(sampling.seed)
        yield from app.reply.follow_reply(queue, engine, messages, mode, sampling, *rest, **options)

    monkeypatch.setattr(compare_module, "follow_reply", follow)
    compare = CompareHandlers(Runtime(engine))
    verdict = list(compare.compare("w3 w4", True, False, None, *values(max_new_tokens=6, temperature=0.8, seed=-1)))[-1][3]
    assert len(seeds) == 3 and len(set(seeds)) == 1 and seeds[0] is not None
    assert f"Sampled with seed {seeds[0]} in every mode" in verdict and "EAGLE-2 output is identical to vanilla" in verdict
    *_, notice = compare.benchmark(None, 1, False, None, *values(max_new_tokens=6, temperature=0.8, seed=-1), progress=no_progress)
    assert notice.startswith("Sampled with seed ") and "the same for every prompt and mode. EAGLE-2 output identical to vanilla on 100% of the prompts." in notice


def test_compare_names_why_speculation_is_off(engine, tiny_base, monkeypatch):
    """A head is loaded but the model refuses speculation: say why, not 'needs a
    draft head'; and an error clears the last comparison's results."""
    compare = CompareHandlers(Runtime(engine))
    monkeypatch.setattr(type(engine), "speculation_problem", lambda self: "speculative decoding does not support sliding-window attention (mistral)")
    message = "Comparing needs speculative decoding, which is off for this model (speculative decoding does not support sliding-window attention (mistral))."
    assert list(compare.compare("w3 w4", False, False, None, *values()))[-1] == ("", "", "", message)
    *cleared, notice = compare.benchmark(None, 1, False, None, *values(), progress=no_progress)
    assert cleared == [None, None, None] and "off for this model (speculative decoding does not support sliding-window" in notice
    monkeypatch.undo()
    compare = CompareHandlers(Runtime(Engine(tiny_base)))
    assert list(compare.compare("w3 w4", False, False, None, *values()))[-1][3] == "Comparing needs a draft head; load a model with one in the Models tab."


def vanilla_held_after_its_first_step(engine, monkeypatch, go_on: threading.Event) -> list[str]:
    """engine.chat, with vanilla holding the model after its first step until
    `go_on` is set; returns the modes it is asked for, as they are."""
    chat_steps, modes = engine.chat, []

    def held(messages, mode, *args, **kwargs):
        modes.append(mode)
        for step in chat_steps(messages, mode, *args, **kwargs):
            yield step
            if mode == "vanilla":
                go_on.wait(10)

    monkeypatch.setattr(engine, "chat", held)
    return modes


def in_queue_after(runtime: Runtime, action) -> threading.Event:
    """Run `action` on a thread in a turn of the model's own, as the Models tab
    runs Unload and Load; returns once it waits in the queue, with the event it sets when done."""
    entered, done = threading.Event(), threading.Event()

    def run():
        ticket = runtime.queue.enter()
        entered.set()
        runtime.queue.wait(ticket)
        try:
            action()
        finally:
            runtime.queue.leave()
            done.set()

    threading.Thread(target=run, daemon=True).start()
    entered.wait(10)
    return done


def test_compare_stops_where_the_model_was_unloaded_or_replaced_meanwhile(engine, tiny_base, monkeypatch):
    """Each mode, and the margin pass, waits for a turn of its own, and the Models
    tab's Unload or Load can take one in between: the comparison stops there and
    says so, with the panes so far, as a Stop does; it runs nothing more on the
    model it started with, and gives no verdict for a model no longer loaded."""
    import app.reply

    monkeypatch.setattr(compare_module, "PANE_INTERVAL", 0.0)
    runtime = Runtime(engine)
    go_on = threading.Event()
    modes = vanilla_held_after_its_first_step(engine, monkeypatch, go_on)
    runs = CompareHandlers(runtime).compare("w3 w4", False, False, None, *values(max_new_tokens=20))
    next(runs), next(runs)  # vanilla runs
    in_queue_after(runtime, runtime.unload)  # Unload pressed
    go_on.set()
    vanilla, eagle, eagle2, verdict = list(runs)[-1]
    assert runtime.engine is None and modes == ["vanilla"]  # EAGLE-2 never ran on the unloaded model
    assert vanilla and not eagle2 and verdict.startswith("The model (") and verdict.endswith(
        " was unloaded during the comparison; press Compare again."
    )  # fmt: skip
    # replaced (another model loaded) as EAGLE-2 ends, with greedy replies that part: no margin pass on the old one
    monkeypatch.undo()
    monkeypatch.setattr(compare_module, "PANE_INTERVAL", 0.0)
    runtime = Runtime(engine)
    other = Engine(tiny_base)

    def follow(queue, engine, messages, mode, *rest, **options):
        for reply in app.reply.follow_reply(queue, engine, messages, mode, *rest, **options):
            if mode == "eagle2" and reply.finish_reason is not None:
                reply.token_ids[2] = (reply.token_ids[2] + 1) % 60 + 8
                in_queue_after(runtime, lambda: runtime.replace(lambda: other)).wait(10)
            yield reply

    monkeypatch.setattr(compare_module, "follow_reply", follow)
    margins = []
    monkeypatch.setattr(type(engine), "next_token_margin", lambda self, ids: margins.append(ids) or 0.0)
    vanilla, eagle, eagle2, verdict = list(CompareHandlers(runtime).compare("w3 w4", False, False, None, *values(max_new_tokens=8)))[-1]
    assert runtime.engine is other and not margins
    assert vanilla and eagle2 and "was replaced by " in verdict and verdict.endswith(" during the comparison; press Compare again.")


def test_a_chat_reply_waiting_behind_unload_or_load_never_runs_on_the_model_they_let_go(engine, tiny_base, store, monkeypatch):
    """Send or Regenerate pressed while another reply holds the model and the
    Models tab's Unload or Load waits for its turn before it: the reply's turn
    comes after theirs, and it must not decode on the model unloaded (keeping it
    in memory) or replaced (two models held); it is refused as a Send that
    cannot run is, its message back in the box, and says why."""
    monkeypatch.setattr(chat_module, "TEXT_INTERVAL", 0.0)
    decoded = []
    chat_steps = engine.chat
    monkeypatch.setattr(engine, "chat", lambda *args, **kwargs: decoded.append(args) or chat_steps(*args, **kwargs))
    runtime = Runtime(engine)
    handlers = ChatHandlers(runtime, store)
    _, pending, _, chat, _ = handlers.accept("w1 w2", new_chat(), True)
    with runtime.queue.turn():  # tab 1's reply
        unloaded = in_queue_after(runtime, runtime.unload)  # Unload pressed
        updates = handlers.send(pending, chat, "", *values(max_new_tokens=8))  # tab 2's Send
        next(updates)
    final = list(updates)[-1]
    assert unloaded.wait(10) and runtime.engine is None and not decoded
    assert final[0] == "w1 w2" and final[2]["messages"] == [] and store.load_chat(chat["id"]) is None
    assert final[3] == chat_module.notice_html(f"The model ({engine.base.name}) was unloaded while the reply waited for its turn; send it again.")
    # another model loaded while a regeneration waits: the reply it would replace stays
    runtime = Runtime(engine)
    handlers = ChatHandlers(runtime, store)
    chat = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    decoded.clear()
    assert handlers.check_idle(chat)[1] is False
    with runtime.queue.turn():
        loaded = in_queue_after(runtime, lambda: runtime.replace(lambda: Engine(tiny_base), "another model"))
        updates = handlers.regenerate(chat, False, "", *values(max_new_tokens=8))
        next(updates)
    final = list(updates)[-1]
    assert loaded.wait(10) and runtime.engine is not engine and not decoded
    assert final[2]["messages"] == chat["messages"] and store.load_chat(chat["id"])["messages"] == chat["messages"]
    name = engine.base.name  # the other model is the same one, loaded again
    assert final[3] == chat_module.notice_html(f"The model ({name}) was replaced by {name} while the reply waited for its turn; press Regenerate again.")


def test_stop_signals_are_let_go_as_replies_end_and_tabs_close(handlers):
    """One Stop signal per chat ever sent and per tab that compared, kept for
    good, added up: each goes as its reply or run ends, or as its tab closes
    (with the token of a message accepted whose send never came)."""
    runtime = handlers.runtime
    compare = CompareHandlers(runtime)

    def one_tab(name: str) -> None:
        _, pending, _, chat, _ = handlers.accept("w1 w2", None, True, "", request=tab(name))
        chat = list(handlers.send(pending, chat, "", *values(max_new_tokens=2)))[-1][2]
        handlers.stop(chat)  # nothing running: nothing kept
        handlers.check_idle(chat, tab(name))
        list(handlers.regenerate(chat, False, "", *values(max_new_tokens=2)))
        handlers.accept("w3", chat, True, "", request=tab(name))  # closed before its send came
        compare.arm(tab(name))
        list(compare.compare("w3 w4", False, False, tab(name), *values(max_new_tokens=2)))
        compare.stop(tab(name))
        compare.arm_benchmark(tab(name))  # closed while its run waits: the run still comes, stopped, and lets go
        compare.forget(tab(name))
        handlers.forget_session(tab(name))
        assert compare.benchmark(None, 1, False, tab(name), *values(max_new_tokens=2), progress=no_progress)[3] == (
            "Stopped before the benchmark started."
        )  # fmt: skip

    for name in ("tab-1", "tab-2", "tab-3"):
        one_tab(name)
    assert runtime._cancels == {} and handlers.unsent == {} and not compare.pending
    # a Stop during a reply still ends it
    stream = handlers.send("w1", new_chat(), "", *values(max_new_tokens=200, mode="vanilla"))
    writing = next(stream)[2]
    next(stream)
    assert "Stopping..." in handlers.stop(writing)
    assert list(stream)[-1][2]["messages"][-1]["stats"]["finish_reason"] == "cancelled" and runtime._cancels == {}


def test_compare_says_it_waits_for_the_model_until_each_turn_comes(engine, monkeypatch):
    """Another tab's reply or an API request holding the model, or waiting for it
    first: the verdict line says so until the mode's (or the margin pass's) turn
    comes, as the Chat tab and the benchmark say, then what runs."""
    import app.reply

    monkeypatch.setattr(compare_module, "PANE_INTERVAL", 0.0)
    runtime = Runtime(engine)
    release = threading.Event()

    def follow(queue, engine, messages, mode, *rest, **options):  # another request comes in as each mode ends
        for reply in app.reply.follow_reply(queue, engine, messages, mode, *rest, **options):
            if reply.finish_reason is not None:
                if mode == "eagle2":
                    reply.token_ids[2] = (reply.token_ids[2] + 1) % 60 + 8  # greedy replies that part: the margin pass follows
                release.clear()
                in_queue_after(runtime, lambda: release.wait(10))
            yield reply

    monkeypatch.setattr(compare_module, "follow_reply", follow)
    runs = CompareHandlers(runtime).compare("w3 w4", False, False, None, *values(max_new_tokens=8))
    with runtime.queue.turn():  # another request holds the model
        statuses = [next(runs)[3]]
    for *panes, status in runs:
        statuses.append(status)
        if status == "Waiting for the model...":
            release.set()  # the other request ends
    said = [status for at, status in enumerate(statuses) if at == 0 or status != statuses[at - 1]]
    waiting = "Waiting for the model..."
    assert said[:-1] == [waiting, "Running vanilla...", waiting, "Running EAGLE-2...", waiting], said
    assert "margin there is" in said[-1]  # measured once its turn came


def test_stop_as_the_verdict_goes_out_leaves_it(engine, monkeypatch):
    """Stop pressed after the comparison's last update was sent, before its run
    has ended here: nothing is left to stop, and the verdict stays (no "Stopping..."
    over it for good)."""
    monkeypatch.setattr(compare_module, "PANE_INTERVAL", 0.0)
    compare, mine = CompareHandlers(Runtime(engine)), tab("mine")
    compare.arm(mine)
    runs = compare.compare("w3 w4", False, False, mine, *values(max_new_tokens=8))
    verdict = next(update for update in runs if "verdict-eagle2-tps" in update[3])[3]
    assert all(is_skip(update) for update in compare.stop(mine))
    assert list(runs) == [] and not compare.pending and "identical to vanilla" in verdict


def test_benchmark_stops_with_the_prompts_it_finished(engine, tmp_path, monkeypatch):
    import core.bench

    handlers = CompareHandlers(Runtime(engine))
    mine = tab("mine")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [f"w{i} w{i + 1}"]}) for i in range(1, 6)), encoding="utf-8-sig")
    run_once = core.bench.run_once
    calls = []

    def counted(*args, **kwargs):  # Stop pressed during the third prompt's EAGLE-2 run
        calls.append(1)
        if len(calls) == 2 + 6:  # after the warm-up's two runs
            handlers.stop(mine)
        return run_once(*args, **kwargs)

    monkeypatch.setattr(core.bench, "run_once", counted)
    handlers.arm_benchmark(mine)
    table, _, result, notice = handlers.benchmark(str(prompts), 5, False, mine, *values(max_new_tokens=8), progress=no_progress)
    # the engine had answered before (this module's engine): a stopped run's notice says so too
    assert re.fullmatch(r"Stopped: the figures are those of the first 2 of 5 prompts\.( EAGLE-2's tree planner had learnt from .+ of "
                        r"earlier replies before this run\.)?", notice)  # fmt: skip
    assert ("tree planner had learnt" in notice) == any(result["summary"]["planner_learned"]["before_warmup"]["eagle2"].values())
    assert result["complete"] is False and len(result["prompts"]) == 4 and len(table) == 2
    monkeypatch.setattr(core.bench, "run_once", run_once)
    handlers.arm_benchmark(mine)
    table, _, result, notice = handlers.benchmark(str(prompts), 5, False, mine, *values(max_new_tokens=8), progress=no_progress)
    assert result["complete"] and len(result["prompts"]) == 10  # a new run starts with Stop released

    prompts.write_text(json.dumps({"turns": ["w1"]}) + "\n" + json.dumps({"id": "long", "turns": [" ".join(["w2"] * 300)]}))
    *_, notice = handlers.benchmark(str(prompts), 5, False, mine, *values(max_new_tokens=8), progress=no_progress)
    assert notice.startswith("prompt long: ") and "context window is 256" in notice


def test_a_message_sent_while_the_model_runs_something_else_says_it_waits(handlers):
    """A comparison, the benchmark or an API request holds the model (running,
    not waiting): a message sent meanwhile says that it waits for the model."""
    with handlers.runtime.queue.turn():
        notice = handlers.accept("w1", new_chat(), True)[-1]
    assert "Waiting for the model" in notice
    assert "Waiting for the model" not in handlers.accept("w1", new_chat(), True)[-1]


def test_an_exported_chat_is_imported_as_a_chat_of_its_own_and_shown(handlers, store, tmp_path):
    chat = list(handlers.send("w1", new_chat(), "w2", *values(max_new_tokens=4)))[-1][2]
    chat = handlers.rename("my chat", chat)[0]
    (_, exported), _ = handlers.export(chat)
    # only a file uploaded through the page: Gradio checks no path a client names in an app it did not launch
    refused = handlers.import_chat(exported, new_chat(), True)
    assert refused[-1] == chat_module.notice_html(f"{Path(exported).name} was not uploaded through the page; nothing was imported.")
    assert len(store.list_chats()) == 1
    data = str(tmp_path / Path(exported).name)  # as Gradio keeps an upload
    shutil.copy(exported, data)
    # its own id is taken (the chat is still saved here): a new one, and the saved chat is left as it is
    shown, imported, system, stats, _, _, listed, notice = handlers.import_chat(data, new_chat(), True)
    assert imported["id"] != chat["id"] and imported["messages"] == store.load_chat(chat["id"])["messages"]
    assert imported["name"] == "my chat" and system == "w2" and 'Imported chat-' in notice and '&quot;my chat&quot;' in notice
    assert listed["value"] == imported["id"] and store.load_chat(imported["id"])["messages"] == imported["messages"]
    assert shown == chat_module.display(imported, True) and "tau" in stats
    assert store.load_chat(chat["id"])["name"] == "my chat" and len(store.list_chats()) == 2
    # its id free (deleted here, or another computer's): kept
    store.delete_chat(chat["id"])
    assert handlers.import_chat(data, new_chat(), True)[1]["id"] == chat["id"]
    # while this tab's reply is written: saved, not shown
    handlers.replying[imported["id"]] = True
    outputs = handlers.import_chat(data, imported, True)
    assert outputs[0] == gr.skip() and outputs[1] is imported and "once this reply ends" in outputs[-1]
    assert store.load_settings()["open_chat"] == chat["id"]  # a next page load opens the chat it opened before
    assert len(store.list_chats()) == 3
    del handlers.replying[imported["id"]]
    # files that are not a chat's export: named, nothing saved
    bad = tmp_path / "bad.json"
    for text, said in [("{", "not valid JSON"), ("[1]", "a JSON object is expected"), ('{"messages": [{"role": "tool", "content": "x"}]}', "message 1 has the role"),
                       ('{"messages": []}', "without messages"), ("\xff", "not UTF-8")]:  # fmt: skip
        bad.write_bytes(text.encode("latin-1"))
        notice = handlers.import_chat(str(bad), imported, True)[-1]
        assert said in notice and "bad.json" in notice and "nothing was imported" in notice, notice
    assert len(store.list_chats()) == 3
    assert handlers.import_chat(None, imported, True) == (gr.skip(),) * 8
    with bad.open("wb") as file:  # larger than any chat's export: refused before it is read
        file.truncate(chat_module.IMPORT_LIMIT + 1)
    assert "bad.json is larger than a chat" in handlers.import_chat(str(bad), imported, True)[-1]
    # what a file from elsewhere may hold: ids that are not this app's, numbers too large for a float, the page's own state
    saved = json.loads(Path(data).read_text())
    ids = ["x" * 300, "../x", "C:x", 123, "\u0662" * 8 + "-123456-abcdef", imported["id"]]
    handlers.replying["20261130-000000-abcdef"] = True  # a chat of this app's being written, not saved yet: its id is taken
    ids.append("20261130-000000-abcdef")
    for odd in ids:
        bad.write_text(json.dumps({**saved, "id": odd}))
        _, shown, *_, notice = handlers.import_chat(str(bad), new_chat(), True)
        assert shown["id"] not in (odd, saved["id"]) and "Imported bad.json" in notice, (odd, notice)
    del handlers.replying["20261130-000000-abcdef"]
    huge = {**saved, "id": "", "session": {"tokens": 10**400, "forwards": 1}, "taken_back": 1, "name": "n" * 101}
    huge["messages"] = [*saved["messages"][:-1], {**saved["messages"][-1], "stats": {**saved["messages"][-1]["stats"], "tokens": 10**400}}]
    bad.write_text(json.dumps(huge))
    _, shown, _, stats, _, _, _, notice = handlers.import_chat(str(bad), new_chat(), True)
    assert shown["session"] == {"tokens": 0, "forwards": 0} and "taken_back" not in shown and "name" not in shown
    assert "Imported bad.json" in notice and handlers.restore()  # the chat opened at the next page load shows too
    final = list(handlers.send("w5", shown, "", *values(max_new_tokens=2)))[-1]  # and goes on
    assert final[2]["messages"][-2]["content"] == "w5" and store.load_chat(shown["id"])["messages"] == final[2]["messages"]


def test_export_markdown_and_json(handlers):
    chat = list(handlers.send("w1", new_chat(), "w2", *values(max_new_tokens=4)))[-1][2]
    (markdown, data), notice = handlers.export(chat)
    assert notice == ""
    assert "**User:**" in open(markdown).read()
    assert json.loads(open(data).read())["messages"] == chat["messages"]
    other = list(handlers.send("w3", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    again, _ = handlers.export(other)
    assert Path(again[0]).parent == Path(markdown).parent and Path(again[0]).name != Path(markdown).name
    folder = Path(markdown).parent
    handlers.exports.cleanup()  # what happens when the app ends
    assert not folder.exists()
    (markdown, data), _ = handlers.export(chat)  # a folder removed under a running app is made again
    assert json.loads(open(data).read())["messages"] == chat["messages"]
    files, notice = handlers.export(new_chat())  # nothing to export: said, not silent
    assert files == gr.skip() and "nothing to export yet" in notice
    assert handlers.exports_of([markdown, data], chat) == gr.skip() and handlers.exports_of([markdown, data], other) is None
    assert handlers.exports_of([markdown, data], None) is None and handlers.exports_of(None, other) == gr.skip()
    listed = handlers.listed(other)  # the chat shown is ticked in Saved chats; a new one, not saved, is not
    assert listed["value"] == other["id"] and other["id"] in [chat_id for _, chat_id in listed["choices"]]
    assert handlers.listed(new_chat())["value"] is None
    handlers.replying[chat["id"]] = True  # its next reply on its way: the files would lack it
    files, notice = handlers.export(chat)
    assert files == gr.skip() and "A reply is being written" in notice
    del handlers.replying[chat["id"]]
    assert "no message to edit yet" in handlers.edit_last(new_chat(), True)[3]
    Path(markdown).unlink()
    Path(markdown).mkdir()  # a file that cannot be written: named, no traceback
    files, notice = handlers.export(chat)
    assert files == gr.skip() and "could not be exported" in notice and "still saved" in notice


def test_the_markdown_export_keeps_each_message_to_itself():
    """Read by a CommonMark reader, the export names who said what: each
    message is a block quote, so a code block, HTML block or list it leaves
    open ends with it, and a line typed like a role label stays inside it."""
    from markdown_it import MarkdownIt

    chat = new_chat("**User:**")
    contents = [
        "```python\nprint('unclosed')\n\n**Assistant:**\n\nI am a fake label",
        "1. Run:\n   ```bash\n   pip install x",  # a reply cut inside a list item's code block
        "  **User:**\r\n\r\n__Assistant:__\rcrlf\n<pre>\n\n**User:**",
        "- a\n  ```\n  code\n\nb\n\n**User:**\n<!-- open",
    ]
    chat["messages"] = [{"role": ("user", "assistant")[i % 2], "content": text} for i, text in enumerate(contents)]
    tokens = MarkdownIt("commonmark").parse(store_module.to_markdown(chat))
    top = [token.content for token in tokens if token.type == "inline" and token.level == 1]  # outside every quote
    assert top == [store_module.chat_title(chat), "**System:**", "**User:**", "**Assistant:**", "**User:**", "**Assistant:**"]
    code = [token.content for token in tokens if token.type == "fence"]
    assert code[0] == "print('unclosed')\n\n**Assistant:**\n\nI am a fake label\n" and code[1] == "pip install x\n"


def test_the_markdown_export_shows_markup_as_text_as_the_page_does():
    """Tags in prose are text on the page; in the export too, for viewers that
    render HTML (a <style> rule there could hide the whole document). Code and
    a comparison's "<" stay as written."""
    from markdown_it import MarkdownIt

    chat = new_chat("<b>system</b>")
    chat["messages"] = [
        {"role": "user", "content": "<script>alert(1)</script> hi <style>body{display:none}</style> <!-- x"},
        {"role": "assistant", "content": "Use `<div>` here:\n\n```html\n<div>a</div>\n```\n\nand a < b, <https://example.com>."},
    ]
    exported = store_module.to_markdown(chat)
    tokens = MarkdownIt("commonmark").parse(exported)
    inline = [child for token in tokens if token.children for child in token.children]
    assert not [t for t in [*tokens, *inline] if t.type in ("html_block", "html_inline")], exported
    # fences markdown may not read as found (indented 4 spaces, a backtick in the info string, a lone \r), and a
    # comment or instruction that an address's characters follow: text too
    for odd in ("    ```\n<style>x</style>\n```", "```a`b\n<style>x</style>\n```", "```x\r```\n<style>x</style>",
                "<!--a@b>\n\nrest", "<?x@y>", "`<!-- x` <b>y</b>"):
        blocks = MarkdownIt("commonmark").parse(store_module.to_markdown({**chat, "messages": [{"role": "user", "content": odd}]}))
        found = [*blocks, *(child for block in blocks if block.children for child in block.children)]
        assert not [t for t in found if t.type in ("html_block", "html_inline")], odd
    blocks = MarkdownIt("commonmark").parse(store_module.to_markdown({**chat, "messages": [{"role": "user", "content": "To <a@b.org>."}]}))
    assert any(child.type == "link_open" for block in blocks if block.children for child in block.children)
    assert "`<div>`" in exported and "```html\n> <div>a</div>" in exported and "a < b" in exported
    assert [t.attrs["href"] for t in inline if t.type == "link_open"] == ["https://example.com"]  # an autolink stays one
    assert exported.startswith("# &lt;script>alert(1)&lt;/script>")


def test_the_markdown_export_makes_tags_text_in_code_spans_markdown_may_pair_otherwise():
    """Code spans were kept as written, as found on one line: markdown pairs
    backticks across lines and at a lone carriage return, a table splits a
    span at its "|", and an escaped backslash leaves the backtick after it
    a delimiter, so a tag between two spans was live HTML in the export.
    Such spans have their tags made text; a "<" that opens none stays, and a
    span markdown surely pairs keeps its tags."""
    from markdown_it import MarkdownIt

    for text in ("`a\nb` <img src=x onerror=alert(1)> `c", "Note `a\r# <img src=y onerror=alert(2)>` end",
                 "\\\\`a` <img src=x onerror=1> `b`", "| `<img src=x onerror=1>|` |\n|-|-|",
                 # a fence markdown closes elsewhere: the fences after it may pair otherwise too
                 "```\nx\n    ```\n```\n<img src=x onerror=1>\n```"):
        exported = store_module.to_markdown({**new_chat(), "messages": [{"role": "user", "content": text}]})
        for reader in (MarkdownIt("commonmark"), MarkdownIt("js-default", {"html": True})):  # the second reads tables
            blocks = reader.parse(exported)
            found = [*blocks, *(child for block in blocks if block.children for child in block.children)]
            assert not [t for t in found if t.type in ("html_block", "html_inline")], text
    assert render.inert_markdown("A lone ` here.\nThen `a < b` and `<div>`") == "A lone ` here.\nThen `a < b` and `&lt;div>`"
    assert render.inert_markdown("Then `a < b` and `<div>`") == "Then `a < b` and `<div>`"
    assert render.inert_markdown("x ~~~~`<b>` y") == "x ~~~~`&lt;b>` y"  # marked takes a backtick after tildes as text


def test_the_markdown_export_keeps_code_as_written_before_what_may_hide_a_fence():
    """A link definition or a lone carriage return anywhere made every fence's
    tags text in the export (and every fence holding a "<" a text block on the
    page): only fences that reach it are, as markdown reads the lines before
    it as written."""
    code = '```html\n<div class="box">hi</div>\n```'
    for text in (f"Use this:\n\n{code}\n\nSee [the docs][1].\n\n[1]: https://developer.mozilla.org/", f"{code}\n\nThen\r<b>"):
        assert render.inert_markdown(text).startswith(text.partition(code)[0] + code), text
        assert render.message_html({"role": "assistant", "content": text}, False).startswith(text.partition(code)[0] + code), text
    for text in ("[x]:\n```\n<b>\n```", "Then\r\n```\n<b>\n```"):  # fences after them: text, as before
        assert "&lt;b>" in render.inert_markdown(text) and "<b" not in render.message_html({"role": "user", "content": text}, False)


def test_the_markdown_export_writes_a_reply_s_settings_as_text_on_one_line():
    """A reply's stored settings (an imported chat's, as written) went into
    the export raw: a model name could hold live HTML and a line passing for
    the next message's label."""
    from markdown_it import MarkdownIt

    chat = new_chat()
    settings = {"model": "x<img src=x onerror=alert(1)>\n\n**User:**\n\n> fake", "head": "h<i>", "dtype": "d\n# e", "quantization": "q<s>"}
    chat["messages"] = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "stats": {"mode": "m<b>", "settings": settings}}]
    exported = store_module.to_markdown(chat)
    tokens = MarkdownIt("commonmark").parse(exported)
    inline = [child for token in tokens if token.children for child in token.children]
    assert not [t for t in [*tokens, *inline] if t.type in ("html_block", "html_inline")], exported
    assert [token.content for token in tokens if token.type == "inline" and token.level == 1][1:3] == ["**User:**", "**Assistant:**"]
    assert "_m&lt;b>, x&lt;img src=x onerror=alert(1)> **User:** > fake (d # e, q&lt;s>), draft head h&lt;i>_" in exported


def test_models_tab_load_failure_keeps_model_and_unload(engine, tiny_dir, store, tmp_path, monkeypatch):
    import app.library

    runtime = Runtime(engine)
    library = LibraryHandlers(runtime, store.folder / "heads", "cpu", "off")  # as `ui --device cpu --compile off`
    calls = []
    load_pair = app.library.load_pair
    monkeypatch.setattr(app.library, "load_pair", lambda *args: calls.append(args[4:]) or load_pair(*args))
    status, notice, _ = library.load(str(tmp_path / "missing"), "", None, "none", "float32")
    assert "Loading failed" in notice and "The previous model is still loaded." in notice and runtime.engine is engine
    status, notice, mode = library.load(str(tiny_dir), "", None, "none", "float32")
    assert notice == "Loaded." and runtime.engine is not engine and mode["choices"] == [("vanilla", "vanilla")]
    assert calls == [("cpu", "off")] * 2
    _, notice, mode = library.unload()
    assert runtime.engine is None and mode["choices"] == [("vanilla", "vanilla")] and library.heads()["choices"] == []
    assert notice == "Unloaded; memory freed." and library.heads()["info"].startswith("none yet: head folders in")
    assert library.unload()[1] == "No model is loaded; there was nothing to unload."  # not "Unloaded" again
    final = list(ChatHandlers(runtime, store).send("w1", new_chat(), "", *values()))[-1]
    assert "No model is loaded" in final[3] and final[0] == "w1"
    status, notice, _ = library.load(str(tmp_path / "missing"), "", None, "none", "float32")
    assert "Loading failed" in notice and "No model is loaded." in notice and "previous" not in notice
    # a file given for a head: its folder is suggested only where it holds a head's config.json
    (tmp_path / "notes.txt").write_text("x")
    status, notice, _ = library.load(str(tiny_dir), str(tmp_path / "notes.txt"), None, "none", "float32")
    assert "is a file; a draft head is the folder holding config.json and its weights." in notice
    (tmp_path / "bad-head").mkdir()  # a folder whose config.json lacks a head's fields: said to be the head's
    (tmp_path / "bad-head" / "config.json").write_text('{"vocab_size": 64}')
    status, notice, _ = library.load(str(tiny_dir), str(tmp_path / "bad-head"), None, "none", "float32")
    assert notice.startswith("Loading failed (the draft head): ") and "bad-head" in notice and "missing field" in notice


def test_the_model_loaded_in_the_tab_is_the_next_start_s(engine, store, tmp_path, monkeypatch, capsys):
    """A desktop app opens with what was used last: a load in the Models tab is
    kept in the settings, and a start that names no model loads it again; one
    that no longer loads gives way to the bundled model, and a model named on
    the command line wins."""
    from argparse import Namespace

    import app.library
    from app.library import MODEL_SETTING
    from app.ui import load_first
    from models.errors import ModelNotFoundError

    runtime = Runtime(engine)
    library = LibraryHandlers(runtime, store.folder / "heads", "cpu", "off", remember=lambda choice: store.update_settings({MODEL_SETTING: choice}))
    monkeypatch.setattr(app.library, "load_pair", lambda *args: engine)
    library.load(" /models/mine ", "", None, "int8", "bfloat16")
    assert store.load_settings()[MODEL_SETTING] == {"model": "/models/mine", "head": None, "quantization": "int8", "dtype": "bfloat16"}
    (tmp_path / "local").mkdir()
    monkeypatch.chdir(tmp_path)
    library.load("local", "", None, "auto", "auto")  # a local path kept absolute: the next start may run elsewhere
    assert store.load_settings()[MODEL_SETTING]["model"] == str(tmp_path / "local")
    library.load(" /models/mine ", "", None, "int8", "bfloat16")
    loads = []

    def load_pair(*args):
        loads.append(args)
        if args[0] == "/models/gone":
            raise ModelNotFoundError("/models/gone: no such file or folder")
        return engine

    start = Namespace(model=None, head=None, quantization="auto", dtype="auto", device="cpu", compile="off")
    assert load_first(start, store.load_settings(), load_pair) is engine
    assert loads == [("/models/mine", None, "int8", "bfloat16", "cpu", "off")]
    assert "Loading /models/mine (last loaded in the Models tab; --model chooses another)" in capsys.readouterr().out
    loads.clear()
    load_first(Namespace(**{**vars(start), "model": "other"}), store.load_settings(), load_pair)
    load_first(Namespace(**{**vars(start), "quantization": "none"}), store.load_settings(), load_pair)
    assert [args[:3] for args in loads] == [("other", None, "auto"), (None, None, "none")]  # named on the command line
    loads.clear()
    load_first(start, {MODEL_SETTING: {"model": "/models/gone"}}, load_pair)
    assert [args[0] for args in loads] == ["/models/gone", None]
    assert "It did not load (/models/gone: no such file or folder); loading the bundled model instead (--model chooses another)." in capsys.readouterr().out
    for kept in ({"model": 3}, {"model": "x", "dtype": "half"}, "x", {"model": " "}):  # edited by hand: not a choice
        loads.clear()
        load_first(start, {MODEL_SETTING: kept}, load_pair)
        assert loads == [(None, None, "auto", "auto", "cpu", "off")], kept


def test_a_failed_load_says_what_failed_and_what_is_loaded(engine, store, tmp_path, monkeypatch):
    """An error no one foresaw is said as it is (no bare 'Error' toast); out of
    memory with a model loaded says that it stays loaded while another loads;
    a head listed for the loaded base is not loaded onto another base."""
    import app.library
    from models.errors import OutOfMemoryError

    runtime = Runtime(engine)
    library = LibraryHandlers(runtime, store.folder / "heads", "cpu", "off")

    def failing(error):
        def load_pair(*args):
            raise error

        return load_pair

    monkeypatch.setattr(app.library, "load_pair", failing(AttributeError("'dict' object has no attribute 'x'")))
    _, notice, mode = library.load("m", "", None, "auto", "auto")
    assert notice == "Loading failed: AttributeError: &#x27;dict&#x27; object has no attribute &#x27;x&#x27;. The previous model is still loaded."
    assert is_skip(mode) and runtime.engine is engine
    monkeypatch.setattr(app.library, "load_pair", failing(OutOfMemoryError("m: not enough memory to load the model")))
    _, notice, _ = library.load("m", "", None, "auto", "auto")
    assert notice.endswith("The previous model is still loaded. It stays loaded while another loads: Unload it first, then Load.")
    loads = []
    monkeypatch.setattr(app.library, "load_pair", lambda *args: loads.append(args[:2]) or engine)
    _, notice, _ = library.load(str(tmp_path / "another-base"), "", str(tmp_path / "heads" / "mine"), "auto", "auto")
    assert f"was made for {engine.base.name}, not for {tmp_path / 'another-base'}; put {engine.base.name} in the base model box" in notice
    assert loads == []
    library.load(engine.base.name, "typed", str(tmp_path / "heads" / "mine"), "auto", "auto")
    library.load("", "", str(tmp_path / "heads" / "mine"), "auto", "auto")  # the box left empty: the loaded base
    assert loads == [(engine.base.name, str(tmp_path / "heads" / "mine"))] * 2  # the same base: the chosen head wins


def test_a_model_loaded_in_the_tab_replaces_the_mode_it_wanted(engine, store, tmp_path, monkeypatch):
    """A page opened without a head wants its saved mode back; a model loaded
    in that tab sets the mode itself (EAGLE-2), and that is the one given back
    after another tab's model without a head (the saved EAGLE came back)."""
    import app.library

    runtime = Runtime(Engine(engine.base))  # no head: the page-load wanted the saved "eagle" back
    library = LibraryHandlers(runtime, store.folder / "heads", "cpu", "off")
    wanted = "eagle"
    assert library.load_here(str(tmp_path / "missing"), "", None, "none", "float32")[-1] == gr.skip()  # a failed load keeps it
    monkeypatch.setattr(app.library, "load_pair", lambda *args: engine)
    *_, mode, wanted = library.load_here("", "", None, "none", "float32")
    assert mode["value"] == "eagle2" and wanted is None
    runtime.replace(lambda: Engine(engine.base), "the same model without a head")  # as another tab's Load would
    mode, wanted = library.modes("eagle2", wanted)
    assert mode["value"] == "vanilla" and wanted == "eagle2"
    runtime.replace(lambda: engine, "the pair again")
    mode, wanted = library.modes("vanilla", wanted)
    assert mode["value"] == "eagle2"


def test_a_page_without_a_head_keeps_the_saved_mode(engine, store):
    """Vanilla shown alone (no head loaded) is not a choice: a message or a
    setting changed then keeps the saved EAGLE mode for the next page load;
    vanilla picked where EAGLE modes are offered is saved."""
    store.update_settings({"mode": "eagle"})
    headless = ChatHandlers(Runtime(Engine(engine.base)), store)
    headless.remember("", "", *values(mode="vanilla", temperature=0.5))
    list(headless.send("hello", new_chat(), "", *values(mode="vanilla", max_new_tokens=2)))
    saved = store.load_settings()
    assert saved["mode"] == "eagle" and saved["max_new_tokens"] == 2  # the other settings are saved
    ChatHandlers(Runtime(engine), store).remember("", "", *values(mode="vanilla"))
    assert store.load_settings()["mode"] == "vanilla"


def test_catalog_and_trained_heads(engine, tmp_path):
    from models.head import save_head

    frame = catalog_frame(24.0)
    assert len(frame) == len(catalog.CATALOG) and "Vicuna-13B v1.3" in list(frame["model"])
    assert catalog.fit(catalog.estimated_gb(catalog.find("Vicuna-13B v1.3"), 16), 24.0) == "does not fit"
    assert catalog.fit(catalog.estimated_gb(catalog.find("Vicuna-7B v1.3"), 4), 24.0) == "fits"
    gpu = dict(zip(frame["model"], frame["4-bit on a 12 GB GPU"]))
    here = dict(zip(frame["model"], frame["16-bit GB"]))
    assert here["Vicuna-13B v1.3"].endswith("(does not fit here)")
    assert gpu["Llama-3.1-8B-Instruct (EAGLE-3)"] == "fits" and gpu["Qwen3-8B (EAGLE-3, community head)"] == "fits"
    assert gpu["Llama-3.3-70B-Instruct (EAGLE-3)"] == "does not fit"
    assert dict(zip(frame["model"], frame["4-bit GB"]))["Llama-3.1-8B-Instruct (EAGLE-3)"].endswith("(fits here)")
    # a CPU without native bf16 reads the whole 8B model in float32 (about 35 GB with its head) before int4 shrinks it
    on_cpu = catalog_frame(24.0, load_bytes=4)
    four_bit = dict(zip(on_cpu["model"], on_cpu["4-bit GB"]))
    assert four_bit["Llama-3.1-8B-Instruct (EAGLE-3)"].endswith("(does not fit here)") and four_bit["SmolLM2-135M-Instruct (bundled)"].endswith("(fits here)")
    assert dict(zip(on_cpu["model"], on_cpu["load peak on this CPU GB"]))["Llama-3.1-8B-Instruct (EAGLE-3)"] == "34.8"
    for name, base in (("mine", engine.base.name), ("other", "another/model"), ("unreported", None)):
        save_head(random_head(engine.model), tmp_path / "heads" / name)
        if base:
            (tmp_path / "heads" / name / "training_report.json").write_text(json.dumps({"base_model": base}))
    found = trained_heads(tmp_path / "heads", engine.base.name, engine.model.config)
    assert found == [str(tmp_path / "heads" / "mine"), str(tmp_path / "heads" / "unreported")]
    # a base given as a path is the same base however the path is written
    (tmp_path / "heads" / "other" / "training_report.json").write_text(json.dumps({"base_model": str(tmp_path / "base")}))
    (tmp_path / "base").mkdir()
    found = trained_heads(tmp_path / "heads", f"{tmp_path}/./base/", engine.model.config)
    assert str(tmp_path / "heads" / "other") in found and str(tmp_path / "heads" / "mine") not in found
    # a path typed relative to where the training ran (elsewhere): its report's folder tells
    from core.training.pipeline import base_folder

    report = {"base_model": "base", **base_folder(str(tmp_path / "base"))}
    (tmp_path / "heads" / "other" / "training_report.json").write_text(json.dumps(report))
    assert str(tmp_path / "heads" / "other") in trained_heads(tmp_path / "heads", str(tmp_path / "base"), engine.model.config)
    from app.library import trained_base

    assert trained_base(tmp_path / "heads" / "other") == str(tmp_path / "base")
    # a folder named like a repo id where the training ran: the head is listed for that repo too
    (tmp_path / "heads" / "other" / "training_report.json").write_text(json.dumps({**report, "base_model": "owner/name"}))
    assert str(tmp_path / "heads" / "other") in trained_heads(tmp_path / "heads", "owner/name", engine.model.config)
    assert base_folder("another/model") == {}  # a repo id


def ui_args(*argv: str):
    from app.cli import build_parser

    return build_parser().parse_args(["ui", *argv])


def test_access_is_local_unless_listen_with_auth_and_api_key():
    from app.ui import access_from

    local = access_from(ui_args())
    assert (local.host, local.auth, local.api_key, local.allow_origins) == ("127.0.0.1", None, None, ())
    exposed = access_from(ui_args("--listen", "--auth", "ann:secret", "--api-key", "auto"))
    assert exposed.host == "0.0.0.0" and exposed.auth == ("ann", "secret") and exposed.api_key.startswith("kestrel-")
    assert access_from(ui_args("--api-key", "k" * 12)).api_key == "k" * 12
    with pytest.raises(ValueError, match="--auth USER:PASS --api-key auto"):
        access_from(ui_args("--listen"))
    with pytest.raises(ValueError, match="--api-key auto"):
        access_from(ui_args("--listen", "--auth", "ann:secret"))
    with pytest.raises(ValueError, match="USER:PASS"):
        access_from(ui_args("--auth", "nopassword"))
    with pytest.raises(ValueError, match="--allow-origin"):
        access_from(ui_args("--allow-origin", "localhost:3000"))
    assert access_from(ui_args("--allow-origin", "http://localhost:3000/")).allow_origins == ("http://localhost:3000",)


def test_allow_origin_takes_extensions_and_apps_and_null_with_a_key_as_refusals_suggest():
    from app.server import origin_refusal
    from app.ui import access_from

    origins = ["chrome-extension://abcdefghijklmnop", "moz-extension://*", "app://obsidian.md", "tauri://localhost", "vscode-webview://0a1b2c", "http://[::1]:3000"]
    assert access_from(ui_args(*[part for origin in origins for part in ("--allow-origin", origin)])).allow_origins == tuple(origins)
    for bad in ("*", "http://*", "https://*", "null://*", "localhost:3000", "https://chat.example/path", "Chrome-Extension://abc", "app://a b"):
        with pytest.raises(ValueError, match="--allow-origin takes"):
            access_from(ui_args("--allow-origin", bad))
    with pytest.raises(ValueError, match="--api-key"):  # any web site's sandboxed frame sends null too
        access_from(ui_args("--allow-origin", "null"))
    assert access_from(ui_args("--allow-origin", "null", "--api-key", "auto")).allow_origins == ("null",)
    assert not access_from(ui_args("--allow-origin", "moz-extension://*")).allows("null")  # null only as itself, with its key
    assert access_from(ui_args("--allow-host", "Host.Docker.Internal", "--allow-host", "kestrel.localhost")).allow_hosts == (
        "host.docker.internal", "kestrel.localhost")
    for bad in ("host.docker.internal:8100", "http://host.docker.internal", "a b"):
        with pytest.raises(ValueError, match="--allow-host takes a host name without port"):
            access_from(ui_args("--allow-host", bad))
    # what a refusal tells a page's user to start Kestrel with is taken; nothing is suggested for what is no origin
    for origin in ("chrome-extension://abcdefghijklmnop", "moz-extension://0f3c5e2a-5d3b", "app://obsidian.md", "null", "https://chat.example:8443"):
        suggested = re.search(r"--allow-origin (\S+)", origin_refusal(origin)).group(1)
        assert suggested == origin and access_from(ui_args("--allow-origin", suggested, "--api-key", "auto")).allow_origins == (origin,)
    assert "--allow-origin" not in origin_refusal("https://chat.example/path") + origin_refusal("\x1b[31m")


def test_the_browser_opens_only_where_there_is_a_desktop(monkeypatch):
    """Linux without a graphical session (ssh, a server): Python's fallback would run a text browser in Kestrel's terminal."""
    from app import instance

    opened = []
    monkeypatch.setattr(instance.webbrowser, "open", opened.append)
    monkeypatch.setattr(instance.sys, "platform", "linux")
    for name in ("DISPLAY", "WAYLAND_DISPLAY"):
        monkeypatch.delenv(name, raising=False)
    instance.open_browser("http://127.0.0.1:7860/")
    assert opened == []
    monkeypatch.setenv("WAYLAND_DISPLAY", "wayland-0")
    instance.open_browser("http://127.0.0.1:7860/")
    monkeypatch.delenv("WAYLAND_DISPLAY")
    monkeypatch.setattr(instance.sys, "platform", "darwin")
    instance.open_browser("http://127.0.0.1:7861/")
    assert opened == ["http://127.0.0.1:7860/", "http://127.0.0.1:7861/"]


def test_cli_refuses_listen_without_auth(capsys):
    from app.cli import main

    assert main(["ui", "--listen", "--no-browser"]) == 2
    assert "--auth USER:PASS" in capsys.readouterr().err


def test_shortcuts_start_kestrel_from_any_folder_name(tmp_path):
    """A folder named with %, quotes, $, ` or a backslash: the desktop entry's
    Exec line reads back (string escapes, then quoting) as the real paths,
    and the macOS command changes into that folder with nothing expanded."""
    from app.shortcut import OR_PYTHON3, desktop_entry, mac_command

    root = tmp_path / "100% $HOME `x` a\\sb \"q\" it's"
    root.mkdir()
    folders = [("KESTREL_DATA_DIR", str(root / "data")), ("KESTREL_CACHE_DIR", str(root / "cache"))]  # set when it was made
    line = next(line for line in desktop_entry(root, "/usr/bin/python3", folders).splitlines() if line.startswith("Exec="))[5:]
    assert exec_arguments(line) == ["env", *(f"{name}={value}" for name, value in folders), "/bin/sh", "-c", OR_PYTHON3, "/usr/bin/python3", str(root / "launch.py")]
    script = mac_command(root, "/bin/echo", folders).replace("exec ", 'pwd; echo "$KESTREL_DATA_DIR"; echo "$KESTREL_CACHE_DIR"; exit; : ')
    ran = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert ran.stdout.splitlines() == [str(root), str(root / "data"), str(root / "cache")], ran.stderr


def exec_arguments(line: str) -> list[str]:
    """A desktop entry's Exec value read back as its program's arguments."""
    general = {"s": " ", "n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
    text, index = "", 0
    while index < len(line):  # the string escapes of a desktop entry's values
        if line[index] == "\\":
            text, index = text + general.get(line[index + 1], "\\" + line[index + 1]), index + 2
        else:
            text, index = text + line[index], index + 1
    assert "%" not in text.replace("%%", "")  # no field code
    arguments, current, quoted, index = [], "", False, 0
    text = text.replace("%%", "%")
    while index < len(text):  # the Exec quoting rule
        char = text[index]
        if quoted and char == "\\":
            current, index = current + text[index + 1], index + 2
            continue
        if char == '"':
            quoted = not quoted
        elif char == " " and not quoted:
            arguments, current = arguments + [current], ""
        else:
            current += char
        index += 1
    return arguments + [current]


def test_shortcut_starts_kestrel_with_the_options_it_was_made_with(tmp_path, monkeypatch, capsys):
    """`--model ./folder --port 7861 --install-shortcut`: the shortcut starts
    that model on that port (it started the defaults), the folder made
    absolute since the shortcut starts in Kestrel's own folder; a password or
    key is refused by name, and nothing is written."""
    from app.cli import main
    from app.shortcut import ROOT, desktop_entry, mac_command, windows_batch

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("XDG_DATA_HOME", "XDG_CONFIG_HOME", "KESTREL_DATA_DIR", "KESTREL_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my model").mkdir()
    given = ["--model", "my model", "--port", "7861", "--no-browser", "--allow-origin", "app://obsidian.md", "--allow-origin", "null", "--head", "owner/head"]
    assert main([*given, "--install"]) == 0  # argparse's abbreviation of --install-shortcut: not passed on either
    entry = tmp_path / "home/.local/share/applications/kestrel.desktop"
    line = next(line for line in entry.read_text().splitlines() if line.startswith("Exec="))[5:]
    expected = ["ui", "--model", str(tmp_path / "my model"), "--head", "owner/head", "--port", "7861", "--no-browser", "--allow-origin", "app://obsidian.md", "--allow-origin", "null"]
    assert exec_arguments(line)[-len(expected) - 1 :] == [str(ROOT / "launch.py"), *expected]
    assert capsys.readouterr().out.startswith("Shortcut written: ")
    assert main(["--install-shortcut"]) == 0  # the defaults: launch.py alone, as before
    assert exec_arguments(next(line for line in entry.read_text().splitlines() if line.startswith("Exec="))[5:])[-1] == str(ROOT / "launch.py")
    entry.unlink()
    assert main(["--listen", "--auth", "me:secret", "--api-key", "sk-1", "--install-shortcut"]) == 2
    assert "--auth: a shortcut keeps no passwords or keys" in capsys.readouterr().err and not entry.exists()
    assert main(["--api-key", "auto", "--install-shortcut"]) == 0 and exec_arguments(
        next(line for line in entry.read_text().splitlines() if line.startswith("Exec="))[5:])[-3:] == ["ui", "--api-key", "auto"]  # fmt: skip
    script = mac_command(ROOT, "/bin/echo", options=["--model", "it's $HOME"])
    ran = subprocess.run(["bash", "-c", script, "bash", "--port", "1"], capture_output=True, text=True)
    assert ran.stdout == "launch.py ui --model it's $HOME --port 1\n", ran.stderr  # the shortcut's own arguments after them
    # the Python that made .venv gone (a system upgrade): python3 runs launch.py, which makes .venv again with it
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text('#!/bin/sh\necho python3 "$@"\n')
    (fake / "python3").chmod(0o755)
    path = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    ran = subprocess.run(["bash", "-c", mac_command(ROOT, str(tmp_path / "gone/python3.11"), options=["--port", "1"])], capture_output=True, text=True, env=path)
    assert ran.stdout == "python3 launch.py ui --port 1\n", ran.stderr
    entry_line = next(line for line in desktop_entry(ROOT, str(tmp_path / "gone/python3.11"), options=["--port", "1"]).splitlines() if line.startswith("Exec="))
    ran = subprocess.run(exec_arguments(entry_line[5:]), capture_output=True, text=True, env=path)
    assert ran.stdout == f"python3 {ROOT / 'launch.py'} ui --port 1\n", ran.stderr
    entry_line = next(line for line in desktop_entry(ROOT, "/bin/echo", options=["--port", "1"]).splitlines() if line.startswith("Exec="))
    assert subprocess.run(exec_arguments(entry_line[5:]), capture_output=True, text=True, env=path).stdout == f"{ROOT / 'launch.py'} ui --port 1\n"
    batch = windows_batch(Path("C:\\K"), "py.exe", options=["--model", "D:\\100% models"]).split("\r\n")
    assert batch[3] == '"py.exe" launch.py "ui" "--model" "D:\\100%% models" %*'
    assert windows_batch(Path("C:\\K"), "py.exe", options=["--model", "D:\\"]).split("\r\n")[3] == '"py.exe" launch.py "ui" "--model" "D:\\\\" %*'
    with pytest.raises(ValueError, match="double quote"):
        windows_batch(Path("C:\\K"), "py.exe", options=["--model", 'a"b'])


def test_install_shortcut_linux(tmp_path, monkeypatch):
    from app.shortcut import ROOT, install

    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("XDG_DATA_HOME", "KESTREL_DATA_DIR", "KESTREL_CACHE_DIR"):  # a shortcut made with none moved
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "Desktop").mkdir()
    written = install(platform="linux")
    assert written == [tmp_path / ".local/share/applications/kestrel.desktop", tmp_path / "Desktop/kestrel.desktop"]
    text = written[0].read_text()
    assert text.startswith("[Desktop Entry]") and "launch.py" in text and "Terminal=true" in text
    assert 'Exec=env "KESTREL_SHORTCUT=1" "' in text  # its terminal closes when Kestrel ends: launch.py holds it after an error
    arguments = exec_arguments(next(line for line in text.splitlines() if line.startswith("Exec="))[5:])
    python = arguments[arguments.index(str(ROOT / "launch.py")) - 1]  # the Python that made .venv, not whatever python3 is
    assert subprocess.run([python, "-c", "import sys; print(sys.version_info >= (3, 11))"], capture_output=True, text=True).stdout == "True\n"
    assert written[0].stat().st_mode & stat.S_IXUSR
    batch = install(platform="win32", home=tmp_path)[0]
    assert batch.name == "Kestrel.bat"
    lines = batch.read_bytes().decode("utf-8").split("\r\n")  # cmd reads it in UTF-8 from its second line on
    assert lines[1] == "chcp 65001 >nul" and lines[3] == f'"{python}" launch.py %*'  # one Python: no second run after a failure
    assert lines[4] == "if errorlevel 9009 pause"  # a Python that is gone: the window stays to say so
    monkeypatch.setenv("KESTREL_DATA_DIR", str(tmp_path / "100% chats"))  # the shortcut starts Kestrel with the folders set now
    moved = install(platform="win32", home=tmp_path)[0].read_bytes().decode("utf-8").split("\r\n")
    assert moved[2] == f'set "KESTREL_DATA_DIR={tmp_path / "100%% chats"}"' and moved[4] == f'"{python}" launch.py %*'
    assert f'Exec=env "KESTREL_SHORTCUT=1" "KESTREL_DATA_DIR={tmp_path / "100%% chats"}" "/bin/sh"' in install(platform="linux")[0].read_text()
    monkeypatch.delenv("KESTREL_DATA_DIR")
    assert 'cd /d "C:\\100%% Kestrel"' in install(root=Path("C:\\100% Kestrel"), platform="win32", home=tmp_path)[0].read_text()
    assert install(platform="darwin", home=tmp_path)[0].name == "Kestrel.command"
    (tmp_path / ".config").mkdir()  # a localised desktop folder, as freedesktop's user-dirs names it
    (tmp_path / ".config" / "user-dirs.dirs").write_text('# written by xdg-user-dirs-update\nXDG_DESKTOP_DIR="$HOME/Schreibtisch"\n')
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    assert install(platform="linux") == [written[0]]  # no such folder yet: the menu entry alone
    (tmp_path / "Schreibtisch").mkdir()
    assert install(platform="linux") == [written[0], tmp_path / "Schreibtisch" / "kestrel.desktop"]
    (tmp_path / ".config" / "user-dirs.dirs").write_text('XDG_DESKTOP_DIR="$HOME/"\n')  # the home itself: no desktop
    assert install(platform="linux") == [written[0]] and not (tmp_path / "kestrel.desktop").exists()


def test_free_port_skips_a_taken_port():
    import socket

    from app.server import free_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert free_port("127.0.0.1", port) > port


def test_launched_app_streams_through_gradio_client(engine, tmp_path):
    from gradio_client import Client

    from app.server import Server
    from app.ui import build_app

    runtime = Runtime(engine)
    server = Server(build_app(runtime, tmp_path / "data"), runtime, port=7960)
    url = server.start()
    try:
        assert url.startswith("http://127.0.0.1:") and server.access.host == "127.0.0.1"
        client = Client(url, verbose=False)
        settings = dict(zip(SETTINGS, values(max_new_tokens=40)))
        settings["mode"] = "eagle2"
        job = client.submit("w1 w2", "", *settings.values(), api_name="/send")
        updates = list(job)
        final = job.result()
        chatbot = final[1]
        assert chatbot[-1]["role"] == "assistant" and chatbot[-1]["content"]
        assert len(updates) >= 2
    finally:
        server.close()


def test_code_in_markdown_stays_raw_and_prose_is_escaped():
    text = "a <b> & b\n```cpp\n#include <vector>\n```\nuse `x < y` <script>"
    segments = [[text[:4], render.DRAFT], [text[4:], render.BASE]]
    shown = render.message_html({"role": "assistant", "content": text, "segments": segments}, True)
    assert shown.startswith('<span class="kd"')
    assert "```c cpp\n#include <vector>" in shown and ">x &#60; y</code>" in shown
    assert "a &lt;b</span>&gt; &amp; b" in shown and "&lt;script&gt;" in shown and "<script>" not in shown
    plain = render.message_html({"role": "user", "content": "```\n<i>"}, False)
    assert plain == "```\n<i>"
    tildes = render.message_html({"role": "user", "content": "x < y\n~~~py\nif a < b && c:\n~~~\nand a ~~~ <b>"}, False)
    assert tildes == "x &lt; y\n~~~py\nif a < b && c:\n~~~\nand a ~~~ &lt;b&gt;"  # a ~~~ fence opens a line
    midline = render.message_html({"role": "user", "content": "Type ``` to start a fence. Then <b>bold</b>"}, False)
    assert midline == "Type ``` to start a fence. Then &lt;b&gt;bold&lt;/b&gt;"  # a ``` fence opens only a line
    nested = render.message_html({"role": "user", "content": "1. Code:\n      ```py\n      a<b\n      ```\nand ``a`b`` <i>"}, False)
    assert nested == "1. Code:\n      ```py\n      a<b\n      ```\nand ``a`b`` &lt;i&gt;"


def test_raw_text_that_markdown_may_not_read_as_code_cannot_open_a_tag():
    """Code stays raw only where markdown surely reads code: else a "<" in it
    could open a tag (a remote image loaded on every view of the chat)."""

    def shown(text: str) -> str:
        return render.message_html({"role": "user", "content": text}, False)

    # a backslash-escaped backtick opens no span, for markdown as here
    assert shown("a \\`<img src=x>` b") == "a \\`&lt;img src=x&gt;` b"
    # a fence indented 4 spaces is indented code to markdown, which ends at the unindented line
    assert "<img" not in shown("x:\n\n    ```\n<img src=x>\n    ```") and "&#96;&#96;&#96;" in shown("x:\n\n    ```\n<img src=x>\n    ```")
    # a line indented less than a list item's fence ends the item, and the code block with it
    assert "<img" not in shown("- a\n  ```\n<img src=x>\n  ```")
    assert "<img" not in shown("``` a`b\n<img src=x>\n```")  # backticks in the info string: not a fence
    # inline spans holding "<" become <code> elements, whatever markdown pairs the backticks with (those it may pair
    # otherwise, where the "<" can open a tag)
    assert shown("use `x < y` and `z`") == 'use <code data-md="&#96;x &#60; y&#96;">x &#60; y</code> and `z`'
    assert shown("| `<img src=x>|` |") == '| <code data-md="&#96;&#60;img src&#61;x&#62;&#124;&#96;">&#60;img src&#61;x&#62;&#124;</code> |'
    # a fence that markdown closes elsewhere (at a closing line it does not take) becomes a text block, so that
    # markdown reads no fence there and the fences after it as found here (tests/test_browser.py: LEAKS)
    for text in ("```\nx\n    ```\n```\n<img src=x>\n```", "```\nx\n```py\n```\n<img src=x>\n```", "```\nx\n```~\n<img src=x>\n```",
                 "```\nx\n```\t\n<img src=x>\n```"):  # marked, the page's reader, takes neither as the end
        assert shown(text).startswith('<pre class="kestrel-text"><code>&#'), text
    # a line shorter than the opening run ends no fence, here as for markdown: the fence stays raw, what follows is prose
    for text in ("````\n```\n````\n<img src=x>\n```", "~~~~\n~~~\n~~~~\n<img src=x>\n~~~"):
        assert shown(text) == text.replace("<img src=x>", "&lt;img src=x&gt;"), text
    # after a fence opened behind a list marker, which is not read here, no fence is taken as sure
    assert "<img" not in shown("- ```\n  x\n  ```\n  <img src=x>\n  ```")
    # nor where Gradio or marked may read a fence otherwise: mermaid, $$ math, a link definition, a lone \r,
    # an unclosed fence, a "<" in the opening line
    for text in ("```mermaid\nA[<b>x</b>]\n```", "~~~\n```mermaid\n<b>\n```\n~~~", "$$\n```\n<b>\n```", "[x]:\n```\n<b>\n```",
                 "```\n<b>\r```", "Text\n```<b>", "```<b>\nx\n```"):
        assert "<b" not in shown(text) and shown(text).count('<pre class="kestrel-text">') >= 1, text
    assert shown("```mermaid\ngraph TD\n```").startswith('<pre class="kestrel-text">')
    # fences markdown surely reads stay raw: top level, and a list item's, even indented 4 or more
    assert shown("```html\n<p>hi</p>\n```") == "```html\n<p>hi</p>\n```"
    assert shown("1. Code:\n    ```\n    a<b\n    ```") == "1. Code:\n    ```\n    a<b\n    ```"
    assert "a<b" not in shown("Text\n    ```\n    a<b\n    ```")  # not in a list: not a fence


def test_a_line_opening_with_backticks_closed_on_it_is_inline_code_not_a_fence():
    """A ``` fence's info string holds no backtick: "```print('hi')``` prints
    hi." is inline code, where it had opened a fence to the message's end,
    which showed the rest as raw text. A fence closes only at a line of its
    character at least as long as its opening run, so a block can show
    another's fence lines. The page's copy reads code as CODE does."""
    from markdown_it import MarkdownIt

    def shown(text: str) -> str:
        return render.message_html({"role": "assistant", "content": text}, False)

    text = "Sure.\n```print('hi')``` prints hi.\n\n## Steps\n\n1. **Install** Python\n2. Run it"
    assert shown(text) == text
    nested = "Here is a README snippet:\n\n````markdown\n```html\n<div>hi</div>\n```\n````\n\nDone."
    assert shown(nested) == nested and render.inert_markdown(nested) == nested  # the export keeps its tags too
    # a span holding a "<" becomes a <code> element: the backtick run before it is written as entities, so that the
    # line, which opened no fence as written, opens none without the span's backticks either
    for text in ("````cpp`**<b>`\nnext", "- ````cpp`**<b>`\nnext"):
        tokens = MarkdownIt("commonmark").parse(shown(text))
        assert not [t for t in tokens if t.type == "fence"] and "&#96;&#96;&#96;&#96;cpp<code" in shown(text), text
    javascript = render.CODE.pattern.replace("(?P<", "(?<").replace(".*?", "[\\s\\S]*?").replace("\\Z", "$")
    javascript = re.sub(r"\(\?P=(\w+)\)", r"\\k<\1>", javascript)  # Python's (?P=name) is JavaScript's \k<name>
    assert f"const code = /{javascript}/g;" in render.COPY_JS


def test_the_reasoning_fold_ends_before_the_answer_whatever_code_the_reasoning_holds():
    """The fold closed a code block it took as left open in the reasoning,
    read line by line: where the page showed that line as text (indented by
    a tab, a "<" on it) or as inline code, the closing line it added opened
    a block instead, which held the fold's end and the answer. Now it closes
    only a block the page leaves open, indented as it opened (a list item's)."""
    from markdown_it import MarkdownIt

    for reasoning in ("The user wants hello world.\n```print('hi')``` prints it.", "foo\n\t```python", "~~~<b>",
                      "Plan:\n1. Write the loop:\n   ```python\n   for i", "Try it:\n```python\nprint(4 + 4)"):
        message = {"role": "assistant", "content": f"<think>\n{reasoning}\n</think>\n\nUse `print('hi')`.", "reasoning": True}
        tokens = MarkdownIt("commonmark").parse(render.message_html(message, True))
        assert any(t.type == "html_block" and t.content.startswith("</details>") for t in tokens), reasoning
        assert [t.content for t in tokens if t.type == "inline"][-1] == "Use `print('hi')`.", reasoning
    cut = "<think>\nPlan:\n1. Write the loop:\n   ```python\n   for i"  # a reply stopped there
    shown = render.message_html({"role": "assistant", "content": cut, "reasoning": True}, False)
    assert shown.endswith('data-fence="7"><summary>Reasoning...</summary>\n\n' + cut[8:] + "\n   ```\n\n</details>\n\n")


def test_a_reasoning_fold_says_its_reply_ended_in_it_and_an_empty_one_is_not_shown():
    """A reply stopped (or cut) while reasoning kept its fold titled
    "Reasoning..." as if still written, after a reload too; Qwen3's empty
    reasoning (thinking off) showed an empty fold."""
    thinking = {"role": "assistant", "content": "<think>\nStill weighing it", "reasoning": True}
    assert "<summary>Reasoning...</summary>" in render.message_html(thinking, False)  # on its way: no stats yet
    stopped = render.message_html({**thinking, "stats": {"finish_reason": "cancelled"}}, False)
    assert '<details class="kestrel-think" open ' in stopped and "<summary>Reasoning (unfinished)</summary>" in stopped
    empty = render.message_html({"role": "assistant", "content": "<think>\n\n</think>\n\nHello!", "reasoning": True}, False)
    assert empty.startswith('<details class="kestrel-think" hidden data-open=') and empty.endswith("</details>\n\nHello!")
    said = render.message_html({"role": "assistant", "content": "<think>\nHm.\n</think>\n\nHello!", "reasoning": True}, False)
    assert said.startswith('<details class="kestrel-think" data-open=')


def test_a_code_span_markdown_may_pair_otherwise_is_left_to_markdown_where_it_can_open_no_tag():
    """A backtick earlier in the paragraph pairs with the span's first one
    for markdown: the span's <code> element showed inside that span as its
    markup. Where its "<" can open no tag, the span stays as written; where
    it can, it stays an element (its markup shows, nothing runs)."""
    text = "In Markdown, a single ` opens a code span.\nSo `a < b` is code, and so is `c`."
    assert render.message_html({"role": "assistant", "content": text}, False) == text
    tagged = render.message_html({"role": "assistant", "content": "one `two\nthree` <img src=x> `four`"}, False)
    assert "<img" not in tagged and '<code data-md="' in tagged


def test_colour_leaves_emphasis_inside_a_word_as_it_renders():
    """A highlight between ** and a letter ("这是**重要**的", foo**bar**baz)
    stood beside the ** as punctuation, so it emphasised nothing: such a run
    stays uncoloured. A highlight beside emphasis between spaces stays."""
    from markdown_it import MarkdownIt

    for segments in ([["这是**", render.BASE], ["重要", render.DRAFT], ["**的。", render.BASE]],
                     [["foo**", render.BASE], ["bar", render.DRAFT], ["**baz", render.BASE]]):
        text = "".join(piece for piece, _ in segments)
        shown = render.message_html({"role": "assistant", "content": text, "segments": segments}, True)
        assert MarkdownIt("commonmark").render(shown) == MarkdownIt("commonmark").render(text), text
    segments = [["The ", render.DRAFT], ["**", render.BASE], ["answer", render.DRAFT], ["** is", render.BASE]]
    shown = render.message_html({"role": "assistant", "content": "The **answer** is", "segments": segments}, True)
    assert shown.count('class="kd"') == 2 and "<strong>" in MarkdownIt("commonmark").render(shown)


def test_message_longer_than_the_context_is_refused(handlers):
    long = " ".join(["w1"] * 300)
    final = list(handlers.send(long, new_chat(), "", *values()))[-1]
    assert "context window" in final[3] and final[0] == long and final[2]["messages"] == []


def test_launched_app_with_auth_requires_login(engine, tmp_path):
    import httpx

    from app.server import Access, Server
    from app.ui import build_app

    runtime = Runtime(engine)
    server = Server(build_app(runtime, tmp_path / "data"), runtime, Access(auth=("ann", "secret")), 7970)
    url = server.start()
    try:
        assert httpx.get(f"{url}config").status_code == 401
        login = httpx.post(f"{url}login", data={"username": "ann", "password": "secret"})
        assert login.status_code == 200
        assert httpx.post(f"{url}login", data={"username": "ann", "password": "wrong"}).status_code == 400
    finally:
        server.close()


def test_an_event_from_a_page_of_another_version_is_refused(engine, tmp_path):
    """The page's version is the same at every start of the same app and changes
    with its events; an event sent with another version is refused by name,
    one with this version or with none (a script's client) runs."""
    import gradio as gr
    import httpx

    from app.server import STALE_PAGE, Server, page_version
    from app.ui import build_app

    runtime = Runtime(engine)
    demo = build_app(runtime, tmp_path / "data")
    version = page_version(demo)
    assert version == page_version(build_app(runtime, tmp_path / "data"))
    script = (
        "import sys; from pathlib import Path; from app.runtime import Runtime; from app.server import page_version; "
        "from app.ui import build_app; print(page_version(build_app(Runtime(None), Path(sys.argv[1]))))"
    )  # fmt: skip
    # another process, with other hashes of strings than this one's (random): the same version
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "other")], capture_output=True, text=True,
                         env={**os.environ, "PYTHONHASHSEED": "1"}, cwd=Path(__file__).resolve().parent.parent, timeout=300)  # fmt: skip
    assert run.stdout.strip().splitlines()[-1:] == [version], run.stderr[-2000:]
    with demo:
        gr.Button("another").click(lambda: None)
    assert page_version(demo) != version
    server = Server(build_app(runtime, tmp_path / "data"), runtime, port=7972)
    url = server.start()
    try:
        join = f"{url}gradio_api/queue/join"
        body = {"data": [], "fn_index": 10**6, "trigger_id": None, "session_hash": "s1"}  # no such event: Gradio's own answer
        refused = httpx.post(join, json=body, headers={"X-Kestrel-Page": "another"})
        assert refused.status_code == 409 and refused.json()["detail"] == STALE_PAGE
        assert refused.headers["x-kestrel-stale"] == "1" and "reload the page" in STALE_PAGE
        for headers in ({"X-Kestrel-Page": version}, {}):
            passed = httpx.post(join, json=body, headers=headers)
            assert passed.status_code != 409 and "x-kestrel-stale" not in passed.headers, passed.text
        assert f'"{version}"' in httpx.get(f"{url}config").json()["js"]  # the page sends what it was served with
    finally:
        server.close()


def test_verdict_explains_where_and_why_greedy_replies_differ(engine):
    from app.compare import Divergence, divergence, verdict_html

    messages = [{"role": "user", "content": "w1 w2"}]
    prompt_ids = engine.encode(messages)
    steps = list(engine.chat(messages, "vanilla", SamplingParams(max_new_tokens=8)))
    vanilla = Reply(token_ids=[t for step in steps for t in step.token_ids], snapshot=steps[-1].stats)
    other_ids = list(vanilla.token_ids)
    other_ids[2] = (other_ids[2] + 1) % 60 + 8
    other = Reply(token_ids=other_ids, snapshot=steps[-1].stats)
    assert divergence(engine, prompt_ids, vanilla, vanilla) is None
    found = divergence(engine, prompt_ids, vanilla, other)
    logits = engine.model(torch.tensor([prompt_ids + vanilla.token_ids[:2]])).logits[0, -1]
    top = torch.topk(logits, 2).values
    assert found.index == 2 and found.dtype == "float64"
    assert found.margin == pytest.approx(float(top[0] - top[1]), rel=1e-9)
    verdict = verdict_html({"vanilla": vanilla, "eagle2": other}, True, {"eagle2": replace(found, exact=False)})
    assert "differs from vanilla from token 2" in verdict and "not a rounding near-tie" in verdict
    assert found.exact == engine.exact
    near = Divergence(5, "a", "b", 0.3, "bfloat16").explain("EAGLE-2")
    assert "near-tie in bfloat16" in near and "different texts" in near and "&#x27;a&#x27;" in near
    assert "int4 or int8 weights" in near and "float32" not in near  # float32 products are not row-invariant here either
    exact = Divergence(5, "a", "b", 0.3, "bfloat16", exact=True).explain("EAGLE-2")
    assert "bit for bit" in exact and "please report" in exact and "near-tie" not in exact


def test_verdict_compares_sampled_replies_made_with_one_seed(engine):
    """Compare draws one seed for every mode, which makes the same sample in
    each, so sampled replies are compared token by token too."""
    from app.compare import verdict_html

    messages = [{"role": "user", "content": "w1 w2"}]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10, seed=11)
    replies = {}
    for mode in ("vanilla", "eagle2"):
        steps = list(engine.chat(messages, mode, sampling))
        replies[mode] = Reply(token_ids=[t for step in steps for t in step.token_ids], snapshot=steps[-1].stats)
    assert replies["eagle2"].token_ids == replies["vanilla"].token_ids
    verdict = verdict_html(replies, False, seed=11)
    assert "with seed 11" in verdict and "EAGLE-2 output is identical to vanilla" in verdict
    other = replace(replies["eagle2"], token_ids=replies["vanilla"].token_ids[:3] + [(replies["vanilla"].token_ids[3] + 1) % 60 + 8])
    parted = verdict_html({"vanilla": replies["vanilla"], "eagle2": other}, False, seed=11, exact=False)
    assert "differs from vanilla from token 3" in parted and "different samples" in parted
    assert "please report" in verdict_html({"vanilla": replies["vanilla"], "eagle2": other}, False, seed=11, exact=True)


def test_verdict_names_the_differing_tokens_where_the_margin_cannot_be_measured(engine, monkeypatch):
    """Greedy replies that part, where the margin pass cannot run (Stop after
    EAGLE-2 ended, the queue full): the verdict still names what each mode wrote
    there, and why the margin is missing; where one reply is the start of the
    other, which is longer and what it wrote there."""
    import app.reply

    monkeypatch.setattr(compare_module, "PANE_INTERVAL", 0.0)
    compare, mine = CompareHandlers(Runtime(engine)), tab("mine")
    change = {}

    def follow(queue, engine, messages, mode, *rest, **options):
        for reply in app.reply.follow_reply(queue, engine, messages, mode, *rest, **options):
            if reply.finish_reason is not None and mode == "vanilla":
                change["vanilla"] = reply.token_ids
            if reply.finish_reason is not None and mode == "eagle2":
                change["edit"](reply.token_ids)
                compare.stop(mine)  # pressed as EAGLE-2 ends: the margin pass never gets its turn
            yield reply

    monkeypatch.setattr(compare_module, "follow_reply", follow)
    decode = engine.base.tokenizer.decode

    def compared(edit) -> str:
        change["edit"] = edit
        compare.arm(mine)
        return list(compare.compare("w3 w4", False, False, mine, *values(max_new_tokens=8)))[-1][3]

    verdict = compared(lambda ids: ids.__setitem__(2, (ids[2] + 1) % 60 + 8))
    ours = change["vanilla"][2]
    theirs = (ours + 1) % 60 + 8
    assert "EAGLE-2 output differs from vanilla from token 2: " in verdict
    assert html.escape(f"vanilla wrote {decode([ours])!r}, EAGLE-2 wrote {decode([theirs])!r}") in verdict
    assert "margin there could not be measured (the comparison was stopped before it could be)" in verdict
    verdict = compared(lambda ids: ids.__delitem__(slice(5, None)))  # EAGLE-2's reply is the start of vanilla's
    assert html.escape(f"from token 5: EAGLE-2's reply ends there, vanilla's is longer and wrote {decode(change['vanilla'][5:6])!r} there") in verdict
    # the queue full: the margin pass is refused, saying why
    from app.compare import verdict_html

    runtime = Runtime(engine, max_waiting=1)
    runtime.queue.enter()  # a request waiting
    vanilla = Reply(token_ids=[20, 21, 22], snapshot=Snapshot(3, 3, 0.1, 0.01, 30.0, 1.0, 0.0, 0.0, ()), finish_reason="length")
    other = replace(vanilla, token_ids=[20, 23, 22])
    found = CompareHandlers(runtime)._divergences(engine, [{"role": "user", "content": "w3"}], {"vanilla": vanilla, "eagle2": other}, ["eagle2"])
    verdict = verdict_html({"vanilla": vanilla, "eagle2": other}, True, found)
    assert html.escape(f"vanilla wrote {decode([21])!r}, EAGLE-2 wrote {decode([23])!r}") in verdict
    assert "could not be measured (the model is busy: 1 request is already waiting" in verdict


def test_speedup_never_shows_a_slowdown_as_1x():
    from app.compare import summary_frame, verdict_html

    def reply(tokens_per_s: float) -> Reply:
        return Reply(snapshot=Snapshot(100, 100, 100 / tokens_per_s, 0.01, tokens_per_s, 1.5, 0.0, 0.0, ()), finish_reason="length")

    for eagle2, shown in ((99.6, "0.996x"), (99.98, "0.999x"), (99.4, "0.99x"), (100.0, "1.00x"), (100.4, "1.00x"), (152.0, "1.52x")):
        verdict = verdict_html({"vanilla": reply(100.0), "eagle2": reply(eagle2)}, True)
        assert f"<b id='verdict-speedup'>{shown}</b>" in verdict and f'id="verdict-eagle2-speedup">{shown}<' in verdict
        result = {"modes": {"vanilla": {"tokens": 100, "seconds": 1.0, "tokens_per_s": 100.0},
                            "eagle2": {"tokens": 100, "seconds": 1.0, "tokens_per_s": eagle2}}}  # fmt: skip
        assert summary_frame(result)["speedup"].tolist() == [1.0, float(shown.removesuffix("x"))]


def test_stop_while_waiting_for_the_model_gives_the_message_back(handlers):
    assert is_skip(handlers.stop(new_chat()))  # nothing to stop
    chat = new_chat()
    with handlers.runtime.queue.turn():  # another request holds the model
        updates = handlers.send("w1 w2", chat, "", *values())
        next(updates)  # the pending reply is shown; its decoding waits for a turn
        assert "Stopping..." in handlers.stop(chat)  # said at once
        final = list(updates)[-1]
    assert "Stopped before the reply started" in final[3] and final[0] == "w1 w2" and final[2]["messages"] == []
    assert handlers.runtime.queue.waiting == 0


def test_a_closed_tab_s_waiting_request_no_longer_holds_its_chat(handlers):
    """Send or Regenerate marks its chat busy at the click while it waits for
    the model; a tab closed meanwhile never starts it, and its unload frees the chat."""
    chat = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    with handlers.runtime.queue.turn():  # another reply is being written
        assert handlers.check_idle(chat, SimpleNamespace(session_hash="tab-1"))[1] is False  # Regenerate pressed in tab 1
        assert handlers._busy(chat) and "being written" in handlers.edit_last(chat, True)[3]
        handlers.forget_session(SimpleNamespace(session_hash="tab-2"))  # another tab closed: still waiting
        assert handlers._busy(chat)
        handlers.forget_session(SimpleNamespace(session_hash="tab-1"))  # tab 1 closed before its turn came
        assert not handlers._busy(chat) and handlers.edit_last(chat, True)[0] == "w1"


def test_send_accepts_at_once_and_a_stop_before_its_turn_holds(handlers, store):
    """Send's first step (accept) saves the message and resets Stop, so a Stop
    pressed while the reply waits for the model stops it, and an old Stop does not."""
    chat = new_chat()
    handlers.stop(chat)  # pressed earlier, with nothing running
    box, pending, shown_chat, chat, _ = handlers.accept(" w1 w2 ", chat, True)
    assert box == "" and pending.endswith(":w1 w2") and [m["content"] for m in store.load_chat(chat["id"])["messages"]] == ["w1 w2"]
    assert "w1 w2" in str(shown_chat)
    final = list(handlers.send(pending, chat, "", *values(max_new_tokens=8)))[-1]
    assert final[2]["messages"][-1]["role"] == "assistant"  # the old Stop did not cancel it

    chat = new_chat()
    _, pending, _, chat, _ = handlers.accept("w3", chat, True)
    handlers.stop(chat)  # while it waits for its turn
    final = list(handlers.send(pending, chat, "", *values(max_new_tokens=8)))[-1]
    assert final[0] == "w3" and "Stopped before the reply started" in final[3]
    assert store.load_chat(chat["id"]) is None  # the message went back to the box, not left saved alone

    chat = list(handlers.send("w4", new_chat(), "", *values(max_new_tokens=8)))[-1][2]
    handlers.stop(chat)  # pressed earlier: Regenerate's click releases it
    assert handlers.check_idle(chat)[1] is False
    chat = list(handlers.regenerate(chat, False, "", *values(max_new_tokens=8)))[-1][2]
    assert chat["messages"][-1]["stats"]["finish_reason"] == "length"
    assert handlers.check_idle(chat)[1] is False
    handlers.stop(chat)  # pressed while Regenerate waits for its turn
    updates = list(handlers.regenerate(chat, False, "", *values(max_new_tokens=8)))
    final = updates[-1]
    assert "Stopped before the reply started" in final[3] and final[2]["messages"] == chat["messages"]  # the reply kept
    assert all(is_skip(update[0]) for update in updates)  # what is typed in the box meanwhile stays there
    _, pending, _, chat, _ = handlers.accept("w5", chat, True)
    assert all(is_skip(update[0]) for update in handlers.send(pending, chat, "", *values(max_new_tokens=8)))  # the next draft too


def test_clear_and_delete_of_a_chat_without_messages_say_there_is_nothing_to_remove(handlers, store):
    assert "nothing to clear" in handlers.clear(new_chat())[-1] and "nothing to delete" in handlers.delete(new_chat())[-1]
    assert "nothing to delete" in handlers.delete(None)[-1]


def test_clear_new_and_edit_wait_for_the_reply_being_written(handlers, store):
    chat = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=8)))[-1][2]
    stream = handlers.send("w2", chat, "", *values(max_new_tokens=200, mode="vanilla"))
    writing = next(stream)[2]
    next(stream)  # the decoding has started (a Stop before that would give the message back)
    for outcome in (handlers.clear(writing), handlers.new(writing, ""), handlers.edit_last(writing, True),
                    handlers.delete(writing), handlers.open(chat["id"], writing, True), handlers.check_idle(writing)[:1]):  # fmt: skip
        assert "A reply is being written" in outcome[-1]
    assert handlers.check_idle(writing)[1] is True  # Regenerate, refused at once: it would wait, then replace the reply
    assert all(is_skip(update) for update in next(handlers.regenerate(writing, True, "", *values()))[:4])
    assert store.load_chat(writing["id"]) is not None  # Delete waited
    assert "A reply is being written" in list(handlers.send("w3", writing, "", *values()))[-1][3]
    handlers.stop(writing)
    final = list(stream)[-1][2]
    assert [m["content"] for m in final["messages"]][:3] == ["w1", final["messages"][1]["content"], "w2"]
    assert handlers.clear(final)[-1] == ""  # once it is written


def test_session_tau_shows_before_a_reply_and_the_tree_slider_at_1_is_named(handlers):
    assert 'id="stat-tau-session">2.50<' in render.stats_html(None, 0, 2.5)
    from core.stats import Snapshot

    live = Snapshot(8, 6, 1.0, 0.1, 8.0, 1.33, draft_seconds=0.01, verify_seconds=0.9, acceptance_by_depth=())
    assert 'id="stat-share">- (nothing drafted)<' in render.stats_html(live, 1, None)  # vanilla: no draft share
    drafted = Snapshot(8, 4, 1.0, 0.1, 8.0, 2.0, draft_seconds=0.1, verify_seconds=0.9, acceptance_by_depth=(0.5,), mean_tree_size=4.0)
    assert 'id="stat-share">10% / 90%<' in render.stats_html(drafted, 4, None)
    final = list(handlers.send("w1", new_chat(), "", *values(total_tokens=1)))[-1]
    assert "Tree: tokens verified per step" in final[3] and final[0] == "w1"


def test_the_chat_s_tau_counts_its_drafted_replies_only(handlers):
    """A vanilla reply's tau is 1 whatever the head: counted in, it pulled the
    chat's figure towards 1, and switching modes made it a figure of neither."""
    import re

    def chat_tau(panel: str) -> str:
        return re.search(r'id="stat-tau-session">([^<]*)<', panel).group(1)

    final = list(handlers.send("w1", new_chat(), "", *values(mode="eagle2")))[-1]
    chat, panel = final[2], final[4]
    drafted = dict(chat["session"])
    assert drafted["forwards"] > 0 and chat_tau(panel) == f"{drafted['tokens'] / drafted['forwards']:.2f}"
    assert drafted["tokens"] > drafted["forwards"]  # the random head's drafts are sometimes taken, so tau > 1
    steps = list(handlers.send("w2", chat, "", *values(mode="vanilla")))
    assert all(chat_tau(step[4]) == chat_tau(panel) for step in steps if isinstance(step[4], str))  # live too
    assert steps[-1][2]["session"] == drafted


def test_a_fixed_tree_bigger_than_its_depth_and_top_k_can_draft_is_said(handlers):
    """60 tokens at depth 2 and top-k 2: the head drafts at most 1 + 2 + 4 nodes, and the notice says so."""
    updates = list(handlers.send("w1", new_chat(), "", *values(total_tokens=60, depth=2, tree_top_k=2, max_new_tokens=4)))
    notice = html.unescape(" ".join(u[3] for u in updates if isinstance(u[3], str)))
    assert '"Tree: tokens verified per step" 60 is more than "Tree: depth" 2' in notice and "at most 7 tokens" in notice
    assert updates[-1][2]["messages"][-1]["stats"]["tokens"] == 4  # the reply is written all the same
    fits = list(handlers.send("w1", new_chat(), "", *values(total_tokens=7, depth=2, tree_top_k=2, max_new_tokens=4)))
    assert not any("is more than" in u[3] for u in fits if isinstance(u[3], str))


def test_a_chat_cleared_in_one_tab_and_continued_in_another_keeps_both(handlers, store):
    """Tab B clears a chat that tab A shows too; A goes on with it (saving it
    again), then B writes in its emptied view: B's message starts a chat of its
    own instead of replacing A's."""
    first = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    tab_a = tab_b = first
    tab_b = handlers.clear(tab_b)[1]
    tab_a = list(handlers.send("w2", tab_a, "", *values(max_new_tokens=4)))[-1][2]
    tab_b = list(handlers.send("w3", tab_b, "", *values(max_new_tokens=4)))[-1][2]
    assert [m["content"] for m in store.load_chat(first["id"])["messages"] if m["role"] == "user"] == ["w1", "w2"]
    assert [m["content"] for m in store.load_chat(tab_b["id"])["messages"] if m["role"] == "user"] == ["w3"]


def test_a_page_open_across_a_server_restart_continues_the_chat_it_shows(handlers, engine, store):
    """The server's chat state goes with the server; the id the page keeps
    names the chat, so Send continues it instead of starting a new one."""
    chat = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    assert handlers.shown_marks(chat) == (chat["id"], "") and handlers.shown_marks(None) == ("", "")
    restarted = ChatHandlers(Runtime(engine), Store(store.folder))
    _, pending, shown, state, notice = restarted.accept("w2", None, True, chat["id"])
    assert state["id"] == chat["id"] and [m["content"] for m in state["messages"]] == [m["content"] for m in chat["messages"]]
    assert "another tab" not in notice and "w1" in str(shown)
    final = list(restarted.send(pending, state, "", *values(max_new_tokens=4)))[-1][2]
    assert final["id"] == chat["id"] and [m["role"] for m in store.load_chat(chat["id"])["messages"]] == ["user", "assistant"] * 2
    _, _, _, state, _ = restarted.accept("w3", None, True, new_chat()["id"])  # a new chat never saved: a new chat still
    assert state["messages"] == []
    # the other buttons (Edit, Clear, Delete, Regenerate, Export, Earlier reply) first take the saved chat back the same way
    assert restarted.recover(None, chat["id"])["id"] == chat["id"]
    assert restarted.recover(None, new_chat()["id"]) == gr.skip() and restarted.recover(final, chat["id"]) == gr.skip()


def test_an_edited_message_sent_across_a_server_restart_replaces_what_edit_took_back(handlers, engine, store):
    """Edit takes the last exchange back in the chat state, which a server
    restart loses; the page's mark of it (count and digest) still names it, so
    the edited message replaces it rather than following it. Where the saved
    chat has changed since (another tab sent), the mark names nothing there
    and the message follows what is saved: nothing is replaced."""
    chat = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    chat = list(handlers.send("w2", chat, "", *values(max_new_tokens=4)))[-1][2]
    text, _, edited, _ = handlers.edit_last(chat, True)
    shown, mark = handlers.shown_marks(edited)
    assert text == "w2" and shown == chat["id"] and mark.startswith("2 ")
    restarted = ChatHandlers(Runtime(engine), Store(store.folder))
    assert [m["content"] for m in restarted.recover(None, shown, mark)["messages"] if m["role"] == "user"] == ["w1"]
    _, pending, _, state, notice = restarted.accept("w2 changed", None, True, shown, mark)
    assert "another tab" not in notice and state["id"] == chat["id"]
    list(restarted.send(pending, state, "", *values(max_new_tokens=4)))
    users = [m["content"] for m in store.load_chat(chat["id"])["messages"] if m["role"] == "user"]
    assert users == ["w1", "w2 changed"]
    _, _, edited, _ = restarted.edit_last(store.load_chat(chat["id"]), True)
    mark = restarted.shown_marks(edited)[1]
    other_tab = list(restarted.send("w3", store.load_chat(chat["id"]), "", *values(max_new_tokens=4)))[-1][2]
    again = ChatHandlers(Runtime(engine), Store(store.folder))
    assert again.recover(None, chat["id"], mark)["messages"] == other_tab["messages"]  # the mark names nothing saved now
    assert again.recover(None, chat["id"], "2 0000") == again.recover(None, chat["id"], "x") == again.recover(None, chat["id"], "")
    assert again.recover(None, chat["id"], "\u00b2 x") == again.recover(None, chat["id"], "")  # a mark the page did not write


def test_send_pressed_twice_in_one_tab_is_one_send_also_for_a_chat_another_tab_changed(handlers, engine, store):
    """Both presses carry the same text: the second does nothing, whether the
    first continued the chat or went on as a copy of it. Another text, or
    another tab, is a send of its own."""
    tab = types.SimpleNamespace(session_hash="tab-a")
    shown = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    list(ChatHandlers(Runtime(engine), store).send("w2", shown, "", *values(max_new_tokens=4)))  # another tab extends it
    first = handlers.accept("w3", shown, True, "", request=tab)
    assert first[1].endswith(":w3") and first[3]["id"] != shown["id"]  # a copy
    with pytest.raises(gr.Error):  # unseen, it ends the second press's events: no send of its own
        handlers.accept("w3", shown, True, "", request=tab)
    sends = [list(handlers.send(first[1], first[3], "", *values(max_new_tokens=4))) for _ in range(2)]  # both presses' sends
    assert sends[0][-1][2]["messages"][-1]["role"] == "assistant" and all(output == gr.skip() for output in sends[1][-1][:4])
    copies = [chat for chat in store.list_chats() if chat["id"] not in (shown["id"],)]
    assert len(copies) == 1
    assert handlers.accept("w4", shown, True, "", request=tab)[1].endswith(":w4")  # another message: sent
    assert handlers.accept("w3", first[3], True, "", request=types.SimpleNamespace(session_hash="tab-b"))[1].endswith(":w3")


def test_a_chat_changed_in_another_tab_goes_on_as_a_copy(handlers, store):
    """Two tabs show the same saved chat; one sends. When the other sends next,
    its view is out of date: it continues as a new chat, and the first tab's
    messages stay as they were on disk."""
    first = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=6)))[-1][2]
    tab_a = tab_b = first  # both tabs restored the latest chat
    _, pending, _, tab_a, notice = handlers.accept("w2", tab_a, True)
    assert tab_a["id"] == first["id"] and "another tab" not in notice
    tab_a = list(handlers.send(pending, tab_a, "", *values(max_new_tokens=6)))[-1][2]
    _, pending, _, tab_b, notice = handlers.accept("w3", tab_b, True)
    assert tab_b["id"] != first["id"] and "changed in another tab" in notice
    final = list(handlers.send(pending, tab_b, "", *values(max_new_tokens=6)))[-1]
    tab_b = final[2]
    assert "changed in another tab" in final[3]  # said again with the reply
    assert [m["content"] for m in store.load_chat(first["id"])["messages"] if m["role"] == "user"] == ["w1", "w2"]
    assert [m["content"] for m in store.load_chat(tab_b["id"])["messages"] if m["role"] == "user"] == ["w1", "w3"]
    _, _, _, same, notice = handlers.accept("w4", tab_a, True)  # tab A's view is what is saved: no copy
    assert same["id"] == first["id"] and notice == ""


def test_a_chat_whose_message_waits_for_the_model_is_busy_too(handlers, store):
    """Another chat's reply holds the model; this chat's message is accepted
    and waits. Until its reply starts, opening another chat, New, Delete,
    Clear, Edit and Regenerate are refused: its reply would land in the chat
    shown then, or bring back what was deleted."""
    other = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=6)))[-1][2]
    waiting = list(handlers.send("w2", new_chat(), "", *values(max_new_tokens=6)))[-1][2]
    writing = handlers.send("w3", other, "", *values(max_new_tokens=200, mode="vanilla"))
    next(writing)  # the other chat's reply is being written
    _, pending, _, waiting, _ = handlers.accept("w4", waiting, True)
    for outcome in (handlers.open(other["id"], waiting, True), handlers.new(waiting, ""), handlers.delete(waiting),
                    handlers.clear(waiting), handlers.edit_last(waiting, True), handlers.check_idle(waiting)[:1]):  # fmt: skip
        assert "A reply is being written" in outcome[-1]
    handlers.stop(other)
    list(writing)
    final = list(handlers.send(pending, waiting, "", *values(max_new_tokens=4)))[-1][2]
    assert [m["content"] for m in store.load_chat(waiting["id"])["messages"] if m["role"] == "user"] == ["w2", "w4"]
    assert handlers.clear(final)[-1] == ""  # its reply written: free again


def test_regenerate_and_edit_in_a_tab_with_an_old_view_are_refused(handlers, store):
    """Tab B shows a chat that tab A has since continued: its Regenerate or Edit
    would save B's older copy over A's turn (or, for Edit, delete the chat)."""
    first = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=6)))[-1][2]
    tab_a = list(handlers.send("w2", first, "", *values(max_new_tokens=6)))[-1][2]
    assert "changed in another tab" in next(handlers.regenerate(first, False, "", *values()))[3]
    assert "changed in another tab" in handlers.edit_last(first, True)[3]
    assert store.load_chat(first["id"])["messages"] == json.loads(json.dumps(tab_a["messages"]))
    assert len(list(handlers.regenerate(tab_a, False, "", *values(max_new_tokens=4)))[-1][2]["messages"]) == 4


def test_unreadable_chats_and_settings_are_named_at_load_and_kept(handlers, store):
    """Chat files that cannot be read (cut short, nested too deep for Python's
    reader, not a chat) are named and left alone; a settings file that cannot
    be read is set aside before a setting changes, so nothing overwrites it."""
    good = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    folder = store.chat_path("x").parent
    damaged = {"cut.json": '{"messages": [{"role": "us', "deep.json": "[" * 100_000 + "]" * 100_000,
               "list.json": "[]", ".hidden.json": json.dumps(store.load_chat(good["id"]))}  # fmt: skip
    for name, text in damaged.items():
        (folder / name).write_text(text)
    (store.folder / "settings.json").write_text('{"temperature": 0.7, "system": "be br')
    restored = handlers.restore()
    notice = restored[-1]
    assert [chat_id for _, chat_id in restored[-3]["choices"]] == [good["id"]]  # the good chat, and no dotted name
    assert "3 saved chats cannot be read" in notice
    assert "cut.json (not valid JSON: Unterminated string starting at: line 1 column 24), deep.json (not valid JSON: nested too deep), " \
           "list.json (not a chat: a JSON object is expected)" in notice
    assert "The saved settings could not be read" in notice and "settings.damaged-" in notice
    kept = list(store.folder.glob("settings.damaged-*.json"))
    assert len(kept) == 1 and kept[0].read_text() == '{"temperature": 0.7, "system": "be br'
    handlers.remember("w2", "", *values())
    assert kept[0].read_text() == '{"temperature": 0.7, "system": "be br'  # the new settings went to settings.json
    assert store.load_settings()["system"] == "w2"
    assert all((folder / name).read_text() == text for name, text in damaged.items())
    again = handlers.restore()[-1]
    assert "3 saved chats cannot be read" in again and "settings" not in again
    (store.folder / "settings.json").write_text('{"temperature": 0.5,')  # damaged while the page is open
    handlers.new(None, "")  # a change saved (the chat shown): the damaged file set aside, silently until now
    assert len(list(store.folder.glob("settings.damaged-*.json"))) == 2
    told = handlers.restore()[-1]
    assert "The saved settings could not be read" in told and "settings.damaged-" in told
    assert "settings" not in handlers.restore()[-1]  # said once


def test_a_chat_file_nested_too_deep_to_copy_is_refused_at_import_and_named_at_load(handlers, store, tmp_path):
    """Valid JSON that Python reads, with a value nested some hundreds deep,
    would fail every Send (copying it exceeds Python's recursion limit): refused
    as a chat, named with the reason; a file nested as deep as Kestrel's own is not."""
    export = tmp_path / "deep.json"
    text = '{"messages": [{"role": "user", "content": "w1", "extra": %s}]}'
    export.write_text(text % ("[" * 500 + "]" * 500))
    notice = handlers.import_chat(str(export), new_chat(), True)[-1]
    assert "deep.json is not a chat" in notice and "nested more than 64 levels deep; nothing was imported" in notice
    assert store.list_chats() == []
    store.chat_path("x").parent.mkdir(parents=True)
    store.chat_path("20250101-000000-abcdef").write_text(export.read_text())
    assert "20250101-000000-abcdef.json (not a chat: it holds values nested more than 64 levels deep)" in handlers.restore()[-1]
    export.write_text(text % ("[" * 20 + "]" * 20))
    _, imported, *_, notice = handlers.import_chat(str(export), new_chat(), True)
    assert "Imported deep.json" in notice and handlers.accept("w2", imported, True)[3]["id"] == imported["id"]


@pytest.mark.skipif(os.name == "nt", reason="Windows keeps a backslash out of file names")
def test_a_chat_file_named_as_no_chat_can_be_is_named_at_load_not_a_failed_page(handlers, store):
    """A file copied into the chats folder under a name that the store refuses
    as a chat's id (here a backslash, as a Windows path copied by hand leaves
    it): the page loads, naming it as a file it cannot open."""
    folder = store.chat_path("x").parent
    folder.mkdir(parents=True)
    (folder / "my\\chat.json").write_text(json.dumps({**new_chat(), "messages": [{"role": "user", "content": "w1"}]}))
    restored = handlers.restore()
    assert restored[-3]["choices"] == [] and "my\\chat.json (not a name Kestrel can open)" in restored[-1]


def test_a_settings_file_is_set_aside_only_when_damaged_and_never_replaced(handlers, store, monkeypatch):
    path = store.folder / "settings.json"
    store.folder.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b'\xef\xbb\xbf{"temperature": 0.7}')  # a byte order mark, as some editors save
    assert store.load_settings() == {"temperature": 0.7} and store.set_aside_damaged_settings() is None
    original = Path.read_text

    def busy(self, *args, **kwargs):  # a read that fails for a moment is not damage
        if self.name == "settings.json":
            raise PermissionError(13, "Permission denied")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", busy)
    assert store.set_aside_damaged_settings() is None and path.exists()
    # nor is it replaced by the one change a chat opened saves (read as {}, the other settings were lost)
    assert "settings could not be saved" in handlers.remember("w1", "", *values())
    handlers._update_settings({"open_chat": "x"})
    monkeypatch.undo()
    assert json.loads(path.read_text(encoding="utf-8-sig")) == {"temperature": 0.7}
    path.write_text('{"temperature": 0.')

    def held(*args):  # renaming fails (another program holds the file)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", held)
    assert "settings.json" in handlers.restore()[-1] and "cannot be read" in handlers.restore()[-1]
    assert "settings could not be saved" in handlers.remember("w1", "", *values())
    assert path.read_text() == '{"temperature": 0.' and not list(store.folder.glob("settings.damaged-*"))


def test_a_damaged_message_or_time_in_a_chat_file_does_not_break_the_page(handlers, store):
    """Segments that are not [text, origin] pairs of the content are dropped
    (the text shows uncoloured); a time that is NaN or past year 9999 sorts last."""
    folder = store.chat_path("x").parent
    folder.mkdir(parents=True, exist_ok=True)
    reply = {"role": "assistant", "content": "a", "segments": [["a"]]}
    for name, extra in (("segments", {}), ("huge", {"updated": 1e11}), ("nan", {"updated": float("nan")})):  # 1e11: year 5138
        chat = {"title": name, "messages": [{"role": "user", "content": "q"}, reply if name == "segments" else {"role": "assistant", "content": "a"}]}
        (folder / f"{name}.json").write_text(json.dumps({**chat, **extra}))
    assert "segments" not in store.load_chat("segments")["messages"][1]
    good = {"role": "assistant", "content": "ab", "segments": [["a", "draft"], ["b", "base"]]}
    (folder / "good.json").write_text(json.dumps({"messages": [good], "updated": 5.0}))
    assert store.load_chat("good")["messages"][0]["segments"] == good["segments"]
    later = {"role": "assistant", "content": "abc", "segments": [["a", "draft"], ["b", "lookup"], ["c", "base"]]}
    (folder / "later.json").write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, later], "updated": 6.0}))
    opened = store.load_chat("later")
    assert opened["messages"][1]["segments"] == later["segments"]  # a later version's origin: kept, and shown uncoloured
    assert 'class="kd"' in render.message_html(opened["messages"][1], True) and "b</span>" not in render.message_html(opened["messages"][1], True)
    store.save_chat(opened)
    assert store.load_chat("later")["messages"][1]["segments"] == later["segments"]
    assert store.load_chat("nan")["updated"] == 0.0 and store.load_chat("huge")["updated"] == 0.0
    restored = handlers.restore()
    assert len(restored[-3]["choices"]) == 5 and restored[-4]["messages"]  # the page loads, with every chat listed
    for name in ("segments", "huge", "nan"):
        assert "a" in str(handlers.open(name, new_chat(), True)[0])


def test_a_read_only_data_folder_still_replies_and_says_what_was_not_saved(handlers, store, monkeypatch):
    def refuse(*args):
        raise OSError(30, "Read-only file system")

    for name in ("save_chat", "save_settings", "delete_chat"):
        monkeypatch.setattr(store, name, refuse)
    final = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1]
    assert [m["role"] for m in final[2]["messages"]] == ["user", "assistant"]
    assert "could not be saved" in final[3] and "Read-only" in final[3]
    for outcome in (handlers.delete(final[2]), handlers.clear(final[2])):
        assert "could not be changed" in outcome[-1] and "Read-only" in outcome[-1]
    assert handlers.edit_last(final[2], True)[0] == "w1"  # Edit writes nothing until the edited message is sent
    assert "settings could not be saved" in handlers.remember("w2", "", *values(temperature=0.5)) and "Read-only" in handlers.remember("", "", *values())
    monkeypatch.undo()
    assert handlers.remember("w2", "", *values()) == gr.skip()  # saved: the notice is left as it is


def test_a_start_after_an_update_does_not_pass_the_older_running_kestrel_off_as_itself(tmp_path, capsys, monkeypatch):
    """A start whose code differs from the running Kestrel's (files updated
    since it started, or another copy of Kestrel) says so and opens nothing;
    the same code opens the running page, as before."""
    from app import instance
    from app.instance import DataLock, code_stamp, tell_running

    root = tmp_path / "kestrel"
    (root / "core").mkdir(parents=True)
    (root / "core" / "engine.py").write_text("")
    before = code_stamp(root)
    os.utime(root / "core" / "engine.py", ns=(time.time_ns() + 10**9,) * 2)  # an update's newer file
    assert code_stamp(root) != before and code_stamp(root).endswith(str(root))
    held = DataLock(tmp_path)
    assert held.acquire()
    held.announce("http://127.0.0.1:7860/")
    opened = []
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.setattr(instance.webbrowser, "open", opened.append)
    assert tell_running(DataLock(tmp_path), tmp_path, no_browser=False) == 0 and opened == ["http://127.0.0.1:7860/"]
    capsys.readouterr()
    monkeypatch.setattr(instance, "code_stamp", lambda: f"{time.time_ns()} {instance.ROOT}")  # this copy, updated since
    assert tell_running(DataLock(tmp_path), tmp_path, no_browser=False) == 1 and len(opened) == 1
    out = capsys.readouterr().out
    assert "Another Kestrel, started before this one's files were updated, is running at http://127.0.0.1:7860/" in out and "Close it" in out
    monkeypatch.setattr(instance, "code_stamp", lambda: f"1 {root}")  # another copy of Kestrel
    assert tell_running(DataLock(tmp_path), tmp_path, no_browser=True) == 1
    assert f"Another Kestrel, from {instance.ROOT}, is running" in capsys.readouterr().out
    held.release()
    (tmp_path / "kestrel.lock").write_text("http://127.0.0.1:7860/")  # as a Kestrel from before the stamps announced itself
    assert tell_running(DataLock(tmp_path), tmp_path, no_browser=False) == 1 and len(opened) == 1
    assert "started before this one's files were updated" in capsys.readouterr().out
    (root / "core" / "training").mkdir()
    (root / "core" / "training" / "trainer.py").write_text("")
    later = code_stamp(root).partition(" ")[0]
    newest = int(later) + 10**10
    os.utime(root / "core" / "training" / "trainer.py", ns=(newest, newest))
    assert code_stamp(root) == f"{newest} {root}"  # a file in a subfolder counts too


def test_one_running_page_per_data_folder(tmp_path, capsys, monkeypatch):
    """A second start on the same data folder (a double-click twice) does not
    serve a second page that would save over the first one's chats: it names
    the running one's address and opens it. The lock ends with its holder."""
    from app import instance, ui
    from app.instance import DataLock

    first = DataLock(tmp_path)
    assert first.acquire()
    first.announce("http://127.0.0.1:7860/")
    assert not DataLock(tmp_path).acquire() and DataLock(tmp_path).holder() == "http://127.0.0.1:7860/"
    opened = []
    monkeypatch.setenv("DISPLAY", ":0")  # a desktop session, where a browser is started
    monkeypatch.setenv("KESTREL_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(instance.webbrowser, "open", opened.append)
    monkeypatch.setattr("app.session.load_pair", lambda *a, **k: pytest.fail("a second start must not load a model"))
    args = SimpleNamespace(install_shortcut=False, listen=False, auth=None, api_key=None, allow_origin=[], threads=None, no_browser=False)
    assert ui.serve(args) == 0
    assert opened == ["http://127.0.0.1:7860/"] and "already running at http://127.0.0.1:7860/" in capsys.readouterr().out
    # the command line answers before importing the page (gradio, torch: 15 s or more on a first start's cold disk)
    code = "import sys; from app.cli import main; code = main(['ui', '--no-browser']); print('imported:', 'gradio' in sys.modules, 'torch' in sys.modules)"
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent)
    assert "already running at http://127.0.0.1:7860/" in second.stdout and "imported: False False" in second.stdout, second.stdout + second.stderr
    first.release()  # the first one ended (a crash too: the OS drops its lock)
    again = DataLock(tmp_path)
    assert again.acquire() and again.holder() == ""  # the old address is gone while this one starts
    again.release()


def test_a_failed_save_names_the_file_meant_and_leftovers_are_removed_at_start(store, tmp_path, monkeypatch):
    """A save refused by the disk names the chat file, not the hidden temporary
    one it was writing; temporary files left by a killed save are removed when
    a page starts (it then holds the data folder alone)."""
    import tempfile

    from app.store import remove_leftovers

    def refused(*args, **kwargs):
        raise OSError(30, "Read-only file system", str(store.chat_path("x").parent / ".x.json.abc.tmp"))

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    with pytest.raises(OSError) as error:
        store.save_chat({**new_chat(), "id": "x", "messages": [{"role": "user", "content": "w1"}]})
    assert error.value.filename == str(store.chat_path("x")) and ".tmp" not in str(error.value)
    monkeypatch.undo()
    store.save_chat({**new_chat(), "id": "x", "messages": [{"role": "user", "content": "w1"}]})
    left = [store.chat_path("x").parent / ".x.json.k1l2.tmp", store.folder / ".settings.json.q9.tmp"]
    for path in left:
        path.write_text("{")
    remove_leftovers(store.folder)
    assert not any(path.exists() for path in left) and store.load_chat("x")["messages"]


def test_a_data_folder_that_cannot_be_saved_to_is_named_when_the_page_loads(handlers, store, monkeypatch):
    """Said at page load, not only at the first save: a file where the chats
    folder belongs, a folder where the settings file belongs, a read-only folder."""
    store.folder.mkdir(parents=True)
    assert store.write_problem() is None and "cannot be saved" not in handlers.restore()[-1]
    (store.folder / "chats").write_text("")
    assert "chats is a file, not a folder" in handlers.restore()[-1] and "a closed page loses them" in handlers.restore()[-1]
    (store.folder / "chats").unlink()
    (store.folder / "settings.json").mkdir()
    assert "settings.json is a folder, not a file" in handlers.restore()[-1]
    (store.folder / "settings.json").rmdir()
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # a read-only file system (root may write anywhere else)
    assert f"{store.folder} cannot be written" in handlers.restore()[-1]


def test_folders_set_with_a_tilde_are_in_the_home_folder(monkeypatch):
    from app.instance import data_dir
    from models.bundled import cache_root

    monkeypatch.setenv("KESTREL_DATA_DIR", "~/kestrel-chats")
    monkeypatch.setenv("KESTREL_CACHE_DIR", "~/kestrel-cache")
    assert data_dir() == Path.home() / "kestrel-chats" and cache_root() == Path.home() / "kestrel-cache"


def test_a_new_data_folder_that_cannot_be_made_is_named_before_a_save(tmp_path, monkeypatch):
    """A KESTREL_DATA_DIR not made yet is made at the first save, in the nearest folder that exists: where that
    cannot be written (or is a file), the page says so at load rather than at the first message."""
    assert Store(tmp_path / "new" / "data").write_problem() is None
    (tmp_path / "file").write_text("x")
    assert "cannot be made" in Store(tmp_path / "file" / "data").write_problem()
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)  # a read-only folder (root may write anywhere)
    assert f"{tmp_path / 'new' / 'data'} cannot be made ({tmp_path} cannot be written)" == Store(tmp_path / "new" / "data").write_problem()


def test_saved_settings_that_are_not_valid_are_named_at_page_load(handlers, store):
    store.save_settings({"temperature": "hot", "max_new_tokens": 1e9, "colour": "yes", "top_p": 0.5})
    notice = handlers.restore()[-1]
    assert "not valid" in notice and "Temperature, Max new tokens, colour" in notice and "Top-p" not in notice
    store.save_settings({"temperature": 0.5})
    assert "not valid" not in handlers.restore()[-1]


def test_a_reply_cut_short_by_a_crash_is_said_when_its_chat_opens(handlers, store):
    chat = {**new_chat(), "messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2",
            "stats": {"tokens": 1, "finish_reason": "interrupted"}}]}  # fmt: skip
    store.save_chat(chat)
    assert "cut short" in handlers.open(chat["id"], new_chat(), True)[-1] and "cut short" in handlers.restore()[-1]
    handlers.replying[chat["id"]] = True  # its reply, saved as it is written, is on its way (in another tab)
    for notice in (handlers.open(chat["id"], new_chat(), True)[-1], handlers.restore()[-1]):
        assert "cut short" not in notice and "is still being written" in notice  # not shown as the whole reply
    del handlers.replying[chat["id"]]
    chat["messages"][-1]["stats"]["finish_reason"] = "length"
    store.save_chat(chat)
    assert "cut short" not in handlers.open(chat["id"], new_chat(), True)[-1]


def test_a_message_left_without_a_reply_is_said_unless_its_reply_is_on_its_way(handlers, store):
    """A message saved at Send whose reply never began (the page reloaded while
    a long prompt was read, or the server stopped): opening or reloading its
    chat says so and how to get one; not while its reply is being written."""
    chat = {**new_chat(), "messages": [{"role": "user", "content": "w1"}]}
    store.save_chat(chat)
    assert "has no reply" in handlers.open(chat["id"], new_chat(), True)[-1] and "has no reply" in handlers.restore()[-1]
    handlers.replying[chat["id"]] = True  # written in another tab now
    try:
        assert "has no reply" not in handlers.restore()[-1]
    finally:
        handlers.replying.pop(chat["id"])
    chat["messages"].append({"role": "assistant", "content": "w2", "stats": {"tokens": 1, "finish_reason": "stop"}})
    store.save_chat(chat)
    assert "has no reply" not in handlers.open(chat["id"], new_chat(), True)[-1]


def test_a_data_folder_that_cannot_be_written_still_starts_the_page(tmp_path):
    """No lock can be taken where nothing can be written (a read-only folder,
    a file in the folder's place): the page starts and names the problem."""
    from app.instance import DataLock

    (tmp_path / "file").write_text("")
    lock = DataLock(tmp_path / "file")
    assert lock.acquire() and lock.holder() == ""
    lock.announce("http://127.0.0.1:7860/")  # nothing to write to: no error
    assert "is a file, not a folder" in Store(tmp_path / "file").write_problem()


def test_deleting_a_chat_never_saved_works_in_a_read_only_folder(store, monkeypatch):
    """A read-only file system refuses unlink even for a file that is not there
    (EROFS before ENOENT): a chat with nothing on disk is deleted all the same."""
    from pathlib import Path

    real = Path.unlink

    def read_only(path, missing_ok=False):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(Path, "unlink", read_only)
    store.delete_chat("never-saved")  # nothing to delete: no error
    monkeypatch.setattr(Path, "unlink", real)
    store.save_chat({**new_chat(), "id": "saved", "messages": [{"role": "user", "content": "w1"}]})
    assert store.chat_path("saved").exists()
    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(OSError, match="Read-only"):
        store.delete_chat("saved")  # a saved chat that stays on disk is still an error to report


def test_after_a_failed_save_regenerate_and_edit_still_work_and_blame_no_other_tab(handlers, store, monkeypatch):
    chat = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "save_chat", full)
    final = list(handlers.send("w2", chat, "", *values(max_new_tokens=4)))[-1]
    assert "could not be saved" in final[3]
    edited = handlers.edit_last(final[2], True)
    assert edited[0] == "w2" and "another tab" not in edited[3]
    assert "another tab" not in handlers.accept("w3", final[2], True)[4]
    regenerated = list(handlers.regenerate(final[2], False, "", *values(max_new_tokens=4)))[-1]
    assert "another tab" not in regenerated[3] and len(regenerated[2]["messages"]) == 4


def test_the_server_stopping_mid_reply_keeps_the_message_and_the_reply_so_far(handlers, store, monkeypatch):
    """Ctrl+C on the server fails the decoding with ServerStopping: kept as a
    stopped reply, as Stop and a closed page keep it, not deleted as a failure."""
    from app.decoding import ServerStopping

    real = chat_module.follow_reply

    def stopping(*args, **kwargs):
        for count, reply in enumerate(real(*args, **kwargs)):
            yield reply
            if count == 3:
                raise ServerStopping("the server is stopping")

    monkeypatch.setattr(chat_module, "follow_reply", stopping)
    chat = new_chat()
    _, pending, _, chat, _ = handlers.accept("w1 w2", chat, True)
    final = list(handlers.send(pending, chat, "", *values(max_new_tokens=200, mode="vanilla")))[-1]
    assert "server is stopping" in final[3]
    saved = store.load_chat(chat["id"])["messages"]
    assert [m["role"] for m in saved] == ["user", "assistant"] and saved[1]["content"]
    assert saved[1]["stats"]["finish_reason"] == "cancelled"

    def stopped_before_a_token(*args, **kwargs):
        raise ServerStopping("the server is stopping")
        yield

    monkeypatch.setattr(chat_module, "follow_reply", stopped_before_a_token)
    kept = store.load_chat(chat["id"])
    final = list(handlers.regenerate(kept, False, "", *values()))[-1]
    assert store.load_chat(chat["id"])["messages"] == kept["messages"]  # the reply a regeneration would replace stays


def test_a_reply_is_saved_as_it_grows_and_on_the_server_s_stop(handlers, store, monkeypatch):
    """A new reply is saved every SAVE_INTERVAL while it is written (marked
    "interrupted"), so a killed server loses at most that much; the server's
    stop saves it as far as the page saw it, once, even when the page's
    generator is never resumed; a regeneration keeps the saved reply until it ends."""
    monkeypatch.setattr(chat_module, "SAVE_INTERVAL", 0.0)
    chat = new_chat()
    _, pending, _, chat, _ = handlers.accept("w1 w2", chat, True)
    stream = handlers.send(pending, chat, "", *values(max_new_tokens=200, mode="vanilla"))
    for _ in range(4):
        next(stream)
    saved = store.load_chat(chat["id"])["messages"]
    assert [m["role"] for m in saved] == ["user", "assistant"] and saved[1]["content"]
    assert saved[1]["stats"]["finish_reason"] == "interrupted" and 0 < saved[1]["stats"]["tokens"] < 200
    assert "cut short: Kestrel stopped while writing it" in store_module.to_markdown(store.load_chat(chat["id"]))

    handlers.runtime.stopping()  # Ctrl+C: the main thread saves before the process ends
    saved = store.load_chat(chat["id"])["messages"]
    assert [m["role"] for m in saved] == ["user", "assistant"] and saved[1]["stats"]["finish_reason"] == "cancelled"
    rest = list(stream)  # were the page's generator resumed, it would not save a second reply
    assert "server is stopping" in rest[-1][3]
    assert store.load_chat(chat["id"])["messages"] == saved and not handlers.live

    finished = list(handlers.send("w3", new_chat(), "", *values(max_new_tokens=12, mode="vanilla")))[-1][2]
    assert [m["role"] for m in store.load_chat(finished["id"])["messages"]] == ["user", "assistant"]
    assert store.load_chat(finished["id"])["messages"][-1]["stats"]["finish_reason"] == "length"
    before = store.load_chat(finished["id"])["messages"]
    stream = handlers.regenerate(finished, False, "", *values(max_new_tokens=200, mode="vanilla"))
    for _ in range(4):
        next(stream)
    assert store.load_chat(finished["id"])["messages"] == before  # the reply being replaced stays until the new one ends
    list(stream)


def test_regenerate_keeps_the_replies_it_replaces_and_earlier_reply_shows_them(handlers, store):
    """A regeneration, finished or stopped, keeps the reply it replaces with the
    new one; Earlier reply shows them in turn (saved, and continued from), back
    to the latest."""
    chat = list(handlers.send("w1 w2", new_chat(), "", *values(max_new_tokens=10, temperature=1.0, seed=1)))[-1][2]
    first = chat["messages"][-1]["content"]
    assert "no earlier versions" in handlers.earlier_reply(chat, True)[3]
    assert "no reply to show" in handlers.earlier_reply(new_chat(), True)[3]
    chat = list(handlers.regenerate(chat, False, "", *values(max_new_tokens=10, temperature=1.0, seed=2)))[-1][2]
    second = chat["messages"][-1]["content"]
    stream = handlers.regenerate(chat, False, "", *values(max_new_tokens=200, temperature=1.0, seed=3, mode="vanilla"))
    for _ in range(3):
        next(stream)
    handlers.stop(chat)
    chat = list(stream)[-1][2]
    third = chat["messages"][-1]
    assert third["stats"]["finish_reason"] == "cancelled"  # stopped: the replies it replaced are kept with it
    assert [m["content"] for m in third["earlier"]] == [first, second] and "earlier" not in third["earlier"][0]
    assert store.load_chat(chat["id"])["messages"][-1]["earlier"] == third["earlier"]
    shown = []
    for _ in range(3):
        view, chat, stats, notice = handlers.earlier_reply(chat, True)
        shown.append(chat["messages"][-1]["content"])
        assert f">{chat['messages'][-1]['stats']['tokens']}<" in stats  # the panel shows the figures of the reply shown
        assert "3 are kept for this message" in notice and store.load_chat(chat["id"])["messages"][-1]["content"] == shown[-1]
        assert f"({chat['messages'][-1]['stats']['mode']}, " in notice  # says how the reply shown was made
        assert shown[-1] in str(view) and len(chat["messages"]) == 2
    assert shown == [second, first, third["content"]]  # back to the latest
    text, _, edited, _ = handlers.edit_last(chat, True)  # while an edit is pending, the saved chat ends with the exchange taken back
    assert "An edit is pending" in handlers.earlier_reply(edited, True)[3] and handlers.check_idle(edited)[1] is True
    assert "An edit is pending" in handlers.check_idle(edited)[0]
    saved = store.load_chat(chat["id"])
    saved["messages"][-1]["earlier"][-1]["segments"] = [["not the text", "base"]]  # a hand-edited file: shown uncoloured
    store.save_chat(saved)
    view, chat, _, notice = handlers.earlier_reply(saved, True)
    assert "Another kept reply" in notice and "segments" not in chat["messages"][-1]
    _, pending, _, chat, _ = handlers.accept("w3", chat, True)  # not a copy: the chat shown is the one saved
    chat = list(handlers.send(pending, chat, "", *values(max_new_tokens=4)))[-1][2]  # continued from the reply shown
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant", "user", "assistant"]


def test_a_failed_regeneration_keeps_the_reply_it_would_replace(handlers, store):
    chat = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=6)))[-1][2]
    final = list(handlers.regenerate(chat, False, "", *values(total_tokens=1)))[-1]  # a setting that is refused
    assert final[2]["messages"] == chat["messages"] and "Tree: tokens verified per step" in final[3]
    assert handlers.accept("w2", final[2], True)[3]["id"] == chat["id"]  # the view matches the disk: no copy


def failing_after(engine, monkeypatch, steps: int, error: Exception) -> None:
    """The engine's decoding raises `error` after `steps` steps (0: before its first token)."""
    chat_steps = engine.chat

    def failing(*args, **kwargs):
        for count, step in enumerate(chat_steps(*args, **kwargs)):
            if count == steps:
                raise error
            yield step

    monkeypatch.setattr(engine, "chat", failing)


def test_a_reply_that_fails_unexpectedly_keeps_what_was_written_and_the_chat_goes_on(handlers, engine, store, monkeypatch, caplog):
    """An error no handler expects (a fault of the model's code) part-way through
    a reply: logged, named in the notice, and the reply so far kept as Stop keeps
    it, so that the chat shown is the one saved and the next message continues it
    (not a copy, as for a chat another tab changed)."""
    first = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    real = engine.chat
    failing_after(engine, monkeypatch, 5, RuntimeError("w9 broke"))
    _, pending, _, chat, _ = handlers.accept("w2", first, True)
    box, _, chat, notice = list(handlers.send(pending, chat, "", *values(max_new_tokens=40, mode="vanilla")))[-1][:4]
    assert is_skip(box) and "The reply failed (RuntimeError: w9 broke). What was written is kept." in notice
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant"] * 2 and chat["messages"][2]["content"] == "w2"
    assert chat["messages"][3]["content"] and chat["messages"][3]["stats"]["finish_reason"] == "cancelled"
    assert store.load_chat(chat["id"])["messages"] == chat["messages"]
    assert any(record.exc_info and record.exc_info[0] is RuntimeError for record in caplog.records)
    failing_after(engine, monkeypatch, 0, RuntimeError("w8 broke"))  # before its first token: the message goes back to the box
    _, pending, _, shown, _ = handlers.accept("w3", chat, True)
    box, _, back, notice = list(handlers.send(pending, shown, "", *values(max_new_tokens=40, mode="vanilla")))[-1][:4]
    assert box == "w3" and "The reply failed (RuntimeError: w8 broke)." in notice
    assert back["messages"] == chat["messages"] and store.load_chat(chat["id"])["messages"] == chat["messages"]
    monkeypatch.setattr(engine, "chat", real)
    _, pending, _, same, notice = handlers.accept("w4", back, True)
    assert same["id"] == first["id"] and "another tab" not in notice
    final = list(handlers.send(pending, same, "", *values(max_new_tokens=4)))[-1][2]
    assert [m["content"] for m in store.load_chat(first["id"])["messages"] if m["role"] == "user"] == ["w1", "w2", "w4"]
    assert final["messages"] == store.load_chat(first["id"])["messages"]


def test_a_model_error_after_the_first_tokens_keeps_the_reply_so_far(handlers, engine, store, monkeypatch):
    """Out of memory part-way through a reply: what was shown (and saved as it
    grew) stays, cut short as Stop leaves it, with the error as the notice; a
    regeneration keeps the reply it replaces among the earlier ones. Before the
    first token the message goes back into the box, as for any refused send."""
    from models.errors import OutOfMemoryError

    first = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    failing_after(engine, monkeypatch, 5, OutOfMemoryError("out of memory while decoding"))
    _, pending, _, chat, _ = handlers.accept("w2", first, True)
    box, _, chat, notice = list(handlers.send(pending, chat, "", *values(max_new_tokens=40, mode="vanilla")))[-1][:4]
    assert is_skip(box) and "Out of memory while decoding. What was written is kept." in notice
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant"] * 2 and chat["messages"][2]["content"] == "w2"
    assert chat["messages"][3]["content"] and chat["messages"][3]["stats"]["finish_reason"] == "cancelled"
    assert store.load_chat(chat["id"])["messages"] == chat["messages"]
    replaced = chat["messages"][3]
    chat = list(handlers.regenerate(chat, False, "", *values(max_new_tokens=40, mode="vanilla")))[-1][2]  # greedy: no end before the error
    assert chat["messages"][3]["stats"]["finish_reason"] == "cancelled" and chat["messages"][3]["earlier"] == [replaced]
    assert store.load_chat(chat["id"])["messages"] == chat["messages"]
    failing_after(engine, monkeypatch, 0, OutOfMemoryError("out of memory while reading"))
    _, pending, _, shown, _ = handlers.accept("w3", chat, True)
    box, _, back, notice = list(handlers.send(pending, shown, "", *values(max_new_tokens=40, mode="vanilla")))[-1][:4]
    assert box == "w3" and "Out of memory while reading." in notice
    assert back["messages"] == chat["messages"] and store.load_chat(chat["id"])["messages"] == chat["messages"]


def test_a_send_that_fails_in_the_copy_it_began_leaves_no_copy(handlers, store):
    """A tab behind another sends with a setting that is refused: the copy its
    message began holds nothing new, so it goes again; a copy that has replies stays."""
    first = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    list(handlers.send("w2", first, "", *values(max_new_tokens=4)))  # another tab goes on: this one still shows `first`
    _, pending, _, copied, notice = handlers.accept("w3", first, True)
    assert copied["id"] != first["id"] and "changed in another tab" in notice
    box, _, _, notice = list(handlers.send(pending, copied, "", *values(top_k="abc")))[-1][:4]
    assert box == "w3" and "Top-k: enter a number" in notice
    assert [chat["id"] for chat in store.list_chats()] == [first["id"]] and not handlers.forked
    _, pending, _, copied, _ = handlers.accept("w3", first, True)
    copied = list(handlers.send(pending, copied, "", *values(max_new_tokens=4)))[-1][2]
    _, pending, _, same, _ = handlers.accept("w4", copied, True)
    assert list(handlers.send(pending, same, "", *values(top_k="abc")))[-1][0] == "w4"
    assert store.load_chat(copied["id"])["messages"] == copied["messages"] and len(store.list_chats()) == 2
    # a tab that began a copy and closed before its send came: the copy, saved with its message, is then a chat
    # like any other, which a failed send from another tab must not delete as the empty copy it began
    _, _, _, orphan, _ = handlers.accept("w5", first, True, request=SimpleNamespace(session_hash="closed-tab"))
    assert orphan["id"] in handlers.forked
    handlers.forget_session(SimpleNamespace(session_hash="closed-tab"))
    opened = store.load_chat(orphan["id"])
    assert opened["messages"][-1]["content"] == "w5"
    assert list(handlers.send("w6", opened, "", *values(top_k="abc")))[-1][0] == "w6"
    assert store.load_chat(orphan["id"])["messages"] == opened["messages"]


def test_a_long_conversation_shows_how_far_it_is_read_and_stop_gives_it_back(handlers, monkeypatch):
    import core.engine

    monkeypatch.setattr(core.engine, "PREFILL_CHUNK", 4)
    message = " ".join(f"w{i % 9 + 1}" for i in range(60))
    updates = list(handlers.send(message, new_chat(), "", *values(max_new_tokens=8)))
    notices = [u[3] for u in updates if isinstance(u[3], str) and "Reading the conversation" in u[3]]
    assert notices and "% of " in notices[0] and " tokens..." in notices[0]
    assert "Reading" not in updates[-1][3] and updates[-1][2]["messages"][-1]["role"] == "assistant"

    with handlers.runtime.queue.turn():  # the first decoding has left the model, its caches kept
        handlers.runtime.engine.forget()  # the same message again would be read from them
    read = core.engine._Run._read
    monkeypatch.setattr(core.engine._Run, "_read", lambda run, start, end: (time.sleep(0.05), read(run, start, end))[1])
    chat = new_chat()
    stream = handlers.send(message, chat, "", *values(max_new_tokens=8))
    for update in stream:
        if isinstance(update[3], str) and "Reading the conversation" in update[3]:
            break
    handlers.stop(chat)
    final = list(stream)[-1]
    assert "Stopped before the reply started" in final[3] and final[0] == message and final[2]["messages"] == []


def test_a_message_sent_during_its_chat_s_reply_is_refused_at_once_and_stays_in_the_box(handlers, store):
    """Enter (or Send) while this tab's reply is written: said at once, the text kept, nothing
    queued to be sent later with the old text (which then cleared what was typed meanwhile)."""
    chat = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    _, pending, _, chat, _ = handlers.accept("w2", chat, True)
    stream = handlers.send(pending, chat, "", *values(max_new_tokens=200, mode="vanilla"))
    writing = next(stream)[2]
    next(stream)  # the decoding has started
    box, pending, shown_chat, state, notice = handlers.accept("w3", writing, True)
    assert (box, pending) == ("w3", "") and is_skip(shown_chat) and is_skip(state) and "A reply is being written" in notice
    handlers.stop(writing)
    final = list(stream)[-1][2]
    assert all(is_skip(update) for update in list(handlers.send(pending, final, "", *values()))[-1])  # nothing to send
    assert [m["content"] for m in store.load_chat(chat["id"])["messages"] if m["role"] == "user"] == ["w1", "w2"]
    assert "Type a message first" in handlers.accept("  ", final, True)[4]


def test_a_message_from_another_tab_during_a_reply_keeps_the_reply(handlers, store):
    """Tab B shows the chat that tab A is being answered in. B's message is refused while
    the reply is written (it used to wait, then save B's older view over A's exchange);
    sent again afterwards it starts a copy, titled so."""
    first = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    tab_a = tab_b = first
    _, pending_a, _, tab_a, _ = handlers.accept("w2", tab_a, True)
    stream = handlers.send(pending_a, tab_a, "", *values(max_new_tokens=200, mode="vanilla"))
    next(stream), next(stream)  # the decoding has started
    box, pending_b, _, _, notice = handlers.accept("w3", tab_b, True)
    assert (box, pending_b) == ("w3", "") and "A reply is being written" in notice
    handlers.stop(tab_a)
    list(stream)
    _, pending_b, _, tab_b, notice = handlers.accept("w3", tab_b, True)
    assert pending_b.endswith(":w3") and tab_b["id"] != first["id"] and "changed in another tab" in notice
    list(handlers.send(pending_b, tab_b, "", *values(max_new_tokens=4)))
    assert [m["content"] for m in store.load_chat(first["id"])["messages"] if m["role"] == "user"] == ["w1", "w2"]
    assert [m["content"] for m in store.load_chat(tab_b["id"])["messages"] if m["role"] == "user"] == ["w1", "w3"]
    titles = dict((chat_id, title) for title, chat_id in chat_module.chat_choices(store))
    assert titles[tab_b["id"]].startswith("w1 (copy) (") and titles[first["id"]].startswith("w1 (")


def test_a_new_reply_clears_the_panel_of_the_last_one_and_follows_the_colour_box(handlers):
    chat = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    stream = handlers.send("w2", chat, "", *values(max_new_tokens=40, mode="eagle2", colour=True))
    first = next(stream)
    assert 'id="stat-tps">-<' in first[4] and 'id="stat-tokens"' not in first[4]  # not the last reply's figures
    writing = first[2]
    assert is_skip(handlers.recolour(writing, False))  # the view lacks the reply so far: the reply takes it up
    updates = list(stream)
    final = updates[-1][2]
    assert 'class="kd"' in str(chat_module.display(final, True))  # drafted runs that colouring would show
    assert updates[-1][1] == chat_module.display(final, False)  # the finished reply uncoloured, as the box now says


def test_the_colour_box_of_another_tab_showing_the_chat_leaves_its_reply_alone(handlers):
    """Tab A writes a reply; tab B shows the same chat and unticks its colour
    box: B's view is redrawn uncoloured, A's reply keeps A's colours."""
    chat = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    _, pending, _, writing, _ = handlers.accept("w2", chat, True, request=tab("a"))
    stream = handlers.send(pending, writing, "", *values(max_new_tokens=40, mode="eagle2", colour=True))
    writing = next(stream)[2]
    assert handlers.recolour(chat, False, tab("b")) == chat_module.display(chat, False)
    updates = list(stream)
    final = updates[-1][2]
    assert updates[-1][1] == chat_module.display(final, True)  # still coloured, as tab A's box says


def test_a_catalog_entry_that_does_not_fit_warns_when_picked(monkeypatch):
    """Picking a catalog row said nothing about its "does not fit here" before
    a download and load of minutes that ends out of memory."""
    from app import library

    llama = catalog.find("Llama-3.1-8B-Instruct (EAGLE-3)")
    # this machine: 24 GB of RAM, a CPU without native bf16 (the 8B model is read in float32 first, about 35 GB)
    warning = library.fit_warning(llama, (24.0, "system RAM"), 4)
    assert "loading on this CPU peaks at about 34.8 GB" in warning and "more than the 24.0 GB of system RAM" in warning
    assert library.fit_warning(llama, (5.0, "GPU X"), None).startswith("Llama-3.1-8B-Instruct (EAGLE-3) needs about 7.4 GB at 4 bits, more")
    assert "only just" in library.fit_warning(llama, (8.0, "GPU X"), None)  # 7.4 GB of 8: tight
    assert library.fit_warning(llama, (12.0, "GPU X"), None) == ""
    assert library.fit_warning(llama, (None, "unknown memory"), 4) == ""  # nothing to say
    monkeypatch.setattr(library, "detected_memory", lambda device: (24.0, "system RAM"))
    monkeypatch.setattr(library, "cpu_weight_bytes", lambda device: 4)
    handlers = LibraryHandlers(None, Path("heads"))
    model, head, notice = handlers.pick(llama.name)
    assert (model, head) == (llama.base, llama.head) and "run out of memory" in notice
    assert handlers.pick(catalog.CATALOG[0].name)[2] == ""  # the bundled model fits: the notice is cleared


def test_a_catalog_entry_s_fit_is_weighed_at_the_chosen_quantization():
    """The warning weighed 4 bits alone, also where quantization none loads 16-bit
    weights; auto on a GPU loads 16 bits where they fit (models/base.py), 4 elsewhere."""
    from app import library

    llama = catalog.find("Llama-3.1-8B-Instruct (EAGLE-3)")
    gpu = (12.0, "GPU X")
    assert library.fit_warning(llama, gpu, None, "auto") == ""  # 4 bits: 7.4 GB
    assert library.fit_warning(llama, gpu, None, "none").startswith("Llama-3.1-8B-Instruct (EAGLE-3) needs about 17.9 GB at 16 bits, more")
    assert "about 10.9 GB at 8 bits: it fits the 12.0 GB of GPU X only just" in library.fit_warning(llama, gpu, None, "8bit")
    assert "17.9 GB at 16 bits: it fits the 21.0 GB" in library.fit_warning(llama, (21.0, "GPU X"), None, "auto")  # 16.1 <= 80% of 21
    assert library.fit_warning(llama, (20.0, "GPU X"), None, "auto") == ""  # 16.1 > 80% of 20: 4 bits
    on_cpu = library.fit_warning(llama, (24.0, "system RAM"), 4, "none")
    assert "about 17.9 GB at 16 bits, and loading on this CPU peaks at about 34.8 GB" in on_cpu
    assert "at 4 bits" in library.fit_warning(llama, (24.0, "system RAM"), 4, "auto")


def test_the_models_tab_weighs_the_memory_of_the_device_models_load_on(monkeypatch):
    """detected_memory read GPU 0 and cpu_weight_bytes gave None wherever CUDA
    was, whatever `ui --device` chose (cpu on a GPU machine, cuda:1)."""
    from app import library

    asked = []

    def properties(index):
        asked.append(index)
        return SimpleNamespace(total_memory=(24e9 if index == 1 else 12e9), name=f"card {index}")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(library, "system_memory_gb", lambda: 24.0)
    monkeypatch.setattr(library, "cpu_has_native_bf16", lambda: False)
    cpu = torch.device("cpu")
    assert library.detected_memory(cpu) == (24.0, "system RAM (models load on the CPU)") and library.cpu_weight_bytes(cpu) == 4
    assert library.detected_memory(torch.device("cuda:1")) == (24.0, "GPU card 1") and asked == [1]
    assert library.cpu_weight_bytes(torch.device("cuda:1")) is None
    assert library.detected_memory(torch.device("cuda")) == (12.0, "GPU card 0") and asked == [1, 0]
    llama = catalog.find("Llama-3.1-8B-Instruct (EAGLE-3)")
    notice = LibraryHandlers(None, Path("heads"), "cpu").pick(llama.name)[2]
    assert "loading on this CPU peaks at about 34.8 GB, more than the 24.0 GB of system RAM (models load on the CPU)" in notice
    assert LibraryHandlers(None, Path("heads"), "cuda:1").pick(llama.name, "none")[2] == ""  # 17.9 GB of 24
    assert "more than the 12.0 GB of GPU card 0" in LibraryHandlers(None, Path("heads"), "cuda").pick(llama.name, "none")[2]


def test_the_fit_notice_follows_the_quantization_chosen_after_the_entry(monkeypatch):
    """Picking a catalog row weighed the Quantization chosen then; changing it
    afterwards left the notice as it was (none at auto's 4 bits, where 16 bits
    would run out of memory)."""
    from app import library

    monkeypatch.setattr(library, "detected_memory", lambda device: (12.0, "GPU X"))
    monkeypatch.setattr(library, "cpu_weight_bytes", lambda device: None)
    handlers = LibraryHandlers(None, Path("heads"))  # the memory of a 12 GB GPU, as detected_memory says it
    llama = catalog.find("Llama-3.1-8B-Instruct (EAGLE-3)")
    assert handlers.pick(llama.name, "auto")[2] == ""
    assert "needs about 17.9 GB at 16 bits, more than the 12.0 GB of GPU X" in handlers.refit(llama.name, "none")
    assert handlers.refit(llama.name, "4bit") == ""
    assert handlers.refit(None, "none") == gr.skip()  # no row picked, or the boxes typed over: nothing to weigh


def test_the_models_tab_says_the_memory_of_the_device_ui_was_started_on(monkeypatch, tmp_path):
    """`ui --device cpu` on a machine with a GPU: the tab weighed the GPU's memory."""
    from app import library
    from app.ui import build_app

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(library, "system_memory_gb", lambda: 24.0)
    demo = build_app(Runtime(None), tmp_path / "data", device="cpu")
    said = [block.value for block in demo.blocks.values() if isinstance(block, gr.Markdown) and "Detected memory" in str(block.value)]
    assert len(said) == 1 and "**24.0 GB** of system RAM (models load on the CPU)" in said[0] and "On this CPU a model loads" in said[0]
    picked = [event for event in demo.fns.values() if getattr(event.fn, "__name__", "") == "pick"]
    assert [block.label for block in picked[0].inputs] == ["Catalog entry", "Quantization"]  # the fit weighed at the chosen one


def test_catalog_estimates_keep_the_embedding_at_16_bits():
    """Quantization (bitsandbytes, and the CPU kernels) leaves the embedding and
    an untied lm_head at 16 bits: an 8B model with a 128k vocabulary needs about
    1 GB more at 8 bits than all of it at 8 bits would, and is tight on 12 GB."""
    llama = catalog.find("Llama-3.1-8B-Instruct (EAGLE-3)")
    everything_at_8 = llama.parameters + llama.head_parameters * 2 + catalog.RUNTIME_OVERHEAD_GB
    assert catalog.estimated_gb(llama, 8) == pytest.approx(everything_at_8 + llama.embedding_parameters)
    assert catalog.estimated_gb(llama, 16) == pytest.approx(llama.parameters * 2 + llama.head_parameters * 2 + catalog.RUNTIME_OVERHEAD_GB)
    assert catalog.fit(catalog.estimated_gb(llama, 8), 12.0) == "tight"
    assert all(0 < entry.embedding_parameters < entry.parameters / 4 for entry in catalog.CATALOG)
    eagle2 = catalog.find("Llama-3.1-8B-Instruct")  # a published EAGLE-1/2 head carries the base's embedding, loaded as its own
    assert catalog.estimated_gb(eagle2, 4) == pytest.approx(
        (eagle2.parameters - eagle2.embedding_parameters) / 2 + (eagle2.embedding_parameters + eagle2.head_parameters + 0.525) * 2
        + catalog.RUNTIME_OVERHEAD_GB)  # fmt: skip
    assert catalog.CONSUMER_GPU_GB == pytest.approx(12.88, abs=0.01)  # an RTX 3060's 12 GiB, in the estimates' GB of 10^9 bytes


def test_engine_messages_read_as_sentences_on_the_page():
    from app.render import sentence

    assert sentence("no model is loaded; load one in the Models tab") == "No model is loaded; load one in the Models tab."
    assert sentence("config.json: missing field hidden_size") == "config.json: missing field hidden_size."  # a name stays as written
    assert sentence("prompt long: 305 tokens") == "prompt long: 305 tokens."  # a prompt's id before its colon too
    assert sentence("Loading failed (see above)") == "Loading failed (see above)" and sentence("") == ""


def test_a_reply_that_ends_at_once_says_so(handlers, engine, monkeypatch):
    """A reply of no text (the model's first token ends its turn) gets a note, not a bare empty bubble."""
    first = next(iter(engine.chat([{"role": "user", "content": "w1"}], "vanilla", SamplingParams(max_new_tokens=1)))).token_ids[0]
    monkeypatch.setattr(engine, "stop_ids", engine.stop_ids | {first})
    last = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1]
    reply = last[2]["messages"][-1]
    assert reply["role"] == "assistant" and reply["content"] == "" and reply["stats"]["finish_reason"] == "stop"
    assert chat_module.EMPTY_REPLY_TEXT in last[3]
    monkeypatch.setattr(engine, "stop_ids", engine.stop_ids - {first})
    last = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1]
    assert last[2]["messages"][-1]["content"] and chat_module.EMPTY_REPLY_TEXT not in last[3]


def test_a_chat_keeps_the_name_it_is_given_through_replies_reloads_and_the_export(handlers, engine, store):
    chat = list(handlers.send("w1 w2", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    assert handlers.name_of(chat) == "" and store.list_chats()[0]["title"] == "w1 w2"
    renamed, listed, box, notice = handlers.rename("  Trip\n plans  ", chat)
    assert (box, notice, renamed["name"], renamed["title"]) == ("Trip plans", "", "Trip plans", "Trip plans")
    assert (("Trip plans (", chat["id"]) == (listed["choices"][0][0][:12], listed["choices"][0][1])) and listed["value"] == chat["id"]
    assert store.load_chat(chat["id"])["name"] == "Trip plans" and handlers.name_of(renamed) == "Trip plans"
    later = list(handlers.send("w3", renamed, "", *values(max_new_tokens=4)))[-1][2]  # a later reply keeps it
    assert store.list_chats()[0]["title"] == "Trip plans" and len(store.load_chat(chat["id"])["messages"]) == 4
    assert handlers.open(chat["id"], new_chat(), True)[1]["name"] == "Trip plans"  # as a reload or Saved chats opens it
    (markdown, _), _ = handlers.export(later)
    assert open(markdown).read().startswith("# Trip plans\n")
    back, listed, box, _ = handlers.rename("   ", later)  # an empty name: the first message's again
    assert "name" not in back and box == "" and listed["choices"][0][0].startswith("w1 w2 (")
    assert "name" not in store.load_chat(chat["id"])

    too_long = handlers.rename("x" * 101, later)
    assert too_long[:3] == (gr.skip(),) * 3 and "at most 100 characters; this one has 101" in too_long[3]
    assert "send one first" in handlers.rename("A name", new_chat())[3]  # nothing saved to name
    elsewhere = list(ChatHandlers(Runtime(engine), store).send("w4", back, "", *values(max_new_tokens=4)))[-1][2]
    assert "changed in another tab" in handlers.rename("Mine", back)[3] and "name" not in store.load_chat(chat["id"])
    handlers.replying[elsewhere["id"]] = True  # its reply's own saves would drop the name
    assert "A reply is being written" in handlers.rename("Mine", elsewhere)[3]
    del handlers.replying[elsewhere["id"]]
    taken = handlers.edit_last(elsewhere, True)[2]  # Edit pending: the exchange taken back stays saved
    assert "An edit is pending" in handlers.rename("Mine", taken)[3] and len(store.load_chat(chat["id"])["messages"]) == 6
    path = store.chat_path(chat["id"])
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "name": 5, "title": ""}))  # edited by hand: the first message's title again
    assert "name" not in store.load_chat(chat["id"]) and store.list_chats()[0]["title"] == "w1 w2"


def test_a_name_given_in_one_tab_stays_when_another_tab_or_a_reply_begun_before_saves_the_chat(handlers, engine, store):
    chat = list(handlers.send("w1 w2", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    other_tab = ChatHandlers(Runtime(engine), store)
    renamed = handlers.rename("Trip plans", chat)[0]  # the other tab still shows the chat without its name
    later = list(other_tab.send("w3", chat, "", *values(max_new_tokens=4)))[-1][2]
    assert store.load_chat(chat["id"])["name"] == "Trip plans" and len(store.load_chat(chat["id"])["messages"]) == 4
    assert store.list_chats()[0]["title"] == "Trip plans"
    assert handlers.rename("", later)[2] == "" and "name" not in store.load_chat(chat["id"])  # emptied, from either tab
    list(handlers.send("w4", renamed, "", *values(max_new_tokens=4)))  # a view that still has the name (a stale tab forks)
    assert all(c["title"] != "Trip plans" or c["id"] != chat["id"] for c in store.list_chats())
    assert handlers.rename("Mine", new_chat())[2] == gr.skip()  # refused: the name typed stays in the box


def test_an_export_from_a_tab_that_has_not_seen_a_rename_has_the_saved_name(handlers, store):
    """Another tab named the chat (or took its name away): the export names it
    as Saved chats does, the Markdown's heading as the JSON's name."""
    chat = list(handlers.send("w1 w2", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    renamed = handlers.rename("Trip plans", json.loads(json.dumps(chat)))[0]  # in another tab: this one still shows `chat`
    (markdown, data), notice = handlers.export(chat)
    assert notice == "" and Path(markdown).read_text().startswith("# Trip plans\n")
    assert json.loads(Path(data).read_text())["name"] == "Trip plans"
    handlers.rename("", json.loads(json.dumps(renamed)))  # the name taken away in the other tab
    (markdown, data), _ = handlers.export(renamed)
    assert Path(markdown).read_text().startswith("# w1 w2\n") and "name" not in json.loads(Path(data).read_text())


def test_free_port_names_a_port_below_1024_instead_of_calling_it_in_use(monkeypatch):
    """As a user, binding a port below 1024 is refused (EACCES): `--port 80`
    said "no free port in 80-179; pass --port" and `--port 1000` "Port 1000 is
    in use; using 1024". A range in use does not ask for the --port given."""
    import errno
    import socket

    from app import server

    class Probe(socket.socket):  # as a user: the tests may run as root, who may bind any port
        def bind(self, address):
            if address[1] < 1024:
                raise PermissionError(errno.EACCES, "Permission denied")
            if address[1] >= 8000:
                raise OSError(errno.EADDRINUSE, "Address already in use")
            super().bind(address)

    monkeypatch.setattr(server.socket, "socket", Probe)
    for port in (80, 1000):
        with pytest.raises(OSError, match=f"port {port} on 127.0.0.1 cannot be used .*ports below 1024 need administrator rights; choose --port 1024 or higher"):
            server.free_port("127.0.0.1", port)
    with pytest.raises(OSError, match="no free port in 8000-8002 on 127.0.0.1") as error_info:
        server.free_port("127.0.0.1", 8000, tries=3)
    assert "pass --port" not in str(error_info.value)


def test_a_model_that_recommends_sampling_says_so_when_it_loads(engine, tiny_dir, store, tmp_path, monkeypatch):
    """Qwen3's and DeepSeek-R1-Distill's cards warn that greedy decoding (the
    page's default) makes their reasoning repeat itself; the page said nothing
    of the settings their generation_config.json recommends."""
    import shutil

    runtime = Runtime(engine)
    library = LibraryHandlers(runtime, store.folder / "heads", "cpu", "off")
    _, notice, _ = library.load(str(tiny_dir), "", None, "none", "float32")
    assert notice == "Loaded."
    recommending = tmp_path / "recommending"
    shutil.copytree(tiny_dir, recommending)
    settings = json.loads((recommending / "generation_config.json").read_text())
    (recommending / "generation_config.json").write_text(json.dumps({**settings, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    _, notice, _ = library.load(str(recommending), "", None, "none", "float32")
    assert notice == ("Loaded. The model recommends sampling with Temperature 0.6, Top-p 0.95, Top-k 20 (its generation_config.json): "
                      "set them in the Decoding settings of the Chat tab, where Temperature 0 decodes greedily, which it may not be made for.")  # fmt: skip


def test_replies_that_ended_before_their_end_go_to_the_engine_marked_so():
    """A stopped or cut reply of a DeepSeek-R1 chat holds only unfinished
    reasoning (its template opened it): marked, the engine leaves it out of
    the next prompt (core/prompt.without_unfinished_thinking)."""
    from app.chat import engine_messages

    chat = new_chat("Be brief.")
    chat["messages"] = [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "stats": {"finish_reason": "stop"}},
        {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "stats": {"finish_reason": "length"}},
        {"role": "user", "content": "e"}, {"role": "assistant", "content": "f", "stats": {"finish_reason": "cancelled"}},
        {"role": "user", "content": "g"}, {"role": "assistant", "content": "h"},  # imported without stats
    ]
    marked = [message.get("unfinished", False) for message in engine_messages(chat)]
    assert marked == [False, False, False, False, True, False, True, False, False]


def test_a_regeneration_from_an_earlier_reply_at_the_limit_drops_the_oldest_reply(handlers, store):
    """With EARLIER_LIMIT replies kept, a regeneration drops the oldest, also
    when Earlier reply shows another than the newest (whose turn then comes
    back in the order the replies were written)."""
    chat = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    limit = chat_module.EARLIER_LIMIT
    kept = [{"role": "assistant", "content": f"r{i}"} for i in range(limit)]
    chat["messages"][-1] = {"role": "assistant", "content": f"r{limit}", chat_module.EARLIER: kept}
    store.save_chat(chat)
    for presses, shown in ((1, limit - 1), (2, limit - 2)):
        view = chat
        for _ in range(presses):
            view = handlers.earlier_reply(view, True)[1]
        assert view["messages"][-1]["content"] == f"r{shown}"
        regenerated = list(handlers.regenerate(view, False, "", *values(max_new_tokens=4)))[-1][2]
        earlier = [m["content"] for m in regenerated["messages"][-1][chat_module.EARLIER]]
        assert earlier == [f"r{i}" for i in range(1, limit + 1)], presses  # r0 dropped, in the order they were written
        store.save_chat(chat)


def test_a_chat_file_damaged_while_shown_is_left_as_it_is_and_the_chat_goes_on_as_a_copy(handlers, store):
    """A hand edit that leaves the file unreadable is kept, as at page load:
    the tab's next message continues its chat as a copy, saying why, and
    Earlier reply (which saves the chat) is refused."""
    chat = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    chat = list(handlers.regenerate(chat, False, "", *values(max_new_tokens=4)))[-1][2]
    path = store.chat_path(chat["id"])
    damaged = path.read_text().replace('"content": "w1"', '"content": "w1 mended",', 1)  # a stray comma
    path.write_text(damaged)
    view, _, _, notice = handlers.earlier_reply(chat, True)
    assert view == gr.skip() and "can no longer be read (not valid JSON" in notice and path.read_text() == damaged
    _, pending, _, copied, notice = handlers.accept("w2", chat, True)
    assert copied["id"] != chat["id"] and copied["copy_of"] == chat["id"] and "not valid JSON" in notice
    final = list(handlers.send(pending, copied, "", *values(max_new_tokens=4)))[-1]
    assert "not valid JSON" in final[3] and "another tab" not in final[3]  # said again with the reply
    assert path.read_text() == damaged and store.load_chat(copied["id"])["title"] == "w1 (copy)"
    with pytest.raises(OSError, match="not valid JSON"):  # a reply being written as the file was damaged: not saved over it
        store.save_chat(chat)
    assert path.read_text() == damaged
    notice = handlers.delete(chat, True)[-1]
    assert "Nothing is written to it or removed" in notice and path.read_text() == damaged


def test_a_chat_file_held_a_moment_by_another_program_is_no_damage(handlers, store, monkeypatch):
    """A file that cannot be read just now (a virus scanner holding it on
    Windows) is not damaged: the chat goes on as itself, not as a copy."""
    chat = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    original = Path.read_text

    def held(self, *args, **kwargs):
        if self.name == f"{chat['id']}.json":
            raise PermissionError(13, "Permission denied")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", held)
    _, _, _, accepted, notice = handlers.accept("w2", chat, True)
    assert accepted["id"] == chat["id"] and "can no longer be read" not in notice


def test_a_lone_surrogate_typed_or_read_from_a_file_is_saved_as_the_replacement_character(handlers, store, tmp_path):
    """A lone UTF-16 surrogate (half an emoji: valid JSON as an escape, and
    what a browser may send) can be neither written as UTF-8 nor tokenized:
    it is read as U+FFFD, the character a browser shows for it."""
    _, pending, _, chat, notice = handlers.accept("w1 \ud83d", new_chat(), True)
    assert notice == "" and store.load_chat(chat["id"])["messages"][0]["content"] == "w1 \ufffd"
    final = list(handlers.send(pending, chat, "w2 \udc00", *values(max_new_tokens=4)))[-1]
    chat = final[2]
    assert chat["messages"][0]["content"] == "w1 \ufffd" and chat["system"] == "w2 \ufffd" and not handlers.sent
    path = store.chat_path(chat["id"])
    saved = json.loads(path.read_text())
    saved["messages"][1]["content"] = "w3 \ud83d"
    path.write_text(json.dumps(saved))  # written as an escape: valid JSON
    chat = handlers.open(chat["id"], new_chat(), True)[1]
    assert chat["messages"][1]["content"] == "w3 \ufffd"
    chat = list(handlers.send("w4", chat, "", *values(max_new_tokens=4)))[-1][2]
    assert store.load_chat(chat["id"])["messages"][:3] == chat["messages"][:3] and len(chat["messages"]) == 4
    (markdown, _), notice = handlers.export(chat)
    assert notice == "" and "w3 \ufffd" in Path(markdown).read_text(encoding="utf-8")
    assert handlers.rename("w5 \ud83d", chat)[2] == "w5 \ufffd"
    assert handlers.remember("w6 \ud83d", "", *values()) == gr.skip() and store.load_settings()["system"] == "w6 \ufffd"
    export = tmp_path / "export.json"
    export.write_text(json.dumps({"messages": [{"role": "user", "content": "w7 \udc00"}]}))
    _, imported, *_, notice = handlers.import_chat(str(export), new_chat(), True)
    assert "Imported export.json" in notice and store.load_chat(imported["id"])["messages"][0]["content"] == "w7 \ufffd"


def test_a_lone_surrogate_in_a_reply_s_settings_is_saved_as_the_replacement_character(handlers, engine, store, monkeypatch):
    """A model's folder named in another encoding than UTF-8 reads with lone
    surrogates: its replies are saved (and shown) with U+FFFD, and the chat
    shown stays the one saved (no copy at the next message)."""
    chat = new_chat()
    reply = {"role": "assistant", "content": "w2", "stats": {"settings": {"model": "w\udcff"}}}
    chat["messages"] = [{"role": "user", "content": "w1"}, reply]
    store.save_chat(chat)
    assert store.load_chat(chat["id"])["messages"][1]["stats"]["settings"]["model"] == "w\ufffd"
    monkeypatch.setattr(engine.base, "name", "models/w\udcff")
    chat = list(handlers.send("w3", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    assert chat["messages"][1]["stats"]["settings"]["model"] == "models/w\ufffd"
    assert store.load_chat(chat["id"])["messages"] == chat["messages"] and handlers.accept("w4", chat, True)[3]["id"] == chat["id"]


@pytest.mark.skipif(os.name == "nt", reason="Windows cannot open a folder to sync it")
def test_a_save_syncs_the_folder_that_holds_the_file(store, monkeypatch):
    """The file's new name is the folder's: synced after the replace, so that a
    power cut cannot lose it; a file system that cannot sync a folder still saves."""
    import errno

    real, synced = os.fsync, []

    def recording(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    chat = {**new_chat(), "messages": [{"role": "user", "content": "w1"}]}
    store.save_chat(chat)
    assert synced == [False, True]

    def no_folders(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd)

    monkeypatch.setattr(os, "fsync", no_folders)
    chat["messages"].append({"role": "assistant", "content": "w2"})
    store.save_chat(chat)
    assert store.load_chat(chat["id"])["messages"] == chat["messages"]


def test_a_saved_chat_without_messages_can_be_deleted_and_cleared(handlers, store):
    folder = store.chat_path("x").parent
    folder.mkdir(parents=True)
    path = folder / "20250101-000000-abcdef.json"
    for remove in (handlers.delete, handlers.clear):
        path.write_text(json.dumps({"title": "Old notes", "messages": []}))
        assert [chat["title"] for chat in store.list_chats()] == ["Old notes"]
        chat = handlers.open(path.stem, new_chat(), True)[1]
        assert remove(chat)[-1] == "" and not path.exists() and store.list_chats() == []


def test_the_markdown_export_says_how_many_earlier_replies_the_json_export_holds(handlers):
    chat = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    (markdown, _), _ = handlers.export(chat)
    assert "Earlier replies" not in Path(markdown).read_text()
    for _ in range(2):
        chat = list(handlers.regenerate(chat, False, "", *values(max_new_tokens=4)))[-1][2]
    (markdown, data), _ = handlers.export(chat)
    assert "_Earlier replies kept for this message: 2 (the JSON export holds them)._" in Path(markdown).read_text()
    assert len(json.loads(Path(data).read_text())["messages"][-1]["earlier"]) == 2


def test_a_listed_chat_whose_file_was_damaged_since_is_named_with_the_damage_when_picked(handlers, store):
    chat = list(handlers.send("w1", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    other = list(handlers.send("w2", new_chat(), "", *values(max_new_tokens=4)))[-1][2]
    path = store.chat_path(chat["id"])
    damaged = path.read_text()[:-5]
    path.write_text(damaged)
    shown, kept, *_, notice = handlers.open(chat["id"], other, True)
    assert shown == gr.skip() and kept == other and "no longer saved" not in notice
    assert "not valid JSON" in notice and chat["id"] in notice and path.read_text() == damaged
    saved = json.loads(store.chat_path(other["id"]).read_text())
    saved["messages"][0]["role"] = "System"
    store.chat_path(other["id"]).write_text(json.dumps(saved))
    notice = handlers.open(other["id"], new_chat(), True)[-1]
    assert "message 1 has the role" in notice and "no longer saved" not in notice


def test_a_reply_stores_the_draft_head_it_was_drafted_with(handlers, engine, monkeypatch):
    monkeypatch.setattr(engine, "head_name", "heads/w1-head")
    for mode in ("eagle2", "eagle", "vanilla"):
        stats = list(handlers.send("w1", new_chat(), "", *values(mode=mode, max_new_tokens=4)))[-1][2]["messages"][-1]["stats"]
        assert stats["settings"].get("head") == (None if mode == "vanilla" else "heads/w1-head"), mode
        assert ("draft head heads/w1-head" in store_module.made_with(stats)) == (mode != "vanilla"), mode
