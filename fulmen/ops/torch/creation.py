"""Creation torch-level ops: `zeros`, `ones`, `full`, `empty`, `arange`, `linspace`, the
`*_like` and `Tensor.new_*` families, `torch.tensor` of a Python scalar, and the RNG factories.

Calls with no tensor argument reach the tracer only for symbols tagged `"factory"` (see
`fulmen.tracer.factory_mode.FactoryMode`), so every op here carries that tag; on the `*_like` and
`new_*` ops it also routes calls on real tensors the traced code closed over, which then
become inputs of the trace instead of being evaluated once while tracing.

Defaults follow eager: dtype from `torch.get_default_dtype()` (or from the fill value, for
`full` and `tensor`), device from `torch.get_default_device()`. Arguments the decompositions do
not model (`requires_grad=True`, `pin_memory=True`, a non-strided layout, a tensor used as a
size or a value) raise `NotYetSupportedError`, and the exact torch op is recorded instead.

NOTE [empty]: `empty`, `empty_like` and `new_empty` decompose to a zero fill. Eager leaves the
memory uninitialised, so any content is correct; zeros make traces deterministic.

NOTE [RNG factories]: `rand`, `randn`, `randint`, `randperm`, `normal` and their `*_like`
forms are tagged `"factory"` so the tracer sees them, and their decompositions always raise
`NotYetSupportedError`: they are recorded as opaque ops, which the torch executor runs as the
torch call itself, drawing from torch's global generator exactly as eager does.
"""

from __future__ import annotations

import math
from numbers import Number

import torch

from fulmen.core import FulmenError, NotYetSupportedError
from fulmen.ops import prims
from fulmen.ops.torch.base import torch_op
from fulmen.ops.torch.shape import as_int

T = torch.Tensor
FACTORY = ("factory",)
LIKE = ("factory", "not_differentiable")  # made after another tensor: never requires grad


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def resolve_device(device) -> torch.device:
    """The device eager would allocate on for `device=` (None means the default device)."""
    if device is None:
        device = torch.get_default_device()
    if isinstance(device, int) and not isinstance(device, bool):
        raise NotYetSupportedError("a device given as an ordinal", op="factory")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def scalar_dtype(value) -> torch.dtype:
    """The dtype eager infers for a Python scalar (`torch.full`'s fill value, `torch.tensor`)."""
    if isinstance(value, bool):
        return torch.bool
    if isinstance(value, int):
        return torch.int64
    if isinstance(value, float):
        return torch.get_default_dtype()
    if isinstance(value, complex):
        default = torch.get_default_dtype()
        return {torch.float64: torch.complex128, torch.float16: torch.complex32}.get(
            default, torch.complex64
        )
    raise NotYetSupportedError(f"{type(value).__name__} value", op="factory")


def check_options(op: str, *, layout=None, requires_grad=False, pin_memory=False,
                  memory_format=None) -> None:
    """Raise `NotYetSupportedError` for factory options the decompositions do not model."""
    if layout not in (None, torch.strided):
        raise NotYetSupportedError(f"layout={layout}", op=op)
    if requires_grad:
        raise NotYetSupportedError("requires_grad=True on a created tensor", op=op)
    if pin_memory:
        raise NotYetSupportedError("pin_memory=True", op=op)
    if memory_format not in (None, torch.preserve_format, torch.contiguous_format):
        raise NotYetSupportedError(f"memory_format={memory_format}", op=op)


def size_arg(size: tuple, kwargs: dict, op: str) -> tuple[int, ...]:
    """A size given as varargs (`zeros(2, 3)`), one sequence or `torch.Size`, or `size=`."""
    if "size" in kwargs:
        if size:
            raise NotYetSupportedError("size given both positionally and by keyword", op=op)
        size = (kwargs.pop("size"),)
    if kwargs:
        raise NotYetSupportedError(f"unsupported keyword arguments {sorted(kwargs)}", op=op)
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    out = []
    for value in size:
        if isinstance(value, (torch.Tensor, bool)):
            raise NotYetSupportedError("a size given as a tensor or bool", op=op)
        value = as_int(value, op)  # a symbolic size stays symbolic (`operator.index` specialises)
        if value < 0:
            raise FulmenError(f"trying to create tensor with negative dimension {value}: "
                              f"{list(size)}", op=op)
        out.append(value)
    return tuple(out)


def number_arg(value, op: str) -> Number:
    """A Python number to fill with (a tensor value is not supported here)."""
    if isinstance(value, torch.Tensor) or not isinstance(value, Number):
        raise NotYetSupportedError(f"fill value of type {type(value).__name__}", op=op)
    return value


def filled(shape, value, dtype: torch.dtype, device: torch.device) -> T:
    """A tensor of `shape` filled with `value`."""
    return prims.full(tuple(shape), value, dtype, device)


# ---------------------------------------------------------------------------------------------
# Filled tensors
# ---------------------------------------------------------------------------------------------


