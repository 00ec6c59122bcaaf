"""EAGLE-3 heads: the published checkpoint format loaded strictly, features
captured from the unmodified base model, and lossless decoding with them."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.capture import LayerCapture
from core.config import SamplingParams, TreeParams
from core.drafter import draft_vocabulary
from core.engine import Engine
from models import eagle3
from models.base import load_base
from models.errors import HeadFormatError
from models.head import head_files, load_head, read_checkpoint
from tests.factory import ARCHITECTURES, decodes_as, random_eagle3_head, save_tiny_model
from tests.test_planner import CPU_LIKE, GPU_LIKE


@pytest.fixture(scope="module")
def base64(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("llama") / "m", vocab_size=48)
    return load_base(str(folder), dtype="float64")


def saved(base, folder, **options):
    head = random_eagle3_head(base.model, **options)
    return head, eagle3.save(head, folder)


def load(base, folder):
    config = base.model.config
    return load_head(folder, config.hidden_size, config.vocab_size, dtype=torch.float64, base_layers=config.num_hidden_layers)


def test_round_trip_in_the_published_format(base64, tmp_path):
    head, folder = saved(base64, tmp_path / "head", qkv_bias=True)
    loaded = load(base64, folder)
    assert isinstance(loaded, eagle3.Eagle3Head)
    original, again = head.state_dict(), loaded.state_dict()
    assert original.keys() == again.keys() and all(torch.equal(original[k], again[k]) for k in original)
    assert loaded.layer_ids == head.layer_ids
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 24
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    _, state, _ = read_checkpoint(folder)
    assert {"fc.weight", "midlayer.hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(state)
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool and int(state["t2d"].sum()) == 24


def rewrite(folder, change):
    state = load_file(str(folder / "model.safetensors"))
    change(state)
    save_file(state, str(folder / "model.safetensors"))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s.pop("midlayer.hidden_norm.weight"), r"missing key midlayer\.hidden_norm\.weight \(expected shape \[64\]\)"),
        (lambda s: s.update(extra=torch.zeros(3)), r"unexpected key extra \(shape \[3\]\) in an EAGLE-3 head"),
        (lambda s: s.update({"fc.weight": torch.zeros(64, 128)}), r"key fc\.weight has shape \[64, 128\], expected \[64, 192\]"),
        (lambda s: s.update(d2t=torch.full((24,), 40)), r"d2t maps draft ids outside the vocabulary of 48 tokens"),
    ],
    ids=["missing", "extra", "shape", "d2t-range"],
)
def test_bad_checkpoints_are_refused_by_name(base64, tmp_path, change, message):
    _, folder = saved(base64, tmp_path / "head")
    rewrite(folder, change)
    with pytest.raises(HeadFormatError, match=message) as caught:
        load(base64, folder)
    assert "model.safetensors" in str(caught.value)


def test_d2t_offsets_map_draft_ids_to_target_ids(base64, tmp_path):
    draft_ids = torch.tensor([3, 7, 8, 20, 41])
    head, folder = saved(base64, tmp_path / "head", draft_ids=draft_ids)
    _, state, _ = read_checkpoint(folder)
    assert state["d2t"].tolist() == [3, 6, 6, 17, 37]  # target id = draft id + d2t[draft id]
    loaded = load(base64, folder)
    vocabulary = draft_vocabulary(loaded, base64.model)
    assert vocabulary.target_ids(torch.tensor([0, 1, 2, 3, 4])).tolist() == [3, 7, 8, 20, 41]
    # the head's own lm_head ranks them: a row that favours draft id 3 proposes target 20
    with torch.no_grad():
        loaded.lm_head.weight.zero_()
        loaded.lm_head.weight[3] = 1.0
    hidden = torch.ones(1, 64, dtype=torch.float64)
    best = draft_vocabulary(loaded, base64.model).log_probs(hidden).argmax(-1)
    assert vocabulary.target_ids(best).tolist() == [20]


def test_feature_layers_come_from_the_config_or_the_default(base64, tmp_path):
    _, folder = saved(base64, tmp_path / "head")
    config_file = folder / "config.json"
    settings = json.loads(config_file.read_text())
    settings.pop("eagle_aux_hidden_state_layer_ids")
    config_file.write_text(json.dumps(settings))
    config = base64.model.config
    published = load_head(folder, config.hidden_size, config.vocab_size, base_layers=32)  # as for an 8B model
    assert published.layer_ids == (2, 16, 29)
    settings["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 2, 0]}
    config_file.write_text(json.dumps(settings))
    assert load(base64, folder).layer_ids == (0, 1, 2)  # fused low, mid, high, in the order the layers run
    settings["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 0, 1]}
    config_file.write_text(json.dumps(settings))
    with pytest.raises(HeadFormatError, match=r"config.json: eagle_aux_hidden_state_layer_ids names layer 1 more than once"):
        head_files(folder)
    settings["eagle_aux_hidden_state_layer_ids"] = [0, 1, 9]
    config_file.write_text(json.dumps(settings))
    with pytest.raises(HeadFormatError, match=r"aux layers \[0, 1, 9\] do not exist in a 2-layer base model"):
        load(base64, folder)
    for ids in ([0, 1], [-1, 0, 1], [True, False, 1], "0,1,2"):
        settings["eagle_aux_hidden_state_layer_ids"] = ids
        config_file.write_text(json.dumps(settings))
        with pytest.raises(HeadFormatError, match="config.json: eagle_aux_hidden_state_layer_ids must be three layer numbers"):
            head_files(folder)  # from config.json alone, before any base model loads


def test_a_new_head_fuses_three_different_layers_that_load_again(base64, tmp_path):
    """Training's layers: the reference (2, L//2, L-3) where those are three layers;
    on 4- to 6-layer bases, where it repeats one (refused in config.json), three others."""
    for layers in range(2, 81):
        ids = eagle3.training_layer_ids(layers)
        assert len(set(ids)) == 3 and list(ids) == sorted(ids) and 0 <= ids[0] and ids[-1] <= layers, (layers, ids)
        if len(set(eagle3.default_layer_ids(layers))) == 3:
            assert ids == eagle3.default_layer_ids(layers)
    assert eagle3.training_layer_ids(5) == (1, 2, 4)
    with pytest.raises(ValueError, match="fuses three layers of its base model; this one has 1 decoder layer"):
        eagle3.training_layer_ids(1)
    _, folder = saved(base64, tmp_path / "head", layer_ids=eagle3.training_layer_ids(5))
    config = base64.model.config
    loaded = load_head(folder, config.hidden_size, config.vocab_size, dtype=torch.float64, base_layers=5)
    assert loaded.layer_ids == (1, 2, 4)


def test_captured_features_are_the_models_own_hidden_states(base64):
    """Hook i holds transformers' output_hidden_states[i]: the input of
    decoder layer i, and for i = L the last layer's output before the norm."""
    model = base64.model
    tokens = torch.tensor([[5, 9, 13, 2, 7]])
    outputs = []
    handle = model.get_decoder().layers[-1].register_forward_hook(lambda module, args, out: outputs.append(out))
    expected = model(tokens, output_hidden_states=True).hidden_states
    handle.remove()
    last = outputs[0][0] if isinstance(outputs[0], tuple) else outputs[0]
    expected = (expected[0], expected[1], last)  # transformers' hidden_states[L] is after the final norm
    capture = LayerCapture(model, (0, 1, 2))
    with capture.during():
        model(tokens)
    fused = capture.features()
    assert fused.shape == (5, 3 * 64)
    for index, layer in enumerate((0, 1, 2)):
        assert torch.equal(fused[:, 64 * index : 64 * (index + 1)], expected[layer][0])
    model(tokens)  # hooks are gone after the block
    with pytest.raises(RuntimeError):
        capture.features()


