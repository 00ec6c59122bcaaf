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


@pytest.mark.skipif(not int8.integer_screen(), reason="the integer screen is built for AVX2 CPUs without AVX-512")
def test_one_and_two_row_screens_multiply_integers_and_still_find_the_exact_argmax(monkeypatch):
    """A vanilla step's screen (one row) and a small tree's (two) round the
    features to int8 and multiply integers: the bound grows by what that
    rounding can change, and the argmax stays the float32 one, near-ties
    included; more rows screen in float32."""
    calls = []
    integer = int8.screen
    monkeypatch.setattr(int8, "screen", lambda *args: calls.append(len(args[0])) or integer(*args))
    generator = torch.Generator().manual_seed(2)
    # features with one large value per group of 32, so the others round coarsely
    features = torch.randn(96, generator=generator)
    features[::32] *= 40
    # weights that int8 holds exactly (whole multiples of 2^-7, up to 127 of them): the screen's error is
    # then all in the rounded features, and only the bound's term for that covers it
    codes = torch.randint(-100, 101, (900, 96), generator=generator)
    codes[:, 0] = 127
    target = float((codes.double() @ features.double()).max()) + 20
    for row in range(40):  # tokens 0-39: logits within about 0.01 of each other, weights far apart
        for column in [column for column in features.abs().argsort(descending=True).tolist() if column]:
            gap = target - float(codes[row].double() @ features.double())
            codes[row, column] = int((codes[row, column] + round(gap / float(features[column]))).clamp(-126, 126))
    lm_head = torch.nn.Linear(96, 900, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(codes * 2.0**-7)
    screen = ScreenedArgmax(lm_head)
    assert screen.enabled and screen.integer
    hidden = features + 0.01 * torch.randn(120, 96, generator=generator)  # which of the near-ties wins varies
    hidden[60:70] *= 1e-4  # small features
    expected = (hidden @ lm_head.weight.T).argmax(dim=-1).tolist()
    assert [screen(hidden[row : row + 1])[0] for row in range(120)] == expected
    assert [token for row in range(0, 120, 2) for token in screen(hidden[row : row + 2])] == expected
    assert calls == [1] * 120 + [2] * 60
    assert screen(hidden) == expected and len(calls) == 180  # 120 rows at once: the float32 screen
    ranks = [int((screen.screen(hidden[row : row + 1])[0].logits > (hidden[row] @ lm_head.weight[token])).sum()) for row, token in enumerate(expected)]
    assert set(expected[:60]) <= set(range(40)) and max(ranks) > 16  # the winner was often outside the screen's candidates


@pytest.mark.skipif(not int8.integer_screen(), reason="the integer screen is built for AVX2 CPUs without AVX-512")
def test_an_integer_screen_that_leaves_too_many_tokens_screens_again_in_float32(monkeypatch):
    """Flat logits (thousands of tokens within the rounded features' bound)
    would cost thousands of exact logits: the row is screened again with
    float32 features, whose bound leaves few, and the argmax is still exact."""
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(64, generator=generator)
    lm_head = torch.nn.Linear(64, 3000, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(3000, 64, generator=generator))
        lm_head.weight[:2000] = base + 1e-3 * torch.randn(2000, 64, generator=generator)  # 2,000 near-ties
    screen = ScreenedArgmax(lm_head)
    assert screen.integer
    products = []
    float_product = int8.own_matmul
    monkeypatch.setattr(int8, "own_matmul", lambda x, *weights: products.append(len(x)) or float_product(x, *weights))
    hidden = base * 3 + 0.05 * torch.randn(20, 64, generator=generator)
    hidden[:, ::32] *= 30  # coarse rounding of the other features
    expected = (hidden @ lm_head.weight.T).argmax(dim=-1).tolist()
    assert [screen(hidden[row : row + 1])[0] for row in range(20)] == expected
    assert products == [1] * 20  # every row left more than INTEGER_CONTENDERS tokens and went to float32


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
    assert not screen.rows.one_row_tiles  # 700 tokens: too few to measure which kernel is faster for one row
    assert [screen(hidden[row : row + 1])[0] for row in range(0, 200, 7)] == expected[::7]  # one row: the vector kernel
    if screen.rows.tiles:
        screen.rows.one_row_tiles = True  # as where the tiles measured faster for one row
        assert [screen(hidden[row : row + 1])[0] for row in range(0, 200, 7)] == expected[::7]


def test_a_tokens_exact_logit_is_the_same_whichever_tokens_share_its_product():
    """The candidates' exact logits settle near-ties: a token's must not depend on which
    other tokens the screen put beside it, nor where (a vanilla step's screen and a tree
    node's may rank them differently). A matrix-vector product's low bits depend on both."""
    generator = torch.Generator().manual_seed(3)
    lm_head = torch.nn.Linear(576, 5000, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(5000, 576, generator=generator))
    screen = ScreenedArgmax(lm_head)
    for _ in range(20):
        hidden = torch.randn(576, generator=generator).bfloat16().to(screen.exact_dtype)
        tokens = torch.randperm(5000, generator=generator)[:600]
        alone = {int(token): float(screen._exact(token[None], hidden)[0]) for token in tokens[:40]}
        for count in (2, 3, 7, 16, 17, 33, 600):
            shuffled = tokens[:count][torch.randperm(count, generator=generator)]
            for token, logit in zip(shuffled.tolist(), screen._exact(shuffled, hidden).tolist()):
                assert token not in alone or logit == alone[token], (count, token)


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


@pytest.mark.parametrize("own", [True, False], ids=["own-kernel", "torch-kernel"])
def test_screened_sampling_is_the_gumbel_argmax_of_the_exact_logits(own, monkeypatch):
    """argmax(logits / T + g) from the screen equals the one from the whole
    product, at low and high temperatures, with noise that makes every token
    a near-tie (the bound then leaves them all to be computed exactly)."""
    if own and not int8.own_kernel():
        pytest.skip("Kestrel's int8 kernel is not built here")
    if not own and not int8.kernel_available(torch.device("cpu")):
        pytest.skip("torch's int8 kernel is missing here")
    monkeypatch.setattr(int8, "own_kernel", lambda: own)
    monkeypatch.setattr(int8, "available", int8.kernel_available)
    generator = torch.Generator().manual_seed(3)
    dtypes = (torch.float32, torch.bfloat16) if own else (torch.float32,)
    for dtype in dtypes:
        lm_head = torch.nn.Linear(64, 600, bias=False).to(dtype)
        with torch.no_grad():
            lm_head.weight.copy_(torch.randn(600, 64, generator=generator))
        screen = ScreenedArgmax(lm_head)
        assert screen.enabled and screen.own == own
        hidden = torch.randn(40, 64, generator=generator).to(dtype)
        # the logits resolve computes exactly (float32 products of the stored values), for every token
        exact = torch.stack([screen._exact(torch.arange(600), row.to(screen.exact_dtype)) for row in hidden])
        assert torch.allclose(exact, hidden.float() @ lm_head.weight.float().T, rtol=1e-5, atol=1e-5)
        for temperature in (0.3, 1.0, 1.7):
            gumbels = [-torch.log(-torch.log(torch.rand(600, generator=generator, dtype=torch.float64))) for _ in hidden]
            expected = [int(torch.argmax(row.double() / temperature + g)) for row, g in zip(exact, gumbels)]
            assert screen.sample(hidden, gumbels, temperature) == expected
            assert len(set(expected)) > 10  # the noise moved the choice off the argmax
        # every token within 1e-9 of the best score: all of them go to the exact product
        flat = [-(row.double() / 1.0) + 1e-9 * torch.rand(600, generator=generator, dtype=torch.float64) for row in exact]
        expected = [int(torch.argmax(row.double() + g)) for row, g in zip(exact, flat)]
        assert screen.sample(hidden, flat, 1.0) == expected
