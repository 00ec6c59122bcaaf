"""The OpenAI-compatible API on a live server (127.0.0.1, a free port), driven
by the official `openai` client and by raw HTTP, on a tiny float64 model with
a random draft head."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import socket
import threading
import time

import httpx
import openai
import pytest

from app.runtime import Runtime
from app.server import Access, Server
from app.ui import build_app
from core.config import SamplingParams
from core.engine import Engine
from tests.factory import random_head

MESSAGES = [{"role": "system", "content": "w5 w6"}, {"role": "user", "content": "w1 w2 w3"}]


class PacedEngine(Engine):
    """The real engine, with an adjustable pause after each step (to hold the
    model busy in queue tests) and a count of the steps it has made."""

    delay = 0.0
    steps = 0

    def stream(self, *args, **kwargs):
        for step in super().stream(*args, **kwargs):
            PacedEngine.steps += 1
            time.sleep(self.delay)
            yield step


@pytest.fixture(scope="module")
def engine(tiny_base):
    return PacedEngine(tiny_base, random_head(tiny_base.model), head_name="random test head")


def start(engine, tmp_path_factory, access: Access = Access(), max_waiting: int = 16) -> Server:
    runtime = Runtime(engine, max_waiting=max_waiting)
    server = Server(build_app(runtime, tmp_path_factory.mktemp("api-data")), runtime, access, 8100)
    server.start()
    return server


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    server = start(engine, tmp_path_factory)
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def paced(engine):
    def set_delay(seconds: float):
        engine.delay = seconds

    yield set_delay
    engine.delay = 0.0


def engine_text(engine, messages=MESSAGES, mode="eagle2", max_new_tokens=30) -> tuple[str, str]:
    """The engine's own greedy reply and finish reason."""
    steps = list(engine.chat(messages, mode, SamplingParams(max_new_tokens=max_new_tokens)))
    return "".join(step.text for step in steps), steps[-1].finish_reason


def chat(client, model, **kwargs):
    settings = {"messages": MESSAGES, "temperature": 0, "max_tokens": 30, **kwargs}
    return client.chat.completions.create(model=model, **settings)


def test_models_lists_the_loaded_model_with_its_head_and_modes(client, engine):
    models = client.models.list().data
    assert [model.id for model in models] == [engine.base.name]
    extra = models[0].model_dump()["kestrel"]
    assert extra["head"] == "random test head" and extra["modes"] == ["vanilla", "eagle", "eagle2"]
    assert client.models.retrieve(engine.base.name).id == engine.base.name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_greedy_chat_equals_the_engine_and_vanilla(client, engine):
    expected, reason = engine_text(engine)
    vanilla, _ = engine_text(engine, mode="vanilla")
    assert expected == vanilla and expected
    for mode in ("eagle2", "eagle", "vanilla"):
        reply = chat(client, engine.base.name, extra_body={"kestrel": {"mode": mode}})
        assert reply.choices[0].message.content == expected, mode
        assert reply.choices[0].finish_reason == {"length": "length", "stop": "stop"}[reason]
        assert reply.object == "chat.completion" and reply.model == engine.base.name
        usage = reply.usage.model_dump()
        assert usage["prompt_tokens"] == len(engine.encode(MESSAGES))
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        speculative = usage["speculative"]
        assert speculative["mode"] == mode and speculative["forwards"] >= 1
        assert speculative["mean_accepted_length"] == pytest.approx(usage["completion_tokens"] / speculative["forwards"], abs=1e-3)
        assert set(speculative) == {
            "mode", "mean_accepted_length", "forwards", "accepted_draft_tokens", "acceptance_by_depth",
            "mean_tree_size", "mean_tree_depth", "tokens_per_second", "decoding_tokens_per_second", "time_to_first_token",
        }  # fmt: skip
        assert speculative["decoding_tokens_per_second"] > 0  # 30 tokens: many after the first
        if mode == "vanilla":
            assert speculative["accepted_draft_tokens"] == 0 and speculative["acceptance_by_depth"] == []
            assert speculative["mean_tree_size"] == 1.0 and speculative["mean_tree_depth"] == 0.0


def test_a_conversation_s_next_turn_reads_only_what_is_new_with_the_same_reply(client, engine):
    """A client sends the whole conversation each turn: the caches of the
    last request are continued (`usage.prompt_tokens_details.cached_tokens`)
    and the reply is the one a fresh read gives."""
    first = chat(client, engine.base.name)
    assert first.usage.model_dump()["prompt_tokens_details"]["cached_tokens"] < len(engine.encode(MESSAGES))
    turn = [*MESSAGES, {"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "w4 w5"}]
    for mode in ("eagle2", "vanilla"):
        reply = chat(client, engine.base.name, messages=turn, extra_body={"kestrel": {"mode": mode}})
        cached = reply.usage.model_dump()["prompt_tokens_details"]["cached_tokens"]
        assert len(engine.encode(MESSAGES)) - 1 <= cached < len(engine.encode(turn)), mode  # the first prompt at least
        assert reply.choices[0].message.content == engine_text(engine, turn)[0], mode


def test_a_server_without_kept_caches_reads_every_prompt_afresh(engine, tmp_path_factory):
    """`ui --no-kept-caches` (bench-app's server): the same prompt sent again is read again."""
    from app.cli import build_parser

    assert build_parser().parse_args(["ui", "--no-kept-caches"]).no_kept_caches
    runtime = Runtime(engine, reuse=False)
    server = Server(build_app(runtime, tmp_path_factory.mktemp("fresh-data")), runtime, Access(), 8100)
    server.start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}v1", api_key="unused", max_retries=0, timeout=120)
        replies = [chat(client, engine.base.name) for _ in range(2)]
        assert [reply.usage.model_dump()["prompt_tokens_details"]["cached_tokens"] for reply in replies] == [0, 0]
        assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    finally:
        server.close()


def test_list_of_text_parts_is_the_same_message(client, engine):
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "w1 w2 w3"}]}]
    assert chat(client, engine.base.name, messages=parts).choices[0].message.content == engine_text(engine)[0]


