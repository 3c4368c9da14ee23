"""Passes keep what the program means, checked against eager on programs where a wrong pass
changes the answer (not by reading the pass's output trace):

- cse never merges two random draws, nor two calls that differ only in a keyword argument;
- the fusion partitioner emits regions in an order that keeps the draws of the global
  generator in program order and reads of an input before its in-place write-back;
- remat never recomputes a random op in the backward, even inside a checkpoint region (eager's
  checkpoint replays the generator state; a recomputed draw would be a new mask).
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fulmen
from fulmen.ops.torch import symbol_for
from fulmen.transforms import decompose_to_prims, transform

CODEGEN = ["codegen", "torch"]


def _same_under_seed(fn, *args, executors=None, seed=7):
    torch.manual_seed(seed)
    expected = fn(*args)
    jfn = fulmen.jit(fn, executors=executors) if executors else fulmen.jit(fn)
    torch.manual_seed(seed)
    actual = jfn(*args)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e)
    return jfn


def _two_draws(x):
    # intermediates: cse keeps every statement whose output is returned
    first, second = F.dropout(x, 0.5), F.dropout(x, 0.5)
    return torch.rand(4, 5) + x, torch.rand(4, 5) + x, first * 2, second * 3


@pytest.mark.parametrize("executors", [None, CODEGEN], ids=["default", "codegen"])
def test_random_draws_are_never_merged(executors):
    _same_under_seed(_two_draws, torch.randn(4, 5), executors=executors)


def _kwargs_only(x):
    pairs = [(torch.softmax(x, dim=0), torch.softmax(x, dim=1)),
             (x.sum(dim=0, keepdim=True), x.sum(dim=0, keepdim=False)),
             (F.gelu(x, approximate="tanh"), F.gelu(x)),
             (x.to(dtype=torch.float16), x.to(dtype=torch.bfloat16))]
    return [value * 1 for pair in pairs for value in pair]  # intermediates, as above


def test_calls_differing_only_in_keywords_are_not_merged():
    _same_under_seed(_kwargs_only, torch.randn(5, 5))


def _draws_in_order(x):
    a = torch.rand(6, 4)
    b = torch.randn(6, 4)
    c = torch.rand(6, 4)
    return a * x, b + x, c - x


@pytest.mark.usefixtures("codegen_eager")
def test_fused_program_draws_in_program_order():
    _same_under_seed(_draws_in_order, torch.randn(6, 4), executors=CODEGEN)


def _read_then_update(x, y):
    before = x * 2 + y  # reads x before the update
    x.add_(y)
    return before, x.sin()


@pytest.mark.usefixtures("codegen_eager")
def test_reads_of_an_input_stay_before_its_write_back():
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    jfn = fulmen.jit(_read_then_update, executors=CODEGEN)
    for _ in range(2):  # the second call runs the compiled kernels (and updates x again)
        x_eager = x.clone()
        expected = _read_then_update(x_eager, y)
        actual = jfn(x, y)
        for a, e in zip(actual, expected, strict=True):
            torch.testing.assert_close(a, e)
        torch.testing.assert_close(x, x_eager)


def test_a_dropout_of_a_fused_transposed_value_draws_eagers_mask(codegen_eager):
    """The kernel of `x.t() * 2` writes a row-major output where eager's is transposed, and
    dropout draws its mask in its input's memory order: with the kernel (not torch's fallback
    of a region not yet hot) the mask was another (NOTE [random draws read their input's
    layout] in `executors/claim.py`)."""
    x = torch.randn(6, 8)
    torch.manual_seed(11)
    expected = _dropout_of_strided(x)
    jfn = fulmen.jit(_dropout_of_strided, executors=CODEGEN)
    for _ in range(2):
        torch.manual_seed(11)
        actual = jfn(x)
        torch.testing.assert_close(actual, expected)
        assert [a.stride() for a in actual] == [e.stride() for e in expected]


class _CheckpointedDropout(torch.nn.Module):
    """Dropout of an activation (decomposed in the forward, so its mask is a value) and of a
    tensor that needs no gradient (kept whole) inside one checkpoint region."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def _block(self, h, noise):
        kept = F.dropout(noise, 0.4, training=True)  # noise needs no gradient
        return self.b(F.dropout(torch.tanh(self.a(h)), 0.3, training=True) * kept)

    def forward(self, x, noise):
        return checkpoint(self._block, x, noise, use_reentrant=False).sum()


def test_random_ops_in_a_checkpoint_region_are_not_redrawn_in_backward():
    torch.manual_seed(0)
    model = _CheckpointedDropout()
    x, noise = torch.randn(16, 8, requires_grad=True), torch.rand(16, 8) + 0.5
    grads = {}
    for name, run in (("eager", model), ("jit", fulmen.jit(model))):
        torch.manual_seed(3)
        loss = run(x, noise)
        grads[name] = (loss.detach(), *torch.autograd.grad(loss, [x, *model.parameters()]))
    for e, a in zip(grads["eager"], grads["jit"], strict=True):
        torch.testing.assert_close(a, e)


def _dropout_of_strided(x):
    # eager draws the mask into `empty_like(input)`: in the input's memory order
    return F.dropout(x.t() * 2, 0.5), F.dropout(x[:, ::2].exp(), 0.3)


@pytest.mark.parametrize("executors", [["torch"], CODEGEN], ids=["torch", "codegen"])
@pytest.mark.parametrize("decomposed", [False, True], ids=["whole", "prims"])
def test_a_dropout_mask_is_drawn_in_the_layout_of_its_input(executors, decomposed):
    """Same values and strides as eager: `bernoulli_` fills a permuted tensor in memory order,
    so a mask drawn contiguous holds other values. Decomposed to prims, the mask is the
    `bernoulli` prim's draw (an executor otherwise runs `F.dropout` whole)."""
    x = torch.randn(6, 8)
    torch.manual_seed(11)
    expected = _dropout_of_strided(x)
    jfn = fulmen.jit(_dropout_of_strided, executors=executors,
                     transforms=[decompose_to_prims] if decomposed else [])
    jfn(x)  # the first call traces
    torch.manual_seed(11)
    actual = jfn(x)
    torch.testing.assert_close(actual, expected)
    assert [a.stride() for a in actual] == [e.stride() for e in expected]


def _sin_plus_one(x):
    return torch.sin(x) + 1


def test_a_user_transform_runs_and_its_trace_is_what_runs():
    """`jit(transforms=[...])`: the user's pass runs before the executors claim, and the trace it
    returns is the one compiled (a pass rewriting sin to cos changes the answer)."""
    sin, cos = symbol_for(torch.sin), symbol_for(torch.cos)

    @transform("sin to cos")
    def sin_to_cos(trace):
        return trace.replace(bsyms=tuple(b.replace(sym=cos, subsymbols=()) if b.sym is sin else b
                                         for b in trace.bsyms))

    x = torch.randn(5)
    jfn = fulmen.jit(_sin_plus_one, executors=["torch"], transforms=[sin_to_cos])
    torch.testing.assert_close(jfn(x), torch.cos(x) + 1)
