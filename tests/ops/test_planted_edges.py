"""Op edges the planted-bug campaign of issue 18 (helper h39ver) found untested: each test
compares fulmen with eager (never with fulmen) on an input the decomposition's rarely taken
branch sees, and names the mutant of `tests/fuzz/mutant_table.py` it kills."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.transforms import decompose_to_prims


def _both(fn, *args, transforms=()):
    """(eager, fulmen) results of `fn(*args)`."""
    return fn(*args), fulmen.jit(fn, transforms=list(transforms))(*args)


@pytest.mark.parametrize("transforms", [[], [decompose_to_prims]], ids=["torch", "decomposed"])
@pytest.mark.parametrize("shape", [(3, 4, 5), (2, 3), (6,), (2, 3, 4, 5)])
@pytest.mark.parametrize("log", [False, True])
def test_softmax_without_dim_picks_eagers_dim(shape, log, transforms):
    """`F.softmax(x)` with no dim: eager picks dim 0 for rank 0, 1 and 3, else 1; decomposed,
    the prims must reduce that dim too (kills softmax_implicit_dim_rank3)."""
    op = F.log_softmax if log else F.softmax
    x = torch.randn(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected, actual = _both(lambda t: op(t), x, transforms=transforms)
    torch.testing.assert_close(actual, expected)


def test_dropout_of_probability_one_is_zero():
    """`F.dropout(x, 1.0)` while training is all zeros, with a zero gradient (kills
    dropout_p_one_keeps)."""
    x = torch.randn(4, 5, requires_grad=True)
    expected, actual = _both(lambda t: F.dropout(t, 1.0, training=True) + t, x)
    torch.testing.assert_close(actual, expected)
    g = torch.randn(4, 5)
    torch.testing.assert_close(torch.autograd.grad(actual, x, g)[0],
                               torch.autograd.grad(expected, x, g)[0])


@pytest.mark.parametrize("transforms", [[], [decompose_to_prims]], ids=["torch", "decomposed"])
def test_silu_gradient_matches_eager(transforms):
    """silu's gradient, as eager's kernel and decomposed to prims (the form a fusion executor
    runs): kills silu_backward_slope_sign."""
    x = (torch.randn(5, 7) * 4).requires_grad_()
    expected, actual = _both(F.silu, x, transforms=transforms)
    torch.testing.assert_close(actual, expected)
    g = torch.randn(5, 7)
    torch.testing.assert_close(torch.autograd.grad(actual, x, g)[0],
                               torch.autograd.grad(expected, x, g)[0])


@pytest.mark.parametrize("transforms", [[], [decompose_to_prims]], ids=["torch", "decomposed"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_label_smoothing_skips_a_custom_ignore_index(reduction, weighted, transforms):
    """cross_entropy with label smoothing and an `ignore_index` other than -100: ignored rows
    add nothing to the smoothing term nor to the mean's count, as in eager (kills
    ce_smoothing_ignore_default, ce_smoothing_ignored_not_masked)."""
    torch.manual_seed(0)
    logits = torch.randn(6, 5, requires_grad=True)
    target = torch.tensor([0, 2, 4, 2, 1, 3])
    weight = torch.rand(5) + 0.5 if weighted else None

    def fn(x):
        return F.cross_entropy(x, target, weight=weight, ignore_index=2, reduction=reduction,
                               label_smoothing=0.3)

    expected, actual = _both(fn, logits, transforms=transforms)
    torch.testing.assert_close(actual, expected)
    g = torch.randn_like(expected)
    torch.testing.assert_close(torch.autograd.grad(actual, logits, g)[0],
                               torch.autograd.grad(expected, logits, g)[0])


@pytest.mark.parametrize("value_dtype", [torch.float64, torch.int64, torch.bfloat16])
def test_masked_fill_with_a_tensor_of_another_dtype(value_dtype):
    """`masked_fill(mask, value)` with a 0-d tensor value of another dtype: the result keeps
    the input's dtype and the value is rounded to it (kills masked_fill_value_uncast)."""
    x = torch.randn(3, 4)
    mask = torch.rand(3, 4) > 0.5
    value = torch.tensor(1.0 / 3.0).to(value_dtype) if value_dtype != torch.int64 \
        else torch.tensor(7)
    expected, actual = _both(lambda t, m, v: t.masked_fill(m, v), x, mask, value)
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


@pytest.mark.parametrize("transforms", [[], [decompose_to_prims]], ids=["torch", "decomposed"])
@pytest.mark.parametrize("shape", [(2, 3, 5), (3, 3, 3), (2, 1, 4, 4)])
@pytest.mark.parametrize("diagonal", [0, 1, -1])
def test_tril_and_triu_of_a_batch(shape, diagonal, transforms):
    """tril/triu of batched matrices mask the last two dims of every matrix (kills
    triangle_keep_last_dims_off)."""
    x = torch.randn(shape, requires_grad=True)
    for op in (torch.tril, torch.triu):
        expected, actual = _both(lambda t, op=op: op(t, diagonal) * 2, x, transforms=transforms)
        torch.testing.assert_close(actual, expected)
        g = torch.randn(shape)
        torch.testing.assert_close(torch.autograd.grad(actual, x, g)[0],
                                   torch.autograd.grad(expected, x, g)[0])
