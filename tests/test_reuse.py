"""A chat's next turn continues the caches of the last: only what is new is
read, and the reply is the one a fresh read of the whole conversation gives."""

import threading

import pytest
import torch

from core.config import SamplingParams, TreeParams
from core.engine import Engine, Reading
from models.base import load_base
from tests.factory import ARCHITECTURES, random_eagle3_head, random_head, save_tiny_model

TREE = TreeParams(total_tokens=10, depth=4, top_k=3, lookup_tokens=4)
PARAMS = SamplingParams(max_new_tokens=20)


def tokens_of(events) -> list[int]:
    return [token for event in events if not isinstance(event, Reading) for token in event.token_ids]


def last_stats(events):
    return [event for event in events if not isinstance(event, Reading)][-1].stats


def random_tokens(count: int, seed: int) -> list[int]:
    return torch.randint(8, 48, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def second_turn(engine: Engine, prompt: list[int], follow, mode: str = "eagle2"):
    """`prompt` answered, then the conversation follow(reply) continued from
    its caches -> (that conversation, the second request's events)."""
    engine.forget()
    reply = tokens_of(engine.stream(prompt, mode=mode, sampling=PARAMS, tree=TREE, reuse=True))
    conversation = follow(reply)
    return conversation, list(engine.stream(conversation, mode=mode, sampling=PARAMS, tree=TREE, reuse=True))


@pytest.fixture(scope="module", params=[*ARCHITECTURES, "llama-eagle3"])
def engine(request, tmp_path_factory):
    architecture = request.param.removesuffix("-eagle3")
    folder = save_tiny_model(tmp_path_factory.mktemp(architecture) / "m", architecture, vocab_size=48)
    base = load_base(str(folder), dtype="float64")
    if request.param.endswith("-eagle3"):
        return Engine(base, random_eagle3_head(base.model, seed=1))
    return Engine(base, random_head(base.model, seed=1, qkv_bias=architecture == "qwen2"))


@pytest.mark.parametrize("mode", ["vanilla", "eagle", "eagle2"])
def test_each_turn_continues_the_last_turn_s_caches_with_the_reply_a_fresh_read_gives(engine, mode):
    engine.forget()
    conversation = random_tokens(9, seed=0)
    for turn in range(3):
        fresh = tokens_of(engine.stream(conversation, mode=mode, sampling=PARAMS, tree=TREE))  # no reuse: kept as it was
        events = list(engine.stream(conversation, mode=mode, sampling=PARAMS, tree=TREE, reuse=True))
        reply = tokens_of(events)
        assert reply == fresh, (mode, turn)
        # the first turn reads everything; each later one keeps the last turn's prompt and
        # reply but its final token, which was never read, and reads the last shared one again
        expected = 0 if turn == 0 else len(conversation) - len(random_tokens(3 + turn, seed=turn)) - 1
        assert last_stats(events).reused_tokens == expected, (mode, turn)
        conversation = conversation + reply + random_tokens(3 + turn + 1, seed=turn + 1)


def kept_after_prefill(engine: Engine, prompt: list[int]):
    """The caches kept by a request closed after its prefill step, and the
    head's cache as the next request continues it, its pending pairs read."""
    events = engine.stream(prompt, mode="eagle2", sampling=PARAMS, tree=TREE, reuse=True)
    next(events)  # the prefill step: the new tokens are read and their pairs pending
    events.close()
    kept = engine.kept_conversations[0]
    assert kept.pending is not None and kept.pending[0].is_inference()  # as the steps' own tensors
    drafter = engine._drafter("eagle2", TREE)
    with torch.inference_mode():
        kept.continue_head(drafter, len(kept.tokens))
        drafter.catch_up()
    return kept, drafter.cache


@pytest.mark.parametrize("edit", [None, 6])
def test_the_head_s_cache_continued_holds_what_a_fresh_read_would(engine, edit):
    """Each cached pair (feature of token t, token t + 1) stays at its position:
    after a continued turn, or one whose earlier message was edited, the head's
    keys are those of one read of everything."""
    engine.forget()
    prompt = random_tokens(11, seed=4)
    reply = tokens_of(engine.stream(prompt, mode="eagle2", sampling=PARAMS, tree=TREE, reuse=True))
    conversation = prompt + reply + random_tokens(5, seed=5)
    if edit is not None:
        conversation[edit] = 8 if conversation[edit] != 8 else 9
    kept, head = kept_after_prefill(engine, conversation)
    engine.forget()
    again, fresh = kept_after_prefill(engine, conversation)
    assert kept.tokens == again.tokens == conversation and kept.following == again.following  # the first token
    assert head.length == fresh.length == len(conversation)
    assert torch.allclose(head.keys, fresh.keys, atol=1e-9)
    assert torch.allclose(head.values, fresh.values, atol=1e-9)


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.8, max_new_tokens=16, seed=5), SamplingParams(temperature=1.2, top_p=0.9, top_k=20, max_new_tokens=16, seed=6),
])  # fmt: skip
def test_a_continued_turn_samples_what_a_fresh_read_samples(engine, sampling):
    """One seed draws the same sample in every mode (noise keyed by absolute
    position): a continued turn, which reads from a later position, too."""
    first = random_tokens(9, seed=14)
    reply = tokens_of(engine.stream(first, mode="vanilla", sampling=sampling))
    conversation = first + reply + random_tokens(4, seed=15)
    fresh = tokens_of(engine.stream(conversation, mode="vanilla", sampling=sampling))
    for mode in ("vanilla", "eagle", "eagle2"):
        engine.forget()
        assert tokens_of(engine.stream(first, mode=mode, sampling=sampling, tree=TREE, reuse=True)) == reply, mode
        events = list(engine.stream(conversation, mode=mode, sampling=sampling, tree=TREE, reuse=True))
        assert last_stats(events).reused_tokens >= len(first), mode
        assert tokens_of(events) == fresh, mode


