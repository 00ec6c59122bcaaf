"""Static passes for CUDA graphs (core/graphs.py): padded rows, writes into
the cache's buffers and a mask over their whole capacity compute what eager
passes compute. Checked on CPUs without capture, in float64; the capture
itself needs a CUDA GPU."""

import json

import pytest
import torch

from core import compiled, costs, graphs, kv_cache
from core.config import SamplingParams, TreeParams
from core.engine import Engine
from core.verify import base_forward
from models.base import load_base
from tests.factory import decodes_as, random_eagle3_head, random_head, save_tiny_model, tokens_of


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_folder(request, tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("graphs") / request.param, request.param, vocab_size=48)


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
def test_static_passes_decode_exactly_as_eager(tiny_folder, kind):
    """float64: every mode through the static passes equals eager vanilla,
    greedy and sampled, EAGLE-3's captured layers included."""
    eager = Engine(load_base(str(tiny_folder), dtype="float64"), compile="off")
    base = load_base(str(tiny_folder), dtype="float64")
    head = random_head(base.model, seed=1) if kind == "eagle2" else random_eagle3_head(base.model, seed=1)
    engine = Engine(base, head, compile="graphs")
    graphed = engine.graphed
    assert graphed is not None and graphs.of(base.model) is graphed and not graphed.capture
    assert base.model.config._attn_implementation == graphs.NAME and engine.speculation_problem() is None
    assert decodes_as(engine, eager) > 0
    assert len(graphed.entries) > 1  # one-token steps and padded tree passes ran static
    assert {key[0] for key in graphed.entries} <= set(graphs.ROWS)


def test_a_static_pass_computes_the_eager_features(tiny_folder):
    """A 5-node tree padded to 8 rows, then one-token steps past the
    buffers' capacity (they grow, and the passes move to new buffers): the
    same features and cache contents as eager passes."""
    base = load_base(str(tiny_folder), dtype="float64")
    model = base.model
    eager_cache, static_cache = kv_cache.new_cache(model), kv_cache.new_cache(model)
    prompt = torch.arange(8, 8 + 30)
    base_forward(model, prompt, torch.arange(30), None, eager_cache)
    base_forward(model, prompt, torch.arange(30), None, static_cache)
    graphed = graphs.graph_model(model, capture=False)
    tokens = torch.tensor([9, 10, 11, 12, 13])
    positions = torch.tensor([30, 31, 31, 32, 32])
    mask = torch.ones(5, 35, dtype=torch.bool)
    mask[:, 30:] = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], dtype=torch.bool)
    steps = [(tokens, positions, mask)] + [(torch.tensor([8 + step % 40]), torch.tensor([35 + step]), None) for step in range(graphs.CAPACITY_STEP)]
    try:
        static = [graphed.forward(*step, static_cache) for step in steps]
        # buffers aligned to a whole step at the first static pass, then grown past it
        assert [key[:3] for key in graphed.entries] == [(8, (), graphs.CAPACITY_STEP), (1, (), graphs.CAPACITY_STEP), (1, (), 2 * graphs.CAPACITY_STEP)]
    finally:
        graphs.ungraph(graphed)
    assert model.config._attn_implementation != graphs.NAME
    reference = [base_forward(model, *step, eager_cache) for step in steps]
    for ours, theirs in zip(static, reference):
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-9)
    assert static_cache.get_seq_length() == eager_cache.get_seq_length() == 35 + graphs.CAPACITY_STEP
    for ours, theirs in zip(static_cache.layers, eager_cache.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(ours.values, theirs.values, rtol=1e-9, atol=1e-9)


def test_passes_past_the_largest_row_count_and_prefill_run_eagerly(tiny_folder):
    base = load_base(str(tiny_folder), dtype="float64")
    graphed = graphs.graph_model(base.model, capture=False)
    try:
        cache = kv_cache.new_cache(base.model)
        base_forward(base.model, torch.arange(8, 20), torch.arange(12), None, cache)  # prefill: causal, eager
        assert not graphed.entries and cache.get_seq_length() == 12
        count = graphs.ROWS[-1] + 1
        mask = torch.ones(count, 12 + count, dtype=torch.bool).tril(12)
        base_forward(base.model, torch.full((count,), 9), torch.arange(12, 12 + count), mask, cache)
        assert not graphed.entries and cache.get_seq_length() == 12 + count
        base_forward(base.model, torch.tensor([9]), torch.tensor([12 + count]), None, cache)
        assert len(graphed.entries) == 1 and cache.get_seq_length() == 13 + count
    finally:
        graphs.ungraph(graphed)


def test_padding_rows_do_not_change_a_scaled_rotary_embedding(tmp_path):
    """A rotary embedding scaled by the largest position (dynamic NTK): a
    tree padded in an entry that a longer pass used before computes as
    eagerly (the padding rows' positions are the pass's own)."""
    folder = save_tiny_model(tmp_path / "dynamic", "llama", vocab_size=48, max_position_embeddings=64, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    model = load_base(str(folder), dtype="float64").model

    def tree_pass(cache, length, n):
        mask = torch.ones(n, length + n, dtype=torch.bool)
        mask[:, length:] = torch.ones(n, n, dtype=torch.bool).tril()
        return base_forward(model, torch.arange(9, 9 + n), torch.arange(length, length + n), mask, cache)

    eager = kv_cache.new_cache(model)
    base_forward(model, torch.arange(8, 28), torch.arange(20), None, eager)
    reference = tree_pass(eager, 20, 5)
    graphed = graphs.graph_model(model, capture=False)
    try:
        cache = kv_cache.new_cache(model)
        base_forward(model, torch.arange(8, 28), torch.arange(20), None, cache)
        base_forward(model, torch.arange(60) % 40 + 8, torch.arange(20, 80), torch.ones(60, 80, dtype=torch.bool).tril(20), cache)
        tree_pass(cache, 80, 7)  # 8 rows at positions past the model's 64
        kv_cache.advance(cache, 20)  # back to the prompt, as a regenerated reply continues a kept cache
        again = tree_pass(cache, 20, 5)  # the same 8-row entry
        assert [key[0] for key in graphed.entries] == [64, 8]  # the 60-row pass, and the 8-row entry used twice
    finally:
        graphs.ungraph(graphed)
    torch.testing.assert_close(again, reference, rtol=1e-9, atol=1e-9)


def test_decoders_the_loop_does_not_stand_for_stay_eager(tiny_folder):
    """A decoder that scales its embedding (Granite), or has no layers in the
    expected place (GPT-2): no graphs, and the engine decodes eagerly."""
    from transformers import AutoModelForCausalLM, GPT2Config, GraniteConfig

    small = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    granite = AutoModelForCausalLM.from_config(GraniteConfig(**small, embedding_multiplier=4.0), dtype=torch.float64)
    assert graphs.graph_model(granite, capture=False) is None and graphs.of(granite) is None
    assert granite.config._attn_implementation != graphs.NAME
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=48, n_embd=32, n_layer=2, n_head=4), dtype=torch.float64)
    assert graphs.graph_model(gpt2, capture=False) is None
    base = load_base(str(tiny_folder), dtype="float64")  # and one the loop stands for
    graphed = graphs.graph_model(base.model, capture=False)
    assert graphed is not None and not graphed.entries  # the check's own passes are not kept
    graphs.ungraph(graphed)


