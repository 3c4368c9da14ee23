"""losses.py against eager (reductions, weights, ignore_index, label smoothing), with grads."""

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.transforms import decompose_to_prims

TARGET = torch.tensor([[0, 4, 2], [1, -100, 3], [-100, 2, 2], [4, 0, 1]])
WEIGHT = torch.rand(5) + 0.5

CASES = [
    dict(),
    dict(weight=WEIGHT, reduction="sum"),
    dict(reduction="none"),
    dict(label_smoothing=0.2),
    dict(weight=WEIGHT, label_smoothing=0.3),
    dict(weight=WEIGHT, label_smoothing=0.1, reduction="none"),
]


@pytest.mark.parametrize("mode", [[], [decompose_to_prims]])
@pytest.mark.parametrize("loss", ["cross_entropy", "nll_loss"])
@pytest.mark.parametrize("index", range(len(CASES)))
def test_class_losses(index, loss, mode):
    kwargs = CASES[index]
    if loss == "nll_loss" and "label_smoothing" in kwargs:
        pytest.skip("nll_loss has no label smoothing")
    fn = getattr(F, loss)
    x = torch.randn(4, 5, 3, requires_grad=True)
    jfn = fulmen.jit(lambda x: fn(x, TARGET, **kwargs), transforms=mode)
    expected, actual = fn(x, TARGET, **kwargs), jfn(x)
    torch.testing.assert_close(actual, expected)
    cotangent = torch.randn_like(expected)
    torch.testing.assert_close(torch.autograd.grad(actual, x, cotangent)[0],
                               torch.autograd.grad(expected, x, cotangent)[0])
    assert "opaque" not in str(fulmen.last_traces(jfn)[0])


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_mse_loss(reduction):
    x, y = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    jfn = fulmen.jit(lambda x, y: F.mse_loss(x, y, reduction=reduction),
                     transforms=[decompose_to_prims])
    expected, actual = F.mse_loss(x, y, reduction=reduction), jfn(x, y)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(torch.autograd.grad(actual.sum(), x)[0],
                               torch.autograd.grad(expected.sum(), x)[0])


SHAPES = {"unbatched": (5,), "rows": (6, 5), "rows and positions": (4, 5, 3)}


def _targets(shape, all_ignored: bool) -> torch.Tensor:
    target = torch.randint(0, 5, (shape[0],) + tuple(shape[2:]) if len(shape) > 1 else ())
    target[(0,) * target.ndim] = -100  # an ignored row (the only one when unbatched)
    if len(shape) > 1:
        target.view(-1)[-1] = 4  # the last class
    return torch.full_like(target, -100) if all_ignored else target