def test_streamed_deltas_equal_the_whole_reply_and_usage_comes_last(client, engine):
    whole = chat(client, engine.base.name).choices[0].message.content
    stream = chat(client, engine.base.name, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and chunks[-2].choices[0].finish_reason == finals[0]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert chunks[-1].usage.model_dump()["speculative"]["mode"] == "eagle2"
    assert all(c.usage is None for c in chunks[:-1])


def test_max_tokens_ends_with_length(client, engine):
    reply = chat(client, engine.base.name, max_tokens=None, max_completion_tokens=3)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3


def test_stop_strings_cut_the_reply(client, engine):
    whole, _ = engine_text(engine)
    words = whole.split()
    stop = f" {words[2]}"  # the third word (and what follows it) is cut
    cut = whole[: whole.index(stop)]
    for stops in (stop, ["w63 w63 w63", stop]):
        reply = chat(client, engine.base.name, stop=stops)
        assert reply.choices[0].message.content == cut and reply.choices[0].finish_reason == "stop"
    streamed = chat(client, engine.base.name, stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_stop_string_counts_the_same_completion_tokens_in_every_mode(client, engine):
    """A speculative step commits several tokens at once; those after the one
    that completes the stop string are cut from the text and not counted, so
    usage is what one-token-a-step decoding reports."""
    vanilla = [step for step in engine.chat(MESSAGES, "vanilla", SamplingParams(max_new_tokens=30))]
    eagle2 = [step for step in engine.chat(MESSAGES, "eagle2", SamplingParams(max_new_tokens=30))]
    ids = [token for step in vanilla for token in step.token_ids]
    text = engine.base.tokenizer.decode(ids, skip_special_tokens=True)
    words = text.split()
    run = max(range(len(words)), key=lambda i: next((n for n in range(len(words) - i) if words[i + n] != words[i]), len(words) - i))
    stop = " " + " ".join([words[run]] * 5)  # ends inside a speculative step of several tokens
    assert any(len(step.token_ids) > 2 for step in eagle2)
    expected = next(n for n in range(1, len(ids) + 1) if stop in engine.base.tokenizer.decode(ids[:n], skip_special_tokens=True))
    for mode in ("vanilla", "eagle", "eagle2"):
        reply = chat(client, engine.base.name, stop=stop, extra_body={"kestrel": {"mode": mode}})
        assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content == text[: text.index(stop)]
        assert reply.usage.completion_tokens == expected, mode
        speculative = reply.usage.model_dump()["speculative"]  # its figures count the same tokens
        assert speculative["mean_accepted_length"] * speculative["forwards"] == pytest.approx(expected, abs=1e-2), mode


def test_stop_strings_are_met_token_by_token_however_many_tokens_a_step_commits(engine):
    """Two stop strings, the second starting later but complete sooner: one
    token a step meets the second first, and so must a step that commits every
    token at once (which holds both): the same text, the same token count."""
    from app.api import StopScanner
    from core.engine import Step

    tokenizer = engine.base.tokenizer
    ids = tuple(tokenizer("w1 w2 w3 w4 w5", add_special_tokens=False)["input_ids"])
    text = tokenizer.decode(ids, skip_special_tokens=True)
    stops = (text[text.index(" w2") :], text[text.index("2 w3") : text.index(" w4")])

    def scanned(steps: list[tuple[int, ...]]) -> tuple[str, int]:
        scanner, sent, decoded, counted = StopScanner(stops, tokenizer), "", "", 0
        for tokens in steps:
            so_far = tokenizer.decode(list(ids[: counted + len(tokens)]), skip_special_tokens=True)
            piece, decoded = so_far[len(decoded) :], so_far
            out, kept = scanner.scan(Step(tokens, piece, len(tokens) - 1, len(tokens), 0.0, 0.0, None))
            sent += out
            if kept is not None:
                return sent, counted + kept
            counted += len(tokens)
        raise AssertionError("no stop string met")

    one_by_one = scanned([(token,) for token in ids])
    assert one_by_one == (text[: text.index(stops[1])], ids.index(tokenizer("w3", add_special_tokens=False)["input_ids"][0]) + 1)
    assert scanned([ids]) == one_by_one and scanned([ids[:2], ids[2:]]) == one_by_one


def test_completions_take_a_raw_prompt(client, engine):
    prompt_ids = engine.base.tokenizer("w1 w2 w3")["input_ids"]
    steps = list(engine.stream(prompt_ids, "eagle2", SamplingParams(max_new_tokens=12), continues=True))
    reply = client.completions.create(model=engine.base.name, prompt="w1 w2 w3", max_tokens=12, temperature=0)
    assert reply.choices[0].text == "".join(step.text for step in steps)
    whole = engine.base.tokenizer.decode(prompt_ids + [token for step in steps for token in step.token_ids], skip_special_tokens=True)
    assert "w1 w2 w3" + reply.choices[0].text == whole  # the reply continues the prompt's text, its first space kept
    assert reply.usage.prompt_tokens == len(prompt_ids)
    by_ids = client.completions.create(model=engine.base.name, prompt=prompt_ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == reply.choices[0].text
    short = client.completions.create(model=engine.base.name, prompt="w1 w2 w3", temperature=0)  # max_tokens left out
    sixteen = list(engine.stream(prompt_ids, "eagle2", SamplingParams(max_new_tokens=16), continues=True))
    assert short.choices[0].text == "".join(step.text for step in sixteen) and short.usage.completion_tokens <= 16


def test_seeded_sampling_repeats(client, engine):
    first = chat(client, engine.base.name, temperature=1.0, top_p=0.9, seed=7)
    again = chat(client, engine.base.name, temperature=1.0, top_p=0.9, seed=7)
    assert first.choices[0].message.content == again.choices[0].message.content
    negative = [chat(client, engine.base.name, temperature=1.0, seed=-7).choices[0].message.content for _ in range(2)]
    assert negative[0] == negative[1]  # any 64-bit seed, as OpenAI's
    fresh = {chat(client, engine.base.name, temperature=1.0, seed=-1).choices[0].message.content for _ in range(4)}
    assert len(fresh) > 1  # -1, as some front-ends send it: a fresh seed each time


def test_a_sampled_reply_names_its_seed_so_that_it_can_be_made_again(client, engine):
    """The page and chat name the seed they drew for an unseeded sampled reply;
    the API drew one too and never said which, so no reply could be made again.
    `kestrel.seed` names it, streamed (in every chunk) or not, for chat and
    completions; a greedy reply has none."""
    name = engine.base.name
    for seed in (None, -1):
        reply = chat(client, name, temperature=1.0, seed=seed).model_dump()
        drawn = reply["kestrel"]["seed"]
        assert 0 <= drawn < 2**32
        again = chat(client, name, temperature=1.0, seed=drawn)
        assert again.choices[0].message.content == reply["choices"][0]["message"]["content"]
        assert again.model_dump()["kestrel"]["seed"] == drawn  # a seed sent is named too
    chunks = list(chat(client, name, temperature=1.0, stream=True, stream_options={"include_usage": True}))
    seeds = {chunk.model_dump()["kestrel"]["seed"] for chunk in chunks}
    assert len(seeds) == 1
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chat(client, name, temperature=1.0, seed=seeds.pop()).choices[0].message.content == streamed
    raw = client.completions.create(model=name, prompt="w5 w6 w1", max_tokens=12, temperature=1.0).model_dump()
    repeated = client.completions.create(model=name, prompt="w5 w6 w1", max_tokens=12, temperature=1.0, seed=raw["kestrel"]["seed"])
    assert repeated.choices[0].text == raw["choices"][0]["text"]
    assert "kestrel" not in chat(client, name, seed=5).model_dump()  # greedy: no seed acts


@pytest.mark.parametrize(
    "changes, param",
    [
        ({"temperature": 3}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": 10**400}, "temperature"),  # past float's range: compared exactly, not converted
        ({"top_p": -(10**20)}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"extra_body": {"ignore_eos": True}}, "ignore_eos"),  # other servers' extensions, sent by their front-ends
        ({"extra_body": {"min_tokens": 12}}, "min_tokens"),
        ({"extra_body": {"grammar": 'root ::= "no"'}}, "grammar"),
        ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
        ({"extra_body": {"repeat_penalty": 1.8}}, "repeat_penalty"),
        ({"extra_body": {"max_new_tokens": 5}}, "max_new_tokens"),
        ({"extra_body": {"do_sample": False}}, "do_sample"),
        ({"extra_body": {"chat_template_kwargs": {"messages": []}}}, "chat_template_kwargs.messages"),
        ({"extra_body": {"continue_final_message": True}}, "continue_final_message"),
        ({"extra_body": {"num_predict": 5}}, "num_predict"),  # Ollama's reply length
        ({"extra_body": {"max_length": 5}}, "max_length"),  # KoboldCpp's
        ({"extra_body": {"rep_pen": 1.3}}, "rep_pen"),
        ({"extra_body": {"grammar_string": 'root ::= "no"'}}, "grammar_string"),  # text-generation-webui's grammar
        ({"extra_body": {"dynamic_temperature": True}}, "dynamic_temperature"),
        ({"stop": [f"w{n}" for n in range(33)]}, "stop"),  # 32 taken: front-ends for local servers send more than OpenAI's 4
        ({"extra_body": {"top_k": -2}}, "top_k"),
        ({"max_tokens": -2}, "max_tokens"),
        ({"seed": 2**63}, "seed"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content[0]"),
        ({"extra_body": {"kestrel": {"mode": "fast"}}}, "kestrel.mode"),
        ({"extra_body": {"kestrel": {"total_tokens": 1}}}, "kestrel.total_tokens"),
        ({"extra_body": {"kestrel": {"mode": "eagle", "lookup_tokens": 0, "depth": 2}}}, "kestrel.depth"),  # EAGLE-1's fixed tree
        ({"extra_body": {"kestrel": {"colour": True}}}, "kestrel.colour"),
    ],
)
def test_bad_values_are_400_naming_the_parameter(client, engine, changes, param):
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, engine.base.name, **changes)
    assert error.value.status_code == 400 and error.value.param == param
    assert param.split("[")[0].split(".")[-1] in error.value.message


@pytest.mark.parametrize(
    "changes, shown",
    [
        ({"temperature": 2.0000001}, "temperature must be a number from 0 to 2, got 2.0000001"),  # :g showed 2
        ({"top_p": 1.0000000001}, "top_p must be a number from 0 to 1, got 1.0000000001"),  # and 1
        ({"seed": 1e30}, "got 1e+30"),  # not the integer it converts to, 1000000000000000019884624838656
        ({"extra_body": {"top_k": 2e6}}, "top_k must be an integer from -1 to 1000000, got 2000000.0"),
    ],
)
def test_a_value_out_of_range_is_named_as_sent(client, engine, changes, shown):
    """A range error showed the value rounded or converted, so that it read as
    within the range it was refused for."""
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, engine.base.name, **changes)
    assert error.value.message.endswith(shown)


def test_ignored_fields_do_not_matter(client, engine):
    harmless = {"ignore_eos": False, "repeat_penalty": 1.0, "stop_token_ids": [], "skip_special_tokens": True, "do_sample": True,
                "add_generation_prompt": True, "chat_template_kwargs": {}, "rep_pen": 1, "top_n_sigma": -1,
                "dynamic_temperature": False, "grammar_string": "", "mirostat": 0, "mirostat_tau": 5, "mirostat_eta": 0.1,
                "guidance_scale": 1, "negative_prompt": "x", "max_length": 30, "num_predict": 30}  # fmt: skip
    # (the same length as max_tokens under other servers' names: harmless; the helper sends max_tokens 30)
    reply = chat(client, engine.base.name, user="ann", metadata={"k": "v"}, n=1, logprobs=False, extra_body=harmless)
    assert reply.choices[0].message.content == engine_text(engine)[0]


def test_a_decoding_that_fails_is_500_and_not_retried_by_the_client(server, engine, monkeypatch):
    """Out of memory mid-reply: a 500 naming it, which the official client (retrying 5xx twice by default)
    is told not to send again: it would decode the request three times."""
    from models.errors import OutOfMemoryError

    def failing(*args, **kwargs):
        raise OutOfMemoryError("out of memory while decoding: close other programs")
        yield

    monkeypatch.setattr(engine, "stream", failing)
    sent = []
    with pytest.raises(openai.InternalServerError) as error:
        chat(counted_client(server.url, sent), engine.base.name)
    assert error.value.status_code == 500 and error.value.code == "decoding_failed" and "out of memory" in error.value.message
    assert len(sent) == 1


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as error:
        chat(client, "gpt-4o")
    assert error.value.code == "model_not_found" and "gpt-4o" in error.value.message


def test_prompt_longer_than_the_context_is_400_with_both_lengths(client, engine):
    long = [{"role": "user", "content": " ".join(["w1"] * 300)}]
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, engine.base.name, messages=long)
    assert error.value.code == "context_length_exceeded"
    assert str(len(engine.encode(long))) in error.value.message and str(engine.context_limit) in error.value.message


def test_max_tokens_is_clipped_to_the_context_and_says_so(client, engine):
    reply = chat(client, engine.base.name, max_tokens=100_000, stop=["w0"])
    assert reply.model_dump()["kestrel"]["max_tokens_clipped"]["requested"] == 100_000
    for limit in (2**31 - 1, 2**63 - 1):  # counts clients send for "no limit"
        reply = chat(client, engine.base.name, max_tokens=limit, stop=["w0"])
        assert reply.model_dump()["kestrel"]["max_tokens_clipped"]["requested"] == limit
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, engine.base.name, max_tokens=2**63)
    assert error.value.param == "max_tokens"
    # completions' default of 16 past the room left is no count the client asked for; 16 sent is
    long = [8] * (engine.context_limit - 5)
    plain = client.completions.create(model=engine.base.name, prompt=long, temperature=0).model_dump()
    asked = client.completions.create(model=engine.base.name, prompt=long, temperature=0, max_tokens=16).model_dump()
    assert not (plain.get("kestrel") or {}).get("max_tokens_clipped") and asked["kestrel"]["max_tokens_clipped"]["requested"] == 16
    assert plain["choices"][0]["text"] == asked["choices"][0]["text"]