def test_the_context_branch_continues_with_every_token_of_the_conversation(engine, monkeypatch):
    """The drafter's index of committed tokens (the context branch's matches)
    holds the whole conversation after a continued read, as after a fresh one."""
    made = []
    drafter = engine._drafter
    monkeypatch.setattr(engine, "_drafter", lambda *args: made.append(drafter(*args)) or made[-1])
    engine.forget()
    prompt = random_tokens(12, seed=16)
    reply = tokens_of(engine.stream(prompt, mode="eagle2", sampling=PARAMS, tree=TREE, reuse=True))
    conversation = prompt + reply + random_tokens(5, seed=17)
    indexes = []
    for _ in range(2):  # continued, then (forgotten) fresh
        events = engine.stream(conversation, mode="eagle2", sampling=PARAMS, tree=TREE, reuse=True)
        next(events)
        events.close()
        indexes.append(list(made[-1].index.tokens))
        engine.forget()
    assert indexes[0] == indexes[1] and indexes[0][: len(conversation)] == conversation


def test_a_stop_while_the_prompt_is_read_keeps_the_chunks_read(engine, monkeypatch):
    import core.engine

    engine.forget()
    monkeypatch.setattr(core.engine, "PREFILL_CHUNK", 5)
    prompt = random_tokens(17, seed=18)
    cancel = threading.Event()
    for event in engine.stream(prompt, mode="eagle2", sampling=PARAMS, tree=TREE, cancel=cancel, reading=True, reuse=True):
        if isinstance(event, Reading) and event.done == 5:
            cancel.set()  # taken at the next chunk's start: two chunks read
    assert engine.kept_conversations[0].tokens == prompt[:10] and engine.kept_conversations[0].following == prompt[10]
    events = list(engine.stream(prompt, mode="eagle2", sampling=PARAMS, tree=TREE, reuse=True))
    assert last_stats(events).reused_tokens == 10  # the tenth token is read again: the eleventh follows it in the cache
    assert tokens_of(events) == tokens_of(engine.stream(prompt, mode="vanilla", sampling=PARAMS))


