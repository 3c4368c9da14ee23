"""Translating a fusion region of prims into calls on an nvFuser `FusionDefinition`.

`translate(fd, region, inputs, outputs, dtypes)` emits, in order, `fd.define_tensor` for each
region input (contiguous, sizes symbolic except broadcast 1s: the runtime passes contiguous
tensors), `fd.define_scalar` for each Python number, one `fd.ops.<op>` call per prim (views
included) and `fd.add_output` per output. It works against anything with that API: the real
`nvfuser_direct.FusionDefinition` (or the older `nvfuser.FusionDefinition`), or the `Recorder`
below, whose record is the canonical form of the definition (two regions with equal records
build one fusion). `dtypes` maps torch dtypes to the frontend's `DataType` members.

`TRANSLATIONS` holds one small function per claimed prim; `CLAIMED` is its key set. Nothing here
imports nvFuser.
"""

from __future__ import annotations

from collections.abc import Callable
from numbers import Number

import torch

from fulmen.core import BoundSymbol

# torch dtype -> name of the nvFuser DataType member
DTYPES = {
    torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16",
    torch.float64: "Double", torch.int32: "Int32", torch.int64: "Int", torch.bool: "Bool",
}  # fmt: skip

# prims that map one-to-one onto an fd.ops function of the same arguments
_SAME_NAME = (
    "neg", "abs", "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sqrt", "rsqrt",
    "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh",
    "atanh", "erf", "erfc", "reciprocal", "floor", "ceil", "round", "trunc", "sign", "signbit",
    "isnan", "isinf", "isfinite", "logical_not", "bitwise_not", "add", "sub", "mul", "div",
    "remainder", "fmod", "pow", "atan2", "bitwise_and", "bitwise_or", "bitwise_xor", "eq", "ne",
    "lt", "le", "gt", "ge", "where",
)  # fmt: skip


class Recorder:
    """A stand-in `FusionDefinition` that records the calls: `record` is a tuple of
    `(function, args, kwargs)` with tensors and scalars named `T0, T1, ...`/`S0, ...`."""

    class _Ops:
        def __init__(self, recorder: Recorder) -> None:
            self._recorder = recorder

        def __getattr__(self, name: str) -> Callable:
            return lambda *args, **kwargs: self._recorder._call(f"ops.{name}", args, kwargs, "T")

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.ops = Recorder._Ops(self)
        self._count = 0

    def _call(self, name: str, args, kwargs, prefix: str):
        out = f"{prefix}{self._count}"
        self._count += 1
        self.calls.append((name, _freeze(args), tuple(sorted(kwargs.items())), out))
        return out

    def define_tensor(self, **kwargs):
        return self._call("define_tensor", (), {k: _freeze(v) for k, v in kwargs.items()}, "T")

    def define_scalar(self, value, dtype=None):
        return self._call("define_scalar", (value,), {"dtype": dtype}, "S")

    def add_output(self, value) -> None:
        self.calls.append(("add_output", (value,), (), None))

    @property
    def record(self) -> tuple:
        return tuple(self.calls)


def _freeze(value):
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


class DtypeNames:
    """A `dtypes` table that names members (`DataType.Float` -> "Float"): for recording."""

    def __getitem__(self, dtype: torch.dtype) -> str:
        return DTYPES[dtype]


def _elementwise(name: str):
    def emit(fd, env, bsym):
        return getattr(fd.ops, name)(*[env(a) for a in bsym.args])

    return emit


def _reduction(name: str):
    def emit(fd, env, bsym):
        a, dims = bsym.args[0], bsym.args[1]
        return getattr(fd.ops, name)(env(a), dims=list(dims), keepdim=False,
                                     dtype=env.dtype(bsym.output.dtype))

    return emit


def _var(fd, env, bsym):
    a, dims, correction = bsym.args
    return fd.ops.var(env(a), dims=list(dims), correction=correction, keepdim=False)


def _convert(fd, env, bsym):
    return fd.ops.cast(env(bsym.args[0]), dtype=env.dtype(bsym.args[1]))