def test_messages_the_model_s_chat_template_refuses_are_a_400_in_its_words(client, engine, monkeypatch):
    """A system message for a model whose template takes none (as Gemma-2's): 400 on messages, saying why."""
    from tests.factory import CHAT_TEMPLATE

    refuses = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    monkeypatch.setattr(engine.base.tokenizer, "chat_template", refuses + CHAT_TEMPLATE)
    messages = [{"role": "system", "content": "w4"}, {"role": "user", "content": "w1 w2"}]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=engine.base.name, messages=messages, max_tokens=4)
    assert error.value.param == "messages"
    assert "messages: the model's chat template refuses this conversation: System role not supported" in error.value.message
    assert client.chat.completions.create(model=engine.base.name, messages=messages[1:], max_tokens=4).choices[0].message.content


def test_several_prompts_in_one_completions_request_are_refused_saying_so(client, engine):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=engine.base.name, prompt=["w1 w2", "w3 w4"], max_tokens=4)
    assert error.value.param == "prompt" and "one completion per request" in error.value.message
    one = client.completions.create(model=engine.base.name, prompt=["w1 w2"], max_tokens=4, temperature=0)
    assert one.choices[0].text == client.completions.create(model=engine.base.name, prompt="w1 w2", max_tokens=4, temperature=0).choices[0].text


def test_values_other_servers_take_for_off_mean_off(client, engine):
    """max_tokens -1 (no limit, to LM Studio's clients) is the context window's,
    with no clipping notice, for completions too (whose default is 16); top_k -1
    (vLLM's off) keeps every token; more than 4 stop strings are taken."""
    whole = chat(client, engine.base.name, max_tokens=None)
    unlimited = chat(client, engine.base.name, max_tokens=-1)
    assert unlimited.choices[0].message.content == whole.choices[0].message.content and whole.usage.completion_tokens > 30
    assert "kestrel" not in unlimited.model_dump() or not unlimited.model_dump()["kestrel"].get("max_tokens_clipped")
    raw = [client.completions.create(model=engine.base.name, prompt="w5 w6 w1 w2", max_tokens=limit, temperature=0) for limit in (-1, 10**5)]
    assert raw[0].choices[0].text == raw[1].choices[0].text and raw[0].usage.completion_tokens > 16
    sampled = [chat(client, engine.base.name, temperature=1.0, seed=3, extra_body={"top_k": k}).choices[0].message.content for k in (0, -1)]
    assert sampled[0] == sampled[1]
    stops = [f"zz{n}" for n in range(19)] + [whole.choices[0].message.content.split()[3]]  # the last one meets the reply
    cut = chat(client, engine.base.name, max_tokens=None, stop=stops)
    assert cut.choices[0].finish_reason == "stop" and len(cut.choices[0].message.content) < len(whole.choices[0].message.content)


def test_a_null_kestrel_top_k_leaves_the_top_level_one_in_force(client, engine):
    """kestrel.top_k null is left out, as every kestrel setting's null is: the
    top-level top_k holds (it was replaced by 0, keeping every token)."""
    name = engine.base.name
    greedy = chat(client, name).choices[0].message.content

    def sampled(**extra_body):
        return chat(client, name, temperature=2.0, seed=4, extra_body=extra_body).choices[0].message.content

    assert sampled(top_k=0) != greedy  # every token kept: another reply
    assert sampled(top_k=1, kestrel={"top_k": None}) == sampled(top_k=1) == greedy
    assert sampled(top_k=0, kestrel={"top_k": 1}) == greedy  # a kestrel.top_k sent still wins


def test_a_stop_token_ends_with_stop_and_the_context_window_with_length(client, engine, monkeypatch):
    """The engine's own finish reasons as the API names them: a stop token
    (end of turn) is "stop", the context window's end is "length"; streamed too."""
    ids = [token for step in engine.chat(MESSAGES, "vanilla", SamplingParams(max_new_tokens=30)) for token in step.token_ids]
    stop = next(token for token in ids[3:] if token not in ids[:3])  # the reply ends at its first use
    monkeypatch.setattr(engine, "stop_ids", engine.stop_ids | {stop})
    expected, reason = engine_text(engine, mode="vanilla")
    assert reason == "stop" and expected
    for stream in (False, True):
        for mode in ("eagle2", "vanilla"):
            kestrel = {"kestrel": {"mode": mode}}
            if stream:
                chunks = list(chat(client, engine.base.name, stream=True, extra_body=kestrel))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                final = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            else:
                reply = chat(client, engine.base.name, extra_body=kestrel)
                text, final = reply.choices[0].message.content, [reply.choices[0].finish_reason]
            assert (text, final) == (expected, ["stop"]), (stream, mode)
    monkeypatch.undo()
    room = 6  # a prompt that leaves the reply six positions of the context window
    words = ["w1"] * (engine.context_limit - room - len(engine.encode([{"role": "user", "content": "w1"}])) + 1)
    messages = [{"role": "user", "content": " ".join(words)}]
    assert engine.context_limit - len(engine.encode(messages)) == room
    _, reason = engine_text(engine, messages, mode="vanilla", max_new_tokens=50)
    assert reason == "context"
    for stream in (False, True):
        if stream:
            chunks = list(chat(client, engine.base.name, messages=messages, max_tokens=50, stream=True))
            final = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            final = [chat(client, engine.base.name, messages=messages, max_tokens=50).choices[0].finish_reason]
        assert final == ["length"], stream


