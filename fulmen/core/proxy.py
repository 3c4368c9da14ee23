"""The proxy interface seen by core: anything with an SSA `name` and a printable type.

Concrete proxies (`TensorProxy`, ...) live in `fulmen.proxies`; core only needs to name them,
print their types and walk them inside nested arguments.
"""

from __future__ import annotations

from typing import Any

import torch


class Proxy:
    """Mixin for values that stand for run-time values while tracing.

    Subclasses set `name` (a valid Python identifier, unique within a trace) and implement
    `type_string()`, e.g. `'cpu f32[4, 4]'`.
    """

    name: str

    def type_string(self) -> str:
        raise NotImplementedError


class ObjectProxy(Proxy):
    """A Python object handed from one statement to another (for example the autograd graph an
    opaque op's forward keeps for its backward). `kind` is what its type comment says."""

    def __init__(self, name: str, kind: str = "object") -> None:
        self.name = name
        self.kind = kind

    def type_string(self) -> str:
        return self.kind

    def __repr__(self) -> str:
        return f"<ObjectProxy {self.name}: {self.kind}>"


def iter_proxies(value: Any) -> list[Proxy]:
    """Every proxy inside nested tuples, lists, dicts and slices, in order (a list: passes call
    this for every argument of every statement, and a list is several times faster than a
    recursive generator)."""
    out: list[Proxy] = []
    _collect(value, out)
    return out


def _collect(value: Any, out: list) -> None:
    if isinstance(value, Proxy):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, Proxy):
                out.append(item)
            elif isinstance(item, (tuple, list, dict, slice)):
                _collect(item, out)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, out)
    elif isinstance(value, slice):
        _collect((value.start, value.stop, value.step), out)


def map_proxies(fn, value: Any) -> Any:
    """Rebuild `value` with `fn(proxy)` in place of every proxy (containers copied)."""
    if isinstance(value, Proxy):
        return fn(value)
    if isinstance(value, tuple):
        items = [map_proxies(fn, item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [map_proxies(fn, item) for item in value]
    if isinstance(value, dict):
        return {key: map_proxies(fn, item) for key, item in value.items()}
    if isinstance(value, slice):
        return slice(*map_proxies(fn, (value.start, value.stop, value.step)))
    return value


_STRIDE = torch.Tensor.stride


def strides_of(tensor: torch.Tensor) -> tuple:
    """`tensor.stride()`, for fulmen's own reads of a proxy's (or a tensor's) strides: a
    `TensorProxy`'s `__torch_function__` answers a metadata read by this very call with its
    subclass disabled, so skipping that Python round trip gives the same tuple (thousands of
    reads per compiled Llama). A torch function mode (the tracer's checks of user code's
    reads) still sees the call; user code's `x.stride()` goes through both as before."""
    with torch._C.DisableTorchFunctionSubclass():
        return _STRIDE(tensor)
