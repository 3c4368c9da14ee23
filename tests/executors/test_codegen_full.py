"""`full` inside codegen kernels (NOTE [full in kernels] in fulmen/executors/codegen/lower.py):
the constant and its views are read as a constant, in pointwise and row kernels; a region that
returns the constant or puts it in a cat falls back. Each compared with eager."""

import pytest
import torch

import fulmen

pytestmark = pytest.mark.usefixtures("codegen_eager")

EXECUTORS = ["codegen", "torch"]


def _unfused_fulls(jfn) -> list[str]:
    """The `full` statements of the last execution trace left outside every kernel."""
    return [b.sym.name for b in fulmen.last_traces(jfn)[-1].bsyms
            if b.sym.name.rstrip("_") == "full"]


def _check(fn, *args):
    jfn = fulmen.jit(fn, executors=EXECUTORS)
    for _ in range(2):
        got, expected = jfn(*args), fn(*args)
        for actual, reference in zip(got if isinstance(got, tuple) else (got,),
                                     expected if isinstance(expected, tuple) else (expected,)):
            torch.testing.assert_close(actual, reference)  # a fused softmax: ulps
            assert actual.dtype == reference.dtype and actual.shape == reference.shape
    return jfn


def test_an_attention_mask_fuses_its_full_with_the_comparisons():
    # HF's padding mask: where(causal & padding, full(0.0), -inf), added to the scores
    def fn(scores, padding):
        q = torch.arange(8)
        allowed = (q[None, :] <= q[:, None]) & padding[:, None, None, :]
        mask = torch.where(allowed, torch.full(allowed.shape, 0.0), -float("inf"))
        return scores + mask

    padding = torch.tensor([[True] * 8, [True] * 5 + [False] * 3])
    jfn = _check(fn, torch.randn(2, 1, 8, 8), padding)
    assert _unfused_fulls(jfn) == []


def test_a_full_in_a_row_kernel_and_a_broadcast_zero_dim_full():
    def fn(x, keep):
        ones = torch.full((), True)  # q_idx.new_ones((), dtype=torch.bool), broadcast
        mask = torch.where(keep & ones, torch.full(x.shape, 0.5), -1e4)
        return torch.softmax(x + mask, -1), x * torch.full((1, 6), 3.0)

    jfn = _check(fn, torch.randn(4, 6), torch.rand(4, 6) > 0.3)
    assert _unfused_fulls(jfn) == []


@pytest.mark.parametrize("case", ["returned", "returned view", "in a cat", "integer"])
def test_a_full_the_kernel_cannot_hold_falls_back_like_eager(case):
    def fn(x):
        f = torch.full(x.shape, 2.0)
        if case == "returned":
            return x * 3 + f, f
        if case == "returned view":
            return x * 3 + f, f.t()
        if case == "in a cat":
            return torch.cat([x * 2, torch.full((4, 2), 1.5)], 1) + 1
        return (x > 0).to(torch.int8) * torch.full((4, 5), 100, dtype=torch.int8) + 100

    _check(fn, torch.randn(4, 5))


def test_gradients_through_a_fused_mask_match_eager():
    def fn(x):
        q = torch.arange(6)
        mask = torch.where(q[None, :] <= q[:, None], torch.full((6, 6), 0.0), -float("inf"))
        return torch.softmax(x + mask, -1).sin().sum()

    x = torch.randn(3, 6, 6, requires_grad=True)
    jfn = fulmen.jit(fn, executors=EXECUTORS)
    (got,) = torch.autograd.grad(jfn(x), x)
    (expected,) = torch.autograd.grad(fn(x), x)
    torch.testing.assert_close(got, expected)
