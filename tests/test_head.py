import json

import pytest
import torch

from models.errors import HeadFormatError, ModelNotFoundError
from models.head import HeadConfig, expected_shapes, head_files, load_head, read_checkpoint, save_head
from tests.factory import random_head, tiny_config


def saved_head(tmp_path, **options):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config())
    head = random_head(model, **options)
    return head, save_head(head, tmp_path / "head")


def test_round_trip_is_identical(tmp_path):
    head, folder = saved_head(tmp_path, qkv_bias=True)
    loaded = load_head(folder, head.config.hidden_size, head.config.vocab_size)
    original, again = head.state_dict(), loaded.state_dict()
    assert original.keys() == again.keys()
    assert all(torch.equal(original[key], again[key]) for key in original)
    assert loaded.config == head.config


def test_rotary_frequencies_stay_float32_in_bf16(tmp_path):
    head, folder = saved_head(tmp_path)
    loaded = load_head(folder, head.config.hidden_size, head.config.vocab_size, dtype=torch.bfloat16)
    assert loaded.fc.weight.dtype == torch.bfloat16
    assert loaded.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(loaded.rotary.inv_freq, head.rotary.inv_freq.float())


def test_official_key_names(tmp_path):
    head, folder = saved_head(tmp_path)
    _, state, _ = read_checkpoint(folder)
    assert set(state) == set(expected_shapes(head.config))
    assert "fc.bias" in state and "layers.0.input_layernorm.weight" not in state
    assert json.loads((folder / "config.json").read_text())["bias"] is True


def rewrite(folder, change):
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    change(state)
    save_file(state, str(folder / "model.safetensors"))


def test_missing_key_is_named(tmp_path):
    head, folder = saved_head(tmp_path)
    rewrite(folder, lambda state: state.pop("layers.0.mlp.up_proj.weight"))
    with pytest.raises(HeadFormatError, match=r"missing key layers\.0\.mlp\.up_proj\.weight.*model\.safetensors|model\.safetensors.*missing key layers\.0\.mlp\.up_proj"):
        load_head(folder, head.config.hidden_size, head.config.vocab_size)


def test_extra_key_is_named(tmp_path):
    head, folder = saved_head(tmp_path)
    rewrite(folder, lambda state: state.update({"norm.weight": torch.ones(4)}))
    with pytest.raises(HeadFormatError, match=r"unexpected key norm\.weight"):
        load_head(folder, head.config.hidden_size, head.config.vocab_size)


def test_misshapen_key_names_both_shapes(tmp_path):
    head, folder = saved_head(tmp_path)
    rewrite(folder, lambda state: state.update({"fc.weight": torch.zeros(3, 5)}))
    with pytest.raises(HeadFormatError, match=r"fc\.weight has shape \[3, 5\], expected \[64, 128\]"):
        load_head(folder, head.config.hidden_size, head.config.vocab_size)


def test_size_mismatch_with_the_base_model(tmp_path):
    head, folder = saved_head(tmp_path)
    with pytest.raises(HeadFormatError, match="hidden_size"):
        load_head(folder, head.config.hidden_size * 2, head.config.vocab_size)
    with pytest.raises(HeadFormatError, match="vocab_size"):
        load_head(folder, head.config.hidden_size, head.config.vocab_size + 1)


def test_pytorch_bin_and_llama31_rope_config(tmp_path):
    """The published EAGLE-LLaMA3.1 format: pytorch_model.bin and a llama3 rope dict."""
    head, _ = saved_head(tmp_path)
    folder = tmp_path / "bin_head"
    folder.mkdir()
    settings = head.config.to_dict()
    settings["rope_scaling"] = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"}  # fmt: skip
    settings["rope_theta"] = 500000.0
    (folder / "config.json").write_text(json.dumps(settings))
    torch.save(head.state_dict(), folder / "pytorch_model.bin")
    loaded = load_head(folder, head.config.hidden_size, head.config.vocab_size)
    assert loaded.config.rope_scaling["rope_type"] == "llama3"


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(ModelNotFoundError):
        load_head(tmp_path / "nothing_here", 64, 64)
    (tmp_path / "empty").mkdir()
    with pytest.raises(HeadFormatError, match="config.json"):
        load_head(tmp_path / "empty", 64, 64)