def test_the_engine_feeds_the_head_its_own_layers_and_drafts_target_ids(base64, monkeypatch):
    """Decoding is lossless whatever the head drafts, so exactness tests cannot
    see a head fed the wrong layers or drafting unmapped ids: the engine
    captures the head's layers in the head's order, and every drafted token is
    one of the head's draft tokens (draft ids mapped through d2t)."""
    from core.drafter import Drafter

    draft_ids = torch.tensor([9, 17, 24, 30, 31, 33, 40, 41, 44, 46, 47])  # none below 9 = the draft vocabulary's size
    head = random_eagle3_head(base64.model, seed=3, draft_ids=draft_ids, layer_ids=(2, 0, 1))
    engine = Engine(base64, head)
    decoder = base64.model.get_decoder()
    assert len(decoder.layers) == 2  # hidden state 2 is the final norm's input
    assert engine.capture.modules == [decoder.norm, decoder.layers[0], decoder.layers[1]]
    trees = []
    draft = Drafter.draft
    monkeypatch.setattr(Drafter, "draft", lambda self, root: trees.append(draft(self, root)) or trees[-1])
    for seed in range(3):
        prompt = torch.randint(0, 48, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        sampling = SamplingParams(max_new_tokens=12) if seed else SamplingParams(temperature=1.0, max_new_tokens=12, seed=seed)
        list(engine.stream(prompt, "eagle2", sampling, TreeParams(10, 3, 3, lookup_tokens=0)))
    drafted = [token for tree in trees for token in tree.tokens[1:].tolist()]
    assert len(drafted) > 50 and set(drafted) <= set(draft_ids.tolist())


@pytest.fixture(scope="module", params=ARCHITECTURES)
def engine3(request, tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp(request.param) / "m", request.param, vocab_size=48)
    base = load_base(str(folder), dtype="float64")
    return Engine(base, random_eagle3_head(base.model, seed=1, qkv_bias=request.param == "qwen2"))


def tokens_of(steps) -> list[int]:
    return [token for step in steps for token in step.token_ids]


@pytest.mark.parametrize(
    "tree, costs",
    [(TreeParams(12, 4, 3), None), (TreeParams(30, 6, 5, lookup_tokens=6), None), (TreeParams(), GPU_LIKE), (TreeParams(), CPU_LIKE)],
    ids=["12/4/3", "30/6/5", "planned-gpu", "planned-cpu"],
)
def test_eagle3_heads_decode_exactly_as_vanilla(engine3, tree, costs):
    engine3.costs = costs
    accepted = 0
    for seed in range(5):
        prompt = torch.randint(8, 48, (4 + 3 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        for sampling in (SamplingParams(max_new_tokens=30), SamplingParams(temperature=1.0, max_new_tokens=30, seed=seed)):
            reference = tokens_of(engine3.stream(prompt, "vanilla", sampling))
            for mode in ("eagle", "eagle2"):
                steps = list(engine3.stream(prompt, mode, sampling, tree))
                assert tokens_of(steps) == reference, (mode, seed, sampling)
                accepted += sum(step.accepted for step in steps)
    assert accepted > 0


def test_an_eagle3_head_loads_with_its_base_through_the_app(tmp_path):
    from app.session import load_pair

    folder = save_tiny_model(tmp_path / "qwen3", "qwen3", vocab_size=48)
    base = load_base(str(folder), dtype="float32")
    eagle3.save(random_eagle3_head(base.model), tmp_path / "head")
    engine = load_pair(str(folder), str(tmp_path / "head"), dtype="float32", device="cpu")
    assert engine.modes == ("vanilla", "eagle", "eagle2") and engine.capture is not None
    from app.runtime import Runtime

    assert "with an EAGLE-3 draft head" in Runtime(engine).describe()
    steps = list(engine.stream([5, 6, 7], "eagle2", SamplingParams(max_new_tokens=8), TreeParams(8, 3, 3)))
    assert len(tokens_of(steps)) == 8 or steps[-1].finish_reason == "stop"


def test_eagle3_heads_decode_exactly_after_a_prompt_read_in_chunks(engine3, monkeypatch):
    import core.engine

    prompt = torch.randint(8, 48, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_new_tokens=30)
    reference = tokens_of(engine3.stream(prompt, mode="vanilla", sampling=params))
    monkeypatch.setattr(core.engine, "PREFILL_CHUNK", 9)
    assert tokens_of(engine3.stream(prompt, mode="eagle2", sampling=params, tree=TreeParams(12, 4, 3))) == reference


def test_published_variants_load_as_the_head_they_are(base64, tmp_path):
    """What published heads leave out and can be told: t2d (never read),
    draft_vocab_size null (lm_head's rows), d2t for a whole-vocabulary head
    (identity); a head in shards; aux ids in the output-of-layer numbering
    (the default layers minus one) read as the layers they mean."""
    head, folder = saved(base64, tmp_path / "head")
    reference = load(base64, folder)
    rewrite(folder, lambda state: state.pop("t2d"))
    settings = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**settings, "draft_vocab_size": None}))
    loaded = load(base64, folder)
    assert torch.equal(loaded.t2d, reference.t2d) and loaded.lm_head.weight.shape == reference.lm_head.weight.shape
    for key, value in reference.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key

    whole, whole_folder = saved(base64, tmp_path / "whole", draft_ids=torch.arange(48))
    rewrite(whole_folder, lambda state: [state.pop("d2t"), state.pop("t2d")])
    assert load(base64, whole_folder).draft_token_ids.tolist() == list(range(48))

    state = load_file(str(folder / "model.safetensors"))
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2], "model-00002-of-00002.safetensors": keys[len(keys) // 2 :]}
    for name, part in shards.items():
        save_file({key: state[key] for key in part}, str(folder / name))
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: n for n, part in shards.items() for k in part}}))
    sharded = load(base64, folder)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, sharded.state_dict()[key]), key

    settings = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**settings, "eagle_aux_hidden_state_layer_ids": [1, 15, 28]}))
    config = base64.model.config
    assert load_head(folder, config.hidden_size, config.vocab_size, base_layers=32).layer_ids == (2, 16, 29)
    (folder / "config.json").write_text(json.dumps({**settings, "eagle_aux_hidden_state_layer_ids": [3, 15, 28]}))
    assert load_head(folder, config.hidden_size, config.vocab_size, base_layers=32).layer_ids == (3, 15, 28)


