"""Compiled decoder layers (core/compiled.py): the same exactness as eager
decoding, and a clean fall back to eager where compiling cannot run."""

import pytest
import torch

from app.session import default_head
from core import compiled
from core.config import SamplingParams, TreeParams
from core.engine import Engine
from core.tree_check import rows_differing
from models import int4
from models.base import load_base
from models.head import load_head
from tests.factory import decodes_as, random_eagle3_head, random_head, save_tiny_model, tokens_of

needs_compiler = pytest.mark.skipif(not compiled.compiler_available(), reason="torch.compile needs a C++ compiler on CPUs")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("compiled") / "llama", "llama", vocab_size=48)


@needs_compiler
@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
def test_compiled_engines_decode_exactly_as_vanilla(tiny_folder, kind):
    """float64, so that every difference is a bug: compiled speculative
    decoding equals compiled vanilla, greedy and sampled, and compiled
    vanilla equals eager vanilla."""
    eager = Engine(load_base(str(tiny_folder), dtype="float64"))
    base = load_base(str(tiny_folder), dtype="float64")
    head = random_head(base.model, seed=1) if kind == "eagle2" else random_eagle3_head(base.model, seed=1)
    engine = Engine(base, head, compile="on")
    assert engine.compiled is not None and compiled.of(base.model) is engine.compiled
    assert isinstance(engine.draft_head, compiled.CompiledHead)  # drafting runs the compiled head too
    assert base.model.config._attn_implementation == compiled.NAME
    assert decodes_as(engine, eager) > 0  # eager vanilla is the reference for compiled vanilla too


@needs_compiler
@pytest.mark.skipif(not int4.kernel_available(torch.device("cpu")), reason="needs torch's int4 CPU kernel")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_bundled_pair_compiled_keeps_bit_for_bit_trees(dtype):
    """The default settings on CPUs (auto: int4 and compiled layers, float32,
    or bf16 where the CPU computes it natively): tree passes still compute
    every node as a one-token step would, checked on the real model, and
    greedy EAGLE-2 equals vanilla. In bf16 that takes Inductor's emulated
    precision casts (core/compiled.py) and the row kernel's bf16 path."""
    base = load_base(None, quantization="auto", dtype=dtype)
    config = base.model.config
    vocab = base.model.get_output_embeddings().weight.shape[0]
    head = load_head(default_head(None), config.hidden_size, vocab, base.device, base.dtype, config.num_hidden_layers)
    engine = Engine(base, head, "bundled", compile="auto")
    assert engine.compiled is not None and engine.exact
    assert rows_differing(base.model) == 0
    engine.compiled.exact = False  # sdpa inside the compiled layers: not row-invariant, so the check has teeth
    try:
        assert rows_differing(base.model) > 0
    finally:
        engine.compiled.exact = True
    for prompt in ("Write a Python function that checks whether a number is prime.", "List five uses of a paperclip."):
        messages = [{"role": "user", "content": prompt}]
        sampling = SamplingParams(max_new_tokens=48)
        vanilla = tokens_of(engine.chat(messages, "vanilla", sampling))
        assert len(vanilla) > 20
        assert tokens_of(engine.chat(messages, "eagle2", sampling)) == vanilla


@needs_compiler
def test_the_bench_baselines_run_transformers_own_code_on_a_compiled_engine(tiny_folder, tmp_path):
    from core.bench import run_bench
    from core.prompt import load_prompts
    from tests.test_bench import write_prompts

    base = load_base(str(tiny_folder), dtype="float64")
    engine = Engine(base, random_head(base.model, seed=3), compile="on")
    path = write_prompts(tmp_path / "p.jsonl", [{"id": str(i), "turns": [f"w{i} w{i + 1} w{i + 2}"]} for i in range(2)])
    result = run_bench(engine, load_prompts(path), ("vanilla", "eagle2", "generate", "prompt-lookup"), SamplingParams(max_new_tokens=16), warmup=0)
    by_mode = {(row["id"], row["mode"]): row["output_ids"] for row in result["prompts"]}
    assert all(by_mode[(str(i), mode)] == by_mode[(str(i), "vanilla")] for i in range(2) for mode in ("eagle2", "generate", "prompt-lookup"))
    assert base.model.config._attn_implementation == compiled.NAME  # compiled again after the baselines
    assert compiled.of(base.model) is engine.compiled
    with pytest.raises(RuntimeError, match="eager"):
        base.model(torch.tensor([[9, 10]]))  # outside the engine and outside compiled.eager


