"""In-place ATen ops that write tensor lists or several tensors: which arguments they write,
and the functional op that computes the new values.

The optimizers' multi-tensor and fused paths (`torch._foreach_add_(steps, 1)`,
`torch._foreach_lerp_(exp_avgs, grads, 0.1)`, `torch._fused_adamw_(params, grads, ...)`) and
GradScaler's `torch._amp_update_scale_` mutate every tensor of one or more list arguments and
return nothing (or the first of them). Their schemas mark the written arguments (`Tensor(a!)[]`),
and PyTorch's functionalization gives each a functional variant, the name without the trailing
underscore (`aten::_fused_adamw`), returning the new values of the written arguments in their
order. The tracer records that functional op and makes each new value the value of the tensor
the user holds (`fulmen.tracer.mutation`), so no write is lost.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _schema(name: str):
    """The schema of the first overload of ATen op `name`, or None when ATen has no such op."""
    packet = getattr(torch.ops.aten, name, None)
    overloads = packet.overloads() if packet is not None else ()
    return getattr(packet, overloads[0])._schema if overloads else None


def written_arguments(name: str) -> tuple[tuple[int, str], ...] | None:
    """(position, name) of each argument the in-place ATen op `name` (e.g. `_fused_adam_`)
    writes, from its first overload's schema; None when ATen has no such op."""
    schema = _schema(name)
    if schema is None:
        return None
    return tuple((position, argument.name) for position, argument in enumerate(schema.arguments)
                 if argument.alias_info is not None and argument.alias_info.is_write)


def functional_variant(name: str):
    """The functional ATen op of in-place op `name` (`aten._foreach_add` for `_foreach_add_`),
    or None."""
    return getattr(torch.ops.aten, name[:-1], None) if name.endswith("_") else None


# NOTE [fused optimizers write their grads only to unscale them]: `torch._fused_adamw_` (and
# `_fused_adam_`, `_fused_sgd_`, `_fused_adagrad_`) mark `grads` written, but the kernels write
# them only when given a `grad_scale` (GradScaler's unscaling); without one the functional
# variant returns the grads unchanged. A gradient with a stride-0 dimension (`p.grad =
# g.expand(...)`) recorded as written was refused at every call as a self-overlapping write
# (`input_aliasing`) eager never makes: such a gradient is not recorded written (the others
# are, so that `executors/torch/inplace_lists.py` still runs the whole op in place).
def unwritten_arguments(name: str, args: tuple, kwargs: dict) -> frozenset[str]:
    """The arguments the schema of in-place ATen op `name` marks written that this call leaves
    as they are (the NOTE above)."""
    if not name.startswith("_fused_"):
        return frozenset()
    schema = _schema(name)
    names = [argument.name for argument in schema.arguments]
    if "grad_scale" not in names or "grads" not in names:
        return frozenset()
    position = names.index("grad_scale")
    scale = args[position] if position < len(args) else kwargs.get("grad_scale")
    return frozenset(("grads",)) if scale is None else frozenset()


def overlaps_itself(tensor) -> bool:
    """Whether two elements of `tensor` (a proxy) lie at one memory location: a dimension of
    stride 0 and more than one element."""
    with torch._C.DisableTorchFunctionSubclass():
        strides = torch.Tensor.stride(tensor)
    return any(stride == 0 and isinstance(size, int) and size > 1
               for size, stride in zip(tensor.shape, strides))


def returns_nothing(name: str) -> bool:
    """Whether the in-place ATen op `name` returns None in Python (its schema returns
    nothing)."""
    return not _schema(name).returns


# NOTE [in-place foreach products round their scalar]: on CPU, `torch._foreach_mul_(xs, s)`
# (its Scalar and ScalarList overloads) multiplies each tensor by `s` rounded to the tensor's
# dtype (bfloat16: 0.9 -> 0.8984375), while the functional `_foreach_mul` (like `t.mul_(s)`)
# multiplies by `s` in float. Recorded as the functional op, SGD's momentum buffers (and AdamW's
# decayed weights) of bfloat16 or float16 parameters with `foreach=True` drifted from eager's by
# an ulp per step. Checked on PyTorch 2.13 for every in-place foreach op taking scalars: only
# `_foreach_mul_` rounds.
_ROUNDED = (torch.bfloat16, torch.float16)


def rounds_its_scalars(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether the in-place ATen op `name` on `args` is a `_foreach_mul_` by Python numbers of
    CPU tensors of a dtype the in-place kernel rounds them to (see the NOTE above)."""
    if name != "_foreach_mul_" or len(args) != 2 or kwargs:
        return False
    tensors, scalars = args
    numbers = scalars if isinstance(scalars, (list, tuple)) else [scalars]
    return all(isinstance(number, (int, float)) for number in numbers) and any(
        t.dtype in _ROUNDED and t.device.type == "cpu" for t in tensors)


def products_of_rounded_scalars(tensors, scalars) -> list[torch.Tensor]:
    """`torch._foreach_mul_(tensors, scalars)`'s new values as eager's CPU kernel computes
    them: each tensor times its scalar rounded to the tensor's dtype."""
    if not isinstance(scalars, (list, tuple)):
        scalars = [scalars] * len(tensors)
    return [torch.mul(t, t.new_full((), scalar))
            for t, scalar in zip(tensors, scalars, strict=True)]