def test_a_sliding_window_model_is_always_read_afresh(tmp_path):
    """A window's cache cannot be cut back to a shorter prefix."""
    folder = save_tiny_model(tmp_path / "m", "mistral", vocab_size=48, sliding_window=16)
    engine = Engine(load_base(str(folder), dtype="float64"))
    prompt = random_tokens(20, seed=19)
    conversation, events = second_turn(engine, prompt, lambda reply: prompt + reply + random_tokens(3, seed=20), "vanilla")
    assert last_stats(events).reused_tokens == 0
    assert tokens_of(events) == tokens_of(engine.stream(conversation, mode="vanilla", sampling=PARAMS))


def test_an_edited_earlier_message_keeps_only_the_tokens_before_the_edit(engine):
    prompt = random_tokens(14, seed=6)
    changed = 8 if prompt[6] != 8 else 9
    edited, events = second_turn(engine, prompt, lambda reply: [*prompt[:6], changed, *prompt[7:], *reply])
    assert last_stats(events).reused_tokens == 5
    assert tokens_of(events) == tokens_of(engine.stream(edited, mode="vanilla", sampling=PARAMS))
    # the conversation before the edit keeps its caches whole (the edited one had a copy of its start)
    original = prompt + tokens_of(engine.stream(prompt, mode="vanilla", sampling=PARAMS)) + random_tokens(3, seed=21)
    events = list(engine.stream(original, mode="eagle2", sampling=PARAMS, tree=TREE, reuse=True))
    assert last_stats(events).reused_tokens == len(original) - 4
    assert tokens_of(events) == tokens_of(engine.stream(original, mode="vanilla", sampling=PARAMS))


def test_a_new_chat_sharing_only_a_short_chat_s_opening_leaves_its_caches_whole(engine):
    """A short chat is mostly the chat template's opening: a new chat that shares
    only that copies it, and the first chat's next turn still continues its own caches."""
    engine.forget()
    short = SamplingParams(max_new_tokens=2)
    opening = random_tokens(12, seed=50)
    first = opening + [8, 9, 10]
    reply = tokens_of(engine.stream(first, mode="eagle2", sampling=short, tree=TREE, reuse=True))
    events = list(engine.stream(opening + [11, 12, 13], mode="eagle2", sampling=short, tree=TREE, reuse=True))
    assert last_stats(events).reused_tokens == len(opening) - 1
    following = first + reply + random_tokens(2, seed=51)
    events = list(engine.stream(following, mode="eagle2", sampling=short, tree=TREE, reuse=True))
    assert last_stats(events).reused_tokens == len(first) + len(reply) - 1
    assert tokens_of(events) == tokens_of(engine.stream(following, mode="vanilla", sampling=short))


def test_the_same_prompt_again_reads_its_last_token_only(engine):
    """A regenerated reply: every prompt token but the last is kept, and it is the same reply."""
    prompt = random_tokens(12, seed=7)
    _, events = second_turn(engine, prompt, lambda reply: prompt)
    assert last_stats(events).reused_tokens == len(prompt) - 1
    assert tokens_of(events) == tokens_of(engine.stream(prompt, mode="vanilla", sampling=PARAMS))


def test_a_stopped_reply_and_a_long_prompt_read_in_chunks_continue_exactly(engine, monkeypatch):
    import core.engine

    engine.forget()
    monkeypatch.setattr(core.engine, "PREFILL_CHUNK", 5)
    prompt = random_tokens(13, seed=8)
    cancel = threading.Event()
    shown = []
    for event in engine.stream(prompt, mode="eagle2", sampling=PARAMS, tree=TREE, cancel=cancel, reuse=True):
        shown.append(event)
        if tokens_of(shown):
            cancel.set()  # Stop after the first token
    assert shown[-1].finish_reason == "cancelled"
    conversation = prompt + tokens_of(shown) + random_tokens(12, seed=9)
    events = list(engine.stream(conversation, mode="eagle2", sampling=PARAMS, tree=TREE, reading=True, reuse=True))
    reused = len(prompt) + len(tokens_of(shown)) - 1
    readings = [event for event in events if isinstance(event, Reading)]
    assert readings == [Reading(done, len(conversation)) for done in range(reused, len(conversation) - 5, 5)]
    assert last_stats(events).reused_tokens == reused
    assert tokens_of(events) == tokens_of(engine.stream(conversation, mode="vanilla", sampling=PARAMS))


