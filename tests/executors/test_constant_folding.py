"""executors/torch/constants.py: statements reading nothing the call brings run once, when the
trace is compiled, and never hand the caller a tensor it could write into."""

import pytest
import torch

import fulmen
from fulmen.executors.torch.constants import MAX_BYTES


@pytest.fixture(autouse=True)
def _default_fusion_policy(monkeypatch):
    """The default policy (the suite fuses tiny regions): the small mask statements stay on
    torch, as in a real model's step."""
    monkeypatch.setenv("FULMEN_FUSE_TINY", "0")


def _forward_source(jfn) -> str:
    """The statements of the last forward trace, without comments (which quote the source)."""
    lines = str(fulmen.last_traces(jfn)[-1]).splitlines()
    return "\n".join(line.split("  #")[0] for line in lines if not line.lstrip().startswith("#"))


def _padding_causal_mask(x, mask):
    """HF's mask functions in miniature: positions, a causal mask, the padding mask indexed by
    batch and key positions, then the additive mask."""
    batch, length = mask.shape
    positions = torch.arange(length) + 0
    q_idx, kv_idx = positions[None, None, :, None], positions[None, None, None, :]
    causal = kv_idx <= q_idx
    padding = mask.to(torch.bool)[torch.arange(batch)[:, None, None, None], kv_idx]
    allowed = causal & padding
    zeros = torch.full((batch, 1, length, length), 0.0)
    scores = x[:, None, :, None] * x[:, None, None, :] + torch.where(allowed, zeros, -float("inf"))
    return (torch.softmax(scores, dim=-1) * x[:, None, None, :]).sum(-1)


def test_mask_statements_of_no_input_run_once_with_eagers_values():
    x = torch.randn(2, 8)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    jfn = fulmen.jit(_padding_causal_mask)
    for _ in range(2):
        torch.testing.assert_close(jfn(x, mask), _padding_causal_mask(x, mask), rtol=0, atol=0)
    source = _forward_source(jfn)
    assert "torch.arange" not in source and "torch.full" not in source
    assert "torch.le(" not in source and "_c0" in source
    mask[0, 6:] = 0  # the padding mask is an input: read at every call
    torch.testing.assert_close(jfn(x, mask), _padding_causal_mask(x, mask), rtol=0, atol=0)


def test_training_through_folded_constants_gives_eagers_gradients():
    x = torch.randn(2, 8, requires_grad=True)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 6:] = 0
    jfn = fulmen.jit(_padding_causal_mask)
    expected = torch.autograd.grad(_padding_causal_mask(x, mask).sum(), x)
    for _ in range(2):
        torch.testing.assert_close(torch.autograd.grad(jfn(x, mask).sum(), x), expected)
    assert "_c0" in _forward_source(jfn)


def test_a_returned_constant_or_view_of_one_is_made_at_every_call():
    """NOTE [a folded constant never escapes]: the caller writes into what it was given; the
    next call must not see that write."""

    def fn(x):
        table = torch.arange(6.0)
        return x + 1, table.view(2, 3), table[1:] * 2

    x = torch.randn(3)
    jfn = fulmen.jit(fn)
    for _ in range(3):
        _, view, doubled = jfn(x)
        torch.testing.assert_close(view, torch.arange(6.0).view(2, 3), rtol=0, atol=0)
        torch.testing.assert_close(doubled, torch.arange(1.0, 6.0) * 2, rtol=0, atol=0)
        view.add_(100)
        doubled.add_(100)
    assert "torch.arange" in _forward_source(jfn)


def test_large_constants_are_not_held():
    """A constant lives as long as the compiled trace: values over MAX_BYTES run per call."""
    side = int((MAX_BYTES // 4) ** 0.5) + 1

    def fn(x):
        return x + torch.ones(side, side).sum()

    jfn = fulmen.jit(fn)
    x = torch.randn(3)
    torch.testing.assert_close(jfn(x), fn(x))
    assert "torch.ones" in _forward_source(jfn) or "full" in _forward_source(jfn)
