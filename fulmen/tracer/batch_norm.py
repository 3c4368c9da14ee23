"""Training-mode batch norm with running statistics, functionalized.

`F.batch_norm(x, running_mean, running_var, training=True)` normalises with the batch
statistics and writes new running statistics into its arguments. The trace records the
normalisation and the new statistics as values, and `Functionalizer.mutate` makes them the
running statistics' new values (NOTE [batch norm running statistics]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fulmen.ops.opaque import BATCH_NORM_FUNCTIONAL
from fulmen.proxies import TensorProxy

_LABEL = "batch_norm (running statistics)"


def functionalize_batch_norm(functionalizer, func, values: dict, start: int):
    """Record `func` (`F.batch_norm` or `torch.batch_norm`, training, its arguments bound by
    name in `values`) functionally; update `running_mean`/`running_var` with eager's values
    and return the normalised output."""
    targets = (values["running_mean"], values["running_var"])
    values = {**values, "running_mean": None, "running_var": None}
    r_values = functionalizer.resolve_tree(values)
    x = r_values["input"]
    stats = [functionalizer.resolve(t) for t in targets if t is not None]
    if _kernel_takes(x, stats, r_values):
        return _kernel_call(functionalizer, func, r_values, targets, stats, start)
    with functionalizer.ctx.internal():
        if values["weight"] is None and stats and stats[0].dtype != x.dtype:
            r_values["weight"] = torch.ones(x.shape[1], dtype=stats[0].dtype,
                                            device=x.device)
        out = func(**r_values)
    if not stats:
        return out
    momentum = values["momentum"]
    dims = [0, *range(2, x.ndim)]
    with functionalizer.ctx.internal():
        detached = x.detach()
        if detached.dtype in (torch.float16, torch.bfloat16):
            detached = detached.float()
        mean = detached.mean(dims)
        count = x.numel() // x.shape[1]
        var = detached.var(dims, correction=1 if count > 1 else 0)
        for target, stat in zip(targets, (mean, var)):
            if target is None:
                continue
            current = functionalizer.resolve(target)
            new = current.to(stat.dtype) * (1 - momentum) + stat * momentum
            functionalizer.mutate(target, new.to(current.dtype), _LABEL, start)
    return out


def _kernel_takes(x: TensorProxy, stats: list, r_values: dict) -> bool:
    """Whether the call runs as eager's CPU kernel in one functional call: both running
    statistics given, on CPU, parameters of one dtype, the input's or float32 for a
    float16/bfloat16 input (eager's kernel refuses other combinations; they keep the general
    path)."""
    if len(stats) != 2 or x.device.type != "cpu":
        return False
    params = [t for t in (*stats, r_values["weight"], r_values["bias"]) if t is not None]
    if not all(isinstance(t, TensorProxy) for t in params):
        return False
    dtypes = {t.dtype for t in params}
    mixed = x.dtype in (torch.float16, torch.bfloat16) and dtypes == {torch.float32}
    return dtypes == {x.dtype} or mixed


def _kernel_call(functionalizer, func, r_values: dict, targets: tuple, stats: list,
                 start: int):
    """One call of `aten._native_batch_norm_legit_functional`, the functional form of the CPU
    kernel eager runs: its output, gradients and new running statistics are eager's to the
    bit."""
    x = r_values["input"]
    if func is F.batch_norm:  # F.batch_norm's own check, before the kernel
        F._verify_batch_size(x.size())
    with functionalizer.ctx.internal():
        out, _, _, mean, var = BATCH_NORM_FUNCTIONAL(
            x, r_values["weight"], r_values["bias"], *stats, True, r_values["momentum"],
            r_values["eps"])
        for target, stat in zip(targets, (mean, var)):
            functionalizer.mutate(target, stat.detach(), _LABEL, start)
    return out


# NOTE [batch norm running statistics]
# On CPU a training-mode batch norm with both running statistics is one call of
# `aten._native_batch_norm_legit_functional`: it runs the kernel eager's `F.batch_norm` runs
# (`batch_norm_cpu`) with the same arguments (so the same "mixed type" choice, below) and
# returns the new running statistics instead of writing them; its output goes on as the
# normalised value, so nothing is computed twice. Computing the statistics in the trace was not
# enough: the kernel sums in its own order, and for a float16/bfloat16 model (parameters in the
# input's dtype) it rounds the mean, the sum of squares and the momentum to that dtype on the
# way, so a statistic near a rounding boundary came out one ulp off eager's (float32 models
# too, by the summation order). The model fuzzer found it through BatchNorm(momentum=None),
# whose first step copies the batch statistics whole. Its meta kernel states cuda's dtypes for
# the statistics (`ops/opaque.py` `_batch_norm_functional_meta`).
#
# Elsewhere (cuda, where eager runs cuDNN's kernel; one running statistic alone) the statistics
# are computed in the trace: in float32 for a float16/bfloat16 input, rounded once, and the
# normalisation is `F.batch_norm` without running statistics. Eager normalises in float32
# ("mixed type") when a parameter's dtype differs from the input's: under autocast a float32
# BatchNorm gets bfloat16 activations, and with affine=False the only such parameters are the
# running statistics. Called without them, the kernel would see no parameter and normalise in
# bfloat16 (outputs and gradients a bfloat16 ulp off eager's), so a float32 weight of ones
# stands in for them (times one: exact).