def test_an_eagle3_head_is_checked_against_the_width_of_the_features_it_reads(base64, tmp_path):
    """target_hidden_size is the base model's width that fc reads: another one
    is refused at load (it failed at the first draft); a head narrower than the
    base with its own embedding drafts, exactly."""
    from models.head import HeadConfig

    _, folder = saved(base64, tmp_path / "head")
    settings = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**settings, "target_hidden_size": 32}))
    rewrite(folder, lambda state: state.update({"fc.weight": torch.zeros(64, 96)}))
    with pytest.raises(HeadFormatError, match=r"reads features 32 wide \(target_hidden_size; fc.weight takes 3 x 32\), and the base model's hidden size is 64"):
        load(base64, folder)

    config = base64.model.config
    narrow = HeadConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=config.vocab_size, bias=False, draft_vocab_size=24, extra={"target_hidden_size": 64})  # fmt: skip
    torch.manual_seed(3)
    head = eagle3.Eagle3Head(narrow, (0, 1, 2), own_embedding=True)
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            parameter.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
        head.d2t.copy_(torch.arange(0, 48, 2) - torch.arange(24))
        head.t2d.zero_()
        head.t2d[torch.arange(0, 48, 2)] = True
    loaded = load(base64, eagle3.save(head, tmp_path / "narrow"))
    engine = Engine(base64, loaded)
    prompt = [9, 14, 20, 31, 11]
    reference = tokens_of(engine.stream(prompt, "vanilla", SamplingParams(max_new_tokens=24)))
    assert tokens_of(engine.stream(prompt, "eagle2", SamplingParams(max_new_tokens=24), TreeParams(12, 4, 3))) == reference
    rewrite(tmp_path / "narrow", lambda state: state.pop("embed_tokens.weight"))
    with pytest.raises(HeadFormatError, match="no embed_tokens of its own"):
        load(base64, tmp_path / "narrow")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling .* is not one transformers reads"),
        ({"rope_scaling": "linear"}, "rope_scaling"),
        ({"hidden_size": 99, "num_attention_heads": 1, "num_key_value_heads": 1}, "each attention head is 99 wide .*: rotary embeddings need an even width"),
        ({"num_attention_heads": 5, "num_key_value_heads": 5}, "num_attention_heads 5 does not divide hidden_size"),
    ],
    ids=["kv-heads", "rope-incomplete", "rope-not-a-map", "odd-head-width", "heads-not-dividing"],
)
def test_head_configs_transformers_cannot_build_are_refused_before_the_base_model_loads(base64, tmp_path, change, message):
    from models.head import head_files

    _, folder = saved(base64, tmp_path / "head")
    settings = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**settings, **change}))
    with pytest.raises(HeadFormatError, match=message):
        head_files(folder)