def test_an_engine_made_again_follows_its_compile_setting(tiny_folder):
    base = load_base(str(tiny_folder), dtype="float64")
    assert Engine(base, compile="graphs").graphed is not None
    eager = Engine(base, compile="off")
    assert eager.graphed is None and graphs.of(base.model) is None and base.model.config._attn_implementation != graphs.NAME
    again = Engine(base, compile="graphs")
    assert again.graphed is graphs.of(base.model) and base.model.config._attn_implementation == graphs.NAME
    if compiled.compiler_available():  # compiled layers replace the graphs, and graphs the compiled layers
        made = Engine(base, compile="on")
        assert made.compiled is compiled.of(base.model) and made.graphed is None and graphs.of(base.model) is None
        assert base.model.config._attn_implementation == compiled.NAME
        last = Engine(base, compile="graphs")
        assert last.compiled is None and compiled.of(base.model) is None and last.graphed is graphs.of(base.model)
        assert base.model.config._attn_implementation == graphs.NAME


class FakeCuda:
    """torch.cuda's calls that capture and replay make, for a CPU: CUDA acts
    on the thread's current device, so each call here notes the device
    current when it acts. torch.cuda.graph's own capture stream is made once,
    on the device current at its first use: here cuda:0, current at start."""

    def __init__(self, monkeypatch):
        self.current = torch.device("cuda", 0)
        self.seen: list[tuple[str, torch.device]] = []  # (what, the device current then)
        fake = self

        class Device:  # torch.cuda.device
            def __init__(self, device):
                self.device = torch.device(device)

            def __enter__(self):
                self.outer, fake.current = fake.current, self.device

            def __exit__(self, *exc):
                fake.current = self.outer

        class Stream:
            def __init__(self, device=None):
                self.device = fake.current if device is None else torch.device(device)

            def wait_stream(self, other):
                pass

        class StreamContext(Device):  # torch.cuda.stream: its stream's device becomes current
            def __init__(self, stream):
                super().__init__(stream.device)

            def __enter__(self):
                super().__enter__()
                fake.seen.append(("stream", fake.current))

        class Graph:  # torch.cuda.CUDAGraph
            def replay(self):
                fake.seen.append(("replay", fake.current))

        default_stream = Stream()

        class Capture(StreamContext):  # torch.cuda.graph
            def __init__(self, graph, pool=None, stream=None, capture_error_mode="global"):
                super().__init__(stream or default_stream)

            def __enter__(self):
                super().__enter__()
                fake.seen.append(("capture", fake.current))

        for name, value in dict(
            device=Device, Stream=Stream, stream=StreamContext, CUDAGraph=Graph, graph=Capture,
            graph_pool_handle=lambda: (0, 1), current_stream=lambda device=None: Stream(device),
        ).items():  # fmt: skip
            monkeypatch.setattr(torch.cuda, name, value)