def _constant_factory(op: str, value: int):
    def decomposition(*size, out=None, dtype=None, layout=None, device=None,
                      pin_memory=False, requires_grad=False, **kwargs):
        check_options(op, layout=layout, requires_grad=requires_grad, pin_memory=pin_memory,
                      memory_format=kwargs.pop("memory_format", None))
        shape = size_arg(size, kwargs, op)
        dtype = dtype or torch.get_default_dtype()
        return filled(shape, value, dtype, resolve_device(device))

    decomposition.__name__ = op
    decomposition.__doc__ = f"`torch.{op}(*size)`: a tensor of {value}s."
    return decomposition


zeros = torch_op(torch.zeros, tags=FACTORY)(_constant_factory("zeros", 0))
ones = torch_op(torch.ones, tags=FACTORY)(_constant_factory("ones", 1))
empty = torch_op(torch.empty, tags=FACTORY)(_constant_factory("empty", 0))  # NOTE [empty]


@torch_op(torch.full, tags=FACTORY)
def full(size, fill_value, *, out=None, dtype=None, layout=None, device=None, pin_memory=False,
         requires_grad=False):
    check_options("full", layout=layout, requires_grad=requires_grad, pin_memory=pin_memory)
    value = number_arg(fill_value, "full")
    shape = size_arg((size,), {}, "full")
    return filled(shape, value, dtype or scalar_dtype(value), resolve_device(device))


# ---------------------------------------------------------------------------------------------
# *_like and Tensor.new_*
# ---------------------------------------------------------------------------------------------


def _like(input, value, op, dtype, layout, device, requires_grad, memory_format) -> T:
    check_options(op, layout=layout, requires_grad=requires_grad, memory_format=memory_format)
    if not isinstance(input, torch.Tensor):
        raise NotYetSupportedError("input is not a tensor", op=op)
    return filled(input.shape, value, dtype or input.dtype,
                  input.device if device is None else resolve_device(device))


@torch_op(torch.zeros_like, tags=LIKE)
def zeros_like(input, *, dtype=None, layout=None, device=None, pin_memory=False,
               requires_grad=False, memory_format=torch.preserve_format):
    check_options("zeros_like", pin_memory=pin_memory)
    return _like(input, 0, "zeros_like", dtype, layout, device, requires_grad, memory_format)


@torch_op(torch.ones_like, tags=LIKE)
def ones_like(input, *, dtype=None, layout=None, device=None, pin_memory=False,
              requires_grad=False, memory_format=torch.preserve_format):
    check_options("ones_like", pin_memory=pin_memory)
    return _like(input, 1, "ones_like", dtype, layout, device, requires_grad, memory_format)


@torch_op(torch.empty_like, tags=LIKE)
def empty_like(input, *, dtype=None, layout=None, device=None, pin_memory=False,
               requires_grad=False, memory_format=torch.preserve_format):
    """Zero-filled (NOTE [empty])."""
    check_options("empty_like", pin_memory=pin_memory)
    return _like(input, 0, "empty_like", dtype, layout, device, requires_grad, memory_format)


@torch_op(torch.full_like, tags=LIKE)
def full_like(input, fill_value, *, dtype=None, layout=None, device=None, pin_memory=False,
              requires_grad=False, memory_format=torch.preserve_format):
    check_options("full_like", pin_memory=pin_memory)
    value = number_arg(fill_value, "full_like")
    return _like(input, value, "full_like", dtype, layout, device, requires_grad, memory_format)


def _new(self, size, kwargs, value, op) -> T:
    options = {key: kwargs.pop(key) for key in ("dtype", "device", "layout", "requires_grad",
                                                 "pin_memory") if key in kwargs}
    check_options(op, layout=options.get("layout"), requires_grad=options.get("requires_grad"),
                  pin_memory=options.get("pin_memory"))
    shape = size_arg(size, kwargs, op)
    dtype = options.get("dtype") or self.dtype
    device = options.get("device")
    return filled(shape, value, dtype, self.device if device is None else resolve_device(device))


@torch_op(T.new_zeros, tags=LIKE)
def new_zeros(self, *size, **kwargs):
    return _new(self, size, kwargs, 0, "new_zeros")


@torch_op(T.new_ones, tags=LIKE)
def new_ones(self, *size, **kwargs):
    return _new(self, size, kwargs, 1, "new_ones")


@torch_op(T.new_empty, tags=LIKE)
def new_empty(self, *size, **kwargs):
    """Zero-filled (NOTE [empty])."""
    return _new(self, size, kwargs, 0, "new_empty")


@torch_op(T.new_full, tags=LIKE)
def new_full(self, size, fill_value, *, dtype=None, device=None, layout=None,
             requires_grad=False, pin_memory=False):
    value = number_arg(fill_value, "new_full")
    kwargs = {"dtype": dtype, "device": device, "layout": layout,
              "requires_grad": requires_grad, "pin_memory": pin_memory}
    return _new(self, (size,), kwargs, value, "new_full")