def speculators_layout(folder, **fields):
    """Rewrite a published-format head as the speculators library saves one:
    its layer named layers.0.*, its config the layer's settings wrapped."""
    rewrite(folder, lambda state: state.update({key.replace("midlayer.", "layers.0."): state.pop(key) for key in list(state) if key.startswith("midlayer.")}))
    settings = json.loads((folder / "config.json").read_text())
    own = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids")
    kestrels = ("architectures", "bias", "qkv_bias")  # fields of Kestrel's own, which that library does not write
    layer = {key: value for key, value in settings.items() if key not in own and key not in kestrels}
    wrapped = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
        "transformer_layer_config": {**layer, "model_type": "llama", "architectures": ["LlamaForCausalLM"]},
        **{key: settings[key] for key in own if key in settings}, "norm_before_residual": False, "norm_before_fc": False,
        "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "owner/base", "architectures": ["LlamaForCausalLM"]}},
        **fields,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(wrapped))


def test_a_head_saved_by_the_speculators_library_loads_as_the_published_one(base64, tmp_path):
    from app.cli import earlier_arch
    from models.head import check_fits_sizes, head_keys, holds_a_head

    head, folder = saved(base64, tmp_path / "head")
    speculators_layout(folder)
    assert "layers.0.hidden_norm.weight" in load_file(str(folder / "model.safetensors"))
    loaded = load(base64, folder)
    assert isinstance(loaded, eagle3.Eagle3Head) and loaded.layer_ids == head.layer_ids
    original, again = head.state_dict(), loaded.state_dict()
    assert original.keys() == again.keys() and all(torch.equal(original[k], again[k]) for k in original)
    assert not loaded.midlayer.norm_before_residual
    config = base64.model.config
    check_fits_sizes(folder, config.hidden_size, config.vocab_size, config.num_hidden_layers)
    assert eagle3.MARKER in head_keys(folder) and holds_a_head(folder) and earlier_arch(folder) == "eagle3"
    with pytest.raises(HeadFormatError, match=r"aux layers \[0, 1, 2\] do not exist in a 1-layer base model"):
        check_fits_sizes(folder, config.hidden_size, config.vocab_size, 1)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"speculators_model_type": "eagle"}, r"a speculators 'eagle' head; Kestrel reads the speculators library's EAGLE-3 heads"),
        ({"transformer_layer_config": None}, r"needs transformer_layer_config"),
        ({"transformer_layer_config": {"model_type": "gemma3", "hidden_size": 64}}, r"a 'gemma3' layer \(transformer_layer_config\.model_type\)"),
        ({"norm_before_residual": "yes"}, r"config\.json: norm_before_residual must be true or false, got 'yes'"),
        ({"transformer_layer_config": {"num_hidden_layers": 2}}, r"the head has 2 decoder layers \(transformer_layer_config\.num_hidden_layers\)"),
        ({"transformer_layer_config": {"attention_bias": True}}, r"biases on its attention projections \(transformer_layer_config\.attention_bias\)"),
        ({"transformer_layer_config": {"mlp_bias": True}}, r"biases on its MLP \(transformer_layer_config\.mlp_bias\)"),
    ],
    ids=["eagle-1", "no-layer", "gemma3-layer", "flag-not-bool", "two-layers", "attention-bias", "mlp-bias"],
)
def test_speculators_configs_kestrel_cannot_read_are_named(base64, tmp_path, fields, message):
    """Refused from config.json alone, before the base model loads."""
    from models.head import check_fits_sizes

    _, folder = saved(base64, tmp_path / "head")
    speculators_layout(folder)
    settings = json.loads((folder / "config.json").read_text())
    layer = fields.get("transformer_layer_config")
    if isinstance(layer, dict) and "model_type" not in layer:  # a field of the layer's settings changed
        fields = {**fields, "transformer_layer_config": {**settings["transformer_layer_config"], **layer}}
    (folder / "config.json").write_text(json.dumps({**settings, **fields}))
    with pytest.raises(HeadFormatError, match=message):
        check_fits_sizes(folder, None, None, None)