def test_a_drafting_turn_after_a_vanilla_one_continues_its_caches(engine):
    """A vanilla reply, with a head loaded, keeps the head's pairs of every
    token it reads and writes (never running the head): the drafting turn
    after it reads only what is new, with the head's keys of a fresh read."""
    engine.forget()
    prompt = random_tokens(10, seed=10)
    reply = tokens_of(engine.stream(prompt, mode="vanilla", sampling=PARAMS, reuse=True))
    conversation = prompt + reply + random_tokens(4, seed=11)
    events = list(engine.stream(conversation, mode="eagle2", sampling=PARAMS, tree=TREE, reuse=True))
    assert last_stats(events).reused_tokens == len(prompt) + len(reply) - 1
    assert tokens_of(events) == tokens_of(engine.stream(conversation, mode="eagle2", sampling=PARAMS, tree=TREE))
    # eagle2, then vanilla continuing it, then eagle2 again: each turn reads what is new only
    conversation = conversation + tokens_of(events) + random_tokens(3, seed=12)
    after = list(engine.stream(conversation, mode="vanilla", sampling=PARAMS, reuse=True))
    assert last_stats(after).reused_tokens > len(prompt) + len(reply)
    conversation = conversation + tokens_of(after) + random_tokens(3, seed=13)
    kept, head = kept_after_prefill(engine, conversation)
    engine.forget()
    again, fresh = kept_after_prefill(engine, conversation)
    assert head.length == fresh.length == len(conversation)
    assert torch.allclose(head.keys, fresh.keys, atol=1e-9) and torch.allclose(head.values, fresh.values, atol=1e-9)


def test_a_kept_cache_without_the_head_s_pairs_is_continued_by_vanilla_and_read_again_to_draft(engine, monkeypatch):
    """A kept cache without the head's pairs (here: none were gathered, as for a
    model without a head) is continued by vanilla as before, and a drafting
    turn after it reads everything again."""
    engine.forget()
    prompt = random_tokens(10, seed=16)
    monkeypatch.setattr(Engine, "_drafting_ready", lambda self, kept, first: False)
    reply = tokens_of(engine.stream(prompt, mode="vanilla", sampling=PARAMS, reuse=True))
    assert engine.kept_conversations[0].head_cache is None
    monkeypatch.undo()
    conversation = prompt + reply + random_tokens(3, seed=17)
    after = list(engine.stream(conversation, mode="vanilla", sampling=PARAMS, reuse=True))
    assert last_stats(after).reused_tokens == len(prompt) + len(reply) - 1
    assert engine.kept_conversations[0].head_cache is None  # the pairs of its first positions were never made
    conversation = conversation + tokens_of(after) + random_tokens(3, seed=18)
    events = list(engine.stream(conversation, mode="eagle2", sampling=PARAMS, tree=TREE, reuse=True))
    assert last_stats(events).reused_tokens == 0
    assert tokens_of(events) == tokens_of(engine.stream(conversation, mode="vanilla", sampling=PARAMS))


def test_requests_without_reuse_leave_the_kept_caches_alone(engine):
    engine.forget()
    prompt = random_tokens(10, seed=12)
    list(engine.stream(prompt, mode="eagle2", sampling=PARAMS, tree=TREE, reuse=True))
    kept = engine.kept_conversations
    list(engine.stream(random_tokens(10, seed=13), mode="eagle2", sampling=PARAMS, tree=TREE))
    assert engine.kept_conversations == kept and len(kept) == 1
    engine.forget()
    assert engine.kept_conversations == ()