@pytest.mark.parametrize("executors", [["torch"], None], ids=["torch", "codegen"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("index", range(len(CASES)))
@pytest.mark.parametrize("loss", ["cross_entropy", "nll_loss"])
def test_class_loss_vjp_rules_match_eager(loss, index, shape, executors):
    # the composite rules (rules_losses.py): one row expression instead of the scatter of
    # take_along_dim's transpose; gradients of ignored rows are 0, and an all-ignored mean
    # (NaN loss) has zero gradients, as in eager
    kwargs = CASES[index]
    if loss == "nll_loss" and "label_smoothing" in kwargs:
        pytest.skip("nll_loss has no label smoothing")
    fn = getattr(F, loss)
    for all_ignored in (False, True):
        target = _targets(SHAPES[shape], all_ignored)
        x = torch.randn(SHAPES[shape], dtype=torch.float64, requires_grad=True)
        jfn = fulmen.jit(lambda x, t=target: fn(x, t, **_f64(kwargs)), executors=executors)
        expected, actual = fn(x, target, **_f64(kwargs)), jfn(x)
        torch.testing.assert_close(actual, expected, equal_nan=True)
        cotangent = torch.randn_like(expected)
        (want,) = torch.autograd.grad(expected, x, cotangent)
        (got,) = torch.autograd.grad(actual, x, cotangent)
        torch.testing.assert_close(got, want, equal_nan=True)
        backward = str(fulmen.last_backward_traces(jfn)[-1])
        assert "scatter" not in backward and "take_along_dim" not in backward


@pytest.mark.parametrize("index", range(len(CASES)))
@pytest.mark.parametrize("loss", ["cross_entropy", "nll_loss"])
def test_all_ignored_mean_has_zero_gradients_decomposed(loss, index):
    # eager: NaN loss (0 / 0) and zero gradients; the prims' division gave NaN gradients
    # (0 * (1 / 0)): a batch whose labels are all -100 poisoned the accumulated gradients
    kwargs = CASES[index]
    if loss == "nll_loss" and "label_smoothing" in kwargs:
        pytest.skip("nll_loss has no label smoothing")
    fn = getattr(F, loss)
    target = _targets(SHAPES["rows"], all_ignored=True)
    x = torch.randn(SHAPES["rows"], requires_grad=True)
    jfn = fulmen.jit(lambda x: fn(x, target, **kwargs), transforms=[decompose_to_prims])
    expected, actual = fn(x, target, **kwargs), jfn(x)
    torch.testing.assert_close(actual, expected, equal_nan=True)
    cotangent = torch.ones_like(expected)
    (want,) = torch.autograd.grad(expected, x, cotangent)
    (got,) = torch.autograd.grad(actual, x, cotangent)
    torch.testing.assert_close(got, want, equal_nan=True)


def _f64(kwargs: dict) -> dict:
    weight = kwargs.get("weight")
    return kwargs if weight is None else {**kwargs, "weight": weight.double()}


def test_cross_entropy_rule_in_half_precision():
    target = torch.tensor([1, -100, 4, 0])
    x = torch.randn(4, 5, dtype=torch.bfloat16, requires_grad=True)
    jfn = fulmen.jit(lambda x: F.cross_entropy(x, target, label_smoothing=0.1))
    expected, actual = F.cross_entropy(x, target, label_smoothing=0.1), jfn(x)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(torch.autograd.grad(actual, x)[0],
                               torch.autograd.grad(expected, x)[0])


def test_cross_entropy_backward_is_one_pass_over_saved_log_probabilities():
    # the saving forward (rules_losses.py): eager's _log_softmax and nll_loss in the forward,
    # the log-probabilities kept, and a backward without reductions (it recomputed log_softmax
    # from the logits: amax, two sums, two exps per element)
    target = torch.tensor([1, -100, 4, 0, 2, 2])
    x = torch.randn(6, 5, requires_grad=True)
    jfn = fulmen.jit(lambda x: F.cross_entropy(x, target))
    expected, actual = F.cross_entropy(x, target), jfn(x)
    assert torch.equal(actual, expected)  # eager's own kernels
    cotangent = torch.tensor(0.7)
    torch.testing.assert_close(torch.autograd.grad(actual, x, cotangent)[0],
                               torch.autograd.grad(expected, x, cotangent)[0])
    forward, backward = (_statements(traces(jfn)[-1])
                         for traces in (fulmen.last_traces, fulmen.last_backward_traces))
    assert "log_softmax" in forward and "nll_loss" in forward and "cross_entropy" not in forward
    for reduction in ("amax", "sum", "log_softmax"):
        assert reduction not in backward, reduction


def _statements(trace) -> str:
    return "\n".join(line for line in str(trace).splitlines()
                     if not line.lstrip().startswith("#"))


@pytest.mark.parametrize("loss", ["cross_entropy", "nll_loss"])
def test_rows_ignored_by_a_class_index_get_zero_gradients(loss):
    # ignore_index names a class and every row is ignored: eager's mean is 0 / 0 and its
    # gradient 0; the rule put w * -(g / W) = 0 * -inf = NaN at the ignored class's column
    fn = getattr(F, loss)
    target = torch.tensor([2, 2, 2])
    x = torch.randn(3, 4, requires_grad=True)
    jfn = fulmen.jit(lambda x: fn(x, target, ignore_index=2))
    expected, actual = fn(x, target, ignore_index=2), jfn(x)
    torch.testing.assert_close(actual, expected, equal_nan=True)
    (got,) = torch.autograd.grad(actual, x)
    (want,) = torch.autograd.grad(expected, x)
    assert torch.equal(got, want) and not got.isnan().any()