def test_norm_before_fc_and_norm_output_heads_are_refused_before_the_base_model_loads(base64, tmp_path):
    from models.head import check_fits_sizes

    _, folder = saved(base64, tmp_path / "head")
    settings = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**settings, "eagle_config": {"norm_before_fc": True}}))  # published layout
    config = base64.model.config
    with pytest.raises(HeadFormatError, match=r"norm_before_fc heads \(a norm over the three features before fc\) are not supported"):
        check_fits_sizes(folder, config.hidden_size, config.vocab_size, config.num_hidden_layers)
    for where in ({"norm_output": True}, {"eagle_config": {"norm_output": True}}):
        (folder / "config.json").write_text(json.dumps({**settings, **where}))
        with pytest.raises(HeadFormatError, match=r"norm_output heads \(an EAGLE-3\.1 variant\) are not supported"):
            check_fits_sizes(folder, config.hidden_size, config.vocab_size, config.num_hidden_layers)
    (folder / "config.json").write_text(json.dumps(settings))
    speculators_layout(folder, norm_before_fc=True)
    with pytest.raises(HeadFormatError, match=r"norm_before_fc heads \(a norm over the three features before fc\) are not supported"):
        check_fits_sizes(folder, config.hidden_size, config.vocab_size, config.num_hidden_layers)