def test_conversations_taken_up_in_turn_each_continue_their_own_caches(engine, monkeypatch):
    """Two chats answered in turn (two tabs, two API clients) each continue
    their own caches; past KEPT_CONVERSATIONS, or past KEPT_BYTES for all but
    the latest, the oldest are dropped."""
    import core.engine

    engine.forget()
    opening = random_tokens(5, seed=29)  # as a chat template's opening and a system prompt start every conversation
    chats = [opening + random_tokens(10, seed=30 + index) for index in range(3)]
    for turn in range(2):
        for index, chat in enumerate(chats[:2]):
            events = list(engine.stream(chat, mode="eagle2", sampling=PARAMS, tree=TREE, reuse=True))
            # a later turn keeps all but its 3 new tokens, less one; a first turn the other chat's opening, less one
            assert last_stats(events).reused_tokens == (len(chat) - 4 if turn else 4 * index), (turn, index)
            assert tokens_of(events) == tokens_of(engine.stream(chat, mode="vanilla", sampling=PARAMS))
            chats[index] = chat + tokens_of(events) + random_tokens(3, seed=40 + 2 * turn + index)
    assert [kept.tokens[:15] for kept in engine.kept_conversations] == [chats[1][:15], chats[0][:15]]  # one state of each
    monkeypatch.setattr(core.engine, "KEPT_CONVERSATIONS", 2)
    list(engine.stream(chats[2], mode="eagle2", sampling=PARAMS, tree=TREE, reuse=True))
    assert [kept.tokens[:15] for kept in engine.kept_conversations] == [chats[2][:15], chats[1][:15]]
    assert all(kept.nbytes() > 0 for kept in engine.kept_conversations)
    monkeypatch.setattr(core.engine, "KEPT_BYTES", engine.kept_conversations[1].nbytes())  # room for one of them
    list(engine.stream(chats[0], mode="vanilla", sampling=PARAMS, reuse=True))  # read afresh: its caches were dropped
    assert [kept.tokens[:15] for kept in engine.kept_conversations] == [chats[0][:15], chats[2][:15]]
    monkeypatch.setattr(core.engine, "KEPT_BYTES", 0)  # the latest alone
    list(engine.stream(chats[1], mode="vanilla", sampling=PARAMS, reuse=True))
    assert [kept.tokens[:15] for kept in engine.kept_conversations] == [chats[1][:15]]
    with pytest.raises(core.engine.ContextOverflowError):  # refused before any reading: the caches stay kept
        list(engine.stream(chats[1] + [9] * engine.context_limit, mode="vanilla", sampling=PARAMS, reuse=True))
    assert [kept.tokens[:15] for kept in engine.kept_conversations] == [chats[1][:15]]


def test_on_cpus_that_read_prompts_row_by_row_a_continued_bf16_cache_is_a_fresh_read_s_bits():
    """The bundled pair as it runs by default (bf16, its int4 kernel): where
    prompts are read row by row (core/rowkernel.prefills) the keys and values
    kept from the last turn, its reply's included, are bit for bit those of one
    read of the whole conversation, so a continued turn's reply is the same."""
    from app.session import load_pair
    from core import rowkernel

    engine = load_pair(quantization="auto", dtype="bfloat16", compile="off")
    if not (engine.exact and rowkernel.prefills(torch.bfloat16, engine.base.device)):
        pytest.skip("prompts are read by sdpa here, whose rounding depends on the rows read together")
    messages = [{"role": "user", "content": "Name three rivers of Europe and say where each one ends. " * 45}]  # > 512 tokens: two chunks
    params = SamplingParams(max_new_tokens=24)
    reply = tokens_of(engine.chat(messages, mode="eagle2", sampling=params, reuse=True))
    messages += [{"role": "assistant", "content": engine.base.tokenizer.decode(reply, skip_special_tokens=True)},
                 {"role": "user", "content": "Which one is the longest?"}]  # fmt: skip
    continued = list(engine.chat(messages, mode="eagle2", sampling=params, reuse=True))
    kept = engine.kept_conversations[0]
    assert last_stats(continued).reused_tokens > len(engine.encode(messages[:1]))  # the first reply's tokens were kept
    engine.forget()
    fresh = list(engine.chat(messages, mode="eagle2", sampling=params, reuse=True))
    assert tokens_of(continued) == tokens_of(fresh)
    length = len(engine.encode(messages))
    for ours, theirs in zip(kept.cache.layers, engine.kept_conversations[0].cache.layers):
        assert torch.equal(ours.keys[..., :length, :], theirs.keys[..., :length, :])
        assert torch.equal(ours.values[..., :length, :], theirs.values[..., :length, :])