def test_graphs_are_captured_and_replayed_with_the_model_s_device_current(tiny_folder, monkeypatch):
    """A model on cuda:1 whose graphs were captured with cuda:0 current (as
    on a decoding thread, where nothing set it) recorded none of its kernels:
    replays did nothing and repeated the first step's output. The model here
    (on the CPU) stands for one on a device that is not the current one."""
    cuda = FakeCuda(monkeypatch)
    model = load_base(str(tiny_folder), dtype="float64").model
    graphed = graphs.graph_model(model, capture=True)
    try:
        cache = kv_cache.new_cache(model)
        base_forward(model, torch.arange(8, 20), torch.arange(12), None, cache)
        base_forward(model, torch.tensor([9]), torch.tensor([12]), None, cache)  # captured, then replayed
        base_forward(model, torch.tensor([10]), torch.tensor([13]), None, cache)  # replayed
    finally:
        graphs.ungraph(graphed)
    assert graphed.captures == 1 and [what for what, _ in cuda.seen] == ["stream", "stream", "capture", "replay", "replay"]
    assert all(device == model.device for _, device in cuda.seen), cuda.seen  # the warm-up's stream, the capture's, the replays
    assert cuda.current == torch.device("cuda", 0)  # as it was


def test_a_pass_run_before_capture_was_turned_on_is_captured_rather_than_replayed(tiny_folder, monkeypatch):
    """A static pass kept from before capture was turned on has no graph: its
    next run replayed None (an AttributeError). A load's self-checks run such
    passes, and a later pass on buffers at the same addresses found them."""
    FakeCuda(monkeypatch)
    model = load_base(str(tiny_folder), dtype="float64").model
    graphed = graphs.graph_model(model, capture=False)
    captured = []

    def capture(static, keys, values, hooked):
        captured.append(len(static.tokens))

        def run():
            static.out = graphed._static_forward(static, keys, values, hooked)

        run()
        static.graph = type("Replay", (), {"replay": staticmethod(run)})()

    monkeypatch.setattr(graphed, "_capture", capture)
    try:
        cache = kv_cache.new_cache(model)
        base_forward(model, torch.arange(8, 20), torch.arange(12), None, cache)
        eager = base_forward(model, torch.tensor([9]), torch.tensor([12]), None, cache)  # kept, with no graph
        kv_cache.commit(cache, 12, [])  # the same position again, on the same buffers
        graphed.capture = True
        replayed = base_forward(model, torch.tensor([9]), torch.tensor([12]), None, cache)
    finally:
        graphs.ungraph(graphed)
    assert captured == [1]
    torch.testing.assert_close(replayed, eager, rtol=0, atol=0)


def test_graphs_given_up_while_costs_are_measured_leave_the_eager_passes_table(tiny_dir, monkeypatch, tmp_path):
    """A capture that runs out of memory part-way through measuring step
    costs gives graphs up: that table (partly graphed) is cached under no
    key, the eager passes' table is measured and cached, and the engine
    plans with it. Graphs given up after a graphed table: the eager one again."""
    monkeypatch.setenv("KESTREL_COSTS_DIR", str(tmp_path))
    FakeCuda(monkeypatch)  # replays run under torch.cuda.device
    captures, fail_at = [], [4]  # the 8-row pass's capture (1, 2, 4, 8, ... rows measured in turn)

    class Replay:  # a CPU's stand-in for a captured graph: replaying runs the static pass
        def __init__(self, run):
            self.replay = run

    def capture(graphed, static, keys, values, hooked):
        captures.append(len(static.tokens))
        if len(captures) == fail_at[0]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

        def run():
            static.out = graphed._static_forward(static, keys, values, hooked)

        run()
        static.graph = Replay(run)

    measured, measure = [], costs.measure
    monkeypatch.setattr(costs, "measure", lambda *args: measured.append(1) or measure(*args))
    monkeypatch.setattr(graphs.Graphed, "_capture", capture)

    def graphed_engine():
        base = load_base(str(tiny_dir), dtype="float64")
        engine = Engine(base, random_head(base.model, seed=1), compile="graphs")
        engine.graphed.capture = True
        return engine

    def cached():
        saved = [json.loads(path.read_text()) for path in tmp_path.glob("costs-*.json")]
        return {entry["key"]["graphs"]: costs.Costs.from_dict(entry["costs"]) for entry in saved}

    engine = graphed_engine()
    table = engine.prepare_costs()
    assert captures == [1, 2, 4, 8] and "ran out of memory" in engine.graphed.problem and not engine.graphs_in_use
    assert len(measured) == 2 and cached() == {False: table} and engine.costs == table
    fail_at[0] = 0  # no capture fails
    later = graphed_engine()
    graphed_table = later.prepare_costs()
    assert len(measured) == 3 and later.graphs_in_use and cached() == {False: table, True: graphed_table}
    later.graphed.give_up("capturing a CUDA graph ran out of memory")  # as a later conversation's capture may
    assert later.prepare_costs() == table and later.costs == table and len(measured) == 3


