import pytest
import torch

from core.argmax import ScreenedArgmax, exact_argmax
from models import int8


@pytest.mark.parametrize("own", [True, False], ids=["own-kernel", "torch-kernel"])
def test_screened_argmax_equals_full_argmax_including_near_ties(own, monkeypatch):
    if own and not int8.own_kernel():
        pytest.skip("Kestrel's int8 kernel is not built here")
    if not own and not int8.kernel_available(torch.device("cpu")):
        pytest.skip("torch's int8 kernel is missing here")
    monkeypatch.setattr(int8, "own_kernel", lambda: own)
    monkeypatch.setattr(int8, "available", int8.kernel_available)  # whatever the speed probe finds on a busy machine
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        lm_head = torch.nn.Linear(64, 500, bias=False).to(dtype)
        with torch.no_grad():
            lm_head.weight.copy_(torch.randn(500, 64, generator=generator, dtype=dtype))
            # near-ties: rows 1-3 are row 0 nudged below bf16 resolution
            for row in (1, 2, 3):
                lm_head.weight[row] = lm_head.weight[0] * (1 + row * 1e-6)
        screen = ScreenedArgmax(lm_head)
        assert screen.enabled and screen.own == own
        hidden = torch.randn(300, 64, generator=generator, dtype=dtype)
        hidden[:100] = lm_head.weight[0].detach() * 3  # rows where tokens 0-3 nearly tie
        expected = (hidden @ lm_head.weight.T).argmax(dim=-1).tolist()
        assert screen(hidden) == expected
        # more near-ties than the screen's candidates: the other contenders are computed exactly too
        with torch.no_grad():
            for row in range(4, 60):
                lm_head.weight[row] = lm_head.weight[0] * (1 - row * 1e-6)
        screen = ScreenedArgmax(lm_head)
        expected = (hidden @ lm_head.weight.T).argmax(dim=-1).tolist()
        assert screen(hidden) == expected


@pytest.mark.skipif(not int8.own_kernel(), reason="Kestrel's int8 kernel is not built here")
def test_a_bf16_lm_head_is_screened_against_its_float32_products():
    """bf16 weights and features, widened exactly: the screened argmax is the
    argmax of their float32 products, near-ties (which round to the same
    bf16 logit) included."""
    generator = torch.Generator().manual_seed(1)
    lm_head = torch.nn.Linear(64, 700, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(700, 64, generator=generator))
        for row in (1, 2, 3):
            lm_head.weight[row] = lm_head.weight[0]
            lm_head.weight[row, row] += 2**-7 * row * torch.sign(lm_head.weight[0, row])
    screen = ScreenedArgmax(lm_head)
    assert screen.enabled and screen.own
    hidden = torch.randn(200, 64, generator=generator).bfloat16()
    hidden[:80] = (lm_head.weight[0].detach() * 3).bfloat16()  # rows where tokens 0-3 nearly tie
    expected = (hidden.float() @ lm_head.weight.float().T).argmax(dim=-1).tolist()
    assert screen(hidden) == expected
    assert set(expected[:80]) <= {0, 1, 2, 3}
    assert screen.rows.tiles == int8.tiles_available()  # many rows on AMX tiles where the CPU has them
    assert [screen(hidden[row : row + 1])[0] for row in range(0, 200, 7)] == expected[::7]  # one row: the vector kernel


def test_screen_is_off_for_half_precision_and_biased_heads(monkeypatch):
    assert not ScreenedArgmax(torch.nn.Linear(8, 20, bias=False).to(torch.float16)).enabled
    monkeypatch.setattr(int8, "own_kernel", lambda: False)
    assert not ScreenedArgmax(torch.nn.Linear(16, 20, bias=False).to(torch.bfloat16)).enabled
    biased = ScreenedArgmax(torch.nn.Linear(8, 20, bias=True))
    assert not biased.enabled
    hidden = torch.randn(3, 8)
    assert biased(hidden) == biased.lm_head(hidden).argmax(dim=-1).tolist()


def test_exact_argmax_of_half_precision_keeps_the_first_of_tied_maxima():
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    logits[:, 700] = logits[:, 300] = 50.0  # exact ties: the first index wins, as in vanilla argmax
    for dtype in (torch.bfloat16, torch.float16):
        rows = logits.to(dtype)
        assert exact_argmax(rows).tolist() == [300] * 16
        assert exact_argmax(rows).tolist() == rows.argmax(dim=-1).tolist()