def counted_client(url: str, sent: list) -> openai.OpenAI:
    """The official client with its default retries, counting the requests it sends."""
    return openai.OpenAI(base_url=f"{url}v1", api_key="unused", http_client=httpx.Client(event_hooks={"request": [sent.append]}))


def test_no_model_is_503(tmp_path_factory):
    server = start(None, tmp_path_factory)
    try:
        sent = []
        with pytest.raises(openai.InternalServerError) as error:
            chat(counted_client(server.url, sent), "anything")
        assert error.value.status_code == 503 and "no model is loaded" in error.value.message
        assert "retry-after" not in error.value.response.headers  # waiting does not load one,
        assert len(sent) == 1  # so the client is told not to retry
        assert httpx.get(f"{server.url}health").status_code == 503
    finally:
        server.close()


def test_a_model_loading_is_503_then_served(server, client, engine):
    server.runtime.loading = "another model"
    try:
        with pytest.raises(openai.InternalServerError) as error:
            chat(client, engine.base.name)
        assert error.value.status_code == 503 and error.value.code == "model_loading" and error.value.response.headers["retry-after"] == "5"
        assert httpx.get(f"{server.url}health").json()["status"] == "loading"
    finally:
        server.runtime.loading = None
    assert chat(client, engine.base.name, max_tokens=2).choices[0].message.content


