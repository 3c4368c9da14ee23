"""Autocast scenarios a user writes, each compared with eager: outputs, dtypes, gradients.

CTC loss: autocast runs `ctc_loss` in float32, and its kernel's output shape comes from the
lengths' values, so the fake run that tells autocast's casts stops at the kernel: the casts
autocast logged before it are the answer (the compiled call refused the op inside autocast).
"""

import pytest
import torch
import torch.nn.functional as F

import fulmen


def _grads(outputs, leaves):
    return torch.autograd.grad(sum(o.float().sum() for o in outputs), leaves)


def _assert_as_eager(fn, inputs, leaves, region):
    """`fn` and its jitted form called under `region()`: same outputs, dtypes, gradients."""
    jfn = fulmen.jit(fn)
    with region():
        want, got = fn(*inputs), jfn(*inputs)
    want, got = (want,) if torch.is_tensor(want) else want, (got,) if torch.is_tensor(got) else got
    assert fulmen.compile_stats(jfn).eager_calls == 0
    assert [t.dtype for t in got] == [t.dtype for t in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    for g, w in zip(_grads(got, leaves), _grads(want, leaves), strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w)


def _bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("lengths", ["tensors", "lists"])
def test_ctc_loss_under_autocast_is_eagers(lengths):
    def ctc(x, w, targets, input_lengths, target_lengths):
        log_probs = (x @ w).float().log_softmax(-1)
        return (F.ctc_loss(log_probs, targets, input_lengths, target_lengths),
                F.ctc_loss(log_probs.bfloat16(), targets, input_lengths, target_lengths,
                           reduction="sum"))  # bfloat16 in: autocast casts it to float32

    torch.manual_seed(0)
    x, w = torch.randn(10, 2, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True)
    targets = torch.tensor([[1, 2, 3], [4, 5, 1]])
    sizes = ([10, 9], [3, 2])
    if lengths == "tensors":
        sizes = tuple(torch.tensor(s) for s in sizes)
    _assert_as_eager(lambda x, w: ctc(x, w, targets, *sizes), (x, w), [x, w], _bf16)