def test_a_config_that_is_not_an_object_and_a_damaged_bin_are_named(tmp_path):
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(HeadFormatError, match=r"config.json: must be a JSON object of settings, got an array"):
        head_files(tmp_path)
    head, _ = saved_head(tmp_path / "saved")
    (tmp_path / "config.json").write_text(json.dumps(head.config.to_dict()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"garbage")
    with pytest.raises(HeadFormatError, match=r"pytorch_model.bin: not a readable PyTorch checkpoint \(damaged") as error:
        load_head(tmp_path, head.config.hidden_size, head.config.vocab_size)
    assert "weights_only" not in str(error.value)  # torch's advice to load it unsafely is not passed on


def test_a_head_with_nan_weights_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    head, folder = saved_head(tmp_path)
    state = load_file(str(folder / "model.safetensors"))
    state["fc.weight"][0, 0] = float("nan")
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(HeadFormatError, match=r"model.safetensors: fc.weight holds NaN or infinite values"):
        load_head(folder, head.config.hidden_size, head.config.vocab_size)


def test_config_missing_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(HeadFormatError, match="missing field"):
        load_head(tmp_path, 64, 64)


@pytest.mark.parametrize("field, value, message", [
    ("num_attention_heads", 0, "num_attention_heads must be a whole number of at least 1, got 0"),
    ("rope_theta", "10000", "rope_theta must be a number above 0, got '10000'"),
    ("hidden_size", 64.5, "hidden_size must be a whole number"),
    ("bias", "yes", "bias must be true or false"),
])  # fmt: skip
def test_config_fields_of_the_wrong_kind_are_named(tmp_path, field, value, message):
    settings = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 64, field: value}
    (tmp_path / "config.json").write_text(json.dumps(settings))
    with pytest.raises(HeadFormatError, match=f"config.json: field {message}"):
        load_head(tmp_path, 64, 64)


def test_head_config_reads_v5_rope_parameters():
    config = HeadConfig.from_dict({"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2,
                                   "vocab_size": 10, "rope_parameters": {"rope_theta": 1234.0}})  # fmt: skip
    assert config.rope_theta == 1234.0 and config.num_key_value_heads == 2


def test_reduced_draft_vocabulary_round_trip_and_decoding(tmp_path, tiny_base):
    """A head drafting over a subset of tokens saves d2t, reloads strictly, and stays lossless."""
    from core.config import SamplingParams, TreeParams
    from core.engine import Engine
    from models.head import with_draft_vocabulary

    head = random_head(tiny_base.model, seed=5)
    subset = torch.tensor([40, 3, 9, 10, 11, 12, 20, 21, 30, 33, 47, 50, 60, 61])
    reduced = with_draft_vocabulary(head, subset)
    assert torch.equal(reduced.draft_token_ids, torch.sort(subset).values)
    folder = save_head(reduced, tmp_path / "reduced")
    loaded = load_head(folder, head.config.hidden_size, head.config.vocab_size, dtype=torch.float64)
    assert torch.equal(loaded.draft_token_ids, reduced.draft_token_ids)
    engine, plain = Engine(tiny_base, loaded), Engine(tiny_base)
    params = SamplingParams(max_new_tokens=30)
    for prompt in ([8, 9, 10], [12, 11, 10, 9]):
        drafted = [t for s in engine.stream(prompt, mode="eagle2", sampling=params, tree=TreeParams(10, 3, 3)) for t in s.token_ids]
        reference = [t for s in plain.stream(prompt, mode="vanilla", sampling=params) for t in s.token_ids]
        assert drafted == reference
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    state["d2t"][-1] = head.config.vocab_size  # the last draft id mapped past the vocabulary: named at load, not at drafting
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(HeadFormatError, match=f"model.safetensors: d2t maps draft ids outside the vocabulary of {head.config.vocab_size}"):
        load_head(folder, head.config.hidden_size, head.config.vocab_size)
    drafter_tokens = set()
    from core.drafter import Drafter

    drafter = Drafter(loaded, tiny_base.model, TreeParams(10, 3, 3))
    with torch.no_grad():
        drafter.commit(torch.randn(3, 64, dtype=torch.float64), torch.tensor([8, 9, 10]))
        drafter_tokens.update(drafter.draft(10).tokens[1:].tolist())
    assert drafter_tokens <= set(subset.tolist())


def test_a_base_model_given_as_the_head_is_named_so(tmp_path, tiny_dir):
    """A whole model's folder in the head box: said plainly, before reading its weights."""
    with pytest.raises(HeadFormatError, match=r"a whole model's weights \(keys model\.layers\.\*\), not a draft head; give this folder as the base model"):
        load_head(tiny_dir, 64, 64)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((tiny_dir / "config.json").read_text())
    (sharded / "model.safetensors.index.json").write_text('{"weight_map": {"model.layers.0.mlp.up_proj.weight": "model-00001-of-00002.safetensors"}}')
    with pytest.raises(HeadFormatError, match="a whole model's sharded weights, not a draft head"):
        load_head(sharded, 64, 64)