def test_the_head_reads_a_long_prompt_s_pairs_in_chunks_as_in_one_forward(engine, monkeypatch):
    """After a long prompt the head reads its pairs a chunk at a time (no mask
    as large as the conversation squared): the same keys as one read, and the
    same reply."""
    from core import drafter as drafter_module

    conversation = random_tokens(23, seed=30)
    engine.forget()
    _, whole = kept_after_prefill(engine, conversation)
    reply = tokens_of(engine.stream(conversation, mode="eagle2", sampling=PARAMS, tree=TREE))
    monkeypatch.setattr(drafter_module, "CATCH_UP_CHUNK", 5)
    engine.forget()
    _, chunked = kept_after_prefill(engine, conversation)
    assert whole.length == chunked.length == len(conversation)
    assert torch.allclose(whole.keys, chunked.keys, atol=1e-9) and torch.allclose(whole.values, chunked.values, atol=1e-9)
    assert tokens_of(engine.stream(conversation, mode="eagle2", sampling=PARAMS, tree=TREE)) == reply
    assert reply == tokens_of(engine.stream(conversation, mode="vanilla", sampling=PARAMS))


def tiny_longrope_engine(folder, boundary: int) -> Engine:
    """A tiny Phi-3 with LongRoPE (as Phi-3.5's and Phi-4-mini's) turning to its long factors at `boundary`."""
    from transformers import AutoModelForCausalLM, Phi3Config

    from tests.factory import tiny_config, tiny_tokenizer

    settings = tiny_config("llama", vocab_size=48).to_dict()
    pairs = settings["hidden_size"] // settings["num_attention_heads"] // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * pairs,
            "long_factor": [4.0 + i for i in range(pairs)], "original_max_position_embeddings": boundary}  # fmt: skip
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")  # fmt: skip
    config = Phi3Config(**{key: settings[key] for key in keys}, sliding_window=None, original_max_position_embeddings=boundary, rope_parameters=rope)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    base = load_base(str(folder), dtype="float64")
    return Engine(base, random_head(base.model, seed=1), compile="off")


def test_longrope_s_boundary_is_crossed_as_one_token_steps_cross_it(tmp_path, monkeypatch):
    """transformers turns LongRoPE to its long factors for a whole forward once
    its furthest position passes the boundary: a tree pass reaching past it
    from before it computed its root otherwise than vanilla's step did (2 of 12
    replies differed), and a continued turn whose chunk crossed it read
    positions otherwise than a fresh read. Trees stop at the boundary and
    chunks end there: every reply equals vanilla's, continued or fresh."""
    import core.engine

    engine = tiny_longrope_engine(tmp_path / "m", boundary=64)
    assert engine.rope_boundary == 64 and engine.speculation_problem() is None
    tree = TreeParams(total_tokens=16, depth=6, top_k=4)
    for seed in range(12):
        prompt = random_tokens(50 + seed, seed=seed)
        vanilla = tokens_of(engine.stream(prompt, mode="vanilla", sampling=PARAMS))
        assert tokens_of(engine.stream(prompt, mode="eagle2", sampling=PARAMS, tree=tree)) == vanilla, seed
    monkeypatch.setattr(core.engine, "PREFILL_CHUNK", 16)  # a fresh read's chunks end at 64; a continued one's did not (2 of 24 differed)
    crossed = 0
    for seed in range(12):
        for mode in ("vanilla", "eagle2"):
            prompt = random_tokens(40, seed=100 + seed)  # its reply ends before the boundary; the next turn crosses it,
            conversation, events = second_turn(engine, prompt, lambda reply: prompt + reply + random_tokens(10, seed=200 + seed), mode)
            crossed += last_stats(events).reused_tokens < 64 < len(conversation)  # unless the reply ended early
            assert tokens_of(events) == tokens_of(engine.stream(conversation, mode=mode, sampling=PARAMS, tree=TREE)), (seed, mode)
    assert crossed >= 16


