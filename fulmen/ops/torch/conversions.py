"""dtype conversions: `Tensor.to`, `.float()`/`.half()`/..., `type_as`, `Tensor.type`.

Where eager returns the very same tensor (the dtype already matches), the input proxy is
returned and nothing is recorded. Device moves, copies and memory formats the decompositions do
not cover raise `NotYetSupportedError`, so the torch op runs whole.
"""

from __future__ import annotations

import torch

from fulmen.core import NotYetSupportedError, Symbol
from fulmen.ops import prims
from fulmen.ops.torch.base import torch_op

T = torch.Tensor


def _unsupported(op: str, message: str) -> NotYetSupportedError:
    return NotYetSupportedError(message, op=f"ltorch.{op}")


def _convert(op: str, a: torch.Tensor, dtype: torch.dtype, memory_format=None) -> torch.Tensor:
    """`a` as `dtype`: `a` itself when it already has it (as eager returns the same tensor)."""
    if not isinstance(a, torch.Tensor) or not isinstance(dtype, torch.dtype):
        raise _unsupported(op, "needs a tensor and a dtype")
    if memory_format not in (None, torch.preserve_format) and not (
        memory_format == torch.contiguous_format and a.is_contiguous()
    ):
        raise _unsupported(op, f"memory_format={memory_format}")
    return a if a.dtype == dtype else prims.convert_element_type(a, dtype)


def _same_device(a: torch.Tensor, device) -> bool:
    """Whether moving `a` to `device` is no move at all (a device without an index is only
    known to be `a`'s for the CPU)."""
    if device is None:
        return True
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        return False
    if device == a.device:
        return True
    if device.index is None:
        return device.type == a.device.type and device.type == "cpu"
    return device == a.device


@torch_op(T.to)
def to(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """`Tensor.to` with a dtype, or with `self`'s own device; a device move or `copy=True` of
    an unchanged dtype runs as the opaque op."""
    kwargs = dict(kwargs)
    device = kwargs.pop("device", None)
    dtype = kwargs.pop("dtype", None)
    kwargs.pop("non_blocking", None)  # nothing moves, so nothing can be asynchronous
    copy = kwargs.pop("copy", False)
    memory_format = kwargs.pop("memory_format", None)
    if kwargs:
        raise _unsupported("to", f"arguments {sorted(kwargs)}")
    args = list(args)
    if args and isinstance(args[0], torch.Tensor):
        other = args.pop(0)
        device, dtype = other.device, other.dtype
    elif args and isinstance(args[0], torch.dtype):
        dtype = args.pop(0)
    elif args and (args[0] is None or isinstance(args[0], (str, torch.device, int))):
        device = args.pop(0)
        if args and (args[0] is None or isinstance(args[0], torch.dtype)):
            dtype = args.pop(0)
    if args and isinstance(args[0], bool):
        args.pop(0)  # non_blocking
    if args and isinstance(args[0], bool):
        copy = args.pop(0)
    if args:
        raise _unsupported("to", "unrecognised positional arguments")
    if not _same_device(self, device):
        raise _unsupported("to", "moves between devices")
    dtype = self.dtype if dtype is None else dtype
    if copy and dtype == self.dtype:
        raise _unsupported("to", "copy=True without a dtype change")
    return _convert("to", self, dtype, memory_format)


def _conversion_method(name: str, dtype: torch.dtype) -> Symbol:
    def decomposition(self, memory_format=torch.preserve_format):
        return _convert(name, self, dtype, memory_format)

    decomposition.__name__ = name
    decomposition.__doc__ = f"`self` as {dtype} (`self` itself if it already is)."
    return torch_op(getattr(T, name), name=name)(decomposition)


# Named with a trailing underscore where the method's name is a Python builtin.
float_ = _conversion_method("float", torch.float32)
double = _conversion_method("double", torch.float64)
half = _conversion_method("half", torch.float16)
bfloat16 = _conversion_method("bfloat16", torch.bfloat16)
int_ = _conversion_method("int", torch.int32)
long = _conversion_method("long", torch.int64)
short = _conversion_method("short", torch.int16)
bool_ = _conversion_method("bool", torch.bool)
byte = _conversion_method("byte", torch.uint8)
char = _conversion_method("char", torch.int8)
cfloat = _conversion_method("cfloat", torch.complex64)
cdouble = _conversion_method("cdouble", torch.complex128)


@torch_op(T.cpu)
def cpu(self: torch.Tensor, memory_format=torch.preserve_format) -> torch.Tensor:
    """`self` itself on the CPU (as eager returns the same tensor); a move is opaque."""
    if self.device.type != "cpu":
        raise _unsupported("cpu", "moves between devices")
    return _convert("cpu", self, self.dtype, memory_format)


@torch_op(T.type_as)
def type_as(self: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """`self` as `other`'s dtype (`self` itself if it already is); a device move is opaque."""
    if not isinstance(other, torch.Tensor) or other.device != self.device:
        raise _unsupported("type_as", "other on another device")
    return _convert("type_as", self, other.dtype)


# Legacy tensor type names, as `Tensor.type()` returns them (prefixed `torch.` or `torch.cuda.`).
_LEGACY_TYPE_NAMES = {
    torch.float32: "FloatTensor", torch.float64: "DoubleTensor", torch.float16: "HalfTensor",
    torch.bfloat16: "BFloat16Tensor", torch.int64: "LongTensor", torch.int32: "IntTensor",
    torch.int16: "ShortTensor", torch.int8: "CharTensor", torch.uint8: "ByteTensor",
    torch.bool: "BoolTensor", torch.complex64: "ComplexFloatTensor",
    torch.complex128: "ComplexDoubleTensor",
}  # fmt: skip
_LEGACY_TYPE_DTYPES = {name: dtype for dtype, name in _LEGACY_TYPE_NAMES.items()}


def _legacy_type_target(self: torch.Tensor, dtype) -> torch.dtype | None:
    """The dtype a `Tensor.type` argument names, when it keeps `self` on its device (CPU)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if self.device.type != "cpu":
        return None
    if isinstance(dtype, str):
        module, _, name = dtype.rpartition(".")
        return _LEGACY_TYPE_DTYPES.get(name) if module == "torch" else None
    if isinstance(getattr(dtype, "dtype", None), torch.dtype) and hasattr(dtype, "is_cuda"):
        return None if dtype.is_cuda else dtype.dtype  # a legacy class such as torch.FloatTensor
    return None


@torch_op(T.type, name="type")
def type_(self: torch.Tensor, dtype=None, non_blocking: bool = False, **kwargs):
    """`self.type(dtype)`: `self` converted (itself if the dtype is unchanged). `dtype` is a
    `torch.dtype`, or for CPU tensors a type name (`"torch.DoubleTensor"`) or legacy class.
    `self.type()` returns the type name (`"torch.FloatTensor"`, `"torch.cuda.FloatTensor"`)."""
    if kwargs:
        raise _unsupported("type", f"arguments {sorted(kwargs)}")
    if dtype is None:
        name = _LEGACY_TYPE_NAMES.get(self.dtype)
        if name is None or self.device.type not in ("cpu", "cuda"):
            raise _unsupported("type", f"no type name for {self.dtype} on {self.device}")
        return f"torch.{name}" if self.device.type == "cpu" else f"torch.cuda.{name}"
    target = _legacy_type_target(self, dtype)
    if target is None:
        raise _unsupported("type", f"type {dtype!r}")
    return _convert("type", self, target)
