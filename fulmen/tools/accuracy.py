"""The float64 accuracy rule: is a compiled result as accurate as eager's?

Comparing a compiled result with eager's by a fixed tolerance is a guess: the right tolerance
depends on how much rounding the program does (a sum that cancels, a bfloat16 matmul), so
tests end up with hand-tuned `rtol`s. Instead, as PyTorch's own accuracy checker
(`torch._dynamo.utils.same` with `fp64_ref`) does, both results are measured against the same
program run in float64 (model and inputs cast to float64, same seed), the reference:

    error(x) = rms(x - reference)            (root mean square, computed in float64)
    accurate  <=>  error(compiled) <= k * max(error(eager), noise) + floor

- `k` = 2 for float32 results, 3 when bfloat16/float16 took part (`low_precision`): a
  compiler may round differently (fused kernels keep intermediates in float32, reductions
  reassociate), but not be much less accurate than eager;
- `noise` (optional, default 0): eager's typical error over a group of related results (all
  gradients of one call). A value that cancels to ~0 (a conv bias before batch norm) can have
  an eager error far below its terms' rounding by luck; the group's error stands in for it;
- `floor` = `RELATIVE_FLOOR[dtype] * rms(reference) + ABSOLUTE_FLOOR`: eager can be exact by
  luck (error 0: a value every step of which is representable), and then no difference at all
  would be allowed. fp32: 1e-5 relative, dynamo's `tol / 10` with its default `tol=1e-4`,
  made relative to the values' magnitude (a loss of 1e3 has a larger ulp than one of 1e-3);
  that is ~80 float32 ulps, far below any real miscompile (an off-by-one stride or a wrong
  op moves values by O(1) relative). Low precision: 1e-3 relative, an eighth of a bfloat16
  ulp. `ABSOLUTE_FLOOR` = 1e-7 for a reference that is itself ~0.

Besides values, the rule demands what no rounding explains: the same shape and dtype, the
same finite/non-finite positions, and exact equality for integer and bool results.

    >>> from fulmen.tools.accuracy import check_accuracy
    >>> result = check_accuracy(compiled_out, eager_out, float64_out)
    >>> assert result.ok, result.detail

`assert_accurate` applies the rule to pytrees of results and computes the float64 reference
lazily (only when some result is not within a tight tolerance of eager's), so tests pay for
the float64 run only when they need it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

MULTIPLIER = {torch.float32: 2.0, torch.float64: 2.0, torch.bfloat16: 3.0, torch.float16: 3.0}
RELATIVE_FLOOR = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-3,
                  torch.float16: 1e-3}
ABSOLUTE_FLOOR = 1e-7
LOW_PRECISION = (torch.float16, torch.bfloat16)
# results this close to eager's need no float64 reference (torch.testing's defaults)
TIGHT = {torch.float32: (1.3e-6, 1e-5), torch.float64: (1e-7, 1e-7),
         torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (1e-3, 1e-5)}


@dataclass
class Accuracy:
    """The rule applied to one result: `ok`, the two errors vs float64 and the bound."""

    ok: bool
    error: float = 0.0
    eager_error: float = 0.0
    bound: float = 0.0
    detail: str = ""

    def __bool__(self) -> bool:
        return self.ok


def rms(t: torch.Tensor) -> float:
    """Root mean square of `t` in float64 (0 for an empty tensor)."""
    return float(t.double().square().mean().sqrt()) if t.numel() else 0.0


def tight(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether `actual` equals eager's `expected` within torch.testing's default tolerance of
    `expected`'s dtype (exactly, for integers and bools); NaN matches NaN."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return False
    if not expected.is_floating_point():
        return torch.equal(actual, expected)
    rtol, atol = TIGHT.get(expected.dtype, (1.3e-6, 1e-5))
    return torch.allclose(actual.detach().double(), expected.detach().double(), rtol=rtol,
                          atol=atol, equal_nan=True)


def check_accuracy(actual: torch.Tensor, expected: torch.Tensor, reference: torch.Tensor | None,
                   low_precision: bool | None = None, noise: float = 0.0) -> Accuracy:
    """Apply the float64 rule (module docstring) to one tensor: `actual` (compiled), `expected`
    (eager) and `reference` (eager in float64). `low_precision` defaults to whether
    `expected` is float16/bfloat16; pass True when half precision took part upstream (autocast)
    even though the result is float32.

    Example:
        >>> check_accuracy(torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([1.0])).ok
        True
    """
    actual, expected = actual.detach(), expected.detach()
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return Accuracy(False, detail=f"metadata: {actual.dtype}{list(actual.shape)} vs eager's "
                                      f"{expected.dtype}{list(expected.shape)}")
    if not expected.is_floating_point():
        ok = torch.equal(actual, expected)
        return Accuracy(ok, detail="" if ok else "integer/bool values differ")
    if not torch.equal(torch.isfinite(actual), torch.isfinite(expected)):
        return Accuracy(False, float("inf"), detail="non-finite values at other positions")
    finite = torch.isfinite(expected)
    if not finite.all():  # inf/nan where eager has them: the same values there, then the rest
        same = torch.equal(actual[~finite].double().nan_to_num(),
                           expected[~finite].double().nan_to_num())
        if not same:
            return Accuracy(False, float("inf"), detail="non-finite values differ")
        actual, expected = actual[finite], expected[finite]
        reference = reference.detach()[finite] if reference is not None \
            and reference.shape == finite.shape else None
    if reference is None or reference.shape != expected.shape \
            or not torch.isfinite(reference).all():
        return Accuracy(False, detail="no finite float64 reference")
    if low_precision is None:
        low_precision = expected.dtype in LOW_PRECISION
    dtype = torch.bfloat16 if low_precision else expected.dtype
    reference = reference.detach().double()
    error, eager_error = rms(actual.double() - reference), rms(expected.double() - reference)
    bound = (MULTIPLIER.get(dtype, 2.0) * max(eager_error, noise)
             + RELATIVE_FLOOR.get(dtype, 1e-5) * rms(reference) + ABSOLUTE_FLOOR)
    return Accuracy(error <= bound, error, eager_error, bound,
                    f"rms error vs float64 {error:.3g}, eager's {eager_error:.3g}, "
                    f"bound {bound:.3g}")


def to_float64(tree):
    """`tree` (tensors, modules, containers) with floating tensors and modules cast to float64,
    gradients required where they were: the inputs of a reference run."""
    def widen(leaf):
        if isinstance(leaf, torch.nn.Module):
            return leaf.double()
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.detach().double().requires_grad_(leaf.requires_grad)
        return leaf

    return pytree.tree_map(widen, tree)


def assert_accurate(actual, expected, reference, low_precision: bool | None = None,
                    what: str = "result") -> None:
    """Raise AssertionError unless every tensor of the pytree `actual` is as accurate as eager's
    `expected` by the float64 rule. `reference` is the float64 pytree, or a function computing
    it, called only if some tensor is not `tight`ly equal to eager's. None leaves must match.

    Example:
        >>> assert_accurate(jmodel(x), model(x), lambda: copy.deepcopy(model).double()(x.double()))
    """
    act, exp = pytree.tree_leaves(actual), pytree.tree_leaves(expected)
    assert len(act) == len(exp), f"{what}: {len(act)} values, eager has {len(exp)}"
    refs = None
    for index, (a, e) in enumerate(zip(act, exp)):
        if not isinstance(e, torch.Tensor):
            assert a == e, f"{what}[{index}]: {a!r} vs eager's {e!r}"
            continue
        assert isinstance(a, torch.Tensor), f"{what}[{index}]: {type(a).__name__}, eager: tensor"
        if tight(a, e):
            continue
        if refs is None:
            refs = pytree.tree_leaves(reference() if callable(reference) else reference)
            assert len(refs) == len(exp), f"{what}: the float64 run has {len(refs)} values"
        result = check_accuracy(a, e, refs[index], low_precision)
        assert result.ok, (f"{what}[{index}] less accurate than eager: {result.detail} "
                           f"(max |compiled - eager| "
                           f"{float((a.detach().double() - e.detach().double()).abs().max()):.3g})")


__all__ = ["Accuracy", "assert_accurate", "check_accuracy", "rms", "tight", "to_float64"]
