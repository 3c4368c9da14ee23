"""How `fulmen.verify` compares a stage's results with eager's: per-dtype tolerances (those of
`torch.testing.assert_close`, never below one ulp), checked in float64, and the float64 rule of
`fulmen.accuracy` for results outside them (see `fulmen.tools.verify`).
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from fulmen.tools.accuracy import check_accuracy

_TOLERANCES = {  # (rtol, atol), as torch.testing.assert_close
    torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7), torch.complex64: (1.3e-6, 1e-5), torch.complex128: (1e-7, 1e-7),
}  # fmt: skip


def _tolerance(dtype, rtol, atol, scale=1.0) -> tuple[float, float]:
    """(rtol, atol) for `dtype`: the given values or the dtype's defaults, and an rtol of at
    least one ulp (`finfo.eps`) for floating dtypes; integers and bools compare exactly."""
    if not (dtype.is_floating_point or dtype.is_complex):
        return (rtol or 0.0, atol or 0.0)
    eps = torch.finfo(dtype).eps
    default = _TOLERANCES.get(dtype, (2 * eps, 1e-5))
    chosen_rtol = rtol if rtol is not None else default[0] * scale
    chosen_atol = atol if atol is not None else default[1] * scale
    return max(chosen_rtol, eps), chosen_atol


def _close(a: torch.Tensor, e: torch.Tensor, rtol: float, atol: float) -> tuple[bool, float]:
    """Whether |a - e| <= atol + rtol * |e| everywhere (NaN matching NaN, infinities matching),
    computed in float64 so low-precision dtypes do not round the check; and the worst error."""
    if not a.numel():
        return True, 0.0
    a64, e64 = a.detach().to(torch.complex128 if a.is_complex() else torch.float64), \
        e.detach().to(torch.complex128 if e.is_complex() else torch.float64)
    diff = (a64 - e64).abs()
    both_nan = torch.isnan(a64) & torch.isnan(e64)
    same = (a64 == e64) | both_nan  # equal infinities too
    diff = torch.where(same, 0, diff)
    worst = float(diff.nan_to_num(float("inf")).max())
    ok = bool(((diff <= atol + rtol * e64.abs()) | same).all())
    return ok, worst


def _as_accurate(a: torch.Tensor, e: torch.Tensor, reference) -> bool:
    """Whether `a` is as accurate as eager's `e` by the float64 rule (`fulmen.accuracy`):
    against the float64 `reference`, at most 2x eager's error (3x for float16/bfloat16) plus
    a small floor. False without a usable reference."""
    if not isinstance(reference, torch.Tensor) or not e.is_floating_point():
        return False
    return check_accuracy(a, e, reference).ok


def _compare(actual, expected, rtol, atol, scale=1.0, reference=None) -> tuple[bool, float, str]:
    """Compare two pytrees of tensors/values; return (ok, max error, detail). `reference`, when
    given, is `expected` computed in float64 (see the module docstring)."""
    act, exp = pytree.tree_leaves(actual), pytree.tree_leaves(expected)
    if len(act) != len(exp):
        return False, float("inf"), f"{len(act)} outputs, expected {len(exp)}"
    refs = pytree.tree_leaves(reference) if reference is not None else []
    if len(refs) != len(exp):
        refs = [None] * len(exp)
    worst = 0.0
    for index, (a, e) in enumerate(zip(act, exp)):
        if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor):
            if a.shape != e.shape or a.dtype != e.dtype:
                return False, float("inf"), f"output {index}: {a.dtype}{list(a.shape)} vs " \
                                            f"{e.dtype}{list(e.shape)}"
            r, t = _tolerance(e.dtype, rtol, atol, scale)
            ok, error = _close(a, e, r, t)
            worst = max(worst, error)
            if not ok and not _as_accurate(a, e, refs[index]):
                return False, worst, f"output {index} differs"
        elif (e is None) != (a is None) or (e is not None and not isinstance(e, torch.Tensor)
                                            and a != e):
            return False, float("inf"), f"output {index}: {a!r} vs {e!r}"
    return True, worst, ""