def test_sse_framing_and_done(server, engine):
    body = {"model": engine.base.name, "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}v1/chat/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for payload in events[:-2]:
        assert payload.startswith("data: ") and "\n" not in payload
        assert json.loads(payload[6:])["object"] == "chat.completion.chunk"


def test_host_and_origin_checks_and_no_cors_by_default(server, engine):
    url = f"{server.url}v1/models"
    assert httpx.get(url).status_code == 200
    assert "access-control-allow-origin" not in httpx.get(url).headers
    rebound = httpx.get(url, headers={"Host": "attacker.example:8100"})
    assert rebound.status_code == 403 and "not this computer" in rebound.json()["error"]["message"]
    assert httpx.get(server.url, headers={"Host": "attacker.example"}).status_code == 403  # the page too
    assert httpx.get(url, headers={"Host": "localhost"}).status_code == 200
    other_site = httpx.post(
        f"{server.url}v1/chat/completions", headers={"Origin": "https://evil.example"},
        json={"model": engine.base.name, "messages": MESSAGES},
    )  # fmt: skip
    assert other_site.status_code == 403 and "--allow-origin" in other_site.json()["error"]["message"]
    # the page's own routes: another site's page may link to it, not act on it (a form POST needs no preflight)
    upload = f"{server.url}gradio_api/upload"
    files = {"files": ("a.jsonl", b'{"turns": ["w1"]}\n', "application/octet-stream")}
    refused = httpx.post(upload, headers={"Origin": "https://evil.example"}, files=files)
    assert refused.status_code == 403 and "from the page itself" in refused.json()["error"]["message"]
    assert "--page-origin https://evil.example" in refused.json()["error"]["message"]  # where that is the page behind a proxy
    assert httpx.post(upload, headers={"Origin": server.url.rstrip("/")}, files=files).status_code == 200
    assert httpx.post(upload, files=files).status_code == 200  # no browser: no origin to check
    assert httpx.get(server.url).status_code == 200  # a link to the page, followed: no Origin
    for path in ("", "config", "gradio_api/queue/data?session_hash=x"):  # another site's (or local server's) script reads none of it
        for origin in ("https://evil.example", "http://localhost:5000"):
            assert httpx.get(server.url + path, headers={"Origin": origin}).status_code == 403, (path, origin)
    assert httpx.get(f"{server.url}config", headers={"Origin": server.url.rstrip("/")}).status_code == 200
    too_big = {"files": ("b.jsonl", b"x" * (64 * 1024 * 1024 + 1), "application/octet-stream")}
    assert httpx.post(upload, files=too_big, timeout=60).status_code == 413


def test_allowed_origin_gets_cors_headers(engine, tmp_path_factory):
    """A preflight from an allowed origin is an empty 204 that allows the headers
    asked for (the official JavaScript SDK adds X-Stainless-* to every request)
    and keeps the connection open; refusals to that origin carry the CORS header,
    so its page can read why."""
    server = start(engine, tmp_path_factory, Access(api_key="key-1", allow_origins=("http://localhost:3000",)))
    try:
        url = f"{server.url}v1/models"
        site = {"Origin": "http://localhost:3000"}
        with httpx.Client() as connection:  # one kept-alive connection for the preflight and the requests after it
            asked = "authorization, content-type, x-stainless-os, x-stainless-retry-count"
            preflight = connection.options(url, headers={**site, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": asked})
            assert preflight.status_code == 204 and preflight.content == b""
            assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
            allowed = [name.strip().lower() for name in preflight.headers["access-control-allow-headers"].split(",")]
            assert sorted(allowed) == ["authorization", "content-type", "x-stainless-os", "x-stainless-retry-count"]  # each once
            ok = connection.get(url, headers={**site, "Authorization": "Bearer key-1", "X-Stainless-OS": "Linux"})
            assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://localhost:3000"
            refused = connection.get(url, headers=site)
            assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "http://localhost:3000"
            assert "API key" in refused.json()["error"]["message"]
        odd = httpx.options(url, headers={**site, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "x-a, bad header, (x)"})
        assert odd.headers["access-control-allow-headers"] == "Authorization, Content-Type, x-a"
        assert httpx.get(url, headers={"Origin": "http://localhost:4000"}).status_code == 403
    finally:
        server.close()


def test_the_host_may_name_this_computer_or_a_name_given_with_allow_host(server, allowing):
    """A container in Docker Desktop reaches the server as host.docker.internal
    (Open WebUI's, LibreChat's setup): answered when named with --allow-host,
    whose name the refusal gives. Not by default: where Docker Desktop is not
    installed, the network's name server answers for that name (and, in some
    browsers, for *.localhost), and a page served under it could be rebound here."""
    for host in ("host.docker.internal:8100", "kestrel.localhost:8100", "localhost.attacker.example", "docker.internal"):
        refused = httpx.get(f"{server.url}v1/models", headers={"Host": host})
        assert refused.status_code == 403 and "not this computer" in refused.json()["error"]["message"], host
        assert f"--allow-host {host.split(':')[0]} to answer to it" in refused.json()["error"]["message"], host
    for host in ("host.docker.internal:8100", "HOST.docker.internal"):
        assert httpx.get(f"{allowing.url}health", headers={"Host": host}).status_code == 200, host
    for host in ("x.host.docker.internal", "kestrel.localhost", "attacker.internal"):
        assert httpx.get(f"{allowing.url}health", headers={"Host": host}).status_code == 403, host


def test_a_refused_origin_reads_why_and_the_terminal_names_it_once(server, engine, caplog):
    """The page at a refused origin could show no more than "Failed to fetch":
    its preflight is answered, the request after it refused with a 403 it may
    read, and Kestrel's terminal names the origin and the option, once."""
    url, site = f"{server.url}v1/chat/completions", {"Origin": "chrome-extension://abcdefghijklmnop"}
    asked = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
    preflight = httpx.options(url, headers={**site, **asked})
    assert preflight.status_code == 204 and preflight.headers["access-control-allow-origin"] == site["Origin"]
    with caplog.at_level(logging.WARNING, logger="kestrel"):
        for _ in range(3):
            refused = httpx.post(url, headers={**site, "Authorization": "Bearer unused"}, json={"model": engine.base.name, "messages": MESSAGES})
            assert refused.status_code == 403 and refused.headers["access-control-allow-origin"] == site["Origin"]
            assert "--allow-origin chrome-extension://abcdefghijklmnop to allow" in refused.json()["error"]["message"]
    told = [record.getMessage() for record in caplog.records if "chrome-extension://abcdefghijklmnop" in record.getMessage()]
    assert len(told) == 1 and "--allow-origin chrome-extension://abcdefghijklmnop" in told[0]


@pytest.fixture(scope="module")
def allowing(engine, tmp_path_factory):
    """A server that allows a web site, a browser extension, every Firefox extension, a desktop app and null
    to call /v1, and serves the page behind a proxy at https://chat.example."""
    allowed = ("http://localhost:3000", "chrome-extension://abcdefghijklmnop", "moz-extension://*", "app://obsidian.md", "null")
    access = Access(api_key="key-1", allow_origins=allowed, allow_hosts=("host.docker.internal",), page_origins=("https://chat.example",))
    server = start(engine, tmp_path_factory, access)
    yield server
    server.close()


def test_allowed_origins_call_only_the_api_and_a_page_origin_is_the_page_too(allowing):
    """--allow-origin lets a site's page, an extension, a desktop app or null call
    /v1, never act as the page (its events read every chat, delete chats, load
    models, and need no API key); the page behind a proxy, --page-origin, does both."""
    url, key = f"{allowing.url}v1/models", {"Authorization": "Bearer key-1"}
    api_only = ("http://localhost:3000", "chrome-extension://abcdefghijklmnop", "moz-extension://0f3c5e2a-5d3b-4c7e-9a51-1d2e3f4a5b6c", "app://obsidian.md", "null")
    for origin in (*api_only, "https://chat.example"):
        ok = httpx.get(url, headers={**key, "Origin": origin})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == origin, origin
    for origin in ("chrome-extension://ponmlkjihgfedcba", "app://other.example", "https://localhost:3000", "https://other.chat.example"):
        assert httpx.get(url, headers={**key, "Origin": origin}).status_code == 403, origin
    upload, files = f"{allowing.url}gradio_api/upload", {"files": ("a.jsonl", b'{"turns": ["w1"]}\n', "application/octet-stream")}
    for origin in api_only:
        refused = httpx.post(upload, headers={"Origin": origin}, files=files)
        assert refused.status_code == 403 and "from the page itself" in refused.json()["error"]["message"], origin
        assert httpx.get(f"{allowing.url}config", headers={"Origin": origin}).status_code == 403, origin
    # where that is the page behind a proxy: the option that says so, for a web site only (not any site's sandboxed frame)
    assert "--page-origin http://localhost:3000" in httpx.post(upload, headers={"Origin": "http://localhost:3000"}, files=files).text
    for origin in ("null", "chrome-extension://abcdefghijklmnop"):
        assert "--page-origin" not in httpx.post(upload, headers={"Origin": origin}, files=files).text, origin
    page = {"Origin": "https://chat.example"}  # behind a proxy that sends its own Host (nginx's default)
    assert httpx.post(upload, headers=page, files=files).status_code == 200
    assert httpx.get(f"{allowing.url}config", headers=page).status_code == 200


def test_a_page_origin_is_an_http_or_https_origin_and_a_refusal_says_what_is_wrong():
    from app.cli import build_parser
    from app.ui import access_from

    def access(*origins: str) -> Access:
        return access_from(build_parser().parse_args(["ui", *[part for origin in origins for part in ("--page-origin", origin)]]))

    given = access("https://Chat.Example/", "http://192.168.1.5:8080", "http://[::1]:3000")
    assert given.page_origins == ("https://chat.example", "http://192.168.1.5:8080", "http://[::1]:3000") and given.allow_origins == ()
    assert given.allows("https://chat.example") and not given.allows("https://other.example")
    faults = {
        "chat.example": "no scheme", "chrome-extension://abcdefghijklmnop": "not chrome-extension", "null": "sandboxed frames",
        "https://chat.example/kestrel": "no path", "https://*.example": "no wildcards", "https://chat example": "no host[:port]",
        "https://chat.example:443": "give https://chat.example", "http://chat.example:80": "give http://chat.example",
    }  # fmt: skip
    for origin, fault in faults.items():
        with pytest.raises(ValueError, match="--page-origin takes") as error:
            access(origin)
        assert fault in str(error.value) and repr(origin) in str(error.value), origin


def test_an_allowed_origin_may_read_when_and_whether_to_retry(allowing):
    """Retry-After and x-should-retry are not CORS-safelisted: a page's script
    (the official JavaScript SDK's retries) reads them only where they are exposed."""
    for headers in ({"Authorization": "Bearer key-1"}, {}):
        answer = httpx.get(f"{allowing.url}v1/models", headers={"Origin": "http://localhost:3000", **headers})
        exposed = {name.strip().lower() for name in answer.headers.get("access-control-expose-headers", "").split(",")}
        assert {"retry-after", "x-should-retry"} <= exposed, answer.status_code


def test_the_responses_api_and_a_doubled_v1_get_a_404_that_says_what_to_change(server, engine):
    client = openai.OpenAI(base_url=f"{server.url}v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="/v1/chat/completions") as error:
        client.responses.create(model=engine.base.name, input="w1")
    assert error.value.code == "unknown_url"
    doubled = openai.OpenAI(base_url=f"{server.url}v1/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="/v1 twice") as error:
        chat(doubled, engine.base.name)
    assert error.value.code == "unknown_url"
    assert httpx.get(f"{server.url}v1/nope").json()["error"]["message"] == "no such API endpoint: GET /v1/nope"


def test_tree_settings_a_mode_does_not_use_are_refused_only_where_they_would_be_expected_to_act(client, engine):
    """eagle drafts EAGLE-1's fixed tree: of the tree settings only lookup_tokens
    changes it, so the others are a 400 there; vanilla drafts no tree, and a
    prompt of no tokens is a 400 naming it, not a failed decoding."""
    assert chat(client, engine.base.name, extra_body={"kestrel": {"mode": "eagle", "lookup_tokens": 0}}).choices[0].message.content
    assert chat(client, engine.base.name, extra_body={"kestrel": {"mode": "vanilla", "depth": 2}}).choices[0].message.content
    assert not engine.base.tokenizer("   ", add_special_tokens=False)["input_ids"]  # the test tokenizer reads it as nothing
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=engine.base.name, prompt="   ", max_tokens=3)
    assert error.value.param == "prompt" and "no tokens" in error.value.message


def test_an_api_key_no_client_can_send_is_refused_at_start():
    from app.cli import build_parser
    from app.ui import access_from

    for key in ("clé-secrète-123", "two words here"):  # an HTTP header carries ASCII only, and a Bearer token no spaces
        with pytest.raises(ValueError, match="--api-key must be letters, digits and ASCII punctuation"):
            access_from(build_parser().parse_args(["ui", "--api-key", key]))


def test_api_key_is_required_when_set(engine, tmp_path_factory):
    server = start(engine, tmp_path_factory, Access(api_key="secret-key-123"))
    try:
        for key in ("wrong", None):
            headers = {} if key is None else {"Authorization": f"Bearer {key}"}
            refused = httpx.get(f"{server.url}v1/models", headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{server.url}v1", api_key="secret-key-123", max_retries=0)
        assert chat(good, engine.base.name, max_tokens=4).choices[0].message.content
    finally:
        server.close()


def test_concurrent_streams_and_a_page_request_all_finish_with_sequential_outputs(server, client, engine):
    from gradio_client import Client

    from tests.test_ui import SETTINGS, values

    prompts = [[{"role": "user", "content": f"w{i} w{i + 1} w{i + 2}"}] for i in range(10, 18)]
    expected = [chat(client, engine.base.name, messages=m).choices[0].message.content for m in prompts]
    results: dict[int, str] = {}

    def stream(index: int) -> None:
        chunks = chat(client, engine.base.name, messages=prompts[index], stream=True)
        results[index] = "".join(c.choices[0].delta.content or "" for c in chunks)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    page = Client(server.url, verbose=False)
    settings = dict(zip(SETTINGS, values(max_new_tokens=20)))
    page_reply = page.submit("w1 w2", "", *settings.values(), api_name="/send").result()
    for thread in threads:
        thread.join(120)
    assert [results.get(i) for i in range(len(prompts))] == expected
    assert page_reply[1][-1]["role"] == "assistant" and page_reply[1][-1]["content"]


def test_full_queue_is_429(engine, tmp_path_factory, paced):
    server = start(engine, tmp_path_factory, max_waiting=2)
    paced(0.1)  # the first reply holds the model for 4 s
    try:
        body = {"model": engine.base.name, "messages": MESSAGES, "max_tokens": 40, "temperature": 0, "stream": True,
                "stop": ["w63 w62 w61 w60"], "kestrel": {"mode": "vanilla"}}  # fmt: skip
        with contextlib.ExitStack() as open_streams:
            streams = [  # one running, two waiting
                open_streams.enter_context(httpx.stream("POST", f"{server.url}v1/chat/completions", json=body, timeout=60))
                for _ in range(3)
            ]
            assert httpx.get(f"{server.url}health").json()["queue"]["waiting"] == 2
            encoded = []
            encode = engine.encode
            engine.encode = lambda messages: encoded.append(messages) or encode(messages)
            try:
                refused = httpx.post(f"{server.url}v1/chat/completions", json={**body, "stream": False}, timeout=60)
            finally:
                del engine.encode
            assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
            assert encoded == []  # refused before its prompt was tokenized
            assert refused.headers["retry-after"] == "1" and "2 requests are already waiting" in refused.json()["error"]["message"]
            paced(0.0)
            for response in streams:
                assert response.read().decode().endswith("data: [DONE]\n\n")
    finally:
        server.close()


def test_a_stream_waiting_for_its_turn_sends_comments_that_clients_skip(server, client, engine, paced, monkeypatch):
    """While a stream waits behind another reply, SSE comment lines go out (a
    client's or proxy's read timeout would end a quiet one); the official client
    reads the reply through them as if they were not there."""
    from app import api

    monkeypatch.setattr(api, "KEEPALIVE_SECONDS", 0.2)
    expected = engine_text(engine, max_new_tokens=8, mode="vanilla")[0]
    paced(0.1)  # the first reply holds the model for 3 s
    body = {"model": engine.base.name, "messages": MESSAGES, "max_tokens": 30, "temperature": 0, "stream": True,
            "stop": ["w63 w62 w61 w60"], "kestrel": {"mode": "vanilla"}}  # fmt: skip
    with httpx.stream("POST", f"{server.url}v1/chat/completions", json=body, timeout=60) as first:
        with httpx.stream("POST", f"{server.url}v1/chat/completions", json={**body, "max_tokens": 8}, timeout=60) as waiting:
            lines = list(waiting.iter_lines())
        first.read()
    assert lines.count(": waiting") >= 3 and "data: [DONE]" in lines, lines[:8]
    assert all(line.startswith(("data: ", ": waiting")) or line == "" for line in lines)
    paced(0.1)
    with httpx.stream("POST", f"{server.url}v1/chat/completions", json=body, timeout=60) as first:
        stream = client.chat.completions.create(model=engine.base.name, messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
                                                extra_body={"kestrel": {"mode": "vanilla"}})  # fmt: skip
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == expected
        first.read()


def test_a_client_gone_mid_stream_frees_the_model_within_a_step(server, client, engine, paced):
    paced(0.05)  # a 200-token reply would hold the model for 10 s
    body = {"model": engine.base.name, "messages": MESSAGES, "max_tokens": 200, "temperature": 0,
            "stream": True, "stop": ["w63 w62 w61 w60"], "kestrel": {"mode": "vanilla"}}  # fmt: skip
    with httpx.stream("POST", f"{server.url}v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
    started = time.monotonic()
    steps = PacedEngine.steps
    reply = chat(client, engine.base.name, max_tokens=2)
    assert reply.choices[0].message.content and time.monotonic() - started < 3
    time.sleep(0.5)
    assert PacedEngine.steps - steps < 10  # the abandoned reply stopped decoding


def test_a_client_gone_while_sending_its_body_leaves_no_traceback(server, client, engine):
    """A client that closes the connection partway through its request body (an editor
    cancelling a long prompt): no "Exception in ASGI application" on the server's terminal."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        host, port = server.url.split("//")[1].strip("/").split(":")
        for _ in range(3):
            with socket.create_connection((host, int(port))) as connection:
                connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                   b"Content-Length: 200\r\n\r\n{\"model\": \"x\"")  # fmt: skip
                time.sleep(0.2)
        time.sleep(0.5)
        assert chat(client, engine.base.name, max_tokens=2).choices[0].message.content
    finally:
        logger.removeHandler(handler)
    assert [record.getMessage() for record in records if record.levelno >= logging.ERROR] == []


def test_bad_input_fuzz_is_always_a_4xx_json_error(server, client, engine):
    rng = random.Random(0)
    url = f"{server.url}v1/chat/completions"
    bodies = [
        b"{", b"[]", b"null", b"42", b'"text"', b"\xff\xfe\x00junk", bytes(rng.getrandbits(8) for _ in range(300)),
        b'{"model": "' + engine.base.name.encode() + b'", "messages": [{"role": "user", "content": "w1"}], "temperature": NaN}',
        b"[" * 100_000, json.dumps({"model": engine.base.name, "messages": "x" * 5_000_000}).encode(),
    ]  # fmt: skip
    good = {"model": engine.base.name, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2}
    junk_values = [None, -1, -1e308, 1e308, "", "x" * 10_000, [], {}, [1, "a"], True, {"a": {"b": []}}]
    for _ in range(60):
        field = rng.choice(["model", "messages", "temperature", "top_p", "max_tokens", "seed", "stop", "stream", "n", "kestrel"])
        bodies.append(json.dumps({**good, field: rng.choice(junk_values)}).encode())
    for body in bodies:
        response = httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=60)
        if response.status_code == 200:  # some junk is valid (e.g. stream=None)
            continue
        assert 400 <= response.status_code < 500, (body[:80], response.status_code, response.text[:200])
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{server.url}v1/nope").status_code == 404
    assert httpx.delete(f"{server.url}v1/chat/completions").status_code in (404, 405)
    assert chat(client, engine.base.name, max_tokens=3).choices[0].message.content


def test_odd_requests_get_named_errors_or_sound_answers(server, client, engine):
    url, name = f"{server.url}v1", engine.base.name

    def post(path: str, raw: str) -> httpx.Response:
        return httpx.post(f"{url}/{path}", content=raw.encode(), headers={"Content-Type": "application/json"}, timeout=60)

    def named(response: httpx.Response, status: int, param: str | None) -> None:
        assert response.status_code == status, response.text[:200]
        assert response.json()["error"]["param"] == param

    named(post("chat/completions", json.dumps({"model": name, "messages": [{"role": ["user"], "content": "w1"}]})), 400, "messages[0].role")
    for raw, kind in (("null", "null"), ("[1, 2]", "an array"), ('"w1"', "a string"), ("true", "a boolean")):
        answer = post("chat/completions", raw)
        assert answer.status_code == 400 and answer.json()["error"]["message"].endswith(f"must be a JSON object, got {kind}"), raw
    # a lone surrogate: half of a character cut in two, as JSON's \u escapes can carry
    surrogate = '"w1 \\ud800 w2"'
    named(post("chat/completions", f'{{"model": "{name}", "messages": [{{"role": "user", "content": {surrogate}}}]}}'), 400, "messages[0].content")
    named(post("completions", f'{{"model": "{name}", "prompt": {surrogate}}}'), 400, "prompt")
    named(post("chat/completions", f'{{"model": "{name}", "messages": [{{"role": "user", "content": "w1"}}], "stop": {surrogate}}}'), 400, "stop")
    unknown_key = post("chat/completions", f'{{"model": "{name}", "messages": [{{"role": "user", "content": "w1"}}], "kestrel": {{{surrogate}: 1}}}}')
    assert unknown_key.status_code == 400 and "not a Kestrel setting" in unknown_key.json()["error"]["message"]
    # a top_p or temperature too small for float32 samples the most likely token: the greedy reply
    greedy = chat(client, name, max_tokens=12).choices[0].message.content
    assert greedy
    for changes in ({"temperature": 1.0, "top_p": 1e-46}, {"temperature": 1e-40, "top_p": 0.9}, {"temperature": 1.0, "top_p": 0},
                    {"temperature": 1.0, "extra_body": {"top_k": 1}, "seed": 3}):
        assert chat(client, name, max_tokens=12, **changes).choices[0].message.content == greedy
    # methods: HEAD where GET is served, 405 naming the method where the path exists
    assert httpx.head(f"{server.url}health").status_code == 200 and httpx.head(f"{url}/models").status_code == 200
    wrong = httpx.get(f"{url}/chat/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST" and wrong.json()["error"]["code"] == "method_not_allowed"
    assert httpx.post(f"{server.url}health").status_code == 405
    assert httpx.get(f"{url}/models", headers={"Host": "LocalHost"}).status_code == 200
    # a client whose base URL lacks /v1 is told where the API is, in OpenAI's shape
    for method, path in (("POST", "chat/completions"), ("POST", "completions"), ("GET", "models"), ("GET", f"models/{name}")):
        missing = httpx.request(method, f"{server.url}{path}", json={"model": name})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_url", path
        assert f"/v1/{path}" in missing.json()["error"]["message"]
    assert httpx.get(server.url).status_code == 200  # the page is still at /


def test_the_page_queue_is_calmed_where_gradio_polls():
    import gradio as gr

    from app.server import QUEUE_POLL_SECONDS, calm_queue

    with gr.Blocks() as demo:
        gr.Markdown("x")
    demo.queue()
    for name in ("sleep_when_free", "progress_update_sleep_when_free"):  # Gradio's own polling intervals
        assert isinstance(getattr(demo._queue, name), float), name
    calm_queue(demo)
    assert demo._queue.sleep_when_free == QUEUE_POLL_SECONDS


def test_the_server_keeps_the_state_of_a_bounded_number_of_pages(engine, tmp_path_factory):
    """Each page load is a session whose state Gradio keeps (about half a MB): the least
    recently used go past PAGE_SESSIONS_KEPT, where Gradio's default kept 10,000."""
    from app.server import PAGE_SESSIONS_KEPT

    runtime = Runtime(engine)
    demo = build_app(runtime, tmp_path_factory.mktemp("sessions-data"))
    server = Server(demo, runtime, Access(), 8100)
    server.start()
    try:
        held = demo.state_holder
        assert held.capacity == PAGE_SESSIONS_KEPT
        for number in range(PAGE_SESSIONS_KEPT + 10):
            held[f"page-{number}"]
        assert len(held.session_data) == PAGE_SESSIONS_KEPT and "page-9" not in held and f"page-{PAGE_SESSIONS_KEPT + 9}" in held
    finally:
        server.close()


@pytest.mark.skipif(os.name == "nt", reason="the test stops the server with SIGINT, which Windows cannot send")
def test_launch_serves_the_page_and_the_api_with_a_generated_key(tiny_dir):
    """The real command line: `launch.py ui --no-browser --api-key auto`."""
    import re
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from app.server import LOCALHOST, free_port

    launch = Path(__file__).resolve().parent.parent / "launch.py"
    port = free_port(LOCALHOST, 8300)
    command = [sys.executable, str(launch), "ui", "--model", str(tiny_dir), "--dtype", "float64", "--no-browser",
               "--port", str(port), "--threads", "1", "--api-key", "auto"]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output = ""
        while "API key (shown once)" not in output:
            line = server.stdout.readline()
            assert line, f"the server stopped: {output}"
            output += line
        key = re.search(r"API key \(shown once\): (\S+)", output).group(1)
        url = re.search(r"running at (\S+)", output).group(1)
        assert url == f"http://127.0.0.1:{port}/" and httpx.get(url).status_code == 200
        assert httpx.get(f"{url}v1/models").status_code == 401
        client = openai.OpenAI(base_url=f"{url}v1", api_key=key, max_retries=0, timeout=60)
        model = client.models.list().data[0]
        assert model.id == str(tiny_dir) and model.model_dump()["kestrel"]["modes"] == ["vanilla"]
        reply = client.chat.completions.create(model=model.id, messages=MESSAGES, temperature=0, max_tokens=5)
        assert reply.usage.completion_tokens >= 1 and reply.usage.model_dump()["speculative"]["mode"] == "vanilla"
        server.send_signal(signal.SIGINT)
        try:
            code = server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            raise AssertionError(f"Ctrl+C did not stop the server within 30 s; it printed: {server.stdout.read()}") from None
        assert code == 0
    finally:
        if server.poll() is None:
            server.kill()


def test_a_request_waiting_while_the_model_is_replaced_does_not_run_on_the_old_one(engine, tmp_path_factory, paced):
    """A request that joined the queue before a Load or Unload (which waits for
    its own turn) would otherwise run on the old model after the new one had
    loaded, keeping it in memory: it is answered 503 model_changed instead."""
    import threading

    server = start(engine, tmp_path_factory)
    paced(0.1)  # the first reply holds the model for about 2 s
    try:
        body = {"model": engine.base.name, "messages": MESSAGES, "max_tokens": 20, "temperature": 0, "kestrel": {"mode": "vanilla"}}
        with httpx.stream("POST", f"{server.url}v1/chat/completions", json={**body, "stream": True}, timeout=60) as first:
            waiting = {}
            second = threading.Thread(target=lambda: waiting.update(response=httpx.post(f"{server.url}v1/chat/completions", json=body, timeout=60)))
            streamed = threading.Thread(  # a stream has been answered 200 before its turn: the error comes as an event
                target=lambda: waiting.update(stream=httpx.post(f"{server.url}v1/chat/completions", json={**body, "stream": True}, timeout=60))
            )
            second.start()
            streamed.start()
            deadline = time.time() + 10
            while httpx.get(f"{server.url}health").json()["queue"]["waiting"] < 2 and time.time() < deadline:
                time.sleep(0.05)
            server.runtime.unload()  # as the Models tab's Unload does once it has the model
            paced(0.0)
            assert first.read().decode().endswith("data: [DONE]\n\n")  # the running reply ends on its model
            second.join(30)
            streamed.join(30)
        refused = waiting["response"]
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_changed"
        assert "was replaced while this request waited for its turn (no model is loaded now)" in refused.json()["error"]["message"]
        events = [line.removeprefix("data: ") for line in waiting["stream"].text.split("\n\n") if line]
        assert waiting["stream"].status_code == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "model_changed"
        assert "content" not in waiting["stream"].text.replace('"content": ""', "")  # no text came before the error
    finally:
        server.close()


def test_an_error_that_ends_the_decoding_between_reads_is_still_reported():
    """The decoding thread may fail just after a read found no new step and
    before the reader asks whether it has ended: the error is still raised (a
    500 naming it), not dropped as a cut-short reply."""
    import asyncio
    from types import SimpleNamespace

    from app.api import ApiError, Outcome, texts
    from models.errors import KestrelError

    class FailsBetweenReads:
        reads = 0

        def read(self, cursor, timeout=None):
            self.reads += 1
            if self.reads == 1:
                return []  # nothing yet: the failure lands right after this read
            raise KestrelError("the decoding failed")

        def done_reading(self, cursor):
            return True

        def stop(self):
            pass

    class Connected:
        async def is_disconnected(self):
            return False

    async def reply():
        changed = asyncio.Event()
        changed.set()
        generation = SimpleNamespace(stop=(), messages=[])
        return [text async for text in texts(FailsBetweenReads(), changed, Connected(), generation, Outcome("eagle2", 3), None, [])]

    with pytest.raises(ApiError, match="the decoding failed") as raised:
        asyncio.run(reply())
    assert raised.value.status == 500


def test_sampling_left_out_takes_the_model_s_own_recommended_settings(client, engine, monkeypatch):
    """Open WebUI, LangChain and Continue leave temperature out: that was
    OpenAI's 1 over the whole vocabulary, where Qwen3's and Llama-3.1's
    generation_config.json recommend 0.6 with top_p (and top_k) cuts. A model
    that recommends nothing keeps OpenAI's defaults; a value sent wins."""
    from transformers import GenerationConfig

    name = engine.base.name

    def sampled(top_k=None, **kwargs):  # temperature None: sent as null, as left out
        extra = {} if top_k is None else {"extra_body": {"top_k": top_k}}
        return chat(client, name, max_tokens=24, seed=11, **extra, **kwargs).choices[0].message.content

    openai_defaults = sampled(temperature=1.0)
    assert sampled(temperature=None) == openai_defaults  # the tiny model's generation config recommends nothing
    recommended = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.5, top_k=3)
    monkeypatch.setattr(engine.model, "generation_config", recommended)
    model_own = sampled(temperature=0.6, top_p=0.5, top_k=3)
    assert sampled(temperature=None) == model_own != openai_defaults
    assert sampled(temperature=None, top_p=1.0, top_k=0) == sampled(temperature=0.6, top_p=1.0, top_k=0)  # sent: kept
    assert sampled(temperature=1.0) == sampled(temperature=1.0, top_p=0.5, top_k=3)
    monkeypatch.setattr(engine.model, "generation_config", GenerationConfig(do_sample=False, temperature=0.6))
    assert sampled(temperature=None) == openai_defaults  # not for sampling: none recommended


def test_a_photo_over_the_body_limit_is_told_that_images_are_not_read(server, engine):
    """A phone photo sent as a base64 image part (Open WebUI, LibreChat) passes
    4 MiB and got only "body too large": the user could not tell that no size would do."""
    photo = "data:image/jpeg;base64," + "A" * (5 << 20)
    content = [{"type": "text", "text": "What is in this picture?"}, {"type": "image_url", "image_url": {"url": photo}}]
    body = {"model": engine.base.name, "messages": [{"role": "user", "content": content}]}
    refused = httpx.post(f"{server.url}v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 413
    assert "the models here read text only: image and audio parts are refused at any size" in refused.json()["error"]["message"]


def test_chat_template_kwargs_reach_the_template_and_kestrel_s_own_are_refused(client, engine, monkeypatch):
    """{"enable_thinking": false}, as vLLM documents for Qwen3, was refused
    with a 400 (even true, the template's default): thinking could not be
    turned off. The variables Kestrel sets itself are refused by name."""
    import re

    from app.request import RequestError, parse_chat

    seen = []
    encode = type(engine).encode

    def spy(self, messages, template_options=None):
        seen.append(template_options)
        return encode(self, messages, template_options)

    monkeypatch.setattr(type(engine), "encode", spy)
    reply = chat(client, engine.base.name, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reply.choices[0].finish_reason in ("stop", "length") and seen[-1] == {"enable_thinking": False}
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    for value, message in (
        ([1], "chat_template_kwargs must be an object of the chat template's variables, got an array"),
        ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt is set by Kestrel"),
        ({"messages": []}, "chat_template_kwargs.messages is set by Kestrel"),
        ({"not a name": 1}, "chat_template_kwargs.not a name is not a template variable's name"),
        ({"conversation": []}, "chat_template_kwargs.conversation is set by Kestrel"),  # apply_chat_template's own
    ):
        with pytest.raises(RequestError, match=re.escape(message)):
            parse_chat({**body, "chat_template_kwargs": value})
    assert parse_chat({**body, "chat_template_kwargs": {}}).template_options is None


# Tiny templates that behave as the reasoning models' do: DeepSeek-R1-Distill's generation prompt opens the
# reasoning itself ("<think>\n"), so its replies write only </think>; Qwen3's replies write <think> themselves.
# Both drop an earlier reply's reasoning up to its </think>; enable_thinking false closes the reasoning at once.
REASONING_HISTORY = (
    "{% for message in messages %}<|im_start|> {{ message['role'] }} "
    "{{ message['content'].split('</think>')[-1] if message['role'] == 'assistant' else message['content'] }} <|im_end|> "
    "{% endfor %}"
)
THINKING_OFF = "{% if enable_thinking is defined and enable_thinking is false %}"
R1_LIKE = REASONING_HISTORY + "{% if add_generation_prompt %}<|im_start|> assistant <think>\n" + THINKING_OFF + "\n</think>\n\n{% endif %}{% endif %}"
QWEN3_LIKE = REASONING_HISTORY + "{% if add_generation_prompt %}<|im_start|> assistant " + THINKING_OFF + "<think>\n\n</think>\n\n{% endif %}{% endif %}"
REASONED = [MESSAGES[0], {"role": "user", "content": "w4 w5"}]  # the tiny reasoning model's reply to it runs past 12 tokens


@pytest.fixture(scope="module")
def reasoning(tmp_path_factory):
    """A tiny reasoning model (<think> and </think> are tokens of its own; R1_LIKE's template) on a server of its
    own: its engine and a client."""
    from transformers import AddedToken, AutoTokenizer

    from models.base import load_base
    from tests.factory import WORDS, save_tiny_model

    folder = save_tiny_model(tmp_path_factory.mktemp("reasoning") / "llama", vocab_size=len(WORDS) + 2)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tokenizer.chat_template = R1_LIKE
    tokenizer.save_pretrained(folder)
    base = load_base(str(folder), dtype="float64")
    engine = Engine(base, random_head(base.model), head_name="random test head")
    server = start(engine, tmp_path_factory)
    yield engine, openai.OpenAI(base_url=f"{server.url}v1", api_key="unused", max_retries=0, timeout=120)
    server.close()


def engine_reply(engine, prompt_ids: list[int], max_new_tokens: int = 12, continues: bool = False) -> tuple[str, list[int]]:
    """The engine's own greedy reply to `prompt_ids`: its text and its token ids."""
    steps = list(engine.stream(prompt_ids, "eagle2", SamplingParams(max_new_tokens=max_new_tokens), continues=continues))
    return "".join(step.text for step in steps), [token for step in steps for token in step.token_ids]


def test_a_reply_inside_reasoning_the_template_opened_begins_with_its_think(reasoning, monkeypatch):
    """DeepSeek-R1's template opens the reasoning in the prompt, so its replies
    held only "</think>": Open WebUI and LibreChat fold reasoning only between
    <think> and </think>, and showed it as the answer with a stray tag. The
    content begins with the template's own "<think>\\n", which is no generated
    token: usage, stop strings and max_tokens are as before; sent back in the
    history a finished reply makes the same prompt, and one cut inside its
    reasoning goes back without it, as Qwen3's do. A prompt that does not end
    inside the reasoning (Qwen3's, a raw completion) gets none."""
    engine, client = reasoning
    tokenizer, name = engine.base.tokenizer, engine.base.name
    assert engine.encode(REASONED)[-1] == tokenizer.convert_tokens_to_ids("<think>")
    text, ids = engine_reply(engine, engine.encode(REASONED))
    reply = chat(client, name, messages=REASONED, max_tokens=12)
    assert reply.choices[0].message.content == "<think>\n" + text
    assert reply.usage.completion_tokens == len(ids) == 12 and reply.usage.prompt_tokens == len(engine.encode(REASONED))
    short = chat(client, name, messages=REASONED, max_tokens=3)
    assert short.choices[0].message.content == "<think>\n" + engine_reply(engine, engine.encode(REASONED), 3)[0]
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"

    assert "<think>" in text  # the tiny model writes one itself: a stop string meets that one, not the template's
    for stop in (f" {text.split()[2]}", "<think>"):
        counted = next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n], skip_special_tokens=True))
        reply = chat(client, name, messages=REASONED, max_tokens=12, stop=stop)
        assert reply.choices[0].message.content == "<think>\n" + text[: text.index(stop)], stop
        assert reply.usage.completion_tokens == counted and reply.choices[0].finish_reason == "stop", stop

    # sent back, the reasoning is dropped up to its </think> as before: nothing doubles
    answered = [*REASONED, {"role": "assistant", "content": text + " </think> w9"}, {"role": "user", "content": "w4 w5"}]
    returned = [*answered[:2], {"role": "assistant", "content": "<think>\n" + answered[2]["content"]}, answered[3]]
    assert engine.encode(returned) == engine.encode(answered)
    assert chat(client, name, messages=returned, max_tokens=2).usage.prompt_tokens == len(engine.encode(answered))
    cut = [*REASONED, {"role": "assistant", "content": short.choices[0].message.content}, answered[3]]
    assert engine.encode(cut) == engine.encode([*REASONED, {"role": "assistant", "content": ""}, answered[3]])

    raw = tokenizer.apply_chat_template(REASONED, add_generation_prompt=True, tokenize=False)
    completion = client.completions.create(model=name, prompt=raw, max_tokens=12, temperature=0)
    assert completion.choices[0].text == engine_reply(engine, tokenizer(raw)["input_ids"], continues=True)[0]
    assert not completion.choices[0].text.startswith("<think>")
    monkeypatch.setattr(tokenizer, "chat_template", QWEN3_LIKE)
    assert chat(client, name, messages=REASONED, max_tokens=12).choices[0].message.content == engine_reply(engine, engine.encode(REASONED))[0]


def test_a_streamed_reply_inside_reasoning_the_template_opened_begins_with_its_think(reasoning):
    """The first content delta begins with the template's "<think>\\n"; the
    usage chunk counts the generated tokens only. Where chat_template_kwargs
    close the reasoning in the prompt, no tag is added."""
    engine, client = reasoning
    text, ids = engine_reply(engine, engine.encode(REASONED))
    chunks = list(chat(client, engine.base.name, messages=REASONED, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(contents) > 1 and contents[0].startswith("<think>\n") and "".join(contents) == "<think>\n" + text
    assert chunks[-1].usage.completion_tokens == len(ids)

    off = {"enable_thinking": False}
    assert engine.base.tokenizer.decode(engine.encode(REASONED, off)).rstrip().endswith("</think>")
    chunks = list(chat(client, engine.base.name, messages=REASONED, max_tokens=12, stream=True, extra_body={"chat_template_kwargs": off}))
    closed = engine_reply(engine, engine.encode(REASONED, off))[0]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == closed