def test_norm_before_residual_adds_the_normed_hidden_input_and_decodes_exactly(base64, tmp_path):
    """With norm_before_residual the layer's residual is its hidden input after
    hidden_norm (vLLM's and the speculators library's reading); the head
    drafts with it and the output stays vanilla's, in float64."""
    _, folder = saved(base64, tmp_path / "head")
    plain = load(base64, folder)
    speculators_layout(folder, norm_before_residual=True)
    normed = load(base64, folder)
    assert normed.midlayer.norm_before_residual and not plain.midlayer.norm_before_residual
    layer = normed.midlayer
    embeddings, hidden = torch.randn(1, 5, 64, dtype=torch.float64), torch.randn(1, 5, 64, dtype=torch.float64)
    positions = torch.arange(5)[None]
    rotary = normed.rotary(hidden, positions)
    from models.head import HeadCache

    x = torch.cat([layer.input_layernorm(embeddings), layer.hidden_norm(hidden)], dim=-1)
    h = layer.hidden_norm(hidden) + layer.self_attn(x, rotary, None, HeadCache())
    expected = h + layer.mlp(layer.post_attention_layernorm(h))
    assert torch.allclose(normed(embeddings, hidden, positions, None, HeadCache()), expected, rtol=0, atol=1e-12)
    assert not torch.allclose(plain(embeddings, hidden, positions, None, HeadCache()), expected, atol=1e-3)

    engine = Engine(base64, normed)
    assert decodes_as(engine, engine) > 0  # greedy and sampled, eagle and eagle2, as vanilla