def test_running_out_of_memory_in_the_static_pass_check_decodes_eagerly(tiny_folder, monkeypatch, caplog):
    """Graphs' buffers are memory eager passes do without: where checking the
    static pass at load runs out of it, the model decodes eagerly, saying why."""

    def no_memory(graphed):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    monkeypatch.setattr(graphs, "_loop_problem", no_memory)
    base = load_base(str(tiny_folder), dtype="float64")
    with caplog.at_level("INFO", logger="kestrel"):
        assert graphs.graph_model(base.model, capture=False) is None
    assert "Decoding eagerly: the static pass's check ran out of memory (OutOfMemoryError" in caplog.text
    assert graphs.of(base.model) is None and base.model.config._attn_implementation != graphs.NAME
    assert not Engine(base, compile="graphs").graphs_in_use


def test_rows_are_padded_to_the_next_count():
    assert [graphs.rows_for(count) for count in (1, 2, 3, 5, 9, 13, 60, 128)] == [1, 2, 4, 8, 12, 16, 64, 128]
    assert graphs.rows_for(129) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="capturing CUDA graphs needs a CUDA GPU")
def test_captured_graphs_replay_the_static_passes(tiny_folder):
    """On a GPU: replayed graphs give the replies of uncaptured static passes (float32)."""
    plain = Engine(load_base(str(tiny_folder), dtype="float32", device="cuda"), compile="graphs")
    base = load_base(str(tiny_folder), dtype="float32", device="cuda")
    engine = Engine(base, random_head(base.model, seed=1).to(base.device), compile="graphs")
    assert engine.graphs_in_use
    plain.graphed.capture = False
    prompt = list(range(8, 20))
    sampling = SamplingParams(max_new_tokens=24)
    reference = tokens_of(plain.stream(prompt, "vanilla", sampling))
    assert tokens_of(engine.stream(prompt, "vanilla", sampling)) == reference
    steps = list(engine.stream(prompt, "eagle2", sampling, TreeParams(12, 4, 3)))
    assert engine.graphs_in_use and engine.graphed.captures > 0
    assert len(tokens_of(steps)) == len(reference)


def test_a_sliding_window_as_long_as_the_context_is_none_and_a_shorter_one_gives_way(tmp_path):
    """A window no shorter than the context window (Phi-3.5's way) never cuts
    anything: the cache is Kestrel's own (transformers' sliding layers counted
    every tree node verified, and the masks sized from that count stopped
    fitting), the row-invariant attention and the static passes run, and
    every mode decodes as eager vanilla in float64. A shorter window: the static
    passes give way (the model loading failed), and speculation is refused saying why."""
    for window in (512, 128):  # the tiny models' context window is 256
        folder = save_tiny_model(tmp_path / str(window), "mistral", vocab_size=48, sliding_window=window)
        eager = Engine(load_base(str(folder), dtype="float64"), compile="off")
        for compile in ("off", "graphs"):
            base = load_base(str(folder), dtype="float64")
            engine = Engine(base, random_head(base.model, seed=1), compile=compile)
            if window == 512:
                assert all(type(layer) is kv_cache.GrowingLayer for layer in kv_cache.new_cache(base.model).layers)
                assert engine.speculation_problem() is None and (engine.graphed is not None) == (compile == "graphs")
                assert engine.exact or compile == "graphs"
                assert decodes_as(engine, eager) > 0
            else:
                assert engine.graphed is None and "sliding-window" in engine.speculation_problem()
                assert tokens_of(engine.stream(engine.encode([{"role": "user", "content": "w1 w2"}]), "vanilla", SamplingParams(max_new_tokens=8)))
