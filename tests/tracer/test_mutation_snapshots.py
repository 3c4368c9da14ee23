"""Reads of a tensor before the traced code updates it in place see its old value, as in
eager: in a differentiated trace through the snapshot taken before the update (NOTE [mutation
and autodiff]), and through a reinterpreting view (`x.view(torch.int32)`) written in place."""

import pytest
import torch

import fulmen

_READS = {
    # the backward recomputes `x * x` and `sin(3x)` from the value x had before `add_`
    "recomputed": lambda x, w: (x * x) * w + (x * 3).sin() * w,
    # the backward reads x's old value itself (a float64 copy is recomputed, not kept)
    "widened": lambda x, w: x.double() * w.double(),
}


@pytest.mark.parametrize("read", sorted(_READS))
def test_gradients_read_an_updated_inputs_value_from_before_the_update(read):
    def fn(x, w):
        y = _READS[read](x, w)
        x.add_(1)
        return y

    torch.manual_seed(0)
    x, w = torch.randn(5), torch.randn(5, requires_grad=True)
    x_eager, w_eager = x.clone(), w.detach().clone().requires_grad_()
    fn(x_eager, w_eager).sum().backward()
    fulmen.jit(fn, executors=["torch"])(x, w).sum().backward()
    torch.testing.assert_close(w.grad, w_eager.grad)
    torch.testing.assert_close(x, x_eager)


def test_an_in_place_update_through_a_dtype_view_reaches_the_input():
    def fn(x):
        bits = x.view(torch.int32)
        bits.bitwise_xor_(-2147483648)  # flips the sign bit
        return x * 1

    x = torch.randn(4)
    x_eager = x.clone()
    expected = fn(x_eager)
    actual = fulmen.jit(fn, executors=["torch"])(x)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(x, x_eager)
