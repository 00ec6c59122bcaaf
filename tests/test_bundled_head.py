"""The bundled draft head: loads offline with the default model and drafts well
enough to matter (a regression guard, not a benchmark). The tree is fixed
(16 nodes, depth 5, 6 per level): the planner's trees depend on this machine's
measured costs, and measuring them would double the test's time."""

from app.session import BUNDLED_HEAD, load_pair
from core.config import SamplingParams, TreeParams

PROMPT = "Write a Python function that returns the sum of a list of numbers."  # tau 3.4 when added


def test_bundled_head_loads_and_accepts_drafts():
    assert (BUNDLED_HEAD / "config.json").is_file() and (BUNDLED_HEAD / "model.safetensors").is_file()
    engine = load_pair(dtype="float32")
    assert engine.head is not None and engine.head.config.draft_vocab_size == 8192
    assert engine.modes == ("vanilla", "eagle", "eagle2")
    messages = [{"role": "user", "content": PROMPT}]
    params = SamplingParams(max_new_tokens=64)
    steps = list(engine.chat(messages, mode="eagle2", sampling=params, tree=TreeParams(total_tokens=16, depth=5)))
    assert steps[-1].stats.mean_accepted_length > 1.5
    vanilla = [token for step in engine.chat(messages, mode="vanilla", sampling=params) for token in step.token_ids]
    assert [token for step in steps for token in step.token_ids] == vanilla
