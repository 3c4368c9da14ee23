"""Gradients of corner cases against eager autograd, each closing a gap that a generated
mutant of a VJP rule survived (session 42, tests/fuzz/mutant_table.py names the mutants).

Every test compares `.grad` of each input after `backward()` with eager's, including whether
it is None: a rule that drops a cotangent (returns None instead of zeros) leaves `.grad` None
where eager fills it with zeros.
"""

import torch

import fulmen


def _leaves(inputs):
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]


def assert_grads_like_eager(fn, *inputs, **close):
    """Run `fn` eagerly and jitted on copies of `inputs`, backward the sum of the output, and
    compare the outputs and every input's `.grad` (None included) with eager's."""
    eager_in, jit_in = _leaves(inputs), _leaves(inputs)
    expected, actual = fn(*eager_in), fulmen.jit(fn)(*jit_in)
    torch.testing.assert_close(actual, expected, **close)
    expected.sum().backward()
    actual.sum().backward()
    for i, (e, a) in enumerate(zip(eager_in, jit_in, strict=True)):
        assert (a.grad is None) == (e.grad is None), f"input {i}: .grad {a.grad} vs {e.grad}"
        if e.grad is not None:
            torch.testing.assert_close(a.grad, e.grad, msg=f"input {i}", **close)


def test_empty_slice_gives_zero_gradient():
    def fn(x, y):
        return x[:, 2:2].sum() + (y * 2).sum()

    assert_grads_like_eager(fn, torch.randn(3, 4, requires_grad=True),
                            torch.randn(3, requires_grad=True))