def test_auto_leaves_float64_and_compilerless_machines_eager(tiny_folder, monkeypatch):
    base = load_base(str(tiny_folder), dtype="float64")
    assert Engine(base, random_head(base.model), compile="auto").compiled is None  # float64 is for checking
    float32 = load_base(str(tiny_folder), dtype="float32")
    monkeypatch.setattr(compiled, "compiler_available", lambda: False)
    engine = Engine(float32, random_head(float32.model), compile="auto")
    assert engine.compiled is None and float32.model.config._attn_implementation in ("sdpa", "kestrel_rows")
    assert not isinstance(engine.draft_head, compiled.CompiledHead)
    with pytest.raises(ValueError, match="compile"):
        Engine(float32, compile="sometimes")


def test_models_the_op_cannot_stand_in_for_stay_eager(tmp_path):
    """A layout without attention modules holding their scaling (GPT-2's,
    say) is never compiled, and an engine over it decodes eagerly."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)).eval()
    assert compiled.compile_model(model) is None
    assert compiled.of(model) is None and model.config._attn_implementation != compiled.NAME


@needs_compiler
def test_a_forward_whose_attention_op_ran_too_rarely_is_refused(tiny_folder):
    base = load_base(str(tiny_folder), dtype="float64")
    engine = Engine(base, compile="on")
    engine.compiled.modules = engine.compiled.modules + engine.compiled.modules[:1]  # one more layer than ran
    with pytest.raises(RuntimeError, match="attention op ran"):
        list(engine.stream([9, 10, 11], "vanilla", SamplingParams(max_new_tokens=2)))


@needs_compiler
def test_compile_off_returns_a_compiled_model_to_eager(tiny_folder):
    base = load_base(str(tiny_folder), dtype="float64")
    assert Engine(base, compile="on").compiled is not None
    engine = Engine(base, compile="off")
    assert engine.compiled is None and compiled.of(base.model) is None
    assert len(tokens_of(engine.stream([9, 10, 11], "vanilla", SamplingParams(max_new_tokens=6)))) == 6


def test_a_failed_compile_leaves_the_model_eager_and_decoding(tiny_folder, monkeypatch):
    base = load_base(str(tiny_folder), dtype="float64")
    reference = tokens_of(Engine(base).stream([9, 10, 11], "vanilla", SamplingParams(max_new_tokens=12)))

    def broken(function, **options):
        def fails(*args, **kwargs):
            raise RuntimeError("no backend")

        return fails

    monkeypatch.setattr(compiled, "compiler_available", lambda: True)
    monkeypatch.setattr(torch, "compile", broken)
    engine = Engine(base, random_head(base.model), compile="on")
    assert engine.compiled is None and compiled.of(base.model) is None
    assert base.model.config._attn_implementation != compiled.NAME
    prompt_steps = engine.stream([9, 10, 11], "eagle2", SamplingParams(max_new_tokens=12))
    assert tokens_of(prompt_steps) == reference


@pytest.mark.parametrize("own", [True, False], ids=["kestrels-folder", "users-folder"])
@pytest.mark.parametrize("damage", ["entry", "module", "other"])
def test_a_damaged_compile_cache_is_mended_and_the_model_stays_eager(tiny_folder, monkeypatch, tmp_path, caplog, damage, own):
    """torch skips an entry of its cache it cannot read but keeps it, and prints a traceback
    at every start (and code compiled beside it read differently from a fresh compile's): the
    start decodes eagerly and Kestrel's own cache folder is emptied; a folder the user set,
    which other programs may share, loses only the unreadable entries. A generated module cut
    short fails the compile itself: the same, that file removed. Another compile failure
    leaves the cache alone."""
    import logging
    import pickle

    monkeypatch.setenv("KESTREL_CACHE_DIR", str(tmp_path / "kestrel"))
    cache = tmp_path / "kestrel" / "inductor" if own else tmp_path / "users-cache"
    for folder in ("fxgraph/ab", "fxgraph/cd", "ef"):
        (cache / folder).mkdir(parents=True)
    cut, whole, module, other = cache / "fxgraph/ab/entry", cache / "fxgraph/cd/entry", cache / "ef/module.py", cache / "ef/other.py"
    cut.write_bytes(pickle.dumps({"graph": list(range(50))})[:20])
    whole.write_bytes(pickle.dumps({"graph": list(range(50))}))
    module.write_text("def call(")
    other.write_text("x = 1\n")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    base = load_base(str(tiny_folder), dtype="float64")
    reference = tokens_of(Engine(base).stream([9, 10, 11], "vanilla", SamplingParams(max_new_tokens=12)))
    torch_log = logging.getLogger("torch._inductor.codecache")
    printed = []
    handler = logging.Handler()
    handler.emit = printed.append
    torch_log.addHandler(handler)

    def damaged(function, **options):
        def runs(*args, **kwargs):
            if damage == "entry":
                torch_log.warning("fx graph cache unable to load compiled graph", exc_info=True)
                return function(*args, **kwargs)
            said = "Failed to import" if damage == "module" else "C++ compile error:"
            raise RuntimeError(f"{said} {module}\nSyntaxError: '(' was never closed")

        return runs

    monkeypatch.setattr(compiled, "compiler_available", lambda: True)
    monkeypatch.setattr(torch, "compile", damaged)
    try:
        with caplog.at_level(logging.WARNING, logger="kestrel"):
            engine = Engine(base, random_head(base.model), compile="on")
    finally:
        torch_log.removeHandler(handler)
    assert engine.compiled is None and compiled.of(base.model) is None
    assert printed == []  # torch's own warning and traceback kept off the terminal
    left = {path for path in (cut, whole, module, other) if path.exists()}
    if damage == "other":
        assert left == {cut, whole, module, other} and "was damaged" not in caplog.text
    elif own:
        assert not cache.exists() and f"torch's compile cache ({cache}) was damaged" in caplog.text and "emptied" in caplog.text
    else:
        assert left == ({whole, other, module} if damage == "entry" else {whole, other})  # the module named by the error
        assert f"torch's compile cache ({cache}) was damaged" in caplog.text and "damaged entries were removed" in caplog.text
    assert tokens_of(engine.stream([9, 10, 11], "eagle2", SamplingParams(max_new_tokens=12))) == reference


def test_segments_cover_the_layers_in_runs_starting_at_hooked_layers():
    size = compiled.SEGMENT
    assert compiled.segments(30, set()) == [(start, min(start + size, 30)) for start in range(0, 30, size)]
    runs = compiled.segments(30, {2, 15, 27})
    assert [layer for start, end in runs for layer in range(start, end)] == list(range(30))
    assert {2, 15, 27} <= {start for start, _ in runs}
    assert all(0 < end - start <= size for start, end in runs)
    assert compiled.segments(4, {0, 3}) == [(0, 3), (3, 4)]  # SEGMENT >= 3


@needs_compiler
def test_a_decoder_whose_forward_the_loop_does_not_match_stays_eager(tiny_folder, caplog):
    """The loop is checked against the transformers decoder at compile time: one
    that scales its embedding (as some architectures do) is left eager."""
    base = load_base(str(tiny_folder), dtype="float32")
    decoder = base.model.get_decoder()
    plain = decoder.forward

    def scaled(input_ids=None, **kwargs):
        return plain(inputs_embeds=decoder.embed_tokens(input_ids) * 8.0, **kwargs)

    decoder.forward = scaled
    with caplog.at_level("WARNING", logger="kestrel"):
        engine = Engine(base, compile="on")
    assert engine.compiled is None and compiled.of(base.model) is None
    assert "differs from LlamaModel's forward" in caplog.text
    assert base.model.config._attn_implementation != compiled.NAME


@needs_compiler
@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
def test_the_compiled_head_drafts_as_the_eager_one(tiny_folder, kind):
    """One call after another, as drafting makes them (a catch-up over
    several rows, a tree level of siblings, one row): the compiled head's
    outputs and cache entries equal the eager head's in float64, up to the
    float32 casts of its norm, which Inductor may fuse away (1e-6 here)."""
    from models.head import HeadCache

    base = load_base(str(tiny_folder), dtype="float64")
    head = random_head(base.model, seed=5) if kind == "eagle2" else random_eagle3_head(base.model, seed=5)
    embed = base.model.get_input_embeddings()
    fast = compiled.compile_head(head, embed)
    assert fast is not None and fast.feature_size == head.feature_size  # otherwise the head itself
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 48, (1, 9), generator=generator)
    features = torch.randn(1, 9, head.feature_size, generator=generator, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 6, 7]])
    tree = torch.ones(1, 1, 2, 9, dtype=torch.bool)
    tree[0, 0, :, 7:] = torch.tensor([[True, False], [False, True]])
    calls = [(slice(0, 5), None), (slice(5, 7), torch.ones(1, 1, 2, 7, dtype=torch.bool).tril(5)), (slice(7, 9), tree)]
    caches = HeadCache(), HeadCache()
    with torch.inference_mode():
        for part, mask in calls:
            eager, quick = (run(embed(tokens[:, part]), features[:, part], positions[:, part], mask, cache) for run, cache in zip((head, fast), caches))
            torch.testing.assert_close(quick, eager, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(caches[1].keys, caches[0].keys, rtol=1e-4, atol=1e-5)
        assert caches[1].length == 9


@needs_compiler
def test_a_compiled_head_that_computes_something_else_stays_eager(tiny_folder, monkeypatch):
    base = load_base(str(tiny_folder), dtype="float32")
    monkeypatch.setattr(compiled._OpaqueCache, "attend", lambda self, query, key, value, mask: torch.zeros_like(query))
    assert compiled.compile_head(random_head(base.model, seed=2), base.model.get_input_embeddings()) is None


@needs_compiler
def test_the_cpp_pass_op_appends_and_attends_as_the_python_op(tiny_folder, monkeypatch):
    """Where the row kernel runs a forward, the compiled layers' attention op
    appends to the cache's buffers and attends in C++: the same bits as the
    Python op (prefill, tree passes and commits in between), every decoded
    token the same, and the Python op's pass state left alone."""
    from core import kv_cache, rowkernel
    from core.tree import ancestor_mask
    from core.verify import base_forward

    if rowkernel.library() is None:
        pytest.skip("the row kernel is not built here")
    base = load_base(str(tiny_folder), dtype="float64")
    engine = Engine(base, random_head(base.model, seed=3), compile="on")
    assert engine.exact and engine.compiled.pass_ops
    advanced, advance = [], kv_cache.advance  # the C++ op's forwards end by advancing the cache

    def counted(cache, length):
        advanced.append(length)
        advance(cache, length)

    monkeypatch.setattr(kv_cache, "advance", counted)
    model, generator = base.model, torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 48, (11,), generator=generator)
    parents = torch.tensor([-1, 0, 0, 1, 2, 3])
    mask = ancestor_mask(parents)  # (6, 6)
    results = []
    for pass_ops in (True, False):
        engine.compiled.pass_ops = pass_ops
        cache, hidden = kv_cache.new_cache(model), []
        with torch.inference_mode():
            hidden.append(base_forward(model, prompt, torch.arange(11), None, cache))
            for step in range(3):
                length = cache.get_seq_length()
                tree_tokens = torch.randint(0, 48, (6,), generator=torch.Generator().manual_seed(step))
                visible = torch.cat([torch.ones(6, length, dtype=torch.bool), mask], dim=1)
                positions = length + torch.tensor([0, 1, 1, 2, 2, 3])
                hidden.append(base_forward(model, tree_tokens, positions, visible, cache))
                kv_cache.commit(cache, length, [0, 2, 4] if step % 2 else [0, 1, 3, 5])
                hidden.append(base_forward(model, torch.tensor([7]), torch.tensor([cache.get_seq_length()]), None, cache))
        results.append((hidden, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]))
    assert advanced == [17, 16, 22, 20, 26, 25]  # the C++ op ran every tree pass and one-token step of the first run
    (hidden, layers), (reference, reference_layers) = results
    assert all(torch.equal(a, b) for a, b in zip(hidden, reference))
    assert all(torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(layers, reference_layers))
    engine.compiled.pass_ops = True
    sampling = SamplingParams(max_new_tokens=24)
    assert tokens_of(engine.stream(prompt.tolist(), "eagle2", sampling, TreeParams(12, 4, 3))) == tokens_of(engine.stream(prompt.tolist(), "vanilla", sampling))


