"""Gradients of prim rules where a planted slip (a floor for a trunc, a dropped mask, a bound
taken as open) changes only some inputs: each case names the inputs that tell, and compares
every input's gradient with eager's (torch executor; the rules are the same for any)."""

import pytest
import torch
import torch.nn.functional as F

import fulmen


def _grads(fn, inputs, jit: bool):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    f = fulmen.jit(fn, executors=["torch"]) if jit else fn
    out = f(*leaves)
    out.backward(torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape).to(out.dtype))
    return [t.grad for t in leaves]


def _check(fn, *inputs, exact: bool = False):
    expected, actual = _grads(fn, inputs, False), _grads(fn, inputs, True)
    for e, a in zip(expected, actual):
        if exact:
            assert a.dtype == e.dtype and torch.equal(a, e), (a, e)
        else:
            torch.testing.assert_close(a, e, equal_nan=True)


def _t(*values):
    return torch.tensor(values)


_BINARY = {
    # d/db of a ** b is 0 where a == 0 and b >= 0 (b == 0 included: 0 ** 0 is 1, flat in b)
    "pow zero base and exponent": (torch.pow, _t(0.0, 0.0, 2.0), _t(0.0, 1.0, 3.0)),
    # d/db of remainder(a, b) is -floor(a / b); of fmod(a, b), -trunc(a / b): they differ
    # where a / b is negative and not whole
    "remainder negative quotient": (torch.remainder, _t(-5.0, 5.0, -7.5), _t(3.0, -3.0, 2.0)),
    "fmod negative quotient": (torch.fmod, _t(-5.0, 5.0, -7.5), _t(3.0, -3.0, 2.0)),
    # copysign's magnitude gradient is sign(out / a), 0 (not NaN) where a is 0
    "copysign zero magnitude": (torch.copysign, _t(0.0, 1.0, -2.0), _t(-1.0, -1.0, 1.0)),
}


@pytest.mark.parametrize("case", sorted(_BINARY))
def test_binary_gradients_at_the_telling_inputs_are_eagers(case):
    fn, a, b = _BINARY[case]
    _check(fn, a, b)


def test_elu_at_zero_takes_the_negative_sides_slope():
    """elu_backward uses `alpha * exp(x)` for x <= 0: at 0 that is alpha, not 1."""
    _check(lambda x: F.elu(x, alpha=2.0), _t(0.0, -1.0, 1.0))


def test_flip_gradient_is_flipped_back():
    _check(lambda x: x.flip(-1) * torch.arange(4.0), torch.randn(2, 4))


def test_batched_square_matmul_gradients_keep_their_operand_order():
    """Square batches let a transposed or swapped product through a shape check."""
    torch.manual_seed(0)
    _check(torch.matmul, torch.randn(2, 3, 3), torch.randn(2, 3, 3))


def test_sigmoid_gradient_in_bfloat16_is_eagers_bit_for_bit():
    """Eager's CPU sigmoid backward computes bfloat16 in float32, rounding once."""
    torch.manual_seed(0)
    _check(torch.sigmoid, (torch.randn(64) * 3).to(torch.bfloat16), exact=True)


def test_minimum_halves_the_gradient_at_a_tie():
    _check(lambda x: torch.minimum(x, torch.zeros(3)), _t(0.0, -1.0, 1.0))


@pytest.mark.parametrize("keepdim", [False, True])
def test_max_and_min_along_a_negative_dim_send_the_gradient_to_the_index(keepdim):
    def fn(x):
        return torch.max(x, -1, keepdim=keepdim)[0] + torch.min(x, dim=-1, keepdim=keepdim)[0]

    _check(fn, _t(1.0, 5.0, 2.0, 7.0, 0.0, 3.0).view(2, 3))