def test_a_speculators_head_given_another_base_names_the_one_it_was_made_for(base64, tmp_path):
    """Its config names its base model (speculators_config.verifier): a head
    that does not fit the base given says which base it was made for, before
    the base model loads where its sizes can be read, and after it otherwise."""
    from app.session import load_pair

    _, folder = saved(base64, tmp_path / "head")
    speculators_layout(folder)  # made for owner/base, 64 wide
    wider = save_tiny_model(tmp_path / "wider", vocab_size=48, hidden_size=96, intermediate_size=192)
    with pytest.raises(HeadFormatError, match=r"and the base model.s hidden size is 96 \(the head was made for owner/base: give that as the base model\)"):
        load_pair(str(wider), str(folder), dtype="float32", device="cpu")
    other = save_tiny_model(tmp_path / "other", vocab_size=40)  # its vocabulary checked once it has loaded
    with pytest.raises(HeadFormatError, match=r"!= base model vocabulary 40 \(the head was made for owner/base: give that as the base model\)"):
        load_pair(str(other), str(folder), dtype="float32", device="cpu")
    settings = json.loads((folder / "config.json").read_text())
    made_for_wider = {**settings, "speculators_config": {"verifier": {"name_or_path": str(wider)}}}
    (folder / "config.json").write_text(json.dumps(made_for_wider))
    with pytest.raises(HeadFormatError) as refused:  # made for the base given (typed otherwise): no advice to give it
        load_pair(str(wider) + "/", str(folder), dtype="float32", device="cpu")
    assert "made for" not in str(refused.value)
    for kind in ({"speculators_config": {"algorithm": "eagle3"}}, {"speculators_config": "eagle3"}):  # naming no base
        (folder / "config.json").write_text(json.dumps({**settings, **kind}))
        with pytest.raises(HeadFormatError) as refused:  # the error as it was
            load_pair(str(wider), str(folder), dtype="float32", device="cpu")
        assert "made for" not in str(refused.value) and "hidden size is 96" in str(refused.value)
    (folder / "config.json").write_text(json.dumps({**settings, "norm_output": True}))
    with pytest.raises(HeadFormatError) as refused:  # not a matter of the base model: no advice to give another
        load_pair(str(wider), str(folder), dtype="float32", device="cpu")
    assert "norm_output heads" in str(refused.value) and "made for" not in str(refused.value)


def test_bench_says_which_base_an_other_head_was_made_for(base64, tmp_path, capsys):
    from app.cli import main

    _, folder = saved(base64, tmp_path / "head")
    speculators_layout(folder)
    wider = save_tiny_model(tmp_path / "wider", vocab_size=48, hidden_size=96, intermediate_size=192)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["w1 w2"]}) + "\n")
    command = ["bench", "--prompts", str(prompts), "--model", str(wider), "--modes", "vanilla,eagle2@other", "--other-head", f"other={folder}"]
    assert main(command) == 2
    assert "(the head was made for owner/base: give that as the base model)" in capsys.readouterr().err