@torch_op(torch.tensor, tags=FACTORY)
def tensor(data, *, dtype=None, device=None, requires_grad=False, pin_memory=False):
    """A tensor of a Python scalar; other data (lists, arrays) is recorded as the torch op."""
    check_options("tensor", requires_grad=requires_grad, pin_memory=pin_memory)
    if isinstance(data, torch.Tensor) or not isinstance(data, (bool, int, float, complex)):
        raise NotYetSupportedError(f"torch.tensor of {type(data).__name__}", op="tensor")
    return filled((), data, dtype or scalar_dtype(data), resolve_device(device))


# ---------------------------------------------------------------------------------------------
# Ranges
# ---------------------------------------------------------------------------------------------


def _range_number(value, op: str) -> int | float:
    if isinstance(value, (torch.Tensor, bool)) or not isinstance(value, (int, float)):
        raise NotYetSupportedError(f"a {type(value).__name__} bound", op=op)
    return value


def _trunc_div(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


@torch_op(torch.arange, tags=FACTORY)
def arange(start=0, end=None, step=1, *, out=None, dtype=None, layout=None, device=None,
           pin_memory=False, requires_grad=False):
    """`torch.arange` in its three forms: `(end)`, `(start, end)`, `(start, end, step)`."""
    check_options("arange", layout=layout, requires_grad=requires_grad, pin_memory=pin_memory)
    if end is None:
        start, end = 0, start
    start, end, step = (_range_number(v, "arange") for v in (start, end, step))
    is_float = any(isinstance(v, float) for v in (start, end, step))
    if dtype is None:
        dtype = torch.get_default_dtype() if is_float else torch.int64
    if dtype.is_complex or dtype == torch.bool:
        raise NotYetSupportedError(f"arange of dtype {dtype}", op="arange")
    if not dtype.is_floating_point and is_float:
        raise NotYetSupportedError("float bounds with an integer dtype", op="arange")
    if not all(math.isfinite(v) for v in (start, end, step)):
        raise FulmenError("unsupported range: bounds must be finite", op="arange")
    if step == 0:
        raise FulmenError("step must be nonzero", op="arange")
    if (step > 0 and end < start) or (step < 0 and end > start):
        raise FulmenError("upper bound and larger bound inconsistent with step sign", op="arange")
    if dtype == torch.int64:  # eager's integer formula
        sign = 1 if step > 0 else -1
        length = _trunc_div(end - start + step - sign, step)
    else:
        length = math.ceil((float(end) - float(start)) / float(step))
    return prims.iota(length, start, step, dtype, resolve_device(device))


@torch_op(torch.linspace, tags=FACTORY)
def linspace(start, end, steps, *, out=None, dtype=None, layout=None, device=None,
             pin_memory=False, requires_grad=False):
    """`steps` evenly spaced floats from `start` to `end`, computed in the output dtype with
    eager's two-sided formula (the second half counts back from `end`)."""
    check_options("linspace", layout=layout, requires_grad=requires_grad, pin_memory=pin_memory)
    start, end = _range_number(start, "linspace"), _range_number(end, "linspace")
    steps = as_int(steps, "linspace")
    if steps < 0:
        raise FulmenError("number of steps must be non-negative", op="linspace")
    dtype = dtype or torch.get_default_dtype()
    if not dtype.is_floating_point:
        raise NotYetSupportedError(f"linspace of dtype {dtype}", op="linspace")
    device = resolve_device(device)
    if steps <= 1:
        return prims.full((steps,), start, dtype, device)
    step = (float(end) - float(start)) / (steps - 1)
    index = prims.iota(steps, 0, 1, dtype, device)
    low = prims.add(prims.mul(index, step), start)
    high = prims.sub(end, prims.mul(prims.sub(steps - 1, index), step))
    return prims.where(prims.lt(index, steps // 2), low, high)


# ---------------------------------------------------------------------------------------------
# RNG factories (NOTE [RNG factories])
# ---------------------------------------------------------------------------------------------


def _random_factory(op: str):
    def decomposition(*args, **kwargs):
        raise NotYetSupportedError("random numbers come from torch's own generator", op=op)

    decomposition.__name__ = op
    decomposition.__doc__ = f"`torch.{op}`: always recorded as the torch op (NOTE [RNG factories])."
    return decomposition


rand = torch_op(torch.rand, tags=FACTORY)(_random_factory("rand"))
randn = torch_op(torch.randn, tags=FACTORY)(_random_factory("randn"))
randint = torch_op(torch.randint, tags=FACTORY)(_random_factory("randint"))
randperm = torch_op(torch.randperm, tags=FACTORY)(_random_factory("randperm"))
normal = torch_op(torch.normal, tags=FACTORY)(_random_factory("normal"))
rand_like = torch_op(torch.rand_like, tags=LIKE)(_random_factory("rand_like"))
randn_like = torch_op(torch.randn_like, tags=LIKE)(_random_factory("randn_like"))
randint_like = torch_op(torch.randint_like, tags=LIKE)(_random_factory("randint_like"))