def _broadcast_in_dim(fd, env, bsym):
    a, shape, dims = bsym.args
    return fd.ops.broadcast_in_dim(env(a), shape=list(shape), broadcast_dims=list(dims))


def _reshape(fd, env, bsym):
    return fd.ops.reshape(env(bsym.args[0]), new_shape=list(bsym.args[1]))


def _permute(fd, env, bsym):
    return fd.ops.permute(env(bsym.args[0]), dims=list(bsym.args[1]))


def _squeeze(fd, env, bsym):
    return fd.ops.squeeze(env(bsym.args[0]), dims=list(bsym.args[1]))


def _slice(fd, env, bsym):
    a, starts, ends, steps = bsym.args
    return fd.ops.slice(env(a), start_indices=list(starts), end_indices=list(ends),
                        strides=list(steps))


TRANSLATIONS: dict[str, Callable] = {
    **{name: _elementwise(name) for name in _SAME_NAME},
    "maximum": _elementwise("maximum"), "minimum": _elementwise("minimum"),
    **{prim: _reduction(op) for prim, op in (("sum", "sum"), ("prod", "prod"), ("amax", "max"),
                                             ("amin", "min"))},
    "var": _var, "convert_element_type": _convert, "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape, "permute": _permute, "squeeze": _squeeze, "slice": _slice,
}  # fmt: skip
CLAIMED = frozenset(TRANSLATIONS)


def claimable(bsym: BoundSymbol) -> bool:
    """Whether `bsym` is a prim this translation covers, on CUDA tensors of nvFuser dtypes."""
    if not bsym.sym.is_prim or bsym.kwargs or bsym.sym.name not in CLAIMED:
        return False
    tensors = [a for a in bsym.args if isinstance(a, torch.Tensor)]
    if not tensors or any(t.device.type != "cuda" or t.dtype not in DTYPES for t in tensors):
        return False
    if bsym.sym.name == "convert_element_type" and bsym.args[1] not in DTYPES:
        return False
    outputs = bsym.proxy_outputs
    return all(o.dtype in DTYPES for o in outputs)


class _Env:
    """Region values -> definition values: tensors by proxy name, numbers as scalars."""

    def __init__(self, fd, dtypes) -> None:
        self.fd, self.dtypes, self.values = fd, dtypes, {}

    def dtype(self, dtype: torch.dtype):
        return self.dtypes[dtype]

    def __call__(self, arg):
        if isinstance(arg, torch.Tensor):
            return self.values[arg.name]
        if isinstance(arg, bool):
            return self.fd.define_scalar(arg, dtype=self.dtypes[torch.bool])
        if isinstance(arg, int):
            return self.fd.define_scalar(arg, dtype=self.dtypes[torch.int64])
        if isinstance(arg, Number):
            return self.fd.define_scalar(float(arg), dtype=self.dtypes[torch.float64])
        return arg


def translate(fd, region: list[BoundSymbol], inputs: list, outputs: list, dtypes) -> None:
    """Emit the definition of `region` (statements in order) into `fd` (see module docstring).

    Raises:
        KeyError: if a statement's prim has no translation (`claimable` was not checked).
    """
    env = _Env(fd, dtypes)
    for proxy in inputs:
        env.values[proxy.name] = fd.define_tensor(
            shape=[1 if size == 1 else -1 for size in proxy.shape],
            contiguity=[None if size == 1 else True for size in proxy.shape],
            dtype=dtypes[proxy.dtype])
    for bsym in region:
        env.values[bsym.output.name] = TRANSLATIONS[bsym.sym.name](fd, env, bsym)
    for proxy in outputs:
        fd.add_output(env.values[proxy.name])


def canonical_form(region: list[BoundSymbol], inputs: list, outputs: list) -> tuple:
    """The recorded definition of `region`: equal for regions that build the same fusion."""
    recorder = Recorder()
    translate(recorder, region, inputs, outputs, DtypeNames())
    return recorder.record
