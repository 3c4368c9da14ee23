"""Autocast scenarios a user writes, each compared with eager: outputs, dtypes, gradients.

A packed-sequence LSTM: fake tensors cannot run it, so it runs whole inside autocast.

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


def test_packed_sequence_lstm_under_autocast_is_eagers():
    # A packed-sequence LSTM reads `batch_sizes`' values, so the fake run that tells autocast's
    # casts cannot run it: the compiled call refused it inside autocast. It now runs whole
    # inside autocast (a graph break describes its outputs), bfloat16 as in eager.
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(4, 5, batch_first=True)

    def packed(x):
        sequence = torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor([5, 3]),
                                                           batch_first=True)
        out, (h, c) = lstm(sequence)
        return torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0], h, c

    x = torch.randn(2, 5, 4, requires_grad=True)
    _assert_as_eager(packed, (x,), [x, *lstm.parameters()], _bf16)