def test_longrope_replies_equal_generate_past_the_boundary(tmp_path, monkeypatch):
    """transformers' `generate` reads a Phi-3's whole sequence again, with the
    long factors, at the step that first passes the boundary, and a prompt past
    it in one forward, every position with the long factors. Kestrel kept the
    positions before the boundary as read with the short factors, and wrote
    other tokens than `generate` past it. It now reads them again there too:
    fresh prompts before, at and past the boundary, read in chunks, and
    continued turns (kept caches of either kind), in every mode, equal `generate`."""
    import core.engine
    from tests.test_vanilla import generate_reference

    engine = tiny_longrope_engine(tmp_path / "m", boundary=64)
    monkeypatch.setattr(core.engine, "PREFILL_CHUNK", 16)
    tree = TreeParams(total_tokens=16, depth=6, top_k=4)
    sampling = SamplingParams(max_new_tokens=24)
    for index, length in enumerate([*range(40, 100, 3), 63, 64, 65]):  # 5 of the first 40 replies differed
        for seed in range(2):
            prompt = random_tokens(length, seed=10 * length + seed)
            expected = generate_reference(engine, prompt, 24)
            for mode in ("vanilla", "eagle", "eagle2") if index % 4 == 0 or length in (63, 64, 65) else ("vanilla",):
                assert tokens_of(engine.stream(prompt, mode=mode, sampling=sampling, tree=tree)) == expected, (length, seed, mode)
    turn = SamplingParams(max_new_tokens=12)
    for seed in range(4):
        for mode in ("vanilla", "eagle2"):
            engine.forget()
            prompt = random_tokens(20, seed=300 + seed)
            first = tokens_of(engine.stream(prompt, mode=mode, sampling=turn, tree=tree, reuse=True))
            shorter = prompt + first + random_tokens(6, seed=400 + seed)  # before the boundary: the short factors' cache continued
            second = list(engine.stream(shorter, mode=mode, sampling=turn, tree=tree, reuse=True))
            assert len(shorter) + 12 < 64 and tokens_of(second) == generate_reference(engine, shorter, 12), (seed, mode)
            assert last_stats(second).reused_tokens > 20
            longer = shorter + tokens_of(second) + random_tokens(30, seed=500 + seed)  # past it: read again, long
            third = list(engine.stream(longer, mode=mode, sampling=turn, tree=tree, reuse=True))
            assert len(longer) > 64 and tokens_of(third) == generate_reference(engine, longer, 12), (seed, mode)
            assert last_stats(third).reused_tokens == 0
            fourth = longer + tokens_of(third) + random_tokens(5, seed=600 + seed)  # the long factors' cache continued
            events = list(engine.stream(fourth, mode=mode, sampling=turn, tree=tree, reuse=True))
            assert tokens_of(events) == generate_reference(engine, fourth, 12), (seed, mode)
            assert last_stats(events).reused_tokens > 64
            # an early message edited: a prompt before the boundary continues the short factors' caches, kept beside the long ones
            edited = fourth[:30] + random_tokens(8, seed=700 + seed)
            assert [kept.long_rope for kept in engine.kept_conversations] == [True, False]
            events = list(engine.stream(edited, mode=mode, sampling=sampling, tree=tree, reuse=True))
            assert tokens_of(events) == generate_reference(engine, edited, 24), (seed, mode)
            assert last_stats(events).reused_tokens == 29


def test_dynamic_rope_scaling_decodes_vanilla_only_saying_why(tmp_path):
    """Dynamic NTK scaling recomputes the frequencies from each forward's furthest
    position: no tree pass can compute what one-token steps do past the trained length."""
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    folder = save_tiny_model(tmp_path / "m", "llama", vocab_size=48, rope_parameters=rope)
    base = load_base(str(folder), dtype="float64")
    engine = Engine(base, random_head(base.model, seed=1), compile="off")
    assert "dynamic RoPE scaling" in engine.speculation_problem()
    assert tokens_of(engine.stream(random_tokens(9, seed=3), mode="vanilla", sampling=PARAMS))