def test_a_qwen3_layer_head_norms_each_heads_queries_and_keys_and_decodes_exactly(tmp_path):
    """A speculators head whose layer is a Qwen3 layer (transformer_layer_config
    model_type qwen3) has an RMSNorm over each head's queries and keys, before
    the rotary embedding, as Qwen3's attention: loaded strictly, applied, and
    lossless in float64 on a Qwen3 base."""
    from models.head import HeadCache

    folder = save_tiny_model(tmp_path / "qwen3", "qwen3", vocab_size=48)
    base = load_base(str(folder), dtype="float64")
    head = random_eagle3_head(base.model, seed=2)
    saved_at = eagle3.save(head, tmp_path / "head")
    width = head.config.dim_per_head
    norms = {f"midlayer.self_attn.{p}_norm.weight": (1.0 + 0.5 * torch.randn(width)).double() for p in ("q", "k")}  # as a head holds them
    rewrite(saved_at, lambda state: state.update(norms))
    speculators_layout(saved_at)
    settings = json.loads((saved_at / "config.json").read_text())
    settings["transformer_layer_config"]["model_type"] = "qwen3"
    (saved_at / "config.json").write_text(json.dumps(settings))
    config = base.model.config
    loaded = load_head(saved_at, config.hidden_size, config.vocab_size, dtype=torch.float64, base_layers=config.num_hidden_layers)
    attention = loaded.midlayer.self_attn
    assert torch.equal(attention.q_norm.weight, norms["midlayer.self_attn.q_norm.weight"])
    assert torch.equal(attention.k_norm.weight, norms["midlayer.self_attn.k_norm.weight"])

    # transformers' own Qwen3 attention over the same 2H-wide input, with these weights (its eps and head width too)
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    settings = head.config
    qwen3 = Qwen3Config(hidden_size=2 * settings.hidden_size, num_attention_heads=settings.num_attention_heads,
                        num_key_value_heads=settings.num_key_value_heads, head_dim=width, rms_norm_eps=settings.rms_norm_eps,
                        attention_bias=False, intermediate_size=8, num_hidden_layers=1, vocab_size=48)  # fmt: skip
    qwen3._attn_implementation = "sdpa"
    reference = Qwen3Attention(qwen3, 0).double()
    reference.o_proj = torch.nn.Linear(settings.num_attention_heads * width, settings.hidden_size, bias=False).double()
    reference.load_state_dict(attention.state_dict(), strict=True)
    x = torch.randn(1, 5, 2 * config.hidden_size, dtype=torch.float64)
    rotary = loaded.rotary(x, torch.arange(5)[None])
    expected, _ = reference(x, rotary, None)
    assert torch.allclose(attention(x, rotary, None, HeadCache()), expected, rtol=0, atol=1e-12)

    engine = Engine(base, loaded)
    assert decodes_as(engine, engine) > 0  # greedy and sampled, eagle and eagle2, as vanilla

    def loads():
        return load_head(saved_at, config.hidden_size, config.vocab_size, dtype=torch.float64, base_layers=config.num_hidden_layers)

    settings = json.loads((saved_at / "config.json").read_text())
    settings["transformer_layer_config"]["model_type"] = "llama"  # a Llama layer's config with a Qwen3 layer's weights
    (saved_at / "config.json").write_text(json.dumps(settings))
    with pytest.raises(HeadFormatError, match=r"unexpected key midlayer\.self_attn\.(q|k)_norm\.weight"):
        loads()
    settings["transformer_layer_config"]["model_type"] = "qwen3"
    (saved_at / "config.json").write_text(json.dumps(settings))
    rewrite(saved_at, lambda state: [state.pop("layers.0.self_attn.k_norm.weight"), state.pop("layers.0.self_attn.q_norm.weight")])
    with pytest.raises(HeadFormatError, match=r"missing key midlayer\.self_attn\.(q|k)_norm\.weight"):
        loads()  # a Qwen3 layer's config without its norms: not read as a Llama layer


def test_an_eagle3_layer_named_layers_0_without_its_hidden_norm_is_named_so(base64, tmp_path):
    _, folder = saved(base64, tmp_path / "head")
    speculators_layout(folder)
    rewrite(folder, lambda state: state.pop("layers.0.hidden_norm.weight"))
    with pytest.raises(HeadFormatError, match=r"an EAGLE-3 head's layer \(its attention reads 2 x 64\) named layers\.0\.\*, without layers\.0\.hidden_norm\.weight"):
        load(base64, folder)