@needs_compiler
def test_a_failed_forward_leaves_no_pass_state_behind(tiny_folder):
    """A forward that raises inside the compiled layers still pops its state:
    the next forward decodes, and nothing is left on the pass stack."""
    from core import kv_cache, rowkernel

    if rowkernel.library() is None:
        pytest.skip("the row kernel is not built here")
    base = load_base(str(tiny_folder), dtype="float64")
    engine = Engine(base, random_head(base.model, seed=3), compile="on")
    layer = base.model.get_decoder().layers[1]

    def fail(module, args):
        raise ValueError("a failing hook")

    reference = tokens_of(engine.stream([9, 10, 11], "eagle2", SamplingParams(max_new_tokens=8)))
    handle = layer.register_forward_pre_hook(fail)
    try:
        with pytest.raises(ValueError, match="a failing hook"):
            list(engine.stream([9, 10, 11], "eagle2", SamplingParams(max_new_tokens=8)))
    finally:
        handle.remove()
    with pytest.raises(RuntimeError, match="end_pass without begin_pass"):
        torch.ops.kestrel_rows.end_pass()
    assert tokens_of(engine.stream([9, 10, 11], "eagle2", SamplingParams(max_new_tokens=8))) == reference
    assert kv_cache.buffers(kv_cache.new_cache(base.model), 1) is None  # nothing held: the Python op appends


@needs_compiler
def test_an_unloaded_compiled_model_leaves_no_compiled_code_behind(tiny_folder):
    """Dynamo keeps what it compiled per code object, its functions in
    core/compiled's globals, for the process's life: every load and unload
    with compiling on left some 10 MB behind. Unload and replace drop them."""
    from app.runtime import Runtime

    def made() -> set[str]:
        return {name for name in vars(compiled) if name.startswith("__compiled_fn")}

    before = made()
    runtime = Runtime(None)
    for _ in range(2):
        base = load_base(str(tiny_folder), dtype="float32")
        engine = runtime.replace(lambda: Engine(base, random_head(base.model, seed=1), compile="on"))
        assert len(tokens_of(engine.stream([5, 6, 7], mode="eagle2", sampling=SamplingParams(max_new_tokens=6)))) == 6
        assert made() - before  # the model's and the head's
        engine = base = None
        runtime.unload()
        assert made() == before
